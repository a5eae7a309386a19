//! Loop detection, last: a request's repeats (the same model, messages and tools) are counted
//! like attempts in a counter of the scope's own per fingerprint ([`super::rate::count`]) and
//! refuse after the budgets passed; the history's most repeated tool call is judged without
//! state.

use crate::decision::{Deny, Reason};
use crate::policy::validate::{duration_ms, positive};
use crate::policy::{LoopLimit, PolicyError, RawLoops, ScopeRule};
use crate::scope::ScopeKey;

use super::RateCheck;

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
pub fn plan(rule: &ScopeRule, key: &ScopeKey, fingerprint: Option<u64>) -> Option<RateCheck> {
    let l = rule.loops?;
    let fp = fingerprint?;
    Some(RateCheck {
        scope: key.child(&format!("repeat:{fp:016x}")),
        limit: l.max_identical.get(),
        window_ms: l.window_ms.get(),
    })
}

/// The refusal of a history whose most repeated tool call appears `repeats` times, when the
/// rule detects loops and that is over its limit.
pub fn history_verdict(rule: &ScopeRule, key: &ScopeKey, repeats: u64) -> Option<Deny> {
    let max = rule.loops?.max_identical.get();
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
