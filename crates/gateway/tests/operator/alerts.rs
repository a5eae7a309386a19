//! Alerts to webhooks: a budget's thresholds and its exhaustion fire once per scope and period
//! across two instances sharing a Redis (one instance on the memory store), under concurrent
//! requests on both; kill switches set and lifted through the admin API are told; a receiver
//! that fails a delivery gets it again; the Slack body is one line of text.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;
use tollgate_core::Keeper as _;

use axum::extract::{Path, State};
use axum::routing::post;
use serde_json::{Value, json};
use tollgate_gateway::{Gateway, GatewayConfig};
use tollgate_testkit::sim::SimConfig;

const KEY: &str = "sk-alerts-acme";
const TOKEN: &str = "alerts-admin-token-0123456789";

/// What the receiver got, by path; it answers 500 to the first post of each path.
#[derive(Default)]
struct Received {
    posts: Mutex<Vec<(String, Value)>>,
    failed: Mutex<Vec<String>>,
}

async fn receive(
    State(r): State<Arc<Received>>,
    Path(path): Path<String>,
    body: String,
) -> axum::http::StatusCode {
    let mut failed = r.failed.lock().unwrap();
    if !failed.contains(&path) {
        failed.push(path);
        return axum::http::StatusCode::INTERNAL_SERVER_ERROR;
    }
    r.posts
        .lock()
        .unwrap()
        .push((path, serde_json::from_str(&body).unwrap()));
    axum::http::StatusCode::NO_CONTENT
}

async fn receiver() -> (String, Arc<Received>) {
    let r = Arc::new(Received::default());
    let app = axum::Router::new()
        .route("/{path}", post(receive))
        .with_state(r.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    (url, r)
}

/// A gateway instance of `text` with an admin listener: (gateway URL, admin URL).
async fn instance(text: &str) -> (String, String) {
    // Bound here and handed over: a port released and bound again may be taken in between.
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_addr = admin.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap().keep();
    let token = dir.join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let text = format!(
        "[admin]\nlisten = \"{admin_addr}\"\ntoken_file = \"{}\"\n{text}",
        token.display()
    );
    let mut config = GatewayConfig::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    config.upstreams[0].api_key = Some(common::SIM_KEY.into());
    let store = tollgate_gateway::start_store(&config).await.unwrap();
    // A test's Redis is new: initialised as an operator would.
    store.initialise().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(tollgate_gateway::serve_bound(
        Gateway::new(config, store),
        listener,
        tollgate_gateway::Bound {
            admin: Some(admin),
            metrics: None,
        },
        std::future::pending(),
    ));
    (url, admin_addr.to_string())
}

async fn chat(url: &str) -> u16 {
    let body = json!({"model": "gpt-4o", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}]});
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let headers = [("authorization", format!("Bearer {KEY}"))];
    common::post(addr, "/v1/chat/completions", &headers, body.to_string())
        .await
        .status
}

async fn admin(addr: &str, method: &str, path: &str, body: &str) -> u16 {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_owned(),
        )))
        .unwrap();
    client.request(req).await.unwrap().status().as_u16()
}

/// The events posted to `path`, once `n` have arrived (10 s at most), and a little after.
async fn events(r: &Received, path: &str, n: usize) -> Vec<Value> {
    let of_path = || -> Vec<Value> {
        r.posts
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == path)
            .map(|(_, v)| v.clone())
            .collect()
    };
    tollgate_testkit::wait::until(&format!("{n} events on {path}"), async || {
        of_path().len() >= n
    })
    .await;
    // Room for a duplicate to show.
    tokio::time::sleep(Duration::from_millis(700)).await;
    of_path()
}

async fn thresholds_and_exhaustion_fire_once(redis: bool) {
    let (hooks, received) = receiver().await;
    // The Redis server lives as long as this binding.
    let (sim, _redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, SimConfig::default(), "alerts").await;
    let text = format!(
        "{store}[alerts]\nattempts = 4\n\
         [[alerts.webhooks]]\nurl = \"{hooks}/json\"\n\
         [[alerts.webhooks]]\nurl = \"{hooks}/slack\"\nformat = \"slack\"\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
         [policy]\nversion = \"alerting\"\n[[policy.scopes]]\nname = \"tenant\"\nkey = \"tenant\"\n\
         budget = {{ tokens = 200, period = \"day\", alert_at = [25, 50, 75] }}\n",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
    );
    let (a, admin_a) = instance(&text).await;
    // Two instances on one Redis; one on the memory store.
    let b = if redis {
        instance(&text).await.0
    } else {
        a.clone()
    };
    // Eight at once, four on each: their reservations cross the three thresholds together.
    let urls: Vec<&str> = (0..8)
        .map(|i| if i % 2 == 0 { a.as_str() } else { b.as_str() })
        .collect();
    let first = futures_util::future::join_all(urls.iter().map(|u| chat(u))).await;
    assert!(first.iter().all(|s| *s == 200), "{first:?}");
    // Then one after another, on both, until well past the budget.
    let mut then = Vec::new();
    for i in 0..8 {
        then.push(chat(if i % 2 == 0 { &a } else { &b }).await);
    }
    assert!(then.iter().filter(|s| **s == 429).count() >= 4, "{then:?}");
    assert_eq!(
        admin(
            &admin_a,
            "POST",
            "/admin/kill",
            r#"{"target": "tenant:acme", "reason": "runaway"}"#
        )
        .await,
        200
    );
    assert_eq!(
        admin(&admin_a, "DELETE", "/admin/kill/tenant:acme", "").await,
        200
    );
    // Lifting what is not switched off is a 404, and no alert: a sentinel kill switch after it
    // shows that the events that follow came, and no second lift among them.
    assert_eq!(
        admin(&admin_a, "DELETE", "/admin/kill/tenant:acme", "").await,
        404
    );
    assert_eq!(
        admin(
            &admin_a,
            "POST",
            "/admin/kill",
            r#"{"target": "tenant:sentinel", "reason": "last"}"#
        )
        .await,
        200
    );

    let got = events(&received, "json", 7).await;
    let mut kinds: Vec<String> = got
        .iter()
        .map(|e| match e["event"].as_str().unwrap() {
            "budget_threshold" => format!("threshold {}", e["percent"]),
            other => other.to_owned(),
        })
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "budget_exhausted",
            "kill_switch_lifted",
            "kill_switch_set",
            "kill_switch_set",
            "threshold 25",
            "threshold 50",
            "threshold 75"
        ],
        "exactly one event per threshold per period: {got:#?}"
    );
    let t = got.iter().find(|e| e["percent"] == 75).unwrap();
    assert_eq!(t["scope"], "tenant|tenant:acme");
    assert_eq!(
        (t["limit"].as_u64(), t["unit"].as_str()),
        (Some(200), Some("tokens"))
    );
    assert!(t["committed"].as_u64().unwrap() >= 150);
    assert_eq!(t["policy_version"], "alerting");
    let slack = events(&received, "slack", 7).await;
    assert_eq!(slack.len(), 7, "{slack:#?}");
    assert!(slack.iter().all(|e| e.as_object().unwrap().len() == 1));
    let texts: Vec<&str> = slack.iter().map(|e| e["text"].as_str().unwrap()).collect();
    assert!(
        texts.contains(&"Tollgate: kill switch set on tenant:acme: runaway"),
        "{texts:?}"
    );
    assert!(
        texts
            .iter()
            .any(|t| t.starts_with("Tollgate: budget of tenant|tenant:acme reached 75% ("))
    );
    // Each path failed once and was retried.
    assert_eq!(received.failed.lock().unwrap().len(), 2);
}

mod both {
    on_both_stores!(thresholds_and_exhaustion_fire_once);
}
