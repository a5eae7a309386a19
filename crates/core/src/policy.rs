//! Policy: parsed raw from TOML, then validated into types that cannot hold invalid values.
//!
//! [`RawPolicy`] mirrors the file; [`Policy::try_from`] checks every field and reports the first
//! problem with its path, e.g. `policy.scopes[2].budget.period: unknown period "fortnight"`.

use std::num::NonZeroU64;
use std::sync::Arc;

mod raw;
mod scope_rule;
pub use raw::*;
pub use scope_rule::ScopeRule;
use scope_rule::validate_scope;

pub use crate::controls::budget::{AlertAt, BudgetLimit, RawBudget, Unit};
pub use crate::controls::concurrency::{ConcurrencyLimit, RawConcurrency};
pub use crate::controls::loops::{LoopLimit, RawLoops};
pub use crate::controls::rate::{RateLimit, RawRequests};
pub use crate::controls::tokens::{OutputLimit, OutputMode, RawInput, RawInputRule, RawOutput};
pub use crate::controls::tool_calls::RawToolCalls;
pub use crate::ledger::Price;
pub use crate::prices::{
    Charges, FeeRule, Prices, RawLongContext, RawPrice, Source as PriceSource,
};
pub use crate::rule::{MAX_LIMIT, MAX_WINDOW_MS, PolicyError, RawCalendar, RawPeriod};
use crate::rule::{duration_ms, positive};

use crate::clock::Millis;

/// A validated policy. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct Policy(Arc<PolicyInner>);

/// The validated contents of a [`Policy`].
#[derive(Debug)]
pub struct PolicyInner {
    /// The version string (defaults to `unversioned`).
    pub version: Arc<str>,
    /// Cap for requests that state none and meet no scope default.
    pub default_max_output_tokens: NonZeroU64,
    /// TTL of a request that holds no lease.
    pub reservation_ttl: NonZeroU64,
    /// What an expired or abandoned reservation costs.
    pub expired_charge: ExpiredCharge,
    /// Controls allowed to fail open when the store is unreachable.
    pub fail_open: Vec<crate::decision::Reason>,
    /// Prices by model name, and of a model's service tiers (priority processing, a region of
    /// its own): a request for a tier is reserved and settled at its tier's price.
    pub prices: Prices,
    /// The priority classes.
    pub classes: crate::controls::reserve::Classes,
    /// The rules, in order.
    pub scopes: Vec<ScopeRule>,
    /// Whether any rule is a shadow rule: a request's shadow plan is not looked for otherwise.
    pub has_shadow: bool,
}

impl std::ops::Deref for Policy {
    type Target = PolicyInner;
    fn deref(&self) -> &PolicyInner {
        &self.0
    }
}

/// What an expired (or abandoned, without reported usage) reservation is charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiredCharge {
    /// The whole reservation: the upstream may have done all the work.
    Full,
    /// Only the input tokens.
    Input,
    /// Nothing.
    None,
}

impl Policy {
    /// Parses and validates a TOML policy document.
    pub fn from_toml(text: &str) -> Result<Self, PolicyError> {
        let raw: RawPolicy =
            toml::from_str(text).map_err(|e| PolicyError::new("policy", e.to_string()))?;
        Self::validate(raw, "policy")
    }

    /// Validates a raw policy; `root` prefixes every error path.
    pub fn validate(raw: RawPolicy, root: &str) -> Result<Self, PolicyError> {
        let version: Arc<str> = match raw.version {
            Some(v) if v.trim().is_empty() => {
                return Err(PolicyError::new(
                    format!("{root}.version"),
                    "must not be empty",
                ));
            }
            Some(v) => v.into(),
            None => "unversioned".into(),
        };
        let default_max_output_tokens = positive(
            raw.default_max_output_tokens.unwrap_or(4096),
            &format!("{root}.default_max_output_tokens"),
        )?;
        let reservation_ttl = match raw.reservation_ttl {
            Some(s) => duration_ms(&s, &format!("{root}.reservation_ttl"))?,
            None => NonZeroU64::new(600_000).unwrap_or(NonZeroU64::MIN),
        };
        let expired_charge = match raw.expired_reservation_charge.as_deref() {
            None | Some("full") => ExpiredCharge::Full,
            Some("input") => ExpiredCharge::Input,
            Some("none") => ExpiredCharge::None,
            Some(other) => {
                return Err(PolicyError::new(
                    format!("{root}.expired_reservation_charge"),
                    format!("unknown charge {other:?}; expected \"full\", \"input\" or \"none\""),
                ));
            }
        };
        let mut fail_open = Vec::new();
        for (i, code) in raw.fail_open.iter().enumerate() {
            let path = format!("{root}.fail_open[{i}]");
            let r = crate::decision::Reason::from_code(code)
                .filter(|r| r.control() == *r)
                .ok_or_else(|| PolicyError::new(&path, format!("unknown control {code:?}")))?;
            if !r.is_stateful() {
                return Err(PolicyError::new(
                    path,
                    "token limits need no store and never fail open; only request_rate_limit, concurrency_limit, budget_limit, tool_call_limit and loop_detected may",
                ));
            }
            fail_open.push(r);
        }
        let prices = crate::prices::validate(raw.prices, raw.price_catalog.as_deref(), root)?;
        let classes = crate::controls::reserve::Classes::check(raw.classes, root)?;
        let mut scopes: Vec<ScopeRule> = Vec::with_capacity(raw.scopes.len());
        for (i, s) in raw.scopes.into_iter().enumerate() {
            let mut rule = validate_scope(s, &format!("{root}.scopes[{i}]"), &prices, &classes)?;
            if scopes.iter().any(|r| r.name == rule.name) {
                return Err(PolicyError::new(
                    format!("{root}.scopes[{i}].name"),
                    format!("duplicate scope name {:?}", &*rule.name),
                ));
            }
            rule.same_key_as = rule
                .global_key
                .is_none()
                .then(|| {
                    scopes
                        .iter()
                        .position(|r| r.dims == rule.dims && r.ip_prefix == rule.ip_prefix)
                })
                .flatten();
            scopes.push(rule);
        }
        Ok(Policy(Arc::new(PolicyInner {
            version,
            default_max_output_tokens,
            reservation_ttl,
            expired_charge,
            fail_open,
            prices,
            has_shadow: scopes.iter().any(|r| r.shadow),
            classes,
            scopes,
        })))
    }

    /// A policy with no limits at all (every request admitted, same accounting).
    pub fn unbounded() -> Self {
        let raw = RawPolicy {
            version: Some("unbounded".into()),
            default_max_output_tokens: Some(u64::from(u32::MAX)),
            ..RawPolicy::default()
        };
        // Validation of this literal cannot fail; fall back to a hand-built value regardless.
        Self::validate(raw, "policy").unwrap_or_else(|_| {
            Policy(Arc::new(PolicyInner {
                version: "unbounded".into(),
                default_max_output_tokens: NonZeroU64::MAX,
                reservation_ttl: NonZeroU64::MAX,
                expired_charge: ExpiredCharge::Full,
                fail_open: Vec::new(),
                prices: Prices::default(),
                classes: crate::controls::reserve::Classes::default(),
                scopes: Vec::new(),
                has_shadow: false,
            }))
        })
    }
}

/// When a request expires if none of its scopes sets a lease TTL: now + the policy's TTL.
pub fn ticket_ttl(policy: &Policy, leases: impl Iterator<Item = u64>) -> Millis {
    leases.min().unwrap_or(policy.reservation_ttl.get())
}

#[cfg(test)]
mod tests;
