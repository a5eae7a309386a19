//! The tool-call budget, after the budget: each round of an agent reserves one call, so that
//! rounds in flight at once cannot all take the last one; what a round emits beyond it is
//! known only from its answer, and settled then. Checked as a budget in calls
//! ([`super::budget::check`]), under its own scope (the rule's, with `/tool_calls`).

use crate::decision::Reason;
use crate::policy::{ScopeRule, Unit};
use crate::scope::ScopeKey;

use super::BudgetCheck;

/// The reason a tool-call budget refuses with.
pub const REASON: Reason = Reason::ToolCallLimit;

/// The tool-call check of `rule` in scope `key`, when the rule limits tool calls.
pub fn plan(rule: &ScopeRule, key: &ScopeKey) -> Option<BudgetCheck> {
    rule.tool_calls.map(|t| BudgetCheck {
        scope: key.child("tool_calls"),
        limit: t.limit.get(),
        unit: Unit::ToolCalls,
        period: t.period,
        amount: 1,
        alert_at: t.alert_at,
    })
}
