//! The gateway end to end, over real sockets, against the upstream simulator: one binary, a
//! module per part (admission, concurrency, operations, streams).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod admission;
mod concurrency;
mod operations;
mod streams;
