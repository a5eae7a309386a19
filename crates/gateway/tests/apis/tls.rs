//! HTTPS upstreams: the gateway reaches the simulator through a TLS terminator with a
//! self-signed certificate, trusted through the upstream's `ca_file`; without it, Mozilla's
//! roots refuse the certificate, and the request fails cleanly with nothing held. Through an
//! HTTP proxy's `CONNECT` tunnel too, with its credentials.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tollgate_gateway::config::GatewayConfig;
use tollgate_gateway::store::AnyStore;
use tollgate_testkit::sim::{Sim, SimConfig};

const KEY: &str = "sk-test-acme";
const UPSTREAM_KEY: &str = "upstream-secret";

/// A TLS terminator on a free loopback port in front of `backend`, with a new self-signed
/// certificate for 127.0.0.1. Returns its port, the certificate as PEM, and the number of
/// handshakes it has completed.
async fn tls_terminator(backend: std::net::SocketAddr) -> (u16, String, Arc<AtomicUsize>) {
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(signing_key.serialize_der()));
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![CertificateDer::from(cert.der().to_vec())], key)
        .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let handshakes = Arc::new(AtomicUsize::new(0));
    let done = handshakes.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let done = done.clone();
            tokio::spawn(async move {
                // A handshake the client aborts (an untrusted certificate) ends here.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                done.fetch_add(1, Ordering::SeqCst);
                let mut up = tokio::net::TcpStream::connect(backend).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
            });
        }
    });
    (port, cert.pem(), handshakes)
}

/// The `Proxy-Authorization` the test proxy requires: `user:secret`, as the gateway sends it.
const PROXY_AUTH: &str = "Basic dXNlcjpzZWNyZXQ=";

/// A minimal HTTP proxy on a free loopback port: `CONNECT host:port` with [`PROXY_AUTH`] opens a
/// tunnel to it, anything else gets a 407. Returns its port and the targets it tunnelled to.
async fn connect_proxy() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let targets = Arc::new(Mutex::new(Vec::new()));
    let seen = targets.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
                    if client.read_exact(&mut byte).await.is_err() {
                        return;
                    }
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head).to_string();
                let target = head
                    .strip_prefix("CONNECT ")
                    .and_then(|r| r.split(' ').next())
                    .map(str::to_owned);
                let authorized = head
                    .lines()
                    .any(|l| l.eq_ignore_ascii_case(&format!("proxy-authorization: {PROXY_AUTH}")));
                let (Some(target), true) = (target, authorized) else {
                    let _ = client
                        .write_all(b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic\r\ncontent-length: 0\r\n\r\n")
                        .await;
                    return;
                };
                let Ok(mut up) = tokio::net::TcpStream::connect(&target).await else {
                    return;
                };
                seen.lock().unwrap().push(target);
                if client
                    .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    .await
                    .is_ok()
                {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
                }
            });
        }
    });
    (port, targets)
}

struct Env {
    sim: Sim,
    addr: std::net::SocketAddr,
    store: AnyStore,
    handshakes: Arc<AtomicUsize>,
    /// The terminator's port.
    tls_port: u16,
    _dir: tempfile::TempDir,
}

/// A gateway on the memory store whose one upstream is `https://127.0.0.1:PORT`, trusting the
/// terminator's certificate when `trust` is set and Mozilla's roots otherwise.
async fn env(trust: bool) -> Env {
    env_with(trust, "").await
}

/// [`env`], with `extra` lines in the upstream's table.
async fn env_with(trust: bool, extra: &str) -> Env {
    let sim = Sim::start(SimConfig {
        api_key: Some(UPSTREAM_KEY.into()),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let (port, pem, handshakes) = tls_terminator(sim.addr).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("upstream-ca.pem");
    std::fs::write(&ca, pem).unwrap();
    let ca_line = if trust {
        format!("ca_file = {:?}\n", ca.display().to_string())
    } else {
        String::new()
    };
    let text = format!(
        "[[upstreams]]\nname = \"sim\"\nbase_url = \"https://127.0.0.1:{port}\"\n{ca_line}{extra}models = [\"gpt-4o\"]\n\
         [[keys]]\nname = \"acme\"\nhash = \"{}\"\ntenant = \"acme\"\n\
         [[policy.scopes]]\nkey = \"tenant\"\nrequests = {{ limit = 100, window = \"1m\" }}\n\
         concurrency = {{ limit = 4, lease_ttl = \"30s\" }}\nbudget = {{ tokens = 100000, period = \"day\" }}\n",
        tollgate_gateway::hash_key(KEY),
    );
    let (addr, store) = common::spawn_gateway(&text, UPSTREAM_KEY).await;
    Env {
        sim,
        addr,
        store,
        handshakes,
        tls_port: port,
        _dir: dir,
    }
}

async fn send(env: &Env, body: Value) -> (u16, Bytes) {
    let auth = [("authorization", format!("Bearer {KEY}"))];
    let r = common::post(
        env.addr,
        "/v1/chat/completions",
        &auth,
        serde_json::to_vec(&body).unwrap(),
    )
    .await;
    (r.status, r.body)
}

fn chat(stream: bool) -> Value {
    json!({"model": "gpt-4o", "max_tokens": 8, "stream": stream,
        "messages": [{"role": "user", "content": "Hello there!"}]})
}

/// The tenant's settled total once nothing is held any more; fails after 3 s.
async fn settles_to_nothing_held(env: &Env) -> u64 {
    common::tenant_usage_when(&env.store, "still held", |u| {
        u.leases == 0 && u.reserved == 0
    })
    .await
    .settled
}

#[tokio::test]
async fn https_upstream_with_its_own_ca_serves_and_streams() {
    let env = env(true).await;
    let (status, body) = send(&env, chat(false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 8);
    // The simulator saw the gateway's own key, over the TLS connection.
    assert_eq!(
        env.sim
            .stats()
            .requests
            .get(&format!("Bearer {UPSTREAM_KEY}")),
        Some(&1)
    );
    assert!(env.handshakes.load(Ordering::SeqCst) >= 1);

    let (status, body) = send(&env, chat(true)).await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert_eq!(text.matches("\"content\":\" tok\"").count(), 8, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // Both settled from the upstream's usage: 10 prompt tokens and 8 completion tokens each.
    common::instance::until("both settled", async || {
        settles_to_nothing_held(&env).await == 2 * (10 + 8)
    })
    .await;
}

#[tokio::test]
async fn untrusted_upstream_certificate_is_a_clean_502() {
    let env = env(false).await;
    let (status, body) = send(&env, chat(false)).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "upstream_unreachable", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("certificate"), "{message}");
    // The handshake failed: nothing reached the simulator, nothing was charged or kept.
    assert_eq!(env.handshakes.load(Ordering::SeqCst), 0);
    assert!(env.sim.stats().requests.is_empty());
    assert_eq!(settles_to_nothing_held(&env).await, 0);
    // And the gateway goes on serving: the same refusal again, not a hang or a crash.
    let (status, _) = send(&env, chat(true)).await;
    assert_eq!(status, 502);
}

#[tokio::test]
async fn https_upstream_through_a_connect_proxy() {
    let (proxy, targets) = connect_proxy().await;
    let env = env_with(
        true,
        &format!("proxy = \"http://user:secret@127.0.0.1:{proxy}\"\n"),
    )
    .await;
    let (status, body) = send(&env, chat(false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (status, _) = send(&env, chat(true)).await;
    assert_eq!(status, 200);
    // Through the tunnel, to the terminator; TLS inside it.
    let seen = targets.lock().unwrap().clone();
    assert!(!seen.is_empty());
    assert!(
        seen.iter()
            .all(|t| *t == format!("127.0.0.1:{}", env.tls_port)),
        "{seen:?}"
    );
    assert!(env.handshakes.load(Ordering::SeqCst) >= 1);
    assert_eq!(settles_to_nothing_held(&env).await, 2 * (10 + 8));

    // Wrong credentials: the proxy answers 407, the request a clean 502.
    let env = env_with(
        true,
        &format!("proxy = \"http://user:wrong@127.0.0.1:{proxy}\"\n"),
    )
    .await;
    let (status, body) = send(&env, chat(false)).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("proxy authorization required"),
        "{message}"
    );
    assert!(env.sim.stats().requests.is_empty());
    assert_eq!(settles_to_nothing_held(&env).await, 0);
}

fn config_error(upstream_extra: &str, base_url: &str) -> String {
    let text = format!(
        "[[upstreams]]\nname = \"sim\"\nbase_url = \"{base_url}\"\n{upstream_extra}models = [\"gpt-4o\"]\n"
    );
    GatewayConfig::from_toml(&text)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
}

#[test]
fn ca_file_errors_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let cases = [
        (
            format!("ca_file = {:?}\n", not_pem.display().to_string()),
            "http://127.0.0.1:9",
            "applies only to an https:// base_url",
        ),
        (
            format!("ca_file = {:?}\n", missing.display().to_string()),
            "https://127.0.0.1:9",
            "cannot read",
        ),
        (
            format!("ca_file = {:?}\n", not_pem.display().to_string()),
            "https://127.0.0.1:9",
            "holds no PEM certificate",
        ),
    ];
    for (extra, url, expected) in [
        (
            "proxy = \"http://127.0.0.1:3128\"\n",
            "http://127.0.0.1:9",
            "applies only to an https:// base_url",
        ),
        (
            "proxy = \"https://127.0.0.1:3128\"\n",
            "https://127.0.0.1:9",
            "an HTTP proxy",
        ),
    ] {
        let e = config_error(extra, url);
        assert!(
            e.starts_with("upstreams[0].proxy: ") && e.contains(expected),
            "{extra} {url}: {e}"
        );
    }
    for (extra, url, expected) in cases {
        let e = config_error(&extra, url);
        assert!(
            e.starts_with("upstreams[0].ca_file: ") && e.contains(expected),
            "{extra} {url}: {e}"
        );
    }
    // An https upstream without a CA file is valid: Mozilla's roots.
    assert_eq!(config_error("", "https://api.openai.com"), "");
}
