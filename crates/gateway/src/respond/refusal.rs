//! Refusals at the edge: a decision's denial becomes its status, its headers (one wait in all
//! of them) and a message whose every number carries its unit.

use super::class::{Class, Refusal};
use tollgate_core::decision::Recourse;
use tollgate_core::{Deny, Quota, Reason, Unit};

use super::error::{Advice, ApiError, Denied, Param, Words};
use super::{LONG_WAIT_MS, inconsistent, killed};

/// The response to a refusal: 429 for rate, concurrency, budget, tool calls and loops (a loop
/// with `x-should-retry: false`, since sending it again only repeats it); 400 for token limits.
/// A budget's amounts are in `unit` (the refusing scope's), money in dollars.
///
/// One wait: `RateLimit`'s `t`, `x-ratelimit-reset-*` and `retry-after-ms` all name when a
/// retry would be admitted, refused attempts counted; `retry-after` and `retry-after-ms` add a
/// jitter of up to a tenth of the wait, at most one second, so that clients refused together do
/// not all come back at once. A wait longer than an SDK sleeps (a minute) says
/// `x-should-retry: false`.
pub fn deny_in(d: &Deny, unit: Option<Unit>) -> ApiError {
    let class = match d.reason.recourse() {
        Recourse::Wait | Recourse::Stop => Class::Refused(Refusal::Limit),
        Recourse::Budget => Class::Refused(Refusal::Quota),
        Recourse::Shrink => Class::Refused(Refusal::TooLarge),
    };
    let mut advice = Advice {
        cause: Some((d.reason.code(), d.scope.key().to_owned())),
        ..Advice::default()
    };
    let mut param = None;
    if d.reason.is_retryable() {
        let quota = Quota {
            reason: d.reason,
            check: 0,
            limit: d.limit,
            remaining: 0,
            window_ms: None,
            reset_after_ms: d.retry_after_ms.or(d.reset_after_ms),
        };
        advice.limit = Some((quota, d.scope.rule().to_owned(), unit));
        match d.retry_after_ms {
            Some(ms) => {
                let ms = ms.max(1);
                let sent = ms.saturating_add(jitter_ms(ms));
                advice.retry_after_ms = Some(sent);
                // Judged on the wait sent, jitter included: what an SDK would sleep.
                advice.no_retry = sent > LONG_WAIT_MS;
            }
            // Larger than the whole budget: waiting cannot help.
            None => advice.no_retry = true,
        }
    } else if d.reason.recourse() == Recourse::Stop {
        advice.no_retry = true;
    } else {
        param = Some(match d.reason {
            Reason::InputTokenLimit => Param::Input,
            _ => Param::OutputCap,
        });
    }
    ApiError {
        class,
        code: d.reason.code().to_owned(),
        words: Words::Denied(Box::new(Denied {
            deny: d.clone(),
            unit,
            allowances: [0; 3],
            cache_writes: 0,
        })),
        param,
        advice,
    }
}

/// [`deny_in`] for a refusal whose budget unit is not known.
pub fn deny(d: &Deny) -> ApiError {
    deny_in(d, None)
}

impl Denied {
    /// What the refusal says: each number with its unit, the wait in words and as an instant,
    /// and what the input counted included besides the body.
    pub fn words(&self) -> String {
        let d = &self.deny;
        // A budget's numbers are in its scope's unit; every other control's in its own.
        let amount = |n: u64| match (d.reason, self.unit) {
            (Reason::BudgetLimit, Some(Unit::MicroUsd)) => dollars(n),
            (Reason::BudgetLimit, Some(Unit::ToolCalls)) => format!("{n} tool calls"),
            (r, _) => r.amount(n),
        };
        let what = d.asked(&amount(d.requested));
        let mut m = format!(
            "{} for scope {}: limit {}, remaining {}",
            d.reason.code(),
            d.scope,
            amount(d.limit),
            amount(d.remaining)
        );
        if !what.is_empty() {
            m.push_str("; ");
            m.push_str(&what);
        }
        m.push('.');
        if let Some(ms) = d.retry_after_ms.filter(|_| d.reason.is_retryable()) {
            m.push_str(&format!(" Retry {}.", in_words(ms.max(1))));
        }
        self.push_allowances(&mut m);
        if d.reason == Reason::BudgetLimit && self.cache_writes > 0 {
            m.push_str(&format!(
                " The reservation prices the {} input tokens that may be written to the prompt \
                 cache at twice the input price, the one-hour write price.",
                self.cache_writes
            ));
        }
        m
    }

    fn push_allowances(&self, m: &mut String) {
        const WHAT: [&str; 3] = [
            "for the earlier context the upstream keeps",
            "for what the tools the upstream runs may fetch",
            "for the files and documents named by URL or id, which the upstream fetches",
        ];
        let parts: Vec<String> = self
            .allowances
            .iter()
            .zip(WHAT)
            .filter(|(n, _)| **n > 0)
            .map(|(n, what)| format!("{n} {what}"))
            .collect();
        if self.deny.reason.counts_input() && !parts.is_empty() {
            m.push_str(&format!(
                " The input counted includes {}.",
                parts.join(" and ")
            ));
        }
    }
}

pub use tollgate_core::ledger::dollars;

/// A wait in words with its instant: `in 6h 46m 3s (at 2026-12-04T19:03:00Z)`.
pub fn in_words(ms: u64) -> String {
    let secs = ms.div_ceil(1000);
    let at = std::time::SystemTime::now() + std::time::Duration::from_millis(ms);
    format!(
        "in {} (at {})",
        humantime::format_duration(std::time::Duration::from_secs(secs)),
        humantime::format_rfc3339_seconds(at)
    )
}

/// Up to a tenth of `wait_ms`, at most a second, drawn anew for each refusal.
pub fn jitter_ms(wait_ms: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let bound = (wait_ms / 10).min(1000);
    if bound == 0 {
        return 0;
    }
    // Each `RandomState` is keyed afresh: a cheap draw that needs no generator of its own.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(wait_ms);
    h.finish() % (bound + 1)
}

/// The response to a refused decision: a denial (its budget amounts in `unit`) or a kill
/// switch.
pub fn refusal_in(d: &tollgate_core::Decision, unit: Option<Unit>) -> ApiError {
    match d {
        tollgate_core::Decision::Deny(d) => deny_in(d, unit),
        tollgate_core::Decision::Killed(k) => killed(k),
        tollgate_core::Decision::Admit(_) => inconsistent(),
    }
}

/// The response to a refused decision: a denial or a kill switch.
pub fn refusal(d: &tollgate_core::Decision) -> ApiError {
    match d {
        tollgate_core::Decision::Deny(d) => deny(d),
        tollgate_core::Decision::Killed(k) => killed(k),
        tollgate_core::Decision::Admit(_) => inconsistent(),
    }
}
