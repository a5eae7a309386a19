//! The six controls, one module each, in the order a request passes them: request rate →
//! input tokens → output-token cap → total tokens (the three in [`tokens`]) → concurrency →
//! budget, then the agent controls that come after the budget ([`tool_calls`], [`loops`]).
//!
//! A module holds how a rule becomes the [`Check`]s of a plan, its check against a scope's
//! state at an instant, and the reason it refuses with. A check is one of four kinds
//! ([`Kind`]): an attempt counted in a window, a lease held, an amount reserved, or a verdict
//! decided without state. Stores know the kinds, never the controls: they count every count
//! first, walk the plan's checks in order to the first refusal, then take the holds. So a
//! control of a known kind is its module, its place in [`checks`], and its reason.
//!
//! Every store decides with these functions: the memory store, and through it the slice book;
//! the Redis scripts have one Lua twin per kind (`crates/redis/src/lua/controls/`), tied to
//! these by tests that run both on the same cases. The checks are pure: the state goes in, the
//! verdict comes out, and time is an argument.

pub mod budget;
pub mod concurrency;
pub mod loops;
pub mod rate;
pub mod tokens;
pub mod tool_calls;

pub use budget::BudgetCheck;
pub use concurrency::ConcurrencyCheck;
pub use rate::RateCheck;

use crate::clock::Millis;
use crate::decision::{Deny, Quota, Reason};
use crate::ledger::Period;
use crate::pipeline::PlanError;
use crate::policy::ScopeRule;
use crate::scope::ScopeKey;

/// The reasons of the controls, in the order a request passes them (the token controls'
/// three in theirs): a refusal names the first control that refuses.
pub const ORDER: [Reason; 8] = Reason::ALL;

/// One check of a plan: the control it is for, and what a store does for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The control, named in its refusal and its quota.
    pub reason: Reason,
    /// What a store does.
    pub kind: Kind,
}

/// What a store does for a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// An attempt counted in a sliding window. Every count of a plan is counted before any
    /// check is decided, whatever refuses the request; a count over its limit refuses at its
    /// place in the plan.
    Count(RateCheck),
    /// One lease more in a scope, held until the request ends when every check passes.
    Lease(ConcurrencyCheck),
    /// An amount reserved in a scope's period, settled when the request ends.
    Reserve(BudgetCheck),
    /// A refusal decided without state, at its place in the plan.
    Verdict(Deny),
}

impl Check {
    /// The scope a stateful check is made in (`None` for a verdict).
    pub fn scope(&self) -> Option<&ScopeKey> {
        match &self.kind {
            Kind::Count(c) => Some(&c.scope),
            Kind::Lease(c) => Some(&c.scope),
            Kind::Reserve(c) => Some(&c.scope),
            Kind::Verdict(_) => None,
        }
    }

    /// The quota an admission reports for this check, the `index`th of its plan, from what a
    /// store found: what is left after the admission and the time to the reset. `at` is the
    /// admission's instant (a calendar period's length depends on it). `None` for a verdict.
    pub fn quota(
        &self,
        index: usize,
        remaining: u64,
        reset_after_ms: Option<u64>,
        at: Millis,
    ) -> Option<Quota> {
        let (limit, window_ms, reset_after_ms) = match &self.kind {
            Kind::Count(c) => (c.limit, Some(c.window_ms), reset_after_ms),
            Kind::Lease(c) => (c.limit, None, None),
            Kind::Reserve(b) => (b.limit, Some(period_len(b.period, at)), reset_after_ms),
            Kind::Verdict(_) => return None,
        };
        Some(Quota {
            reason: self.reason,
            check: index,
            limit,
            remaining,
            window_ms,
            reset_after_ms,
        })
    }

    /// The refusal of this check in its scope, from what a store found.
    pub fn deny(
        &self,
        remaining: u64,
        retry_after_ms: Option<u64>,
        reset_after_ms: Option<u64>,
    ) -> Deny {
        let (scope, limit, requested) = match &self.kind {
            Kind::Count(c) => (&c.scope, c.limit, 1),
            Kind::Lease(c) => (&c.scope, c.limit, 1),
            Kind::Reserve(c) => (&c.scope, c.limit, c.amount),
            Kind::Verdict(d) => return d.clone(),
        };
        Deny {
            reason: self.reason,
            scope: scope.clone(),
            limit,
            remaining,
            requested,
            retry_after_ms,
            reset_after_ms,
        }
    }
}

/// A period's length in ms, the one containing `at` for a calendar month.
fn period_len(p: Period, at: Millis) -> u64 {
    match p {
        Period::Fixed(len) => len,
        Period::CalendarMonth => {
            let (_, start, end) = p.at(at);
            end.saturating_sub(start)
        }
    }
}

/// What the controls make their checks from: the request's rules with their scopes, and
/// what the pipeline found of the request.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// The rules a request falls under, with the scope each puts it in, in policy order.
    pub rules: &'a [(&'a ScopeRule, &'a ScopeKey)],
    /// Input tokens.
    pub input: u64,
    /// The output cap granted.
    pub granted: u64,
    /// How the request is priced.
    pub pricing: budget::Pricing<'a>,
    /// The request's fingerprint for loop detection.
    pub fingerprint: Option<u64>,
    /// How often the history's most repeated tool call appears.
    pub tool_call_repeats: u64,
}

/// Every check of a request, in the fixed order of the controls, each control's in policy
/// order. A new control adds its checks here, at its place.
pub fn checks(x: Inputs<'_>) -> Result<Vec<Check>, PlanError> {
    let rules = x.rules.iter().copied();
    let mut out = Vec::with_capacity(2 * x.rules.len());
    let mut add = |reason: Reason, kind: Kind| out.push(Check { reason, kind });
    for (r, k) in rules.clone() {
        if let Some(c) = rate::plan(r, k) {
            add(rate::REASON, Kind::Count(c));
        }
    }
    if let Some(d) = tokens::verdict(rules.clone(), x.input, x.granted) {
        add(d.reason, Kind::Verdict(d));
    }
    for (r, k) in rules.clone() {
        if let Some(c) = concurrency::plan(r, k) {
            add(concurrency::REASON, Kind::Lease(c));
        }
    }
    for (r, k) in rules.clone() {
        if let Some(b) = budget::plan(r, k, x.pricing)? {
            add(b.unit.reason(), Kind::Reserve(b));
        }
    }
    for (r, k) in rules.clone() {
        if let Some(b) = tool_calls::plan(r, k) {
            add(tool_calls::REASON, Kind::Reserve(b));
        }
    }
    for (r, k) in rules.clone() {
        if let Some(c) = loops::plan(r, k, x.fingerprint) {
            add(loops::REASON, Kind::Count(c));
        }
    }
    if let Some(d) = rules
        .clone()
        .find_map(|(r, k)| loops::history_verdict(r, k, x.tool_call_repeats))
    {
        add(loops::REASON, Kind::Verdict(d));
    }
    Ok(out)
}

/// The rate checks alone (a request's attempt-counting plan, before its body is read).
pub fn rate_checks(rules: &[(&ScopeRule, &ScopeKey)]) -> Vec<Check> {
    rules
        .iter()
        .filter_map(|(r, k)| rate::plan(r, k))
        .map(|c| Check {
            reason: rate::REASON,
            kind: Kind::Count(c),
        })
        .collect()
}
