//! Slices ([`Sliced`]) over a real Redis: the conformance suite with one instance slicing every
//! plan from its first request (it must decide as the store alone does), and what several
//! instances, a dead one and a store that forgets do to the books.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tollgate_core::ManualClock;
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_slices::{SliceConfig, Sliced};
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
    cfg.initialise_on_first_use = true;
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

fn policy() -> tollgate_core::Policy {
    tollgate_testkit::policy(
        r#"
        [[scopes]]
        name = "per-key"
        key = "tenant"
        requests = { limit = 100000, window = "1m" }
        concurrency = { limit = 1000, lease_ttl = "10s" }
        budget = { tokens = 10000000, period = "day" }
        "#,
    )
}

const KEY: &str = "per-key|tenant:acme";
const DAY: tollgate_core::Period = tollgate_core::Period::Fixed(86_400_000);

async fn admit<S: tollgate_core::Store>(s: &S, id: &str) -> tollgate_core::Decision {
    let p = policy();
    s.admit(&tollgate_core::plan(&p, &tollgate_testkit::facts(id, "u", 10, 10)).unwrap())
        .await
        .unwrap()
}

fn used() -> tollgate_core::Usage {
    tollgate_core::Usage {
        input_tokens: 10,
        output_tokens: 3,
        ..tollgate_core::Usage::default()
    }
}

/// An instance dies holding slices: when they expire, Redis gives the slots back and charges
/// each budget slice in full, and the expiry reaches the stream a spend ledger reads.
#[tokio::test]
async fn a_dead_instances_slices_come_back_and_reach_the_ledger() {
    use tollgate_core::{Decision, Finish, Store};
    let server = RedisServer::start();
    let clock = ManualClock::new(tollgate_testkit::T0);
    let redis = redis_on(&server, "dead", &clock).await;
    redis.keep_expiries().await.unwrap();
    let cfg = SliceConfig {
        hot_after: 0,
        ..SliceConfig::default()
    };
    let s = Sliced::with_clock(redis.clone(), clock.clone(), cfg);
    for i in 0..30 {
        assert!(matches!(
            admit(&s, &format!("r{i}")).await,
            Decision::Admit(_)
        ));
    }
    for i in 0..20 {
        let f = s.settle(&format!("r{i}"), used()).await.unwrap();
        assert!(matches!(f, Finish::Done { .. }), "{f:?}");
    }
    s.maintain().await.unwrap();
    let st = s.stats();
    assert!(st.local >= 25 && st.failed == 0, "{st:?}");
    let before = redis.usage(KEY, Some(DAY)).await.unwrap();
    assert_eq!(before.settled, 20 * 13, "reported at the tick");
    assert!(
        before.reserved >= 10 * 20 && before.leases >= 10,
        "{before:?}"
    );
    drop(s);
    clock.advance(20_001);
    redis.sweep_expired(100).await.unwrap();
    let after = redis.usage(KEY, Some(DAY)).await.unwrap();
    assert_eq!(
        (after.settled, after.reserved, after.leases),
        (before.settled + before.reserved, 0, 0)
    );
    let slices: Vec<_> = redis
        .expiries(100)
        .await
        .unwrap()
        .into_iter()
        .filter(|(_, e)| e.request_id.starts_with("~s:"))
        .collect();
    assert_eq!(slices.len(), 1, "the budget slice's expiry: {slices:?}");
    let c = &slices[0].1.charges;
    assert_eq!(
        (c.len(), c[0].scope.as_str(), c[0].amount),
        (1, KEY, before.reserved)
    );
}

/// Redis forgets (FLUSHALL): the instance's slices go with it; a request admitted locally ends
/// as one the store does not know; admissions meet the store's refusal until the loss is
/// acknowledged; then slicing resumes.
#[tokio::test]
async fn a_redis_that_forgets_takes_the_slices_with_it() {
    use tollgate_core::{Decision, Finish, Store, StoreError};
    let server = RedisServer::start();
    let clock = ManualClock::new(tollgate_testkit::T0);
    let redis = redis_on(&server, "forget", &clock).await;
    let cfg = SliceConfig {
        hot_after: 0,
        ..SliceConfig::default()
    };
    let s = Sliced::with_clock(redis.clone(), clock.clone(), cfg);
    for i in 0..5 {
        assert!(matches!(
            admit(&s, &format!("a{i}")).await,
            Decision::Admit(_)
        ));
    }
    assert!(s.stats().local >= 4, "{:?}", s.stats());
    let out = server.cli().args(["FLUSHALL"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK");
    assert_eq!(s.maintain().await, Err(StoreError::StateLost));
    assert_eq!(s.settle("a0", used()).await.unwrap(), Finish::Unknown);
    assert_eq!(admit_err(&s, "b0").await, StoreError::StateLost);
    redis.acknowledge_loss().await.unwrap();
    s.maintain().await.unwrap();
    let local = s.stats().local;
    for i in 0..5 {
        assert!(matches!(
            admit(&s, &format!("c{i}")).await,
            Decision::Admit(_)
        ));
    }
    assert!(s.stats().local > local, "{:?}", s.stats());
}

async fn admit_err<S: tollgate_core::Store>(s: &S, id: &str) -> tollgate_core::StoreError {
    let p = policy();
    s.admit(&tollgate_core::plan(&p, &tollgate_testkit::facts(id, "u", 10, 10)).unwrap())
        .await
        .unwrap_err()
}
