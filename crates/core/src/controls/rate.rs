//! Control 1, the request rate: every attempt counts in every rate scope, admitted or not,
//! in a sliding window (two fixed windows, the previous one weighted by overlap). The same
//! counting detects a request's repeats ([`super::loops`]).
//!
//! Lua twin: `crates/redis/src/lua/controls/rate.lua`.

use std::num::NonZeroU64;

use serde::Deserialize;

use crate::clock::Millis;
use crate::decision::{Deny, Quota, Reason};
use crate::ledger::RateWindow;
use crate::rule::{PolicyError, duration_ms, positive};
use crate::scope::ScopeKey;

/// The reason the request rate refuses with.
pub const REASON: Reason = Reason::RequestRateLimit;

/// A rate check in one scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateCheck {
    /// Scope.
    pub scope: ScopeKey,
    /// Attempts per window.
    pub limit: u64,
    /// Window, ms.
    pub window_ms: u64,
}

/// The rate part of rule `path` as written, checked: `requests = { limit, window }`.
pub fn rule(raw: Option<RawRequests>, path: &str) -> Result<Option<RateLimit>, PolicyError> {
    raw.map(|r| {
        Ok(RateLimit {
            limit: positive(r.limit, &format!("{path}.requests.limit"))?,
            window_ms: duration_ms(&r.window, &format!("{path}.requests.window"))?,
        })
    })
    .transpose()
}

/// The rate check of `rule` in scope `key`, when the rule limits the request rate.
pub fn plan(limit: Option<RateLimit>, key: &ScopeKey) -> Option<RateCheck> {
    limit.map(|r| RateCheck {
        scope: key.clone(),
        limit: r.limit.get(),
        window_ms: r.window_ms.get(),
    })
}

/// What counting one attempt in one scope came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    /// Whether the attempt took the scope over its limit.
    pub over: bool,
    /// Attempts left in the window after this one.
    pub remaining: u64,
    /// Until the current fixed window ends, ms.
    pub reset_after_ms: u64,
    /// Over the limit: how long until one more attempt would pass, assuming none arrives
    /// before. 0 otherwise.
    pub retry_after_ms: u64,
}

/// Counts one attempt at `now` in the window `w` (rolled to `now` first); a window of
/// another length starts again (the policy changed).
pub fn count(w: &mut (u64, RateWindow), c: &RateCheck, now: Millis) -> Counted {
    if w.0 != c.window_ms {
        *w = (c.window_ms, RateWindow::default());
    }
    let win = &mut w.1;
    let over = !win.attempt(now, c.window_ms, c.limit);
    Counted {
        over,
        remaining: win.remaining(now, c.window_ms, c.limit),
        reset_after_ms: (win.start + c.window_ms).saturating_sub(now),
        retry_after_ms: if over {
            win.retry_after(now, c.window_ms, c.limit)
        } else {
            0
        },
    }
}

/// What a window has left at `now`, read, not counted (its twin: `rate_peek` in `rate.lua`):
/// never over, the attempts left and the time until the fixed window ends. A window of
/// another length (the policy changed) reads as empty, as counting would start it again.
pub fn peek(w: &(u64, RateWindow), c: &RateCheck, now: Millis) -> Counted {
    let mut win = if w.0 == c.window_ms {
        w.1
    } else {
        RateWindow::default()
    };
    win.roll(now, c.window_ms);
    Counted {
        over: false,
        remaining: win.remaining(now, c.window_ms, c.limit),
        reset_after_ms: (win.start + c.window_ms).saturating_sub(now),
        retry_after_ms: 0,
    }
}

/// The refusal of an attempt that `counted` found over the limit of `c`, for `reason` (the
/// rate's, or a repeat's).
pub fn deny(c: &RateCheck, counted: Counted, reason: Reason) -> Deny {
    Deny {
        reason,
        scope: c.scope.clone(),
        limit: c.limit,
        remaining: 0,
        requested: 1,
        retry_after_ms: Some(counted.retry_after_ms),
        reset_after_ms: Some(counted.reset_after_ms),
    }
}

/// The quota an admission reports for `c`, the `check`th check of its plan, for `reason`.
pub fn quota(reason: Reason, check: usize, c: &RateCheck, counted: Counted) -> Quota {
    Quota {
        reason,
        check,
        limit: c.limit,
        remaining: counted.remaining,
        window_ms: Some(c.window_ms),
        reset_after_ms: Some(counted.reset_after_ms),
    }
}

/// Attempts left at `now` in a window that has counted `w` (nothing counted now).
pub fn remaining(w: &RateWindow, c: &RateCheck, now: Millis) -> u64 {
    w.remaining(now, c.window_ms, c.limit)
}

/// Attempts per sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Attempts per window.
    pub limit: NonZeroU64,
    /// Window length in ms.
    pub window_ms: NonZeroU64,
}

/// `requests = { limit = 60, window = "1m" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRequests {
    /// Attempts per window.
    pub limit: u64,
    /// Window length, e.g. `60s`, `1m`, `1h`.
    pub window: String,
}
