//! The store conformance suite against a real single-node Redis (its own `redis-server`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tollgate_core::ManualClock;
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_testkit::Harness;
use tollgate_testkit::redis_server::RedisServer;

struct Redis {
    server: RedisServer,
    n: AtomicU64,
}

impl Redis {
    fn new() -> Self {
        Self {
            server: RedisServer::start(),
            n: AtomicU64::new(0),
        }
    }
}

impl Harness for Redis {
    type S = RedisStore;
    async fn store(&self, clock: ManualClock) -> RedisStore {
        let mut cfg = RedisConfig::new(self.server.url());
        // A fresh prefix per store: a clean state on a shared server.
        cfg.prefix = format!("conf{}", self.n.fetch_add(1, Ordering::Relaxed));
        cfg.call_timeout = std::time::Duration::from_secs(5);
        RedisStore::connect(cfg)
            .await
            .unwrap()
            .with_clock(Arc::new(clock))
    }
}

tollgate_testkit::conformance_tests!(Redis::new());

/// After `SCRIPT FLUSH` (as after a Redis restart or failover), the store's next calls get
/// `NOSCRIPT`, load their script again and succeed: a batch call (admission, settlement) and a
/// single one (usage).
#[tokio::test]
async fn scripts_are_loaded_again_after_noscript() {
    use tollgate_core::{
        Decision, Dimension, Finish, Identity, Policy, RequestFacts, Store, Usage,
    };
    let server = RedisServer::start();
    let mut cfg = RedisConfig::new(server.url());
    cfg.prefix = "noscript".into();
    cfg.call_timeout = std::time::Duration::from_secs(5);
    let store = RedisStore::connect(cfg).await.unwrap();
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        concurrency = { limit = 5 }
        budget = { tokens = 1000, period = "day" }
        "#,
    )
    .unwrap();
    let flush = || {
        let out = std::process::Command::new("redis-cli")
            .args(["-p", &server.port().to_string(), "SCRIPT", "FLUSH"])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK");
    };
    let admit = |id: &str| {
        let p = tollgate_core::plan(
            &policy,
            &RequestFacts {
                request_id: id.into(),
                identity: Identity::default().with(Dimension::User, "u"),
                input_tokens: 10,
                max_output_tokens: Some(10),
            },
        )
        .unwrap();
        let store = &store;
        async move { store.admit(&p).await.unwrap() }
    };
    assert!(matches!(admit("a").await, Decision::Admit(_)));
    flush();
    assert!(matches!(admit("b").await, Decision::Admit(_)));
    flush();
    let u = Usage {
        input_tokens: 10,
        cached_input_tokens: 0,
        output_tokens: 5,
    };
    assert_eq!(
        store.settle("a", u).await.unwrap(),
        Finish::Done { charged: vec![15] }
    );
    flush();
    let usage = store
        .usage(
            "user|user:u",
            Some(tollgate_core::Period::Fixed(86_400_000)),
        )
        .await
        .unwrap();
    assert_eq!((usage.settled, usage.reserved, usage.leases), (15, 20, 1));
}
