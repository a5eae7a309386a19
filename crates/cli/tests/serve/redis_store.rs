//! The Redis store across processes: byte-identical replay, the overshoot proof (several OS
//! processes with hundreds of tasks each on one Redis), and faults (a worker SIGKILLed while
//! holding leases and reservations; Redis killed and restarted mid-run).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr
)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::Value;
use tollgate_core::{Ending, Finish, Period, Store, Usage};
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_testkit::redis_server::{RedisCluster, RedisServer};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
}

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

#[test]
fn replay_on_redis_is_byte_identical_to_memory() {
    let server = RedisServer::start();
    let run = |store: &str| {
        let out = bin()
            .args(["replay", "--format", "json", "--store", store])
            .arg(repo("fixtures/day28.toml"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{store}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    let memory = run("memory");
    let redis = run(&server.url());
    assert_eq!(
        String::from_utf8_lossy(&redis),
        String::from_utf8_lossy(&memory)
    );
    // And a second Redis run (fresh prefix) gives the same again.
    assert_eq!(run(&server.url()), memory);
}

const TOKEN_BUDGET: u64 = 15_000;
/// About 590 micro-USD per request at gpt-4o prices: room for some 170 admissions.
const MONEY_BUDGET: u64 = 100_000;
const GLOBAL_LEASES: u64 = 40;
const TTL_MS: u64 = 3_000;
/// A 400-day period: a run never crosses a period boundary.
const PERIOD: Period = Period::Fixed(400 * 86_400_000);

fn policy_file(dir: &Path, money: bool) -> PathBuf {
    let budget = if money {
        format!(
            "[prices.\"gpt-4o\"]\ninput = 2500000\noutput = 10000000\n\
             [[scopes]]\nname = \"all\"\nkey = \"global\"\nconcurrency = {{ limit = {GLOBAL_LEASES}, lease_ttl = \"3s\" }}\n\
             budget = {{ micro_usd = {MONEY_BUDGET}, period = \"400d\" }}\n"
        )
    } else {
        format!(
            "[[scopes]]\nname = \"all\"\nkey = \"global\"\nconcurrency = {{ limit = {GLOBAL_LEASES}, lease_ttl = \"3s\" }}\n\
             budget = {{ tokens = {TOKEN_BUDGET}, period = \"400d\" }}\n"
        )
    };
    let text = format!(
        "reservation_ttl = \"3s\"\nexpired_reservation_charge = \"full\"\n{budget}\
         [[scopes]]\nkey = \"user\"\nrequests = {{ limit = 2000, window = \"1s\" }}\nconcurrency = {{ limit = 15, lease_ttl = \"3s\" }}\n"
    );
    let p = dir.join(if money { "money.toml" } else { "tokens.toml" });
    std::fs::write(&p, text).unwrap();
    p
}

async fn store(server: &RedisServer, prefix: &str) -> RedisStore {
    Target::Single(server).store(prefix).await
}

/// The Redis the workers share: one server, or a cluster with the key space in shards.
#[derive(Clone, Copy)]
enum Target<'a> {
    Single(&'a RedisServer),
    Sharded(&'a RedisCluster),
}

const SHARDS: u16 = 8;

impl Target<'_> {
    async fn store(self, prefix: &str) -> RedisStore {
        let mut cfg = RedisConfig::new(match self {
            Target::Single(s) => s.url(),
            Target::Sharded(_) => String::new(),
        });
        if let Target::Sharded(c) = self {
            cfg.cluster = Some(c.urls());
            cfg.shards = SHARDS;
        }
        cfg.prefix = prefix.to_owned();
        cfg.call_timeout = Duration::from_secs(2);
        RedisStore::connect(cfg).await.unwrap()
    }

    fn args(self) -> Vec<String> {
        match self {
            Target::Single(s) => vec!["--redis".into(), s.url()],
            Target::Sharded(c) => vec![
                "--redis".into(),
                "unused".into(),
                "--cluster".into(),
                c.urls().join(","),
                "--shards".into(),
                SHARDS.to_string(),
            ],
        }
    }
}

fn worker(
    server: &RedisServer,
    prefix: &str,
    policy: &Path,
    name: &str,
    history: &Path,
    extra: &[&str],
) -> Command {
    worker_on(Target::Single(server), prefix, policy, name, history, extra)
}

fn worker_on(
    target: Target<'_>,
    prefix: &str,
    policy: &Path,
    name: &str,
    history: &Path,
    extra: &[&str],
) -> Command {
    let mut c = bin();
    c.arg("stress-store")
        .args(target.args())
        .args(["--prefix", prefix, "--worker", name])
        .arg("--policy")
        .arg(policy)
        .arg("--history")
        .arg(history)
        .args(extra);
    c
}

fn history(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

struct Outcome {
    /// id -> amount reserved at admission
    admitted: HashMap<String, u64>,
    /// id -> charged at settlement or release
    finished: HashMap<String, u64>,
    abandoned: Vec<String>,
    max_committed_lower_bound: u64,
    max_leases_lower_bound: u64,
}

/// Reads the histories and computes, at every instant, what was *certainly* committed: an
/// admission's reservation from the end of its admit call to the start of its finish call (or,
/// abandoned, for half a TTL), and a settlement's charge from the end of its call. A lower bound
/// above the budget would prove an overshoot.
fn check(histories: &[Vec<Value>]) -> Outcome {
    let mut admitted = HashMap::new();
    let mut admit_end = HashMap::new();
    let mut finished = HashMap::new();
    let mut abandoned = Vec::new();
    let mut events: Vec<(u128, i64, i64)> = Vec::new(); // (time, committed delta, lease delta)
    for h in histories {
        for e in h {
            let id = e["id"].as_str().unwrap_or_default().to_owned();
            let t = |k: &str| e[k].as_u64().map(u128::from).unwrap_or(0);
            match (e["op"].as_str(), e["result"].as_str()) {
                (Some("admit"), Some("admit")) => {
                    let amount = e["amounts"][0].as_u64().unwrap();
                    assert!(
                        admitted.insert(id.clone(), amount).is_none(),
                        "{id} admitted twice"
                    );
                    admit_end.insert(id, t("t1"));
                }
                (Some("settle" | "release"), Some("done")) => {
                    let charged = e["charged"][0].as_u64().unwrap();
                    let amount = admitted[&id] as i64;
                    events.push((admit_end[&id], amount, 1));
                    events.push((t("t0"), -amount, -1));
                    events.push((t("t1"), charged as i64, 0));
                    assert!(
                        finished.insert(id.clone(), charged).is_none(),
                        "{id} finished twice"
                    );
                }
                (Some("settle" | "release"), other) => {
                    panic!("{id} did not finish cleanly: {other:?} {e}")
                }
                (Some("abandon"), _) => {
                    let amount = admitted[&id] as i64;
                    let end = admit_end[&id];
                    events.push((end, amount, 1));
                    // Charged in full at expiry: committed stays; the lease certainly lasts half a TTL.
                    events.push((end + u128::from(TTL_MS / 2) * 1_000_000, 0, -1));
                    abandoned.push(id);
                }
                _ => {}
            }
        }
    }
    events.sort_by_key(|e| (e.0, -e.1));
    let (mut committed, mut leases, mut max_c, mut max_l) = (0i64, 0i64, 0i64, 0i64);
    for (_, dc, dl) in events {
        committed += dc;
        leases += dl;
        max_c = max_c.max(committed);
        max_l = max_l.max(leases);
    }
    Outcome {
        admitted,
        finished,
        abandoned,
        max_committed_lower_bound: max_c.max(0) as u64,
        max_leases_lower_bound: max_l.max(0) as u64,
    }
}

fn overshoot_proof(money: bool) {
    let server = RedisServer::start();
    overshoot_proof_on(Target::Single(&server), money);
}

fn overshoot_proof_on(target: Target<'_>, money: bool) {
    let budget = if money { MONEY_BUDGET } else { TOKEN_BUDGET };
    let dir = tempfile::tempdir().unwrap();
    let policy = policy_file(dir.path(), money);
    let prefix = if money { "proof-money" } else { "proof-tokens" };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sampler_store = rt.block_on(target.store(prefix));
    if let Target::Sharded(_) = target {
        // The global scope and the users' scopes must sit in different shards, or the proof
        // never admits a request in parts.
        let global = sampler_store.shard_prefix("all|global").to_owned();
        let apart = (0..4)
            .filter(|u| {
                sampler_store.shard_prefix(&format!("user|tenant:acme/user:u{u}")) != global
            })
            .count();
        assert!(
            apart >= 2,
            "only {apart} of 4 users outside the global scope's shard"
        );
    }
    // The checker samples the store's own books atomically (one Lua call) throughout the run.
    let stop = Arc::new(AtomicBool::new(false));
    let (samples, worst_committed, worst_leases) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let sampler = {
        let (stop, samples, wc, wl, s) = (
            stop.clone(),
            samples.clone(),
            worst_committed.clone(),
            worst_leases.clone(),
            sampler_store.clone(),
        );
        rt.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(u) = s.usage("all|global", Some(PERIOD)).await {
                    wc.fetch_max(u.settled + u.reserved, Ordering::Relaxed);
                    wl.fetch_max(u.leases, Ordering::Relaxed);
                    samples.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    let names: Vec<String> = (0..4).map(|i| format!("w{i}")).collect();
    let children: Vec<_> = names
        .iter()
        .map(|n| {
            worker_on(
                target,
                prefix,
                &policy,
                n,
                &dir.path().join(n),
                &[
                    "--tasks",
                    "150",
                    "--requests",
                    "20",
                    "--hold-ms",
                    "20",
                    "--abandon-every",
                    "50",
                ],
            )
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success(), "a worker failed");
    }
    stop.store(true, Ordering::Relaxed);
    rt.block_on(sampler).unwrap();
    let histories: Vec<_> = names.iter().map(|n| history(&dir.path().join(n))).collect();
    let out = check(&histories);
    let requests: usize = histories
        .iter()
        .map(|h| h.iter().filter(|e| e["op"] == "admit").count())
        .sum();
    assert_eq!(requests, 4 * 150 * 20);
    assert!(
        out.admitted.len() > 100,
        "enough admissions to matter: {}",
        out.admitted.len()
    );
    assert!(
        requests - out.admitted.len() > 200,
        "the limits were contended: {} refused",
        requests - out.admitted.len()
    );
    assert!(samples.load(Ordering::Relaxed) > 20, "the sampler ran");
    // Both limits were contended: many refusals of each kind, and the budget was pressed.
    let refused = |reason: &str| {
        histories
            .iter()
            .flatten()
            .filter(|e| e["reason"] == reason)
            .count()
    };
    // Sharded, concurrency refusals crowd out budget ones: parts taken for a moment before an
    // undo fill lease sets (spurious refusals), and a budget refusal yields to a concurrency
    // refusal that the probe of another shard finds (the earlier control is reported).
    let budget_refusals = if matches!(target, Target::Sharded(_)) {
        100
    } else {
        1000
    };
    assert!(
        refused("budget_limit") > budget_refusals,
        "budget refusals: {}",
        refused("budget_limit")
    );
    assert!(
        refused("concurrency_limit") > 100,
        "concurrency refusals: {}",
        refused("concurrency_limit")
    );
    assert!(
        out.max_committed_lower_bound > budget * 8 / 10,
        "the budget was pressed: {}",
        out.max_committed_lower_bound
    );
    // Invariant 1: settled + reserved never above the budget.
    eprintln!(
        "{prefix}: {requests} requests, {} admitted, {} abandoned, refused {} budget, {} concurrency; committed lower bound max {} of {budget}; \
         {} samples, sampled max {}; leases lower bound max {}, sampled max {} of {GLOBAL_LEASES}",
        out.admitted.len(),
        out.abandoned.len(),
        histories
            .iter()
            .flatten()
            .filter(|e| e["reason"] == "budget_limit")
            .count(),
        histories
            .iter()
            .flatten()
            .filter(|e| e["reason"] == "concurrency_limit")
            .count(),
        out.max_committed_lower_bound,
        samples.load(Ordering::Relaxed),
        worst_committed.load(Ordering::Relaxed),
        out.max_leases_lower_bound,
        worst_leases.load(Ordering::Relaxed),
    );
    assert!(
        out.max_committed_lower_bound <= budget,
        "history proves overshoot: {}",
        out.max_committed_lower_bound
    );
    assert!(
        worst_committed.load(Ordering::Relaxed) <= budget,
        "sampled overshoot"
    );
    // Invariant 2: leases never above the limit.
    assert!(
        out.max_leases_lower_bound <= GLOBAL_LEASES,
        "history proves too many leases: {}",
        out.max_leases_lower_bound
    );
    assert!(worst_leases.load(Ordering::Relaxed) <= GLOBAL_LEASES);
    // Invariant 3: after the TTL, every admission ended in exactly one settlement or expiry.
    std::thread::sleep(Duration::from_millis(TTL_MS + 500));
    rt.block_on(async {
        while sampler_store.sweep_expired(1000).await.unwrap() > 0 {}
        for id in out.admitted.keys() {
            let f = sampler_store.settle(id, Usage::default()).await.unwrap();
            let want = if out.finished.contains_key(id) {
                None
            } else {
                Some(Ending::Expired)
            };
            match (f, want) {
                (Finish::AlreadyEnded(Ending::Settled | Ending::Released), None) => {}
                (Finish::AlreadyEnded(Ending::Expired), Some(Ending::Expired)) => {}
                (f, w) => panic!("{id}: {f:?}, expected {w:?}"),
            }
        }
        let u = sampler_store
            .usage("all|global", Some(PERIOD))
            .await
            .unwrap();
        let charged: u64 = out.finished.values().sum::<u64>()
            + out.abandoned.iter().map(|id| out.admitted[id]).sum::<u64>();
        assert_eq!((u.reserved, u.leases), (0, 0), "nothing leaks");
        assert_eq!(u.settled, charged, "the books equal the history");
    });
    assert!(!out.abandoned.is_empty());
}

#[test]
fn four_processes_never_overshoot_a_token_budget() {
    overshoot_proof(false);
}

#[test]
fn four_processes_never_overshoot_a_money_budget() {
    overshoot_proof(true);
}

/// The same proof on a three-node cluster with the key space in 8 shards: the global scope and
/// the users' scopes sit in different shards, so requests are admitted in parts, shard by shard.
#[test]
fn four_processes_never_overshoot_a_budget_split_over_cluster_shards() {
    let cluster = RedisCluster::start();
    overshoot_proof_on(Target::Sharded(&cluster), false);
}

#[test]
fn a_killed_instance_gives_its_leases_back_and_is_charged() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = policy_file(dir.path(), false);
    let hist = dir.path().join("hang");
    let mut child = worker(
        &server,
        "kill",
        &policy,
        "h",
        &hist,
        &[
            "--tasks",
            "20",
            "--requests",
            "1",
            "--hang",
            "--users",
            "20",
        ],
    )
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "holding");
    let out = check(&[history(&hist)]);
    let held: u64 = out.admitted.values().sum();
    assert_eq!(out.admitted.len(), 20);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = rt.block_on(store(&server, "kill"));
    let u = rt.block_on(s.usage("all|global", Some(PERIOD))).unwrap();
    assert_eq!((u.leases, u.reserved, u.settled), (20, held, 0));
    child.kill().unwrap(); // SIGKILL: no chance to release anything
    child.wait().unwrap();
    // Within the lease TTL the slots come back and the reservations are charged in full.
    let mut last = None;
    tollgate_testkit::wait::until_blocking(
        "the slots back and the reservations charged",
        Duration::from_millis(TTL_MS + 2_000),
        || {
            rt.block_on(s.sweep_expired(1000)).unwrap();
            let u = rt.block_on(s.usage("all|global", Some(PERIOD))).unwrap();
            let back = u.leases == 0 && u.reserved == 0;
            last = Some(u);
            back
        },
    );
    assert_eq!(last.map(|u| u.settled), Some(held));
}

#[test]
fn redis_killed_and_restarted_mid_run_fails_closed_then_recovers() {
    // A production Redis keeps its keys on disk (docs/redis.md): restarted, it still holds its
    // marker and the books, so admissions resume. (One that restarts empty is refused until
    // the loss is acknowledged: crates/gateway/tests/hostile/upstreams.rs.)
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    let mut server = RedisServer::start_with(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--dir",
        &data,
    ]);
    // Generous limits: the run must still be going when Redis dies.
    let policy = dir.path().join("loose.toml");
    std::fs::write(
        &policy,
        "[[scopes]]\nkey = \"user\"\nconcurrency = { limit = 100, lease_ttl = \"3s\" }\nbudget = { tokens = 1000000000, period = \"400d\" }\n",
    )
    .unwrap();
    let hist = dir.path().join("restart");
    let mut child = worker(
        &server,
        "restart",
        &policy,
        "r",
        &hist,
        &["--tasks", "20", "--requests", "400", "--hold-ms", "5"],
    )
    .stdout(Stdio::null())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    };
    // Both instants are read while Redis is certainly down: after it was killed and reaped,
    // and before it is started again (read on the other side of either, a test thread that a
    // busy machine pauses for a moment would count a live Redis's admissions as the dead
    // one's).
    server.kill();
    let killed_at = now();
    std::thread::sleep(Duration::from_millis(1_000));
    let restarted_at = now();
    server.restart();
    let status = child.wait().unwrap();
    assert!(status.success(), "the worker survived (no panic): {status}");
    let h = history(&hist);
    let t = |e: &Value, k: &str| u128::from(e[k].as_u64().unwrap_or(0));
    let errors = h.iter().filter(|e| e["result"] == "error").count();
    assert!(errors > 0, "calls failed while Redis was down");
    // Fail closed: nothing was admitted while Redis was down.
    assert!(!h.iter().any(|e| e["result"] == "admit"
        && t(e, "t0") > killed_at + 50_000_000
        && t(e, "t1") < restarted_at));
    // Service resumed within seconds of the restart.
    let first_after = h
        .iter()
        .filter(|e| e["result"] == "admit" && t(e, "t0") >= restarted_at)
        .map(|e| t(e, "t1"))
        .min()
        .expect("admissions resumed after the restart");
    eprintln!(
        "restart: {errors} calls failed closed while Redis was down; first admission {} ms after the restart",
        (first_after - restarted_at) / 1_000_000
    );
    assert!(
        first_after - restarted_at < 5_000_000_000,
        "resumed {} ms after restart",
        (first_after - restarted_at) / 1_000_000
    );
}
