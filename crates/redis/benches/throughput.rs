//! Admissions per second against one local Redis, next to `redis-benchmark` running a trivial
//! EVALSHA (`return 1`) on the same server in the same run.
//!
//! `cargo bench -p tollgate-redis --bench throughput`
//!
//! For experiments, without changing the defaults: `TOLLGATE_BENCH_CALLERS=8,64` runs only those
//! rows; `TOLLGATE_BENCH_BATCHES_IN_FLIGHT` and `TOLLGATE_BENCH_MAX_BATCH` set the store's
//! `RedisConfig::batches_in_flight` and `max_batch`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate_core::{Decision, Dimension, Identity, Policy, RequestFacts, Store, Usage, plan};
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_testkit::redis_server::RedisServer;

const N: u64 = 40_000;

fn redis_benchmark(port: u16, clients: u64, sha: &str) -> f64 {
    let out = Command::new("redis-benchmark")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-n",
            &N.to_string(),
            "-c",
            &clients.to_string(),
            "-q",
        ])
        .args(["EVALSHA", sha, "0"])
        .output()
        .expect("redis-benchmark runs");
    let text = String::from_utf8_lossy(&out.stdout);
    // "EVALSHA ...: 85000.00 requests per second, p50=0.3 msec"
    let rps = text.rsplit(':').find_map(|part| {
        part.trim()
            .split(' ')
            .next()
            .and_then(|n| n.parse::<f64>().ok())
    });
    rps.unwrap_or_else(|| panic!("cannot read redis-benchmark output: {text}"))
}

async fn tollgate(store: &RedisStore, policy: &Arc<Policy>, clients: u64, settle: bool) -> f64 {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let per = N / clients;
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (store, policy) = (store.clone(), policy.clone());
            tokio::spawn(async move {
                for _ in 0..per {
                    let id = format!("b{}", SEQ.fetch_add(1, Ordering::Relaxed));
                    let f = RequestFacts {
                        request_id: id.clone(),
                        identity: Identity::default()
                            .with(Dimension::User, format!("u{}", c % 16))
                            .with(Dimension::Tenant, "acme"),
                        input_tokens: 100,
                        max_output_tokens: Some(100),
                        ..RequestFacts::default()
                    };
                    let p = plan(&policy, &f).unwrap();
                    match store.admit(&p).await.unwrap() {
                        Decision::Admit(_) => {}
                        other => panic!("benchmark policy refused: {other:?}"),
                    }
                    if settle {
                        let u = Usage {
                            input_tokens: 100,
                            cached_input_tokens: 0,
                            output_tokens: 50,
                            ..Usage::default()
                        };
                        store.settle(&id, u).await.unwrap();
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    (per * clients) as f64 / start.elapsed().as_secs_f64()
}

/// Redis's own CPU time so far, in µs: the whole server (`INFO cpu`, its network I/O included)
/// and inside the library's functions alone (`FCALL` in `INFO commandstats`); and the number of
/// `FCALL` calls.
fn redis_cpu_us(port: u16) -> (f64, f64, f64) {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "INFO", "all"])
        .output()
        .expect("redis-cli runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut server = 0.0;
    let mut fcall = 0.0;
    let mut calls = 0.0;
    for line in text.lines() {
        let line = line.trim_end();
        for name in ["used_cpu_sys:", "used_cpu_user:"] {
            if let Some(secs) = line.strip_prefix(name).and_then(|v| v.parse::<f64>().ok()) {
                server += secs * 1e6;
            }
        }
        if let Some(stats) = line.strip_prefix("cmdstat_fcall:") {
            let field = |name: &str| {
                stats
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(name)?.parse().ok())
                    .unwrap_or(0.0)
            };
            fcall = field("usec=");
            calls = field("calls=");
        }
    }
    (server, fcall, calls)
}

/// This process's CPU time so far (all threads, user + system), in µs, from `/proc/self/stat`
/// (clock ticks of 10 ms: over a run of 40,000 calls, about 1% resolution).
fn own_cpu_us() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) * 10_000.0
}

/// Numbers from the environment, comma-separated; a value that is not one stops the bench.
fn env_numbers(name: &str) -> Option<Vec<u64>> {
    let v = std::env::var(name).ok()?;
    Some(
        v.split(',')
            .map(|n| {
                n.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}: {n} is not a number"))
            })
            .collect(),
    )
}

/// One number from the environment (the first, when a list is given).
fn env_number(name: &str) -> Option<u64> {
    env_numbers(name)?.first().copied()
}

fn main() {
    let callers = env_numbers("TOLLGATE_BENCH_CALLERS").unwrap_or_else(|| vec![1, 8, 64]);
    // Over TCP, as a gateway reaches its Redis in production.
    let server = RedisServer::start_tcp_with(&[]);
    let sha = {
        let out = Command::new("redis-cli")
            .args([
                "-p",
                &server.port().to_string(),
                "SCRIPT",
                "LOAD",
                "return 1",
            ])
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let policy = Arc::new(
        Policy::from_toml(
            r#"
            [[scopes]]
            key = "user"
            requests = { limit = 1000000000, window = "1m" }
            concurrency = { limit = 1000000, lease_ttl = "1m" }
            budget = { tokens = 1000000000000, period = "day" }
            "#,
        )
        .unwrap(),
    );
    println!(
        "N = {N} calls per row; one redis-server on 127.0.0.1, 2 cores shared by client and server\n"
    );
    println!(
        "Redis CPU: µs of Redis's CPU per admission (admit run) and per pair (admit + settle run),\n\
         the whole server, then inside FCALL alone. Client CPU: this process's, the same way\n\
         (plan, the store's client, the tokio runtime). Per call: admissions (admit run) and\n\
         admissions and settlements (pair run) per FCALL, as callers waiting at the same moment\n\
         share one call.\n"
    );
    println!(
        "{:<10} {:>22} {:>16} {:>8} {:>20} {:>8}   {:>11}   {:>11}   {:>11}   {:>9}",
        "clients",
        "redis-benchmark EVALSHA",
        "tollgate admit",
        "ratio",
        "admit + settle (2 calls)",
        "ratio",
        "CPU: admit",
        "pair",
        "client",
        "per call"
    );
    for (flavour, rt) in [
        (
            "multi-thread",
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap(),
        ),
        (
            "current-thread",
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        ),
    ] {
        println!("tokio {flavour} runtime:");
        for &clients in &callers {
            let baseline = redis_benchmark(server.port(), clients, &sha);
            let port = server.port();
            let (admit, pair, cpu, client) = rt.block_on(async {
                let mut cfg = RedisConfig::new(server.url());
                cfg.initialise_on_first_use = true;
                cfg.prefix = format!("bench-{flavour}-{clients}");
                cfg.call_timeout = Duration::from_secs(5);
                if let Some(n) = env_number("TOLLGATE_BENCH_BATCHES_IN_FLIGHT") {
                    cfg.batches_in_flight = n as usize;
                }
                if let Some(n) = env_number("TOLLGATE_BENCH_MAX_BATCH") {
                    cfg.max_batch = n as usize;
                }
                let store = RedisStore::connect(cfg).await.unwrap();
                tollgate(&store, &policy, clients, false).await; // warm up, load the library
                let (before, own0) = (redis_cpu_us(port), own_cpu_us());
                let admit = tollgate(&store, &policy, clients, false).await;
                let (mid, own1) = (redis_cpu_us(port), own_cpu_us());
                let pair = tollgate(&store, &policy, clients, true).await;
                let (after, own2) = (redis_cpu_us(port), own_cpu_us());
                let n = ((N / clients) * clients) as f64;
                let per =
                    |a: (f64, f64, f64), b: (f64, f64, f64)| ((b.0 - a.0) / n, (b.1 - a.1) / n);
                let client = [(own1 - own0) / n, (own2 - own1) / n];
                // Items per FCALL: the pair run has two items per request.
                let batch = [n / (mid.2 - before.2), 2.0 * n / (after.2 - mid.2)];
                (
                    admit,
                    pair,
                    [per(before, mid), per(mid, after)],
                    (client, batch),
                )
            });
            let (client, batch) = client;
            println!(
                "{clients:<10} {baseline:>20.0}/s {admit:>14.0}/s {:>7.2}x {pair:>18.0}/s {:>7.2}x   {:>5.1} {:>5.1}   {:>5.1} {:>5.1}   {:>5.1} {:>5.1}   {:>4.1} {:>4.1}",
                admit / baseline,
                pair / baseline,
                cpu[0].0,
                cpu[0].1,
                cpu[1].0,
                cpu[1].1,
                client[0],
                client[1],
                batch[0],
                batch[1]
            );
        }
    }
}
