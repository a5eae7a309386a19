//! The run-time log of a `tollgate serve` process: every fault leaves one line with its cause,
//! when it begins, not one per request it touches; text by default, JSON when configured.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::Duration;
use tollgate_testkit::wait::{poll, until, until_within};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate_testkit::pg_server::PgServer;
use tollgate_testkit::redis_server::RedisServer;

use crate::common;
use common::{Instance, start_instance_logging};

const KEY: &str = "sk-logs";

/// A process serving `sections` and one upstream at `upstream`, its log in a file: the process,
/// its URL, the log's path and the directory holding them.
fn start(
    sections: &str,
    upstream: &str,
) -> (Instance, String, std::path::PathBuf, tempfile::TempDir) {
    let (p, mut urls, log, dir) = start_with(sections, upstream, &[]);
    (p, urls.remove(0), log, dir)
}

/// [`start`], with the URLs of the side listeners `also` names after the main one.
fn start_with(
    sections: &str,
    upstream: &str,
    also: &[&str],
) -> (Instance, Vec<String>, std::path::PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "{sections}\n[[upstreams]]\nname = \"up\"\nbase_url = \"{upstream}\"\nmodels = [\"gpt-4o\"]\n\
             [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
             [policy]\n[[policy.scopes]]\nname = \"spend\"\nkey = \"tenant\"\n\
             budget = {{ tokens = 1000000, period = \"1d\" }}\n",
            tollgate_gateway::hash_key(KEY)
        ),
    )
    .unwrap();
    // A new Redis without a ledger to tell it from one that forgot: its operator initialises it.
    if sections.contains("url = \"unix://") && !sections.contains("[ledger]") {
        common::init_store(&config);
    }
    let log = dir.path().join("log");
    let file = std::fs::File::create(&log).unwrap();
    let (instance, urls) = start_instance_logging(&config, also, Stdio::from(file));
    (instance, urls, log, dir)
}

/// The upstream simulator with its defaults.
async fn simulator() -> tollgate_sim::Sim {
    tollgate_sim::Sim::start(tollgate_sim::SimConfig::default())
        .await
        .unwrap()
}

async fn chat(url: &str) -> u16 {
    let body = r#"{"model":"gpt-4o","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;
    let req = hyper::Request::post(format!("{url}/v1/chat/completions"))
        .header("authorization", format!("Bearer {KEY}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let r = client.request(req).await.unwrap();
    let status = r.status().as_u16();
    let _ = r.into_body().collect().await;
    status
}

/// The body of `GET url`.
async fn get(url: &str) -> String {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let r = client.get(url.parse().unwrap()).await.unwrap();
    String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).into_owned()
}

/// The log's lines holding `what`, once there are `n` of them (fails after 5 s).
async fn lines_with(log: &std::path::Path, what: &str, n: usize) -> Vec<String> {
    poll(Duration::from_secs(5), async || {
        let text = std::fs::read_to_string(log).unwrap();
        let found: Vec<String> = text
            .lines()
            .filter(|l| l.contains(what))
            .map(str::to_owned)
            .collect();
        if found.len() >= n {
            return Ok(found);
        }
        Err(format!("no {what:?} in the log:\n{text}"))
    })
    .await
}

/// An unreachable upstream: one line per request, with the request's id and the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_is_logged_with_its_cause() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let (_p, url, log, _dir) = start("", &upstream);
    assert_eq!(chat(&url).await, 502);
    let found = lines_with(&log, "the upstream could not be reached", 1).await;
    assert!(found[0].contains("WARN"), "{found:?}");
    assert!(found[0].contains("request_id=tg-"), "{found:?}");
    assert!(
        found[0].to_lowercase().contains("connection refused"),
        "{found:?}"
    );
}

/// A store that loses its state and one that stops answering: each logged once, with its cause,
/// however many requests it refuses; in JSON when configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_faults_are_logged_once_each() {
    let mut redis = RedisServer::start();
    let sections = format!(
        "[log]\nformat = \"json\"\n[store]\nurl = \"{}\"\nprefix = \"logs\"\ncall_timeout = \"500ms\"\n",
        redis.url()
    );
    let upstream = simulator().await;
    let (_p, url, log, _dir) = start(&sections, &upstream.base_url());
    assert_eq!(chat(&url).await, 200);
    let flushed = redis.cli().args(["flushall"]).output().unwrap();
    assert!(flushed.status.success());
    for _ in 0..3 {
        assert_eq!(chat(&url).await, 503);
    }
    let lost = lines_with(&log, "the store has lost its state", 1).await;
    assert_eq!(lost.len(), 1, "logged once: {lost:?}");
    let line: serde_json::Value = serde_json::from_str(&lost[0]).unwrap();
    assert_eq!(line["level"], "ERROR");
    assert_eq!(line["fields"]["fault"], "store_state_lost");
    assert!(
        line["fields"]["cause"].as_str().unwrap().contains("marker"),
        "{line}"
    );

    redis.kill();
    for _ in 0..3 {
        assert_eq!(chat(&url).await, 503);
    }
    let down = lines_with(&log, "the store does not answer", 1).await;
    assert_eq!(down.len(), 1, "logged once: {down:?}");
    let line: serde_json::Value = serde_json::from_str(&down[0]).unwrap();
    assert_eq!(line["fields"]["fault"], "store");
    assert!(
        !line["fields"]["cause"].as_str().unwrap().is_empty(),
        "{line}"
    );
}

/// A Redis that lost the scripts' library but kept its data (`FUNCTION FLUSH`, or a failover
/// to a node that never had it) is served on, the library loaded again; each loss leaves one
/// line, however many calls meet it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_script_library_is_logged_once_each_time() {
    let redis = RedisServer::start();
    let sections = format!(
        "[log]\nformat = \"json\"\n[store]\nurl = \"{}\"\nprefix = \"functions\"\ncall_timeout = \"1s\"\n",
        redis.url()
    );
    let upstream = simulator().await;
    let (_p, url, log, _dir) = start(&sections, &upstream.base_url());
    assert_eq!(chat(&url).await, 200);
    const WHAT: &str = "loaded the scripts' library again";
    for n in 1..=2 {
        let flushed = redis.cli().args(["function", "flush"]).output().unwrap();
        assert!(flushed.status.success());
        for _ in 0..5 {
            assert_eq!(chat(&url).await, 200);
        }
        let found = lines_with(&log, WHAT, n).await;
        assert_eq!(found.len(), n, "once per loss: {found:?}");
        let line: serde_json::Value = serde_json::from_str(&found[n - 1]).unwrap();
        assert_eq!(line["level"], "WARN", "{line}");
        assert_eq!(line["fields"]["fault"], "store_functions", "{line}");
        assert!(
            line["fields"]["cause"]
                .as_str()
                .unwrap()
                .contains("Function not found"),
            "{line}"
        );
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains("the store does not answer"), "{text}");
}

/// A ledger outage: logged when it begins, with its cause, and when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_outage_is_logged_when_it_begins_and_ends() {
    let pg = PgServer::start();
    let sections = format!(
        "[metrics]\nlisten = \"127.0.0.1:0\"\n[ledger]\nurl = \"{}\"\nflush_every = \"50ms\"\n",
        pg.url()
    );
    let upstream = simulator().await;
    let (_p, urls, log, _dir) = start_with(&sections, &upstream.base_url(), &["metrics"]);
    let url = urls[0].clone();
    assert_eq!(chat(&url).await, 200);
    pg.stop();
    for _ in 0..3 {
        assert_eq!(chat(&url).await, 200);
    }
    let failing = lines_with(&log, "ledger writes fail", 1).await;
    // The buffered gauge is live through the outage: at least the three endings since it began.
    tollgate_testkit::wait::poll(Duration::from_secs(5), async || {
        let m = get(&format!("{}/metrics", urls[1])).await;
        let buffered = m
            .lines()
            .find_map(|l| l.strip_prefix("tollgate_ledger_buffered "))
            .and_then(|v| v.parse::<f64>().ok());
        match buffered {
            Some(b) if b >= 3.0 => Ok(()),
            _ => Err(format!("the gauge did not follow the outage:\n{m}")),
        }
    })
    .await;
    assert!(failing[0].contains("ERROR"), "{failing:?}");
    assert!(failing[0].contains("cause="), "{failing:?}");
    pg.restart();
    lines_with(&log, "ledger writes resumed", 1).await;
    let failing = lines_with(&log, "ledger writes fail", 1).await;
    assert_eq!(failing.len(), 1, "one line for the outage: {failing:?}");
}

/// A shutdown during a ledger outage keeps the endings it could not write in the spool file,
/// says so in the log, and the next start writes them: none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_during_a_ledger_outage_keeps_its_endings() {
    let pg = PgServer::start();
    let spool_dir = tempfile::tempdir().unwrap();
    let spool = spool_dir.path().join("endings.spool");
    let sections = format!(
        "[ledger]\nurl = \"{}\"\nflush_every = \"50ms\"\nspool = {:?}\n",
        pg.url(),
        spool.display().to_string()
    );
    let upstream = simulator().await;
    let (mut p, url, log, _dir) = start(&sections, &upstream.base_url());
    pg.stop();
    for _ in 0..5 {
        assert_eq!(chat(&url).await, 200);
    }
    lines_with(&log, "ledger writes fail", 1).await;
    let pid = p.0.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    until_within(
        "the exit after SIGTERM",
        Duration::from_secs(20),
        async || p.0.try_wait().unwrap().is_some(),
    )
    .await;
    let kept = lines_with(&log, "kept in the spool", 1).await;
    assert!(kept[0].contains("endings=5"), "{kept:?}");
    let spooled = std::fs::read_to_string(&spool).unwrap();
    assert_eq!(spooled.lines().count(), 5);

    pg.restart();
    let (_p2, _url2, log2, _dir2) = start(&sections, &upstream.base_url());
    lines_with(&log2, "endings kept at the last shutdown are written", 1).await;
    let pending = tollgate_ledger::spool::replaying(&spool);
    until("the spool written to the ledger", async || {
        !pending.exists() && !spool.exists()
    })
    .await;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "spend",
            "--ledger",
            &pg.url(),
            "--from",
            "2000-01-01",
            "--to",
            "2100-01-01",
            "--format",
            "json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[0]["requests"], 5, "{rows}");
}

/// A store that forgets, with a ledger: the loss and the rebuild of its books each leave a line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_from_the_ledger_is_logged() {
    let redis = RedisServer::start();
    let pg = PgServer::start();
    let sections = format!(
        "[store]\nurl = \"{}\"\nprefix = \"rebuild\"\ncall_timeout = \"1s\"\n\
         [metrics]\nlisten = \"127.0.0.1:0\"\n[ledger]\nurl = \"{}\"\nflush_every = \"50ms\"\n",
        redis.url(),
        pg.url()
    );
    let upstream = simulator().await;
    let (_p, urls, log, _dir) = start_with(&sections, &upstream.base_url(), &["metrics"]);
    let url = &urls[0];
    assert_eq!(chat(url).await, 200);
    // The ending is in the ledger before the store forgets.
    poll(Duration::from_secs(5), async || {
        let m = get(&format!("{}/metrics", urls[1])).await;
        let written = m
            .lines()
            .find_map(|l| l.strip_prefix("tollgate_ledger_written_total "))
            .is_some_and(|v| v.trim() != "0");
        if written {
            Ok(())
        } else {
            Err(format!("the ending is not in the ledger:\n{m}"))
        }
    })
    .await;
    let flushed = redis.cli().args(["flushall"]).output().unwrap();
    assert!(flushed.status.success());
    until("served again", async || chat(url).await == 200).await;
    let lost = lines_with(&log, "the store has lost its state", 1).await;
    assert_eq!(lost.len(), 1, "{lost:?}");
    let rebuilt = lines_with(&log, "the store's books were rebuilt", 1).await;
    assert!(rebuilt[0].contains("scopes=1"), "{rebuilt:?}");
}

/// A TLS fault with Redis (here `rediss://` to a server that speaks no TLS) is logged with its
/// cause at start, not as a question about Redis's settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_fault_with_redis_is_logged_with_its_cause() {
    let redis = RedisServer::start_tcp_with(&[]);
    let sections = format!(
        "[store]\nurl = \"rediss://127.0.0.1:{}\"\nprefix = \"tls\"\ncall_timeout = \"500ms\"\n",
        redis.port()
    );
    let upstream = simulator().await;
    let (_p, url, log, _dir) = start(&sections, &upstream.base_url());
    let found = lines_with(&log, "Redis cannot be reached", 1).await;
    assert!(found[0].contains("WARN"), "{found:?}");
    assert!(!found[0].contains("CONFIG is not allowed"), "{found:?}");
    assert_eq!(chat(&url).await, 503);
    let down = lines_with(&log, "the store does not answer", 1).await;
    assert!(down[0].contains("cause="), "{down:?}");
}

/// An alert that no attempt delivers is logged with its cause (and without the webhook's URL,
/// which may hold its secret).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undelivered_alert_is_logged_with_its_cause() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hook = format!("http://{}/secret-token-path", closed.local_addr().unwrap());
    drop(closed);
    let tokens = tempfile::tempdir().unwrap();
    let token_file = tokens.path().join("token");
    std::fs::write(&token_file, "logs-admin-token-0123456789").unwrap();
    let sections = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = {:?}\n\
         [alerts]\nattempts = 1\n[[alerts.webhooks]]\nurl = \"{hook}\"\n",
        token_file.display().to_string()
    );
    let upstream = simulator().await;
    let (_p, urls, log, _dir) = start_with(&sections, &upstream.base_url(), &["admin"]);
    let req = hyper::Request::post(format!("{}/admin/kill", urls[1]))
        .header("authorization", "Bearer logs-admin-token-0123456789")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            r#"{"target": "tenant:acme", "reason": "trying alerts"}"#,
        )))
        .unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    assert_eq!(client.request(req).await.unwrap().status(), 200);
    let found = lines_with(&log, "an alert could not be delivered", 1).await;
    assert!(
        found[0].contains("ERROR") && found[0].contains("kill_switch_set"),
        "{found:?}"
    );
    assert!(
        found[0].to_lowercase().contains("connection refused"),
        "{found:?}"
    );
    assert!(!found[0].contains("secret-token-path"), "{found:?}");
}
