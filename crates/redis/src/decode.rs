//! Wire decoding: the script's replies back into decisions and endings. Every reply kind and
//! reason the script writes is named in [`ADMIT_REPLIES`], [`FINISH_REPLIES`] and
//! [`STORE_REASONS`], which a test checks against the script's source.

use redis::Value;

use crate::contract::{
    AdmitReply, BudgetQuota, DenyReply, DoneReply, EndedReply, KilledReply, LeaseQuota, RateQuota,
    Renewed,
};
use tollgate_core::pipeline::Plan;
use tollgate_core::{
    Admitted, Decision, Deny, Ending, Finish, Period, Quota, Reason, Renewal, ShadowOutcome,
    StoreError,
};

/// Every reply kind an admission may get from the script.
pub const ADMIT_REPLIES: [&str; 8] = [
    "admit",
    "deny",
    "token",
    "loop",
    "dup",
    "lost",
    "uninitialised",
    "killed",
];
/// The reply kinds of an admission with its shadow plan: its own (the request's reply and the
/// shadow's follow it), and the shadow's besides a refusal.
pub const SHADOW_REPLIES: [&str; 3] = ["shadowed", "held", "passed"];
/// Every reply kind a settlement or release may get from the script.
pub const FINISH_REPLIES: [&str; 3] = ["done", "ended", "unknown"];
/// Every reply kind a renewal may get from the script.
pub const RENEW_REPLIES: [&str; 2] = ["renewed", "gone"];
/// The other reply kinds: an undone part of a sharded admission (best effort: not read), and
/// an item whose script step failed (its message follows).
pub const OTHER_REPLIES: [&str; 2] = ["undone", "error"];
/// The controls the script itself decides (the token controls are decided before it runs),
/// named in a `deny` reply by their reason codes.
pub const STORE_REASONS: [Reason; 5] = [
    Reason::RequestRateLimit,
    Reason::ConcurrencyLimit,
    Reason::BudgetLimit,
    Reason::ToolCallLimit,
    Reason::LoopDetected,
];

pub(crate) fn int(v: &Value) -> Result<i64, StoreError> {
    match v {
        Value::Int(i) => Ok(*i),
        other => Err(StoreError::Protocol(format!(
            "expected an integer, got {other:?}"
        ))),
    }
}

pub(crate) fn text(v: &Value) -> Result<String, StoreError> {
    match v {
        Value::BulkString(b) => Ok(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Ok(s.clone()),
        other => Err(StoreError::Protocol(format!(
            "expected a string, got {other:?}"
        ))),
    }
}

pub(crate) fn items(v: Value) -> Result<Vec<Value>, StoreError> {
    match v {
        Value::Array(a) => Ok(a),
        other => Err(StoreError::Protocol(format!(
            "expected an array, got {other:?}"
        ))),
    }
}

pub(crate) fn opt_ms(v: i64) -> Option<u64> {
    u64::try_from(v).ok()
}

/// Turns the admit script's answer into a decision, with the plan's scopes and limits.
pub(crate) fn decision(plan: &Plan, reply: Vec<Value>) -> Result<Decision, StoreError> {
    let kind = reply.first().map(text).transpose()?.unwrap_or_default();
    let num = |i: usize| {
        reply
            .get(i)
            .ok_or_else(|| StoreError::Protocol(format!("short reply: {reply:?}")))
            .and_then(int)
    };
    match kind.as_str() {
        "admit" => {
            let expires_at = num(AdmitReply::ExpiresAt.at())?.max(0) as u64;
            let mut quotas = Vec::new();
            let mut i = AdmitReply::LEN;
            for (check, r) in plan.rate.iter().enumerate() {
                quotas.push(Quota {
                    reason: Reason::RequestRateLimit,
                    check,
                    limit: r.limit,
                    remaining: num(i + RateQuota::Remaining.at())?.max(0) as u64,
                    window_ms: Some(r.window_ms),
                    reset_after_ms: opt_ms(num(i + RateQuota::Reset.at())?),
                });
                i += RateQuota::LEN;
            }
            for (check, c) in plan.concurrency.iter().enumerate() {
                quotas.push(Quota {
                    reason: Reason::ConcurrencyLimit,
                    check,
                    limit: c.limit,
                    remaining: num(i + LeaseQuota::Remaining.at())?.max(0) as u64,
                    window_ms: None,
                    reset_after_ms: None,
                });
                i += LeaseQuota::LEN;
            }
            for (check, b) in plan.budget.iter().enumerate() {
                let reset = opt_ms(num(i + BudgetQuota::Reset.at())?);
                quotas.push(Quota {
                    reason: b.unit.reason(),
                    check,
                    limit: b.limit,
                    remaining: num(i + BudgetQuota::Remaining.at())?.max(0) as u64,
                    window_ms: match b.period {
                        Period::Fixed(len) => Some(len),
                        Period::CalendarMonth => {
                            let (_, start, end) =
                                b.period.at(expires_at.saturating_sub(plan.ttl_ms));
                            Some(end - start)
                        }
                    },
                    reset_after_ms: reset,
                });
                i += BudgetQuota::LEN;
            }
            Ok(Decision::Admit(Admitted {
                max_output_tokens: plan.max_output_tokens,
                expires_at,
                quotas,
                fail_open: false,
            }))
        }
        "deny" => denial(plan, &reply, num),
        "token" => plan
            .token_verdict
            .clone()
            .map(Decision::Deny)
            .ok_or_else(|| StoreError::Protocol("token denial without a verdict".into())),
        "loop" => plan
            .loop_verdict
            .clone()
            .map(Decision::Deny)
            .ok_or_else(|| StoreError::Protocol("loop denial without a verdict".into())),
        "dup" => Err(StoreError::DuplicateRequestId(plan.request_id.clone())),
        "lost" => Err(StoreError::StateLost),
        "uninitialised" => Err(StoreError::Uninitialised),
        "killed" => Ok(Decision::Killed(tollgate_core::decision::Killed {
            target: reply
                .get(KilledReply::Target.at())
                .map(text)
                .transpose()?
                .unwrap_or_default(),
            reason: reply
                .get(KilledReply::Reason.at())
                .map(text)
                .transpose()?
                .unwrap_or_default(),
        })),
        other => Err(StoreError::Protocol(format!(
            "unknown admit reply {other:?}"
        ))),
    }
}

/// A refusal by a control the script decides, read by the contract's `deny` layout: its
/// reason, the refusing scope (by its index among its control's scopes), what is left and the
/// waits.
fn denial(
    plan: &Plan,
    reply: &[Value],
    num: impl Fn(usize) -> Result<i64, StoreError>,
) -> Result<Decision, StoreError> {
    let code = reply
        .get(DenyReply::Reason.at())
        .map(text)
        .transpose()?
        .unwrap_or_default();
    let reason = STORE_REASONS
        .into_iter()
        .find(|r| r.code() == code)
        .ok_or_else(|| StoreError::Protocol(format!("unknown reason {code:?}")))?;
    let idx = usize::try_from(num(DenyReply::Check.at())?)
        .map_err(|_| StoreError::Protocol("bad scope index".into()))?;
    let missing = || StoreError::Protocol(format!("scope index {idx} out of range"));
    let (scope, limit, requested) = match reason {
        Reason::RequestRateLimit => plan.rate.get(idx).map(|r| (r.scope.clone(), r.limit, 1)),
        Reason::ConcurrencyLimit => plan
            .concurrency
            .get(idx)
            .map(|c| (c.scope.clone(), c.limit, 1)),
        Reason::LoopDetected => plan.repeats.get(idx).map(|r| (r.scope.clone(), r.limit, 1)),
        _ => plan
            .budget
            .get(idx)
            .map(|b| (b.scope.clone(), b.limit, b.amount)),
    }
    .ok_or_else(missing)?;
    Ok(Decision::Deny(Deny {
        reason,
        scope,
        limit,
        remaining: num(DenyReply::Remaining.at())?.max(0) as u64,
        requested,
        retry_after_ms: opt_ms(num(DenyReply::RetryAfter.at())?),
        reset_after_ms: opt_ms(num(DenyReply::Reset.at())?),
    }))
}

/// The answer to an admission with its shadow plan: the request's decision (a reply other than
/// `shadowed`, such as `dup` or `lost`, is the request's alone) and what the shadow made of it.
pub(crate) fn shadowed(
    plan: &Plan,
    shadow: &Plan,
    reply: Vec<Value>,
) -> Result<(Decision, ShadowOutcome), StoreError> {
    if reply.first().map(text).transpose()?.as_deref() != Some("shadowed") {
        return decision(plan, reply).map(|d| (d, ShadowOutcome::Failed));
    }
    let mut parts = reply.into_iter().skip(1);
    let (Some(own), Some(theirs)) = (parts.next(), parts.next()) else {
        return Err(StoreError::Protocol("short shadowed reply".into()));
    };
    let d = decision(plan, items(own)?)?;
    let theirs = items(theirs)?;
    let outcome = match theirs.first().map(text).transpose()?.as_deref() {
        Some("held") => ShadowOutcome::Held,
        Some("passed") => ShadowOutcome::Passed,
        _ => match decision(shadow, theirs)? {
            Decision::Deny(r) => ShadowOutcome::Refused(r),
            other => {
                return Err(StoreError::Protocol(format!(
                    "a shadow plan answered {other:?}"
                )));
            }
        },
    };
    Ok((d, outcome))
}

pub(crate) fn finish_reply(reply: Vec<Value>) -> Result<Finish, StoreError> {
    let kind = reply.first().map(text).transpose()?.unwrap_or_default();
    match kind.as_str() {
        "done" => Ok(Finish::Done {
            charged: reply
                .get(DoneReply::LEN..)
                .unwrap_or_default()
                .iter()
                .map(|v| int(v).map(|n| n.max(0) as u64))
                .collect::<Result<_, _>>()?,
        }),
        "ended" => {
            let how = reply
                .get(EndedReply::How.at())
                .map(text)
                .transpose()?
                .unwrap_or_default();
            Ok(Finish::AlreadyEnded(match how.as_str() {
                "settled" => Ending::Settled,
                "released" => Ending::Released,
                _ => Ending::Expired,
            }))
        }
        "unknown" => Ok(Finish::Unknown),
        other => Err(StoreError::Protocol(format!(
            "unknown finish reply {other:?}"
        ))),
    }
}

/// A renewal's answer: renewed until its new expiry, or no longer in flight.
pub(crate) fn renewal(reply: &[Value]) -> Result<Renewal, StoreError> {
    match reply.first().map(text).transpose()?.as_deref() {
        Some("renewed") => Ok(Renewal::Renewed {
            expires_at: reply
                .get(Renewed::ExpiresAt.at())
                .map(int)
                .transpose()?
                .unwrap_or(0)
                .max(0) as u64,
        }),
        Some("gone") => Ok(Renewal::NotInFlight),
        other => Err(StoreError::Protocol(format!(
            "unknown renew reply {other:?}"
        ))),
    }
}
