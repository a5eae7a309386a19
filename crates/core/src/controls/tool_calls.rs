//! The tool-call budget, after the budget: each round of an agent reserves one call, so that
//! rounds in flight at once cannot all take the last one; what a round emits beyond it is
//! known only from its answer, and settled then. Checked as a budget in calls
//! ([`super::budget::check`]), under its own scope (the rule's, with `/tool_calls`).

use serde::Deserialize;

use crate::decision::Reason;
use crate::ledger::Period;
use crate::rule::{PolicyError, RawPeriod, positive};
use crate::scope::ScopeKey;

use super::budget::{AlertAt, BudgetCheck, BudgetLimit, Unit};

/// The reason a tool-call budget refuses with.
pub const REASON: Reason = Reason::ToolCallLimit;

/// The tool-call part of rule `path` as written, checked: `tool_calls = { limit, period }`.
pub fn rule(raw: Option<RawToolCalls>, path: &str) -> Result<Option<BudgetLimit>, PolicyError> {
    raw.map(|t| {
        Ok(BudgetLimit {
            limit: positive(t.limit, &format!("{path}.tool_calls.limit"))?,
            unit: Unit::ToolCalls,
            period: Period::of(&t.period)
                .map_err(|m| PolicyError::new(format!("{path}.tool_calls.period"), m))?,
            alert_at: AlertAt::default(),
            carry_cap: 0,
        })
    })
    .transpose()
}

/// The tool-call check of `rule` in scope `key`, when the rule limits tool calls.
pub fn plan(limit: Option<BudgetLimit>, key: &ScopeKey) -> Option<BudgetCheck> {
    limit.map(|t| BudgetCheck {
        scope: key.child("tool_calls"),
        limit: t.limit.get(),
        unit: Unit::ToolCalls,
        period: t.period,
        amount: 1,
        alert_at: t.alert_at,
        carry_cap: 0,
    })
}

/// `tool_calls = { limit = 50, period = "1h" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawToolCalls {
    /// Tool calls per period.
    pub limit: u64,
    /// As a budget's.
    pub period: RawPeriod,
}
