//! Test support for Tollgate (not published): the store conformance suite that every [`Store`]
//! must pass, and helpers shared by test binaries.
//!
//! The suite is a table of async cases over a [`Harness`]; [`conformance_tests!`] expands to one
//! `#[tokio::test]` per case, so every store lists the same case names.
//!
//! [`Store`]: tollgate_core::Store

// This crate is test code: its assertions panic by design.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod conformance;
pub mod failover;
pub mod faults;
pub mod paused;
pub mod pg_server;
pub mod redis_server;
pub mod wait;
pub use tollgate_sim as sim;

use tollgate_core::{Dimension, Identity, Keeper, ManualClock, Policy, RequestFacts, Store};

/// Makes fresh, isolated stores for the conformance suite.
pub trait Harness: Send + Sync {
    /// The store under test.
    type S: Store + Keeper;
    /// A clean store whose time is `clock` (a Redis store passes it as the script's time).
    fn store(&self, clock: ManualClock) -> impl std::future::Future<Output = Self::S> + Send;
}

/// 2026-01-01T00:00:00Z: a day, month and every window boundary in the suite.
pub const T0: u64 = 1_767_225_600_000;

/// Parses a policy or fails the test with its error.
pub fn policy(text: &str) -> Policy {
    Policy::from_toml(text).unwrap_or_else(|e| panic!("test policy invalid: {e}"))
}

/// Facts of a request by `user` with declared tokens.
pub fn facts(id: &str, user: &str, input: u64, max_output: u64) -> RequestFacts {
    RequestFacts {
        request_id: id.to_owned(),
        identity: Identity::default()
            .with(Dimension::User, user)
            .with(Dimension::Tenant, "acme")
            .with(Dimension::Model, "gpt-4o"),
        input_tokens: input,
        max_output_tokens: Some(max_output),
        ..RequestFacts::default()
    }
}
