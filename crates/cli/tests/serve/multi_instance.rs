//! Several gateway processes, one Redis, one upstream: the upstream's own counts prove that the
//! concurrency limit and the budget held across instances. Larger runs: `bench/multi-instance.sh`
//! (sets `TOLLGATE_MI_INSTANCES` and `TOLLGATE_MI_REQUESTS`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr
)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tollgate_sim::{Sim, SimConfig};
use tollgate_testkit::redis_server::RedisServer;

use crate::common;
use common::{Instance, start_instance};

const CONCURRENCY: u64 = 4;
const BUDGET: u64 = 800;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The gateways' configuration: one Redis, the simulator, the tenant's concurrency limit and a
/// budget of `budget` tokens; `extra` goes first.
fn write_config(
    dir: &std::path::Path,
    redis: &RedisServer,
    sim: &Sim,
    budget: u64,
    extra: &str,
) -> std::path::PathBuf {
    write_config_with(dir, redis, sim, budget, extra, "")
}

/// The same, with `store` at the end of `[store]` (its sub-tables).
fn write_config_with(
    dir: &std::path::Path,
    redis: &RedisServer,
    sim: &Sim,
    budget: u64,
    extra: &str,
    store: &str,
) -> std::path::PathBuf {
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "{extra}[store]\nurl = \"{}\"\nprefix = \"mi\"\ncall_timeout = \"2s\"\n{store}\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
             [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
             [[policy.scopes]]\nkey = \"tenant\"\nconcurrency = {{ limit = {CONCURRENCY}, lease_ttl = \"30s\" }}\n\
             budget = {{ tokens = {budget}, period = \"400d\" }}\n",
            redis.url(),
            sim.base_url(),
            tollgate_gateway::hash_key("sk-mi")
        ),
    )
    .unwrap();
    common::init_store(&config);
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_sharing_redis_never_exceed_limits_as_the_upstream_sees_it() {
    limits_hold("").await;
}

/// The same proof with every instance admitting against slices it leases (from their first
/// request): the limits hold as the upstream sees them, and slices were taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_admitting_against_slices_never_exceed_limits() {
    let redis = limits_hold("[store.slices]\nhot_after = 0\n").await;
    let out = redis
        .cli()
        .args(["--scan", "--pattern", "mi:ts:~s:*"])
        .output()
        .unwrap();
    let slices = String::from_utf8_lossy(&out.stdout).lines().count();
    assert!(slices > 0, "no slice was taken");
}

/// Three gateways (or `TOLLGATE_MI_INSTANCES`) on one Redis, `store` added to `[store]`, in
/// front of one simulator; returns the Redis for further checks.
async fn limits_hold(store: &str) -> RedisServer {
    let instances = env_or("TOLLGATE_MI_INSTANCES", 3);
    let requests = env_or("TOLLGATE_MI_REQUESTS", 240);
    let sim = Sim::start(SimConfig {
        latency: Duration::from_millis(20),
        token_delay: Duration::from_millis(1),
        output_tokens: 30,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config_with(dir.path(), &redis, &sim, BUDGET, "", store);
    let started: Vec<(Instance, String)> =
        (0..instances).map(|_| start_instance(&config)).collect();
    let urls: Arc<Vec<String>> = Arc::new(started.iter().map(|(_, u)| u.clone()).collect());
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    // 8 workers, each sending its share one after another: steady pressure on the slots until
    // the budget runs out. A worker goes on past its share of `requests` (up to ten times it)
    // until the budget has refused it: on a fast machine, refusals for concurrency come so
    // quickly that the fixed share could run out before the budget did.
    let workers = 8;
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let (client, urls) = (client.clone(), urls.clone());
            tokio::spawn(async move {
                let mut results = Vec::new();
                for i in (w..10 * requests).step_by(workers) {
                    let refused_by_budget = results
                        .last()
                        .is_some_and(|(s, c): &(u16, String)| *s == 429 && c == "budget_limit");
                    if i >= requests && refused_by_budget {
                        break;
                    }
                    let body = json!({"model": "gpt-4o", "max_tokens": 40, "stream": i % 2 == 0,
                        "messages": [{"role": "user", "content": format!("request {i}")}]});
                    let url = &urls[i % urls.len()];
                    results.push(chat(&client, url, "sk-mi", None, body).await);
                }
                results
            })
        })
        .collect();
    let mut ok = 0;
    let (mut conc, mut budget) = (0, 0);
    for t in tasks {
        for r in t.await.unwrap() {
            match r {
                (200, _) => ok += 1,
                (429, c) if c == "concurrency_limit" => conc += 1,
                (429, c) if c == "budget_limit" => budget += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    let stats = sim.stats();
    let max_in_flight = stats.max_in_flight.values().copied().max().unwrap_or(0);
    let served = stats.prompt_tokens + stats.completion_tokens;
    eprintln!(
        "{instances} instances, {} requests (at least {requests}, then until the budget refused each worker): {ok} served, {conc} concurrency refusals, {budget} budget refusals; \
         upstream saw at most {max_in_flight} at once (limit {CONCURRENCY}) and served {served} tokens (budget {BUDGET})",
        ok + conc + budget
    );
    assert!(
        max_in_flight <= CONCURRENCY,
        "the upstream saw {max_in_flight} at once"
    );
    assert!(served <= BUDGET, "the upstream served {served} tokens");
    assert_eq!(
        stats.completed, ok as u64,
        "every 200 was one completed upstream request"
    );
    assert!(
        ok > 10 && conc > 0 && budget > 0,
        "both limits were reached: {ok} ok, {conc} conc, {budget} budget"
    );
    drop(started);
    redis
}

/// The same proof with clients that leave: about one request in seven closes its socket
/// mid-request (streamed and not), in front of an upstream that notices a closed connection
/// only when it next writes. The upstream still never has more than the limit under way, and
/// never serves more than the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_hold_the_limits_when_clients_leave() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Larger than the first test's: more requests are admitted, so more clients leave one.
    const LEAVING_BUDGET: u64 = 6000;
    let instances = env_or("TOLLGATE_MI_INSTANCES", 3);
    let requests = env_or("TOLLGATE_MI_REQUESTS", 240);
    let sim = Sim::start(SimConfig {
        latency: Duration::from_millis(20),
        token_delay: Duration::from_millis(2),
        output_tokens: 30,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &redis,
        &sim,
        LEAVING_BUDGET,
        "[server]\ncancel_grace = \"200ms\"\n",
    );
    let started: Vec<(Instance, String)> =
        (0..instances).map(|_| start_instance(&config)).collect();
    let addrs: Arc<Vec<String>> = Arc::new(
        started
            .iter()
            .map(|(_, u)| u.trim_start_matches("http://").to_owned())
            .collect(),
    );
    let workers = 8;
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let addrs = addrs.clone();
            tokio::spawn(async move {
                let (mut left, mut budget_refused) = (0, false);
                for i in (w..10 * requests).step_by(workers) {
                    if i >= requests && budget_refused {
                        break;
                    }
                    // Deterministic choices: a multiplicative hash of the request number.
                    let h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                    let leave = h % 7 == 0;
                    let body = json!({"model": "gpt-4o", "max_tokens": 40, "stream": i % 2 == 0,
                        "messages": [{"role": "user", "content": format!("request {i}")}]})
                    .to_string();
                    let Ok(mut s) = tokio::net::TcpStream::connect(&addrs[i % addrs.len()]).await
                    else {
                        continue;
                    };
                    let head = format!(
                        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-mi\r\n\
                         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        body.len()
                    );
                    s.write_all(head.as_bytes()).await.unwrap();
                    s.write_all(body.as_bytes()).await.unwrap();
                    let mut out = Vec::new();
                    if leave {
                        let wait = Duration::from_millis(5 + h % 30);
                        let _ = tokio::time::timeout(wait, s.read_to_end(&mut out)).await;
                        left += 1;
                        continue;
                    }
                    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
                        .await;
                    budget_refused = String::from_utf8_lossy(&out).contains("budget_limit");
                }
                left
            })
        })
        .collect();
    let mut left = 0;
    for t in tasks {
        left += t.await.unwrap();
    }
    let stats = sim.stats();
    let max_in_flight = stats.max_in_flight.values().copied().max().unwrap_or(0);
    let served = stats.prompt_tokens + stats.completion_tokens;
    eprintln!(
        "{instances} instances, {left} clients left mid-request, {} cancelled upstream: upstream saw at most {max_in_flight} at once (limit {CONCURRENCY}) and served {served} tokens (budget {LEAVING_BUDGET})",
        stats.cancelled.len()
    );
    assert!(left > 10, "clients left: {left}");
    // A client that leaves does not end what the upstream bills: every answer begun is read
    // to its usage.
    assert!(
        stats.cancelled.is_empty(),
        "{} answers were cancelled upstream",
        stats.cancelled.len()
    );
    assert!(
        max_in_flight <= CONCURRENCY,
        "the upstream saw {max_in_flight} at once"
    );
    assert!(
        served <= LEAVING_BUDGET,
        "the upstream served {served} tokens"
    );
    drop(started);
}

/// Two instances racing on one agent operation's limits, as the upstream counts them: its model
/// rounds (`requests`, every attempt counted: exactly the limit is served) for one tenant, its
/// concurrency for another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_hold_an_operations_limits() {
    const ROUNDS: u64 = 12;
    const AT_ONCE: u64 = 2;
    let scopes = format!(
        "[[policy.scopes]]\nname = \"op-rounds\"\nkey = \"operation\"\n\
         match = {{ tenant = \"rounds\" }}\n\
         requests = {{ limit = {ROUNDS}, window = \"1h\" }}\n\
         [[policy.scopes]]\nname = \"op-slots\"\nkey = \"operation\"\n\
         match = {{ tenant = \"slots\" }}\n\
         concurrency = {{ limit = {AT_ONCE}, lease_ttl = \"30s\" }}\n"
    );
    let pair = Pair::start(SimConfig::default(), "mi-op", ["rounds", "slots"], &scopes).await;
    let (sim, urls) = (&pair.sim, &pair.urls);

    // Slots first: the upstream's peak is then this phase's alone.
    let slots = race(urls, "sk-slots", 64).await;
    let stats = sim.stats();
    let max_in_flight = stats.max_in_flight.values().copied().max().unwrap_or(0);
    assert!(
        max_in_flight <= AT_ONCE,
        "the upstream saw {max_in_flight} at once"
    );
    assert_eq!(
        stats.completed, slots.ok,
        "every 200 was one upstream request"
    );
    assert!(
        slots.ok >= AT_ONCE && slots.conc > 0,
        "{} served, {} refused",
        slots.ok,
        slots.conc
    );

    let rounds = race(urls, "sk-rounds", 64).await;
    eprintln!(
        "2 instances, one operation: with {AT_ONCE} slots {} of 64 served, the upstream saw at \
         most {max_in_flight} at once; with {ROUNDS} rounds {} of 64 served",
        slots.ok, rounds.ok
    );
    assert_eq!(
        (rounds.ok, rounds.rate, rounds.conc),
        (ROUNDS, 64 - ROUNDS, 0),
        "exactly the operation's rounds are served, whichever instance takes them"
    );
    assert_eq!(
        sim.stats().completed,
        slots.ok + ROUNDS,
        "as the upstream counts"
    );
}

/// Two gateway instances on one Redis (prefix `prefix`) in front of one simulator (answering
/// after 40 ms, 5 tokens, as `sim` says otherwise), with a key `sk-<tenant>` per tenant and
/// these `[[policy.scopes]]`. They stop when it is dropped.
struct Pair {
    sim: Sim,
    urls: Arc<Vec<String>>,
    _started: Vec<(Instance, String)>,
    _redis: RedisServer,
    _dir: tempfile::TempDir,
}

impl Pair {
    async fn start(sim: SimConfig, prefix: &str, tenants: [&str; 2], scopes: &str) -> Self {
        let sim = Sim::start(SimConfig {
            latency: Duration::from_millis(40),
            output_tokens: 5,
            ..sim
        })
        .await
        .unwrap();
        let redis = RedisServer::start();
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("gateway.toml");
        let mut text = format!(
            "[store]\nurl = \"{}\"\nprefix = \"{prefix}\"\ncall_timeout = \"2s\"\n\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n",
            redis.url(),
            sim.base_url(),
        );
        for t in tenants {
            let hash = tollgate_gateway::hash_key(&format!("sk-{t}"));
            text.push_str(&format!("[[keys]]\nhash = \"{hash}\"\ntenant = \"{t}\"\n"));
        }
        text.push_str(scopes);
        std::fs::write(&config, text).unwrap();
        common::init_store(&config);
        let started: Vec<(Instance, String)> = (0..2).map(|_| start_instance(&config)).collect();
        let urls = Arc::new(started.iter().map(|(_, u)| u.clone()).collect());
        Self {
            sim,
            urls,
            _started: started,
            _redis: redis,
            _dir: dir,
        }
    }
}

/// Two instances on one Redis, racing on one operation's tool calls (each answer makes one)
/// and on one request sent again and again: the operation's calls never pass the limit, as the
/// upstream counts them, and exactly `max_identical` of the identical requests are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_hold_an_operations_tool_calls_and_loops() {
    const CALLS: u64 = 6;
    const SAME: u64 = 4;
    let scopes = format!(
        "[[policy.scopes]]\nname = \"op-calls\"\nkey = \"operation\"\n\
         match = {{ tenant = \"calls\" }}\n\
         tool_calls = {{ limit = {CALLS}, period = \"1h\" }}\n\
         [[policy.scopes]]\nname = \"op-loops\"\nkey = \"operation\"\n\
         match = {{ tenant = \"loops\" }}\n\
         loops = {{ max_identical = {SAME}, window = \"1h\" }}\n"
    );
    let calls_made = SimConfig {
        function_calls: 1,
        ..SimConfig::default()
    };
    let pair = Pair::start(calls_made, "mi-tc", ["calls", "loops"], &scopes).await;
    let (sim, urls) = (&pair.sim, &pair.urls);
    let with_tool = |i: usize| {
        json!({"model": "gpt-4o", "max_tokens": 10,
            "messages": [{"role": "user", "content": format!("round {i}")}],
            "tools": [{"type": "function", "function": {"name": "search",
                "parameters": {"type": "object"}}}]})
    };
    let calls = race_with(urls, "sk-calls", 48, with_tool).await;
    let made = sim.stats().function_calls;
    assert!(made <= CALLS, "the upstream made {made} calls");
    assert_eq!(made, calls.ok, "one call per served round");
    assert_eq!(calls.ok + calls.refused("tool_call_limit"), 48);
    assert!(calls.ok > 0);
    let same = |_| {
        json!({"model": "gpt-4o", "max_tokens": 10,
            "messages": [{"role": "user", "content": "the same step"}]})
    };
    let loops = race_with(urls, "sk-loops", 32, same).await;
    eprintln!(
        "2 instances, one operation: {} of 48 rounds served under {CALLS} tool calls ({made} \
         made); {} of 32 identical requests served under max_identical = {SAME}",
        calls.ok, loops.ok
    );
    assert_eq!(
        (loops.ok, loops.refused("loop_detected")),
        (SAME, 32 - SAME),
        "exactly max_identical served, whichever instance takes them"
    );
}

/// Two instances on one Redis, sent one request with one `Idempotency-Key` sixteen times at
/// once, alternately: the upstream gets it once; every other attempt is told it is in flight
/// (409) or gets the kept answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_agree_on_an_idempotency_key() {
    let pair = Pair::start(SimConfig::default(), "mi-ik", ["keys", "other"], "").await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = json!({"model": "gpt-4o", "max_tokens": 10,
        "messages": [{"role": "user", "content": "pay the invoice"}]});
    let send = |i: usize| {
        let (client, url, body) = (client.clone(), pair.urls[i % 2].clone(), body.to_string());
        async move {
            let req = Request::post(format!("{url}/v1/chat/completions"))
                .header("authorization", "Bearer sk-keys")
                .header("content-type", "application/json")
                .header("idempotency-key", "invoice-7")
                .body(Full::new(Bytes::from(body)))
                .unwrap();
            let r = client.request(req).await.unwrap();
            let replayed = r.headers().contains_key("x-tollgate-idempotent-replay");
            (r.status().as_u16(), replayed)
        }
    };
    let tasks: Vec<_> = (0..16).map(|i| tokio::spawn(send(i))).collect();
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    let fresh = got.iter().filter(|g| **g == (200, false)).count();
    let replayed = got.iter().filter(|g| **g == (200, true)).count();
    let in_flight = got.iter().filter(|g| g.0 == 409).count();
    assert_eq!(fresh, 1, "{got:?}");
    assert_eq!(fresh + replayed + in_flight, 16, "{got:?}");
    assert_eq!(pair.sim.stats().requests.values().sum::<u64>(), 1);
    // Afterwards, from either instance: the kept answer.
    for i in 0..2 {
        assert_eq!(send(i).await, (200, true));
    }
    eprintln!(
        "2 instances, one key sent 16 times at once: 1 served, {replayed} replayed, {in_flight} \
         told it was in flight; the upstream saw 1"
    );
}

/// What a race of `n` rounds of one operation got: how many were served, and the refusals by
/// reason code.
struct Raced {
    ok: u64,
    rate: u64,
    conc: u64,
    other: Vec<String>,
}

impl Raced {
    fn refused(&self, code: &str) -> u64 {
        self.other.iter().filter(|c| *c == code).count() as u64
    }
}

/// `n` rounds of operation `agent-run-1` with `key`, from 8 workers, over the instances in turn.
async fn race(urls: &Arc<Vec<String>>, key: &'static str, n: usize) -> Raced {
    let body = |i: usize| {
        json!({"model": "gpt-4o", "max_tokens": 10,
            "messages": [{"role": "user", "content": format!("round {i}")}]})
    };
    race_with(urls, key, n, body).await
}

/// [`race`] with the body of round `i` from `body`.
async fn race_with(
    urls: &Arc<Vec<String>>,
    key: &'static str,
    n: usize,
    body: fn(usize) -> serde_json::Value,
) -> Raced {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let workers = 8;
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let (client, urls) = (client.clone(), urls.clone());
            tokio::spawn(async move {
                let mut results = Vec::new();
                for i in (w..n).step_by(workers) {
                    let url = &urls[i % urls.len()];
                    results.push(chat(&client, url, key, Some("agent-run-1"), body(i)).await);
                }
                results
            })
        })
        .collect();
    let mut raced = Raced {
        ok: 0,
        rate: 0,
        conc: 0,
        other: Vec::new(),
    };
    for t in tasks {
        for r in t.await.unwrap() {
            match r {
                (200, _) => raced.ok += 1,
                (429, c) if c == "request_rate_limit" => raced.rate += 1,
                (429, c) if c == "concurrency_limit" => raced.conc += 1,
                (429, c) => raced.other.push(c),
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    raced
}

/// One chat completion through the gateway at `url` with `key` (and an operation): its status
/// and error code.
async fn chat(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    url: &str,
    key: &str,
    operation: Option<&str>,
    body: serde_json::Value,
) -> (u16, String) {
    let mut req = Request::post(format!("{url}/v1/chat/completions"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json");
    if let Some(op) = operation {
        req = req.header("x-tollgate-operation", op);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    let r = client.request(req).await.unwrap();
    let status = r.status().as_u16();
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    let code = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
        .unwrap_or_default();
    (status, code)
}
