//! Keys and limits set at run time, on instances sharing a store: issued keys, their life under
//! random interleavings, and the run-time limits; a module per part.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod issued;
mod lifecycle;
mod overrides;
