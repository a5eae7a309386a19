//! The parts of a plan decided from the policy alone: the token limits' verdict, the budget
//! reservations, loop detection, and what an abandoned request is charged.

use super::*;

/// Controls 2 to 4, decided here without a store: the first input limit exceeded, else the
/// first output cap, else the first total limit.
pub(super) fn token_verdict(
    policy: &Policy,
    scopes: &[Scoped],
    input: u64,
    granted: u64,
) -> Option<Deny> {
    let rule = |i: usize| &policy.scopes[i];
    let token_deny = |reason: Reason, scope: &ScopeKey, limit: u64, requested: u64| Deny {
        reason,
        scope: scope.clone(),
        limit,
        remaining: limit,
        requested,
        retry_after_ms: None,
        reset_after_ms: None,
    };
    let total = input.saturating_add(granted);
    scopes
        .iter()
        .find_map(|(i, k)| {
            rule(*i)
                .input_tokens
                .filter(|l| input > l.get())
                .map(|l| token_deny(Reason::InputTokenLimit, k, l.get(), input))
        })
        .or_else(|| {
            scopes.iter().find_map(|(i, k)| {
                rule(*i)
                    .output_tokens
                    .filter(|o| o.mode == OutputMode::Reject && granted > o.max.get())
                    .map(|o| token_deny(Reason::OutputTokenLimit, k, o.max.get(), granted))
            })
        })
        .or_else(|| {
            scopes.iter().find_map(|(i, k)| {
                rule(*i)
                    .total_tokens
                    .filter(|l| total > l.get())
                    .map(|l| token_deny(Reason::TotalTokenLimit, k, l.get(), total))
            })
        })
}

/// The reservation in every budget scope: input + granted output in tokens, or its price at
/// the estimate in money (a model without a price cannot be reserved in money).
pub(super) fn budgets(
    policy: &Policy,
    scopes: &[Scoped],
    (model, tier): (&str, Option<&str>),
    price: Option<Price>,
    estimate: &Usage,
) -> Result<Vec<BudgetCheck>, PlanError> {
    let total = estimate.input_tokens.saturating_add(estimate.output_tokens);
    let mut budget = Vec::new();
    for (i, k) in scopes {
        let Some(b) = policy.scopes[*i].budget else {
            continue;
        };
        let amount = match b.unit {
            Unit::Tokens | Unit::ToolCalls => total,
            Unit::MicroUsd => match price {
                Some(p) => p.cost(estimate),
                None => {
                    let (model, scope) = (model.to_owned(), k.to_string());
                    return Err(match tier {
                        Some(t) => PlanError::UnpricedTier {
                            model,
                            tier: t.to_owned(),
                            scope,
                        },
                        None => PlanError::UnpricedModel { model, scope },
                    });
                }
            },
        };
        budget.push(BudgetCheck {
            scope: k.clone(),
            limit: b.limit.get(),
            unit: b.unit,
            period: b.period,
            amount,
            alert_at: b.alert_at,
        });
    }
    // Tool calls after every budget, as their control comes after the budget's. Each round
    // reserves one call: rounds in flight at once cannot all take the last one. What a round
    // emits beyond it is known only from its answer, and settled then.
    for (i, k) in scopes {
        if let Some(t) = policy.scopes[*i].tool_calls {
            budget.push(BudgetCheck {
                scope: k.child("tool_calls"),
                limit: t.limit.get(),
                unit: Unit::ToolCalls,
                period: t.period,
                amount: 1,
                alert_at: t.alert_at,
            });
        }
    }
    Ok(budget)
}

/// Loop detection in every scope whose rule has it: the request's repeats, counted in a
/// counter of the scope's own per fingerprint, and the verdict on its history's tool calls.
pub(super) fn loops(
    policy: &Policy,
    scopes: &[Scoped],
    facts: &RequestFacts,
) -> (Vec<RateCheck>, Option<Deny>) {
    let mut repeats = Vec::new();
    let mut verdict = None;
    for (i, k) in scopes {
        let Some(l) = policy.scopes[*i].loops else {
            continue;
        };
        let max = l.max_identical.get();
        if let Some(fp) = facts.fingerprint {
            repeats.push(RateCheck {
                scope: k.child(&format!("repeat:{fp:016x}")),
                limit: max,
                window_ms: l.window_ms.get(),
            });
        }
        if verdict.is_none() && facts.tool_call_repeats > max {
            verdict = Some(Deny {
                reason: Reason::LoopDetected,
                scope: k.clone(),
                limit: max,
                remaining: 0,
                requested: facts.tool_call_repeats,
                retry_after_ms: None,
                reset_after_ms: None,
            });
        }
    }
    (repeats, verdict)
}

/// What an abandoned request is charged, as the policy says.
pub(super) fn expired_usage(policy: &Policy, estimate: Usage) -> Usage {
    // Without cache writes: the Redis ticket keeps input, cached input and output only, and
    // what an abandoned request wrote to a cache is not known.
    let estimate = Usage {
        cache_write_1h_tokens: 0,
        ..estimate
    };
    match policy.expired_charge {
        // With the round's one reserved tool call, which it may have made.
        crate::policy::ExpiredCharge::Full => Usage {
            tool_calls: 1,
            ..estimate
        },
        crate::policy::ExpiredCharge::Input => Usage {
            output_tokens: 0,
            ..estimate
        },
        crate::policy::ExpiredCharge::None => Usage::default(),
    }
}
