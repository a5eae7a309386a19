//! A store loss that an instance could hide: each test is an attack on the books through a store
//! that forgets, over real sockets, with a Redis (and, where the ledger is the evidence, a
//! PostgreSQL) of the test's own. An instance that finds an empty store never writes a fresh
//! marker over a loss: it decides from the ledger's rows or waits for an operator; running
//! instances notice a loss while idle; a Redis that may evict holds nothing that would reopen.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[macro_use]
mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tollgate_gateway::{Gateway, GatewayConfig};
use tollgate_ledger::{Ledger, Settings};
use tollgate_testkit::pg_server::PgServer;
use tollgate_testkit::redis_server::RedisServer;
use tollgate_testkit::sim::{Sim, SimConfig};

const TOKEN: &str = "store-admin-token-0123456789";
const BUDGET: &str = "[[policy.scopes]]\nname = \"tenant\"\nkey = \"tenant\"\n\
                      budget = { tokens = 300, period = \"day\" }\n";

/// A running instance: its address, its admin address, and what stops it (the drain runs).
struct Instance {
    addr: SocketAddr,
    admin: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Instance {
    /// An instance of `text` (a `[store]`, maybe a `[ledger]`) in front of `sim`, with three
    /// tenants (acme, beta, gamma) and a budget of 300 tokens a day each.
    async fn start(sim: &Sim, text: &str) -> Self {
        Self::start_with(sim, text, BUDGET).await
    }

    /// [`Instance::start`] with the rules `scopes` in place of the budget.
    async fn start_with(sim: &Sim, text: &str, scopes: &str) -> Self {
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin_addr = admin.local_addr().unwrap();
        let dir = tempfile::tempdir().unwrap().keep();
        std::fs::write(dir.join("token"), TOKEN).unwrap();
        let keys: String = ["acme", "beta", "gamma"]
            .iter()
            .map(|t| {
                format!(
                    "[[keys]]\nhash = \"{}\"\ntenant = \"{t}\"\n",
                    tollgate_gateway::hash_key(&format!("sk-{t}"))
                )
            })
            .collect();
        let text = format!(
            "{text}[admin]\nlisten = \"{admin_addr}\"\ntoken_file = \"{}\"\n\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n{keys}\
             [policy]\n{scopes}",
            dir.join("token").display(),
            sim.base_url(),
        );
        let mut config = GatewayConfig::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        config.upstreams[0].api_key = Some(common::SIM_KEY.into());
        let store = tollgate_gateway::start_store(&config).await.unwrap();
        let books = tollgate_gateway::open_books(&config).await.unwrap();
        let gw = Gateway::new(config, store).with_books(books);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(tollgate_gateway::serve_bound(
            gw,
            listener,
            tollgate_gateway::Bound {
                admin: Some(admin),
                metrics: None,
            },
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            addr,
            admin: admin_addr,
            stop: Some(stop),
            served,
        }
    }

    /// Drains and stops, its endings written.
    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(Duration::from_secs(20), &mut self.served)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }

    /// A chat request of tenant `t`: (status, error code).
    async fn ask(&self, t: &str) -> (u16, String) {
        let body = json!({"model": "gpt-4o", "max_tokens": 20,
            "messages": [{"role": "user", "content": "Hello there, how are you?"}]});
        let r = common::post(
            self.addr,
            "/v1/chat/completions",
            &[("authorization", format!("Bearer sk-{t}"))],
            body.to_string(),
        )
        .await;
        let code = r.code();
        (r.status, code)
    }

    /// One admin call: (status, JSON answer).
    async fn admin(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<bytes::Bytes>>();
        let req = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.admin))
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.map(|b| b.to_string()).unwrap_or_default(),
            )))
            .unwrap();
        let r = client.request(req).await.unwrap();
        let status = r.status().as_u16();
        let body = http_body_util::BodyExt::collect(r.into_body())
            .await
            .unwrap()
            .to_bytes();
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    async fn store_state(&self) -> String {
        let (status, v) = self.admin("GET", "/admin/status", None).await;
        assert_eq!(status, 200, "{v}");
        v["store"].as_str().unwrap().to_owned()
    }

    /// acme spends its budget; gamma is switched off in the store.
    async fn spend_and_kill(&self) {
        let mut served = 0;
        loop {
            match self.ask("acme").await {
                (200, _) => served += 1,
                (429, code) if code == "budget_limit" => break,
                other => panic!("{other:?}"),
            }
            assert!(served < 20, "the budget never refused");
        }
        let (status, v) = self
            .admin(
                "POST",
                "/admin/kill",
                Some(json!({"target": "tenant:gamma", "reason": "switched off"})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(self.ask("gamma").await, (503, "kill_switch".into()));
    }
}

fn redis_text(redis: &RedisServer) -> String {
    format!(
        "[store]\nurl = \"{}\"\nprefix = \"hs\"\ncall_timeout = \"2s\"\n",
        redis.url()
    )
}

fn flushall(redis: &RedisServer) {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &redis.port().to_string(), "flushall"])
        .output()
        .unwrap();
    assert!(out.status.success());
}

fn redis_has(redis: &RedisServer, key: &str) -> bool {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &redis.port().to_string(), "exists", key])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "1"
}

/// Waits for the kill switch to reach the ledger at `url`, and answers the ledger.
async fn kill_in_ledger(url: String) -> Ledger {
    let ledger = Ledger::open(Settings::new(url)).await.unwrap();
    until("the kill switch in the ledger", async || {
        !ledger.kills().await.unwrap().is_empty()
    })
    .await;
    ledger
}

/// Polls `f` until it holds, 10 s at most.
async fn until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f().await {
        assert!(Instant::now() < deadline, "{what} within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn sim() -> Sim {
    Sim::start(SimConfig {
        api_key: Some(common::SIM_KEY.into()),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// Without a ledger, an empty store cannot be told from one that forgot while no instance ran:
/// a new instance refuses (503 `store_uninitialised`) instead of writing a fresh marker over
/// the loss, until an operator declares it new with `init-store`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_instance_does_not_hide_a_loss() {
    let (sim, redis) = (sim().await, RedisServer::start());
    let first = Instance::start(&sim, &redis_text(&redis)).await;
    // A new deployment is initialised by its operator, then served.
    assert_eq!(first.ask("acme").await, (503, "store_uninitialised".into()));
    assert_eq!(first.store_state().await, "uninitialised");
    let (status, v) = first.admin("POST", "/admin/store/init", None).await;
    assert_eq!((status, &v["initialised"]), (200, &json!(true)), "{v}");
    let (status, v) = first.admin("POST", "/admin/store/init", None).await;
    assert_eq!((status, &v["initialised"]), (200, &json!(false)), "{v}");
    first.spend_and_kill().await;
    first.stop().await;

    // Every instance is down when the store forgets; a new one starts.
    flushall(&redis);
    let second = Instance::start(&sim, &redis_text(&redis)).await;
    for t in ["acme", "gamma", "beta"] {
        assert_eq!(
            second.ask(t).await,
            (503, "store_uninitialised".into()),
            "{t}"
        );
    }
    assert!(!redis_has(&redis, "hs:marker"), "no marker was written");
    assert_eq!(second.store_state().await, "uninitialised");
    // The operator decides: the store is declared new, and admissions begin from it.
    let (status, v) = second.admin("POST", "/admin/store/init", None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(second.ask("acme").await.0, 200);
}

/// A running instance notices a loss while idle (no request reaches it) and writes it down, so
/// that an instance started afterwards refuses with the loss (503 `store_state_lost`), not as
/// a store that may be new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_instance_writes_a_loss_down() {
    let (sim, redis) = (sim().await, RedisServer::start());
    let first = Instance::start(&sim, &redis_text(&redis)).await;
    assert_eq!(first.admin("POST", "/admin/store/init", None).await.0, 200);
    first.spend_and_kill().await;
    flushall(&redis);
    until("the idle instance writing the loss down", async || {
        redis_has(&redis, "hs:lost")
    })
    .await;
    let second = Instance::start(&sim, &redis_text(&redis)).await;
    for t in ["acme", "gamma"] {
        assert_eq!(second.ask(t).await, (503, "store_state_lost".into()), "{t}");
    }
    assert_eq!(first.store_state().await, "lost");
    assert_eq!(second.store_state().await, "lost");
    // Initialising over a written-down loss is refused: it is acknowledged instead.
    let (status, v) = second.admin("POST", "/admin/store/init", None).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("store_state_lost"))
    );
    let (status, _) = second
        .admin("POST", "/admin/store/acknowledge-loss", None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(first.ask("acme").await.0, 200);
}

/// With a spend ledger, the ledger's rows are the evidence: an instance that starts on a store
/// that forgot while every instance was down rebuilds it (the spent budget and the kill switch
/// hold), and one that starts a new deployment (an empty ledger) initialises it by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_instance_rebuilds_a_forgetful_store_from_the_ledger() {
    let (sim, redis, pg) = (sim().await, RedisServer::start(), PgServer::start());
    let text = format!(
        "{}[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n",
        redis_text(&redis),
        pg.url()
    );
    let first = Instance::start(&sim, &text).await;
    // A new deployment: served from the first request.
    first.spend_and_kill().await;
    let ledger = kill_in_ledger(pg.url()).await;
    first.stop().await;
    assert!(
        ledger.counts().await.unwrap().1 > 0,
        "charges in the ledger"
    );

    flushall(&redis);
    let second = Instance::start(&sim, &text).await;
    let mut seen = Vec::new();
    until("the budget refusing again", async || {
        let r = second.ask("acme").await;
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
    assert_eq!(second.ask("gamma").await, (503, "kill_switch".into()));
    assert_eq!(second.ask("beta").await.0, 200);
    // Initialising a store whose ledger holds books is refused.
    let (status, v) = second.admin("POST", "/admin/store/init", None).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("store_has_books"))
    );
}

/// The memory store starts empty with every process: with a spend ledger, a restart restores
/// its books before the first request, so a spent budget and a kill switch hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_store_restarts_with_its_books() {
    let (sim, pg) = (sim().await, PgServer::start());
    let text = format!("[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n", pg.url());
    let first = Instance::start(&sim, &text).await;
    first.spend_and_kill().await;
    kill_in_ledger(pg.url()).await;
    first.stop().await;

    let second = Instance::start(&sim, &text).await;
    assert_eq!(second.ask("acme").await, (429, "budget_limit".into()));
    assert_eq!(second.ask("gamma").await, (503, "kill_switch".into()));
    assert_eq!(second.ask("beta").await.0, 200);
}

/// A Redis that may evict keys holds no budget and no kill switch: a policy with a budget is
/// refused with `allow_eviction`, and a kill switch set at run time is refused (409) while one
/// in the configuration file still holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_is_refused_where_it_would_reopen() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let evicting = format!("{}allow_eviction = true\n", redis_text(&redis));
    let budget = format!(
        "{evicting}[policy]\n[[policy.scopes]]\nkey = \"tenant\"\n\
         budget = {{ tokens = 300, period = \"day\" }}\n"
    );
    let e = GatewayConfig::from_toml(&budget).unwrap_err().to_string();
    assert!(
        e.contains("store.allow_eviction") && e.contains("budget"),
        "{e}"
    );

    let sim = sim().await;
    let text =
        format!("{evicting}[[kill]]\ntarget = \"tenant:beta\"\nreason = \"held in the file\"\n");
    let scopes =
        "[[policy.scopes]]\nkey = \"tenant\"\nrequests = { limit = 100, window = \"1m\" }\n";
    let gw = Instance::start_with(&sim, &text, scopes).await;
    assert_eq!(gw.admin("POST", "/admin/store/init", None).await.0, 200);
    let (status, v) = gw
        .admin(
            "POST",
            "/admin/kill",
            Some(json!({"target": "tenant:acme", "reason": "x"})),
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("kill_switch_needs_a_store_that_keeps"))
    );
    assert_eq!(gw.ask("acme").await.0, 200);
    assert_eq!(gw.ask("beta").await, (503, "kill_switch".into()));
}
