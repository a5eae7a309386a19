//! Responses at the edge: decisions become status codes, headers and OpenAI-format error
//! bodies here and nowhere else.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tollgate_core::{Admitted, Deny, Quota, Reason};

/// A budget that only resets after this long also says `x-should-retry: false`, so that SDKs
/// do not keep retrying (rate and concurrency waits stay retryable).
pub const LONG_WAIT_MS: u64 = 60_000;

/// An error in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// `type`.
    pub kind: &'static str,
    /// `code`.
    pub code: String,
    /// `message`.
    pub message: String,
    /// `param`.
    pub param: Option<String>,
    /// Extra headers.
    pub headers: HeaderMap,
}

impl ApiError {
    /// A new error.
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            code: code.into(),
            message: message.into(),
            param: None,
            headers: HeaderMap::new(),
        }
    }
    /// With `param`.
    #[must_use]
    pub fn param(mut self, p: impl Into<String>) -> Self {
        self.param = Some(p.into());
        self
    }
    /// 400 invalid request.
    pub fn invalid(code: &str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}});
        let mut r = (self.status, axum::Json(body)).into_response();
        r.headers_mut().extend(self.headers);
        r
    }
}

fn put(h: &mut HeaderMap, name: &'static str, value: impl ToString) {
    if let Ok(v) = HeaderValue::from_str(&value.to_string()) {
        h.insert(HeaderName::from_static(name), v);
    }
}

fn append(h: &mut HeaderMap, name: &'static str, value: String) {
    if let Ok(v) = HeaderValue::from_str(&value) {
        h.append(HeaderName::from_static(name), v);
    }
}

/// OpenAI's reset format: `1s`, `6m0s`, `1h2m3s`.
fn openai_duration(ms: u64) -> String {
    let s = ms.div_ceil(1000);
    let (h, m, s) = (s / 3600, (s % 3600) / 60, s % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m{s}s"),
    }
}

fn policy_name(q_reason: Reason, rule: &str) -> String {
    let kind = match q_reason {
        Reason::RequestRateLimit => "requests",
        Reason::ConcurrencyLimit => "concurrency",
        _ => "budget",
    };
    // Structured-field strings: keep to safe characters.
    let rule: String = rule
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{rule}-{kind}")
}

/// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11) and OpenAI's
/// `x-ratelimit-*` for the limits of an admitted request.
pub fn quota_headers(h: &mut HeaderMap, quotas: &[Quota]) {
    let mut policies = Vec::new();
    let mut limits = Vec::new();
    for q in quotas {
        let name = policy_name(q.reason, q.scope.rule());
        let mut p = format!("\"{name}\";q={}", q.limit);
        if let Some(w) = q.window_ms {
            p.push_str(&format!(";w={}", w.div_ceil(1000)));
        }
        if q.reason == Reason::ConcurrencyLimit {
            p.push_str(";qu=\"concurrent-requests\"");
        }
        policies.push(p);
        let mut l = format!("\"{name}\";r={}", q.remaining);
        if let Some(t) = q.reset_after_ms {
            l.push_str(&format!(";t={}", t.div_ceil(1000)));
        }
        limits.push(l);
    }
    if !policies.is_empty() {
        append(h, "ratelimit-policy", policies.join(", "));
        append(h, "ratelimit", limits.join(", "));
    }
    if let Some(q) = quotas.iter().find(|q| q.reason == Reason::RequestRateLimit) {
        put(h, "x-ratelimit-limit-requests", q.limit);
        put(h, "x-ratelimit-remaining-requests", q.remaining);
        put(
            h,
            "x-ratelimit-reset-requests",
            openai_duration(q.reset_after_ms.unwrap_or(0)),
        );
    }
    if let Some(q) = quotas.iter().find(|q| q.reason == Reason::BudgetLimit) {
        put(h, "x-ratelimit-limit-tokens", q.limit);
        put(h, "x-ratelimit-remaining-tokens", q.remaining);
        put(
            h,
            "x-ratelimit-reset-tokens",
            openai_duration(q.reset_after_ms.unwrap_or(0)),
        );
    }
}

/// Headers of an admitted request.
pub fn admitted_headers(h: &mut HeaderMap, a: &Admitted) {
    quota_headers(h, &a.quotas);
}

/// The response to a refusal: 429 for rate, concurrency and budget; 400 for token limits.
pub fn deny(d: &Deny) -> ApiError {
    let (status, kind) = match d.reason {
        Reason::RequestRateLimit | Reason::ConcurrencyLimit => {
            (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error")
        }
        Reason::BudgetLimit => (StatusCode::TOO_MANY_REQUESTS, "insufficient_quota"),
        Reason::InputTokenLimit | Reason::OutputTokenLimit | Reason::TotalTokenLimit => {
            (StatusCode::BAD_REQUEST, "invalid_request_error")
        }
    };
    let what = match d.reason {
        Reason::RequestRateLimit => "requests".to_owned(),
        Reason::ConcurrencyLimit => "concurrent requests".to_owned(),
        Reason::BudgetLimit => format!("budget (requested {})", d.requested),
        Reason::InputTokenLimit => format!("input tokens (request has {})", d.requested),
        Reason::OutputTokenLimit => format!("output tokens (request asks for {})", d.requested),
        Reason::TotalTokenLimit => {
            format!("input + max output tokens (request has {})", d.requested)
        }
    };
    let mut message = format!(
        "{} for scope {}: limit {}, remaining {}, {what}.",
        d.reason.code(),
        d.scope,
        d.limit,
        d.remaining
    );
    let mut e = ApiError::new(status, kind, d.reason.code(), String::new());
    put(&mut e.headers, "x-tollgate-reason", d.reason.code());
    put(&mut e.headers, "x-tollgate-scope", d.scope.key());
    if d.reason.is_retryable() {
        let quota = Quota {
            reason: d.reason,
            scope: d.scope.clone(),
            limit: d.limit,
            remaining: 0,
            window_ms: None,
            reset_after_ms: d.reset_after_ms.or(d.retry_after_ms),
        };
        quota_headers(&mut e.headers, &[quota]);
        match d.retry_after_ms {
            Some(ms) => {
                put(&mut e.headers, "retry-after", ms.div_ceil(1000).max(1));
                put(&mut e.headers, "retry-after-ms", ms.max(1));
                message.push_str(&format!(" Retry after {} ms.", ms.max(1)));
                if d.reason == Reason::BudgetLimit && ms > LONG_WAIT_MS {
                    put(&mut e.headers, "x-should-retry", "false");
                }
            }
            None => {
                // Larger than the whole budget: waiting cannot help.
                put(&mut e.headers, "x-should-retry", "false");
            }
        }
    } else {
        e = e.param(match d.reason {
            Reason::OutputTokenLimit => "max_tokens",
            Reason::InputTokenLimit => "messages",
            _ => "max_tokens",
        });
    }
    e.message = message;
    e
}

/// The store could not be reached: fail closed.
pub fn store_unavailable() -> ApiError {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        "store_unavailable",
        "The admission store is unavailable; the request was not sent upstream.",
    );
    put(&mut e.headers, "retry-after", 1);
    put(&mut e.headers, "retry-after-ms", 1000);
    e
}

/// A request stopped by the kill switch: 503, with the operator's reason; not retryable until
/// an operator lifts it.
pub fn killed(k: &tollgate_core::decision::Killed) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        "kill_switch",
        format!("Requests for {} are switched off: {}", k.target, k.reason),
    );
    put(&mut e.headers, "x-should-retry", "false");
    put(&mut e.headers, "x-tollgate-reason", "kill_switch");
    put(&mut e.headers, "x-tollgate-scope", &k.target);
    e
}
