//! The gateway end to end, over real sockets, against the upstream simulator: what an operator sees and bounds: slow clients, decision records, metrics, the dashboard.
//! Tests that involve the store run once on the memory store and once on Redis (its own
//! `redis-server`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate_core::{Period, Store};
use tollgate_testkit::sim::SimConfig;

use common::e2e::{BASIC, KEY, chat, env, send};

/// Slow and abusive clients: headers that never finish, a body that never arrives, and more
/// connections than allowed. Store-independent, so run on memory only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_and_connections_are_bounded() {
    let extra =
        "[server]\nheader_timeout = \"300ms\"\nbody_timeout = \"300ms\"\nmax_connections = 2\n";
    let env = env(false, BASIC, extra, SimConfig::default()).await;
    // Headers that never finish: the connection is closed.
    let mut s = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut buf))
        .await
        .expect("closed in time");
    assert!(
        n.is_err()
            || String::from_utf8_lossy(&buf).is_empty()
            || String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 408")
    );
    drop(s);
    // A body that never arrives: 408 in the API's format.
    let mut s = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-length: 100\r\n\r\n{{\"model\""
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
        .await
        .expect("answered in time")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("body_timeout"));
    drop(s);
    common::connections_become(&env, 0.0).await;
    // Two idle connections fill the limit; a third is closed at once.
    let a = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    let b = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    common::connections_become(&env, 2.0).await;
    let mut c = tokio::net::TcpStream::connect(env.addr).await.unwrap();
    let _ = c
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(2), c.read_to_end(&mut buf))
        .await
        .expect("closed at once");
    assert!(
        r.is_err() || buf.is_empty(),
        "the third connection was served: {}",
        String::from_utf8_lossy(&buf)
    );
    drop((a, b));
    // Once they are gone, service resumes.
    common::connections_become(&env, 0.0).await;
    assert_eq!(
        send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5))
            .await
            .status,
        200
    );
}

/// Decision records: one line per request, with ids and numbers; the prompt and the completion
/// never appear in any of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decision_records_never_contain_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("records.jsonl");
    let extra = format!("[records]\npath = \"{}\"\n", path.display());
    let policy = r#"
[[scopes]]
key = "tenant"
requests = { limit = 3, window = "1m" }
budget = { tokens = 100000, period = "day" }
"#;
    let env = env(false, policy, &extra, SimConfig::default()).await;
    let canary = "CANARY-4f1d9b-do-not-log";
    let r = send(
        &env,
        "/v1/chat/completions",
        Some(KEY),
        chat(&format!("secret {canary}"), 5),
    )
    .await;
    assert_eq!(r.status, 200);
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": 3, "stream": true,
        "messages": [{"role": "user", "content": canary}]}))
    .unwrap();
    assert_eq!(
        send(&env, "/v1/chat/completions", Some(KEY), body)
            .await
            .status,
        200
    );
    assert_eq!(
        send(&env, "/v1/chat/completions", Some(KEY), chat(canary, 5))
            .await
            .status,
        200
    );
    let denied = send(&env, "/v1/chat/completions", Some(KEY), chat(canary, 5)).await;
    assert_eq!(denied.status, 429);
    // The writer is asynchronous: wait for the four lines.
    let text = tollgate_testkit::wait::poll(Duration::from_secs(3), async || {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        match text.lines().count() {
            4.. => Ok(text),
            n => Err(format!("{n} of the four records:\n{text}")),
        }
    })
    .await;
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(
        !text.contains("CANARY"),
        "a record leaked the prompt: {text}"
    );
    assert!(!text.contains("tok tok"), "a record leaked the completion");
    let settled: Vec<&Value> = lines.iter().filter(|l| l["ending"] == "settled").collect();
    assert_eq!(settled.len(), 3);
    for l in &settled {
        assert_eq!(l["decision"], "admit");
        assert_eq!(l["upstream_status"], 200);
        assert!(l["settled"][0].as_u64().unwrap() > 0);
        assert!(l["request_id"].as_str().unwrap().starts_with("tg-"));
    }
    let deny = lines.iter().find(|l| l["decision"] == "deny").unwrap();
    assert_eq!(
        (deny["reason"].as_str(), deny["scope"].as_str()),
        (Some("request_rate_limit"), Some("tenant:acme"))
    );
    assert_eq!(deny["policy_version"], "unversioned");
}

/// `/metrics` in Prometheus format: decisions by reason and rule, in-flight and unsettled
/// gauges, settled tokens, store and upstream latency histograms, and the remaining budget of a
/// global scope.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_report_decisions_latency_and_budget() {
    // Rule names unique to this test: the recorder is process-wide, and under `cargo test`
    // other tests in the process record too.
    let policy = r#"
[[scopes]]
name = "metrics-tenant"
key = "tenant"
requests = { limit = 2, window = "1m" }
[[scopes]]
name = "metrics-everyone"
key = "global"
budget = { tokens = 100000, period = "day" }
"#;
    let env = env(
        false,
        policy,
        "[metrics]\nrefresh = \"1s\"\n",
        SimConfig::default(),
    )
    .await;
    for _ in 0..3 {
        send(&env, "/v1/chat/completions", Some(KEY), chat("hi", 5)).await;
    }
    // Budget figures are read from the store once a refresh: the scrape is read again until
    // the global budget's gauge shows what the store holds (10 s at most).
    let u = env
        .store
        .usage("metrics-everyone|global", Some(Period::Fixed(86_400_000)))
        .await
        .unwrap();
    assert!(u.settled > 0);
    let gauge = format!(
        "tollgate_budget_remaining{{scope=\"metrics-everyone|global\",unit=\"tokens\"}} {}",
        100000 - u.settled - u.reserved
    );
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let text = tollgate_testkit::wait::poll(Duration::from_secs(10), async || {
        let r = client
            .request(
                Request::get(format!("http://{}/metrics", env.metrics))
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let text = String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes())
            .into_owned();
        match text.lines().any(|l| l == gauge) {
            true => Ok(text),
            false => Err(format!("no {gauge}:\n{text}")),
        }
    })
    .await;
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
            .to_owned()
    };
    let value = |prefix: &str| {
        line(prefix)
            .rsplit(' ')
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    assert_eq!(
        value("tollgate_decisions_total{decision=\"request_rate_limit\",rule=\"metrics-tenant\"}"),
        1.0
    );
    assert!(value("tollgate_decisions_total{decision=\"admit\"") >= 2.0);
    assert!(value("tollgate_settled_tokens_total{kind=\"output\"}") >= 10.0);
    assert!(value("tollgate_upstream_responses_total{status=\"2xx\"}") >= 2.0);
    assert!(line("tollgate_store_call_seconds_bucket{op=\"admit\",le=\"0.001\"}").len() > 10);
    assert!(line("tollgate_upstream_seconds_bucket").contains("le="));
    line("tollgate_in_flight");
    line("tollgate_reserved_unsettled_tokens");
    line("tollgate_oldest_unsettled_seconds");
}

/// Every metric the Grafana dashboard (`deploy/grafana-dashboard.json`) queries exists in the
/// code, so the dashboard cannot drift into showing nothing.
#[test]
fn the_dashboard_only_uses_metrics_the_gateway_exports() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dash = std::fs::read_to_string(root.join("deploy/grafana-dashboard.json")).unwrap();
    let code = std::fs::read_to_string(root.join("crates/gateway/src/telemetry.rs")).unwrap();
    let mut names: Vec<&str> = dash
        .match_indices("tollgate_")
        .map(|(i, _)| {
            let rest = &dash[i..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let name = &rest[..end];
            name.strip_suffix("_bucket").unwrap_or(name)
        })
        .collect();
    names.sort();
    names.dedup();
    assert!(names.len() >= 10, "{names:?}");
    for n in names {
        assert!(
            code.contains(&format!("\"{n}\"")),
            "the dashboard uses {n}, which the gateway does not export"
        );
    }
}
