//! Control 5, concurrency: a lease per request in flight in every concurrency scope; a scope
//! whose leases are all held refuses. Leases expire unless renewed.
//!
//! Lua twin: `crates/redis/src/lua/controls/concurrency.lua`.

use serde::Deserialize;

use crate::clock::Millis;
use crate::decision::{Deny, Quota, Reason};
use std::num::NonZeroU64;

use crate::rule::{PolicyError, duration_ms, positive};
use crate::scope::ScopeKey;

/// The longest wait a concurrency refusal suggests: when a lease ends is not known, only when
/// it expires at the latest.
pub const RETRY_HINT_MS: u64 = 1_000;

/// The reason concurrency refuses with.
pub const REASON: Reason = Reason::ConcurrencyLimit;

/// A lease to take in one scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConcurrencyCheck {
    /// Scope.
    pub scope: ScopeKey,
    /// Leases at once.
    pub limit: u64,
    /// The per cent of the scope's leases kept for classes above the request's
    /// ([`super::reserve`]): `limit` is what is left of the scope's limit without them, and a
    /// limit set at run time keeps them the same way. Stores never read it.
    pub kept_percent: u64,
}

/// How long a lease lives without renewal unless the rule says.
const DEFAULT_LEASE_TTL_MS: u64 = 300_000;

/// The concurrency part of rule `path` as written, checked: `concurrency = { limit, lease_ttl }`.
pub fn rule(
    raw: Option<RawConcurrency>,
    path: &str,
) -> Result<Option<ConcurrencyLimit>, PolicyError> {
    raw.map(|c| {
        Ok(ConcurrencyLimit {
            limit: positive(c.limit, &format!("{path}.concurrency.limit"))?,
            lease_ttl_ms: match c.lease_ttl {
                Some(t) => duration_ms(&t, &format!("{path}.concurrency.lease_ttl"))?,
                None => NonZeroU64::new(DEFAULT_LEASE_TTL_MS).unwrap_or(NonZeroU64::MIN),
            },
        })
    })
    .transpose()
}

/// The concurrency check of `rule` in scope `key`, when the rule limits concurrency.
pub fn plan(limit: Option<ConcurrencyLimit>, key: &ScopeKey) -> Option<ConcurrencyCheck> {
    limit.map(|c| ConcurrencyCheck {
        scope: key.clone(),
        limit: c.limit.get(),
        kept_percent: 0,
    })
}

/// How long a lease of `rule` lives without renewal, when the rule limits concurrency.
pub fn lease_ttl_ms(limit: Option<ConcurrencyLimit>) -> Option<u64> {
    limit.map(|c| c.lease_ttl_ms.get())
}

/// Checks one more lease in a scope that holds `held`, the soonest of which expires at
/// `soonest` (when known): the leases left after it, or the refusal. A refusal suggests the
/// soonest expiry still ahead, at most [`RETRY_HINT_MS`], at least a millisecond.
pub fn check(
    reason: Reason,
    c: &ConcurrencyCheck,
    held: u64,
    soonest: Option<Millis>,
    now: Millis,
) -> Result<u64, Deny> {
    if held < c.limit {
        return Ok(c.limit - held - 1);
    }
    let wait = match soonest {
        Some(s) if s > now => (s - now).min(RETRY_HINT_MS),
        _ => RETRY_HINT_MS,
    };
    Err(Deny {
        reason,
        scope: c.scope.clone(),
        limit: c.limit,
        remaining: 0,
        requested: 1,
        retry_after_ms: Some(wait),
        reset_after_ms: None,
    })
}

/// The quota an admission reports for `c`, the `check`th check of its plan, for `reason`.
pub fn quota(reason: Reason, check: usize, c: &ConcurrencyCheck, remaining: u64) -> Quota {
    Quota {
        reason,
        check,
        limit: c.limit,
        remaining,
        window_ms: None,
        reset_after_ms: None,
    }
}

/// A concurrency limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConcurrencyLimit {
    /// Unfinished requests at once.
    pub limit: NonZeroU64,
    /// Lease lifetime without renewal, ms.
    pub lease_ttl_ms: NonZeroU64,
}

/// `concurrency = { limit = 2, lease_ttl = "5m" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConcurrency {
    /// Unfinished requests at once.
    pub limit: u64,
    /// How long a lease lives without renewal (default 5m).
    pub lease_ttl: Option<String>,
}
