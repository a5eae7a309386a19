//! Policy: parsed raw from TOML, then validated into types that cannot hold invalid values.
//!
//! [`RawPolicy`] mirrors the file; [`Policy::try_from`] checks every field and reports the first
//! problem with its path, e.g. `policy.scopes[2].budget.period: unknown period "fortnight"`.
//!
//! Over 600 lines because each validated type sits next to the checks that establish its
//! invariants; every function here is one field's or one section's.

use std::collections::BTreeMap;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

mod prices;
mod raw;
pub use raw::*;

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
    fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
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
    /// Prices by model name.
    pub prices: BTreeMap<String, Price>,
    /// Prices of a model's service tiers (priority processing, a region of its own), by model
    /// and tier name: a request for a tier is reserved and settled at its tier's price.
    pub tier_prices: BTreeMap<String, BTreeMap<String, Price>>,
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
    /// Concurrency limit.
    pub concurrency: Option<ConcurrencyLimit>,
    /// Budget.
    pub budget: Option<BudgetLimit>,
    /// Tool calls per period (a [`BudgetLimit`] in [`Unit::ToolCalls`]).
    pub tool_calls: Option<BudgetLimit>,
    /// Loop detection.
    pub loops: Option<LoopLimit>,
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
                .ok_or_else(|| PolicyError::new(&path, format!("unknown control {code:?}")))?;
            if !r.is_stateful() {
                return Err(PolicyError::new(
                    path,
                    "token limits need no store and never fail open; only request_rate_limit, concurrency_limit, budget_limit, tool_call_limit and loop_detected may",
                ));
            }
            fail_open.push(r);
        }
        let (prices, tier_prices) = prices::validate(raw.prices, root)?;
        let mut scopes: Vec<ScopeRule> = Vec::with_capacity(raw.scopes.len());
        for (i, s) in raw.scopes.into_iter().enumerate() {
            let mut rule = validate_scope(s, &format!("{root}.scopes[{i}]"), &prices)?;
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
            tier_prices,
            has_shadow: scopes.iter().any(|r| r.shadow),
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
                prices: BTreeMap::new(),
                tier_prices: BTreeMap::new(),
                scopes: Vec::new(),
                has_shadow: false,
            }))
        })
    }
}

fn positive(v: u64, path: &str) -> Result<NonZeroU64, PolicyError> {
    if v > MAX_LIMIT {
        return Err(PolicyError::new(
            path,
            format!("must be at most {MAX_LIMIT}"),
        ));
    }
    NonZeroU64::new(v).ok_or_else(|| PolicyError::new(path, "must be greater than 0"))
}

fn duration_ms(s: &str, path: &str) -> Result<NonZeroU64, PolicyError> {
    let d: Duration = humantime::parse_duration(s.trim())
        .map_err(|e| PolicyError::new(path, format!("invalid duration {s:?}: {e}")))?;
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms == 0 {
        return Err(PolicyError::new(path, "must be at least 1ms"));
    }
    if ms > MAX_WINDOW_MS {
        return Err(PolicyError::new(path, "must be at most 400 days"));
    }
    NonZeroU64::new(ms).ok_or_else(|| PolicyError::new(path, "must be at least 1ms"))
}

/// A rule's `ip_prefix`: only on rules keyed on `ip`; each length within its family's.
fn validate_ip_prefix(
    raw: Option<&RawIpPrefix>,
    dims: &[Dimension],
    path: &str,
) -> Result<IpPrefix, PolicyError> {
    let d = IpPrefix::default();
    let Some(p) = raw else { return Ok(d) };
    if !dims.contains(&Dimension::Ip) {
        return Err(PolicyError::new(
            format!("{path}.ip_prefix"),
            "applies only to a rule keyed on ip",
        ));
    }
    let (v4, v6) = (p.v4.unwrap_or(d.v4), p.v6.unwrap_or(d.v6));
    if !(1..=32).contains(&v4) {
        return Err(PolicyError::new(
            format!("{path}.ip_prefix.v4"),
            "must be from 1 to 32",
        ));
    }
    if !(1..=128).contains(&v6) {
        return Err(PolicyError::new(
            format!("{path}.ip_prefix.v6"),
            "must be from 1 to 128",
        ));
    }
    Ok(IpPrefix { v4, v6 })
}

fn validate_scope(
    s: RawScope,
    path: &str,
    prices: &BTreeMap<String, Price>,
) -> Result<ScopeRule, PolicyError> {
    let dims = validate_dims(&s.key, path)?;
    let ip_prefix = validate_ip_prefix(s.ip_prefix.as_ref(), &dims, path)?;
    let name: Arc<str> = s.name.unwrap_or_else(|| s.key.trim().to_owned()).into();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '/' | '.'))
    {
        return Err(PolicyError::new(
            format!("{path}.name"),
            "must be non-empty ASCII letters, digits, '-', '_', '.', '/'",
        ));
    }
    let mut matches = Vec::new();
    for (k, v) in s.match_ {
        let d = Dimension::parse(&k)
            .ok_or_else(|| PolicyError::new(format!("{path}.match.{k}"), "unknown dimension"))?;
        matches.push((d, v));
    }
    let requests = match s.requests {
        Some(r) => Some(RateLimit {
            limit: positive(r.limit, &format!("{path}.requests.limit"))?,
            window_ms: duration_ms(&r.window, &format!("{path}.requests.window"))?,
        }),
        None => None,
    };
    let (input_tokens, trim_input) = match s.input_tokens {
        None => (None, false),
        Some(RawInput::Max(v)) => (Some(positive(v, &format!("{path}.input_tokens"))?), false),
        Some(RawInput::Rule(r)) => {
            let max = positive(r.max, &format!("{path}.input_tokens.max"))?;
            let trim = match r.mode.as_deref() {
                None | Some("reject") => false,
                Some("trim") => true,
                Some(m) => {
                    return Err(PolicyError::new(
                        format!("{path}.input_tokens.mode"),
                        format!("unknown mode {m:?}; expected \"reject\" or \"trim\""),
                    ));
                }
            };
            (Some(max), trim)
        }
    };
    let total_tokens = s
        .total_tokens
        .map(|v| positive(v, &format!("{path}.total_tokens")))
        .transpose()?;
    let output_tokens = s
        .output_tokens
        .map(|o| validate_output(o, path))
        .transpose()?;
    let concurrency = match s.concurrency {
        Some(c) => Some(ConcurrencyLimit {
            limit: positive(c.limit, &format!("{path}.concurrency.limit"))?,
            lease_ttl_ms: match c.lease_ttl {
                Some(t) => duration_ms(&t, &format!("{path}.concurrency.lease_ttl"))?,
                None => NonZeroU64::new(300_000).unwrap_or(NonZeroU64::MIN),
            },
        }),
        None => None,
    };
    let budget = s
        .budget
        .map(|b| validate_budget(b, path, prices))
        .transpose()?;
    let tool_calls = match s.tool_calls {
        Some(t) => Some(BudgetLimit {
            limit: positive(t.limit, &format!("{path}.tool_calls.limit"))?,
            unit: Unit::ToolCalls,
            period: Period::parse(&t.period)
                .map_err(|m| PolicyError::new(format!("{path}.tool_calls.period"), m))?,
            alert_at: AlertAt::default(),
        }),
        None => None,
    };
    let loops = match s.loops {
        Some(l) => Some(LoopLimit {
            max_identical: positive(l.max_identical, &format!("{path}.loops.max_identical"))?,
            window_ms: duration_ms(&l.window, &format!("{path}.loops.window"))?,
        }),
        None => None,
    };
    let shadow = shadow_mode(s.mode.as_deref(), trim_input, path)?;
    let global_key = dims
        .is_empty()
        .then(|| ScopeKey::derive(&name, &dims, &Identity::default()))
        .flatten();
    Ok(ScopeRule {
        global_key,
        same_key_as: None,
        ip_prefix,
        name,
        dims,
        matches,
        requests,
        input_tokens,
        trim_input,
        output_tokens,
        total_tokens,
        concurrency,
        budget,
        tool_calls,
        loops,
        shadow,
    })
}

/// `mode`: `enforce` (the default) or `shadow`; a shadow rule cannot trim.
fn shadow_mode(mode: Option<&str>, trim_input: bool, path: &str) -> Result<bool, PolicyError> {
    let shadow = match mode {
        None | Some("enforce") => false,
        Some("shadow") => true,
        Some(m) => {
            return Err(PolicyError::new(
                format!("{path}.mode"),
                format!("unknown mode {m:?}; expected \"enforce\" or \"shadow\""),
            ));
        }
    };
    // Trimming changes the request itself, which a rule that must not change answers cannot.
    if shadow && trim_input {
        return Err(PolicyError::new(
            format!("{path}.input_tokens.mode"),
            "a shadow rule cannot trim: trimming would change the request; use \"reject\" to see which requests it would refuse",
        ));
    }
    Ok(shadow)
}

/// `key`: `global`, or dimensions joined by `/`, each once; sorted.
fn validate_dims(key: &str, path: &str) -> Result<Vec<Dimension>, PolicyError> {
    let key_path = format!("{path}.key");
    let mut dims = Vec::new();
    if key.trim() != "global" {
        for part in key.split('/') {
            let d = Dimension::parse(part.trim()).ok_or_else(|| {
                PolicyError::new(
                    &key_path,
                    format!(
                        "unknown dimension {part:?}; expected \"global\" or tenant, key, user, ip, model, operation joined by '/'"
                    ),
                )
            })?;
            if dims.contains(&d) {
                return Err(PolicyError::new(&key_path, format!("dimension {d} twice")));
            }
            dims.push(d);
        }
    }
    dims.sort();
    Ok(dims)
}

/// `output_tokens = { max, mode, default }`: the default at most the max.
fn validate_output(o: RawOutput, path: &str) -> Result<OutputLimit, PolicyError> {
    let max = positive(o.max, &format!("{path}.output_tokens.max"))?;
    let mode = match o.mode.as_deref() {
        None | Some("reject") => OutputMode::Reject,
        Some("clamp") => OutputMode::Clamp,
        Some(m) => {
            return Err(PolicyError::new(
                format!("{path}.output_tokens.mode"),
                format!("unknown mode {m:?}; expected \"reject\" or \"clamp\""),
            ));
        }
    };
    let default = match o.default {
        Some(d) => positive(d, &format!("{path}.output_tokens.default"))?,
        None => max,
    };
    if default > max {
        return Err(PolicyError::new(
            format!("{path}.output_tokens.default"),
            format!("{default} is above max {max}"),
        ));
    }
    Ok(OutputLimit { max, mode, default })
}

/// `budget = { tokens | micro_usd, period }`: money needs prices.
fn validate_budget(
    b: RawBudget,
    path: &str,
    prices: &BTreeMap<String, Price>,
) -> Result<BudgetLimit, PolicyError> {
    let bpath = format!("{path}.budget");
    let (limit, unit) = match (b.tokens, b.micro_usd) {
        (Some(t), None) => (positive(t, &format!("{bpath}.tokens"))?, Unit::Tokens),
        (None, Some(m)) => {
            if prices.is_empty() {
                return Err(PolicyError::new(
                    format!("{bpath}.micro_usd"),
                    "a money budget needs a [prices] table",
                ));
            }
            (positive(m, &format!("{bpath}.micro_usd"))?, Unit::MicroUsd)
        }
        _ => {
            return Err(PolicyError::new(
                bpath,
                "give exactly one of `tokens` or `micro_usd`",
            ));
        }
    };
    let period =
        Period::parse(&b.period).map_err(|m| PolicyError::new(format!("{bpath}.period"), m))?;
    let alert_at =
        AlertAt::of(&b.alert_at).map_err(|m| PolicyError::new(format!("{bpath}.alert_at"), m))?;
    Ok(BudgetLimit {
        limit,
        unit,
        period,
        alert_at,
    })
}

impl Period {
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
