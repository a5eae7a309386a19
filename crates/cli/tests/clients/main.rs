//! The official OpenAI and Anthropic SDKs and the TypeScript client against the gateway: one binary, a module per client.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

#[path = "../common/mod.rs"]
mod common;

mod sdk;
mod ts_client;
