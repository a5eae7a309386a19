//! How requests are admitted: /v1/limits, priority classes and the paused-time suites, idempotency keys, shadow rules, agent operations and loops: one binary, a module per part.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod agents;
mod classes;
mod idempotency;
mod limits;
mod operations;
mod paused_time;
mod shadow;
