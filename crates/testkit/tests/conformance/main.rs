//! The ledger's invariants and the conformance suite on the memory store and on slices, and the shape of requests: one binary, a module per part.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

mod ledger_props;
mod memory_conformance;
mod shape;
mod sliced_conformance;
