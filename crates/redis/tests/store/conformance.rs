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
        cfg.initialise_on_first_use = true;
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

/// After `FUNCTION FLUSH` (as after a Redis restart without persistence, or a failover to a node
/// that never had the library), the store's next calls find no function, load the library
/// again and succeed: a batch call (admission, settlement) and a single one (usage).
#[tokio::test]
async fn the_library_is_loaded_again_after_a_function_flush() {
    use tollgate_core::{Decision, Finish, Policy, Store, Usage};
    let server = RedisServer::start();
    let mut cfg = RedisConfig::new(server.url());
    cfg.initialise_on_first_use = true;
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
        let out = server.cli().args(["FUNCTION", "FLUSH"]).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK");
        assert_eq!(server.cli_run(&["FUNCTION", "LIST"]).trim(), "");
    };
    let admit = |id: &str| {
        let p = plan_of(&policy, id.into());
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
        ..Usage::default()
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
    // Loaded again, once: one library.
    let list = server.cli_run(&["FUNCTION", "LIST"]);
    assert_eq!(list.matches("library_name").count(), 1, "{list}");
    assert!(list.contains("tollgate_batch_"), "{list}");
}

/// A store on `server` under `prefix`, on a manual clock, with a generous call timeout.
async fn store_on(server: &RedisServer, prefix: &str) -> (RedisStore, ManualClock) {
    let mut cfg = RedisConfig::new(server.url());
    cfg.initialise_on_first_use = true;
    cfg.prefix = prefix.into();
    cfg.call_timeout = std::time::Duration::from_secs(5);
    let clock = ManualClock::new(1_800_000_000_000);
    let store = RedisStore::connect(cfg)
        .await
        .unwrap()
        .with_clock(Arc::new(clock.clone()));
    (store, clock)
}

/// The plan of request `id` by user "u", 10 input tokens and at most 10 output tokens.
fn plan_of(policy: &tollgate_core::Policy, id: String) -> tollgate_core::Plan {
    use tollgate_core::{Dimension, Identity, RequestFacts};
    let facts = RequestFacts {
        request_id: id,
        identity: Identity::default().with(Dimension::User, "u"),
        input_tokens: 10,
        max_output_tokens: Some(10),
        ..RequestFacts::default()
    };
    tollgate_core::plan(policy, &facts).unwrap()
}

/// How many calls of the library's functions (`FCALL`) the server has run.
fn fcall_calls(server: &RedisServer) -> u64 {
    server
        .cli_run(&["INFO", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_fcall:"))
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
    use tollgate_core::{Decision, Finish, Policy, Reason, Store, Usage};
    let server = RedisServer::start();
    let (store, clock) = store_on(&server, "batched").await;
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
            .map(|i| plan_of(&policy, format!("{round}-{i}")))
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
        ..Usage::default()
    };
    let day = Some(tollgate_core::Period::Fixed(86_400_000));
    let calls0 = fcall_calls(&server);

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
    let calls = fcall_calls(&server) - calls0;
    assert!(calls < 80, "{calls} script calls for 97 operations");
}

/// Settlements and admissions on one scope that share script calls (each key is read once and
/// written once per call): slots freed by settlements in a call are taken by later admissions
/// in it, never more; and leases that expired unswept before their settlement are counted out
/// too. 40 leases at most (TTL 10 s), 1,000 tokens a day; 10 + 10 tokens reserved per request,
/// 10 + 5 charged when settled, the full 20 when expired.
///
/// On one thread, every operation below is queued before the batch task runs, so a call holds
/// an admission that reads the full set, then the settlements, then the admissions they make
/// room for (the first operation of each round goes alone: the lane is idle).
#[tokio::test(flavor = "current_thread")]
async fn settlements_free_slots_for_admissions_in_the_same_call() {
    use futures_util::future::join_all;
    use tollgate_core::{Decision, Ending, Finish, Policy, Reason, Store, Usage};
    let server = RedisServer::start();
    let (store, clock) = store_on(&server, "shared").await;
    let policy = Policy::from_toml(
        r#"
        expired_reservation_charge = "full"
        [[scopes]]
        key = "user"
        concurrency = { limit = 40, lease_ttl = "10s" }
        budget = { tokens = 100000, period = "day" }
        "#,
    )
    .unwrap();
    let plan = |id: String| plan_of(&policy, id);
    let used = Usage {
        input_tokens: 10,
        cached_input_tokens: 0,
        output_tokens: 5,
        ..Usage::default()
    };
    let day = Some(tollgate_core::Period::Fixed(86_400_000));
    let admitted = |ds: &[Result<Decision, _>]| {
        ds.iter()
            .filter(|d| matches!(d, Ok(Decision::Admit(_))))
            .count()
    };
    let refused = |ds: &[Result<Decision, tollgate_core::StoreError>]| {
        ds.iter()
            .filter(|d| matches!(d, Ok(Decision::Deny(x)) if x.reason == Reason::ConcurrencyLimit))
            .count()
    };
    let old: Vec<_> = (0..40).map(|i| plan(format!("a{i:02}"))).collect();
    let ds = join_all(old.iter().map(|p| store.admit(p))).await;
    assert_eq!(admitted(&ds), 40);

    // Two find the set full; then 20 settle while 30 ask: the 20 slots freed go to 20 of
    // them, the other 10 are refused.
    let full: Vec<_> = (0..2).map(|i| plan(format!("x{i}"))).collect();
    let new: Vec<_> = (0..30).map(|i| plan(format!("b{i:02}"))).collect();
    let calls0 = fcall_calls(&server);
    let (xs, fs, ds) = tokio::join!(
        join_all(full.iter().map(|p| store.admit(p))),
        join_all(old[..20].iter().map(|p| store.settle(&p.request_id, used))),
        join_all(new.iter().map(|p| store.admit(p))),
    );
    assert_eq!(refused(&xs), 2);
    for f in fs {
        assert_eq!(f.unwrap(), Finish::Done { charged: vec![15] });
    }
    assert_eq!((admitted(&ds), refused(&ds)), (20, 10));
    assert_eq!(
        fcall_calls(&server) - calls0,
        2,
        "one alone, then one call of 51"
    );
    let u = store.usage("user|user:u", day).await.unwrap();
    assert_eq!((u.settled, u.reserved, u.leases), (300, 800, 40));

    // Past every lease's expiry, none swept yet (a call sweeps 16): the 20 old and 20 new that
    // hold leases settle while 40 more ask. Each request ends once, settled or expired, and
    // every slot comes back.
    clock.advance(11_000);
    let holders: Vec<String> = old[20..]
        .iter()
        .map(|p| p.request_id.clone())
        .chain(
            ds.iter()
                .zip(&new)
                .filter(|(d, _)| matches!(d, Ok(Decision::Admit(_))))
                .map(|(_, p)| p.request_id.clone()),
        )
        .collect();
    assert_eq!(holders.len(), 40);
    let late: Vec<_> = (0..40).map(|i| plan(format!("c{i:02}"))).collect();
    let full: Vec<_> = (2..4).map(|i| plan(format!("x{i}"))).collect();
    let (xs, fs, ds) = tokio::join!(
        join_all(full.iter().map(|p| store.admit(p))),
        join_all(holders.iter().map(|id| store.settle(id, used))),
        join_all(late.iter().map(|p| store.admit(p))),
    );
    // Each call sweeps 16 expired requests first: the first two are admitted, each in a call
    // of its own making room (the second heads the call of the rest). Of the 40 holders, 32
    // were swept by then and 8 settle; 38 of the 40 then fit (2 slots went to the first two).
    assert_eq!(admitted(&xs), 2);
    let (mut settled, mut expired) = (0, 0);
    for f in fs {
        match f.unwrap() {
            Finish::Done { charged } => {
                assert_eq!(charged, vec![15]);
                settled += 1;
            }
            Finish::AlreadyEnded(Ending::Expired) => expired += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((settled, expired), (8, 32));
    assert_eq!((admitted(&ds), refused(&ds)), (38, 2));
    let u = store.usage("user|user:u", day).await.unwrap();
    assert_eq!(
        (u.settled, u.reserved, u.leases),
        (300 + 15 * settled + 20 * expired, 800, 40)
    );
    // And the set is full again: one more is refused.
    let d = store.admit(&plan("d".into())).await.unwrap();
    assert!(matches!(d, Decision::Deny(x) if x.reason == Reason::ConcurrencyLimit));

    // Expired again, unswept. One admission goes alone (its call sweeps 16); the next call
    // sweeps 16 more, and its 32 admissions fill the set: the 32nd finds it full, and the 8
    // expired leases left are taken out of the set then. Their 8 requests settle in the same
    // call (their leases were already out: the count must not go down again), then 10 more
    // ask and 7 fit.
    clock.advance(11_000);
    let mut holders: Vec<String> = full
        .iter()
        .chain(&late)
        .zip(xs.iter().chain(&ds))
        .filter(|(_, d)| matches!(d, Ok(Decision::Admit(_))))
        .map(|(p, _)| p.request_id.clone())
        .collect();
    // Equal expiries: the sweep takes them in the order of their ids.
    holders.sort();
    let unswept = &holders[32..];
    let first = plan("y".into());
    let fill: Vec<_> = (0..32).map(|i| plan(format!("z{i:02}"))).collect();
    let more: Vec<_> = (32..42).map(|i| plan(format!("z{i:02}"))).collect();
    let calls0 = fcall_calls(&server);
    let (y, zs, fs, ms) = tokio::join!(
        store.admit(&first),
        join_all(fill.iter().map(|p| store.admit(p))),
        join_all(unswept.iter().map(|id| store.settle(id, used))),
        join_all(more.iter().map(|p| store.admit(p))),
    );
    assert_eq!(
        fcall_calls(&server) - calls0,
        2,
        "one alone, then one call of 50"
    );
    assert!(matches!(y, Ok(Decision::Admit(_))));
    assert_eq!(admitted(&zs), 32);
    for f in fs {
        assert_eq!(f.unwrap(), Finish::Done { charged: vec![15] });
    }
    assert_eq!((admitted(&ms), refused(&ms)), (7, 3));
    let u = store.usage("user|user:u", day).await.unwrap();
    assert_eq!(u.leases, 40);
}

/// A lease set that has held 16 leases, and the expiry index, carry a member that keeps Redis
/// storing them as skiplists (a listpack's every change walks all its members); counts leave
/// that member out, so every admission still reports exactly what is left, up to the limit.
#[tokio::test]
async fn big_lease_sets_are_skiplists_and_count_exactly() {
    use tollgate_core::{Decision, Policy, Reason, Store, Usage};
    let server = RedisServer::start();
    let (store, _clock) = store_on(&server, "sk").await;
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        concurrency = { limit = 30, lease_ttl = "60s" }
        "#,
    )
    .unwrap();
    let plan = |id: String| plan_of(&policy, id);
    let left = |d: Decision| match d {
        Decision::Admit(a) => {
            let q = a
                .quotas
                .iter()
                .find(|q| q.reason == Reason::ConcurrencyLimit);
            q.unwrap().remaining
        }
        other => panic!("refused: {other:?}"),
    };
    let encoding = |key: &str| {
        let out = server
            .cli()
            .args(["OBJECT", "ENCODING", key])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    for i in 0..30 {
        let d = store.admit(&plan(format!("a{i:02}"))).await.unwrap();
        assert_eq!(left(d), 29 - i, "admission {i}");
    }
    assert_eq!(encoding("sk:l:user|user:u"), "skiplist");
    assert_eq!(encoding("sk:x"), "skiplist");
    let d = store.admit(&plan("full".into())).await.unwrap();
    assert!(matches!(d, Decision::Deny(x) if x.reason == Reason::ConcurrencyLimit));
    let used = Usage {
        input_tokens: 10,
        cached_input_tokens: 0,
        output_tokens: 5,
        ..Usage::default()
    };
    for i in 0..10 {
        store.settle(&format!("a{i:02}"), used).await.unwrap();
    }
    let d = store.admit(&plan("b".into())).await.unwrap();
    assert_eq!(left(d), 30 - 21);
    let u = store.usage("user|user:u", None).await.unwrap();
    assert_eq!(u.leases, 21);
}

/// A shadow rule's reservation is charged when its request's ticket expires, and is no spend.
#[tokio::test]
async fn a_shadow_reservation_is_no_expiry_charge() {
    let server = RedisServer::start();
    let mut cfg = RedisConfig::new(server.url());
    cfg.initialise_on_first_use = true;
    cfg.prefix = "shadowexp".into();
    cfg.call_timeout = std::time::Duration::from_secs(5);
    let clock = ManualClock::new(tollgate_testkit::T0);
    let store = RedisStore::connect(cfg)
        .await
        .unwrap()
        .with_clock(Arc::new(clock.clone()));
    store.keep_expiries().await.unwrap();
    tollgate_testkit::conformance::a_shadow_reservation_is_no_expiry_charge(
        &store,
        &clock,
        async || {
            assert_eq!(store.sweep_expired(10).await.unwrap(), 1);
            store
                .expiries(10)
                .await
                .unwrap()
                .into_iter()
                .map(|(_, e)| e)
                .collect()
        },
    )
    .await;
}

/// The write sequence: every admission and kill switch advances it; a store set back behind
/// what an instance saw (a failover to a replica that lagged, played here by setting `n`
/// back) is a loss with its cause and both numbers, for admissions and the watch alike; an
/// acknowledgement starts a new epoch, which the instance takes without calling it a loss.
#[tokio::test]
async fn a_store_behind_its_write_sequence_is_lost() {
    use tollgate_core::{Decision, Policy, Store, StoreError, StoreState};
    use tollgate_redis::Loss;
    let server = RedisServer::start();
    let mut cfg = RedisConfig::new(server.url());
    cfg.initialise_on_first_use = true;
    cfg.prefix = "seq".into();
    let store = RedisStore::connect(cfg).await.unwrap();
    let policy =
        Policy::from_toml("[[scopes]]\nkey = \"user\"\nconcurrency = { limit = 5 }\n").unwrap();
    let admit = |id: &str| {
        let p = plan_of(&policy, id.into());
        let store = &store;
        async move { store.admit(&p).await }
    };
    let n = || -> u64 { server.cli_run(&["HGET", "seq:seq", "n"]).parse().unwrap() };
    assert!(matches!(admit("a").await, Ok(Decision::Admit(_))));
    assert_eq!(store.state().await.unwrap(), StoreState::Kept);
    let after_one = n();
    store.set_kill("user:x", Some("why")).await.unwrap();
    assert!(matches!(admit("b").await, Ok(Decision::Admit(_))));
    let limit = [("user|x#budget".to_owned(), Some("{}".to_owned()))];
    store
        .write_records(tollgate_redis::RecordSet::Limits, &limit, 1)
        .await
        .unwrap();
    assert_eq!(n(), after_one + 3, "a kill switch, an admission, a limit");
    let seen = n();
    let high = store.high_marks();
    assert_eq!(
        high[0].as_ref().map(|(_, h)| *h),
        Some(seen),
        "each write returned it"
    );

    server.cli_run(&["HSET", "seq:seq", "n", &(seen - 1).to_string()]);
    assert!(matches!(admit("c").await, Err(StoreError::StateLost)));
    let Some(Loss::Behind {
        store: at,
        seen: had,
        ..
    }) = store.loss_cause()
    else {
        panic!("{:?}", store.loss_cause());
    };
    assert_eq!((at, had), (seen - 1, seen));
    assert_eq!(store.state().await.unwrap(), StoreState::Lost);
    assert!(server.cli_run(&["GET", "seq:lost"]).starts_with("behind "));

    store.acknowledge_loss().await.unwrap();
    assert_eq!(store.state().await.unwrap(), StoreState::Kept);
    assert_eq!(store.loss_cause(), None);
    assert!(matches!(admit("d").await, Ok(Decision::Admit(_))));
    assert_eq!(n(), 1, "a new epoch counts from zero");
}
