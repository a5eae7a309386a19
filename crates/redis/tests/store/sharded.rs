//! A sharded store on a local three-master Redis Cluster: a request whose scopes sit on different
//! nodes is admitted shard by shard, parts taken before a refusal are given back, the refusal
//! reported is the one a single-shard store reports, and under contention no limit is exceeded.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate_core::{Decision, Period, Policy, Reason, Store, Usage, plan};
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_testkit::redis_server::RedisCluster;
use tollgate_testkit::{facts, policy};

const DAY: Period = Period::Fixed(86_400_000);

async fn sharded(cluster: &RedisCluster, prefix: &str) -> RedisStore {
    let mut cfg = RedisConfig::new("unused");
    cfg.initialise_on_first_use = true;
    cfg.cluster = Some(cluster.urls());
    cfg.prefix = prefix.into();
    cfg.shards = 8;
    cfg.call_timeout = Duration::from_secs(5);
    RedisStore::connect(cfg).await.unwrap()
}

/// The node (port) that owns a key.
fn node_of(cluster: &RedisCluster, key: &str) -> u16 {
    let port = cluster.nodes[0].port().to_string();
    let slot = Command::new("redis-cli")
        .args(["-p", &port, "CLUSTER", "KEYSLOT", key])
        .output()
        .unwrap();
    let slot: u64 = String::from_utf8_lossy(&slot.stdout)
        .trim()
        .parse()
        .unwrap();
    let slots = Command::new("redis-cli")
        .args(["-p", &port, "CLUSTER", "SLOTS"])
        .output()
        .unwrap();
    // Lines: start, end, ip, port, id, ... per range.
    let lines: Vec<String> = String::from_utf8_lossy(&slots.stdout)
        .lines()
        .map(|l| l.trim().to_owned())
        .collect();
    for w in lines.windows(4) {
        if let (Ok(a), Ok(b), Ok(p)) = (w[0].parse::<u64>(), w[1].parse::<u64>(), w[3].parse()) {
            if (a..=b).contains(&slot) && w[2].contains('.') {
                return p;
            }
        }
    }
    panic!("no node owns slot {slot}: {lines:?}")
}

/// A store under a fresh prefix (`name` and a number) and a user whose scope sits on another
/// node than the tenant `acme`, before or after it in shard order as asked.
async fn apart(cluster: &RedisCluster, name: &str, user_first: bool) -> (RedisStore, String) {
    for k in 0..20 {
        let s = sharded(cluster, &format!("{name}{user_first}{k}")).await;
        let tenant = s.shard_prefix("tenant|tenant:acme").to_owned();
        let node = |p: &str| node_of(cluster, &format!("{p}:x"));
        let found = (0..64).map(|i| format!("u{i}")).find(|u| {
            let mine = s
                .shard_prefix(&format!("user|tenant:acme/user:{u}"))
                .to_owned();
            // Shard prefixes end in one digit, so they sort as their shards do.
            (mine < tenant) == user_first && node(&mine) != node(&tenant)
        });
        if let Some(u) = found {
            return (s, u);
        }
    }
    panic!("no prefix puts a user on another node than the tenant")
}

async fn usage(s: &RedisStore, scope: &str) -> (u64, u64, u64) {
    let u = s.usage(scope, Some(DAY)).await.unwrap();
    (u.settled, u.reserved, u.leases)
}

async fn admit(s: &RedisStore, p: &Policy, id: &str, user: &str, inp: u64, out: u64) -> Decision {
    s.admit(&plan(p, &facts(id, user, inp, out)).unwrap())
        .await
        .unwrap()
}

/// A later shard refuses: the earlier shard's lease and reservation are given back; the request
/// id stays free; settling the admitted request charges both shards, in the plan's order.
#[tokio::test]
async fn refusal_in_a_later_shard_undoes_the_earlier_parts() {
    let cluster = RedisCluster::start();
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        concurrency = { limit = 10 }
        budget = { tokens = 1000, period = "day" }
        [[scopes]]
        key = "tenant"
        concurrency = { limit = 10 }
        budget = { tokens = 150, period = "day" }
        "#,
    );
    for user_first in [true, false] {
        let (s, u) = apart(&cluster, "undo", user_first).await;
        let (us, ts) = (format!("user|tenant:acme/user:{u}"), "tenant|tenant:acme");
        assert!(matches!(
            admit(&s, &p, "a", &u, 50, 50).await,
            Decision::Admit(_)
        ));
        let d = admit(&s, &p, "b", &u, 50, 50).await;
        let d = d.deny().cloned().expect("the tenant budget refuses");
        assert_eq!(
            (d.reason, d.scope.key(), d.remaining),
            (Reason::BudgetLimit, "tenant:acme", 50)
        );
        // Only request a holds anything, in either shard.
        assert_eq!(usage(&s, &us).await, (0, 100, 1), "user_first={user_first}");
        assert_eq!(usage(&s, ts).await, (0, 100, 1), "user_first={user_first}");
        // b was never admitted: its id may be used again.
        let again = admit(&s, &p, "b", &u, 10, 10).await;
        assert!(matches!(again, Decision::Admit(_)), "{again:?}");
        let usage_a = Usage {
            input_tokens: 50,
            cached_input_tokens: 0,
            output_tokens: 20,
            ..Usage::default()
        };
        assert_eq!(
            s.settle("a", usage_a).await.unwrap(),
            tollgate_core::Finish::Done {
                charged: vec![70, 70]
            }
        );
        assert_eq!(usage(&s, &us).await, (70, 20, 1));
        assert_eq!(usage(&s, ts).await, (70, 20, 1));
        // Idempotent across shards.
        assert_eq!(
            s.settle("a", usage_a).await.unwrap(),
            tollgate_core::Finish::AlreadyEnded(tollgate_core::Ending::Settled)
        );
        // Another instance (no memory of the admission) settles b in every shard.
        let other = s.clone().with_prefix(s.prefix().to_owned());
        assert!(matches!(
            other.settle("b", usage_a).await.unwrap(),
            tollgate_core::Finish::Done { .. }
        ));
        assert_eq!(usage(&s, ts).await, (140, 0, 0));
    }
}

/// The refusal reported is the first control, then the first scope, that refuses anywhere, as
/// on a single shard; every attempt counts in every rate scope, the probed shards' too.
#[tokio::test]
async fn the_reported_refusal_is_the_single_shard_one() {
    let cluster = RedisCluster::start();
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 100, window = "1m" }
        concurrency = { limit = 1 }
        [[scopes]]
        key = "tenant"
        requests = { limit = 100, window = "1m" }
        budget = { tokens = 150, period = "day" }
        "#,
    );
    for user_first in [true, false] {
        let (s, u) = apart(&cluster, "order", user_first).await;
        assert!(matches!(
            admit(&s, &p, "a", &u, 50, 50).await,
            Decision::Admit(_)
        ));
        // Both the user's concurrency and the tenant's budget refuse; concurrency comes first.
        let d = admit(&s, &p, "b", &u, 50, 50).await;
        let d = d.deny().cloned().expect("refused");
        assert_eq!(
            (d.reason, d.scope.key()),
            (
                Reason::ConcurrencyLimit,
                format!("tenant:acme/user:{u}").as_str()
            ),
            "user_first={user_first}"
        );
        assert_eq!(usage(&s, "tenant|tenant:acme").await, (0, 100, 0));
        // Both attempts counted in both rate scopes: 100 - 2 left.
        let d = admit(&s, &p, "c", &u, 1, 1).await;
        let d = d.deny().cloned().expect("still refused");
        assert_eq!(d.reason, Reason::ConcurrencyLimit);
        s.settle("a", Usage::default()).await.unwrap();
        let pd = plan(&p, &facts("d", &u, 1, 1)).unwrap();
        let Decision::Admit(a) = s.admit(&pd).await.unwrap() else {
            panic!("admitted once a settles")
        };
        let rate: Vec<_> = a
            .quotas
            .iter()
            .filter(|q| q.reason == Reason::RequestRateLimit)
            .map(|q| (pd.scope_of(q).unwrap().key().to_owned(), q.remaining))
            .collect();
        assert_eq!(
            rate,
            [
                (format!("tenant:acme/user:{u}"), 96),
                ("tenant:acme".to_owned(), 96)
            ],
            "quotas in the plan's order, four attempts counted in each"
        );
    }
}

/// Many tasks on two instances admit through a concurrency scope and a budget scope on
/// different nodes: neither limit is ever exceeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_across_shards_never_exceeds_a_limit() {
    let cluster = RedisCluster::start();
    let p = Arc::new(policy(
        r#"
        [[scopes]]
        key = "user"
        budget = { tokens = 2000, period = "day" }
        [[scopes]]
        key = "tenant"
        concurrency = { limit = 3, lease_ttl = "30s" }
        "#,
    ));
    let (a, u) = apart(&cluster, "race", true).await;
    let b = a.clone().with_prefix(a.prefix().to_owned());
    let held = Arc::new(AtomicU64::new(0));
    let most = Arc::new(AtomicU64::new(0));
    let (admitted, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let tasks: Vec<_> = (0..32)
        .map(|t| {
            let s = if t % 2 == 0 { a.clone() } else { b.clone() };
            let (p, u, held, most) = (p.clone(), u.clone(), held.clone(), most.clone());
            let (admitted, refused) = (admitted.clone(), refused.clone());
            tokio::spawn(async move {
                for i in 0..15 {
                    let id = format!("t{t}-{i}");
                    match admit(&s, &p, &id, &u, 30, 20).await {
                        Decision::Admit(_) => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            held.fetch_sub(1, Ordering::SeqCst);
                            let full = Usage {
                                input_tokens: 30,
                                cached_input_tokens: 0,
                                output_tokens: 20,
                                ..Usage::default()
                            };
                            s.settle(&id, full).await.unwrap();
                        }
                        Decision::Deny(_) => {
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                        Decision::Killed(k) => panic!("killed: {k:?}"),
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let (admitted, refused) = (
        admitted.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
    );
    assert!(most.load(Ordering::SeqCst) <= 3, "concurrency exceeded");
    let (settled, reserved, _) = usage(&a, &format!("user|tenant:acme/user:{u}")).await;
    assert_eq!(reserved, 0);
    assert_eq!(settled, 50 * admitted);
    assert!(settled <= 2000, "budget exceeded: {settled}");
    assert_eq!(admitted, 40, "the budget, 2000 / 50, is used up in full");
    assert!(refused > 0, "no contention: the test proves nothing");
    assert_eq!(usage(&a, "tenant|tenant:acme").await.2, 0, "leases left");
}

/// A node dies: a request with a part on it fails closed (`Unavailable`), the part taken before
/// it on a live node is given back, and requests whose scopes all sit on live nodes are still
/// served (with full coverage not required, as an operator would set for this).
#[tokio::test]
async fn a_dead_node_fails_its_requests_closed_and_leaks_nothing() {
    let mut cluster = RedisCluster::start();
    for n in &cluster.nodes {
        let out = Command::new("redis-cli")
            .args(["-p", &n.port().to_string()])
            .args(["CONFIG", "SET", "cluster-require-full-coverage", "no"])
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).contains("OK"));
    }
    let both = policy(
        r#"
        [[scopes]]
        key = "user"
        concurrency = { limit = 5 }
        budget = { tokens = 1000, period = "day" }
        [[scopes]]
        key = "tenant"
        concurrency = { limit = 5 }
        "#,
    );
    let user_only = policy(
        "[[scopes]]\nkey = \"user\"\nconcurrency = { limit = 5 }\nbudget = { tokens = 1000, period = \"day\" }\n",
    );
    // The user's shard comes first, so its part is taken before the dead node is reached.
    let (s, u) = apart(&cluster, "dead", true).await;
    let us = format!("user|tenant:acme/user:{u}");
    assert!(matches!(
        admit(&s, &both, "warm", &u, 1, 1).await,
        Decision::Admit(_)
    ));
    s.settle("warm", Usage::default()).await.unwrap();
    let tenant_node = node_of(
        &cluster,
        &format!("{}:x", s.shard_prefix("tenant|tenant:acme")),
    );
    let dead = cluster
        .nodes
        .iter()
        .position(|n| n.port() == tenant_node)
        .unwrap();
    cluster.nodes[dead].kill();

    let r = s
        .admit(&plan(&both, &facts("a", &u, 10, 10)).unwrap())
        .await;
    assert!(
        matches!(r, Err(tollgate_core::StoreError::Unavailable(_))),
        "fails closed: {r:?}"
    );
    assert_eq!(
        usage(&s, &us).await,
        (0, 0, 0),
        "the user's part was given back"
    );
    let r = s
        .admit(&plan(&user_only, &facts("b", &u, 10, 10)).unwrap())
        .await;
    assert!(
        matches!(r, Ok(Decision::Admit(_))),
        "live nodes serve: {r:?}"
    );
    assert_eq!(usage(&s, &us).await, (0, 20, 1));
}

/// Slices over a sharded store: each scope's slice is leased from its own shard, requests whose
/// scopes sit on different nodes are admitted against them locally, and everything goes back.
#[tokio::test]
async fn slices_are_leased_shard_by_shard() {
    use tollgate_core::Finish;
    use tollgate_slices::{SliceConfig, Sliced};
    let cluster = RedisCluster::start();
    let store = sharded(&cluster, "slices").await;
    let s = Sliced::new(
        store.clone(),
        SliceConfig {
            hot_after: 0,
            ..SliceConfig::default()
        },
    );
    let p = policy(
        r#"
        [[scopes]]
        key = "tenant"
        concurrency = { limit = 100 }
        budget = { tokens = 100000, period = "day" }
        [[scopes]]
        key = "user"
        requests = { limit = 1000, window = "1m" }
        budget = { tokens = 10000, period = "day" }
        "#,
    );
    let users = ["a", "b", "c", "d"];
    let mut charged = 0;
    for i in 0..80 {
        let id = format!("r{i}");
        let d = s
            .admit(&plan(&p, &facts(&id, users[i % 4], 10, 10)).unwrap())
            .await
            .unwrap();
        assert!(matches!(d, Decision::Admit(_)), "{d:?}");
        let u = Usage {
            input_tokens: 10,
            output_tokens: 5,
            ..Usage::default()
        };
        let Finish::Done { charged: c } = s.settle(&id, u).await.unwrap() else {
            panic!("{id} not ended");
        };
        charged += c[0];
    }
    let st = s.stats();
    assert!(st.local > 60 && st.failed == 0, "{st:?}");
    let scopes = users.map(|u| format!("user|tenant:acme/user:{u}"));
    let shards: std::collections::BTreeSet<&str> = scopes
        .iter()
        .map(String::as_str)
        .chain(["tenant|tenant:acme"])
        .map(|scope| store.shard_prefix(scope))
        .collect();
    assert!(shards.len() > 1, "the scopes share one shard: {shards:?}");
    s.return_all().await.unwrap();
    s.return_all().await.unwrap();
    let t = store.usage("tenant|tenant:acme", Some(DAY)).await.unwrap();
    assert_eq!((t.settled, t.reserved, t.leases), (charged, 0, 0));
    for u in users {
        let got = store
            .usage(&format!("user|tenant:acme/user:{u}"), Some(DAY))
            .await
            .unwrap();
        assert_eq!((got.settled, got.reserved), (charged / 4, 0), "user {u}");
    }
}
