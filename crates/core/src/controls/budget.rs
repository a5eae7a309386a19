//! Control 6, the budget: input + the granted output cap is reserved at admission in every
//! budget scope, in tokens or money, and replaced by the charge at settlement. Settled,
//! reserved and this request's amount must stay within the limit of the period containing
//! now. Tool calls are budgets too ([`super::tool_calls`]), checked the same way.
//!
//! Lua twin: `crates/redis/src/lua/controls/budget.lua`.

use std::num::NonZeroU64;

use serde::Deserialize;

use crate::clock::Millis;
use crate::decision::{Deny, Quota, Reason};
use crate::ledger::{Period, Usage};

use crate::ledger::Price;
use crate::prices::Prices;
use crate::rule::{PolicyError, RawPeriod, percent, positive};
use crate::scope::ScopeKey;

/// A reservation to make in one scope: of tokens, money, or tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetCheck {
    /// Scope.
    pub scope: ScopeKey,
    /// Budget per period.
    pub limit: u64,
    /// Tokens or money.
    pub unit: Unit,
    /// Period.
    pub period: Period,
    /// Amount to reserve: the estimate in `unit`.
    pub amount: u64,
    /// Where alerts fire (the gateway's business: stores ignore it).
    pub alert_at: AlertAt,
    /// The most a period adds to its limit of what the one before left unused (0: none).
    pub carry_cap: u64,
}

/// What a request is priced as: its model and service tier, the price found for them, and its
/// estimate (input + granted output).
#[derive(Debug, Clone, Copy)]
pub struct Pricing<'a> {
    /// The model.
    pub model: &'a str,
    /// The service tier, when not the standard one.
    pub tier: Option<&'a str>,
    /// The price, when the policy has one.
    pub price: Option<Price>,
    /// The estimate, its fees included.
    pub estimate: &'a Usage,
    /// What the model has no price for that the request may use: refused under a money limit.
    pub unpriced: Option<&'static str>,
}

impl Pricing<'_> {
    /// The estimate's price, for a money limit in scope `key`: a model (or its tier) without a
    /// price cannot be checked against one, and the request is refused naming them.
    pub fn cost(&self, key: &ScopeKey) -> Result<u64, PlanError> {
        let (model, scope) = (self.model.to_owned(), key.to_string());
        if let Some(what) = self.unpriced {
            return Err(PlanError::UnpricedUse { model, what, scope });
        }
        if let Some(price) = self.price {
            return Ok(price.cost(self.estimate));
        }
        Err(match self.tier {
            Some(t) => PlanError::UnpricedTier {
                model,
                tier: t.to_owned(),
                scope,
            },
            None => PlanError::UnpricedModel { model, scope },
        })
    }
}

/// The budget part of rule `path` as written, checked: `budget = { tokens | micro_usd, period,
/// alert_at }` (money needs prices).
pub fn rule(
    raw: Option<RawBudget>,
    path: &str,
    prices: &Prices,
) -> Result<Option<BudgetLimit>, PolicyError> {
    raw.map(|b| validate_budget(b, path, prices)).transpose()
}

/// The budget check of `rule` in scope `key`: input + granted output in tokens, or its price
/// at the estimate in money (a model without a price cannot be reserved in money).
pub fn plan(
    limit: Option<BudgetLimit>,
    key: &ScopeKey,
    p: Pricing<'_>,
) -> Result<Option<BudgetCheck>, PlanError> {
    let Some(b) = limit else {
        return Ok(None);
    };
    let e = p.estimate;
    let amount = match b.unit {
        Unit::Tokens | Unit::ToolCalls => e.input_tokens.saturating_add(e.output_tokens),
        Unit::MicroUsd => p.cost(key)?,
    };
    Ok(Some(BudgetCheck {
        scope: key.clone(),
        limit: b.limit.get(),
        unit: b.unit,
        period: b.period,
        amount,
        alert_at: b.alert_at,
        carry_cap: b.carry_cap,
    }))
}

/// What a period adds to `limit` of what the period just before it left unused, at most `cap`:
/// that period's limit (its own carry included) less its settled and reserved amounts. A
/// period with no state before it carries nothing (a scope's first period, or one after an
/// idle period).
pub fn carried(cap: u64, limit: u64, before: Option<(u64, u64)>) -> u64 {
    match before {
        Some((carry, committed)) if cap > 0 => limit
            .saturating_add(carry)
            .saturating_sub(committed)
            .min(cap),
        _ => 0,
    }
}

/// [`check`] in a period that carries `carry` over from the one before: it counts in what is
/// left, and the limit reported stays the rule's.
pub fn check_carrying(
    reason: Reason,
    place: usize,
    (c, carry): (&BudgetCheck, u64),
    committed: u64,
    span: (Millis, Millis),
    now: Millis,
) -> Result<Quota, Deny> {
    if carry == 0 {
        return check(reason, place, c, committed, span, now);
    }
    let with = BudgetCheck {
        limit: c.limit.saturating_add(carry),
        ..c.clone()
    };
    match check(reason, place, &with, committed, span, now) {
        Ok(q) => Ok(Quota {
            limit: c.limit,
            ..q
        }),
        Err(d) => Err(Deny {
            limit: c.limit,
            ..d
        }),
    }
}

/// Checks `c`'s reservation in a scope that has `committed` (settled + reserved) in the
/// period `[start, end)` containing `now`: the quota after it, reported as the `check`th
/// check of its plan for `reason`, or the refusal. A request larger than the whole limit is told no wait: no reset
/// will admit it.
pub fn check(
    reason: Reason,
    check: usize,
    c: &BudgetCheck,
    committed: u64,
    (start, end): (Millis, Millis),
    now: Millis,
) -> Result<Quota, Deny> {
    let reset = end.saturating_sub(now);
    if committed.saturating_add(c.amount) > c.limit {
        return Err(Deny {
            reason,
            scope: c.scope.clone(),
            limit: c.limit,
            remaining: c.limit.saturating_sub(committed),
            requested: c.amount,
            retry_after_ms: (c.amount <= c.limit).then_some(reset),
            reset_after_ms: Some(reset),
        });
    }
    Ok(Quota {
        reason,
        check,
        limit: c.limit,
        remaining: c.limit - committed - c.amount,
        window_ms: Some(end.saturating_sub(start)),
        reset_after_ms: Some(reset),
    })
}

/// Whether `amount` more fits in `headroom` (what a limit has left).
pub fn fits(amount: u64, headroom: u64) -> bool {
    amount <= headroom
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

/// `budget = { tokens = 100000, period = "day" }` or `{ micro_usd = 5000000, period = "month" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    /// A budget in tokens (input + output).
    pub tokens: Option<u64>,
    /// A budget in money, integer micro-units.
    pub micro_usd: Option<u64>,
    /// `day`, `month` (UTC calendar), a fixed duration such as `1h`, `7d`, or a calendar in a
    /// zone (`{ every = "month", zone = "Europe/Berlin", starts = "1 09:00" }`).
    pub period: RawPeriod,
    /// Per cent of the limit at which an alert fires, once per scope and period.
    #[serde(default)]
    pub alert_at: Vec<u64>,
    /// What a period leaves unused is added to the next one's, up to this share of the limit
    /// (`"25%"`); off by default.
    pub carry_over: Option<String>,
}

/// `budget = { tokens | micro_usd, period }`: money needs prices.
pub(crate) fn validate_budget(
    b: RawBudget,
    path: &str,
    prices: &Prices,
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
        Period::of(&b.period).map_err(|m| PolicyError::new(format!("{bpath}.period"), m))?;
    let alert_at =
        AlertAt::of(&b.alert_at).map_err(|m| PolicyError::new(format!("{bpath}.alert_at"), m))?;
    let carry_cap = match b.carry_over.as_deref() {
        None => 0,
        Some(share) => {
            let pct = percent(share, &format!("{bpath}.carry_over"))?;
            limit.get().saturating_mul(pct) / 100
        }
    };
    Ok(BudgetLimit {
        limit,
        unit,
        period,
        alert_at,
        carry_cap,
    })
}

/// A request the policy cannot price.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A money limit applies but the model has no price.
    #[error("model {model:?} has no price, and scope {scope} has a money limit")]
    UnpricedModel {
        /// The model.
        model: String,
        /// The scope with the money limit.
        scope: String,
    },
    /// A money limit applies but the model has no price for something the request may use.
    #[error("model {model:?} has no price for {what}, and scope {scope} has a money limit")]
    UnpricedUse {
        /// The model.
        model: String,
        /// What it has no price for (`web search`, `audio input`...).
        what: &'static str,
        /// The scope with the money limit.
        scope: String,
    },
    /// A money limit applies but the service tier asked for has no price for the model.
    #[error(
        "service tier {tier:?} has no price for model {model:?}, and scope {scope} has a money limit"
    )]
    UnpricedTier {
        /// The model.
        model: String,
        /// The tier.
        tier: String,
        /// The scope with the money limit.
        scope: String,
    },
}
