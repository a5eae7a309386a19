//! Slices ([`Sliced`]) over a real Redis: the conformance suite with one instance slicing every
//! plan from its first request (it must decide as the store alone does), and what several
//! instances, a dead one and a store that forgets do to the books.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tollgate_core::{ManualClock, SliceConfig, Sliced};
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_testkit::Harness;
use tollgate_testkit::redis_server::RedisServer;

struct SlicedRedis {
    server: RedisServer,
    n: AtomicU64,
}

impl SlicedRedis {
    fn new() -> Self {
        Self {
            server: RedisServer::start(),
            n: AtomicU64::new(0),
        }
    }
}

/// Slices from the first request, living past the suite's clock jumps (a slice left to expire
/// is a dead instance's: charged in full, tested below).
fn eager() -> SliceConfig {
    SliceConfig {
        hot_after: 0,
        ttl_ms: Some(400 * 86_400_000),
        ..SliceConfig::default()
    }
}

async fn redis_on(server: &RedisServer, prefix: &str, clock: &ManualClock) -> RedisStore {
    let mut cfg = RedisConfig::new(server.url());
    cfg.prefix = prefix.into();
    cfg.call_timeout = std::time::Duration::from_secs(5);
    RedisStore::connect(cfg)
        .await
        .unwrap()
        .with_clock(Arc::new(clock.clone()))
}

impl Harness for SlicedRedis {
    type S = Sliced<RedisStore, ManualClock>;
    async fn store(&self, clock: ManualClock) -> Self::S {
        let prefix = format!("sliced{}", self.n.fetch_add(1, Ordering::Relaxed));
        let redis = redis_on(&self.server, &prefix, &clock).await;
        Sliced::with_clock(redis, clock, eager())
    }
}

tollgate_testkit::conformance_tests!(SlicedRedis::new());

mod orders {
    use super::*;
    use tollgate_testkit::conformance::SliceHarness;

    impl SliceHarness for SlicedRedis {
        type S = RedisStore;
        async fn store(&self, clock: ManualClock) -> Self::S {
            let prefix = format!("orders{}", self.n.fetch_add(1, Ordering::Relaxed));
            redis_on(&self.server, &prefix, &clock).await
        }
    }

    tollgate_testkit::slice_conformance_tests!(SlicedRedis::new());
}
