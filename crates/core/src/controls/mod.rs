//! The six controls, one module each, in the order a request passes them: request rate →
//! input tokens → output-token cap → total tokens (the three in [`tokens`]) → concurrency →
//! budget, then the agent controls that come after the budget ([`tool_calls`], [`loops`]).
//!
//! A module holds the check a [`crate::pipeline::Plan`] carries for it, how that check is made
//! from a rule, its check against a scope's state at an instant, and the reason it refuses
//! with. Every store decides with these functions: the memory store, and through it the slice
//! book; the Redis scripts have one Lua twin per stateful control (`crates/redis/src/lua/
//! controls/`), tied to these by tests that run both on the same cases.
//!
//! The checks are pure: the state goes in, the verdict comes out, and time is an argument.

pub mod budget;
pub mod concurrency;
pub mod loops;
pub mod rate;
pub mod tokens;
pub mod tool_calls;

pub use budget::BudgetCheck;
pub use concurrency::ConcurrencyCheck;
pub use rate::RateCheck;

/// The reasons of the controls, in the order a request passes them (the token controls'
/// three in theirs): a refusal names the first control that refuses.
pub const ORDER: [crate::decision::Reason; 8] = crate::decision::Reason::ALL;
