//! Shutdown of a `tollgate serve` process on SIGTERM, on a Redis store that outlives it: the
//! listener closes at once, a stream under way is served to its end and settled, and one that
//! outlasts the drain timeout is cut off and released (charged what it streamed), so that no
//! lease or reservation waits for its expiry.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tollgate_core::{Period, ScopeUsage, Store};
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_sim::{Sim, SimConfig};
use tollgate_testkit::redis_server::RedisServer;

use crate::common;
use common::{Instance, start_instance_logging};

/// Prompt tokens of the request below, as the simulator reports them.
const PROMPT: u64 = 10;

struct Env {
    _sim: Sim,
    redis: RedisServer,
    _dir: tempfile::TempDir,
    instance: Instance,
    url: String,
    /// The admin listener's URL (`/readyz` answers there through the drain).
    admin: String,
    /// The process's run-time log.
    log: std::path::PathBuf,
}

async fn env(drain_timeout: &str, token_delay: Duration) -> Env {
    env_with(drain_timeout, token_delay, "").await
}

/// The same, with `store` added to `[store]` (its sub-tables).
async fn env_with(drain_timeout: &str, token_delay: Duration, store: &str) -> Env {
    let sim = Sim::start(SimConfig {
        latency: Duration::from_millis(5),
        token_delay,
        output_tokens: 1000,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let redis = RedisServer::start();
    let (dir, token) = common::admin_token_file("admin-token-0123456789");
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\ndrain_timeout = \"{drain_timeout}\"\n\
             [admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = {:?}\n\
             [store]\nurl = \"{}\"\nprefix = \"drain\"\ncall_timeout = \"2s\"\n{store}\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
             [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
             [[policy.scopes]]\nkey = \"tenant\"\nconcurrency = {{ limit = 4, lease_ttl = \"5m\" }}\n\
             budget = {{ tokens = 100000, period = \"day\" }}\n",
            token.display().to_string(),
            redis.url(),
            sim.base_url(),
            tollgate_gateway::hash_key("sk-drain")
        ),
    )
    .unwrap();
    common::init_store(&config);
    let log = dir.path().join("log");
    let file = std::fs::File::create(&log).unwrap();
    let (instance, urls) = start_instance_logging(&config, &["admin"], file.into());
    let [url, admin] = <[String; 2]>::try_from(urls).unwrap();
    Env {
        _sim: sim,
        redis,
        _dir: dir,
        instance,
        url,
        admin,
        log,
    }
}

/// The status of the admin listener's `GET /readyz` (no token: probes carry none).
async fn readyz(env: &Env) -> u16 {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::get(format!("{}/readyz", env.admin))
        .body(Full::new(Bytes::new()))
        .unwrap();
    client.request(req).await.unwrap().status().as_u16()
}

/// Starts a streamed request of `max_tokens` and returns its response once the first
/// content has arrived.
async fn start_stream(env: &Env, max_tokens: u64) -> hyper::Response<hyper::body::Incoming> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = json!({"model": "gpt-4o", "max_tokens": max_tokens, "stream": true,
        "messages": [{"role": "user", "content": "Hello there!"}]});
    let req = Request::post(format!("{}/v1/chat/completions", env.url))
        .header("authorization", "Bearer sk-drain")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    resp
}

fn sigterm(env: &Env) {
    let status = std::process::Command::new("kill")
        .args(["-TERM", &env.instance.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Waits up to `within` for the process to exit; returns whether it exited with success.
fn exits_within(env: &mut Env, within: Duration) -> bool {
    let mut exit = None;
    tollgate_testkit::wait::until_blocking("the exit after SIGTERM", within, || {
        exit = env.instance.0.try_wait().unwrap();
        exit.is_some()
    });
    exit.is_some_and(|s| s.success())
}

/// The tenant's budget and leases as the Redis store holds them.
async fn usage(env: &Env) -> ScopeUsage {
    let mut cfg = RedisConfig::new(env.redis.url().as_str());
    cfg.initialise_on_first_use = true;
    cfg.prefix = "drain".into();
    let store = RedisStore::connect(cfg).await.unwrap();
    let u = store
        .usage("tenant|tenant:acme", Some(Period::Fixed(86_400_000)))
        .await
        .unwrap();
    // The reading's instant is not what is compared.
    ScopeUsage { at_ms: 0, ..u }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_stream_under_way_finish_and_settle() {
    let mut env = env("20s", Duration::from_millis(20)).await;
    let resp = start_stream(&env, 100).await;
    assert_eq!(readyz(&env).await, 200);
    let signalled = Instant::now();
    sigterm(&env);
    // The listener closes at once: new clients go to other instances.
    let port = env.url.rsplit(':').next().unwrap().to_owned();
    tollgate_testkit::wait::until_within(
        "the listener closed after SIGTERM",
        Duration::from_secs(3),
        async || {
            tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
                .await
                .is_err()
        },
    )
    .await;
    // Load balancers probing readiness see the drain.
    assert_eq!(readyz(&env).await, 503);
    // The stream under way goes on to its end (100 tokens at 20 ms each).
    let text = String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    assert_eq!(text.matches("\"content\":\" tok\"").count(), 100, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // Then the process exits by itself, long before its 20 s drain timeout.
    assert!(exits_within(&mut env, Duration::from_secs(10)));
    assert!(signalled.elapsed() < Duration::from_secs(10));
    let u = usage(&env).await;
    assert_eq!((u.leases, u.reserved, u.settled), (0, 0, PROMPT + 100));
}

/// With leased slices: requests admitted against them settle locally, a stream under way at
/// `SIGTERM` finishes, and before the process exits everything it held beyond them goes back:
/// Redis holds no slot and no reservation, and has been told every charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_gives_the_slices_back() {
    let mut env = env_with(
        "20s",
        Duration::from_millis(20),
        "[store.slices]\nhot_after = 0\n",
    )
    .await;
    for _ in 0..5 {
        let body = start_stream(&env, 10)
            .await
            .into_body()
            .collect()
            .await
            .unwrap();
        assert!(String::from_utf8_lossy(&body.to_bytes()).contains("[DONE]"));
    }
    let resp = start_stream(&env, 100).await;
    let held = usage(&env).await;
    assert!(held.leases >= 1 && held.reserved > 0, "{held:?}");
    let out = env
        .redis
        .cli()
        .args(["--scan", "--pattern", "drain:ts:~s:*"])
        .output()
        .unwrap();
    assert!(!out.stdout.is_empty(), "no slice was taken");
    sigterm(&env);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body)
            .trim_end()
            .ends_with("data: [DONE]")
    );
    assert!(exits_within(&mut env, Duration::from_secs(10)));
    let u = usage(&env).await;
    assert_eq!(
        (u.leases, u.reserved, u.settled),
        (0, 0, 5 * (PROMPT + 10) + PROMPT + 100)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_outlasts_the_drain_is_released_not_left_to_expire() {
    // 1,000 tokens at 20 ms each: 20 s, far beyond the 300 ms drain timeout.
    let mut env = env("300ms", Duration::from_millis(20)).await;
    let mut body = start_stream(&env, 1000).await.into_body();
    // Some output first, so that there is a partial usage to charge.
    let mut seen = 0;
    while seen < 5 {
        let frame = body.frame().await.unwrap().unwrap();
        if let Ok(data) = frame.into_data() {
            seen += String::from_utf8_lossy(&data)
                .matches("\"content\":\" tok\"")
                .count();
        }
    }
    sigterm(&env);
    // The stream is cut off: it ends before its 1,000 tokens.
    let rest = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let streamed = seen
        + String::from_utf8_lossy(&rest)
            .matches("\"content\":\" tok\"")
            .count();
    assert!(streamed < 1000, "{streamed}");
    assert!(exits_within(&mut env, Duration::from_secs(8)));
    // Released at shutdown, not left for the 5-minute lease expiry: nothing held, and the
    // reservation charged (the upstream was left mid-answer: what it bills is not known).
    let u = usage(&env).await;
    assert_eq!((u.leases, u.reserved), (0, 0), "{u:?}");
    assert_eq!(u.settled, PROMPT + 1000, "{u:?}, {streamed} streamed");
    // The log says what the drain cut off.
    let log = std::fs::read_to_string(&env.log).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("cut off"))
        .unwrap_or_else(|| panic!("no line for the cut-off stream:\n{log}"));
    assert!(
        line.contains("WARN") && line.contains("connections=1"),
        "{line}"
    );
    // And one line for the stream charged its reservation, with its cause.
    let charged: Vec<_> = log
        .lines()
        .filter(|l| l.contains("charged its whole reservation"))
        .collect();
    assert_eq!(charged.len(), 1, "{log}");
    assert!(charged[0].contains("shut down"), "{}", charged[0]);
}
