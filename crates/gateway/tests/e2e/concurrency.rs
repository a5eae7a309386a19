//! The gateway end to end, over real sockets, against the upstream simulator: concurrency and the bounded queue.
//! Tests that involve the store run once on the memory store and once on Redis (its own
//! `redis-server`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tollgate_testkit::sim::SimConfig;

use common::e2e::{KEY, assert_nothing_leaks, chat, env, send, tenant_usage};
use common::metric;

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
    tollgate_testkit::wait::until("the holder's lease", async || {
        tenant_usage(&env).await.leases > 0
    })
    .await;
    // A second request takes the only queue place, then its client leaves.
    let mut s = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    let body = chat("hi", 5);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&body).await.unwrap();
    let waiting = async |n: f64| metric(&env, "tollgate_queue_waiting").await == Some(n);
    tollgate_testkit::wait::until("the queue's place taken", async || waiting(1.0).await).await;
    // While it waits, the queue is full: a third request is refused at once.
    let r = send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5)).await;
    assert_eq!(r.code(), "concurrency_limit");
    drop(s);
    tollgate_testkit::wait::until("the queue's place free", async || waiting(0.0).await).await;
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

mod both {
    on_both_stores!(
        concurrency_is_enforced_as_the_upstream_sees_it,
        a_bounded_queue_waits_for_a_slot
    );
}
