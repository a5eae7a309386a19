//! The store: one atomic transition per call. The algorithm is in [`crate::pipeline`] and
//! [`crate::ledger`]; a store applies a [`Plan`] to its state in one step (a mutex for memory,
//! one Lua script for Redis).

use std::future::Future;

use crate::clock::Millis;
use crate::decision::{Decision, Deny};
use crate::ledger::Usage;
use crate::pipeline::Plan;

/// A store could not be reached or answered nonsense. Never one of the six reasons: the gateway
/// fails closed on it (503) unless the policy says otherwise.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The store did not answer in time or the connection failed.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// An admission reused the id of a request the store still knows.
    #[error("request id {0:?} is already known to the store")]
    DuplicateRequestId(String),
    /// The store answered something this version cannot read.
    #[error("store protocol error: {0}")]
    Protocol(String),
    /// The store has forgotten what it held (restarted empty, flushed, evicted, or failed over
    /// to a replica that lagged): its marker is gone. Admissions are refused until an operator
    /// acknowledges the loss, since spent budgets and kill switches would otherwise reopen.
    #[error(
        "the store has lost its state (its marker is gone); an operator must acknowledge the loss"
    )]
    StateLost,
    /// The store holds no marker and no record of a loss: it is new, or it forgot everything
    /// while no instance was watching. Which of the two is decided from durable evidence (the
    /// spend ledger's rows) or by an operator's explicit initialisation; until then admissions
    /// are refused, since a marker written over a loss would hide it.
    #[error(
        "the store is not initialised (no marker): initialise it (`tollgate admin init-store`) \
         if it is new, or rebuild it from the ledger if it forgot"
    )]
    Uninitialised,
    /// The store's marker names another schema: an instance of another version keeps its books
    /// under this prefix, and the two must not share it.
    #[error(
        "the store holds the books of another version (schema {found:?}, this one is {ours:?}): \
         instances of different versions must not share a prefix; give this one another \
         prefix, or stop the others and start this one on an empty store"
    )]
    OtherSchema {
        /// The marker's value.
        found: String,
        /// This version's schema.
        ours: String,
    },
    /// A change was made, but no replica confirmed it in time: a failover now could undo it
    /// (the write sequence would then show the store lost).
    #[error(
        "the change was made on the store's primary, but no replica confirmed it within {0} ms: \
         a failover now could undo it"
    )]
    NotReplicated(u64),
}

/// What a store's marker says about what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreState {
    /// The marker is there: the store holds what it was given.
    Kept,
    /// The marker went missing after it had been seen: the store forgot (see
    /// [`StoreError::StateLost`]).
    Lost,
    /// No marker and no record of a loss (see [`StoreError::Uninitialised`]).
    Uninitialised,
}

/// How a request ended, as remembered for idempotency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Settled with reported usage.
    Settled,
    /// Released (cancelled or failed) with partial or policy usage.
    Released,
    /// Expired without settlement; charged as the policy says.
    Expired,
}

/// The result of `settle` or `release`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// This call ended the request: leases returned, reservations replaced by the charges.
    Done {
        /// What was charged per budget scope, in the scope's unit, in plan order.
        charged: Vec<u64>,
    },
    /// The request had already ended this way: nothing changed (idempotent).
    AlreadyEnded(Ending),
    /// The store never admitted this id, or forgot it after the retention time.
    Unknown,
}

/// A request the store expired (its ticket's time came with no ending), with what it was
/// charged: what a spend ledger needs of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiry {
    /// The request.
    pub request_id: String,
    /// The store's time of the expiry.
    pub at: Millis,
    /// Per budget scope, in the ticket's order.
    pub charges: Vec<ExpiryCharge>,
}

/// One budget scope's charge of an [`Expiry`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiryCharge {
    /// The scope's storage id.
    pub scope: String,
    /// Its period.
    pub period: crate::ledger::Period,
    /// The period's id (the period the reservation was made in).
    pub period_id: u64,
    /// The unit.
    pub unit: crate::policy::Unit,
    /// The amount charged.
    pub amount: u64,
}

/// What a request's shadow rules made of it ([`Store::admit_shadowed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShadowOutcome {
    /// They would have admitted it, and it was admitted: their leases and reservations are
    /// held by the request's own admission and end with it (settled, released, renewed or
    /// expired together; their charges are not in [`Finish::Done`] nor in an [`Expiry`]).
    Held,
    /// They would have admitted it, but the request was not admitted: nothing is held.
    Passed,
    /// They would have refused it; nothing is held.
    Refused(Deny),
    /// Admitted in an admission of its own under this id, by a store that cannot make both in
    /// one step (a sharded store): it ends with the request, or is released at once when the
    /// request was not admitted.
    Apart(String),
    /// The shadow admission failed; the request was decided without it.
    Failed,
}

/// The result of `renew`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Leases and reservation now expire at this time.
    Renewed {
        /// New expiry.
        expires_at: Millis,
    },
    /// The request is not in flight (ended, expired or unknown).
    NotInFlight,
}

/// The answer to a claim of an idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyClaim {
    /// The key is now this request's: go on, and end the claim when it is answered.
    Claimed,
    /// Another request holds the key with the same body and has not been answered yet.
    InFlight,
    /// The key was used with another body.
    Conflict,
    /// A request with the key and the same body was answered: its response, as kept (empty
    /// when the store had no room left to keep it).
    Answered(Vec<u8>),
    /// The store keeps as many keys as it may: the request cannot be made idempotent.
    NoRoom,
}

/// An idempotency key to claim: whose it is, what it was sent with, and for how long.
#[derive(Debug, Clone, Copy)]
pub struct KeyUse<'a> {
    /// The key, already scoped to its owner (the gateway prefixes the virtual key's id).
    pub key: &'a str,
    /// A digest of what was sent with it (path and body): the same key with another digest is
    /// a conflict.
    pub digest: &'a str,
    /// The request claiming it: only it can end the claim.
    pub request_id: &'a str,
    /// How long an unanswered claim holds the key (an instance that dies mid-request lets go of
    /// it then).
    pub in_flight_ms: u64,
}

/// The usage of one scope in its current period, for the admin API and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScopeUsage {
    /// Settled in the current period.
    pub settled: u64,
    /// Reserved by unfinished requests in the current period.
    pub reserved: u64,
    /// Leases held now.
    pub leases: u64,
    /// What the current period carries over from the one before (added to its limit).
    pub carried: u64,
    /// The store's time when it was read (ms since the epoch): the instant a reset is counted
    /// from, as admissions count by it.
    pub at_ms: u64,
}

/// A store's URL with its password (if any) replaced by `…`, to be shown or logged.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (auth, host) = match rest.rsplit_once('@') {
        Some(parts) => parts,
        None => return url.to_owned(),
    };
    match auth.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:…@{host}"),
        None => format!("{scheme}://{auth}@{host}"),
    }
}

/// A place to keep counters, leases and reservations. Each method is one atomic transition,
/// shaped so that a networked store does it in one round trip.
pub trait Store: Send + Sync {
    /// Counts the attempt in every rate scope, then applies the plan's token verdict, then takes
    /// a lease in every concurrency scope and reserves in every budget scope: all or nothing.
    fn admit(&self, plan: &Plan) -> impl Future<Output = Result<Decision, StoreError>> + Send;

    /// Admits `plan` as [`Store::admit`] does and, in the same step, evaluates `shadow` (the
    /// plan of the request's shadow rules, whose scopes are not `plan`'s) as if its rules were
    /// enforced alongside: its attempts counted, its checks made and, when both admit, its
    /// leases and reservations held by the request's admission ([`ShadowOutcome::Held`]).
    /// The shadow never changes the decision. A duplicate request id counts nowhere; `shadow`
    /// has no kill targets of its own (a killed request's shadow attempts still count, as a
    /// refused one's do).
    fn admit_shadowed(
        &self,
        plan: &Plan,
        shadow: &Plan,
    ) -> impl Future<Output = Result<(Decision, ShadowOutcome), StoreError>> + Send;

    /// Ends a request with its reported usage. Idempotent by request id.
    fn settle(
        &self,
        request_id: &str,
        usage: Usage,
    ) -> impl Future<Output = Result<Finish, StoreError>> + Send;

    /// Ends a cancelled or failed request. `usage` is what is known to have been used; `None`
    /// charges what the policy says for an abandoned request (the same as expiry).
    fn release(
        &self,
        request_id: &str,
        usage: Option<Usage>,
    ) -> impl Future<Output = Result<Finish, StoreError>> + Send;

    /// Extends the leases and reservation of an unfinished request by its TTL.
    fn renew(&self, request_id: &str) -> impl Future<Output = Result<Renewal, StoreError>> + Send;

    /// Switches `target` off (`Some(reason)`) or on again (`None`), for every instance sharing
    /// the store. Targets: `all`, `tenant:<id>`, `key:<id>`, `model:<name>`, `user:<id>`.
    fn set_kill(
        &self,
        target: &str,
        reason: Option<&str>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The targets switched off, with their reasons.
    fn kills(&self) -> impl Future<Output = Result<Vec<(String, String)>, StoreError>> + Send;

    /// The usage of a budget or concurrency scope by storage id (`rule|key`) in the period that
    /// contains now. Leases count only those not expired.
    fn usage(
        &self,
        scope_id: &str,
        period: Option<crate::ledger::Period>,
    ) -> impl Future<Output = Result<ScopeUsage, StoreError>> + Send;

    /// [`Store::usage`] of a budget whose periods carry over at most `cap` of their `limit`
    /// (`carry`): a period no admission has started yet shows what it will carry from the one
    /// before, as its first admission counts it.
    fn usage_carrying(
        &self,
        scope_id: &str,
        period: crate::ledger::Period,
        carry: (u64, u64),
    ) -> impl Future<Output = Result<ScopeUsage, StoreError>> + Send;

    /// Claims an idempotency key for a request, or says who has it (see [`KeyClaim`]), in one
    /// step: two instances never both claim one key.
    fn claim_key(
        &self,
        key: KeyUse<'_>,
    ) -> impl Future<Output = Result<KeyClaim, StoreError>> + Send;

    /// Ends the claim of `request_id` on `key`: `Some(response)` keeps the response for `keep_ms`
    /// to answer the key's later uses; `None` lets go of the key (the request was refused or
    /// failed: the next use is a new request). A claim held by another request is left alone.
    fn end_claim(
        &self,
        key: &str,
        request_id: &str,
        response: Option<&[u8]>,
        keep_ms: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// A shared store is a store: the embedded layer and the gateway hold one behind an `Arc`.
impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    fn admit(&self, plan: &Plan) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        (**self).admit(plan)
    }

    fn admit_shadowed(
        &self,
        plan: &Plan,
        shadow: &Plan,
    ) -> impl Future<Output = Result<(Decision, ShadowOutcome), StoreError>> + Send {
        (**self).admit_shadowed(plan, shadow)
    }

    fn settle(
        &self,
        request_id: &str,
        usage: Usage,
    ) -> impl Future<Output = Result<Finish, StoreError>> + Send {
        (**self).settle(request_id, usage)
    }

    fn release(
        &self,
        request_id: &str,
        usage: Option<Usage>,
    ) -> impl Future<Output = Result<Finish, StoreError>> + Send {
        (**self).release(request_id, usage)
    }

    fn renew(&self, request_id: &str) -> impl Future<Output = Result<Renewal, StoreError>> + Send {
        (**self).renew(request_id)
    }

    fn set_kill(
        &self,
        target: &str,
        reason: Option<&str>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).set_kill(target, reason)
    }

    fn kills(&self) -> impl Future<Output = Result<Vec<(String, String)>, StoreError>> + Send {
        (**self).kills()
    }

    fn usage(
        &self,
        scope_id: &str,
        period: Option<crate::ledger::Period>,
    ) -> impl Future<Output = Result<ScopeUsage, StoreError>> + Send {
        (**self).usage(scope_id, period)
    }

    fn usage_carrying(
        &self,
        scope_id: &str,
        period: crate::ledger::Period,
        carry: (u64, u64),
    ) -> impl Future<Output = Result<ScopeUsage, StoreError>> + Send {
        (**self).usage_carrying(scope_id, period, carry)
    }

    fn claim_key(
        &self,
        key: KeyUse<'_>,
    ) -> impl Future<Output = Result<KeyClaim, StoreError>> + Send {
        (**self).claim_key(key)
    }

    fn end_claim(
        &self,
        key: &str,
        request_id: &str,
        response: Option<&[u8]>,
        keep_ms: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).end_claim(key, request_id, response, keep_ms)
    }
}
