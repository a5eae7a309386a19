//! The gateway end to end, over real sockets, against the upstream simulator; every test runs
//! once with the memory store and once with Redis (its own `redis-server`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate_core::{Period, Store};
use tollgate_testkit::sim::SimConfig;

const KEY: &str = "sk-test-acme";
const OTHER_KEY: &str = "sk-test-other";
const UPSTREAM_KEY: &str = "upstream-secret";

use common::{Env, Reply};

async fn env(redis: bool, policy: &str, extra: &str, sim: SimConfig) -> Env {
    let (sim, redis_server, store_cfg) =
        common::upstream_and_store(redis, UPSTREAM_KEY, sim, "e2e").await;
    let text = format!(
        "{store_cfg}{extra}\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\", \"gpt-4o-fail\", \"text-embedding-3-small\", \"gpt-3.5-turbo-instruct\"]\n\
         [[keys]]\nname = \"acme\"\nhash = \"{}\"\ntenant = \"acme\"\nallow_user = true\n\
         [[keys]]\nname = \"other\"\nhash = \"{}\"\ntenant = \"other\"\nmodels = [\"text-embedding-3-small\"]\n\
         [policy]\n{policy}\n",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
        tollgate_gateway::hash_key(OTHER_KEY),
    )
    .replace("[[scopes]]", "[[policy.scopes]]");
    Env::start(&text, UPSTREAM_KEY, sim, redis_server).await
}

async fn send(env: &Env, path: &str, key: Option<&str>, body: impl Into<Bytes>) -> Reply {
    let auth: Vec<(&str, String)> = key
        .map(|k| ("authorization", format!("Bearer {k}")))
        .into_iter()
        .collect();
    common::post(env.addr, path, &auth, body).await
}

fn chat(content: &str, max: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": max, "messages": [{"role": "user", "content": content}]})).unwrap()
}

async fn tenant_usage(env: &Env) -> tollgate_core::ScopeUsage {
    common::tenant_usage(&env.store).await
}

/// The tenant's settled total once it reaches `expected` (settlement happens after the
/// response, off its path); fails after 3 s.
async fn settled_becomes(env: &Env, expected: u64) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let u = tenant_usage(env).await;
        if u.settled == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "settled {} never became {expected}",
            u.settled
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every test ends with nothing held: leases back, nothing reserved.
async fn assert_nothing_leaks(env: &Env) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let u = tenant_usage(env).await;
        if u.leases == 0 && u.reserved == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "leaked: {u:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const BASIC: &str = r#"
[[scopes]]
key = "tenant"
requests = { limit = 100, window = "1m" }
input_tokens = 1000
output_tokens = { max = 200, mode = "clamp", default = 50 }
concurrency = { limit = 4, lease_ttl = "30s" }
budget = { tokens = 100000, period = "day" }
"#;

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

async fn streams_pass_through_and_settle(redis: bool) {
    let env = env(redis, BASIC, "", SimConfig::default()).await;
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": 8, "stream": true,
        "messages": [{"role": "user", "content": "Hello there!"}]}))
    .unwrap();
    let r = send(&env, "/v1/chat/completions", Some(KEY), body).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let text = String::from_utf8_lossy(&r.body);
    assert_eq!(text.matches("\"content\":\" tok\"").count(), 8);
    assert!(text.trim_end().ends_with("data: [DONE]"));
    assert!(
        !text.contains("\"usage\""),
        "the usage chunk the gateway asked for is not shown"
    );
    assert_eq!(
        env.sim.stats().last_body.unwrap()["stream_options"]["include_usage"],
        true
    );
    settled_becomes(&env, 10 + 8).await;
    // A client that asked for usage gets it.
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "Hello there!"}]})).unwrap();
    let r = send(&env, "/v1/chat/completions", Some(KEY), body).await;
    assert!(String::from_utf8_lossy(&r.body).contains("\"completion_tokens\":3"));
    assert_nothing_leaks(&env).await;
}

/// Sends a request on a raw socket, reads `read` bytes of the response, then disconnects.
async fn disconnect_after(env: &Env, body: &[u8], read: usize) -> Instant {
    let mut s = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut buf = vec![0u8; read];
    if read > 0 {
        s.read_exact(&mut buf).await.unwrap();
    } else {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(s);
    Instant::now()
}

async fn client_disconnects_cancel_the_upstream(redis: bool) {
    let sim = SimConfig {
        latency: Duration::from_millis(200),
        token_delay: Duration::from_millis(20),
        output_tokens: 200,
        ..SimConfig::default()
    };
    let env = env(redis, BASIC, "", sim).await;
    // Mid-stream: read the headers and a few events, then leave.
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": 200, "stream": true, "messages": [{"role": "user", "content": "hi"}]})).unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let left = disconnect_after(&env, &body, 600).await;
    let deadline = Instant::now() + Duration::from_secs(2);
    while env.sim.stats().cancelled.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the upstream never saw the disconnect"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seen = env.sim.stats().cancelled[0];
    assert!(
        seen.saturating_duration_since(left) < Duration::from_millis(100),
        "upstream closed {:?} after the client left",
        seen.saturating_duration_since(left)
    );
    assert_nothing_leaks(&env).await;
    let u = tenant_usage(&env).await;
    assert!(
        u.settled > 0 && u.settled < 1 + 200,
        "charged the streamed part: {}",
        u.settled
    );
    // Before the first byte of a non-streamed answer: the upstream, which would go on working
    // anyway, is let finish, and its true usage is settled.
    let before = u.settled;
    let completed = env.sim.stats().completed;
    disconnect_after(&env, &chat("hi", 200), 0).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while env.sim.stats().completed == completed {
        assert!(Instant::now() < deadline, "the upstream never finished");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(env.sim.stats().cancelled.len(), 1, "not cancelled upstream");
    assert_nothing_leaks(&env).await;
    let s = env.sim.stats();
    let last = tenant_usage(&env).await.settled - before;
    assert_eq!(last, 8 + 200, "settled what the upstream reported: {s:?}");
}

async fn concurrency_is_enforced_as_the_upstream_sees_it(redis: bool) {
    let policy = r#"
[[scopes]]
key = "tenant"
concurrency = { limit = 2, lease_ttl = "30s" }
"#;
    let sim = SimConfig {
        latency: Duration::from_millis(100),
        ..SimConfig::default()
    };
    let env = Arc::new(env(redis, policy, "", sim).await);
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let env = env.clone();
            tokio::spawn(async move {
                send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5)).await
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            200 => ok += 1,
            429 => assert_eq!(r.code(), "concurrency_limit"),
            s => panic!("status {s}"),
        }
    }
    assert!(ok >= 2);
    let max = env
        .sim
        .stats()
        .max_in_flight
        .values()
        .copied()
        .max()
        .unwrap_or(0);
    assert!(max <= 2, "the upstream saw {max} at once");
    assert_nothing_leaks(&env).await;
}

async fn a_bounded_queue_waits_for_a_slot(redis: bool) {
    let policy = r#"
[[scopes]]
key = "tenant"
concurrency = { limit = 1, lease_ttl = "30s" }
"#;
    let sim = SimConfig {
        latency: Duration::from_millis(50),
        ..SimConfig::default()
    };
    let env = Arc::new(
        env(
            redis,
            policy,
            "[queue]\nmax_wait = \"3s\"\nper_key = 2\nglobal = 10\n",
            sim,
        )
        .await,
    );
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let env = env.clone();
            tokio::spawn(async move {
                send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5))
                    .await
                    .status
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    // One runs, two wait their turn, two find the queue full.
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        3,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        2,
        "{statuses:?}"
    );
    assert_eq!(
        env.sim.stats().max_in_flight.values().copied().max(),
        Some(1)
    );
    assert_nothing_leaks(&env).await;
}

async fn upstream_errors_release_and_charge_nothing(redis: bool) {
    let env = env(redis, BASIC, "", SimConfig::default()).await;
    let body = serde_json::to_vec(&json!({"model": "gpt-4o-fail", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})).unwrap();
    let r = send(&env, "/v1/chat/completions", Some(KEY), body).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.code(), "server_error");
    assert_nothing_leaks(&env).await;
    assert_eq!(tenant_usage(&env).await.settled, 0);
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

macro_rules! both_stores {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(false).await } )*
        }
        mod redis {
            $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(true).await } )*
        }
    };
}

both_stores!(
    admitted_request_is_forwarded_with_its_cap_and_settled,
    bad_input_gets_precise_errors,
    rate_and_budget_refusals_carry_retry_headers,
    token_limits_are_400s,
    streams_pass_through_and_settle,
    client_disconnects_cancel_the_upstream,
    concurrency_is_enforced_as_the_upstream_sees_it,
    a_bounded_queue_waits_for_a_slot,
    upstream_errors_release_and_charge_nothing,
    embeddings_and_completions,
    long_streams_renew_their_leases,
);

/// Slow and abusive clients: headers that never finish, a body that never arrives, and more
/// connections than allowed. Store-independent, so run on memory only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_and_connections_are_bounded() {
    let extra =
        "[server]\nheader_timeout = \"300ms\"\nbody_timeout = \"300ms\"\nmax_connections = 2\n";
    let env = env(false, BASIC, extra, SimConfig::default()).await;
    // Headers that never finish: the connection is closed.
    let mut s = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut buf))
        .await
        .expect("closed in time");
    assert!(
        n.is_err()
            || String::from_utf8_lossy(&buf).is_empty()
            || String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 408")
    );
    drop(s);
    // A body that never arrives: 408 in the API's format.
    let mut s = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-length: 100\r\n\r\n{{\"model\""
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
        .await
        .expect("answered in time")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("body_timeout"));
    drop(s);
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Two idle connections fill the limit; a third is closed at once.
    let a = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    let b = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut c = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    let _ = c
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(2), c.read_to_end(&mut buf))
        .await
        .expect("closed at once");
    assert!(
        r.is_err() || buf.is_empty(),
        "the third connection was served: {}",
        String::from_utf8_lossy(&buf)
    );
    drop((a, b));
    // Once they are gone (their header timeout passes), service resumes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5))
            .await
            .status,
        200
    );
}

/// Decision records: one line per request, with ids and numbers; the prompt and the completion
/// never appear in any of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decision_records_never_contain_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("records.jsonl");
    let extra = format!("[records]\npath = \"{}\"\n", path.display());
    let policy = r#"
[[scopes]]
key = "tenant"
requests = { limit = 3, window = "1m" }
budget = { tokens = 100000, period = "day" }
"#;
    let env = env(false, policy, &extra, SimConfig::default()).await;
    let canary = "CANARY-4f1d9b-do-not-log";
    let r = send(
        &env,
        "/v1/chat/completions",
        Some(KEY),
        chat(&format!("secret {canary}"), 5),
    )
    .await;
    assert_eq!(r.status, 200);
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": 3, "stream": true,
        "messages": [{"role": "user", "content": canary}]}))
    .unwrap();
    assert_eq!(
        send(&env, "/v1/chat/completions", Some(KEY), body)
            .await
            .status,
        200
    );
    assert_eq!(
        send(&env, "/v1/chat/completions", Some(KEY), chat(canary, 5))
            .await
            .status,
        200
    );
    let denied = send(&env, "/v1/chat/completions", Some(KEY), chat(canary, 5)).await;
    assert_eq!(denied.status, 429);
    // The writer is asynchronous: wait for the four lines.
    let deadline = Instant::now() + Duration::from_secs(3);
    let text = loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.lines().count() >= 4 || Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(
        !text.contains("CANARY"),
        "a record leaked the prompt: {text}"
    );
    assert!(!text.contains("tok tok"), "a record leaked the completion");
    let settled: Vec<&Value> = lines.iter().filter(|l| l["ending"] == "settled").collect();
    assert_eq!(settled.len(), 3);
    for l in &settled {
        assert_eq!(l["decision"], "admit");
        assert_eq!(l["upstream_status"], 200);
        assert!(l["settled"][0].as_u64().unwrap() > 0);
        assert!(l["request_id"].as_str().unwrap().starts_with("tg-"));
    }
    let deny = lines.iter().find(|l| l["decision"] == "deny").unwrap();
    assert_eq!(
        (deny["reason"].as_str(), deny["scope"].as_str()),
        (Some("request_rate_limit"), Some("tenant:acme"))
    );
    assert_eq!(deny["policy_version"], "unversioned");
}

/// `/metrics` in Prometheus format: decisions by reason and rule, in-flight and unsettled
/// gauges, settled tokens, store and upstream latency histograms, and the remaining budget of a
/// global scope.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_report_decisions_latency_and_budget() {
    // Rule names unique to this test: the recorder is process-wide, and under `cargo test`
    // other tests in the process record too.
    let policy = r#"
[[scopes]]
name = "metrics-tenant"
key = "tenant"
requests = { limit = 2, window = "1m" }
[[scopes]]
name = "metrics-everyone"
key = "global"
budget = { tokens = 100000, period = "day" }
"#;
    let env = env(
        false,
        policy,
        "[metrics]\nrefresh = \"1s\"\n",
        SimConfig::default(),
    )
    .await;
    for _ in 0..3 {
        send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5)).await;
    }
    // Budget figures are read from the store once a refresh: wait for two.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let r = client
        .request(
            Request::get(format!("http://{}/metrics", env.metrics))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text =
        String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).into_owned();
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
            .to_owned()
    };
    let value = |prefix: &str| {
        line(prefix)
            .rsplit(' ')
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    assert_eq!(
        value("tollgate_decisions_total{decision=\"request_rate_limit\",rule=\"metrics-tenant\"}"),
        1.0
    );
    assert!(value("tollgate_decisions_total{decision=\"admit\"") >= 2.0);
    assert!(value("tollgate_settled_tokens_total{kind=\"output\"}") >= 10.0);
    assert!(value("tollgate_upstream_responses_total{status=\"2xx\"}") >= 2.0);
    assert!(line("tollgate_store_call_seconds_bucket{op=\"admit\",le=\"0.001\"}").len() > 10);
    assert!(line("tollgate_upstream_seconds_bucket").contains("le="));
    line("tollgate_in_flight");
    line("tollgate_reserved_unsettled_tokens");
    line("tollgate_oldest_unsettled_seconds");
    // The remaining budget of the global scope, as the store has it.
    let u = env
        .store
        .usage("metrics-everyone|global", Some(Period::Fixed(86_400_000)))
        .await
        .unwrap();
    assert!(u.settled > 0);
    assert_eq!(
        value("tollgate_budget_remaining{scope=\"metrics-everyone|global\",unit=\"tokens\"}"),
        (100000 - u.settled - u.reserved) as f64
    );
}

/// Every metric the Grafana dashboard (`deploy/grafana-dashboard.json`) queries exists in the
/// code, so the dashboard cannot drift into showing nothing.
#[test]
fn the_dashboard_only_uses_metrics_the_gateway_exports() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dash = std::fs::read_to_string(root.join("deploy/grafana-dashboard.json")).unwrap();
    let code = std::fs::read_to_string(root.join("crates/gateway/src/telemetry.rs")).unwrap();
    let mut names: Vec<&str> = dash
        .match_indices("tollgate_")
        .map(|(i, _)| {
            let rest = &dash[i..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let name = &rest[..end];
            name.strip_suffix("_bucket").unwrap_or(name)
        })
        .collect();
    names.sort();
    names.dedup();
    assert!(names.len() >= 10, "{names:?}");
    for n in names {
        assert!(
            code.contains(&format!("\"{n}\"")),
            "the dashboard uses {n}, which the gateway does not export"
        );
    }
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
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut reserved = 0;
    while reserved == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
        reserved = tenant_usage(&env).await.reserved;
    }
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

/// A stream longer than the lease TTL renews its lease: its slot stays held throughout.
async fn long_streams_renew_their_leases(redis: bool) {
    let policy = r#"
[[scopes]]
key = "tenant"
concurrency = { limit = 1, lease_ttl = "1s" }
"#;
    let sim = SimConfig {
        latency: Duration::from_millis(10),
        token_delay: Duration::from_millis(30),
        output_tokens: 100,
        ..SimConfig::default()
    };
    let env = Arc::new(env(redis, policy, "", sim).await);
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": 100, "stream": true, "messages": [{"role": "user", "content": "hi"}]})).unwrap();
    let e2 = env.clone();
    let long =
        tokio::spawn(async move { send(&e2, "/v1/chat/completions", Some(KEY), body).await });
    // Once the stream holds its lease, wait twice the TTL: renewed, the slot is still taken.
    let deadline = Instant::now() + Duration::from_secs(5);
    while tenant_usage(&env).await.leases == 0 {
        assert!(Instant::now() < deadline, "the stream was never admitted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let r = send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5)).await;
    assert_eq!((r.status, r.code().as_str()), (429, "concurrency_limit"));
    let done = long.await.unwrap();
    assert_eq!(done.status, 200);
    assert_eq!(
        String::from_utf8_lossy(&done.body)
            .matches("\"content\":\" tok\"")
            .count(),
        100
    );
    assert_nothing_leaks(&env).await;
    assert_eq!(
        send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5))
            .await
            .status,
        200
    );
}

/// A queued request whose client disconnects leaves the queue at once: its place is free for
/// the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_the_queue_frees_its_place() {
    let policy = r#"
[[scopes]]
key = "tenant"
concurrency = { limit = 1, lease_ttl = "30s" }
"#;
    let sim = SimConfig {
        latency: Duration::from_millis(1500),
        ..SimConfig::default()
    };
    let env = Arc::new(
        env(
            false,
            policy,
            "[queue]\nmax_wait = \"5s\"\nper_key = 1\nglobal = 1\n",
            sim,
        )
        .await,
    );
    let e2 = env.clone();
    let holder = tokio::spawn(async move {
        send(&e2, "/v1/chat/completions", Some(KEY), chat("hi", 5))
            .await
            .status
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while tenant_usage(&env).await.leases == 0 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A second request takes the only queue place, then its client leaves.
    let mut s = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    let body = chat("hi", 5);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&body).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // While it waits, the queue is full: a third request is refused at once.
    let r = send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5)).await;
    assert_eq!(r.code(), "concurrency_limit");
    drop(s);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Its place is free again: a fourth request waits in the queue and is served.
    let r = send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5)).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(holder.await.unwrap(), 200);
    assert_eq!(
        env.sim.stats().completed,
        2,
        "the request that left never reached the upstream"
    );
    assert_nothing_leaks(&env).await;
}

/// An upstream that does not answer in time: 504, the lease comes back, and the reservation is
/// charged as the policy says (the upstream may have done the work).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_timeouts_release_and_charge_per_policy() {
    let policy = r#"
[[scopes]]
key = "tenant"
concurrency = { limit = 1, lease_ttl = "30s" }
budget = { tokens = 100000, period = "day" }
"#;
    let sim = SimConfig {
        latency: Duration::from_millis(2000),
        ..SimConfig::default()
    };
    let env = env(
        false,
        policy,
        "[server]\nupstream_timeout = \"300ms\"\n",
        sim,
    )
    .await;
    let r = send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 20)).await;
    assert_eq!((r.status, r.code().as_str()), (504, "upstream_timeout"));
    assert_nothing_leaks(&env).await;
    // The default policy charges the full reservation: 8 input + 20 output.
    assert_eq!(tenant_usage(&env).await.settled, 28);
}
