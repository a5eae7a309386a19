//! tollgate serve as a process: its log, its drain on SIGTERM, its status page in a browser, several processes on one Redis, and the Redis store across processes: one binary, a module per part.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

#[path = "../common/mod.rs"]
mod common;

mod drain;
mod logs;
mod multi_instance;
mod redis_store;
mod status_page;
