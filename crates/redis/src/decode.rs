//! Wire decoding: the script's replies back into decisions and endings. Every reply kind the
//! script writes is named in [`ADMIT_REPLIES`] and [`FINISH_REPLIES`], which a test checks
//! against the script's source; a refusal names its check by its place in the plan.

use redis::Value;

use crate::contract::{AdmitReply, DenyReply, DoneReply, EndedReply, KilledReply, Quota, Renewed};
use tollgate_core::pipeline::{Kind, Plan};
use tollgate_core::{Admitted, Decision, Ending, Finish, Renewal, ShadowOutcome, StoreError};

/// Every reply kind an admission may get from the script.
pub const ADMIT_REPLIES: [&str; 6] = ["admit", "deny", "dup", "lost", "uninitialised", "killed"];
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
            let at = expires_at.saturating_sub(plan.ttl_ms);
            let mut quotas = Vec::with_capacity(plan.checks.len());
            for (i, c) in plan.checks.iter().enumerate() {
                let counted_before = plan.attempt_counted && matches!(c.kind, Kind::Count(_));
                if counted_before || !c.reason.reports_quota() {
                    continue;
                }
                let q = AdmitReply::LEN + i * Quota::LEN;
                let remaining = num(q + Quota::Remaining.at())?.max(0) as u64;
                let reset = opt_ms(num(q + Quota::Reset.at())?);
                quotas.extend(c.quota(i, remaining, reset, at));
            }
            Ok(Decision::Admit(Admitted {
                max_output_tokens: plan.max_output_tokens,
                expires_at,
                quotas,
                fail_open: false,
            }))
        }
        "deny" => denial(plan, num),
        "dup" => Err(StoreError::DuplicateRequestId(plan.request_id.clone())),
        "lost" => Err(StoreError::StateLost),
        "uninitialised" => Err(StoreError::Uninitialised),
        "killed" => {
            let field = |f: KilledReply| reply.get(f.at()).map(text).transpose();
            let target = field(KilledReply::Target)?.unwrap_or_default();
            let value = field(KilledReply::Reason)?.unwrap_or_default();
            // The script sends only a switch that holds now: a hold's instant is not checked
            // again.
            tollgate_core::decision::Killed::kept(&target, &value, None)
                .map(Decision::Killed)
                .ok_or_else(|| StoreError::Protocol("a kill switch that does not hold".into()))
        }
        other => Err(StoreError::Protocol(format!(
            "unknown admit reply {other:?}"
        ))),
    }
}

/// A refusal by one of the plan's checks, read by the contract's `deny` layout: the check (by
/// its place in the plan), what is left and the waits.
fn denial(
    plan: &Plan,
    num: impl Fn(usize) -> Result<i64, StoreError>,
) -> Result<Decision, StoreError> {
    let idx = usize::try_from(num(DenyReply::Check.at())?)
        .map_err(|_| StoreError::Protocol("bad check index".into()))?;
    let check = plan
        .checks
        .get(idx)
        .ok_or_else(|| StoreError::Protocol(format!("check index {idx} out of range")))?;
    Ok(Decision::Deny(check.deny(
        num(DenyReply::Remaining.at())?.max(0) as u64,
        opt_ms(num(DenyReply::RetryAfter.at())?),
        opt_ms(num(DenyReply::Reset.at())?),
    )))
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
