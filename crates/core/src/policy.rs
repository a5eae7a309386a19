//! Policy: parsed raw from TOML, then validated into types that cannot hold invalid values.
//!
//! [`RawPolicy`] mirrors the file; [`Policy::try_from`] checks every field and reports the first
//! problem with its path, e.g. `policy.scopes[2].budget.period: unknown period "fortnight"`.

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

mod prices;
pub use prices::{Charges, FeeRule, Prices, Source as PriceSource};
mod raw;
pub(crate) mod validate;
pub use raw::*;
use validate::{duration_ms, positive, validate_scope};

use crate::clock::Millis;
use crate::ledger::Period;
use crate::scope::{Dimension, Identity, IpPrefix, ScopeKey};

/// A policy that failed validation: the path of the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct PolicyError {
    /// Dotted path of the field, e.g. `policy.scopes[2].budget.period`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl PolicyError {
    pub(crate) fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

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

/// A price in micro-units per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Price {
    /// Input tokens.
    pub input: u64,
    /// Cached input tokens.
    pub cached_input: u64,
    /// Output tokens.
    pub output: u64,
}

/// One validated scope rule.
#[derive(Debug, Clone)]
pub struct ScopeRule {
    /// Unique rule name.
    pub name: Arc<str>,
    /// Dimensions in canonical order; empty for global.
    pub dims: Vec<Dimension>,
    /// Required dimension values.
    pub matches: Vec<(Dimension, String)>,
    /// Every control's part of the rule, read as the rule's own fields (`rule.budget`).
    pub controls: crate::controls::Rules,
    /// How client addresses are grouped into `ip` scopes.
    pub ip_prefix: IpPrefix,
    /// A shadow rule: its controls are evaluated and its counters, leases and reservations
    /// kept as if it were enforced, in a plan of its own ([`crate::shadow_plan`]), but it never
    /// refuses; a refusal it would have made is recorded and counted.
    pub shadow: bool,
    /// The one key of a rule with no dimensions (`name|global`), derived once here so that
    /// a plan shares it instead of building it per request.
    pub global_key: Option<ScopeKey>,
    /// The first earlier rule over the same dimensions and address grouping: where both apply,
    /// this rule's key is that rule's renamed ([`ScopeKey::renamed`]), not derived again (a
    /// shadow rule trying other limits on an enforced rule's scopes is the common case).
    pub same_key_as: Option<usize>,
}

impl ScopeRule {
    /// The key of this rule's scope for `identity`, when the rule applies to it: its matches
    /// met and its dimensions known.
    pub fn key_of(&self, identity: &crate::scope::Identity) -> Option<ScopeKey> {
        if self
            .matches
            .iter()
            .any(|(d, v)| identity.get(*d) != Some(v.as_str()))
        {
            return None;
        }
        ScopeKey::derive_in(&self.name, &self.dims, identity, self.ip_prefix)
    }
}

impl std::ops::Deref for ScopeRule {
    type Target = crate::controls::Rules;

    fn deref(&self) -> &Self::Target {
        &self.controls
    }
}

impl std::ops::DerefMut for ScopeRule {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.controls
    }
}

/// Attempts per sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Attempts per window.
    pub limit: NonZeroU64,
    /// Window length in ms.
    pub window_ms: NonZeroU64,
}

/// Loop detection: repeats of one request within a window, and of one tool call in a
/// request's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopLimit {
    /// Identical requests allowed within the window, and identical tool calls in one history:
    /// the one past it is refused.
    pub max_identical: NonZeroU64,
    /// Window of request repeats, ms.
    pub window_ms: NonZeroU64,
}

/// How an output cap treats a request above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputMode {
    /// Refuse the request.
    Reject,
    /// Lower the request's cap to the limit.
    Clamp,
}

/// An output-token cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputLimit {
    /// The cap.
    pub max: NonZeroU64,
    /// Reject or clamp.
    pub mode: OutputMode,
    /// Cap for requests that state none (≤ `max`).
    pub default: NonZeroU64,
}

/// A concurrency limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConcurrencyLimit {
    /// Unfinished requests at once.
    pub limit: NonZeroU64,
    /// Lease lifetime without renewal, ms.
    pub lease_ttl_ms: NonZeroU64,
}

/// The unit of a budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// Input + output tokens.
    Tokens,
    /// Money in integer micro-units, from the model's price.
    MicroUsd,
    /// Tool calls the model emitted.
    ToolCalls,
}

impl Unit {
    /// `tokens` or `micro_usd`.
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Tokens => "tokens",
            Unit::MicroUsd => "micro_usd",
            Unit::ToolCalls => "tool_calls",
        }
    }

    /// The control that refuses when this unit runs out.
    pub fn reason(self) -> crate::decision::Reason {
        match self {
            Unit::Tokens | Unit::MicroUsd => crate::decision::Reason::BudgetLimit,
            Unit::ToolCalls => crate::decision::Reason::ToolCallLimit,
        }
    }
}

/// A budget per period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetLimit {
    /// The limit in `unit`.
    pub limit: NonZeroU64,
    /// Tokens or money.
    pub unit: Unit,
    /// The period.
    pub period: Period,
    /// Where alerts fire.
    pub alert_at: AlertAt,
    /// The most of what a period leaves unused that the next one adds to its limit, in `unit`
    /// (0: nothing carried over).
    pub carry_cap: u64,
}

/// Per cents of a budget's limit (1 to 100) at which an alert fires, once per scope and period:
/// a set, held in one word so that a budget stays `Copy`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AlertAt(u128);

impl AlertAt {
    /// The set of `percents`, each from 1 to 100.
    pub fn of(percents: &[u64]) -> Result<Self, String> {
        let mut bits = 0u128;
        for &p in percents {
            if !(1..=100).contains(&p) {
                return Err(format!("{p} is not a per cent from 1 to 100"));
            }
            bits |= 1 << (p - 1);
        }
        Ok(Self(bits))
    }

    /// Whether no alert is set.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The per cents, lowest first.
    pub fn iter(self) -> impl Iterator<Item = u64> {
        // Set bits only: checked on every request with alerts, where trying all hundred per
        // cents cost more than the rest of the alert check.
        let mut bits = self.0;
        std::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let p = u64::from(bits.trailing_zeros()) + 1;
            bits &= bits - 1;
            Some(p)
        })
    }

    /// The per cents that `committed` of `limit` has reached.
    pub fn reached(self, committed: u64, limit: u64) -> impl Iterator<Item = u64> {
        self.iter()
            .filter(move |p| u128::from(committed) * 100 >= u128::from(*p) * u128::from(limit))
    }
}

/// Upper bounds that keep every product of the ledger arithmetic inside 2^53, so the Lua
/// implementation (doubles) computes exactly what Rust computes.
pub const MAX_LIMIT: u64 = 1_000_000_000_000;
/// Longest rate window or fixed period: 400 days.
pub const MAX_WINDOW_MS: u64 = 400 * 86_400_000;

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
        let prices = prices::validate(raw.prices, raw.price_catalog.as_deref(), root)?;
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

impl Period {
    /// A period as written: a name or duration ([`Period::parse`]), or a calendar in a zone.
    pub fn of(raw: &raw::RawPeriod) -> Result<Self, String> {
        match raw {
            raw::RawPeriod::Named(s) => Self::parse(s),
            raw::RawPeriod::Calendar(c) => {
                crate::ledger::Calendar::parse(&c.every, c.zone.as_deref(), c.starts.as_deref())
                    .map(Period::Calendar)
            }
        }
    }

    /// Parses `day`, `month` or a fixed duration (`1h`, `7d`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "day" | "calendar_day" => Ok(Period::Fixed(86_400_000)),
            "month" | "calendar_month" => Ok(Period::CalendarMonth),
            other => {
                let d = humantime::parse_duration(other).map_err(|e| {
                    format!("unknown period {other:?} ({e}); expected \"day\", \"month\" or a duration like \"1h\"")
                })?;
                let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
                if ms == 0 || ms > MAX_WINDOW_MS {
                    return Err("must be between 1ms and 400 days".into());
                }
                Ok(Period::Fixed(ms))
            }
        }
    }
}

/// When a request expires if none of its scopes sets a lease TTL: now + the policy's TTL.
pub fn ticket_ttl(policy: &Policy, leases: impl Iterator<Item = u64>) -> Millis {
    leases.min().unwrap_or(policy.reservation_ttl.get())
}

#[cfg(test)]
mod tests;
