//! The gateway end to end, over real sockets, against the upstream simulator: streams and the upstream: pass-through and settlement, clients that leave, leases renewed, upstream errors and timeouts.
//! Tests that involve the store run once on the memory store and once on Redis (its own
//! `redis-server`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate_testkit::sim::SimConfig;

use common::Env;
use common::e2e::{
    BASIC, KEY, assert_nothing_leaks, chat, env, send, settled_becomes, tenant_usage,
};

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

/// A client that leaves mid-stream does not end what the upstream bills: the gateway stops
/// passing the stream on but reads it to its usage, and settles that, the lease held until then.
async fn client_disconnects_leave_the_upstream_read_to_its_usage(redis: bool) {
    let sim = SimConfig {
        latency: Duration::from_millis(200),
        token_delay: Duration::from_millis(5),
        output_tokens: 200,
        ..SimConfig::default()
    };
    let env = env(redis, BASIC, "", sim).await;
    // Mid-stream: read the headers and a few events, then leave.
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": 200, "stream": true, "messages": [{"role": "user", "content": "hi"}]})).unwrap();
    disconnect_after(&env, &body, 300).await;
    common::instance::until("the upstream read to its end", async || {
        env.sim.stats().completed != 0
    })
    .await;
    assert_nothing_leaks(&env).await;
    let u = tenant_usage(&env).await;
    assert_eq!(u.settled, 8 + 200, "settled what the upstream reported");
    // Before the first byte of a non-streamed answer: likewise let finish, its usage settled.
    let before = u.settled;
    disconnect_after(&env, &chat("hi", 200), 0).await;
    common::instance::until("the upstream finishing", async || {
        env.sim.stats().completed != 1
    })
    .await;
    assert!(env.sim.stats().cancelled.is_empty(), "cancelled upstream");
    assert_nothing_leaks(&env).await;
    let s = env.sim.stats();
    let last = tenant_usage(&env).await.settled - before;
    assert_eq!(last, 8 + 200, "settled what the upstream reported: {s:?}");
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
    common::instance::until("the stream admitted", async || {
        tenant_usage(&env).await.leases != 0
    })
    .await;
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

async fn upstream_errors_release_and_charge_nothing(redis: bool) {
    let env = env(redis, BASIC, "", SimConfig::default()).await;
    let body = serde_json::to_vec(&json!({"model": "gpt-4o-fail", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})).unwrap();
    let r = send(&env, "/v1/chat/completions", Some(KEY), body).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.code(), "server_error");
    assert_nothing_leaks(&env).await;
    assert_eq!(tenant_usage(&env).await.settled, 0);
}

/// Sends a request on a raw socket, reads `read` bytes of the response, then disconnects.
async fn disconnect_after(env: &Env, body: &[u8], read: usize) -> Instant {
    let asked = env.sim.stats().requests.values().sum::<u64>();
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
        common::instance::until("the request upstream", async || {
            env.sim.stats().requests.values().sum::<u64>() > asked
        })
        .await;
    }
    drop(s);
    Instant::now()
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

mod both {
    on_both_stores!(
        streams_pass_through_and_settle,
        client_disconnects_leave_the_upstream_read_to_its_usage,
        upstream_errors_release_and_charge_nothing
    );
}

/// On Redis, whose clock is real; the memory store's case runs on paused time
/// (`tests/admission/paused_time.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_long_streams_renew_their_leases() {
    long_streams_renew_their_leases(true).await;
}
