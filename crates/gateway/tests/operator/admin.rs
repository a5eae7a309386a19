//! The admin API: a kill switch set through one instance stops another sharing the Redis store;
//! usage per scope; reload (a bad file is refused, the old policy stays); `/readyz`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::Duration;
use tollgate_core::Keeper as _;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tollgate_gateway::Gateway;
use tollgate_gateway::config::GatewayConfig;
use tollgate_testkit::redis_server::RedisServer;
use tollgate_testkit::sim::{Sim, SimConfig};

const KEY: &str = "sk-admin-test";
const TOKEN: &str = "admin-token-0123456789";

async fn call(method: &str, url: &str, token: Option<&str>, body: &str) -> (u16, Value) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut b = Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json");
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    let r = client
        .request(b.body(Full::new(Bytes::from(body.to_owned()))).unwrap())
        .await
        .unwrap();
    let status = r.status().as_u16();
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

fn config_text(
    sim: &Sim,
    redis: &RedisServer,
    admin_port: u16,
    limit: u64,
    version: &str,
    token_file: &Path,
) -> String {
    format!(
        "[store]\nurl = \"{}\"\nprefix = \"admin\"\n[admin]\nlisten = \"127.0.0.1:{admin_port}\"\ntoken_file = \"{}\"\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
         [policy]\nversion = \"{version}\"\n[[policy.scopes]]\nkey = \"tenant\"\nrequests = {{ limit = {limit}, window = \"1m\" }}\n\
         concurrency = {{ limit = 5, lease_ttl = \"1m\" }}\nbudget = {{ tokens = 100000, period = \"day\" }}\n",
        redis.url(),
        token_file.display(),
        sim.base_url(),
        tollgate_gateway::hash_key(KEY)
    )
}

/// A port for the configuration's `[admin] listen`, which `instance` replaces with a listener
/// of its own.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts an instance from a config file; returns (gateway URL, admin URL).
async fn instance(path: &Path) -> (String, String) {
    let mut config = GatewayConfig::from_toml(&std::fs::read_to_string(path).unwrap()).unwrap();
    // The admin listener is bound here and handed over, in place of the file's `listen`: a
    // port released and bound again may be taken in between.
    let admin_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_addr = admin_listener.local_addr().unwrap();
    config.admin.as_mut().unwrap().listen = admin_addr;
    let admin = format!("http://{admin_addr}");
    let store = tollgate_gateway::start_store(&config).await.unwrap();
    // A test's Redis is new: initialised as an operator would.
    store.initialise().await.unwrap();
    let gw = Gateway::new(config, store).with_config_path(path.to_owned());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(tollgate_gateway::serve_bound(
        gw,
        listener,
        tollgate_gateway::Bound {
            admin: Some(admin_listener),
            metrics: None,
        },
        std::future::pending(),
    ));
    let health = format!("{url}/healthz");
    tollgate_testkit::wait::until("the gateway serving", async || {
        call("GET", &health, None, "").await.0 == 200
    })
    .await;
    (url, admin)
}

async fn chat(url: &str) -> (u16, Value) {
    let body = json!({"model": "gpt-4o", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    call(
        "POST",
        &format!("{url}/v1/chat/completions"),
        Some(KEY),
        &body,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_kill_switch_usage_reload_and_readiness() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let (pa, pb) = (dir.path().join("a.toml"), dir.path().join("b.toml"));
    std::fs::write(
        &pa,
        config_text(&sim, &redis, free_port(), 100, "v1", &token_file),
    )
    .unwrap();
    std::fs::write(
        &pb,
        config_text(&sim, &redis, free_port(), 100, "v1", &token_file),
    )
    .unwrap();
    let (a, admin_a) = instance(&pa).await;
    let (b, admin_b) = instance(&pb).await;
    assert_eq!(chat(&a).await.0, 200);
    assert_eq!(chat(&b).await.0, 200);

    // Without the token: 401.
    assert_eq!(
        call("GET", &format!("{admin_a}/admin/kill"), None, "")
            .await
            .0,
        401
    );
    assert_eq!(
        call(
            "GET",
            &format!("{admin_a}/admin/kill"),
            Some("wrong-token-0123456789"),
            ""
        )
        .await
        .0,
        401
    );

    // Kill the tenant through instance A: instance B refuses at once.
    let (s, _) = call(
        "POST",
        &format!("{admin_a}/admin/kill"),
        Some(TOKEN),
        r#"{"target":"tenant:acme","reason":"incident 7"}"#,
    )
    .await;
    assert_eq!(s, 200);
    let (s, body) = chat(&b).await;
    assert_eq!(
        (s, body["error"]["code"].as_str()),
        (503, Some("kill_switch"))
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("incident 7")
    );
    let (_, kills) = call("GET", &format!("{admin_a}/admin/kill"), Some(TOKEN), "").await;
    assert_eq!(kills["kills"][0]["target"], "tenant:acme");
    assert_eq!(
        call(
            "POST",
            &format!("{admin_a}/admin/kill"),
            Some(TOKEN),
            r#"{"target":"planet:x","reason":"?"}"#
        )
        .await
        .0,
        400
    );
    let (s, _) = call(
        "DELETE",
        &format!("{admin_a}/admin/kill/tenant:acme"),
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(chat(&b).await.0, 200);

    // Usage of the tenant scope, seen from either instance: three settled requests.
    let (s, u) = call(
        "GET",
        &format!("{admin_a}/admin/usage?scope=tenant%7Ctenant:acme"),
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(s, 200, "{u}");
    assert_eq!(
        (u["reserved"].as_u64(), u["leases"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(u["settled"].as_u64().unwrap() > 0);
    assert_eq!(u["budget"]["limit"], 100000);
    assert_eq!(u["policy_version"], "v1");

    // Reload: a bad file is refused with the field, and the old policy stays.
    std::fs::write(
        &pa,
        config_text(&sim, &redis, free_port(), 0, "v2", &token_file),
    )
    .unwrap();
    let (s, e) = call("POST", &format!("{admin_a}/admin/reload"), Some(TOKEN), "").await;
    assert_eq!(s, 400);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("policy.scopes[0].requests.limit"),
        "{e}"
    );
    assert_eq!(chat(&a).await.0, 200);
    // A good file: the new policy applies at once (a rate of 1, already spent in this window).
    let text = std::fs::read_to_string(&pa)
        .unwrap()
        .replace("limit = 0, window", "limit = 1, window");
    std::fs::write(&pa, text).unwrap();
    let (s, r) = call("POST", &format!("{admin_a}/admin/reload"), Some(TOKEN), "").await;
    assert_eq!((s, r["policy_version"].as_str()), (200, Some("v2")));
    let (s, body) = chat(&a).await;
    assert_eq!(
        (s, body["error"]["code"].as_str()),
        (429, Some("request_rate_limit"))
    );

    // Readiness follows the store.
    let ready = |url: String| async move {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        client
            .request(
                Request::get(format!("{url}/readyz"))
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    // On the admin listener: the public one serves the API and `/healthz` only.
    assert_eq!(ready(b.clone()).await, 404);
    assert_eq!(ready(admin_b.clone()).await, 200);
    redis.kill();
    assert_eq!(ready(admin_b.clone()).await, 503);
    let (s, body) = chat(&b).await;
    assert_eq!(
        (s, body["error"]["code"].as_str()),
        (503, Some("store_unavailable")),
        "fail closed"
    );
}

/// A request in flight across a reload settles against the reservation it made under the old
/// policy (here: an old price), and new requests use the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_requests_settle_against_their_reservations_across_a_reload() {
    let sim = Sim::start(SimConfig {
        latency: Duration::from_millis(1500),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("t");
    std::fs::write(&token_file, TOKEN).unwrap();
    let path = dir.path().join("g.toml");
    let admin_port = free_port();
    let config = |input_price: u64| {
        format!(
            "[admin]\nlisten = \"127.0.0.1:{admin_port}\"\ntoken_file = \"{}\"\n\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n[[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
             [policy]\nversion = \"price-{input_price}\"\n[policy.prices.\"gpt-4o\"]\ninput = {input_price}\noutput = 1000000\n\
             [[policy.scopes]]\nkey = \"tenant\"\nbudget = {{ micro_usd = 100000000, period = \"day\" }}\n",
            token_file.display(),
            sim.base_url(),
            tollgate_gateway::hash_key(KEY)
        )
    };
    std::fs::write(&path, config(1_000_000)).unwrap();
    let (url, admin) = instance(&path).await;
    let slow = tokio::spawn({
        let url = url.clone();
        async move { chat(&url).await.0 }
    });
    // Until the slow request holds its reservation (admitted at the old price).
    let usage = format!("{admin}/admin/usage?scope=tenant%7Ctenant:acme");
    tollgate_testkit::wait::until("the slow request admitted", async || {
        call("GET", &usage, Some(TOKEN), "").await.1["reserved"].as_u64() != Some(0)
    })
    .await;
    // Ten times the input price from now on.
    std::fs::write(&path, config(10_000_000)).unwrap();
    assert_eq!(
        call("POST", &format!("{admin}/admin/reload"), Some(TOKEN), "")
            .await
            .0,
        200
    );
    assert_eq!(slow.await.unwrap(), 200);
    let (_, u) = call("GET", &usage, Some(TOKEN), "").await;
    // 8 input tokens at the old $1/M and 5 output at $1/M: 13 micro-USD, not 85.
    assert_eq!(
        (u["settled"].as_u64(), u["reserved"].as_u64()),
        (Some(13), Some(0)),
        "{u}"
    );
    assert_eq!(u["policy_version"], "price-10000000");
}

/// An admin listener handed over to a gateway with no `[admin]` section (no token to serve it
/// with) is refused, not served open.
#[tokio::test]
async fn an_admin_listener_without_an_admin_section_is_refused() {
    let config = GatewayConfig::from_toml(
        "[[upstreams]]\nname = \"sim\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"gpt-4o\"]\n",
    )
    .unwrap();
    let store = tollgate_gateway::start_store(&config).await.unwrap();
    // A test's Redis is new: initialised as an operator would.
    store.initialise().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let served = tollgate_gateway::serve_bound(
        Gateway::new(config, store),
        listener,
        tollgate_gateway::Bound {
            admin: Some(admin),
            metrics: None,
        },
        std::future::pending(),
    )
    .await;
    assert_eq!(
        served.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::InvalidInput)
    );
}
