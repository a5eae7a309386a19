//! The spend ledger and a store that forgets: two instances on one Redis write every ending to a
//! PostgreSQL of the test's own; the Redis is flushed in the middle of the run; the books are
//! rebuilt from the ledger before any budget check resumes, so no spent budget reopens and the
//! kill switches come back.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::time::Duration;

use serde_json::json;
use tollgate_core::{Period, Store};
use tollgate_gateway::{Gateway, GatewayConfig};
use tollgate_ledger::{Ledger, Settings};
use tollgate_testkit::pg_server::PgServer;
use tollgate_testkit::sim::SimConfig;

const TOKEN: &str = "books-admin-token-0123456789";
const DAY: u64 = 86_400_000;
const SCOPE: &str = "tenant|tenant:acme";

/// An instance of `text`, with an admin listener: (address, admin address).
async fn instance(text: &str) -> (std::net::SocketAddr, String) {
    // Bound here and handed over: a port released and bound again may be taken in between.
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_addr = admin.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap().keep();
    std::fs::write(dir.join("token"), TOKEN).unwrap();
    let text = format!(
        "[admin]\nlisten = \"{admin_addr}\"\ntoken_file = \"{}\"\n{text}",
        dir.join("token").display()
    );
    let mut config = GatewayConfig::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    config.upstreams[0].api_key = Some(common::SIM_KEY.into());
    let store = tollgate_gateway::start_store(&config).await.unwrap();
    let books = tollgate_gateway::open_books(&config).await.unwrap();
    assert!(books.is_some());
    let records = config.records.clone();
    let mut gw = Gateway::new(config, store).with_books(books);
    if let Some(path) = records {
        gw = gw.with_records(tollgate_gateway::records::RecordSink::open(&path).unwrap());
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tollgate_gateway::serve_bound(
        gw,
        listener,
        tollgate_gateway::Bound {
            admin: Some(admin),
            metrics: None,
        },
        std::future::pending(),
    ));
    (addr, admin_addr.to_string())
}

async fn ask(addr: std::net::SocketAddr, key: &str) -> (u16, String) {
    let body = json!({"model": "gpt-4o", "max_tokens": 20,
        "messages": [{"role": "user", "content": "Hello there, how are you?"}]});
    let r = common::post(
        addr,
        "/v1/chat/completions",
        &[("authorization", format!("Bearer {key}"))],
        body.to_string(),
    )
    .await;
    let code = r.code();
    (r.status, code)
}

async fn usage_at(admin: &str, at: &str) -> serde_json::Value {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let req = hyper::Request::builder()
        .uri(format!(
            "http://{admin}/admin/usage?scope=tenant%7Ctenant%3Aacme&at={at}"
        ))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(http_body_util::Empty::new())
        .unwrap();
    let r = client.request(req).await.unwrap();
    let status = r.status();
    let body = http_body_util::BodyExt::collect(r.into_body())
        .await
        .unwrap()
        .to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 200, "{v}");
    v
}

async fn kill(admin: &str, target: &str) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let body = json!({"target": target, "reason": "held in the ledger"}).to_string();
    let req = hyper::Request::builder()
        .method("POST")
        .uri(format!("http://{admin}/admin/kill"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    assert_eq!(client.request(req).await.unwrap().status(), 200);
}

use tollgate_testkit::wait::until;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_redis_gets_its_books_back_from_the_ledger() {
    let pg = PgServer::start();
    let (sim, redis, store_text) =
        common::upstream_and_store(true, common::SIM_KEY, SimConfig::default(), "books").await;
    let redis = redis.unwrap();
    let keys: String = [
        ("sk-acme", "acme"),
        ("sk-beta", "beta"),
        ("sk-gamma", "gamma"),
    ]
    .iter()
    .map(|(k, t)| {
        format!(
            "[[keys]]\nhash = \"{}\"\ntenant = \"{t}\"\n",
            tollgate_gateway::hash_key(k)
        )
    })
    .collect();
    let text = format!(
        "{store_text}[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n{keys}\
         [policy]\n[[policy.scopes]]\nname = \"tenant\"\nkey = \"tenant\"\n\
         budget = {{ tokens = 300, period = \"day\" }}\n",
        pg.url(),
        sim.base_url(),
    );
    let (a, admin_a) = instance(&text).await;
    let (b, _) = instance(&text).await;
    let ledger = Ledger::open(Settings::new(pg.url())).await.unwrap();
    let config = GatewayConfig::from_toml(&store_text).unwrap();
    let store = tollgate_gateway::start_store(&config).await.unwrap();

    // acme spends its budget on both instances; gamma is switched off.
    let mut served = 0;
    for i in 0..20 {
        let (status, code) = ask(if i % 2 == 0 { a } else { b }, "sk-acme").await;
        match status {
            200 => served += 1,
            429 => {
                assert_eq!(code, "budget_limit");
                break;
            }
            other => panic!("{other} {code}"),
        }
    }
    assert!(served >= 3, "served {served}");
    kill(&admin_a, "tenant:gamma").await;
    assert_eq!(ask(b, "sk-gamma").await, (503, "kill_switch".into()));
    let before = store.usage(SCOPE, Some(Period::Fixed(DAY))).await.unwrap();
    assert_eq!(before.reserved, 0);
    until("every ending in the ledger", async || {
        ledger.counts().await.unwrap().0 == served
    })
    .await;
    until("the kill switch in the ledger", async || {
        !ledger.kills().await.unwrap().is_empty()
    })
    .await;

    // The store forgets everything.
    let out = redis.cli().args(["flushall"]).output().unwrap();
    assert!(out.status.success());

    // Never served again: refused while the books are rebuilt, then by the budget.
    let mut seen = Vec::new();
    until("the budget refusing again", async || {
        let r = ask(if seen.len() % 2 == 0 { a } else { b }, "sk-acme").await;
        assert_ne!(r.0, 200, "a spent budget reopened after {seen:?}");
        seen.push(r.clone());
        r == (429, "budget_limit".into())
    })
    .await;
    assert!(
        seen.iter()
            .all(|r| r.1 == "store_state_lost" || r.1 == "budget_limit"),
        "{seen:?}"
    );
    assert_eq!(
        seen[0],
        (503, "store_state_lost".into()),
        "the loss was seen first"
    );
    assert_eq!(ask(a, "sk-gamma").await, (503, "kill_switch".into()));
    // Budget checks resumed for everyone else.
    assert_eq!(ask(b, "sk-beta").await.0, 200);

    // The store's totals are the ledger's, and what they were before the loss.
    let after = store.usage(SCOPE, Some(Period::Fixed(DAY))).await.unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let totals = ledger.current_totals(now).await.unwrap();
    let in_ledger = totals.iter().find(|t| t.scope == SCOPE).unwrap().amount;
    assert_eq!(after.settled, before.settled);
    assert_eq!(after.settled, u64::try_from(in_ledger).unwrap());
    // The admin API answers a period from the ledger: today's is the same, yesterday's empty.
    let day = |ms: i64| {
        humantime::format_rfc3339(std::time::UNIX_EPOCH + Duration::from_millis(ms as u64))
            .to_string()
    };
    let today = usage_at(&admin_a, &day(now)).await;
    assert_eq!(
        (today["source"].as_str(), today["settled"].as_i64()),
        (Some("ledger"), Some(in_ledger))
    );
    let yesterday = usage_at(&admin_a, &day(now - DAY as i64)[..10]).await;
    assert_eq!(yesterday["settled"], 0);

    // A request no instance ends (as when its instance dies): the store expires it, charging
    // its reservation, and the expiry reaches the ledger.
    let cfg = GatewayConfig::from_toml(&text).unwrap();
    let facts = tollgate_core::RequestFacts {
        request_id: "orphan-1".into(),
        identity: tollgate_core::Identity::default().with(tollgate_core::Dimension::Tenant, "beta"),
        input_tokens: 10,
        max_output_tokens: Some(20),
        ..Default::default()
    };
    let mut p = tollgate_core::plan(&cfg.policy, &facts).unwrap();
    p.ttl_ms = 50;
    assert!(matches!(
        store.admit(&p).await.unwrap(),
        tollgate_core::Decision::Admit(_)
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Any call sweeps.
    assert_eq!(ask(a, "sk-beta").await.0, 200);
    let beta = "tenant|tenant:beta";
    until("the expiry in the ledger", async || {
        let held = store.usage(beta, Some(Period::Fixed(DAY))).await.unwrap();
        let totals = ledger.current_totals(now).await.unwrap();
        let kept = totals
            .iter()
            .find(|t| t.scope == beta)
            .map_or(0, |t| t.amount);
        held.reserved == 0 && u64::try_from(kept).unwrap() == held.settled
    })
    .await;
    let spent = ledger
        .spend(tollgate_ledger::By::Tenant, now - 60_000, now + 60_000)
        .await
        .unwrap();
    let untagged = spent.iter().find(|r| r.group == "-").map(|r| r.requests);
    assert_eq!(
        untagged,
        Some(1),
        "the expiry is an ending without a tenant: {spent:?}"
    );
}

/// With decision records and a ledger both on, the ledger's end user is the record's digest of
/// the `user` the client sent (made once for both), never the value itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_and_the_records_name_one_user_digest() {
    let pg = PgServer::start();
    let (sim, _, _) =
        common::upstream_and_store(false, common::SIM_KEY, SimConfig::default(), "").await;
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records.jsonl");
    let text = format!(
        "[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n[records]\npath = \"{}\"\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\nallow_user = true\n\
         [policy]\n[[policy.scopes]]\nkey = \"user\"\nbudget = {{ tokens = 3000, period = \"day\" }}\n",
        pg.url(),
        records.display(),
        sim.base_url(),
        tollgate_gateway::hash_key("sk-acme"),
    );
    let (addr, _) = instance(&text).await;
    let body = json!({"model": "gpt-4o", "max_tokens": 20, "user": "alice@example.com",
        "messages": [{"role": "user", "content": "Hello there"}]});
    let r = common::post(
        addr,
        "/v1/chat/completions",
        &[("authorization", "Bearer sk-acme".to_owned())],
        body.to_string(),
    )
    .await;
    assert_eq!(r.status, 200);
    let ledger = Ledger::open(Settings::new(pg.url())).await.unwrap();
    until("the ending in the ledger", async || {
        ledger.counts().await.unwrap().0 == 1
    })
    .await;
    let rows = ledger
        .spend(tollgate_ledger::By::User, 0, i64::MAX)
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    let mut recorded = None;
    until("the record written", async || {
        recorded = std::fs::read_to_string(&records)
            .ok()
            .and_then(|t| t.lines().next().map(str::to_owned));
        recorded.is_some()
    })
    .await;
    let record: serde_json::Value = serde_json::from_str(&recorded.unwrap()).unwrap();
    let user = record["facts"]["user"]
        .as_str()
        .unwrap_or_else(|| panic!("{record}"));
    assert_ne!(user, "alice@example.com");
    assert!(!user.is_empty());
    assert_eq!(rows[0].group, user);
}
