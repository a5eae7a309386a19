//! The hostile suites: one binary, a module per attacker (the admin API's callers, the books,
//! clients, keys, the store, upstreams).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod admin;
mod books;
mod clients;
mod keys;
mod store;
mod upstreams;
