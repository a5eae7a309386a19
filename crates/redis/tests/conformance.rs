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

/// How many `EVALSHA` calls the server has run.
fn evalsha_calls(port: u16) -> u64 {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "INFO", "commandstats"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
        .and_then(|s| s.split(',').find_map(|kv| kv.strip_prefix("calls=")))
        .map_or(0, |n| n.parse().unwrap())
}

/// Items that share one script call decide as they would alone: a call remembers the numbers
/// it has converted (limits, windows, periods) for its later items, so this runs many
/// admissions and settlements at once, checks that they did share calls, and checks every
/// count against the policy's arithmetic. Rate 30 per second, 15 leases, 400 tokens a day, 20
/// tokens reserved and 15 settled per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_items_decide_as_single_ones() {
    use futures_util::future::join_all;
    use tollgate_core::{
        Decision, Dimension, Finish, Identity, Policy, Reason, RequestFacts, Store, Usage,
    };
    let server = RedisServer::start();
    let mut cfg = RedisConfig::new(server.url());
    cfg.prefix = "batched".into();
    cfg.call_timeout = std::time::Duration::from_secs(5);
    let clock = ManualClock::new(1_800_000_000_000);
    let store = RedisStore::connect(cfg)
        .await
        .unwrap()
        .with_clock(Arc::new(clock.clone()));
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 30, window = "1s" }
        concurrency = { limit = 15 }
        budget = { tokens = 400, period = "day" }
        "#,
    )
    .unwrap();
    let plans = |round: &str| -> Vec<_> {
        (0..40)
            .map(|i| {
                tollgate_core::plan(
                    &policy,
                    &RequestFacts {
                        request_id: format!("{round}-{i}"),
                        identity: Identity::default().with(Dimension::User, "u"),
                        input_tokens: 10,
                        max_output_tokens: Some(10),
                    },
                )
                .unwrap()
            })
            .collect()
    };
    let tally = |ds: &[Decision]| {
        let by = |r: Reason| {
            ds.iter()
                .filter(|d| matches!(d, Decision::Deny(x) if x.reason == r))
                .count()
        };
        let admitted = ds
            .iter()
            .filter(|d| matches!(d, Decision::Admit(_)))
            .count();
        (
            admitted,
            by(Reason::RequestRateLimit),
            by(Reason::ConcurrencyLimit),
            by(Reason::BudgetLimit),
        )
    };
    let used = Usage {
        input_tokens: 10,
        cached_input_tokens: 0,
        output_tokens: 5,
    };
    let day = Some(tollgate_core::Period::Fixed(86_400_000));
    let calls0 = evalsha_calls(server.port());

    // 40 at once: 30 pass the rate, 15 take the leases, 15 find none left.
    let first = plans("a");
    let ds = join_all(first.iter().map(|p| store.admit(p))).await;
    let ds: Vec<Decision> = ds.into_iter().map(Result::unwrap).collect();
    assert_eq!(tally(&ds), (15, 10, 15, 0));
    let ids: Vec<String> = ds
        .iter()
        .zip(&first)
        .filter_map(|(d, p)| match d {
            Decision::Admit(_) => Some(p.request_id.clone()),
            _ => None,
        })
        .collect();
    let fs = join_all(ids.iter().map(|id| store.settle(id, used))).await;
    for f in fs {
        assert_eq!(f.unwrap(), Finish::Done { charged: vec![15] });
    }
    let u = store.usage("user|user:u", day).await.unwrap();
    assert_eq!((u.settled, u.reserved, u.leases), (225, 0, 0));

    // Two seconds on (a new rate window, the old one out of reach): 175 tokens are left, so 8
    // of the 30 that pass the rate fit the budget.
    clock.advance(2_000);
    let ds = join_all(plans("b").iter().map(|p| store.admit(p))).await;
    let ds: Vec<Decision> = ds.into_iter().map(Result::unwrap).collect();
    assert_eq!(tally(&ds), (8, 10, 0, 22));
    let u = store.usage("user|user:u", day).await.unwrap();
    assert_eq!((u.settled, u.reserved, u.leases), (225, 160, 8));

    // The items did share calls: 80 admissions, 15 settlements and 2 usage reads in fewer.
    let calls = evalsha_calls(server.port()) - calls0;
    assert!(calls < 80, "{calls} script calls for 97 operations");
}
