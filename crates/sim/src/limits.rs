//! The provider's own rate, as OpenAI and Anthropic apply it: requests and tokens per window,
//! told in every answer (OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, the
//! reset a duration; Anthropic's `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`
//! on `/v1/messages`, the reset an RFC 3339 instant), and a 429 with `retry-after` past either,
//! which does no work and bills nothing. A request's tokens are counted against the rate when
//! it arrives: its body's characters over four, plus its output cap. The rate can change while
//! it runs (a tier upgrade: [`crate::Sim::set_rate`]); the window under way keeps its counts.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use super::{SimState, error};

/// The provider's rate: `requests` chat requests and `tokens` tokens (none: no token limit)
/// per `window`.
#[derive(Debug, Clone, Copy)]
pub struct Rate {
    /// Requests per window.
    pub requests: u64,
    /// Tokens per window.
    pub tokens: Option<u64>,
    /// The window.
    pub window: Duration,
}

/// The current window (when it started, the requests and the tokens it has admitted), and the
/// rate set while running, in place of the configuration's.
pub(crate) type Window = std::sync::Mutex<(Option<(tokio::time::Instant, u64, u64)>, Option<Rate>)>;

impl crate::Sim {
    /// Changes the provider's rate from now on (a tier upgrade, a downgrade).
    pub fn set_rate(&self, rate: Rate) {
        if let Ok(mut w) = self.state.window.lock() {
            w.1 = Some(rate);
        }
    }
}

/// Admits a request within the window's limits, and tells their state in the answer's headers.
pub(crate) async fn layer(
    State(state): State<Arc<SimState>>,
    req: Request,
    next: Next,
) -> Response {
    let now_set = state.window.lock().ok().and_then(|w| w.1);
    let Some(rate) = now_set.or(state.config.rate) else {
        return next.run(req).await;
    };
    let anthropic = req.uri().path() == "/v1/messages";
    let (parts, body) = req.into_parts();
    let Ok(bytes) = to_bytes(body, 16 << 20).await else {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body too large",
            "invalid_request_error",
        );
    };
    let size = tokens_of(&bytes);
    let req = Request::from_parts(parts, Body::from(bytes));
    let now = tokio::time::Instant::now();
    let taken = state.window.lock().ok().map(|mut w| {
        let (start, n, used) = match w.0 {
            Some((start, n, used)) if now < start + rate.window => (start, n, used),
            _ => (now, 0, 0),
        };
        let fits = rate.tokens.is_none_or(|t| used.saturating_add(size) <= t);
        let admitted = n < rate.requests && fits;
        let (n, used) = match admitted {
            true => (n + 1, used.saturating_add(size)),
            false => (n, used),
        };
        w.0 = Some((start, n, used));
        (
            admitted,
            n,
            used,
            (start + rate.window).saturating_duration_since(now),
        )
    });
    let Some((admitted, n, used, reset)) = taken else {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "window lost",
            "server_error",
        );
    };
    let mut r = if admitted {
        next.run(req).await
    } else {
        if let Ok(mut s) = state.stats.lock() {
            s.rate_limited += 1;
        }
        let mut r = error(
            StatusCode::TOO_MANY_REQUESTS,
            "Rate limit reached",
            "rate_limit_exceeded",
        );
        let secs = reset.as_secs_f64().ceil().max(1.0);
        set(&mut r, "retry-after", &format!("{secs}"));
        r
    };
    // Anthropic's instant is whole seconds: rounded up, never before the window ends.
    let at = std::time::SystemTime::now() + reset + Duration::from_millis(999);
    let reset = match anthropic {
        true => humantime::format_rfc3339_seconds(at).to_string(),
        false => format!("{}ms", reset.as_millis().max(1)),
    };
    let mut tell = |kind: &str, limit: u64, spent: u64| {
        let left = limit.saturating_sub(spent).to_string();
        let (l, n, t) = match anthropic {
            true => (
                format!("anthropic-ratelimit-{kind}-limit"),
                format!("anthropic-ratelimit-{kind}-remaining"),
                format!("anthropic-ratelimit-{kind}-reset"),
            ),
            false => (
                format!("x-ratelimit-limit-{kind}"),
                format!("x-ratelimit-remaining-{kind}"),
                format!("x-ratelimit-reset-{kind}"),
            ),
        };
        set(&mut r, &l, &limit.to_string());
        set(&mut r, &n, &left);
        set(&mut r, &t, &reset);
    };
    tell("requests", rate.requests, n);
    if let Some(t) = rate.tokens {
        tell("tokens", t, used);
    }
    r
}

/// A request's tokens against the rate: its body's characters over four, plus its output cap.
fn tokens_of(body: &[u8]) -> u64 {
    let cap = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            ["max_tokens", "max_completion_tokens", "max_output_tokens"]
                .iter()
                .find_map(|k| v.get(*k).and_then(serde_json::Value::as_u64))
        })
        .unwrap_or(0);
    (body.len() as u64).div_ceil(4).saturating_add(cap)
}

fn set(r: &mut Response, name: &str, value: &str) {
    if let (Ok(n), Ok(v)) = (
        axum::http::HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(value),
    ) {
        r.headers_mut().insert(n, v);
    }
}
