//! `Idempotency-Key` through the gateway: a retry of an answered request gets its kept
//! response without admission or charge, one in flight gets 409, another body 422; a refused
//! request lets go of its key; keys belong to their virtual key. Memory store and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::time::Duration;

use serde_json::{Value, json};
use tollgate_core::{Period, Store};
use tollgate_testkit::sim::SimConfig;

use common::{Env, Reply};

const A: &str = "sk-idem-a";
const B: &str = "sk-idem-b";

async fn env(redis: bool, policy: &str, sim: SimConfig) -> Env {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, sim, "idem").await;
    let text = format!(
        "{store}[idempotency]\nmax_response_bytes = 2048\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"a\"\n[[keys]]\nhash = \"{}\"\ntenant = \"b\"\n\
         [policy]\n{}",
        sim.base_url(),
        tollgate_gateway::hash_key(A),
        tollgate_gateway::hash_key(B),
        policy.replace("[[scopes]]", "[[policy.scopes]]"),
    );
    Env::start(&text, common::SIM_KEY, sim, redis_server).await
}

async fn send(env: &Env, key: &str, idem: Option<&str>, body: &Value) -> Reply {
    let mut h = vec![("authorization", format!("Bearer {key}"))];
    if let Some(k) = idem {
        h.push(("idempotency-key", k.to_owned()));
    }
    env.post_oneshot("/v1/chat/completions", &h, body.to_string())
        .await
}

fn chat(max_tokens: u64, stream: bool) -> Value {
    json!({"model": "gpt-4o", "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "user", "content": "pay the invoice"}]})
}

fn upstream_requests(env: &Env) -> u64 {
    env.sim.stats().requests.values().sum()
}

/// Tenant `a`'s settled tokens today, once nothing is reserved.
async fn settled(env: &Env) -> u64 {
    let day = Some(Period::Fixed(86_400_000));
    let u = tollgate_testkit::wait::at_most(
        Duration::from_secs(2),
        async || env.store.usage("spend|tenant:a", day).await.unwrap(),
        |u| u.reserved == 0,
    )
    .await;
    u.settled
}

const SPEND: &str = "[[scopes]]\nname = \"spend\"\nkey = \"tenant\"\n\
                     budget = { tokens = 100000, period = \"day\" }\n";

/// An answered request's key replays its response, streamed or not: the upstream is not
/// called again and nothing more is charged. Another body under the key is 422; another
/// virtual key's same key is its own.
async fn answered_requests_are_replayed_not_charged(redis: bool) {
    let env = env(redis, SPEND, SimConfig::default()).await;
    let first = send(&env, A, Some("k-1"), &chat(10, false)).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-tollgate-idempotent-replay"), None);
    let charged = settled(&env).await;
    assert!(charged > 0);
    let again = send(&env, A, Some("k-1"), &chat(10, false)).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.header("x-tollgate-idempotent-replay"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(upstream_requests(&env), 1);
    assert_eq!(settled(&env).await, charged, "the replay charged nothing");
    let other = send(&env, A, Some("k-1"), &chat(11, false)).await;
    assert_eq!(
        (other.status, other.code().as_str()),
        (422, "idempotency_key_reused")
    );
    assert_eq!(
        send(&env, B, Some("k-1"), &chat(10, false)).await.status,
        200
    );
    assert_eq!(upstream_requests(&env), 2, "b's k-1 is b's own");
    // A stream is kept whole and sent again as it was.
    let streamed = send(&env, A, Some("k-2"), &chat(5, true)).await;
    assert_eq!(streamed.status, 200);
    let replayed = send(&env, A, Some("k-2"), &chat(5, true)).await;
    assert_eq!(
        replayed.header("x-tollgate-idempotent-replay"),
        Some("true")
    );
    assert_eq!(replayed.header("content-type"), Some("text/event-stream"));
    assert_eq!(replayed.body, streamed.body);
    assert_eq!(upstream_requests(&env), 3);
    // A response larger than the bound is not kept: its key refuses a retry rather than
    // charging it again.
    let large = send(&env, A, Some("k-3"), &chat(2000, true)).await;
    assert_eq!(large.status, 200);
    assert!(large.body.len() > 2048, "{} bytes", large.body.len());
    let r = send(&env, A, Some("k-3"), &chat(2000, true)).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (409, "idempotent_response_not_kept")
    );
    assert_eq!(r.header("x-should-retry"), Some("false"));
    assert_eq!(upstream_requests(&env), 4);
}

/// The same key while its first request is answered: 409 with a retry hint, nothing admitted.
async fn a_key_in_flight_is_409(redis: bool) {
    let sim = SimConfig {
        latency: Duration::from_millis(400),
        ..SimConfig::default()
    };
    let env = env(redis, SPEND, sim).await;
    let body = chat(10, false);
    let (a, b) = tokio::join!(send(&env, A, Some("k-1"), &body), async {
        // Once the first is with the upstream.
        common::instance::until("a request in flight upstream", async || {
            env.sim.stats().in_flight.values().sum::<u64>() != 0
        })
        .await;
        send(&env, A, Some("k-1"), &body).await
    });
    assert_eq!(a.status, 200);
    assert_eq!(
        (b.status, b.code().as_str()),
        (409, "idempotency_key_in_flight")
    );
    assert!(b.header("retry-after").is_some());
    assert_eq!(upstream_requests(&env), 1);
    let c = send(&env, A, Some("k-1"), &body).await;
    assert_eq!(c.header("x-tollgate-idempotent-replay"), Some("true"));
}

/// A refused request lets go of its key: its retry is admitted once the limit allows, not
/// answered with the refusal.
async fn a_refused_request_lets_go_of_its_key(redis: bool) {
    let policy = "[[scopes]]\nname = \"rate\"\nkey = \"tenant\"\n\
                  requests = { limit = 1, window = \"1s\" }\n";
    let env = env(redis, policy, SimConfig::default()).await;
    assert_eq!(send(&env, A, None, &chat(10, false)).await.status, 200);
    let refused = send(&env, A, Some("k-1"), &chat(10, false)).await;
    assert_eq!(
        (refused.status, refused.code().as_str()),
        (429, "request_rate_limit")
    );
    // Once the window has room (`/v1/limits` reads it without counting an attempt).
    tollgate_testkit::wait::until("room in the rate window", async || {
        let auth = [("authorization", format!("Bearer {A}"))];
        let r = common::get_with(env.addr, "/v1/limits", &auth).await;
        let v: Value = serde_json::from_slice(&r.body).unwrap_or_default();
        v["limits"].as_array().is_some_and(|rows| {
            rows.iter()
                .any(|r| r["control"] == "requests" && r["remaining"].as_u64() == Some(1))
        })
    })
    .await;
    let r = send(&env, A, Some("k-1"), &chat(10, false)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.header("x-tollgate-idempotent-replay"), None);
    // Keys out of bounds are refused before anything is counted.
    for bad in ["", &"k".repeat(256)] {
        let r = send(&env, A, Some(bad), &chat(10, false)).await;
        assert_eq!(
            (r.status, r.code().as_str()),
            (400, "invalid_value"),
            "{bad:?}"
        );
    }
}

mod both {
    on_both_stores!(
        answered_requests_are_replayed_not_charged,
        a_key_in_flight_is_409
    );
}

/// On Redis, whose clock is real; the memory store's case runs on paused time
/// (`paused_time.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_refused_request_lets_go_of_its_key() {
    a_refused_request_lets_go_of_its_key(true).await;
}

/// `[idempotency]` is checked field by field.
#[test]
fn idempotency_settings_are_checked() {
    for (section, path) in [
        ("keep = \"0s\"", "idempotency.keep"),
        ("keep = \"8d\"", "idempotency.keep"),
        ("in_flight = \"soon\"", "idempotency.in_flight"),
        (
            "max_response_bytes = 20000000",
            "idempotency.max_response_bytes",
        ),
    ] {
        let text = format!(
            "[idempotency]\n{section}\n[[upstreams]]\nname = \"u\"\n\
             base_url = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\n"
        );
        let e = tollgate_gateway::GatewayConfig::from_toml(&text).unwrap_err();
        assert_eq!(e.path, path, "{e}");
    }
}
