//! The `tollgate` binary end to end: the Day 28 replay's published figures, mismatch exit codes,
//! and `check` errors that name the field.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;

use serde_json::{Value, json};

use crate::common;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
}

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// `tollgate replay --format json` of a fixture of the repository, which must succeed.
fn replay_json(fixture: &str) -> Value {
    let out = bin()
        .args(["replay", "--format", "json"])
        .arg(repo(fixture))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn day28_replay_reproduces_the_published_figures() {
    let v = replay_json("fixtures/day28.toml");
    let top: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(top, ["paths"]);
    let u = &v["paths"]["unbounded"];
    let l = &v["paths"]["layered_controls"];
    let fig = |p: &Value, k: &str| p[k].as_u64().unwrap_or_else(|| panic!("missing {k}"));
    for (k, unbounded, layered) in [
        ("requests", 19, 19),
        ("accepted", 19, 12),
        ("rejected", 0, 7),
        ("accepted_estimated_tokens", 1132, 590),
        ("settled_tokens", 625, 495),
        ("reserved_outstanding_tokens", 442, 40),
        ("max_concurrency", 3, 2),
        ("budget_overrun_tokens", 100, 0),
    ] {
        assert_eq!((fig(u, k), fig(l, k)), (unbounded, layered), "{k}");
    }
    // Seven refusals, every one of the six reasons, one of them twice.
    let by = l["rejections_by_reason"].as_object().unwrap();
    assert_eq!(by.len(), 6);
    assert_eq!(by.values().map(|n| n.as_u64().unwrap()).sum::<u64>(), 7);
    assert_eq!(by["request_rate_limit"], 2);
    assert!(u["rejections_by_reason"].as_object().unwrap().is_empty());
    // Every path carries exactly the agreed keys.
    let keys: Vec<&String> = l.as_object().unwrap().keys().collect();
    let mut want = vec![
        "accepted",
        "accepted_estimated_tokens",
        "budget_overrun_tokens",
        "cases",
        "max_concurrency",
        "rejected",
        "rejections_by_reason",
        "requests",
        "reserved_outstanding_tokens",
        "settled_tokens",
        "settled_tool_calls",
        "replayed",
    ];
    want.sort();
    assert_eq!(keys, want);
    let cases = l["cases"].as_object().unwrap();
    assert_eq!(cases.len(), 7);
    assert!(cases.values().all(|c| c["predictions_matched"] == true));
    // The 150 total-token case: 80 + 80 refused though each half is under 100.
    assert_eq!(cases["total"]["rejected"], 1);
}

#[test]
fn replay_is_deterministic() {
    let run = || {
        bin()
            .args(["replay", "--format", "json"])
            .arg(repo("fixtures/day28.toml"))
            .output()
            .unwrap()
            .stdout
    };
    assert_eq!(run(), run());
}

#[test]
fn a_wrong_prediction_fails_the_replay() {
    let text = std::fs::read_to_string(repo("fixtures/day28.toml")).unwrap();
    // Predict that the third concurrent request is admitted: it is not.
    let text = text.replace(
        r#"max_output_tokens = 10, expect = "concurrency_limit" }"#,
        r#"max_output_tokens = 10, expect = "admit" }"#,
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wrong.toml");
    std::fs::write(&path, text).unwrap();
    let out = bin().arg("replay").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("case concurrency request conc-3: expected admit, got concurrency_limit"),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("NO"));
}

#[test]
fn check_names_the_bad_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.toml");
    std::fs::write(&path, "[[scopes]]\nkey = \"user\"\n[[scopes]]\nkey = \"tenant\"\nbudget = { tokens = 5, period = \"fortnight\" }\n").unwrap();
    let out = bin()
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("policy.scopes[1].budget.period"), "{err}");
    std::fs::write(
        &path,
        "[[scopes]]\nkey = \"user\"\nrequests = { limit = 5, window = \"1m\" }\n",
    )
    .unwrap();
    let out = bin()
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success());
}

/// `check` takes what `serve --config` takes: the README runs one before the other.
#[test]
fn check_validates_gateway_configurations_and_fixtures() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    let gateway = |upstream_extra: &str, period: &str| {
        format!(
            "[[upstreams]]\nname = \"openai\"\nbase_url = \"https://api.openai.com\"\n{upstream_extra}models = [\"gpt-4o\"]\n\
             [[keys]]\nhash = \"sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\"\ntenant = \"acme\"\n\
             [[policy.scopes]]\nkey = \"tenant\"\nbudget = {{ tokens = 5000, period = \"{period}\" }}\n"
        )
    };
    let check = |text: String| {
        std::fs::write(&path, text).unwrap();
        bin()
            .args(["check", "--config"])
            .arg(&path)
            .output()
            .unwrap()
    };
    let out = check(gateway("", "day"));
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .starts_with("ok: gateway configuration with 1 upstreams, 1 keys"),
        "{out:?}"
    );
    for (text, field) in [
        (gateway("", "fortnight"), "policy.scopes[0].budget.period"),
        (
            gateway("ca_file = \"/nonexistent/ca.pem\"\n", "day"),
            "upstreams[0].ca_file",
        ),
    ] {
        let out = check(text);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{field}: {err}");
    }
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/day28.toml");
    let out = bin().args(["check", "--config", fixture]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("ok: replay fixture with 7 cases"),
        "{out:?}"
    );
}

#[test]
fn count_prints_what_the_gateway_charges() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("req.json");
    std::fs::write(&path, r#"{"model":"gpt-4","max_tokens":20,"messages":[{"role":"user","content":"Hello there!"}]}"#).unwrap();
    let out = bin()
        .args(["count", "--model", "gpt-4o", "--request"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["model"], "gpt-4o");
    assert_eq!(v["encoding"], "o200k_base");
    assert_eq!(v["input_tokens"], 3 + 1 + 3 + 3);
    assert_eq!(v["max_output_tokens"], 20);
    assert_eq!(v["exact"], true);
    assert_eq!(v.as_object().unwrap().len(), 5);
    // From standard input, an embeddings body: no output cap.
    let mut child = bin()
        .args(["count", "--model", "text-embedding-3-small"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), br#"{"input":"hello world"}"#)
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["input_tokens"].as_u64(), v["max_output_tokens"].is_null()),
        (Some(2), true)
    );
    // A Responses API body, told from embeddings by its input items: the chat rule, flagged.
    std::fs::write(
        &path,
        r#"{"model":"gpt-4o","max_output_tokens":20,"input":[{"role":"user","content":"Hello there!"}]}"#,
    )
    .unwrap();
    let out = bin()
        .args(["count", "--request"])
        .arg(&path)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&v["input_tokens"], &v["max_output_tokens"], &v["exact"]),
        (&json!(3 + 1 + 3 + 3), &json!(20), &json!(false))
    );
    let out = bin()
        .args(["count", "--model", "gpt-4o", "--request"])
        .arg(dir.path().join("missing.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// `tollgate serve --demo` starts, prints what to try, and does what it says: five requests
/// pass, the sixth gets 429 with Retry-After; OpenAI's chat and Responses APIs and Anthropic's
/// in turns.
#[test]
fn the_demo_turns_200s_into_429s() {
    use std::io::{BufRead, Read, Write};
    let mut child = bin()
        .args(["serve", "--demo", "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut addr = None;
    for _ in 0..20 {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        if let Some(rest) = line.trim().strip_prefix("gateway:") {
            addr = rest
                .split_whitespace()
                .next()
                .map(|u| u.trim_start_matches("http://").to_owned());
            break;
        }
    }
    let addr = addr.expect("the demo prints its address");
    let openai = (
        "/v1/chat/completions",
        "authorization: Bearer sk-tollgate-demo",
        r#"{"model":"gpt-4o","max_tokens":10,"messages":[{"role":"user","content":"Hello!"}]}"#,
    );
    let anthropic = (
        "/v1/messages",
        "x-api-key: sk-tollgate-demo\r\nanthropic-version: 2023-06-01",
        r#"{"model":"claude-sonnet-4","max_tokens":10,"messages":[{"role":"user","content":"Hello!"}]}"#,
    );
    let responses = (
        "/v1/responses",
        "authorization: Bearer sk-tollgate-demo",
        r#"{"model":"gpt-4o","max_output_tokens":10,"input":"Hello!"}"#,
    );
    let mut statuses = Vec::new();
    for i in 0..6 {
        let (path, auth, body) = [openai, responses, anthropic][i % 3];
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{auth}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        statuses.push(resp[9..12].to_owned());
        if statuses.len() == 6 {
            assert!(resp.to_ascii_lowercase().contains("retry-after:"), "{resp}");
            assert!(resp.contains("request_rate_limit"));
            // Anthropic's error format on its route.
            assert!(resp.contains(r#""type":"rate_limit_error""#), "{resp}");
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(statuses, ["200", "200", "200", "200", "200", "429"]);
}

/// SIGHUP reloads the configuration file: a bad file is refused and the old policy stays; a
/// good one applies at once.
#[test]
fn sighup_reloads_the_policy() {
    use std::io::{Read, Write};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sim = rt
        .block_on(tollgate_sim::Sim::start(tollgate_sim::SimConfig::default()))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    let config = |limit: u64| {
        format!(
            "[metrics]\nlisten = \"127.0.0.1:0\"\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n[[keys]]\nhash = \"{}\"\ntenant = \"t\"\n\
             [policy]\nversion = \"v{limit}\"\n[[policy.scopes]]\nkey = \"tenant\"\nrequests = {{ limit = {limit}, window = \"1m\" }}\n",
            sim.base_url(),
            tollgate_gateway::hash_key("sk-hup")
        )
    };
    std::fs::write(&path, config(100)).unwrap();
    let (instance, urls) = common::start_instance_with(&path, &["metrics"]);
    let addr = urls[0].trim_start_matches("http://").to_owned();
    let metrics = urls[1].trim_start_matches("http://").to_owned();
    let status = || {
        let body =
            r#"{"model":"gpt-4o","max_tokens":3,"messages":[{"role":"user","content":"x"}]}"#;
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        write!(s, "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\nauthorization: Bearer sk-hup\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        resp[9..12].to_owned()
    };
    let reloads = || {
        let mut s = std::net::TcpStream::connect(&metrics).unwrap();
        write!(s, "GET /metrics HTTP/1.0\r\nhost: x\r\n\r\n").unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        resp.lines()
            .filter(|l| l.starts_with("tollgate_reloads_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let hup = |pid: u32| {
        let before = reloads();
        assert!(
            std::process::Command::new("kill")
                .args(["-HUP", &pid.to_string()])
                .status()
                .unwrap()
                .success()
        );
        tollgate_testkit::wait::until_blocking(
            "the reload",
            std::time::Duration::from_secs(5),
            || reloads() > before,
        );
    };
    assert_eq!(status(), "200");
    // A bad file: refused; the old policy (100 per minute) stays.
    std::fs::write(&path, config(0)).unwrap();
    hup(instance.0.id());
    assert_eq!(status(), "200");
    // A good file: a rate of 2, already spent by the two requests above.
    std::fs::write(&path, config(2)).unwrap();
    hup(instance.0.id());
    assert_eq!(status(), "429");
}

/// An agent loop, replayed: the operation's round limit stops it at its sixth round, and the
/// figures are those worked out in the fixture's header.
#[test]
fn an_agent_loop_is_stopped_by_its_operations_round_limit() {
    let v = replay_json("fixtures/agent-loop.toml");
    let u = &v["paths"]["unbounded"];
    let l = &v["paths"]["layered_controls"];
    let fig = |p: &Value, k: &str| p[k].as_u64().unwrap_or_else(|| panic!("missing {k}"));
    for (k, unbounded, layered) in [
        ("requests", 14, 14),
        ("accepted", 14, 7),
        ("rejected", 0, 7),
        ("accepted_estimated_tokens", 8700, 2050),
        ("settled_tokens", 8560, 1980),
    ] {
        assert_eq!((fig(u, k), fig(l, k)), (unbounded, layered), "{k}");
    }
    assert_eq!(l["rejections_by_reason"]["request_rate_limit"], 7);
}

/// The figures of `fixture`'s two paths: `(figure, unbounded, layered)` each.
fn assert_figures(v: &Value, rows: &[(&str, u64, u64)]) {
    let (u, l) = (&v["paths"]["unbounded"], &v["paths"]["layered_controls"]);
    let fig = |p: &Value, k: &str| p[k].as_u64().unwrap_or_else(|| panic!("missing {k}"));
    for (k, unbounded, layered) in rows {
        assert_eq!((fig(u, k), fig(l, k)), (*unbounded, *layered), "{k}");
    }
    for (name, case) in v["paths"]["layered_controls"]["cases"].as_object().unwrap() {
        assert_eq!(case["predictions_matched"], true, "{name}");
    }
}

/// An agent asking for four tools a round, replayed: its operation's tool-call limit stops it
/// after one round past the limit, with the figures of the fixture's header.
#[test]
fn an_agent_loop_is_stopped_by_its_operations_tool_calls() {
    let v = replay_json("fixtures/agent-tool-calls.toml");
    assert_figures(
        &v,
        &[
            ("accepted", 7, 3),
            ("rejected", 0, 4),
            ("accepted_estimated_tokens", 1050, 450),
            ("settled_tokens", 980, 420),
            ("settled_tool_calls", 25, 9),
        ],
    );
    assert_eq!(
        v["paths"]["layered_controls"]["rejections_by_reason"]["tool_call_limit"],
        4
    );
}

/// Agent loops that repeat a request or a tool call, replayed: loop detection stops both.
#[test]
fn agent_loops_are_stopped_by_loop_detection() {
    let v = replay_json("fixtures/agent-repeats.toml");
    assert_figures(
        &v,
        &[
            ("accepted", 10, 5),
            ("rejected", 0, 5),
            ("accepted_estimated_tokens", 1500, 750),
            ("settled_tokens", 1400, 700),
        ],
    );
    assert_eq!(
        v["paths"]["layered_controls"]["rejections_by_reason"]["loop_detected"],
        5
    );
}

/// A client that times out and retries with an idempotency key, replayed: charged once on the
/// layered path, once per attempt without the gateway.
#[test]
fn retries_with_an_idempotency_key_are_charged_once() {
    let v = replay_json("fixtures/agent-retries.toml");
    assert_figures(
        &v,
        &[
            ("accepted", 5, 2),
            ("rejected", 0, 2),
            ("replayed", 0, 1),
            ("accepted_estimated_tokens", 750, 300),
            ("settled_tokens", 700, 280),
        ],
    );
    let by = &v["paths"]["layered_controls"]["rejections_by_reason"];
    assert_eq!(by["idempotency_key_in_flight"], 1);
    assert_eq!(by["idempotency_key_reused"], 1);
}
