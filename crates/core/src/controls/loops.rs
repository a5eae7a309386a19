//! Loop detection, last: a request's repeats (the same model, messages and tools) are counted
//! like attempts in a counter of the scope's own per fingerprint ([`super::rate::count`]) and
//! refuse after the budgets passed; the history's most repeated tool call is judged without
//! state.

use std::num::NonZeroU64;

use serde::Deserialize;

use crate::decision::{Deny, Reason};
use crate::rule::{PolicyError, duration_ms, positive};
use crate::scope::ScopeKey;

use super::rate::RateCheck;

/// The reason loop detection refuses with.
pub const REASON: Reason = Reason::LoopDetected;

/// The loop part of rule `path` as written, checked: `loops = { max_identical, window }`.
pub fn rule(raw: Option<RawLoops>, path: &str) -> Result<Option<LoopLimit>, PolicyError> {
    raw.map(|l| {
        Ok(LoopLimit {
            max_identical: positive(l.max_identical, &format!("{path}.loops.max_identical"))?,
            window_ms: duration_ms(&l.window, &format!("{path}.loops.window"))?,
        })
    })
    .transpose()
}

/// The repeat counter of `rule` in scope `key` for a request whose fingerprint is
/// `fingerprint`, when the rule detects loops.
pub fn plan(
    limit: Option<LoopLimit>,
    key: &ScopeKey,
    fingerprint: Option<u64>,
) -> Option<RateCheck> {
    let l = limit?;
    let fp = fingerprint?;
    Some(RateCheck {
        scope: key.child(&format!("repeat:{fp:016x}")),
        limit: l.max_identical.get(),
        window_ms: l.window_ms.get(),
    })
}

/// The refusal of a history whose most repeated tool call appears `repeats` times, when the
/// rule detects loops and that is over its limit.
pub fn history_verdict(limit: Option<LoopLimit>, key: &ScopeKey, repeats: u64) -> Option<Deny> {
    let max = limit?.max_identical.get();
    (repeats > max).then(|| Deny {
        reason: REASON,
        scope: key.clone(),
        limit: max,
        remaining: 0,
        requested: repeats,
        retry_after_ms: None,
        reset_after_ms: None,
    })
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

/// `loops = { max_identical = 3, window = "10m" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLoops {
    /// How many identical requests may be sent within the window, and how often one tool call
    /// (name and arguments) may appear in one request's history.
    pub max_identical: u64,
    /// The window of request repeats, e.g. `10m`.
    pub window: String,
}
