//! # tollgate-gateway
//!
//! An OpenAI-compatible reverse proxy that enforces Tollgate's six controls before any upstream
//! work: identity first, the body read within a size limit, the input counted (bounded), one
//! atomic admission, the request forwarded with its output cap set, settlement from the
//! upstream's reported usage (or the counted stream), and the lease released on completion,
//! error or disconnect.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let config = tollgate_gateway::GatewayConfig::from_toml(r#"
//!     [[upstreams]]
//!     name = "local"
//!     base_url = "http://127.0.0.1:9000"
//!     models = ["gpt-4o"]
//!     [[keys]]
//!     hash = "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
//!     tenant = "acme"
//!     [[policy.scopes]]
//!     key = "tenant"
//!     budget = { tokens = 100000, period = "day" }
//! "#).expect("valid");
//! let listener = tokio::net::TcpListener::bind(config.listen).await?;
//! tollgate_gateway::serve(config, listener, std::future::pending()).await
//! # }
//! ```

// `ApiError` is built at most once per request, at the edge: boxing it would buy nothing.
#![allow(clippy::result_large_err)]

pub mod admin;
pub mod admission;
pub mod alerts;
pub mod books;
pub mod config;
pub mod conn;
pub mod contexts;
pub mod counting;
pub mod dialect;
pub mod faults;
pub mod gateway;
pub(crate) mod key_copy;
pub mod keyring;
pub mod keys;
pub mod limits;
pub mod memo;
pub mod otel;
pub mod overrides;
mod path;
mod probes;
pub(crate) mod provider;
pub(crate) mod queue;
pub mod records;
pub mod reservations;
pub(crate) mod reserved;
pub mod respond;
pub mod scrape;
pub mod server;
pub mod sse;
pub mod store;
pub mod telemetry;
pub(crate) mod ticket;
pub mod upstream;
pub mod upstream_tools;
mod usage;
pub mod watch;
pub mod words;

pub use config::{GatewayConfig, hash_key};
pub use gateway::{Gateway, Shared};
pub use path::fuzz_agents;
pub use path::intake::{MAX_OPERATION_BYTES, MAX_USER_BYTES};
pub use provider::fuzz_provider;
pub use server::{Bound, open_books, prepare, router, serve, serve_bound, serve_with};
pub use store::{start_store, start_store_with_warnings};
