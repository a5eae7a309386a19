//! Priority classes at the gateway, on paused time: capacity kept for a class, and a queue that
//! serves tenants by their classes' weights rather than by who sent the most. The gateway is on
//! a memory store whose clock follows tokio's, requests go through the router, and the
//! simulator answers each request after one second.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use http::Request;
use http_body_util::BodyExt;
use tokio::time::Instant;
use tollgate_core::{MemoryStore, SharedClock};
use tollgate_gateway::Gateway;
use tollgate_gateway::config::GatewayConfig;
use tollgate_gateway::store::AnyStore;
use tollgate_testkit::T0;
use tollgate_testkit::paused::TokioClock;
use tollgate_testkit::sim::{Sim, SimConfig};
use tower::ServiceExt;

/// The keys: (secret, tenant, class line of its `[[keys]]` entry).
const KEYS: [(&str, &str, &str); 3] = [
    ("sk-flood", "flood", ""),
    ("sk-calm", "calm", ""),
    ("sk-vip", "flood", "class = \"critical\"\n"),
];

/// One slot for the model, requests waiting up to a minute, 16 per key.
const ONE_SLOT: &str = "[queue]\nmax_wait = \"60s\"\nper_key = 16\nglobal = 64\n\
    [policy.classes.critical]\nweight = 3\n\
    [[policy.scopes]]\nkey = \"model\"\nconcurrency = { limit = 1, lease_ttl = \"5m\" }\n";

async fn app(sections: &str) -> (Router, Sim) {
    let sim = SimConfig {
        latency: Duration::from_secs(1),
        ..SimConfig::default()
    };
    let sim = Sim::start(sim).await.unwrap();
    let mut text = format!(
        "{sections}\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n",
        sim.base_url()
    );
    for (secret, tenant, class) in KEYS {
        text.push_str(&format!(
            "[[keys]]\nhash = \"{}\"\ntenant = \"{tenant}\"\n{class}",
            tollgate_gateway::hash_key(secret)
        ));
    }
    let config = GatewayConfig::from_toml(&text).unwrap_or_else(|e| panic!("{e}"));
    let clock: SharedClock = Arc::new(TokioClock::at(T0));
    let store = AnyStore::Memory(Arc::new(MemoryStore::with_clock(clock)));
    (
        tollgate_gateway::router(Arc::new(Gateway::new(config, store))),
        sim,
    )
}

/// Status and error code of one chat request with `key`.
async fn chat(app: &Router, key: &str) -> (u16, String) {
    let body = serde_json::json!({
        "model": "gpt-4o",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
    });
    let mut req = Request::post("/v1/chat/completions")
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    req.extensions_mut()
        .insert(ConnectInfo("127.0.0.1:5000".parse::<SocketAddr>().unwrap()));
    let r = app.clone().oneshot(req).await.unwrap();
    let status = r.status().as_u16();
    let body = r.into_body().collect().await.unwrap().to_bytes();
    let code = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
        .unwrap_or_default();
    (status, code)
}

/// `n` requests with `key`, sent 10 ms apart; each task gives its key and when it was answered.
async fn flood(
    app: &Router,
    key: &'static str,
    n: usize,
) -> Vec<tokio::task::JoinHandle<(&'static str, Instant, u16)>> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            let (status, _) = chat(&app, key).await;
            (key, Instant::now(), status)
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tasks
}

/// A tenant that floods the queue cannot push another tenant's wait beyond its share: with
/// equal weights, the calm tenant's one request is served at most one flooding request after
/// the one in flight, however many the flood keeps sending (a request every 50 ms, each new
/// one as eager as the last).
#[tokio::test(start_paused = true)]
async fn a_flooding_tenant_cannot_push_another_past_its_share() {
    let (app, _sim) = app(ONE_SLOT).await;
    let flooding = tokio::spawn({
        let app = app.clone();
        async move {
            let mut tasks = Vec::new();
            for _ in 0..5 {
                tasks.extend(flood(&app, "sk-flood", 10).await);
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            tasks
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = Instant::now();
    let (status, code) = chat(&app, "sk-calm").await;
    let waited = asked.elapsed();
    assert_eq!(status, 200, "{code}");
    // The slot in use frees within a second, one flooding request may be served before it (a
    // second), and its own answer takes a second. Served first come, it would wait for the
    // nine flooding requests before it.
    assert!(waited <= Duration::from_secs(3), "{waited:?}");
    for t in flooding.await.unwrap() {
        let status = t.await.unwrap().2;
        assert!(status == 200 || status == 429, "{status}");
    }
}

/// The queue shares by weight: with both tenants' requests waiting, a class of weight 3 is
/// served three times for each request of weight 1.
#[tokio::test(start_paused = true)]
async fn the_queue_serves_by_weight() {
    let (app, _sim) = app(ONE_SLOT).await;
    let mut tasks = flood(&app, "sk-calm", 9).await;
    tasks.extend(flood(&app, "sk-vip", 8).await);
    let mut served = Vec::new();
    for t in tasks {
        let (key, at, status) = t.await.unwrap();
        assert_eq!(status, 200);
        served.push((at, key));
    }
    served.sort();
    // The first is the one that found the slot free; the next eight were all waiting.
    let vip = served[1..9].iter().filter(|(_, k)| *k == "sk-vip").count();
    assert!((5..=7).contains(&vip), "{served:?}");
}

/// Capacity kept for a class: a key of a lower class is refused at its share with
/// `capacity_reserved`, while a key of the class is admitted into the reserve.
#[tokio::test(start_paused = true)]
async fn a_reserve_admits_only_its_class() {
    let sections = "[policy.classes.critical]\nweight = 3\n\
        [[policy.scopes]]\nkey = \"model\"\nconcurrency = { limit = 2 }\n\
        reserve = { critical = \"50%\" }\n";
    let (app, _sim) = app(sections).await;
    let first = tokio::spawn({
        let app = app.clone();
        async move { chat(&app, "sk-flood").await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let refused = chat(&app, "sk-calm").await;
    assert_eq!(refused, (429, "capacity_reserved".to_owned()));
    assert_eq!(chat(&app, "sk-vip").await.0, 200);
    assert_eq!(first.await.unwrap().0, 200);
    // A key holder sees its class and the slots it may hold.
    for (key, class, limit, kept) in [("sk-calm", "standard", 1, 1), ("sk-vip", "critical", 2, 0)] {
        let v = limits(&app, key).await;
        assert_eq!(v["class"], class, "{v}");
        let row = v["limits"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["control"] == "concurrency"))
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            (&row["limit"], &row["kept_for_higher_classes"]),
            (&limit.into(), &kept.into()),
            "{v}"
        );
    }
}

/// `GET /v1/limits?model=gpt-4o` with `key`.
async fn limits(app: &Router, key: &str) -> serde_json::Value {
    let mut req = Request::get("/v1/limits?model=gpt-4o")
        .header("authorization", format!("Bearer {key}"))
        .body(Body::empty())
        .unwrap();
    req.extensions_mut()
        .insert(ConnectInfo("127.0.0.1:5000".parse::<SocketAddr>().unwrap()));
    let r = app.clone().oneshot(req).await.unwrap();
    let body = r.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}
