//! The provider's own request rate, as OpenAI applies it: a limit per window, told in every
//! answer (`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`,
//! `x-ratelimit-reset-requests`), and a 429 `rate_limit_exceeded` with `retry-after` past it,
//! which does no work and bills nothing.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use super::{SimState, error};

/// The window of [`super::SimConfig::requests_per_window`]: when it started and how many it
/// has admitted.
pub(crate) type Window = std::sync::Mutex<Option<(tokio::time::Instant, u64)>>;

/// Admits a request within the window's limit, and tells its state in the answer's headers.
pub(crate) async fn layer(
    State(state): State<Arc<SimState>>,
    req: Request,
    next: Next,
) -> Response {
    let Some((limit, window)) = state.config.requests_per_window else {
        return next.run(req).await;
    };
    let now = tokio::time::Instant::now();
    let taken = state.window.lock().ok().map(|mut w| {
        let (start, n) = match *w {
            Some((start, n)) if now < start + window => (start, n),
            _ => (now, 0),
        };
        let reset = (start + window).saturating_duration_since(now);
        let admitted = n < limit;
        *w = Some((start, n + u64::from(admitted)));
        (
            admitted,
            limit.saturating_sub(n + u64::from(admitted)),
            reset,
        )
    });
    let Some((admitted, remaining, reset)) = taken else {
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
            "Rate limit reached for requests",
            "rate_limit_exceeded",
        );
        let secs = reset.as_secs_f64().ceil().max(1.0);
        set(&mut r, "retry-after", &format!("{secs}"));
        r
    };
    set(&mut r, "x-ratelimit-limit-requests", &limit.to_string());
    set(
        &mut r,
        "x-ratelimit-remaining-requests",
        &remaining.to_string(),
    );
    set(
        &mut r,
        "x-ratelimit-reset-requests",
        &format!("{}ms", reset.as_millis().max(1)),
    );
    r
}

fn set(r: &mut Response, name: &'static str, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        r.headers_mut().insert(name, v);
    }
}
