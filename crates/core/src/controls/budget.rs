//! Control 6, the budget: input + the granted output cap is reserved at admission in every
//! budget scope, in tokens or money, and replaced by the charge at settlement. Settled,
//! reserved and this request's amount must stay within the limit of the period containing
//! now. Tool calls are budgets too ([`super::tool_calls`]), checked the same way.
//!
//! Lua twin: `crates/redis/src/lua/controls/budget.lua`.

use crate::clock::Millis;
use crate::decision::{Deny, Quota, Reason};
use crate::ledger::{Period, Usage};
use crate::pipeline::PlanError;

use crate::policy::validate::validate_budget;
use crate::policy::{AlertAt, BudgetLimit, PolicyError, Price, RawBudget, ScopeRule, Unit};
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
    prices: &crate::policy::Prices,
) -> Result<Option<BudgetLimit>, PolicyError> {
    raw.map(|b| validate_budget(b, path, prices)).transpose()
}

/// The budget check of `rule` in scope `key`: input + granted output in tokens, or its price
/// at the estimate in money (a model without a price cannot be reserved in money).
pub fn plan(
    rule: &ScopeRule,
    key: &ScopeKey,
    p: Pricing<'_>,
) -> Result<Option<BudgetCheck>, PlanError> {
    let Some(b) = rule.budget else {
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
