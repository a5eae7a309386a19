//! Controls 2 to 4, the token limits: input tokens, the output-token cap, total tokens. They
//! need no state, so the pipeline decides them when it makes the plan and the store reports
//! the verdict after the rate, as the order says.

use crate::decision::{Deny, Reason};
use std::num::NonZeroU64;

use crate::policy::validate::{positive, validate_output};
use crate::policy::{OutputLimit, OutputMode, PolicyError, RawInput, RawOutput, ScopeRule};
use crate::scope::ScopeKey;

/// The input limit of rule `path` as written, checked, and whether it trims: `input_tokens = N`
/// or `{ max, mode = "reject" | "trim" }`.
pub fn input_rule(
    raw: Option<RawInput>,
    path: &str,
) -> Result<(Option<NonZeroU64>, bool), PolicyError> {
    Ok(match raw {
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
    })
}

/// The total limit of rule `path` as written, checked: `total_tokens = N`.
pub fn total_rule(raw: Option<u64>, path: &str) -> Result<Option<NonZeroU64>, PolicyError> {
    raw.map(|v| positive(v, &format!("{path}.total_tokens")))
        .transpose()
}

/// The output cap of rule `path` as written, checked: `output_tokens = { max, mode, default }`.
pub fn output_rule(raw: Option<RawOutput>, path: &str) -> Result<Option<OutputLimit>, PolicyError> {
    raw.map(|o| validate_output(o, path)).transpose()
}

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
