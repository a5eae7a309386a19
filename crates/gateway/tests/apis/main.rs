//! The APIs the gateway speaks, each from the outside: Anthropic's messages, OpenAI's Responses, the router without sockets, HTTPS upstreams, the tower layer, and one admission for the proxy and the layer: one binary, a module per part.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod anthropic;
mod layer;
mod one_admission;
mod responses;
mod router;
mod tls;
