//! Time-driven behaviour on paused time: the gateway on a memory store whose clock follows
//! tokio's (`TokioClock`), requests sent through the router without sockets to the gateway
//! (`Router::oneshot`), and time moved by `tokio::time::advance` or by the sleeps that paused
//! time skips. A day passes in no time, and every wait is exact.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use http::Request;
use http_body_util::BodyExt;
use tokio::time::{Instant, advance};
use tollgate_core::{Clock, MemoryStore, SharedClock};
use tollgate_gateway::Gateway;
use tollgate_gateway::config::GatewayConfig;
use tollgate_gateway::store::AnyStore;
use tollgate_testkit::T0;
use tollgate_testkit::paused::TokioClock;
use tollgate_testkit::sim::{Sim, SimConfig};
use tower::ServiceExt;

const KEY: &str = "sk-paused";
const DAY_MS: u64 = 86_400_000;

/// The router of a gateway on a memory store on `clock`, in front of a simulator with `sim`'s
/// timing.
async fn app(clock: TokioClock, sections: &str, sim: SimConfig) -> (Router, Sim) {
    let sim = Sim::start(sim).await.unwrap();
    let text = format!(
        "{sections}\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
    );
    let config = GatewayConfig::from_toml(&text).unwrap_or_else(|e| panic!("{e}"));
    let clock: SharedClock = Arc::new(clock);
    let store = AnyStore::Memory(Arc::new(MemoryStore::with_clock(clock)));
    let gw = Arc::new(Gateway::new(config, store));
    (tollgate_gateway::router(gw), sim)
}

struct Answer {
    status: u16,
    code: String,
    retry_after_ms: Option<u64>,
    body: String,
    replayed: bool,
}

async fn chat(app: &Router, max_tokens: u64, stream: bool) -> Answer {
    chat_with(app, max_tokens, stream, None).await
}

/// [`chat`], with an `Idempotency-Key` when given; the answer's replay header is in `replayed`.
async fn chat_with(app: &Router, max_tokens: u64, stream: bool, idem: Option<&str>) -> Answer {
    let body = serde_json::json!({
        "model": "gpt-4o",
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    });
    let mut req = Request::post("/v1/chat/completions")
        .header("authorization", format!("Bearer {KEY}"))
        .header("content-type", "application/json");
    if let Some(k) = idem {
        req = req.header("idempotency-key", k);
    }
    let mut req = req.body(Body::from(body.to_string())).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo("127.0.0.1:5000".parse::<SocketAddr>().unwrap()));
    let r = app.clone().oneshot(req).await.unwrap();
    let status = r.status().as_u16();
    let replayed = r.headers().contains_key("x-tollgate-idempotent-replay");
    let retry_after_ms = r
        .headers()
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let body =
        String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).into_owned();
    let code = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
        .unwrap_or_default();
    Answer {
        status,
        code,
        retry_after_ms,
        body,
        replayed,
    }
}

/// A day's budget spent a minute before midnight UTC: refused until midnight, with a wait that
/// says so, and served again at midnight, not a moment before.
#[tokio::test(start_paused = true)]
async fn a_spent_day_budget_opens_again_at_midnight() {
    let policy =
        "[[policy.scopes]]\nkey = \"tenant\"\nbudget = { tokens = 100, period = \"day\" }\n";
    let sim = SimConfig {
        output_tokens: 5,
        ..SimConfig::default()
    };
    let clock = TokioClock::at(T0 + DAY_MS - 60_000);
    let (app, _sim) = app(clock, policy, sim).await;
    let mut served = 0;
    let refused = loop {
        let a = chat(&app, 20, false).await;
        match a.status {
            200 => served += 1,
            _ => break a,
        }
        assert!(served < 20, "the budget never refused");
    };
    assert_eq!(
        (refused.status, refused.code.as_str()),
        (429, "budget_limit")
    );
    // The wait runs to midnight (plus a jitter of at most a second).
    let to_midnight = T0 + DAY_MS - clock.now();
    let wait = refused.retry_after_ms.expect("a wait");
    assert!(
        (to_midnight..=to_midnight + 1_000).contains(&wait),
        "{wait} ms, {to_midnight} ms to midnight"
    );
    advance(Duration::from_millis(to_midnight - 1)).await;
    assert_eq!(chat(&app, 20, false).await.code, "budget_limit");
    advance(Duration::from_millis(1)).await;
    let a = chat(&app, 20, false).await;
    assert_eq!(a.status, 200, "{}", a.body);
}

/// A rate refusal's wait is enough: after it, the same request is served. (The window slides,
/// and the refused attempt counts too, so the wait may be longer than the window; probing
/// before it would count another attempt.)
#[tokio::test(start_paused = true)]
async fn a_rate_refusal_is_served_after_its_wait() {
    let policy =
        "[[policy.scopes]]\nkey = \"tenant\"\nrequests = { limit = 2, window = \"10s\" }\n";
    let (app, _sim) = app(TokioClock::at(T0), policy, SimConfig::default()).await;
    assert_eq!(chat(&app, 5, false).await.status, 200);
    assert_eq!(chat(&app, 5, false).await.status, 200);
    let refused = chat(&app, 5, false).await;
    assert_eq!(
        (refused.status, refused.code.as_str()),
        (429, "request_rate_limit")
    );
    let wait = refused.retry_after_ms.expect("a wait");
    assert!(wait > 0 && wait <= 2 * 10_000 + 1_000, "{wait}");
    advance(Duration::from_millis(wait)).await;
    let a = chat(&app, 5, false).await;
    assert_eq!(a.status, 200, "{}", a.body);
}

/// A stream that runs three times its lease's TTL keeps its lease (renewed as it runs): a
/// second request meanwhile finds the only slot taken; once the stream ends, the slot is free.
#[tokio::test(start_paused = true)]
async fn a_stream_longer_than_its_lease_keeps_it() {
    let policy =
        "[[policy.scopes]]\nkey = \"tenant\"\nconcurrency = { limit = 1, lease_ttl = \"1s\" }\n";
    let sim = SimConfig {
        token_delay: Duration::from_millis(30),
        output_tokens: 100,
        ..SimConfig::default()
    };
    let (app, _sim) = app(TokioClock::at(T0), policy, sim).await;
    let started = Instant::now();
    let long = tokio::spawn({
        let app = app.clone();
        async move { chat(&app, 100, true).await }
    });
    advance(Duration::from_secs(2)).await;
    let r = chat(&app, 5, false).await;
    assert_eq!((r.status, r.code.as_str()), (429, "concurrency_limit"));
    let done = long.await.unwrap();
    assert_eq!(done.status, 200);
    assert_eq!(done.body.matches("\"content\":\" tok\"").count(), 100);
    assert!(started.elapsed() >= Duration::from_secs(3));
    assert_eq!(chat(&app, 5, false).await.status, 200);
}

/// A gateway under `sections` whose one slot a stream holds for five seconds (100 tokens, 50 ms
/// each), from 100 ms before this returns.
async fn slot_held_for_five_seconds(
    sections: &str,
) -> (Router, Sim, tokio::task::JoinHandle<Answer>) {
    let sim = SimConfig {
        token_delay: Duration::from_millis(50),
        output_tokens: 100,
        ..SimConfig::default()
    };
    let (app, sim) = app(TokioClock::at(T0), sections, sim).await;
    let long = tokio::spawn({
        let app = app.clone();
        async move { chat(&app, 100, true).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    (app, sim, long)
}

/// A queued request waits for a slot at most `[queue] max_wait`, then is refused; one whose
/// slot comes back within that time is served.
#[tokio::test(start_paused = true)]
async fn a_queued_request_waits_at_most_max_wait() {
    let sections = "[queue]\nmax_wait = \"2s\"\nper_key = 4\nglobal = 4\n\
         [[policy.scopes]]\nkey = \"tenant\"\nconcurrency = { limit = 1, lease_ttl = \"1m\" }\n";
    let (app, _sim, long) = slot_held_for_five_seconds(sections).await;
    let asked = Instant::now();
    let r = chat(&app, 5, false).await;
    let waited = asked.elapsed();
    assert_eq!((r.status, r.code.as_str()), (429, "concurrency_limit"));
    assert!(
        waited >= Duration::from_millis(1_900) && waited <= Duration::from_secs(2),
        "{waited:?}"
    );
    // Asked about 1.5 s before the stream ends: it waits for the slot and is served.
    tokio::time::sleep(Duration::from_millis(1_400)).await;
    let asked = Instant::now();
    let r = chat(&app, 5, false).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(long.await.unwrap().status, 200);
}

/// A refused request lets go of its idempotency key: its retry after the wait is admitted and
/// served, not answered with the refusal kept.
#[tokio::test(start_paused = true)]
async fn a_refused_request_lets_go_of_its_idempotency_key() {
    let policy = "[[policy.scopes]]\nkey = \"tenant\"\nrequests = { limit = 1, window = \"1s\" }\n";
    let (app, _sim) = app(TokioClock::at(T0), policy, SimConfig::default()).await;
    assert_eq!(chat(&app, 5, false).await.status, 200);
    let refused = chat_with(&app, 5, false, Some("k-1")).await;
    assert_eq!(
        (refused.status, refused.code.as_str()),
        (429, "request_rate_limit")
    );
    advance(Duration::from_millis(
        refused.retry_after_ms.expect("a wait"),
    ))
    .await;
    let r = chat_with(&app, 5, false, Some("k-1")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(!r.replayed);
    // Answered now, the key replays that answer.
    let again = chat_with(&app, 5, false, Some("k-1")).await;
    assert_eq!(again.status, 200);
    assert!(again.replayed);
}

/// A queued request is one attempt: its retries from the queue count neither in the rate nor
/// in the repeat counter of loop detection, so waiting for a slot never makes it a loop.
#[tokio::test(start_paused = true)]
async fn a_queued_request_is_not_its_own_loop() {
    let sections = "[queue]\nmax_wait = \"10s\"\nper_key = 4\nglobal = 4\n\
         [[policy.scopes]]\nkey = \"tenant\"\nconcurrency = { limit = 1, lease_ttl = \"1m\" }\n\
         loops = { max_identical = 2, window = \"1m\" }\n";
    // The next request waits, retried many times, while the slot is held.
    let (app, _sim, long) = slot_held_for_five_seconds(sections).await;
    let r = chat(&app, 5, false).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(long.await.unwrap().status, 200);
    // The same content a third time (the cap and streaming are not what makes a request the
    // same): that one is the loop.
    let r = chat(&app, 5, false).await;
    assert_eq!((r.status, r.code.as_str()), (429, "loop_detected"));
}

/// `GET` of `path` on `app` with `bearer`: the JSON answer.
async fn read(app: &Router, path: &str, bearer: &str) -> serde_json::Value {
    let mut req = Request::get(path)
        .header("authorization", format!("Bearer {bearer}"))
        .body(Body::empty())
        .unwrap();
    req.extensions_mut()
        .insert(ConnectInfo("127.0.0.1:5000".parse::<SocketAddr>().unwrap()));
    let r = app.clone().oneshot(req).await.unwrap();
    assert_eq!(r.status(), 200, "{path}");
    let body = r.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}

/// The numbers a person reads are the store's: on a store whose clock is eleven months from the
/// instance's, `/v1/limits` and `/admin/usage` give the reset of the store's period, and both
/// count what the period carries over from the one before, as admission does: the same
/// remaining, the same instant.
#[tokio::test(start_paused = true)]
async fn usage_is_read_by_the_stores_clock_with_its_carry() {
    const HOUR: u64 = 3_600_000;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), "paused-admin-token-0123456789").unwrap();
    let sections = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n[[policy.scopes]]\n\
         name = \"hourly\"\nkey = \"tenant\"\n\
         budget = {{ tokens = 1000, period = \"1h\", carry_over = \"50%\" }}\n",
        dir.path().join("token").display()
    );
    let sim = SimConfig {
        output_tokens: 5,
        ..SimConfig::default()
    };
    let clock = TokioClock::at(T0 + HOUR - 600_000);
    let text = format!(
        "{sections}\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n",
        Sim::start(sim).await.unwrap().base_url(),
        tollgate_gateway::hash_key(KEY),
    );
    let config = GatewayConfig::from_toml(&text).unwrap_or_else(|e| panic!("{e}"));
    let admin_config = config.admin.clone().unwrap();
    let shared: SharedClock = Arc::new(clock);
    let store = AnyStore::Memory(Arc::new(MemoryStore::with_clock(shared)));
    let gw = Arc::new(Gateway::new(config, store));
    let (app, admin) = (
        tollgate_gateway::router(gw.clone()),
        tollgate_gateway::admin::router(gw, admin_config),
    );
    assert_eq!(chat(&app, 20, false).await.status, 200);
    // The next hour: the first left most of its 1,000 unused, of which 500 carry over.
    advance(Duration::from_millis(600_000)).await;
    let limits = read(&app, "/v1/limits", KEY).await;
    let usage = read(
        &admin,
        "/admin/usage?scope=hourly%7Ctenant%3Aacme",
        "paused-admin-token-0123456789",
    )
    .await;
    let row = limits["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["control"] == "budget")
        .unwrap()
        .clone();
    assert_eq!(row["carried_over"], 500, "{limits}");
    assert_eq!(row["remaining"], 1500, "{limits}");
    assert_eq!(usage["budget"]["remaining"], 1500, "{usage}");
    assert_eq!(usage["budget"]["carried_over"], 500, "{usage}");
    let end = T0 + 2 * HOUR;
    assert_eq!(row["resets_at_ms"], end, "{limits}");
    assert_eq!(usage["budget"]["resets_at_ms"], end, "{usage}");
    assert_eq!(usage["budget"]["resets_at"], "2026-01-01T02:00:00Z");
    assert_eq!(limits["now_ms"], clock.now(), "{limits}");
    assert_eq!(usage["now_ms"], clock.now(), "{usage}");
}
