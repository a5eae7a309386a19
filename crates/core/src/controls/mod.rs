//! The six controls, one module each, in the order a request passes them: request rate →
//! input tokens → output-token cap → total tokens (the three in [`tokens`]) → concurrency →
//! budget, then the agent controls that come after the budget ([`tool_calls`], [`loops`]).
//!
//! A module holds its part of a scope rule (as written, and checked into [`Rules`]), how a rule
//! becomes the [`Check`]s of a plan, its check against a scope's
//! state at an instant, and the reason it refuses with. A check is one of four kinds
//! ([`Kind`]): an attempt counted in a window, a lease held, an amount reserved, or a verdict
//! decided without state. Stores know the kinds, never the controls: they count every count
//! first, walk the plan's checks in order to the first refusal, then take the holds. So a
//! control of a known kind is its module, its line in the rule table here ([`RawRules`],
//! [`Rules`]), its place in [`checks`], and its reason.
//!
//! Every store decides with these functions: the memory store, and through it the slice book;
//! the Redis scripts have one Lua twin per kind (`crates/redis/src/lua/controls/`), tied to
//! these by tests that run both on the same cases. The checks are pure: the state goes in, the
//! verdict comes out, and time is an argument.

pub mod budget;
pub mod concurrency;
pub mod degrade;
pub mod loops;
pub mod rate;
pub mod request_cost;
pub mod reserve;
pub mod tokens;
pub mod tool_calls;

pub use budget::BudgetCheck;
pub use concurrency::ConcurrencyCheck;
pub use rate::RateCheck;

use std::collections::BTreeMap;
use std::num::NonZeroU64;

use serde::de::MapAccess;

use crate::clock::Millis;
use crate::decision::{Deny, Quota, Reason};
use crate::ledger::Period;
use crate::prices::Prices;
use crate::rule::PolicyError;
use crate::scope::ScopeKey;
use budget::{BudgetLimit, PlanError, RawBudget};
use concurrency::{ConcurrencyLimit, RawConcurrency};
use loops::{LoopLimit, RawLoops};
use rate::{RateLimit, RawRequests};
use tokens::{OutputLimit, RawInput, RawOutput};
use tool_calls::RawToolCalls;

/// Every control's part of a scope rule as written, each under its key in the rule's table.
#[derive(Debug, Clone, Default)]
pub struct RawRules {
    /// `requests = { limit, window }`
    pub requests: Option<RawRequests>,
    /// `input_tokens = N` or `{ max, mode }`
    pub input_tokens: Option<RawInput>,
    /// `output_tokens = { max, mode, default }`
    pub output_tokens: Option<RawOutput>,
    /// `total_tokens = N`
    pub total_tokens: Option<u64>,
    /// `request_cost = "$0.50"`
    pub request_cost: Option<String>,
    /// `concurrency = { limit, lease_ttl }`
    pub concurrency: Option<RawConcurrency>,
    /// `reserve = { <class> = "<n>%" }`
    pub reserve: Option<BTreeMap<String, String>>,
    /// `budget = { tokens | micro_usd, period, alert_at }`
    pub budget: Option<RawBudget>,
    /// `tool_calls = { limit, period }`
    pub tool_calls: Option<RawToolCalls>,
    /// `loops = { max_identical, window }`
    pub loops: Option<RawLoops>,
    /// `degrade = { at, models }`
    pub degrade: Option<degrade::RawDegrade>,
}

impl RawRules {
    /// The keys the controls are written under, in the controls' order.
    pub const KEYS: [&'static str; 11] = [
        "requests",
        "input_tokens",
        "output_tokens",
        "total_tokens",
        "request_cost",
        "concurrency",
        "reserve",
        "budget",
        "tool_calls",
        "loops",
        "degrade",
    ];

    /// Reads the value under `key` from `map` when a control is written under that key; false
    /// when none is (the rule's own fields are the policy's).
    pub fn read<'de, A: MapAccess<'de>>(
        &mut self,
        key: &str,
        map: &mut A,
    ) -> Result<bool, A::Error> {
        match key {
            "requests" => self.requests = Some(map.next_value()?),
            "input_tokens" => self.input_tokens = Some(map.next_value()?),
            "output_tokens" => self.output_tokens = Some(map.next_value()?),
            "total_tokens" => self.total_tokens = Some(map.next_value()?),
            "request_cost" => self.request_cost = Some(map.next_value()?),
            "concurrency" => self.concurrency = Some(map.next_value()?),
            "reserve" => self.reserve = Some(map.next_value()?),
            "budget" => self.budget = Some(map.next_value()?),
            "tool_calls" => self.tool_calls = Some(map.next_value()?),
            "loops" => self.loops = Some(map.next_value()?),
            "degrade" => self.degrade = Some(map.next_value()?),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// Every control's part of a scope rule, checked. A policy's scope rule reads these as its own
/// fields (`rule.budget`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    /// Rate limit.
    pub requests: Option<RateLimit>,
    /// Input-token limit.
    pub input_tokens: Option<NonZeroU64>,
    /// Whether a request above `input_tokens` has its oldest turns dropped until it fits (the
    /// gateway does it, before the plan; a request that still does not fit is refused).
    pub trim_input: bool,
    /// Output-token cap.
    pub output_tokens: Option<OutputLimit>,
    /// Total-token limit.
    pub total_tokens: Option<NonZeroU64>,
    /// The cost cap of one request, in micro-USD.
    pub request_cost: Option<NonZeroU64>,
    /// Concurrency limit.
    pub concurrency: Option<ConcurrencyLimit>,
    /// Shares of the concurrency kept for priority classes.
    pub reserve: Option<reserve::Reserve>,
    /// Budget.
    pub budget: Option<BudgetLimit>,
    /// Tool calls per period (a [`BudgetLimit`] in tool calls).
    pub tool_calls: Option<BudgetLimit>,
    /// Loop detection.
    pub loops: Option<LoopLimit>,
    /// Models sent to cheaper ones past a share of the budget (the gateway's step, no check).
    pub degrade: Option<degrade::Degrade>,
}

impl Rules {
    /// The controls' parts of rule `path` as written, each checked by its module; the first
    /// error names the field.
    pub fn check(
        raw: RawRules,
        path: &str,
        prices: &Prices,
        classes: &reserve::Classes,
    ) -> Result<Self, PolicyError> {
        let requests = rate::rule(raw.requests, path)?;
        let (input_tokens, trim_input) = tokens::input_rule(raw.input_tokens, path)?;
        let total_tokens = tokens::total_rule(raw.total_tokens, path)?;
        let output_tokens = tokens::output_rule(raw.output_tokens, path)?;
        let concurrency = concurrency::rule(raw.concurrency, path)?;
        Ok(Self {
            requests,
            input_tokens,
            trim_input,
            output_tokens,
            total_tokens,
            request_cost: request_cost::rule(raw.request_cost, path, prices)?,
            concurrency,
            reserve: reserve::rule(raw.reserve, concurrency.is_some(), classes, path)?,
            degrade: degrade::rule(raw.degrade, raw.budget.is_some(), path)?,
            budget: budget::rule(raw.budget, path, prices)?,
            tool_calls: tool_calls::rule(raw.tool_calls, path)?,
            loops: loops::rule(raw.loops, path)?,
        })
    }

    /// The three token limits.
    pub fn tokens(&self) -> tokens::Limits {
        tokens::Limits {
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            total_tokens: self.total_tokens,
        }
    }

    /// Whether the rule limits money, so that every model it meets needs a price.
    pub fn limits_money(&self) -> bool {
        self.request_cost.is_some()
            || self
                .budget
                .is_some_and(|b| b.unit == budget::Unit::MicroUsd)
    }

    /// The controls the rule sets, each with its key and the reason it refuses with, in the
    /// controls' order.
    pub fn controls(&self) -> impl Iterator<Item = (&'static str, Reason)> + use<> {
        [
            (self.requests.is_some(), rate::REASON),
            (self.input_tokens.is_some(), Reason::InputTokenLimit),
            (self.output_tokens.is_some(), Reason::OutputTokenLimit),
            (self.total_tokens.is_some(), Reason::TotalTokenLimit),
            (self.request_cost.is_some(), request_cost::REASON),
            (self.concurrency.is_some(), concurrency::REASON),
            (self.reserve.is_some(), reserve::REASON),
            (self.budget.is_some(), Reason::BudgetLimit),
            (self.tool_calls.is_some(), tool_calls::REASON),
            (self.loops.is_some(), loops::REASON),
        ]
        .into_iter()
        .zip(RawRules::KEYS)
        .filter_map(|((set, reason), key)| set.then_some((key, reason)))
    }
}

/// The reasons of the controls, in the order a request passes them (the token controls'
/// three in theirs): a refusal names the first control that refuses.
pub const ORDER: [Reason; 10] = Reason::ALL;

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
    /// A sliding window read, not counted: it never refuses, and reports what is left (what
    /// a caller that is limited may still read of its limits).
    Peek(RateCheck),
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
            Kind::Count(c) | Kind::Peek(c) => Some(&c.scope),
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
            Kind::Count(c) | Kind::Peek(c) => (c.limit, Some(c.window_ms), reset_after_ms),
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
            Kind::Count(c) | Kind::Peek(c) => (&c.scope, c.limit, 1),
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

/// A period's length in ms, the one containing `at` for a calendar period.
fn period_len(p: Period, at: Millis) -> u64 {
    match p {
        Period::Fixed(len) => len,
        Period::CalendarMonth | Period::Calendar(_) => {
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
    pub rules: &'a [(&'a Rules, &'a ScopeKey)],
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
    /// The request's priority class and its weight.
    pub class: (&'a str, u32),
}

/// Every check of a request, in the fixed order of the controls, each control's in policy
/// order. A new control adds its checks here, at its place.
pub fn checks(x: Inputs<'_>) -> Result<Vec<Check>, PlanError> {
    let rules = x.rules.iter().copied();
    // Room for a rule's rate, lease and reservation, and two verdicts, without growing.
    let mut out = Vec::with_capacity(3 * x.rules.len() + 2);
    let mut add = |reason: Reason, kind: Kind| out.push(Check { reason, kind });
    for (r, k) in rules.clone() {
        if let Some(c) = rate::plan(r.requests, k) {
            add(rate::REASON, Kind::Count(c));
        }
    }
    if let Some(d) = tokens::verdict(
        rules.clone().map(|(r, k)| (r.tokens(), k)),
        x.input,
        x.granted,
    ) {
        add(d.reason, Kind::Verdict(d));
    } else if let Some(d) =
        request_cost::verdict(rules.clone().map(|(r, k)| (r.request_cost, k)), x.pricing)?
    {
        add(d.reason, Kind::Verdict(d));
    }
    for (r, k) in rules.clone() {
        if let Some(c) = concurrency::plan(r.concurrency, k) {
            let (reason, c) = match &r.reserve {
                Some(s) => reserve::apply(s, x.class.0, x.class.1, c),
                None => (concurrency::REASON, c),
            };
            add(reason, Kind::Lease(c));
        }
    }
    for (r, k) in rules.clone() {
        if let Some(b) = budget::plan(r.budget, k, x.pricing)? {
            add(b.unit.reason(), Kind::Reserve(b));
        }
    }
    for (r, k) in rules.clone() {
        if let Some(b) = tool_calls::plan(r.tool_calls, k) {
            add(tool_calls::REASON, Kind::Reserve(b));
        }
    }
    for (r, k) in rules.clone() {
        if let Some(c) = loops::plan(r.loops, k, x.fingerprint) {
            add(loops::REASON, Kind::Count(c));
        }
    }
    if let Some(d) = rules
        .clone()
        .find_map(|(r, k)| loops::history_verdict(r.loops, k, x.tool_call_repeats))
    {
        add(loops::REASON, Kind::Verdict(d));
    }
    Ok(out)
}

/// The rate checks alone (a request's attempt-counting plan, before its body is read).
pub fn rate_checks(rules: &[(&Rules, &ScopeKey)]) -> Vec<Check> {
    rules
        .iter()
        .filter_map(|(r, k)| rate::plan(r.requests, k))
        .map(|c| Check {
            reason: rate::REASON,
            kind: Kind::Count(c),
        })
        .collect()
}
