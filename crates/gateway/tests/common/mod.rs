//! What the gateway's end-to-end tests share.

#![allow(clippy::unwrap_used, clippy::panic, dead_code)]

use std::net::SocketAddr;
use std::time::Duration;
use tollgate_core::Keeper as _;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tollgate_core::{Period, ScopeUsage, Store};
use tollgate_gateway::Gateway;
use tollgate_gateway::config::GatewayConfig;
use tollgate_gateway::store::AnyStore;
use tollgate_testkit::redis_server::RedisServer;
use tollgate_testkit::sim::{Sim, SimConfig};

pub mod e2e;
pub mod instance;

/// One `#[tokio::test]` per store for each named `async fn NAME(redis: bool)` of the test file:
/// `memory_store::NAME` and `redis_store::NAME`, inside the module that invokes it.
#[allow(unused_macros)] // not every test binary runs on both stores
macro_rules! on_both_stores {
    ($($name:ident),*) => {
        mod memory_store {
            $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::super::$name(false).await } )*
        }
        mod redis_store {
            $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::super::$name(true).await } )*
        }
    };
}

/// The upstream key tests give the simulator.
pub const SIM_KEY: &str = "upstream-secret";

/// A gateway under test, its upstream and its store.
pub struct Env {
    pub sim: Sim,
    pub addr: SocketAddr,
    /// The metrics listener (`/metrics`, `/readyz`).
    pub metrics: SocketAddr,
    pub store: AnyStore,
    /// The gateway's router, for requests sent without a socket.
    pub router: axum::Router,
    pub _redis: Option<RedisServer>,
}

/// Starts a gateway for the configuration `text` on a free loopback port, with its store and
/// its decision records if the configuration asks for them; its first upstream gets the API key
/// `upstream_key`. It serves until the test ends.
pub async fn spawn_gateway(text: &str, upstream_key: &str) -> (SocketAddr, AnyStore) {
    let (addr, store, _) = spawn_gateway_with_metrics(text, upstream_key).await;
    (addr, store)
}

/// [`spawn_gateway`], with the address of its metrics listener (one on a free port unless the
/// configuration names one), bound before the gateway starts.
pub async fn spawn_gateway_with_metrics(
    text: &str,
    upstream_key: &str,
) -> (SocketAddr, AnyStore, SocketAddr) {
    let (addr, store, metrics, _) = spawn_gateway_with_router(text, upstream_key).await;
    (addr, store, metrics)
}

/// [`spawn_gateway_with_metrics`], with the gateway's router as well, for requests sent without
/// a socket (`Router::oneshot`). The gateway is prepared before this returns, so that the
/// router answers as the listener would.
pub async fn spawn_gateway_with_router(
    text: &str,
    upstream_key: &str,
) -> (SocketAddr, AnyStore, SocketAddr, axum::Router) {
    let mut config = GatewayConfig::from_toml(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    config.upstreams[0].api_key = Some(upstream_key.into());
    // Bound here and handed over: a port released and bound again may be taken in between.
    let metrics_listener = match config.metrics.listen {
        Some(addr) => tokio::net::TcpListener::bind(addr).await.unwrap(),
        None => tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    };
    let metrics = metrics_listener.local_addr().unwrap();
    config.metrics.listen = Some(metrics);
    let store = tollgate_gateway::start_store(&config).await.unwrap();
    // A test's Redis is new: initialised as an operator would (`tollgate admin init-store`).
    store.initialise().await.unwrap();
    let records = config.records.clone();
    let mut gw = Gateway::new(config, store.clone());
    if let Some(path) = records {
        gw = gw.with_records(tollgate_gateway::records::RecordSink::open(&path).unwrap());
    }
    let gw = std::sync::Arc::new(gw);
    tollgate_gateway::prepare(&gw).await.unwrap();
    let router = tollgate_gateway::router(gw.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tollgate_gateway::serve_bound(
        gw,
        listener,
        tollgate_gateway::Bound {
            admin: None,
            metrics: Some(metrics_listener),
        },
        std::future::pending(),
    ));
    (addr, store, metrics, router)
}

impl Env {
    /// A gateway for the configuration `text` (see [`spawn_gateway`]) in front of `sim`.
    pub async fn start(
        text: &str,
        upstream_key: &str,
        sim: Sim,
        redis: Option<RedisServer>,
    ) -> Self {
        let (addr, store, metrics, router) = spawn_gateway_with_router(text, upstream_key).await;
        Self {
            sim,
            addr,
            metrics,
            store,
            router,
            _redis: redis,
        }
    }

    /// `POST {path}` with a JSON body and `headers`, through the router without a socket
    /// (`Router::oneshot`), from a loopback peer: for a case of one request whose answer does not
    /// depend on the connection.
    pub async fn post_oneshot(
        &self,
        path: &str,
        headers: &[(&str, String)],
        body: impl Into<Bytes>,
    ) -> Reply {
        use tower::ServiceExt;
        let mut b = hyper::Request::post(path).header("content-type", "application/json");
        for (name, value) in headers {
            b = b.header(*name, value.as_str());
        }
        let mut req = b.body(axum::body::Body::from(body.into())).unwrap();
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(SocketAddr::from((
                [127, 0, 0, 1],
                40_000,
            ))));
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        Reply {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }
}

/// A response, read whole.
pub struct Reply {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }
}

/// `GET http://ADDR{path}`.
pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    send(Request::get(format!("http://{addr}{path}")).body(Full::new(Bytes::new()))).await
}

/// `GET http://ADDR{path}` with `headers`.
pub async fn get_with(addr: SocketAddr, path: &str, headers: &[(&str, String)]) -> Reply {
    let mut req = Request::get(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    send(req.body(Full::new(Bytes::new()))).await
}

/// `POST http://ADDR{path}` with a JSON body and `headers`.
pub async fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, String)],
    body: impl Into<Bytes>,
) -> Reply {
    let mut b =
        Request::post(format!("http://{addr}{path}")).header("content-type", "application/json");
    for (name, value) in headers {
        b = b.header(*name, value.as_str());
    }
    send(b.body(Full::new(body.into()))).await
}

/// Sends a request and reads its response whole.
async fn send(req: hyper::http::Result<Request<Full<Bytes>>>) -> Reply {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let resp = client.request(req.unwrap()).await.unwrap();
    let (parts, body) = resp.into_parts();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// The `acme` tenant's daily budget and leases.
pub async fn tenant_usage(store: &AnyStore) -> ScopeUsage {
    let u = store
        .usage("tenant|tenant:acme", Some(Period::Fixed(86_400_000)))
        .await
        .unwrap();
    // The reading's instant is not what is compared.
    ScopeUsage { at_ms: 0, ..u }
}

/// The `acme` tenant's usage once `done` holds for it (settlement can follow the response);
/// fails after 3 s, saying `what`.
pub async fn tenant_usage_when(
    store: &AnyStore,
    what: &str,
    done: impl Fn(&ScopeUsage) -> bool,
) -> ScopeUsage {
    tollgate_testkit::wait::poll(Duration::from_secs(3), async || {
        let u = tenant_usage(store).await;
        if done(&u) {
            return Ok(u);
        }
        Err(format!("{what}: {u:?}"))
    })
    .await
}

/// The tenant's settled total once nothing is held and it has reached what the simulator
/// served (input, with any earlier context it billed, and output, as it reported them); fails
/// after 3 s.
pub async fn settled_as_the_upstream_served(env: &Env) -> u64 {
    let served = || {
        let s = env.sim.stats();
        s.prompt_tokens + s.completion_tokens
    };
    let what = format!("settled as the upstream served ({})", served());
    tenant_usage_when(&env.store, &what, |u| {
        u.leases == 0 && u.reserved == 0 && u.settled == served()
    })
    .await
    .settled
}

/// A simulator that requires `upstream_key`, a Redis server of its own when `redis`, and the
/// `[store]` section that points a gateway at it under `prefix` (empty for the memory store).
pub async fn upstream_and_store(
    redis: bool,
    upstream_key: &str,
    sim: SimConfig,
    prefix: &str,
) -> (Sim, Option<RedisServer>, String) {
    let sim = Sim::start(SimConfig {
        api_key: Some(upstream_key.into()),
        ..sim
    })
    .await
    .unwrap();
    let redis_server = redis.then(RedisServer::start);
    let store = match &redis_server {
        Some(r) => format!(
            "[store]\nurl = \"{}\"\nprefix = \"{prefix}\"\ncall_timeout = \"2s\"\n",
            r.url()
        ),
        None => String::new(),
    };
    (sim, redis_server, store)
}

#[allow(dead_code)] // not every test binary sends audio
/// A WAV clip of `seconds` of 8 kHz 8-bit mono silence.
pub fn wav(seconds: u32) -> Vec<u8> {
    let data = 8_000 * seconds;
    let mut b = b"RIFF".to_vec();
    b.extend((36 + data).to_le_bytes());
    b.extend(b"WAVEfmt ");
    b.extend(16u32.to_le_bytes());
    b.extend([1, 0, 1, 0]);
    b.extend(8_000u32.to_le_bytes());
    b.extend(8_000u32.to_le_bytes());
    b.extend([1, 0, 8, 0]);
    b.extend(b"data");
    b.extend(data.to_le_bytes());
    b.extend(vec![128u8; data as usize]);
    b
}

/// The value of the metric `name` (a line `name value`) on the gateway's metrics listener: a
/// test runs in a process of its own, so the figures are its gateway's.
pub async fn metric(env: &Env, name: &str) -> Option<f64> {
    let text = get(env.metrics, "/metrics").await;
    let text = String::from_utf8_lossy(&text.body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Waits until the gateway holds `n` connections on its public listener.
pub async fn connections_become(env: &Env, n: f64) {
    let name = "tollgate_connections_open{listener=\"public\"}";
    tollgate_testkit::wait::until(&format!("{n} connections open"), async || {
        metric(env, name).await.unwrap_or(0.0) == n
    })
    .await;
}
