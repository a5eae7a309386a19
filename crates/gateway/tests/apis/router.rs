//! The router without sockets (`Router::oneshot`): a hostile-input corpus never gets a 5xx and
//! never leaks; identity details (end users, forwarded client IPs, exempt keys).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use tollgate_core::Keeper as _;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use http::Request;
use http_body_util::BodyExt;
use tollgate_core::{Period, Store};
use tollgate_gateway::Gateway;
use tollgate_gateway::config::GatewayConfig;
use tollgate_gateway::store::AnyStore;
use tollgate_testkit::sim::{Sim, SimConfig};
use tower::ServiceExt;

const KEY: &str = "sk-router";
const INTERNAL: &str = "sk-internal";

async fn app(policy: &str) -> (Router, AnyStore, Sim) {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let text = format!(
        "[server]\nmax_body_bytes = 65536\ntrusted_proxies = [\"10.0.0.1\"]\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\", \"gpt-4\", \"text-embedding-3-small\", \"gpt-3.5-turbo-instruct\", \"unknown-model\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\nallow_user = true\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"internal\"\nexempt = [\"request_rate_limit\"]\n{policy}",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
        tollgate_gateway::hash_key(INTERNAL)
    );
    let config = GatewayConfig::from_toml(&text).unwrap_or_else(|e| panic!("{e}"));
    let store = tollgate_gateway::start_store(&config).await.unwrap();
    // A test's Redis is new: initialised as an operator would.
    store.initialise().await.unwrap();
    let gw = Arc::new(Gateway::new(config, store.clone()));
    (tollgate_gateway::router(gw), store, sim)
}

async fn post(
    app: &Router,
    key: &str,
    peer: &str,
    xff: Option<&str>,
    body: Vec<u8>,
) -> (u16, String) {
    let mut b = Request::post("/v1/chat/completions")
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json");
    if let Some(x) = xff {
        b = b.header("x-forwarded-for", x);
    }
    let mut req = b.body(Body::from(body)).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(peer.parse::<SocketAddr>().unwrap()));
    let r = app.clone().oneshot(req).await.unwrap();
    let status = r.status().as_u16();
    (
        status,
        String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).into_owned(),
    )
}

const POLICY: &str = r#"
[[policy.scopes]]
key = "tenant"
input_tokens = 2000
concurrency = { limit = 8, lease_ttl = "1m" }
budget = { tokens = 10000000, period = "day" }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_corpus_gets_4xx_or_200_never_5xx_and_leaks_nothing() {
    let (app, store, _sim) = app(POLICY).await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/request");
    let mut bodies: Vec<Vec<u8>> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    let huge_escapes = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "\\t".repeat(30_000)
    );
    let deep = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":{}1{}}}]}}"#,
        "[".repeat(5000),
        "]".repeat(5000)
    );
    bodies.extend([
        huge_escapes.into_bytes(),
        deep.into_bytes(),
        vec![0xff; 100],
        br#"{"model":"gpt-4o","messages":[{"role":"user","content":"x"}],"max_tokens":18446744073709551615}"#.to_vec(),
        br#"{"model":"gpt-4o","messages":[{"role":"user","content":"x"}],"max_tokens":1.5}"#.to_vec(),
        br#"{"model":"gpt-4o","messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":"yes"}"#.to_vec(),
        br#"{"model":"gpt-4o","messages":[{"role":"user","content":"x"}],"user":{"nested":true}}"#.to_vec(),
        br#"{"model":"gpt-4o","messages":[{"role":"user","content":"x"}]} trailing"#.to_vec(),
        b"null".to_vec(),
        b"[]".to_vec(),
        br#"{"model":null}"#.to_vec(),
        vec![b' '; 70_000],
    ]);
    for (i, body) in bodies.into_iter().enumerate() {
        let (status, text) = post(&app, KEY, "127.0.0.1:5000", None, body).await;
        assert!(status < 500, "case {i}: {status} {text}");
        if status >= 400 {
            let v: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|_| panic!("case {i}: not the API's error format: {text}"));
            assert!(v["error"]["code"].is_string(), "case {i}: {text}");
        }
    }
    // Settlement runs just after each response: allow it a moment.
    tollgate_testkit::wait::poll(std::time::Duration::from_secs(3), async || {
        let u = store
            .usage("tenant|tenant:acme", Some(Period::Fixed(86_400_000)))
            .await
            .unwrap();
        match (u.reserved, u.leases) {
            (0, 0) => Ok(()),
            _ => Err(format!("leaked: {u:?}")),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_users_forwarded_ips_and_exempt_keys() {
    let policy = r#"
[[policy.scopes]]
key = "user"
requests = { limit = 1, window = "1m" }
[[policy.scopes]]
key = "ip"
requests = { limit = 2, window = "1m" }
[[policy.scopes]]
name = "internal-rate"
key = "tenant"
match = { tenant = "internal" }
requests = { limit = 1, window = "1m" }
"#;
    let (app, _store, _sim) = app(policy).await;
    let chat = |user: &str| {
        format!(r#"{{"model":"gpt-4o","max_tokens":3,"user":"{user}","messages":[{{"role":"user","content":"x"}}]}}"#).into_bytes()
    };
    // Each end user has their own scope: alice's second request is refused, bob's first is not.
    assert_eq!(
        post(&app, KEY, "127.0.0.1:1", None, chat("alice")).await.0,
        200
    );
    let (s, body) = post(&app, KEY, "127.0.0.2:1", None, chat("alice")).await;
    assert!(s == 429 && body.contains("user:alice"), "{s} {body}");
    assert_eq!(
        post(&app, KEY, "127.0.0.3:1", None, chat("bob")).await.0,
        200
    );
    // X-Forwarded-For is believed only from the trusted proxy: two requests "from" 192.0.2.7
    // through it exhaust that IP's scope; the same header from an untrusted peer is ignored.
    assert_eq!(
        post(&app, KEY, "10.0.0.1:1", Some("192.0.2.7"), chat("carol"))
            .await
            .0,
        200
    );
    assert_eq!(
        post(&app, KEY, "10.0.0.1:1", Some("192.0.2.7"), chat("dave"))
            .await
            .0,
        200
    );
    let (s, body) = post(&app, KEY, "10.0.0.1:1", Some("192.0.2.7"), chat("erin")).await;
    assert!(s == 429 && body.contains("ip:192.0.2.7"), "{s} {body}");
    assert_eq!(
        post(&app, KEY, "127.0.0.9:1", Some("192.0.2.7"), chat("frank"))
            .await
            .0,
        200
    );
    // The internal key is exempt from the rate: its tenant limit of 1 does not bite.
    for _ in 0..3 {
        let body =
            br#"{"model":"gpt-4o","max_tokens":3,"messages":[{"role":"user","content":"x"}]}"#
                .to_vec();
        assert_eq!(
            post(&app, INTERNAL, "127.0.0.20:1", None, body).await.0,
            200
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenizers_are_configured_per_model_with_field_errors() {
    let base = "[[upstreams]]\nname = \"s\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n";
    for (entry, path) in [
        ("[tokenizers]\nm = \"p50k\"\n", "tokenizers.\"m\""),
        (
            "[tokenizers]\nm = \"/nonexistent/tokenizer.json\"\n",
            "tokenizers.\"m\"",
        ),
    ] {
        let e = GatewayConfig::from_toml(&format!("{base}{entry}")).unwrap_err();
        assert_eq!(e.path, path, "{e}");
    }
    let c =
        GatewayConfig::from_toml(&format!("{base}[tokenizers]\nm = \"cl100k_base\"\n")).unwrap();
    assert_eq!(c.counter.counting_for("m").name(), "cl100k_base");
    assert_eq!(c.counter.counting_for("other").name(), "utf8_bytes");
    let c = GatewayConfig::from_toml(&format!("{base}[tokenizers]\nm = \"estimate\"\n")).unwrap();
    assert_eq!(c.counter.counting_for("m").name(), "estimate");
}

/// A rule's degrade is checked at load: the model degraded to is served, priced where money is
/// limited, and counts tokens as the model it replaces.
#[test]
fn degrades_are_checked_against_the_upstreams_prices_and_tokenizers() {
    let with = |models: &str, extra: &str, to: &str| {
        format!(
            "[[upstreams]]\nname = \"s\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [{models}]\n\
             {extra}[[policy.scopes]]\nkey = \"tenant\"\n\
             budget = {{ tokens = 1000, period = \"day\" }}\n\
             degrade = {{ at = \"80%\", models = {{ \"gpt-4o\" = \"{to}\" }} }}\n"
        )
    };
    let path = "policy.scopes[0].degrade.models.gpt-4o";
    let e = GatewayConfig::from_toml(&with("\"gpt-4o\"", "", "gpt-4o-mini")).unwrap_err();
    assert_eq!(e.path, path, "{e}");
    assert!(e.to_string().contains("served by no upstream"), "{e}");
    let both = "\"gpt-4o\", \"gpt-4o-mini\"";
    let e = GatewayConfig::from_toml(&with(
        both,
        "[tokenizers]\n\"gpt-4o-mini\" = \"cl100k_base\"\n",
        "gpt-4o-mini",
    ))
    .unwrap_err();
    assert_eq!(e.path, path, "{e}");
    assert!(
        e.to_string().contains("counts tokens with o200k_base"),
        "{e}"
    );
    let c = GatewayConfig::from_toml(&with(both, "", "gpt-4o-mini")).unwrap();
    assert!(c.policy.scopes[0].degrade.is_some());
}

#[test]
fn store_shards_and_retention_are_checked_and_passed_on() {
    let base = "[[upstreams]]\nname = \"s\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n";
    for bad in ["0", "1025"] {
        let text = format!("{base}[store]\nurl = \"redis://127.0.0.1:1/\"\nshards = {bad}\n");
        let e = GatewayConfig::from_toml(&text).unwrap_err();
        assert_eq!(e.path, "store.shards", "{e}");
    }
    let text = format!(
        "{base}[store]\ncluster = [\"redis://127.0.0.1:1/\"]\nshards = 16\nretention = \"10m\"\n"
    );
    let c = GatewayConfig::from_toml(&text).unwrap();
    assert!(
        matches!(
            c.store,
            tollgate_gateway::config::StoreConfig::Redis { shards: 16, retention, .. }
                if retention == std::time::Duration::from_secs(600)
        ),
        "{:?}",
        c.store
    );
    for bad in ["\"500ms\"", "\"soon\""] {
        let e =
            GatewayConfig::from_toml(&format!("{base}[store]\nretention = {bad}\n")).unwrap_err();
        assert_eq!(e.path, "store.retention", "{e}");
    }
}

#[test]
fn responses_settings_have_defaults_and_bounds() {
    let base = "[[upstreams]]\nname = \"s\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n";
    assert_eq!(
        GatewayConfig::from_toml(base)
            .unwrap()
            .unknown_context_tokens,
        128_000
    );
    let c = GatewayConfig::from_toml(&format!("{base}[responses]\nunknown_context_tokens = 0\n"))
        .unwrap();
    assert_eq!(c.unknown_context_tokens, 0);
    let e = GatewayConfig::from_toml(&format!(
        "{base}[responses]\nunknown_context_tokens = 10000001\n"
    ))
    .unwrap_err();
    assert_eq!(e.path, "responses.unknown_context_tokens", "{e}");
    let e = GatewayConfig::from_toml(&format!("{base}[responses]\nunknown = 1\n")).unwrap_err();
    assert!(e.to_string().contains("unknown"), "{e}");
    // What a follow-up carries is kept a day by default, from a minute to 30 days.
    let c = GatewayConfig::from_toml(base).unwrap();
    assert_eq!(c.context_ttl, std::time::Duration::from_secs(86_400));
    for bad in ["\"59s\"", "\"31d\"", "\"soon\""] {
        let e = GatewayConfig::from_toml(&format!("{base}[responses]\ncontext_ttl = {bad}\n"))
            .unwrap_err();
        assert_eq!(e.path, "responses.context_ttl", "{e}");
    }
}

#[test]
fn upstream_tools_settings_have_defaults_and_bounds() {
    use tollgate_gateway::upstream_tools::UpstreamTools;
    let base = "[[upstreams]]\nname = \"s\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n";
    let c = GatewayConfig::from_toml(base).unwrap();
    assert_eq!(
        c.upstream_tools,
        UpstreamTools {
            tokens_per_call: 8_000,
            max_calls: 4,
            file_search_chunk_tokens: 800,
        }
    );
    let c = GatewayConfig::from_toml(&format!(
        "{base}[upstream_tools]\ntokens_per_call = 0\nmax_calls = 100\nfile_search_chunk_tokens = 4096\n"
    ))
    .unwrap();
    assert_eq!(
        c.upstream_tools,
        UpstreamTools {
            tokens_per_call: 0,
            max_calls: 100,
            file_search_chunk_tokens: 4096,
        }
    );
    for (bad, path) in [
        (
            "tokens_per_call = 1000001",
            "upstream_tools.tokens_per_call",
        ),
        ("max_calls = 0", "upstream_tools.max_calls"),
        ("max_calls = 101", "upstream_tools.max_calls"),
        (
            "file_search_chunk_tokens = 99",
            "upstream_tools.file_search_chunk_tokens",
        ),
        (
            "file_search_chunk_tokens = 4097",
            "upstream_tools.file_search_chunk_tokens",
        ),
    ] {
        let e = GatewayConfig::from_toml(&format!("{base}[upstream_tools]\n{bad}\n")).unwrap_err();
        assert_eq!(e.path, path, "{e}");
    }
    let e = GatewayConfig::from_toml(&format!("{base}[upstream_tools]\ncalls = 1\n")).unwrap_err();
    assert!(e.to_string().contains("calls"), "{e}");
}
