//! `tollgate serve --demo` does what its banner says: the budget command it prints is refused
//! on its third sending, and its admin listener, token and status page work as printed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, Read, Write};

/// One HTTP/1.1 exchange with `addr` (`host:port`): the whole response as text.
fn exchange(addr: &str, method: &str, path: &str, headers: &str, body: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{headers}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    resp
}

/// The value after `label` on the banner's line that starts with it.
fn field<'a>(banner: &'a [String], label: &str) -> &'a str {
    let line = banner
        .iter()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no {label} in {banner:?}"));
    line.trim_start()[label.len()..]
        .split_whitespace()
        .next()
        .unwrap()
}

/// The body of the banner's `-d '...'` line that holds `needle`.
fn printed_body(banner: &[String], needle: &str) -> String {
    let line = banner
        .iter()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no command with {needle} in the banner"));
    line.trim()
        .trim_start_matches("-d '")
        .trim_end_matches('\'')
        .to_owned()
}

#[test]
fn the_demo_does_what_its_banner_says() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--demo", "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut banner = Vec::new();
    for _ in 0..60 {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let end = line.contains("Ctrl-C");
        banner.push(line);
        if end {
            break;
        }
    }
    let gateway = field(&banner, "gateway:")
        .trim_start_matches("http://")
        .to_owned();
    let admin = field(&banner, "admin:")
        .trim_start_matches("http://")
        .to_owned();
    let token = banner
        .iter()
        .find_map(|l| l.split("(token: ").nth(1))
        .unwrap()
        .trim_end()
        .trim_end_matches(')')
        .to_owned();
    // The budget command, as printed, three times: the third is refused.
    let body = printed_body(&banner, "\"gpt-4o\",\"max_tokens\":256");
    let body = body.as_str();
    let auth = "authorization: Bearer sk-tollgate-demo\r\n";
    // The classes, as printed: the VIP key may hold all of the model's slots.
    let printed = banner
        .iter()
        .find(|l| l.contains("/v1/limits?model=gpt-4o"))
        .expect("the limits command");
    let vip = printed
        .split("Bearer ")
        .nth(1)
        .unwrap()
        .trim()
        .trim_end_matches('\'');
    let limits = exchange(
        &gateway,
        "GET",
        "/v1/limits?model=gpt-4o",
        &format!("authorization: Bearer {vip}\r\n"),
        "",
    );
    assert!(limits.contains(r#""class":"critical""#), "{limits}");
    assert!(
        limits.contains(r#""kept_for_higher_classes":0"#),
        "{limits}"
    );
    let mine = exchange(&gateway, "GET", "/v1/limits?model=gpt-4o", auth, "");
    assert!(mine.contains(r#""kept_for_higher_classes":2"#), "{mine}");
    let answers: Vec<String> = (0..3)
        .map(|_| exchange(&gateway, "POST", "/v1/chat/completions", auth, body))
        .collect();
    let codes: Vec<&str> = answers.iter().map(|a| &a[9..12]).collect();
    assert_eq!(codes, ["200", "200", "429"]);
    // The second went past 1% of the key's money: degraded, as the banner says.
    let degraded = |a: &str| {
        a.to_ascii_lowercase()
            .contains("x-tollgate-degraded-from: gpt-4o")
    };
    assert!(
        !degraded(&answers[0]) && degraded(&answers[1]),
        "{answers:?}"
    );
    let refused = exchange(&gateway, "POST", "/v1/chat/completions", auth, body);
    assert!(refused.contains("budget_limit"), "{refused}");
    assert!(
        refused
            .to_ascii_lowercase()
            .contains("x-should-retry: false"),
        "{refused}"
    );
    // The cost cap, as printed (with the VIP key, whose rate is not spent): 400 in dollars.
    let costly = printed_body(&banner, "\"claude-sonnet-4\",\"max_tokens\":256");
    let costly = costly.as_str();
    let headers = format!("x-api-key: {vip}\r\nanthropic-version: 2023-06-01\r\n");
    let r = exchange(&gateway, "POST", "/v1/messages", &headers, costly);
    assert!(
        r.starts_with("HTTP/1.1 400")
            && r.contains("request_cost_limit")
            && r.contains("limit $0.003"),
        "{r}"
    );
    // A reservation, as printed, and its settlement.
    let edge = banner
        .iter()
        .find(|l| l.contains("/v1/reservations -H"))
        .and_then(|l| l.split("Bearer ").nth(1))
        .expect("the reservation command")
        .trim()
        .trim_end_matches(['\\', ' '])
        .trim_end_matches('\'');
    let edge = format!("authorization: Bearer {edge}\r\n");
    let asked = printed_body(&banner, "\"endpoint\":\"/v1/chat/completions\"");
    let r = exchange(&gateway, "POST", "/v1/reservations", &edge, &asked);
    assert!(r.starts_with("HTTP/1.1 201"), "{r}");
    let json: serde_json::Value =
        serde_json::from_str(r.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(json["body"]["max_tokens"], 50, "{json}");
    let settled = printed_body(&banner, "\"prompt_tokens\":8");
    let path = format!("/v1/reservations/{}/settle", json["id"].as_str().unwrap());
    let r = exchange(
        &gateway,
        "POST",
        &path,
        &edge,
        settled.trim_start_matches("-H 'content-type: application/json' -d '"),
    );
    assert!(
        r.starts_with("HTTP/1.1 200") && r.contains(r#""status":"settled""#),
        "{r}"
    );
    // The admin listener, with the printed token: the kill switch, the status page, metrics.
    let basic = {
        use base64::Engine;
        let b = base64::engine::general_purpose::STANDARD.encode(format!("admin:{token}"));
        format!("authorization: Basic {b}\r\n")
    };
    let kill = r#"{"target":"tenant:demo","reason":"trying the kill switch"}"#;
    assert!(exchange(&admin, "POST", "/admin/kill", &basic, kill).starts_with("HTTP/1.1 200"));
    let r = exchange(&gateway, "POST", "/v1/chat/completions", auth, body);
    assert!(
        r.starts_with("HTTP/1.1 503") && r.contains("kill_switch"),
        "{r}"
    );
    let status = exchange(&admin, "GET", "/admin/status", &basic, "");
    assert!(status.contains("trying the kill switch"), "{status}");
    let lifted = exchange(&admin, "DELETE", "/admin/kill/tenant:demo", &basic, "");
    assert!(lifted.starts_with("HTTP/1.1 200"), "{lifted}");
    assert!(exchange(&admin, "GET", "/admin/ui", &basic, "").starts_with("HTTP/1.1 200"));
    assert!(exchange(&admin, "GET", "/metrics", &basic, "").contains("tollgate_decisions_total"));
    child.kill().unwrap();
    child.wait().unwrap();
}
