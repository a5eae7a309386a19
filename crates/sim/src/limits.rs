//! The provider's own rate, as OpenAI applies it: requests and tokens per window, told in every
//! answer (`x-ratelimit-{limit,remaining,reset}-{requests,tokens}`), and a 429
//! `rate_limit_exceeded` with `retry-after` past either, which does no work and bills nothing.
//! A request's tokens are counted as OpenAI counts them against its rate when it arrives: its
//! body's characters over four, plus its output cap.

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

/// The current window: when it started, the requests and the tokens it has admitted.
pub(crate) type Window = std::sync::Mutex<Option<(tokio::time::Instant, u64, u64)>>;

/// Admits a request within the window's limits, and tells their state in the answer's headers.
pub(crate) async fn layer(
    State(state): State<Arc<SimState>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(rate) = state.config.rate else {
        return next.run(req).await;
    };
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
        let (start, n, used) = match *w {
            Some((start, n, used)) if now < start + rate.window => (start, n, used),
            _ => (now, 0, 0),
        };
        let fits = rate.tokens.is_none_or(|t| used.saturating_add(size) <= t);
        let admitted = n < rate.requests && fits;
        let (n, used) = match admitted {
            true => (n + 1, used.saturating_add(size)),
            false => (n, used),
        };
        *w = Some((start, n, used));
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
    let reset = format!("{}ms", reset.as_millis().max(1));
    let mut tell = |kind: &str, limit: u64, spent: u64| {
        set(
            &mut r,
            &format!("x-ratelimit-limit-{kind}"),
            &limit.to_string(),
        );
        let left = limit.saturating_sub(spent).to_string();
        set(&mut r, &format!("x-ratelimit-remaining-{kind}"), &left);
        set(&mut r, &format!("x-ratelimit-reset-{kind}"), &reset);
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
