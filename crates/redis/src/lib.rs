//! # tollgate-redis
//!
//! The [`Store`] over Redis or Valkey. Every admission is **one** atomic step in a Lua script, so
//! any number of stateless gateway instances sharing one Redis can never overshoot a budget or a
//! concurrency limit together: the check and the reservation happen together on the server.
//!
//! - Admissions and settlements that are waiting at the same moment travel in one script call
//!   (`batch.lua`), each applied as its own atomic transition, in order. One caller alone gets
//!   a call of its own, made from its own task; under load the fixed cost of a call is shared,
//!   and a call reads and writes each scope key its items share once (see `docs/redis.md`).
//! - The scripts are one library of Redis functions, assembled at build time from `src/lua/`
//!   (one file per stateful control, each tied to its twin in `tollgate_core::controls` by
//!   tests), loaded once and again whenever the server lacks it. Time is Redis `TIME`, clamped
//!   so that it never goes back (tests may pass a manual clock). Integer arithmetic only.
//! - Every call has a timeout; a store that cannot be reached answers
//!   [`StoreError::Unavailable`] (the gateway fails closed on it unless told otherwise), and the
//!   connection reconnects by itself.
//! - With `RedisConfig::shards` > 1, scopes spread over cluster slots and a request spanning
//!   several shards is admitted shard by shard, with roll-back (`docs/redis.md`).
//!
//! Key layout (prefix `P`, default `tollgate`), documented in `docs/redis.md`:
//! `P:r:<scope>` rate window, `P:l:<scope>` leases (sorted set by expiry), `P:b:<scope>`
//! budget periods, `P:ts:<request>` the ticket (a msgpack string) and, once the request has
//! ended, how it ended; `P:x` ticket expiry index, `P:kill` kill switch, `P:clock` the store's
//! last time.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tollgate_core::StoreError> {
//! use tollgate_redis::{RedisConfig, RedisStore};
//! let store = RedisStore::connect(RedisConfig::new("redis://127.0.0.1:6379/")).await?;
//! # let _ = store; Ok(()) }
//! ```

mod batch;
mod books;
mod config;
mod conn;
/// The named contract between the encoder and the scripts: every argument list's layout, one
/// table that the encoder writes by and the build script substitutes into the Lua sources.
pub mod contract;
mod decode;
mod encode;
mod failover;
mod history;
mod issued;
mod keeper;
mod keys;
mod mark;
mod marker;
mod sharded;
mod shards;
mod slices;
mod store;
mod strs;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests;

pub use batch::batch_invocation;
pub use books::ExpiryTag;
pub use config::{RedisConfig, redacted};
pub use decode::{ADMIT_REPLIES, FINISH_REPLIES, OTHER_REPLIES, RENEW_REPLIES, SHADOW_REPLIES};
pub use encode::{Invocation, Strs, admit_invocation};
pub use issued::{KeyPut, KeyWrite, RECORD_REPLIES, RecordSet};
pub use keys::KEY_REPLIES;
pub use mark::SCHEMA;
pub use slices::{SLICE_REPLIES, SLICE_TICKETS, slice_invocation};
pub use store::RedisStore;
pub use tollgate_core::Loss;
