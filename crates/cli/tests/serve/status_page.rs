//! The operator's status page of a running `tollgate serve`, in headless Chromium: a screenshot,
//! and what the page shows (policy version, budget bars with the store's figures, leases,
//! refusals by reason, kill switches, rules) checked against the JSON API. Its forms set and
//! lift a kill switch; a request without the token, or a form without the page's token, is
//! refused. `.ci/run` installs Chromium; elsewhere install it (Debian: `chromium`) or set
//! `TOLLGATE_CHROMIUM`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use tollgate_sim::{Sim, SimConfig};

use common::start_instance_with;

const TOKEN: &str = "status-page-token-0123456789";
const KEY: &str = "sk-page-acme";

fn chromium() -> PathBuf {
    if let Ok(p) = std::env::var("TOLLGATE_CHROMIUM") {
        return p.into();
    }
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|d| d.join(name))
                    .find(|p| p.is_file())
            })
        })
        .unwrap_or_else(|| {
            panic!("Chromium is needed: run scripts/test, or install it (Debian: chromium) or set TOLLGATE_CHROMIUM")
        })
}

/// Chromium, headless, on `url` with `args`; its standard output.
fn browse(profile: &std::path::Path, args: &[String], url: &str) -> String {
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            "--hide-scrollbars",
            "--window-size=1280,1700",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One HTTP/1.1 request to `addr` (`host:port`): (status, headers and body as text).
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &str,
) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

fn api(addr: &str, path: &str) -> Value {
    let (status, text) = http(
        addr,
        "GET",
        path,
        &[("authorization", format!("Bearer {TOKEN}"))],
        "",
    );
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap()).unwrap()
}

fn chat(gateway: &str) -> u16 {
    let addr = gateway.trim_start_matches("http://");
    let body =
        r#"{"model":"gpt-4o","max_tokens":20,"messages":[{"role":"user","content":"hello"}]}"#;
    let (status, _) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("authorization", format!("Bearer {KEY}")),
            ("content-type", "application/json".into()),
        ],
        body,
    );
    status
}

/// The text of the first element after `marker` in `dom` whose class is `class`.
fn cell<'a>(dom: &'a str, marker: &str, class: &str) -> &'a str {
    let at = dom
        .find(marker)
        .unwrap_or_else(|| panic!("{marker} not in the page:\n{dom}"));
    let rest = &dom[at..];
    let open = format!("class=\"n {class}\">");
    let start = rest
        .find(&open)
        .unwrap_or_else(|| panic!("{class} after {marker}"))
        + open.len();
    let len = rest[start..].find('<').unwrap();
    &rest[start..start + len]
}

fn form_token(dom: &str) -> String {
    let marker = "name=\"csrf\" value=\"";
    let start = dom.find(marker).unwrap() + marker.len();
    dom[start..start + 64].to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_the_books_and_switches_kill_switches() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let (dir, token_file) = common::admin_token_file(TOKEN);
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "{}[[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
             [policy]\nversion = \"page-v7\"\n\
             [[policy.scopes]]\nname = \"all\"\nkey = \"global\"\nbudget = {{ tokens = 1000, period = \"day\" }}\n\
             [[policy.scopes]]\nname = \"small\"\nkey = \"global\"\nbudget = {{ tokens = 85, period = \"day\" }}\n\
             [[policy.scopes]]\nname = \"acme\"\nkey = \"tenant\"\nmatch = {{ tenant = \"acme\" }}\n\
             requests = {{ limit = 3, window = \"1m\" }}\nconcurrency = {{ limit = 2 }}\n\
             [[policy.scopes]]\nname = \"watch\"\nkey = \"tenant\"\nmode = \"shadow\"\n\
             budget = {{ tokens = 10, period = \"day\" }}\n",
            common::admin_head(&token_file, &sim.base_url()),
            tollgate_gateway::hash_key(KEY),
        ),
    )
    .unwrap();
    let (_gateway, urls) = start_instance_with(&config, &["admin"]);
    let [url, admin] = <[String; 2]>::try_from(urls).unwrap();
    let admin = admin.trim_start_matches("http://").to_owned();
    // Three served, two refused by the rate.
    let answers: Vec<u16> = (0..5).map(|_| chat(&url)).collect();
    assert_eq!(answers, [200, 200, 200, 429, 429]);

    // Without the token: 401, with the browser's prompt.
    let (status, text) = http(&admin, "GET", "/admin/ui", &[], "");
    assert_eq!(status, 401);
    assert!(
        text.to_ascii_lowercase()
            .contains("www-authenticate: basic"),
        "{text}"
    );

    let page = format!("http://operator:{TOKEN}@{admin}/admin/ui");
    let profile = tempfile::tempdir().unwrap();
    let shot = dir.path().join("status.png");
    browse(
        profile.path(),
        &[format!("--screenshot={}", shot.display())],
        &page,
    );
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG screenshot");
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    assert_eq!(width, 1280);
    assert!(
        png.len() > 20_000,
        "the screenshot shows a page, not a blank"
    );
    // Kept for people to look at.
    let _ = std::fs::copy(&shot, std::env::temp_dir().join("tollgate-status-page.png"));

    let dom = browse(profile.path(), &["--dump-dom".into()], &page);
    assert!(
        dom.contains("<td id=\"policy-version\">page-v7</td>"),
        "{dom}"
    );
    assert!(dom.contains("id=\"store-state\" class=\"ok\">ok<"));
    // The global budget's bar, with the store's figures.
    let usage = api(&admin, "/admin/usage?scope=all%7Cglobal");
    let settled = usage["settled"].as_u64().unwrap();
    assert!(settled > 0);
    let row = "data-scope=\"all|global\"";
    assert_eq!(cell(&dom, row, "settled"), format!("{settled} tokens"));
    assert_eq!(cell(&dom, row, "reserved"), "0 tokens");
    assert_eq!(cell(&dom, row, "limit"), "1,000 tokens");
    assert!(dom.contains(&format!("style=\"width: {}%\"", settled * 100 / 1000)));
    // Scopes by rule and value; resets in words and as an instant; a warning colour past four
    // fifths of a budget.
    assert!(dom.contains("<td>all</td><td>global</td>"), "{dom}");
    let resets = cell(&dom, row, "resets");
    assert!(
        resets.starts_with("in ") && resets.ends_with("Z)"),
        "{resets}"
    );
    assert!(
        dom.contains("data-scope=\"all|global\" data-level=\"ok\""),
        "{dom}"
    );
    assert!(
        dom.contains("data-scope=\"small|global\" data-level=\"warn\""),
        "{dom}"
    );
    // Each rule's limits in words; the shadow rule's would-be refusals; a page that refreshes
    // itself without a script.
    assert!(dom.contains("3 requests per 1m; 2 at once"), "{dom}");
    assert!(dom.contains("10 tokens per day (UTC)"), "{dom}");
    assert!(dom.contains("data-rule=\"watch\""), "{dom}");
    assert!(dom.contains("http-equiv=\"refresh\""), "{dom}");
    // Leases of the matched tenant scope, none held now.
    assert_eq!(cell(&dom, "data-scope=\"acme|tenant:acme\"", "held"), "0");
    // The two refusals, by reason.
    assert_eq!(
        cell(&dom, "data-reason=\"request_rate_limit\"", "total"),
        "2"
    );
    // The rules, the shadow one said so.
    assert!(
        dom.contains("<td>watch</td><td>tenant</td><td>shadow</td><td>budget</td>"),
        "{dom}"
    );
    assert!(dom.contains("None set."), "no kill switch yet");
    // No external assets, no script.
    assert!(
        !dom.contains("<script") && !dom.contains("src=\"http") && !dom.contains("href=\"http")
    );

    // A form without the page's token is refused; with it, the switch is set. The token is the
    // session's: the page sets a session cookie, and another session's token is refused.
    let basic = format!("Basic {}", base64_of(&format!("operator:{TOKEN}")));
    let (status, text) = http(
        &admin,
        "GET",
        "/admin/ui",
        &[("authorization", basic.clone())],
        "",
    );
    assert_eq!(status, 200);
    let cookie = set_cookie(&text);
    let form_headers = [
        ("authorization", basic.clone()),
        (
            "content-type",
            "application/x-www-form-urlencoded".to_owned(),
        ),
        ("cookie", cookie.clone()),
    ];
    let (status, _) = http(
        &admin,
        "POST",
        "/admin/ui/kill",
        &form_headers,
        "csrf=forged&target=tenant%3Aacme&reason=x",
    );
    assert_eq!(status, 403);
    let browsers = form_token(&dom);
    let csrf = form_token(&text);
    assert_ne!(browsers, csrf, "each session has its own token");
    let body = format!("csrf={browsers}&target=tenant%3Aacme&reason=x");
    let (status, _) = http(&admin, "POST", "/admin/ui/kill", &form_headers, &body);
    assert_eq!(status, 403, "another session's token");
    let body = format!("csrf={csrf}&target=tenant%3Aacme&reason=x");
    let (status, _) = http(&admin, "POST", "/admin/ui/kill", &form_headers[..2], &body);
    assert_eq!(status, 403, "the right token without its session");
    let body = format!("csrf={csrf}&target=tenant%3Aacme&reason=%3Cb%3Erunaway%3C%2Fb%3E");
    let (status, text) = http(&admin, "POST", "/admin/ui/kill", &form_headers, &body);
    assert_eq!(status, 303, "{text}");
    assert_eq!(chat(&url), 503, "the tenant is switched off");
    let dom = browse(profile.path(), &["--dump-dom".into()], &page);
    assert!(dom.contains("data-target=\"tenant:acme\""), "{dom}");
    assert!(
        dom.contains("&lt;b&gt;runaway&lt;/b&gt;"),
        "the reason is shown as text"
    );
    let kills = api(&admin, "/admin/kill");
    assert_eq!(kills["kills"][0]["target"], "tenant:acme");
    // Lifted from the page.
    let body = format!("csrf={csrf}&target=tenant%3Aacme");
    let (status, _) = http(&admin, "POST", "/admin/ui/lift", &form_headers, &body);
    assert_eq!(status, 303);
    assert_eq!(api(&admin, "/admin/kill")["kills"], Value::Array(vec![]));
    let dom = browse(profile.path(), &["--dump-dom".into()], &page);
    assert!(dom.contains("None set."));
    // An unknown target is a clear error, on a page of its own.
    let body = format!("csrf={csrf}&target=planet%3Aearth&reason=x");
    let (status, text) = http(&admin, "POST", "/admin/ui/kill", &form_headers, &body);
    assert_eq!(status, 400);
    assert!(text.contains("Unknown target"), "{text}");
}

/// The `name=value` of the session cookie an answer sets, checked to be one a browser keeps to
/// this site (`HttpOnly`, `SameSite=Strict`).
fn set_cookie(answer: &str) -> String {
    let line = answer
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
        .unwrap_or_else(|| panic!("no session cookie: {answer}"));
    assert!(
        line.contains("HttpOnly") && line.contains("SameSite=Strict"),
        "{line}"
    );
    let value = line.split_once(':').unwrap().1.trim();
    value.split(';').next().unwrap().to_owned()
}

fn base64_of(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}

/// Serves `html` on a loopback port of its own, to every request, until the test ends: another
/// site's page.
fn another_site(html: String) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\n\
                 connection: close\r\n\r\n{html}",
                html.len()
            );
            let _ = s.write_all(answer.as_bytes());
        }
    });
    port
}

/// A page of another site posts to the admin API from the operator's browser, as Chromium sends
/// it: a `text/plain` key creation (a JSON body by the back door), the status page's kill form,
/// a loss acknowledged. The credentials ride in the form's address, which Chromium sends as
/// Basic after the listener's challenge, as it sends credentials it holds: each answer the
/// browser shows is the cross-site refusal (a request without them would be 401), and nothing
/// changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_sites_page_cannot_write_through_the_operators_browser() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let (dir, token_file) = common::admin_token_file(TOKEN);
    let config = dir.path().join("gateway.toml");
    std::fs::write(&config, common::admin_head(&token_file, &sim.base_url())).unwrap();
    let (_gateway, urls) = start_instance_with(&config, &["admin"]);
    let admin = urls[1].trim_start_matches("http://").to_owned();
    let target = format!("http://operator:{TOKEN}@{admin}");
    let forms = [
        format!(
            "<form method=\"post\" enctype=\"text/plain\" action=\"{target}/admin/keys\">\
             <input name='{{\"tenant\":\"acme\",\"name\":\"planted\",\"x\":\"' value='\"}}'></form>"
        ),
        format!(
            "<form method=\"post\" action=\"{target}/admin/ui/kill\">\
             <input name=\"csrf\" value=\"guess\"><input name=\"target\" value=\"all\">\
             <input name=\"reason\" value=\"planted\"></form>"
        ),
        format!("<form method=\"post\" action=\"{target}/admin/store/acknowledge-loss\"></form>"),
    ];
    let profile = tempfile::tempdir().unwrap();
    for form in forms {
        let html = format!(
            "<!doctype html><html><body>{form}\
             <script>document.forms[0].submit()</script></body></html>"
        );
        // `localhost` is another site than `127.0.0.1`.
        let page = format!("http://localhost:{}/", another_site(html));
        let dom = browse(
            profile.path(),
            &["--virtual-time-budget=5000".into(), "--dump-dom".into()],
            &page,
        );
        assert!(dom.contains("cross_site_request"), "{form}\n{dom}");
    }
    assert_eq!(api(&admin, "/admin/keys")["keys"], Value::Array(vec![]));
    assert_eq!(api(&admin, "/admin/kill")["kills"], Value::Array(vec![]));
}
