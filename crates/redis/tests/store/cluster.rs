//! The store conformance suite against a local three-master Redis Cluster, twice: with one
//! shard (every key of a prefix shares one hash tag, so each script runs atomically on the node
//! that owns the tag; prefixes spread over the nodes) and with eight shards (each scope's keys in
//! the slot of its shard, so one request's scopes sit on different nodes and are admitted shard
//! by shard).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tollgate_core::ManualClock;
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_testkit::Harness;
use tollgate_testkit::redis_server::RedisCluster;

struct Cluster {
    cluster: RedisCluster,
    n: AtomicU64,
    shards: u16,
}

impl Cluster {
    fn new() -> Self {
        Self::sharded(1)
    }

    fn sharded(shards: u16) -> Self {
        Self {
            cluster: RedisCluster::start(),
            n: AtomicU64::new(0),
            shards,
        }
    }
}

impl Harness for Cluster {
    type S = RedisStore;
    async fn store(&self, clock: ManualClock) -> RedisStore {
        let mut cfg = RedisConfig::new("unused");
        cfg.initialise_on_first_use = true;
        cfg.cluster = Some(self.cluster.urls());
        cfg.prefix = format!("cl{}", self.n.fetch_add(1, Ordering::Relaxed));
        cfg.call_timeout = std::time::Duration::from_secs(5);
        cfg.shards = self.shards;
        let store = RedisStore::connect(cfg).await.unwrap();
        assert!(
            store.prefix().starts_with('{'),
            "cluster keys share a hash tag"
        );
        store.with_clock(Arc::new(clock))
    }
}

tollgate_testkit::conformance_tests!(Cluster::new());

mod sharded {
    use super::Cluster;
    tollgate_testkit::conformance_tests!(Cluster::sharded(8));
}
