//! The Redis store against real servers: the conformance suite on one node, on slices, on shards and on a cluster, the Lua controls against their Rust twins, and TLS: one binary, a module per part.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

mod cluster;
mod conformance;
mod sharded;
mod sliced;
mod tls;
mod twins;
