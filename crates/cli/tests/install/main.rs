//! The install path: the deploy files, the release tarball and the image, and the alert rules: one binary, a module per part.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

#[path = "../common/mod.rs"]
mod common;

mod alert_rules;
mod deploy;
