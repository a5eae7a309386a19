//! What the operator sees and does: the admin API, what refusals tell, alerts, OpenTelemetry export: one binary, a module per part.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod admin;
mod alerts;
mod operator;
mod otlp;
