//! The admin listener attacked as a web-security reviewer would: a page of another site making a
//! logged-in operator's browser post (its Basic credentials sent by the browser itself), wrong
//! tokens by the thousand, lower-case schemes, a scope named twice. Each request is sent as the
//! browser sends it, headers and all.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::instance::{Instance, TOKEN, sim};
use serde_json::{Value, json};

/// One admin call with exactly these headers: (status, headers, JSON answer).
async fn call(
    on: &Instance,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, http::HeaderMap, Value) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{}{path}", on.admin));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = client
        .request(
            req.body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_owned(),
            )))
            .unwrap(),
        )
        .await
        .unwrap();
    let (status, h) = (r.status().as_u16(), r.headers().clone());
    let body = http_body_util::BodyExt::collect(r.into_body())
        .await
        .unwrap()
        .to_bytes();
    (
        status,
        h,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    )
}

/// One admin call without a body, with `authorization`.
async fn authed(
    on: &Instance,
    method: &str,
    path: &str,
    authorization: &str,
) -> (u16, http::HeaderMap, Value) {
    call(on, method, path, &[("authorization", authorization)], "").await
}

/// The operator sets a kill switch, which is answered 200.
async fn operator_kills(gw: &Instance) {
    let reason = "the operator got in";
    let kill = json!({"target": "tenant:beta", "reason": reason});
    let (status, v) = gw.admin("POST", "/admin/kill", Some(kill)).await;
    assert_eq!(status, 200, "{v}");
}

fn basic() -> String {
    use base64::Engine;
    let creds = base64::engine::general_purpose::STANDARD.encode(format!("operator:{TOKEN}"));
    format!("Basic {creds}")
}

/// A page of another site cannot make the operator's browser change anything through the JSON
/// API: a `text/plain` or form body (what a page may post anywhere) is refused, and so is any
/// request that says it comes from another site (`Sec-Fetch-Site`, `Origin`); nothing is
/// created, and a loss is not acknowledged. The operator's own calls still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_site_cannot_write_through_the_operators_browser() {
    let sim = sim().await;
    let gw = Instance::start(&sim, "").await;
    let auth = basic();
    let key = r#"{"tenant":"acme","name":"x"}"#;
    let host = gw.admin.to_string();
    for (headers, code) in [
        (vec![("content-type", "text/plain")], "json_required"),
        (
            vec![("content-type", "application/x-www-form-urlencoded")],
            "json_required",
        ),
        (
            vec![
                ("content-type", "application/json"),
                ("sec-fetch-site", "cross-site"),
            ],
            "cross_site_request",
        ),
        (
            vec![
                ("content-type", "application/json"),
                ("origin", "https://evil.example"),
            ],
            "cross_site_request",
        ),
    ] {
        let mut h = headers.clone();
        h.push(("authorization", &auth));
        let (status, _, v) = call(&gw, "POST", "/admin/keys", &h, key).await;
        assert_eq!(v["error"]["code"], code, "{headers:?}: {v}");
        assert!(status == 400 || status == 403, "{status}");
        let (status, _, v) = call(&gw, "POST", "/admin/store/acknowledge-loss", &h, "{}").await;
        assert!(status == 400 || status == 403, "{headers:?}: {v}");
    }
    let (_, listed) = gw.admin("GET", "/admin/keys", None).await;
    assert_eq!(listed["keys"], json!([]), "nothing was created");
    // The operator's own: JSON, from the listener's own origin, or from no page at all.
    let origin = format!("http://{host}");
    let (status, h, v) = call(
        &gw,
        "POST",
        "/admin/keys",
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
            ("origin", &origin),
            ("sec-fetch-site", "same-origin"),
        ],
        key,
    )
    .await;
    assert_eq!(status, 201, "{v}");
    // An answer that carries a secret is never kept by a cache, nor sniffed.
    assert_eq!(h["cache-control"], "no-store");
    assert_eq!(h["x-content-type-options"], "nosniff");
}

/// Auth schemes are case-insensitive; wrong tokens are counted by route in the metrics (and
/// logged, at most once a second); a tenant's token cannot read a scope that names its tenant
/// beside another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_are_read_as_the_standard_says_and_failures_are_seen() {
    let sim = sim().await;
    let dir = tempfile::tempdir().unwrap();
    let acme = "acme-admin-token-0123456789";
    std::fs::write(dir.path().join("acme"), acme).unwrap();
    let text = format!(
        "[[admin.tenants]]\ntenant = \"acme\"\ntoken_file = \"{}\"\n",
        dir.path().join("acme").display()
    );
    let gw = Instance::start(&sim, &text).await;
    let lower = format!("bearer {TOKEN}");
    let (status, h, _) = authed(&gw, "GET", "/admin/status", &lower).await;
    assert_eq!(status, 200);
    assert_eq!(h["x-content-type-options"], "nosniff");
    // Failed logins on a route by a kind of principal.
    let failures = |metrics: &str, route: &str, principal: &str| -> u64 {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("tollgate_admin_login_failures_total{")
                    && l.contains(&format!("route=\"{route}\""))
                    && l.contains(&format!("principal=\"{principal}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let before = failures(&gw.metrics().await, "keys", "unknown");
    for i in 0..50 {
        let wrong = format!("Bearer wrong-token-{i:04}-0123456789");
        let (status, _, _) =
            call(&gw, "GET", "/admin/keys", &[("authorization", &wrong)], "").await;
        assert_eq!(status, 401);
    }
    assert!(failures(&gw.metrics().await, "keys", "unknown") >= before + 50);
    // A tenant's token beyond its tenant is counted under its kind.
    assert_eq!(failures(&gw.metrics().await, "reload", "tenant"), 0);
    let (status, _, _) = authed(&gw, "POST", "/admin/reload", &format!("Bearer {acme}")).await;
    assert_eq!(status, 403);
    assert_eq!(failures(&gw.metrics().await, "reload", "tenant"), 1);

    let bearer = format!("Bearer {acme}");
    for scope in [
        "tenant%7Ctenant%3Abeta%2Ftenant%3Aacme",
        "tenant%7Ctenant%3Abeta",
    ] {
        let path = format!("/admin/usage?scope={scope}");
        let (status, _, v) = call(&gw, "GET", &path, &[("authorization", &bearer)], "").await;
        assert_eq!(status, 403, "{scope}: {v}");
    }
    let (status, _, v) = authed(
        &gw,
        "GET",
        "/admin/usage?scope=tenant%7Ctenant%3Aacme",
        &bearer,
    )
    .await;
    assert_eq!(status, 200, "{v}");
}

/// A tenant's token stalling bodies on many connections does not lock the operator out: four
/// of its calls are in flight at most (the others are answered 429 `admin_busy` at once and
/// their connections closed), each stalled body is answered 408 within the listener's
/// `body_timeout` and its connection closed, and the operator's kill switch goes through
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_do_not_lock_the_operator_out() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = sim().await;
    let dir = tempfile::tempdir().unwrap();
    let acme = "acme-admin-token-0123456789";
    std::fs::write(dir.path().join("acme"), acme).unwrap();
    let text = format!(
        "[server]\nbody_timeout = \"1s\"\n\
         [[admin.tenants]]\ntenant = \"acme\"\ntoken_file = \"{}\"\n",
        dir.path().join("acme").display()
    );
    let gw = Instance::start(&sim, &text).await;
    let mut stalled = Vec::new();
    for _ in 0..12 {
        let mut s = tokio::net::TcpStream::connect(gw.admin).await.unwrap();
        let head = format!(
            "POST /admin/keys HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer {acme}\r\n\
             content-type: application/json\r\ncontent-length: 100\r\n\r\n{{",
            gw.admin
        );
        s.write_all(head.as_bytes()).await.unwrap();
        stalled.push(s);
    }
    let started = std::time::Instant::now();
    // Meanwhile, the operator gets in.
    operator_kills(&gw).await;
    let mut answers = Vec::new();
    for mut s in stalled {
        let mut answer = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            s.read_to_end(&mut answer),
        )
        .await
        .expect("the connection is closed")
        .unwrap();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let code = ["body_timeout", "admin_busy"]
            .into_iter()
            .find(|c| answer.contains(c))
            .unwrap_or_else(|| panic!("{answer}"));
        answers.push((answer[9..12].to_owned(), code));
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(3));
    let timed_out = answers
        .iter()
        .filter(|a| *a == &("408".to_owned(), "body_timeout"))
        .count();
    let busy = answers
        .iter()
        .filter(|a| *a == &("429".to_owned(), "admin_busy"))
        .count();
    assert_eq!((timed_out, busy), (4, 8), "{answers:?}");
}

/// Silent sockets and idle keep-alives fill the admin listener (sixty-four connections from
/// four addresses that never finish a request head, within a long `header_timeout`), and the
/// operator's kill switch still goes through: a full listener closes its longest-idle
/// connection to take a new one. One of the silent sockets is the one closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_do_not_keep_the_operator_out() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = sim().await;
    let gw = Instance::start(&sim, "[server]\nheader_timeout = \"60s\"\n").await;
    let mut silent = Vec::new();
    for n in 2..=5u8 {
        for _ in 0..16 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket
                .bind(std::net::SocketAddr::from(([127, 0, 0, n], 0)))
                .unwrap();
            let mut s = socket.connect(gw.admin).await.unwrap();
            s.write_all(b"GET /admin/status HTTP/1.1\r\n")
                .await
                .unwrap();
            silent.push(s);
        }
    }
    // Every place is taken (the listener holds 64): one more address is turned away, unless
    // an idle connection makes room.
    operator_kills(&gw).await;
    let (status, v) = gw.admin("GET", "/admin/kill", None).await;
    assert_eq!(
        (status, v["kills"][0]["target"].clone()),
        (200, json!("tenant:beta"))
    );
    let mut closed = 0;
    for s in &mut silent {
        let mut buf = [0u8; 64];
        if let Ok(Ok(0)) =
            tokio::time::timeout(std::time::Duration::from_millis(20), s.read(&mut buf)).await
        {
            closed += 1;
        }
    }
    assert!((1..=2).contains(&closed), "{closed} silent sockets closed");
}
