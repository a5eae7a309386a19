//! An instance of the gateway served on loopback with an admin listener, started and stopped
//! (drained) by a test, with three tenants' keys: acme, beta and gamma (`sk-<tenant>`), and
//! acme's key for reservations only (`sk-edge`).

#![allow(clippy::unwrap_used, clippy::panic, dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};
use tollgate_gateway::{Gateway, GatewayConfig};
use tollgate_testkit::redis_server::RedisServer;
use tollgate_testkit::sim::{Sim, SimConfig};

pub const TOKEN: &str = "store-admin-token-0123456789";
pub const BUDGET: &str = "[[policy.scopes]]\nname = \"tenant\"\nkey = \"tenant\"\n\
                      budget = { tokens = 300, period = \"day\" }\n";

/// A running instance: its address, its admin address, and what stops it (the drain runs).
pub struct Instance {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Instance {
    /// An instance of `text` (a `[store]`, maybe a `[ledger]`) in front of `sim`, with three
    /// tenants (acme, beta, gamma) and a budget of 300 tokens a day each.
    pub async fn start(sim: &Sim, text: &str) -> Self {
        Self::start_with(sim, text, BUDGET).await
    }

    /// [`Instance::start`] with the rules `scopes` in place of the budget.
    pub async fn start_with(sim: &Sim, text: &str, scopes: &str) -> Self {
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
            .collect::<String>()
            // acme's key for code that calls the provider itself: reservations only.
            + &format!(
                "[[keys]]\nhash = \"{}\"\ntenant = \"acme\"\nuses = \"reservations\"\n",
                tollgate_gateway::hash_key("sk-edge")
            );
        let text = format!(
            "{text}[admin]\nlisten = \"{admin_addr}\"\ntoken_file = \"{}\"\n\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n{keys}\
             [policy]\n{scopes}",
            dir.join("token").display(),
            sim.base_url(),
        );
        let mut config = GatewayConfig::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        config.upstreams[0].api_key = Some(super::SIM_KEY.into());
        let store = tollgate_gateway::start_store(&config).await.unwrap();
        let books = tollgate_gateway::open_books(&config).await.unwrap();
        let records = config.records.clone();
        let mut gw = Gateway::new(config, store).with_books(books);
        if let Some(path) = records {
            gw = gw.with_records(tollgate_gateway::records::RecordSink::open(&path).unwrap());
        }
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
    pub async fn stop(mut self) {
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
    pub async fn ask(&self, t: &str) -> (u16, String) {
        self.ask_with(&format!("sk-{t}")).await
    }

    /// A chat request with the key `secret`: (status, error code).
    pub async fn ask_with(&self, secret: &str) -> (u16, String) {
        let body = json!({"model": "gpt-4o", "max_tokens": 20,
            "messages": [{"role": "user", "content": "Hello there, how are you?"}]});
        let r = super::post(
            self.addr,
            "/v1/chat/completions",
            &[("authorization", format!("Bearer {secret}"))],
            body.to_string(),
        )
        .await;
        let code = r.code();
        (r.status, code)
    }

    /// The admin listener's `/metrics`, as text.
    pub async fn metrics(&self) -> String {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<bytes::Bytes>>();
        let req = hyper::Request::get(format!("http://{}/metrics", self.admin))
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let r = client.request(req).await.unwrap();
        let b = http_body_util::BodyExt::collect(r.into_body())
            .await
            .unwrap()
            .to_bytes();
        String::from_utf8_lossy(&b).into_owned()
    }

    /// One admin call: (status, JSON answer).
    /// The instant the instance's last complete read of the store's keys began.
    pub async fn keys_as_of(&self) -> Option<std::time::SystemTime> {
        let (_, v) = self.admin("GET", "/admin/status", None).await;
        humantime::parse_rfc3339(v["keys_as_of"].as_str()?).ok()
    }

    pub async fn admin(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.admin_as(TOKEN, method, path, body).await
    }

    /// One admin call with `token`: (status, JSON answer).
    pub async fn admin_as(
        &self,
        token: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        request(self.admin, method, path, token, body).await
    }

    pub async fn store_state(&self) -> String {
        let (status, v) = self.admin("GET", "/admin/status", None).await;
        assert_eq!(status, 200, "{v}");
        v["store"].as_str().unwrap().to_owned()
    }

    /// acme spends its budget; gamma is switched off in the store.
    pub async fn spend_and_kill(&self) {
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

pub fn redis_text(redis: &RedisServer) -> String {
    format!(
        "[store]\nurl = \"{}\"\nprefix = \"hs\"\ncall_timeout = \"2s\"\n",
        redis.url()
    )
}

pub fn flushall(redis: &RedisServer) {
    let out = redis.cli().args(["flushall"]).output().unwrap();
    assert!(out.status.success());
}

pub fn redis_has(redis: &RedisServer, key: &str) -> bool {
    let out = redis.cli().args(["exists", key]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "1"
}

#[allow(unused_imports)]
pub use tollgate_testkit::wait::until;

pub async fn sim() -> Sim {
    Sim::start(SimConfig {
        api_key: Some(super::SIM_KEY.into()),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// One call to `addr` with a bearer `secret` and a JSON body: (status, JSON answer).
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    secret: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("authorization", format!("Bearer {secret}"))
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

/// Waits until every instance of `on` has read the store's keys afresh: a read that began
/// after this call. A read begins `REFRESH_EVERY` after the last ended; the bound is three
/// times that, as a busy machine may delay one.
pub async fn refreshed(on: &[&Instance]) {
    let since = std::time::SystemTime::now();
    let bound = tollgate_gateway::keys::REFRESH_EVERY * 3;
    tollgate_testkit::wait::until_within(
        "every instance read the keys afresh",
        bound,
        async || {
            for gw in on {
                if gw.keys_as_of().await.is_none_or(|t| t <= since) {
                    return false;
                }
            }
            true
        },
    )
    .await;
}
