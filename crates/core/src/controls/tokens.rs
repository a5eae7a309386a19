//! Controls 2 to 4, the token limits: input tokens, the output-token cap, total tokens. They
//! need no state, so the pipeline decides them when it makes the plan and the store reports
//! the verdict after the rate, as the order says.

use serde::Deserialize;

use crate::decision::{Deny, Reason};
use std::num::NonZeroU64;

use crate::rule::{PolicyError, positive};
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

/// A rule's three token limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Input-token limit.
    pub input_tokens: Option<NonZeroU64>,
    /// Output-token cap.
    pub output_tokens: Option<OutputLimit>,
    /// Total-token limit.
    pub total_tokens: Option<NonZeroU64>,
}

/// The first input limit exceeded, else the first output cap (in reject mode), else the first
/// total limit, among `rules` in policy order. `granted` is the output cap granted.
pub fn verdict<'a>(
    rules: impl Iterator<Item = (Limits, &'a ScopeKey)> + Clone,
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

/// `input_tokens = 8000` or `input_tokens = { max = 8000, mode = "trim" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RawInput {
    /// The limit; a request above it is refused.
    Max(u64),
    /// The limit and what happens above it.
    Rule(RawInputRule),
}

/// `{ max = 8000, mode = "trim" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawInputRule {
    /// The limit.
    pub max: u64,
    /// `reject` (default: a request above it is refused) or `trim` (its oldest turns are
    /// dropped until it fits, and it is refused only if it still does not).
    pub mode: Option<String>,
}

/// `output_tokens = { max = 1000, mode = "clamp", default = 512 }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOutput {
    /// The cap.
    pub max: u64,
    /// `reject` (a request over the cap is refused) or `clamp` (it is lowered to the cap).
    pub mode: Option<String>,
    /// The cap given to a request that states none (defaults to `max`).
    pub default: Option<u64>,
}

/// `output_tokens = { max, mode, default }`: the default at most the max.
pub(crate) fn validate_output(o: RawOutput, path: &str) -> Result<OutputLimit, PolicyError> {
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
