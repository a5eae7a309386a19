//! The gateway end to end, over real sockets, against the upstream simulator: admitted, refused and charged: caps, precise errors, rate, budget and token refusals, embeddings and completions, fail-open, several choices.
//! Tests that involve the store run once on the memory store and once on Redis (its own
//! `redis-server`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tollgate_testkit::sim::SimConfig;

use common::e2e::{
    BASIC, KEY, OTHER_KEY, UPSTREAM_KEY, assert_nothing_leaks, chat, env, send, settled_becomes,
    tenant_usage,
};

async fn admitted_request_is_forwarded_with_its_cap_and_settled(redis: bool) {
    let env = env(redis, BASIC, "", SimConfig::default()).await;
    let r = send(
        &env,
        "/v1/chat/completions",
        Some(KEY),
        chat("Hello there!", 5000),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    // `tg-`, 12 hex digits, `-`, a sequence number in 7: short enough for the memory store to
    // keep inline (23 bytes).
    let id = r.header("x-request-id").unwrap_or_default();
    assert!(id.starts_with("tg-") && id.len() == 23, "{id}");
    assert_eq!(id.split('-').nth(1).map(str::len), Some(12), "{id}");
    assert!(
        r.header("ratelimit-policy")
            .is_some_and(|v| v.contains("\"tenant-requests\";q=100;w=60")),
        "{:?}",
        r.headers
    );
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("100"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("99"));
    assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("100000"));
    // The upstream got the clamped cap and its own key, never the client's.
    let last = env.sim.stats().last_body.unwrap();
    assert_eq!(last["max_tokens"], 200);
    assert!(
        env.sim
            .stats()
            .requests
            .contains_key(&format!("Bearer {UPSTREAM_KEY}"))
    );
    // Settled from the upstream's usage: 3 + 1 + 3 + 3 prompt tokens, 16 completion tokens.
    settled_becomes(&env, 10 + 16).await;
    assert_nothing_leaks(&env).await;
    // A request without a cap gets the policy's default.
    let body = serde_json::to_vec(
        &json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
    )
    .unwrap();
    assert_eq!(
        send(&env, "/v1/chat/completions", Some(KEY), body)
            .await
            .status,
        200
    );
    assert_eq!(env.sim.stats().last_body.unwrap()["max_tokens"], 50);
}

async fn bad_input_gets_precise_errors(redis: bool) {
    let env = env(
        redis,
        BASIC,
        "[server]\nmax_body_bytes = 4096\n",
        SimConfig::default(),
    )
    .await;
    let cases: Vec<(Option<&str>, Vec<u8>, u16, &str)> = vec![
        (None, chat("x", 5), 401, "invalid_api_key"),
        (Some("sk-wrong"), chat("x", 5), 401, "invalid_api_key"),
        (Some(KEY), vec![b'x'; 10_000], 413, "request_too_large"),
        (Some(KEY), b"{not json".to_vec(), 400, "invalid_json"),
        (
            Some(KEY),
            br#"{"model":"gpt-4o","messages":[{"role":"user","content":5}]}"#.to_vec(),
            400,
            "invalid_value",
        ),
        (
            Some(KEY),
            br#"{"model":"gpt-4o","messages":"hi"}"#.to_vec(),
            400,
            "invalid_json",
        ),
        (
            Some(KEY),
            br#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            404,
            "model_not_found",
        ),
        (Some(OTHER_KEY), chat("x", 5), 403, "model_not_allowed"),
        (
            Some(KEY),
            chat("x", 1_000_000_000_000),
            400,
            "invalid_value",
        ),
        (
            Some(KEY),
            br#"{"model":"gpt-4o","max_tokens":-5,"messages":[{"role":"user","content":"x"}]}"#
                .to_vec(),
            400,
            "invalid_json",
        ),
    ];
    for (key, body, status, code) in cases {
        let r = send(&env, "/v1/chat/completions", key, body).await;
        assert_eq!(
            (r.status, r.code().as_str()),
            (status, code),
            "{}",
            String::from_utf8_lossy(&r.body)
        );
        assert!(r.json()["error"]["type"].is_string());
        assert!(r.header("x-request-id").is_some());
    }
    let r = send(&env, "/v1/chat/completions", Some(KEY), chat("x", 5)).await;
    assert_eq!(r.status, 200, "the server keeps serving");
    assert_eq!(
        env.sim.stats().requests.values().sum::<u64>(),
        1,
        "no bad request reached the upstream"
    );
    assert_nothing_leaks(&env).await;
}

async fn rate_and_budget_refusals_carry_retry_headers(redis: bool) {
    let policy = r#"
[[scopes]]
key = "tenant"
requests = { limit = 2, window = "1m" }
[[scopes]]
name = "daily"
key = "tenant"
budget = { tokens = 100, period = "day" }
"#;
    let env = env(redis, policy, "", SimConfig::default()).await;
    assert_eq!(
        send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 20))
            .await
            .status,
        200
    );
    // 80 output tokens + input: over the remaining budget.
    let r = send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 80)).await;
    assert_eq!((r.status, r.code().as_str()), (429, "budget_limit"));
    assert_eq!(r.json()["error"]["type"], "insufficient_quota");
    assert_eq!(
        r.header("x-should-retry"),
        Some("false"),
        "a daily budget is a long wait"
    );
    assert!(
        r.header("retry-after")
            .is_some_and(|s| s.parse::<u64>().unwrap() > 60)
    );
    assert_eq!(r.header("x-tollgate-scope"), Some("tenant:acme"));
    // Third attempt: the rate (every attempt counted, the refused one too).
    let r = send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5)).await;
    assert_eq!((r.status, r.code().as_str()), (429, "request_rate_limit"));
    let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
    let ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
    // A sliding window may need up to two windows to admit again.
    assert!(
        (1..=120).contains(&secs) && ms <= secs * 1000 && ms > (secs - 1) * 1000,
        "{secs} s, {ms} ms"
    );
    assert!(r.header("ratelimit").is_some_and(|v| v.contains(";r=0")));
    // Retried by an SDK only when it would sleep that long (a minute at most).
    let long = (ms > 60_000).then_some("false");
    assert_eq!(r.header("x-should-retry"), long, "{ms} ms");
    assert_eq!(env.sim.stats().requests.values().sum::<u64>(), 1);
    assert_nothing_leaks(&env).await;
}

async fn token_limits_are_400s(redis: bool) {
    let policy = r#"
[[scopes]]
key = "tenant"
input_tokens = 20
output_tokens = { max = 100 }
total_tokens = 100
"#;
    let env = env(redis, policy, "", SimConfig::default()).await;
    let long = "word ".repeat(100);
    for (body, code) in [
        (chat(&long, 5), "input_token_limit"),
        (chat("hi", 500), "output_token_limit"),
        (chat("hi", 95), "total_token_limit"),
    ] {
        let r = send(&env, "/v1/chat/completions", Some(KEY), body).await;
        assert_eq!((r.status, r.code().as_str()), (400, code));
        assert!(r.header("retry-after").is_none());
    }
    assert_eq!(env.sim.stats().requests.values().sum::<u64>(), 0);
}

async fn embeddings_and_completions(redis: bool) {
    let env = env(redis, BASIC, "", SimConfig::default()).await;
    let r = send(
        &env,
        "/v1/embeddings",
        Some(KEY),
        r#"{"model":"text-embedding-3-small","input":"hello world"}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = send(
        &env,
        "/v1/completions",
        Some(KEY),
        r#"{"model":"gpt-3.5-turbo-instruct","prompt":"hello","max_tokens":4}"#,
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        env.sim.stats().last_body,
        None,
        "chat bodies only are recorded"
    );
    settled_becomes(&env, 2 + (1 + 4)).await;
    assert_nothing_leaks(&env).await;
}

/// Redis down: a policy that lets every control of a request fail open admits it (counted);
/// token limits are still enforced; a policy that does not fails closed with 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_is_an_explicit_per_control_choice() {
    let open = r#"
fail_open = ["request_rate_limit", "budget_limit"]
[[scopes]]
key = "tenant"
requests = { limit = 100, window = "1m" }
input_tokens = 50
budget = { tokens = 100000, period = "day" }
"#;
    let mut env_open = env(true, open, "", SimConfig::default()).await;
    assert_eq!(
        send(&env_open, "/v1/chat/completions", Some(KEY), chat("hi", 5))
            .await
            .status,
        200
    );
    env_open._redis.as_mut().unwrap().kill();
    let r = send(&env_open, "/v1/chat/completions", Some(KEY), chat("hi", 5)).await;
    assert_eq!(
        r.status,
        200,
        "failed open: {}",
        String::from_utf8_lossy(&r.body)
    );
    let r = send(
        &env_open,
        "/v1/chat/completions",
        Some(KEY),
        chat(&"word ".repeat(100), 5),
    )
    .await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "input_token_limit"),
        "token limits still hold"
    );
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let m = client
        .request(
            Request::get(format!("http://{}/metrics", env_open.metrics))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    let text =
        String::from_utf8_lossy(&m.into_body().collect().await.unwrap().to_bytes()).into_owned();
    assert!(
        text.lines().any(|l| l == "tollgate_fail_open_total 1"),
        "{text}"
    );

    // The same policy without fail_open: closed.
    let closed = open.replace("fail_open = [\"request_rate_limit\", \"budget_limit\"]", "");
    let mut env_closed = env(true, &closed, "", SimConfig::default()).await;
    env_closed._redis.as_mut().unwrap().kill();
    let r = send(
        &env_closed,
        "/v1/chat/completions",
        Some(KEY),
        chat("hi", 5),
    )
    .await;
    assert_eq!((r.status, r.code().as_str()), (503, "store_unavailable"));
    assert_eq!(r.header("retry-after"), Some("1"));
    // Only one upstream call was made while a store was down: the fail-open one.
    assert_eq!(env_closed.sim.stats().requests.values().sum::<u64>(), 0);
}

/// Several choices multiply the output: the reservation covers all of them, and each choice
/// gets its share of the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_choices_are_reserved_in_full() {
    let policy = r#"
[[scopes]]
key = "tenant"
output_tokens = { max = 60, mode = "clamp" }
budget = { tokens = 1000, period = "day" }
"#;
    let sim = SimConfig {
        latency: Duration::from_millis(1000),
        ..SimConfig::default()
    };
    let env = Arc::new(env(false, policy, "", sim).await);
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "n": 3, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]})).unwrap();
    let e2 = env.clone();
    let first =
        tokio::spawn(async move { send(&e2, "/v1/chat/completions", Some(KEY), body).await });
    // While it runs: 8 input + 3 x 10 output reserved.
    let mut reserved = 0;
    tollgate_testkit::wait::until("a reservation while it runs", async || {
        reserved = tenant_usage(&env).await.reserved;
        reserved > 0
    })
    .await;
    let r = first.await.unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(reserved, 8 + 30);
    assert_eq!(env.sim.stats().last_body.unwrap()["max_tokens"], 10);
    // 4 choices of 20 = 80, clamped to the cap of 60: 15 each.
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "n": 4, "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]})).unwrap();
    assert_eq!(
        send(&env, "/v1/chat/completions", Some(KEY), body)
            .await
            .status,
        200
    );
    assert_eq!(env.sim.stats().last_body.unwrap()["max_tokens"], 15);
    // More choices than the cap has tokens: refused.
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "n": 100, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})).unwrap();
    let r = send(&env, "/v1/chat/completions", Some(KEY), body).await;
    assert_eq!((r.status, r.code().as_str()), (400, "invalid_value"));
    assert_nothing_leaks(&env).await;
}

mod both {
    on_both_stores!(
        admitted_request_is_forwarded_with_its_cap_and_settled,
        bad_input_gets_precise_errors,
        rate_and_budget_refusals_carry_retry_headers,
        token_limits_are_400s,
        embeddings_and_completions
    );
}
