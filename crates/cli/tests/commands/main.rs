//! The binary's commands that run and end: check, prices, spend, whatif, replay, admin and the demo: one binary, a module per command.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

#[path = "../common/mod.rs"]
mod common;

mod admin_cli;
mod check;
mod demo;
mod prices;
mod replay;
mod spend;
mod whatif;
