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
