//! The provider's own rate limits, learned from its answers. A provider tells its limits in
//! every answer (OpenAI's `x-ratelimit-remaining-*` and `x-ratelimit-reset-*`, Anthropic's
//! `anthropic-ratelimit-*-remaining` and `-reset`) and in a 429's `retry-after`. When an answer
//! says nothing more will be admitted before an instant, the model is held until then: a hold
//! in the store's kill switches (`provider:<model>`), read inside every instance's admissions,
//! so no instance sends the provider a request it would refuse, and clients are told to wait
//! (429 `upstream_rate_limited`) instead of retrying into the limit.
//!
//! When an answer says only a few tokens are left (less than a quarter of its limit), the
//! model is held for requests larger than what is left, until the tokens reset: the provider
//! would refuse those. Smaller ones still go, and each answer tells what is left anew.
//!
//! Every number here comes from outside: a wait is read as a duration or an instant, at most
//! [`MAX_HOLD_MS`], and anything else is ignored.

use std::time::{Duration, SystemTime};

use axum::http::{HeaderMap, StatusCode};

use crate::store::AnyStore;
use tollgate_core::Store;

/// The longest hold: an answer that asks for more (a daily quota, or a broken header) holds
/// the model this long, then lets one request find out again.
pub const MAX_HOLD_MS: u64 = 600_000;

/// A 429 that names no wait holds this long.
const DEFAULT_429_MS: u64 = 1_000;

/// A hold the provider's answer asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hold {
    /// How long, in ms (1 to [`MAX_HOLD_MS`]).
    pub ms: u64,
    /// Of requests of more than this many tokens only; `None`: of every request.
    pub over: Option<u64>,
    /// Why, in words.
    pub why: String,
}

/// How long the provider's answer says no request of its model (or none larger than what is
/// left) would be admitted, with why; `None` when it leaves room.
pub(crate) fn hold(status: StatusCode, h: &HeaderMap, now: SystemTime) -> Option<Hold> {
    // Read on every answer: most tell no limit, which one pass over the names finds.
    let told = h.keys().any(|k| {
        let k = k.as_str();
        k.starts_with("x-ratelimit-") || k.starts_with("anthropic-ratelimit-")
    });
    if !told && status != StatusCode::TOO_MANY_REQUESTS {
        return None;
    }
    let (ms, over, why) = if status == StatusCode::TOO_MANY_REQUESTS {
        let wait = retry_after(h, now)
            .or_else(|| exhausted(h, now).map(|(ms, _)| ms))
            .unwrap_or(DEFAULT_429_MS);
        (wait, None, "it answered 429".to_owned())
    } else if let Some((ms, why)) = exhausted(h, now) {
        (ms, None, why)
    } else {
        let (ms, left) = short(h, now)?;
        (
            ms,
            Some(left),
            format!("only {left} tokens are left in its window"),
        )
    };
    Some(Hold {
        ms: ms.clamp(1, MAX_HOLD_MS),
        over,
        why,
    })
}

/// The tokens left, and the time to their reset, when less than a quarter of the token limit
/// is left (OpenAI's `x-ratelimit-*-tokens`, Anthropic's `anthropic-ratelimit-tokens-*`).
fn short(h: &HeaderMap, now: SystemTime) -> Option<(u64, u64)> {
    let text = |name: &str| h.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    let int = |name: &str| text(name).and_then(|v| v.parse::<u64>().ok());
    let (left, limit, reset) = match int("x-ratelimit-remaining-tokens") {
        Some(left) => (
            left,
            int("x-ratelimit-limit-tokens")?,
            text("x-ratelimit-reset-tokens").and_then(duration_ms)?,
        ),
        None => (
            int("anthropic-ratelimit-tokens-remaining")?,
            int("anthropic-ratelimit-tokens-limit")?,
            text("anthropic-ratelimit-tokens-reset")
                .and_then(|v| humantime::parse_rfc3339_weak(v).ok())
                .and_then(|at| until(at, now))?,
        ),
    };
    (left < limit / 4).then_some((reset, left))
}

/// The wait of a `retry-after-ms` (ms) or `retry-after` (seconds, or an HTTP date).
fn retry_after(h: &HeaderMap, now: SystemTime) -> Option<u64> {
    let text = |name: &str| h.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = text("retry-after-ms").and_then(|v| v.parse::<f64>().ok()) {
        return finite_ms(ms);
    }
    let v = text("retry-after")?;
    match v.parse::<f64>() {
        Ok(s) => finite_ms(s * 1000.0),
        Err(_) => until(httpdate(v)?, now),
    }
}

/// OpenAI's limits an answer tells: each kind's header of what is left, and of its reset.
const OPENAI: [(&str, &str, &str); 2] = [
    (
        "requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    ),
    (
        "tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ),
];

/// Anthropic's, likewise.
const ANTHROPIC: [(&str, &str, &str); 4] = [
    (
        "requests",
        "anthropic-ratelimit-requests-remaining",
        "anthropic-ratelimit-requests-reset",
    ),
    (
        "tokens",
        "anthropic-ratelimit-tokens-remaining",
        "anthropic-ratelimit-tokens-reset",
    ),
    (
        "input-tokens",
        "anthropic-ratelimit-input-tokens-remaining",
        "anthropic-ratelimit-input-tokens-reset",
    ),
    (
        "output-tokens",
        "anthropic-ratelimit-output-tokens-remaining",
        "anthropic-ratelimit-output-tokens-reset",
    ),
];

/// The longest wait among the limits an answer says are used up (0 left), with the limit's
/// name. Every answer is read, so the header names are constants and nothing is allocated
/// unless a limit is used up.
fn exhausted(h: &HeaderMap, now: SystemTime) -> Option<(u64, String)> {
    let text = |name: &str| h.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    let mut found: Option<(u64, String)> = None;
    for (kind, left, reset) in OPENAI {
        if text(left) == Some("0") {
            if let Some(ms) = text(reset).and_then(duration_ms) {
                found = longer(found, ms, kind);
            }
        }
    }
    for (kind, left, reset) in ANTHROPIC {
        if text(left) == Some("0") {
            let reset = text(reset)
                .and_then(|v| humantime::parse_rfc3339_weak(v).ok())
                .and_then(|at| until(at, now));
            if let Some(ms) = reset {
                found = longer(found, ms, kind);
            }
        }
    }
    found
}

fn longer(found: Option<(u64, String)>, ms: u64, kind: &str) -> Option<(u64, String)> {
    match found {
        Some((m, w)) if m >= ms => Some((m, w)),
        _ => Some((ms, format!("no {kind} left in its window"))),
    }
}

fn finite_ms(ms: f64) -> Option<u64> {
    (ms.is_finite() && ms >= 0.0).then(|| ms.min(MAX_HOLD_MS as f64).ceil() as u64)
}

fn until(at: SystemTime, now: SystemTime) -> Option<u64> {
    let d = at.duration_since(now).unwrap_or(Duration::ZERO);
    Some(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn httpdate(v: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(v).ok().or_else(|| {
        // `Wed, 21 Oct 2015 07:28:00 GMT`.
        let parts: Vec<&str> = v.split_whitespace().collect();
        let [_, day, month, year, time, "GMT"] = parts.as_slice() else {
            return None;
        };
        let months = [
            "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
        ];
        let m = months.iter().position(|x| x == month)? + 1;
        humantime::parse_rfc3339(&format!("{year}-{m:02}-{day:0>2}T{time}Z")).ok()
    })
}

/// OpenAI's reset durations: `1s`, `6m0s`, `20ms`, `1h2m3.5s`.
fn duration_ms(v: &str) -> Option<u64> {
    let mut total = 0.0;
    let mut rest = v;
    while !rest.is_empty() {
        let n = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|n| *n > 0)?;
        let value: f64 = rest[..n].parse().ok()?;
        rest = &rest[n..];
        let (unit, len) = if rest.starts_with("ms") {
            (1.0, 2)
        } else {
            match rest.chars().next()? {
                'h' => (3_600_000.0, 1),
                'm' => (60_000.0, 1),
                's' => (1000.0, 1),
                _ => return None,
            }
        };
        total += value * unit;
        rest = &rest[len..];
    }
    finite_ms(total)
}

/// Whether the answer tells the provider's limits and none is used up or short: the
/// provider's latest word, which lifts a hold an earlier answer asked for.
pub(crate) fn room(status: StatusCode, h: &HeaderMap, now: SystemTime) -> bool {
    let told = h.keys().any(|k| {
        let k = k.as_str();
        k.starts_with("x-ratelimit-remaining-") || k.starts_with("anthropic-ratelimit-")
    });
    told && status.is_success() && hold(status, h, now).is_none()
}

/// How often one instance lifts a model's hold on an answer that shows room: a store call per
/// model per second at most, however many answers come.
const LIFT_EVERY: Duration = Duration::from_secs(1);

type Lifts = std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>;

/// When this process last lifted each model's hold (a gateway of its own needs no more: a lift
/// is idempotent, and this only spares the store calls).
fn lifts() -> &'static Lifts {
    static LIFTS: std::sync::OnceLock<Lifts> = std::sync::OnceLock::new();
    LIFTS.get_or_init(Lifts::default)
}

/// Lifts `model`'s hold on every instance (an answer showed room: the provider's latest word
/// wins, after a tier upgrade or an early reset), at most once per [`LIFT_EVERY`] here.
pub(crate) fn lift(store: &AnyStore, model: &str) {
    let now = std::time::Instant::now();
    let Ok(mut last) = lifts().lock() else { return };
    if last
        .get(model)
        .is_some_and(|at| now.duration_since(*at) < LIFT_EVERY)
    {
        return;
    }
    last.insert(model.to_owned(), now);
    drop(last);
    let store = store.clone();
    let target = format!("provider:{model}");
    tokio::spawn(async move {
        if let Err(e) = store.set_kill(&target, None).await {
            tracing::warn!(cause = %e, "a provider's hold could not be lifted in the store");
        }
    });
}

/// Holds `model` for `ms` on every instance, and says so once in the log (a hold of large
/// requests only, which every answer may renew while few tokens are left, at debug level).
pub(crate) fn hold_model(store: &AnyStore, model: &str, Hold { ms, over, why }: Hold) {
    match over {
        None => tracing::warn!(
            model,
            wait_ms = ms,
            cause = %why,
            "the provider's rate limit for the model is reached: its requests are refused until it resets"
        ),
        Some(n) => tracing::debug!(
            model,
            wait_ms = ms,
            tokens_left = n,
            "few of the provider's tokens are left: larger requests are refused until they reset"
        ),
    }
    let store = store.clone();
    let target = format!("provider:{model}");
    let why = format!("the provider said {why}");
    let value = tollgate_core::decision::Killed::hold_for(ms, over, &why);
    tokio::spawn(async move {
        if let Err(e) = store.set_kill(&target, Some(&value)).await {
            tracing::warn!(cause = %e, "a provider's hold could not be kept in the store");
        }
    });
}

/// The property the `provider` fuzz target checks: any status and headers (`name: value`
/// lines) from an upstream give a hold of 1 ms to [`MAX_HOLD_MS`] or none, never a panic.
#[doc(hidden)]
#[allow(clippy::panic)] // a failed check must crash the fuzzer
pub fn fuzz_provider(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let status = if first % 2 == 0 {
        StatusCode::OK
    } else {
        StatusCode::TOO_MANY_REQUESTS
    };
    let mut h = HeaderMap::new();
    for line in String::from_utf8_lossy(rest).lines() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if let (Ok(n), Ok(v)) = (
            axum::http::HeaderName::from_bytes(name.trim().as_bytes()),
            axum::http::HeaderValue::from_str(value.trim()),
        ) {
            h.append(n, v);
        }
    }
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_000_000);
    if let Some(Hold { ms, .. }) = hold(status, &h, now) {
        assert!((1..=MAX_HOLD_MS).contains(&ms), "a hold of {ms} ms");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_headers_hold_within_bounds() {
        for data in [
            &b"\x01retry-after: 1e308"[..],
            b"\x01retry-after: NaN\nretry-after-ms: inf",
            b"\x00x-ratelimit-remaining-requests: 0\nx-ratelimit-reset-requests: 99999999999h",
            b"\x00anthropic-ratelimit-tokens-remaining: 0\nanthropic-ratelimit-tokens-reset: 1900-01-01T00:00:00Z",
            b"\x01retry-after: Mon, 99 Foo 2025 99:99:99 GMT",
            b"",
        ] {
            fuzz_provider(data);
        }
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap_or_else(|_| unreachable!()));
        }
        h
    }

    #[test]
    fn few_tokens_left_hold_larger_requests_only() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_000_000);
        let ok = StatusCode::OK;
        let of = |h: &[(&'static str, &str)]| hold(ok, &headers(h), now).map(|h| (h.ms, h.over));
        let openai = |left: &'static str| {
            [
                ("x-ratelimit-limit-tokens", "30000"),
                ("x-ratelimit-remaining-tokens", left),
                ("x-ratelimit-reset-tokens", "12s"),
            ]
        };
        assert_eq!(of(&openai("7499")), Some((12_000, Some(7_499))));
        // A quarter or more left: nothing to hold.
        assert_eq!(of(&openai("7500")), None);
        assert_eq!(of(&openai("-1")), None);
        assert_eq!(of(&openai("1e3")), None);
        assert_eq!(of(&openai("0")), Some((12_000, None)));
        let anthropic = [
            ("anthropic-ratelimit-tokens-limit", "80000"),
            ("anthropic-ratelimit-tokens-remaining", "4000"),
            ("anthropic-ratelimit-tokens-reset", "2025-11-24T16:00:09Z"),
        ];
        assert_eq!(of(&anthropic), Some((9_000, Some(4_000))));
        // Without its limit, what is left cannot be judged.
        assert_eq!(of(&anthropic[1..]), None);
        let h = hold(ok, &headers(&openai("20")), now);
        assert!(h.is_some_and(|h| h.why == "only 20 tokens are left in its window"));
    }

    #[test]
    fn waits_are_read_from_every_provider_format() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_000_000);
        let ok = StatusCode::OK;
        let many = StatusCode::TOO_MANY_REQUESTS;
        let at = |h: &[(&'static str, &str)], s| hold(s, &headers(h), now).map(|h| h.ms);
        assert_eq!(at(&[("retry-after", "2")], many), Some(2_000));
        assert_eq!(at(&[("retry-after-ms", "350.5")], many), Some(351));
        assert_eq!(at(&[], many), Some(DEFAULT_429_MS));
        assert_eq!(at(&[("retry-after", "99999999")], many), Some(MAX_HOLD_MS));
        assert_eq!(at(&[("retry-after", "-3")], many), Some(DEFAULT_429_MS));
        let openai = [
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "6m0.5s"),
            ("x-ratelimit-remaining-tokens", "1200"),
            ("x-ratelimit-reset-tokens", "20ms"),
        ];
        assert_eq!(at(&openai, ok), Some(360_500));
        assert_eq!(at(&openai[2..], ok), None);
        let anthropic = [
            ("anthropic-ratelimit-tokens-remaining", "0"),
            ("anthropic-ratelimit-tokens-reset", "2025-11-24T16:00:30Z"),
        ];
        assert_eq!(at(&anthropic, ok), Some(30_000));
        assert_eq!(
            at(&[("retry-after", "Mon, 24 Nov 2025 16:00:05 GMT")], many),
            Some(5_000)
        );
        assert_eq!(
            at(
                &[
                    ("x-ratelimit-remaining-requests", "0"),
                    ("x-ratelimit-reset-requests", "soon")
                ],
                ok
            ),
            None
        );
    }
}
