//! Hostile clients: each test is an attack, over real sockets, against a gateway of its own and
//! the upstream simulator; where a store is involved it runs on the memory store and on Redis.
//! The gate must stay open to everyone else, and no client-chosen value may bend a limit.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tollgate_testkit::sim::SimConfig;

use common::{Env, Reply};

const UPSTREAM_KEY: &str = "upstream-secret";
/// Keys and their tenants: `acme` and `beta` may name their end users.
const KEYS: [(&str, &str); 4] = [
    ("sk-acme", "acme"),
    ("sk-beta", "beta"),
    ("sk-free", "free"),
    ("sk-pro", "pro"),
];

async fn env(redis: bool, policy: &str, extra: &str) -> Env {
    env_with(redis, policy, extra, SimConfig::default()).await
}

async fn env_with(redis: bool, policy: &str, extra: &str, sim: SimConfig) -> Env {
    let (sim, redis_server, store_cfg) =
        common::upstream_and_store(redis, UPSTREAM_KEY, sim, "hostile").await;
    let keys: String = KEYS
        .iter()
        .map(|(k, t)| {
            format!(
                "[[keys]]\nhash = \"{}\"\ntenant = \"{t}\"\nallow_user = true\n",
                tollgate_gateway::hash_key(k)
            )
        })
        .collect();
    let text = format!(
        "{store_cfg}{extra}\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\", \"claude-sonnet-4-5\"]\n\
         {keys}[policy]\n{policy}\n",
        sim.base_url(),
    )
    .replace("[[scopes]]", "[[policy.scopes]]");
    Env::start(&text, UPSTREAM_KEY, sim, redis_server).await
}

async fn post_as(
    env: &Env,
    path: &str,
    key: &str,
    headers: &[(&str, String)],
    body: &Value,
) -> Reply {
    let mut h: Vec<(&str, String)> = vec![("authorization", format!("Bearer {key}"))];
    h.extend(headers.iter().cloned());
    common::post(env.addr, path, &h, serde_json::to_vec(body).unwrap()).await
}

fn chat(content: &str, max: u64) -> Value {
    json!({"model": "gpt-4o", "max_tokens": max, "messages": [{"role": "user", "content": content}]})
}

/// Requests the upstream received.
fn served(env: &Env) -> u64 {
    env.sim.stats().requests.values().sum()
}

/// Reads until the peer closes (`true`) or `within` passes (`false`).
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

async fn healthz_from(addr: SocketAddr, from: [u8; 4]) -> Option<String> {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::from((from, 0))).unwrap();
    let mut s = sock.connect(addr).await.ok()?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

// ---------------------------------------------------------------------------------------------
// Connections.

/// `max_connections` sockets that never send a byte: once the deadline from accept has passed,
/// the server has closed them and a normal client is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_are_closed_at_the_deadline_and_the_gate_reopens() {
    let extra = "[server]\nmax_connections = 8\nheader_timeout = \"1s\"\n";
    let env = env(false, "", extra).await;
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(TcpStream::connect(env.addr).await.unwrap());
    }
    common::connections_become(&env, 8.0).await;
    // Full: a ninth connection is closed at once.
    assert!(
        healthz_from(env.addr, [127, 0, 0, 1])
            .await
            .is_none_or(|r| r.is_empty())
    );
    for s in &mut silent {
        assert!(
            closed_within(s, Duration::from_secs(3)).await,
            "a silent socket outlived its deadline"
        );
    }
    let r = healthz_from(env.addr, [127, 0, 0, 1])
        .await
        .unwrap_or_default();
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
}

/// The deadline runs from accept, not from the first byte: a head sent complete, but only after
/// the deadline has passed in silence, is not served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_after_the_deadline_is_not_served() {
    let env = env(false, "", "[server]\nheader_timeout = \"500ms\"\n").await;
    let mut s = TcpStream::connect(env.addr).await.unwrap();
    // Accepted, then closed at the deadline.
    common::connections_become(&env, 1.0).await;
    common::connections_become(&env, 0.0).await;
    let _ = s
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut buf)).await;
    assert!(
        !buf.starts_with(b"HTTP/1.1 200"),
        "served after its deadline: {}",
        String::from_utf8_lossy(&buf)
    );
}

/// Cleartext HTTP/2 is not spoken unless configured: a prior-knowledge preface gets no HTTP/2
/// settings frame, only an HTTP/1.1 error or a close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_is_refused_unless_configured() {
    let env = env(false, "", "[server]\nheader_timeout = \"1s\"\n").await;
    let mut s = TcpStream::connect(env.addr).await.unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut buf)).await;
    assert!(
        buf.is_empty() || buf.starts_with(b"HTTP/1.1 "),
        "answered in HTTP/2: {buf:?}"
    );
    // Configured on purpose, it is served, with the same deadlines.
    let env2 = self::env(
        false,
        "",
        "[server]\nheader_timeout = \"1s\"\nhttp2 = true\n",
    )
    .await;
    let mut s = TcpStream::connect(env2.addr).await.unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let mut head = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut head))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(head[3], 0x04, "the server's first frame is SETTINGS");
    // Then silent: closed at the deadline like any connection.
    assert!(closed_within(&mut s, Duration::from_secs(3)).await);
}

/// A kept-alive connection that sends nothing more is closed after the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_are_closed() {
    let env = env(false, "", "[server]\nidle_timeout = \"500ms\"\n").await;
    let mut s = TcpStream::connect(env.addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    let start = Instant::now();
    assert!(closed_within(&mut s, Duration::from_secs(3)).await);
    assert!(
        start.elapsed() >= Duration::from_millis(400),
        "{:?}",
        start.elapsed()
    );
}

/// One address cannot take every connection: past its cap it is refused, another is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_is_capped_and_others_are_served() {
    let extra =
        "[server]\nmax_connections = 16\nmax_connections_per_ip = 3\nheader_timeout = \"5s\"\n";
    let env = env(false, "", extra).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(TcpStream::connect(env.addr).await.unwrap());
    }
    common::connections_become(&env, 3.0).await;
    let mine = healthz_from(env.addr, [127, 0, 0, 1])
        .await
        .unwrap_or_default();
    assert!(mine.is_empty(), "served past its cap: {mine}");
    let other = healthz_from(env.addr, [127, 0, 0, 2])
        .await
        .unwrap_or_default();
    assert!(other.starts_with("HTTP/1.1 200"), "{other}");
    drop(held);
}

// ---------------------------------------------------------------------------------------------
// Counting.

/// Another tenant's small input limit does not stop the count of this tenant's request, whose
/// budget needs all of it: the second 15,000-token request does not fit a 20,000-token budget.
async fn another_tenants_rule_cannot_shrink_a_reservation(redis: bool) {
    let policy = r#"
[[scopes]]
name = "free-input"
key = "tenant"
match = { tenant = "free" }
input_tokens = 100
[[scopes]]
name = "pro-budget"
key = "tenant"
match = { tenant = "pro" }
budget = { tokens = 20000, period = "day" }
"#;
    let env = env(redis, policy, "").await;
    let big = "hello ".repeat(15_000);
    let first = post_as(&env, "/v1/chat/completions", "sk-pro", &[], &chat(&big, 10)).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let second = post_as(&env, "/v1/chat/completions", "sk-pro", &[], &chat(&big, 10)).await;
    assert_eq!(second.status, 429, "{:?}", second.body);
    assert_eq!(second.code(), "budget_limit");
    // The free tenant's own limit still stops counting early and refuses.
    let free = post_as(
        &env,
        "/v1/chat/completions",
        "sk-free",
        &[],
        &chat(&big, 10),
    )
    .await;
    assert_eq!(free.status, 400);
    assert_eq!(free.code(), "input_token_limit");
}

/// Files and documents named by URL or id are admitted with an allowance each, and a refusal
/// says how much of the count it is.
async fn remote_content_is_counted_with_an_allowance(redis: bool) {
    // The default allowance, 32,000 tokens an item.
    let policy = "[[scopes]]\nkey = \"tenant\"\ninput_tokens = 30000\n";
    let env = env(redis, policy, "").await;
    let chat_file = json!({"model": "gpt-4o", "max_tokens": 5, "messages": [{"role": "user",
        "content": [{"type": "text", "text": "summarise"},
                    {"type": "file", "file": {"file_id": "file-abc"}}]}]});
    let responses_url = json!({"model": "gpt-4o", "max_output_tokens": 5, "input": [{"role": "user",
        "content": [{"type": "input_file", "file_url": "https://example.invalid/a.pdf"}]}]});
    let anthropic_url = json!({"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": [{"role": "user",
        "content": [{"type": "document", "source": {"type": "url", "url": "https://example.invalid/a.pdf"}}]}]});
    for (path, body) in [
        ("/v1/chat/completions", &chat_file),
        ("/v1/responses", &responses_url),
        ("/v1/messages", &anthropic_url),
    ] {
        let r = post_as(&env, path, "sk-acme", &[], body).await;
        assert_eq!(r.status, 400, "{path}: {:?}", r.body);
        let text = String::from_utf8_lossy(&r.body).into_owned();
        assert!(text.contains("input_token_limit"), "{path}: {text}");
        assert!(
            text.contains("32000 for the files and documents named by URL or id"),
            "{path}: {text}"
        );
    }
    // The same request holding a PDF inline is counted by its pages and admitted; one whose
    // pages cannot be read is admitted at the allowance, like a file named by id.
    let inline = |data: &str| {
        json!({"model": "gpt-4o", "max_tokens": 5, "messages": [{"role": "user",
        "content": [{"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{data}"), "filename": "a.pdf"}}]}]})
    };
    use base64::Engine;
    let pdf = base64::engine::general_purpose::STANDARD
        .encode("%PDF-1.4\n1 0 obj << /Type /Page >> endobj\n2 0 obj << /Type /Page >> endobj\n");
    let r = post_as(&env, "/v1/chat/completions", "sk-acme", &[], &inline(&pdf)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = post_as(
        &env,
        "/v1/chat/completions",
        "sk-acme",
        &[],
        &inline("QUJD"),
    )
    .await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    let text = String::from_utf8_lossy(&r.body).into_owned();
    assert!(text.contains("32000 for the files and documents"), "{text}");
}

/// `anthropic-beta` values pass only from the configured allow-list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_betas_pass_only_from_the_allow_list() {
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}]});
    let key = [("x-api-key", "sk-acme".to_owned())];
    // By default no beta passes.
    let env = self::env(false, "", "").await;
    let mcp = [
        key[0].clone(),
        ("anthropic-beta", "mcp-client-2025-04-04".to_owned()),
    ];
    let r = common::post(
        env.addr,
        "/v1/messages",
        &mcp,
        serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert_eq!(served(&env), 0);
    let env = self::env(
        false,
        "",
        "[anthropic]\nbetas = [\"files-api-2025-04-14\"]\n",
    )
    .await;
    let mcp = [
        key[0].clone(),
        (
            "anthropic-beta",
            "files-api-2025-04-14,mcp-client-2025-04-04".to_owned(),
        ),
    ];
    let r = common::post(
        env.addr,
        "/v1/messages",
        &mcp,
        serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    let e = r.json();
    assert_eq!(e["type"], "error", "Anthropic's error format: {e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("mcp-client-2025-04-04"),
        "{e}"
    );
    let ok = [
        key[0].clone(),
        ("anthropic-beta", "files-api-2025-04-14".to_owned()),
    ];
    let r = common::post(
        env.addr,
        "/v1/messages",
        &ok,
        serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    // Nothing reserved or leased was left by the refusal.
    assert_eq!(served(&env), 1);
}

// ---------------------------------------------------------------------------------------------
// Identity values.

/// A `user` longer than 256 bytes is a 400 naming it, in the body or the header, and nothing is
/// counted for it.
async fn long_user_ids_are_refused(redis: bool) {
    let policy = "[[scopes]]\nkey = \"user\"\nrequests = { limit = 100, window = \"1m\" }\n";
    let env = env(redis, policy, "").await;
    let long = "u".repeat(257);
    let mut body = chat("hi", 5);
    body["user"] = json!(long);
    let r = post_as(&env, "/v1/chat/completions", "sk-acme", &[], &body).await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert_eq!(r.json()["error"]["param"], "user");
    let h = [("x-tollgate-user", long.clone())];
    let r = post_as(&env, "/v1/chat/completions", "sk-acme", &h, &chat("hi", 5)).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "user");
    body["user"] = json!("u".repeat(256));
    let r = post_as(&env, "/v1/chat/completions", "sk-acme", &[], &body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(served(&env), 1);
}

/// Two tenants' `alice` are two scopes; `carol\u{1}`, `carol\u{2}` and `carol?` are three.
async fn user_scopes_belong_to_their_tenant_and_escape_injectively(redis: bool) {
    let policy = "[[scopes]]\nkey = \"user\"\nrequests = { limit = 1, window = \"1m\" }\n";
    let env = env(redis, policy, "").await;
    let as_user = |u: &str| {
        let mut b = chat("hi", 5);
        b["user"] = json!(u);
        b
    };
    let a = post_as(
        &env,
        "/v1/chat/completions",
        "sk-acme",
        &[],
        &as_user("alice"),
    )
    .await;
    assert_eq!(a.status, 200);
    let b = post_as(
        &env,
        "/v1/chat/completions",
        "sk-beta",
        &[],
        &as_user("alice"),
    )
    .await;
    assert_eq!(
        b.status, 200,
        "tenant beta's alice was limited by acme's: {:?}",
        b.body
    );
    let again = post_as(
        &env,
        "/v1/chat/completions",
        "sk-acme",
        &[],
        &as_user("alice"),
    )
    .await;
    assert_eq!(again.status, 429);
    assert_eq!(
        again.header("x-tollgate-scope"),
        Some("tenant:acme/user:alice")
    );
    for u in ["carol\u{1}", "carol\u{2}", "carol?"] {
        let r = post_as(&env, "/v1/chat/completions", "sk-acme", &[], &as_user(u)).await;
        assert_eq!(r.status, 200, "{u:?} shared another's scope: {:?}", r.body);
    }
    let r = post_as(
        &env,
        "/v1/chat/completions",
        "sk-acme",
        &[],
        &as_user("carol?"),
    )
    .await;
    assert_eq!(
        r.header("x-tollgate-scope"),
        Some("tenant:acme/user:carol%3F")
    );
}

/// A small chat request from `ip`, as a trusted proxy in front of the gateway says.
async fn chat_from(env: &Env, key: &str, ip: &str) -> Reply {
    let from = [("x-forwarded-for", ip.to_owned())];
    post_as(env, "/v1/chat/completions", key, &from, &chat("hi", 5)).await
}

/// A client rotating addresses inside one IPv6 /64 stays in one `ip` scope; another /64 is
/// another scope.
async fn ipv6_clients_are_scoped_by_network(redis: bool) {
    let policy = r#"
[[scopes]]
name = "per-ip"
key = "ip"
requests = { limit = 2, window = "1m" }
"#;
    let env = env(
        redis,
        policy,
        "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n",
    )
    .await;
    for ip in ["2001:db8:1:2::1", "2001:db8:1:2:ffff::9"] {
        let r = chat_from(&env, "sk-acme", ip).await;
        assert_eq!(r.status, 200, "{ip}: {:?}", r.body);
    }
    let r = chat_from(&env, "sk-acme", "2001:db8:1:2:aaaa:bbbb:cccc:dddd").await;
    assert_eq!(
        r.status, 429,
        "a fresh address in the same /64 got a fresh scope"
    );
    assert_eq!(r.header("x-tollgate-scope"), Some("ip:2001:db8:1:2::/64"));
    let r = chat_from(&env, "sk-acme", "2001:db8:1:3::1").await;
    assert_eq!(r.status, 200, "another /64 is another scope");
}

/// A rule can group networks instead: IPv4 by /24 here, and the prefix shows in the scope id.
async fn ip_rules_may_group_networks(redis: bool) {
    let policy = r#"
[[scopes]]
name = "per-net"
key = "ip"
match = { tenant = "beta" }
ip_prefix = { v4 = 24, v6 = 48 }
requests = { limit = 2, window = "1m" }
"#;
    let env = env(
        redis,
        policy,
        "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n",
    )
    .await;
    for ip in ["10.1.2.3", "10.1.2.99"] {
        let r = chat_from(&env, "sk-beta", ip).await;
        assert_eq!(r.status, 200);
    }
    let r = chat_from(&env, "sk-beta", "10.1.2.200").await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-tollgate-scope"), Some("ip:10.1.2.0/24"));
}

// ---------------------------------------------------------------------------------------------
// Fields.

/// `n` and `best_of` must be positive integers: a string is a 400 naming the field, and nothing
/// reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn choices_are_typed() {
    let env = env(false, "", "").await;
    for (field, value) in [
        ("n", json!("3")),
        ("n", json!(0)),
        ("n", json!(-1)),
        ("best_of", json!("2")),
        ("n", json!(1.5)),
    ] {
        let mut body = chat("hi", 5);
        body[field] = value.clone();
        let r = post_as(&env, "/v1/chat/completions", "sk-acme", &[], &body).await;
        assert_eq!(r.status, 400, "{field} = {value}: {:?}", r.body);
        assert_eq!(r.json()["error"]["param"], field);
    }
    assert_eq!(served(&env), 0);
}

// ---------------------------------------------------------------------------------------------
// Listeners.

/// `/metrics` and `/readyz` are not on the public listener; the metrics listener serves them,
/// and a scrape reads cached budget figures: scrapes do not call the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_private_and_scrapes_do_not_call_the_store() {
    let policy = r#"
[[scopes]]
name = "all"
key = "global"
budget = { tokens = 100000, period = "day" }
[[scopes]]
name = "acme"
key = "tenant"
match = { tenant = "acme" }
budget = { tokens = 50000, period = "day" }
"#;
    // The metrics listener is one of the harness's (`env.metrics`), bound before the gateway
    // starts. Slices off: their maintenance calls the store every tick (a script call of
    // several commands), which would fall into the count below now and then.
    let env = env(
        true,
        policy,
        "[metrics]\nrefresh = \"1h\"\n[store.slices]\nenabled = false\n",
    )
    .await;
    for path in ["/metrics", "/readyz"] {
        assert_eq!(common::get(env.addr, path).await.status, 404, "{path}");
    }
    let metrics = env.metrics;
    // The first refresh runs at start-up.
    tollgate_testkit::wait::until_within(
        "budget figures in /metrics",
        Duration::from_secs(3),
        async || {
            let r = common::get(metrics, "/metrics").await;
            assert_eq!(r.status, 200);
            String::from_utf8_lossy(&r.body).contains("scope=\"acme|tenant:acme\"")
        },
    )
    .await;
    let redis = env._redis.as_ref().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = redis.info_number("stats", "total_commands_processed");
    for _ in 0..20 {
        assert_eq!(common::get(metrics, "/metrics").await.status, 200);
    }
    let after = redis.info_number("stats", "total_commands_processed");
    // The INFO call itself and at most a background call or two, nothing per scrape (each
    // scrape read both budgets from the store before).
    assert!(
        after - before <= 4,
        "20 scrapes cost {} store commands",
        after - before
    );
    assert_eq!(common::get(metrics, "/readyz").await.status, 200);
}

mod memory {
    on_both_stores!(
        another_tenants_rule_cannot_shrink_a_reservation,
        remote_content_is_counted_with_an_allowance,
        long_user_ids_are_refused,
        user_scopes_belong_to_their_tenant_and_escape_injectively,
        ipv6_clients_are_scoped_by_network,
        ip_rules_may_group_networks
    );
}
