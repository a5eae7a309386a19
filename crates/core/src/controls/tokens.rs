//! Controls 2 to 4, the token limits: input tokens, the output-token cap, total tokens. They
//! need no state, so the pipeline decides them when it makes the plan and the store reports
//! the verdict after the rate, as the order says.

use crate::decision::{Deny, Reason};
use crate::policy::{OutputMode, ScopeRule};
use crate::scope::ScopeKey;

/// The first input limit exceeded, else the first output cap (in reject mode), else the first
/// total limit, among `rules` in policy order. `granted` is the output cap granted.
pub fn verdict<'a>(
    rules: impl Iterator<Item = (&'a ScopeRule, &'a ScopeKey)> + Clone,
    input: u64,
    granted: u64,
) -> Option<Deny> {
    let deny = |reason: Reason, scope: &ScopeKey, limit: u64, requested: u64| Deny {
        reason,
        scope: scope.clone(),
        limit,
        remaining: limit,
        requested,
        retry_after_ms: None,
        reset_after_ms: None,
    };
    let total = input.saturating_add(granted);
    rules
        .clone()
        .find_map(|(r, k)| {
            r.input_tokens
                .filter(|l| input > l.get())
                .map(|l| deny(Reason::InputTokenLimit, k, l.get(), input))
        })
        .or_else(|| {
            rules.clone().find_map(|(r, k)| {
                r.output_tokens
                    .filter(|o| o.mode == OutputMode::Reject && granted > o.max.get())
                    .map(|o| deny(Reason::OutputTokenLimit, k, o.max.get(), granted))
            })
        })
        .or_else(|| {
            rules.clone().find_map(|(r, k)| {
                r.total_tokens
                    .filter(|l| total > l.get())
                    .map(|l| deny(Reason::TotalTokenLimit, k, l.get(), total))
            })
        })
}
