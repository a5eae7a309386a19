//! # tollgate-core
//!
//! The admission controls of Tollgate, pure: six layered controls in a fixed order, a
//! reserve-then-settle budget ledger, leases that expire, and the [`Store`] trait with an
//! in-memory implementation. No IO, no async runtime, no clock reads in the decision logic.
//!
//! ```
//! use tollgate_core::{Identity, Dimension, ManualClock, MemoryStore, Policy, RequestFacts, Usage};
//! use tollgate_core::{plan, Decision, Reason};
//!
//! let policy = Policy::from_toml(r#"
//!     [[scopes]]
//!     key = "user"
//!     requests = { limit = 5, window = "1m" }
//!     total_tokens = 150
//!     concurrency = { limit = 2, lease_ttl = "5m" }
//!     budget = { tokens = 300, period = "day" }
//! "#).unwrap();
//! let clock = ManualClock::new(0);
//! let store = MemoryStore::with_clock(clock.clone());
//! let facts = |id: &str, input, max| RequestFacts {
//!     request_id: id.into(),
//!     identity: Identity::default().with(Dimension::User, "alice"),
//!     input_tokens: input,
//!     max_output_tokens: Some(max),
//!     ..RequestFacts::default()
//! };
//!
//! // Admitted: 100 tokens reserved (input + max output), one lease taken.
//! let Decision::Admit(a) = store.admit_sync(&plan(&policy, &facts("r1", 50, 50)).unwrap()).unwrap()
//! else { panic!() };
//! assert_eq!(a.max_output_tokens, 50);
//! // 80 + 80 = 160 is over the total-token limit of 150, though each half is small.
//! let d = store.admit_sync(&plan(&policy, &facts("r2", 80, 80)).unwrap()).unwrap();
//! assert_eq!(d.deny().unwrap().reason, Reason::TotalTokenLimit);
//! // Settlement replaces the reservation with input + actual output; a duplicate is a no-op.
//! store.settle_sync("r1", Usage { input_tokens: 50, output_tokens: 10, ..Usage::default() }).unwrap();
//! ```
//!
//! See `docs/design.md` in the repository for the invariants and how the Redis store mirrors
//! this one.

pub mod clock;
pub mod controls;
pub mod decision;
pub mod exchange;
pub mod keeper;
pub mod ledger;
pub mod memory;
pub mod pipeline;
pub mod policy;
pub mod prices;
pub mod record;
pub mod replay;
pub mod rule;
pub mod scope;
pub mod store;
pub mod whatif;

pub use clock::{Clock, ManualClock, Millis, SharedClock, SystemClock};
pub use decision::{Admitted, Decision, Deny, Quota, Reason};
pub use exchange::SliceSource;
pub use keeper::{ExpiryTag, Keeper, Loss};
pub use ledger::{Metered, Period, Usage};
pub use memory::MemoryStore;
pub use pipeline::{
    KillTargets, Plan, PlanError, RequestFacts, plan, plans, rate_plan, shadow_plan,
};
pub use policy::{Policy, PolicyError, Unit};
pub use scope::{Dimension, Identity, IpPrefix, ScopeKey};
pub use store::{
    Ending, Expiry, ExpiryCharge, Finish, KeyClaim, KeyUse, Renewal, ScopeUsage, ShadowOutcome,
    Store, StoreError, StoreState,
};
