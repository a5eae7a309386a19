//! Responses at the edge: decisions and errors become status codes and headers here and nowhere
//! else, each error through a named constructor, as a value ([`ApiError`]) that each dialect
//! renders in its format. Refusals, store and upstream failures are here; what is wrong with a
//! client's request is in `client`.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use tollgate_core::{Admitted, Plan, Quota, Reason};

mod admin;
mod class;
mod client;
mod error;
mod refusal;
mod units;
pub use admin::*;
pub use class::{Class, Fault, Refusal, Upstream};
pub use client::*;
pub use error::{Advice, ApiError, Denied, Param, Words};
pub use refusal::*;

/// A budget that only resets after this long also says `x-should-retry: false`, so that SDKs
/// do not keep retrying (rate and concurrency waits stay retryable).
pub const LONG_WAIT_MS: u64 = 60_000;

fn put(h: &mut HeaderMap, name: &'static str, value: impl ToString) {
    if let Ok(v) = HeaderValue::from_str(&value.to_string()) {
        h.insert(HeaderName::from_static(name), v);
    }
}

/// `retry-after` (whole seconds, at least one) and `retry-after-ms`.
fn put_retry_after(h: &mut HeaderMap, ms: u64) {
    put(h, "retry-after", ms.div_ceil(1000).max(1));
    put(h, "retry-after-ms", ms.max(1));
}

/// Appends `n` in decimal with `itoa`: through `write!`, `core::fmt::write` was the largest part
/// of these headers' cost in the gateway's profile.
fn push_number(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// OpenAI's reset format: `1s`, `6m0s`, `1h2m3s`.
fn openai_duration(ms: u64) -> String {
    let s = ms.div_ceil(1000);
    let (h, m, s) = (s / 3600, (s % 3600) / 60, s % 60);
    let mut out = String::with_capacity(16);
    if h > 0 {
        push_number(&mut out, h);
        out.push('h');
    }
    if h > 0 || m > 0 {
        push_number(&mut out, m);
        out.push('m');
    }
    push_number(&mut out, s);
    out.push('s');
    out
}

/// Appends a limit's name, `"<rule>-<kind>"`, as a structured-field string.
fn push_policy_name(out: &mut String, reason: Reason, rule: &str) {
    let kind = reason.limit_name();
    let safe = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    out.push('"');
    // Structured-field strings: keep to safe characters (rule names usually are already).
    if rule.chars().all(safe) {
        out.push_str(rule);
    } else {
        out.extend(rule.chars().map(|c| if safe(c) { c } else { '_' }));
    }
    out.push('-');
    out.push_str(kind);
    out.push('"');
}

fn put_number(h: &mut HeaderMap, name: HeaderName, n: u64) {
    h.insert(name, HeaderValue::from(n));
}

/// A header built here: its bytes are known to be valid, and the string becomes the value
/// without a copy.
fn put_built(h: &mut HeaderMap, name: HeaderName, value: String) {
    if let Ok(v) = HeaderValue::try_from(value) {
        h.insert(name, v);
    }
}

// Names made at compile time: `from_static` checks every byte when it runs.
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const LIMIT_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
const REMAINING_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-requests");
const RESET_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");

/// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11) and OpenAI's
/// `x-ratelimit-*` for the limits of an admitted request. Written on every admitted response,
/// so each header is built in one buffer. `rule` names a quota's scope rule, `unit` a budget
/// quota's unit (`x-ratelimit-*-tokens` carry tokens only, see [`units`]).
pub fn quota_headers<'a>(
    h: &mut HeaderMap,
    quotas: &[Quota],
    rule: impl Fn(&Quota) -> &'a str,
    unit: impl Fn(&Quota) -> Option<tollgate_core::Unit>,
) {
    if !quotas.is_empty() {
        let mut policies = String::with_capacity(64 * quotas.len());
        let mut limits = String::with_capacity(48 * quotas.len());
        for (i, q) in quotas.iter().enumerate() {
            if i > 0 {
                policies.push_str(", ");
                limits.push_str(", ");
            }
            let name_at = policies.len();
            push_policy_name(&mut policies, q.reason, rule(q));
            // The same name starts both headers' entries: copied, not made twice.
            limits.push_str(&policies[name_at..]);
            policies.push_str(";q=");
            push_number(&mut policies, q.limit);
            if let Some(w) = q.window_ms {
                policies.push_str(";w=");
                push_number(&mut policies, w.div_ceil(1000));
            }
            if q.reason.control() == Reason::ConcurrencyLimit {
                policies.push_str(";qu=\"concurrent-requests\"");
            }
            limits.push_str(";r=");
            push_number(&mut limits, q.remaining);
            if let Some(t) = q.reset_after_ms {
                limits.push_str(";t=");
                push_number(&mut limits, t.div_ceil(1000));
            }
        }
        for (name, value) in [(RATELIMIT_POLICY, policies), (RATELIMIT, limits)] {
            if let Ok(v) = HeaderValue::try_from(value) {
                h.append(name, v);
            }
        }
    }
    if let Some(q) = quotas.iter().find(|q| q.reason == Reason::RequestRateLimit) {
        put_number(h, LIMIT_REQUESTS, q.limit);
        put_number(h, REMAINING_REQUESTS, q.remaining);
        put_built(
            h,
            RESET_REQUESTS,
            openai_duration(q.reset_after_ms.unwrap_or(0)),
        );
    }
    units::budget_headers(h, quotas, unit);
}

/// Headers of an admitted request, whose plan was `p`.
pub fn admitted_headers(h: &mut HeaderMap, p: &Plan, a: &Admitted) {
    let unit = |q: &Quota| match p.checks.get(q.check).map(|c| &c.kind) {
        Some(tollgate_core::pipeline::Kind::Reserve(b)) => Some(b.unit),
        _ => None,
    };
    quota_headers(
        h,
        &a.quotas,
        |q| p.scope_of(q).map_or("", |s| s.rule()),
        unit,
    );
}

/// The store could not be reached: fail closed.
pub fn store_unavailable() -> ApiError {
    ApiError::new(
        Class::Books,
        "store_unavailable",
        "The admission store is unavailable; the request was not sent upstream.",
    )
    .retry_after(1_000)
}

/// The store holds as many idempotency keys as it may: the request is not sent without one.
pub fn idempotency_keys_full() -> ApiError {
    ApiError::new(
        Class::Books,
        "idempotency_keys_full",
        "The gateway holds as many idempotency keys as it may; the request was not sent \
         upstream. Retry later, or without an Idempotency-Key.",
    )
    .retry_after(1_000)
}

/// Says how many of the request's oldest turns were dropped to fit an input limit.
pub fn trimmed(h: &mut HeaderMap, turns: u64) {
    put(h, "x-tollgate-trimmed-turns", turns);
}

/// A kept response sent again for a later use of its idempotency key, marked as such. `None`
/// when the kept status is not one.
pub fn replayed(status: u16, content_type: &str, body: Vec<u8>) -> Option<Response> {
    let status = StatusCode::from_u16(status).ok()?;
    let mut r = Response::new(axum::body::Body::from(body));
    *r.status_mut() = status;
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(content_type) {
        h.insert(axum::http::header::CONTENT_TYPE, v);
    }
    put(h, "x-tollgate-idempotent-replay", "true");
    Some(r)
}

/// No API key, or one this gateway does not know: 401.
pub fn unauthorized(message: &str) -> ApiError {
    ApiError::new(
        Class::Client(Fault::Unauthenticated),
        "invalid_api_key",
        message,
    )
}

/// A body over `max_body_bytes`: 413, refused before it is read.
pub fn body_too_large(max: usize) -> ApiError {
    ApiError::new(
        Class::Client(Fault::TooLarge),
        "request_too_large",
        format!("Request bodies are limited to {max} bytes."),
    )
}

/// A body that did not arrive within `body_timeout`: 408.
pub fn body_timeout() -> ApiError {
    ApiError::new(
        Class::Client(Fault::TooSlow),
        "body_timeout",
        "The request body did not arrive in time.",
    )
}

/// A model no upstream serves: 404 (`shown` is the client's name for it, bounded).
pub fn model_not_found(shown: &str) -> ApiError {
    ApiError::new(
        Class::Client(Fault::NotFound),
        "model_not_found",
        format!("The model {shown:?} does not exist or is not served here."),
    )
    .param("model")
}

/// A model the key may not use: 403.
pub fn model_not_allowed(model: &str) -> ApiError {
    ApiError::new(
        Class::Client(Fault::Forbidden),
        "model_not_allowed",
        format!("This key may not use {model:?}."),
    )
    .param("model")
}

/// Something on this side failed: 500 with `code`.
pub fn internal(code: &str, message: impl std::fmt::Display) -> ApiError {
    ApiError::new(Class::Internal, code, message.to_string())
}

/// A decision that contradicts itself (a bug): 500.
pub fn inconsistent() -> ApiError {
    internal("internal", "inconsistent decision")
}

/// A money budget applies to a model the policy has no price for (a configuration error): 500.
pub fn unpriced_model(e: impl std::fmt::Display) -> ApiError {
    internal("unpriced_model", e)
}

/// An admin call the store could not answer: 503 with the store's error.
pub fn store_failed(e: &tollgate_core::StoreError) -> ApiError {
    if let tollgate_core::StoreError::NotReplicated(_) = e {
        // Made, but not yet safe from a failover: not a 503, which says nothing changed.
        return ApiError::new(Class::Unknown, "store_not_replicated", e.to_string());
    }
    ApiError::new(Class::Books, "store_unavailable", e.to_string())
}

/// A gateway shutting down (`/readyz`): 503.
pub fn draining() -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
}

/// A gateway ready to serve (`/readyz`): 200.
pub fn ready() -> Response {
    (StatusCode::OK, "ready").into_response()
}

/// The upstream's answer could not be read: 502.
pub fn upstream_body() -> ApiError {
    ApiError::new(
        Class::Upstream(Upstream::Failed),
        "upstream_body",
        "The upstream's response could not be read.",
    )
}

/// The upstream could not be reached (`why`): 502, nothing charged.
pub fn upstream_unreachable(why: &str) -> ApiError {
    ApiError::new(
        Class::Upstream(Upstream::Failed),
        "upstream_unreachable",
        format!("The upstream could not be reached: {why}"),
    )
}

/// The upstream sent no response headers within `upstream_timeout`: 504.
pub fn upstream_timeout() -> ApiError {
    ApiError::new(
        Class::Upstream(Upstream::Timeout),
        "upstream_timeout",
        "The upstream did not answer in time.",
    )
}

/// The store forgot its state (see [`tollgate_core::StoreError::StateLost`]): 503, not
/// retryable until an operator acknowledges the loss (`POST /admin/store/acknowledge-loss`).
pub fn store_state_lost() -> ApiError {
    ApiError::new(
        Class::Books,
        "store_state_lost",
        "The admission store has lost its state (spent budgets and kill switches would reopen); \
         requests are refused until an operator acknowledges the loss. The request was not sent \
         upstream.",
    )
    .no_retry()
}

/// The store holds no marker and nothing says whether it is new or forgot (see
/// [`tollgate_core::StoreError::Uninitialised`]): 503, not retryable until an operator
/// initialises it (`tollgate admin init-store`) or the ledger rebuilds it.
pub fn store_uninitialised() -> ApiError {
    ApiError::new(
        Class::Books,
        "store_uninitialised",
        "The admission store is empty and not initialised: it may be new, or it may have lost \
         spent budgets and kill switches. Requests are refused until an operator initialises it \
         (`tollgate admin init-store`). The request was not sent upstream.",
    )
    .no_retry()
}

/// The spend ledger's buffer is full (PostgreSQL slow or down, `[ledger] on_full = "refuse"`):
/// 503, retryable; nothing was counted or sent upstream.
pub fn ledger_full() -> ApiError {
    ApiError::new(
        Class::Books,
        "ledger_unavailable",
        "The spend ledger cannot keep up, so no new request is admitted until it has written \
         what it holds. The request was not counted or sent upstream; retry shortly.",
    )
    .retry_after(1_000)
}

/// `/admin/usage?at=…` without a ledger, or for a scope without a budget: 404.
pub fn no_ledger() -> ApiError {
    ApiError::new(
        Class::Client(Fault::NotFound),
        "no_ledger",
        "Usage of a past period is answered from the spend ledger ([ledger]), for a scope with a \
         budget; this gateway keeps no ledger or the scope has no budget.",
    )
}

/// An `at` that is neither a UTC day nor a UTC time: 400.
pub fn bad_instant(at: &str) -> ApiError {
    ApiError::new(
        Class::Client(Fault::Invalid),
        "invalid_at",
        format!("at {at:?}: at must be a UTC day (2026-11-30) or time (2026-11-30T08:00:00Z)."),
    )
    .param("at")
}

/// The spend ledger did not answer: 503.
pub fn ledger_failed(detail: &str) -> ApiError {
    ApiError::new(
        Class::Books,
        "ledger_unavailable",
        format!("The spend ledger did not answer: {detail}"),
    )
}

/// A request stopped by the kill switch: 503, with the operator's reason; not retryable until
/// an operator lifts it.
pub fn killed(k: &tollgate_core::decision::Killed) -> ApiError {
    if let Some(wait) = k.wait_ms(tollgate_core::Clock::now(&tollgate_core::SystemClock)) {
        return provider_held(k, wait);
    }
    ApiError {
        class: Class::Refused(Refusal::Killed),
        code: "kill_switch".into(),
        words: Words::Killed {
            target: k.target.clone(),
            reason: k.reason.clone(),
        },
        param: None,
        advice: Advice {
            no_retry: true,
            cause: Some(("kill_switch", k.target.clone())),
            ..Advice::default()
        },
    }
}

/// A request for a model whose provider said its rate limit is reached for `wait` ms more: 429
/// `upstream_rate_limited` with the wait the provider gave, sent before the provider is asked
/// again (so that the gateway never retries into the limit, and neither do its clients).
fn provider_held(k: &tollgate_core::decision::Killed, wait: u64) -> ApiError {
    let model = k.target.strip_prefix("provider:").unwrap_or(&k.target);
    ApiError {
        class: Class::Refused(Refusal::Limit),
        code: "upstream_rate_limited".into(),
        words: Words::Held {
            model: model.to_owned(),
            reason: k.reason.clone(),
            wait_ms: wait,
        },
        param: None,
        advice: Advice {
            retry_after_ms: Some(wait),
            cause: Some(("upstream_rate_limited", k.target.clone())),
            ..Advice::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::{Dimension, Identity, ScopeKey};

    /// The header values, exactly, for a rate, a concurrency and a budget limit.
    #[test]
    fn quota_headers_follow_the_draft_and_openai() {
        let id = Identity::default().with(Dimension::User, "u1");
        let scope =
            ScopeKey::derive("per user", &[Dimension::User], &id).unwrap_or_else(|| unreachable!());
        let q = |reason, limit, remaining, window_ms, reset_after_ms| Quota {
            reason,
            check: 0,
            limit,
            remaining,
            window_ms,
            reset_after_ms,
        };
        let quotas = [
            q(
                Reason::RequestRateLimit,
                100,
                99,
                Some(60_000),
                Some(59_001),
            ),
            q(Reason::ConcurrencyLimit, 4, 3, None, None),
            q(
                Reason::BudgetLimit,
                5000,
                4200,
                Some(86_400_000),
                Some(3_723_000),
            ),
        ];
        let mut h = HeaderMap::new();
        let tokens = |_: &Quota| Some(tollgate_core::Unit::Tokens);
        quota_headers(&mut h, &quotas, |_| scope.rule(), tokens);
        let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
        assert_eq!(
            get("ratelimit-policy").as_deref(),
            Some(
                "\"per_user-requests\";q=100;w=60, \"per_user-concurrency\";q=4;qu=\"concurrent-requests\", \"per_user-budget\";q=5000;w=86400"
            )
        );
        assert_eq!(
            get("ratelimit").as_deref(),
            Some(
                "\"per_user-requests\";r=99;t=60, \"per_user-concurrency\";r=3, \"per_user-budget\";r=4200;t=3723"
            )
        );
        assert_eq!(get("x-ratelimit-limit-requests").as_deref(), Some("100"));
        assert_eq!(get("x-ratelimit-remaining-requests").as_deref(), Some("99"));
        assert_eq!(get("x-ratelimit-reset-requests").as_deref(), Some("1m0s"));
        assert_eq!(get("x-ratelimit-limit-tokens").as_deref(), Some("5000"));
        assert_eq!(get("x-ratelimit-remaining-tokens").as_deref(), Some("4200"));
        assert_eq!(get("x-ratelimit-reset-tokens").as_deref(), Some("1h2m3s"));
    }
}
