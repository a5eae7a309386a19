//! What is charged: what the upstream bills that the gateway never sees, fees besides token prices, the spend ledger through a store that forgets, the provider's own limits, degrading to a cheaper model, and reservations for code that calls the provider itself: one binary, a module per part.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod books;
mod degrade;
mod fees;
mod provider_limits;
mod reservations;
mod unseen;
