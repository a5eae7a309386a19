//! `tollgate whatif`: the decision records of a run of `tollgate serve`, replayed under a
//! stricter policy (a lower rate, a budget per user of one tenant) and a looser one (no input
//! limit): exact counts of what would change, by rule, tenant, key and reason, and the tokens
//! that would not have been spent.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use tollgate_sim::{Sim, SimConfig};

use common::start_instance;

fn chat(gateway: &str, key: &str, user: &str, words: usize) -> u16 {
    let addr = gateway.trim_start_matches("http://");
    let body = json!({"model": "gpt-4o", "max_tokens": 10, "user": user,
        "messages": [{"role": "user", "content": "hello ".repeat(words)}]})
    .to_string();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\
         authorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split(' ').nth(1).unwrap().parse().unwrap()
}

fn whatif(records: &std::path::Path, policy: &std::path::Path, json: bool) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.arg("whatif")
        .arg("--records")
        .arg(records)
        .arg("--policy")
        .arg(policy);
    if json {
        cmd.args(["--format", "json"]);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whatif_counts_what_a_new_policy_would_change() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records.jsonl");
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "[records]\npath = \"{}\"\n\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
             [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\nallow_user = true\n\
             [[keys]]\nhash = \"{}\"\ntenant = \"beta\"\n\
             [policy]\nversion = \"then\"\n\
             [[policy.scopes]]\nname = \"tenant\"\nkey = \"tenant\"\n\
             requests = {{ limit = 100, window = \"1m\" }}\ninput_tokens = 40\n\
             budget = {{ tokens = 100000, period = \"day\" }}\n",
            records.display(),
            sim.base_url(),
            tollgate_gateway::hash_key("sk-acme"),
            tollgate_gateway::hash_key("sk-beta"),
        ),
    )
    .unwrap();
    let (gateway, url) = start_instance(&config);
    // beta: one too large for the input limit, then four; acme (user alice): six.
    let mut answers = vec![chat(&url, "sk-beta", "bob", 60)];
    answers.extend((0..4).map(|_| chat(&url, "sk-beta", "bob", 1)));
    answers.extend((0..6).map(|_| chat(&url, "sk-acme", "alice", 1)));
    assert_eq!(
        answers,
        [400, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200]
    );
    // Admitted requests are recorded when they end.
    let read = || -> Vec<Value> {
        let text = std::fs::read_to_string(&records).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    tollgate_testkit::wait::until_blocking("11 records", Duration::from_secs(5), || {
        read().len() >= 11
    });
    let lines = read();
    drop(gateway);
    assert_eq!(lines.len(), 11);
    // Nothing a client chose is kept in clear.
    let text = std::fs::read_to_string(&records).unwrap();
    assert!(!text.contains("alice") && !text.contains("hello"), "{text}");
    let mut by_time = lines.clone();
    by_time.sort_by_key(|r| r["ts_ms"].as_u64().unwrap());
    let settled = |r: &Value| {
        let u = &r["usage"];
        u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap()
    };
    // In time order: beta's five, then acme's six.
    let est = by_time[5]["input_tokens"].as_u64().unwrap() + 10;
    let big_input = by_time[0]["input_tokens"].as_u64().unwrap();
    assert_eq!(by_time[0]["reason"], "input_token_limit");
    assert!(
        settled(&by_time[5]) * 2 > est,
        "two settle above one estimate"
    );
    // The key ids the gateway gave the two keys.
    let (acme, beta) = (
        by_time[5]["facts"]["key"].as_str().unwrap().to_owned(),
        by_time[0]["facts"]["key"].as_str().unwrap().to_owned(),
    );
    assert_ne!(acme, beta);

    // Stricter: four attempts a minute per tenant; acme's users two estimates a day. Looser:
    // no input limit.
    let policy = dir.path().join("new.toml");
    std::fs::write(
        &policy,
        format!(
            "version = \"now\"\n\
             [[scopes]]\nname = \"tenant\"\nkey = \"tenant\"\nrequests = {{ limit = 4, window = \"1m\" }}\n\
             [[scopes]]\nname = \"per-user\"\nkey = \"tenant/user\"\nmatch = {{ tenant = \"acme\" }}\n\
             budget = {{ tokens = {}, period = \"day\" }}\n",
            2 * est
        ),
    )
    .unwrap();
    let report: Value = serde_json::from_str(&whatif(&records, &policy, true)).unwrap();
    assert_eq!(report["policy_version"], "now");
    assert_eq!(report["recorded_versions"], json!(["then"]));
    assert_eq!(report["replayed"], 11);
    assert_eq!(report["served_then"], 10);
    // beta: the large one and three more; acme: two.
    assert_eq!(report["served_now"], 6, "{report:#}");
    let change = |rule: &str, tenant: &str, key: &str, reason: &str, requests: u64, tokens: u64| {
        json!({"rule": rule, "tenant": tenant, "key": key, "reason": reason,
            "requests": requests, "tokens": tokens})
    };
    // acme's third and fourth exceed alice's budget; its fifth and sixth, and beta's fifth
    // attempt, the rate.
    let tokens = |idx: &[usize]| idx.iter().map(|&i| settled(&by_time[i])).sum::<u64>();
    assert_eq!(
        report["newly_refused"],
        json!([
            change(
                "per-user",
                "acme",
                &acme,
                "budget_limit",
                2,
                tokens(&[7, 8])
            ),
            change(
                "tenant",
                "acme",
                &acme,
                "request_rate_limit",
                2,
                tokens(&[9, 10])
            ),
            change(
                "tenant",
                "beta",
                &beta,
                "request_rate_limit",
                1,
                tokens(&[4])
            ),
        ]),
        "{report:#}"
    );
    assert_eq!(
        report["newly_served"],
        json!([change(
            "",
            "beta",
            &beta,
            "input_token_limit",
            1,
            big_input + 10
        )])
    );
    assert_eq!(report["tokens_not_spent"], tokens(&[4, 7, 8, 9, 10]));
    assert_eq!(report["tokens_newly_reserved"], big_input + 10);

    // The same as a table.
    let table = whatif(&records, &policy, false);
    assert!(
        table.contains("policy now against 11 records decided under then"),
        "{table}"
    );
    assert!(table.contains("served: 10 then, 6 now"), "{table}");
    assert!(table.contains("per-user"), "{table}");

    // The policy of the run itself changes nothing.
    let same = dir.path().join("same.toml");
    std::fs::write(&same, std::fs::read_to_string(&config).unwrap()).unwrap();
    let report: Value = serde_json::from_str(&whatif(&records, &same, true)).unwrap();
    assert_eq!(report["served_now"], 10);
    assert_eq!(report["newly_refused"], json!([]));
    assert_eq!(report["newly_served"], json!([]));

    // A line that is not a record is an error naming it.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        format!("{}\nnot json\n", text.lines().next().unwrap()),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("whatif")
        .arg("--records")
        .arg(&bad)
        .arg("--policy")
        .arg(&policy)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
}

/// A record of a request refused for its input keeps that its count stopped at the limit (a
/// lower bound); what-if under a looser input limit reports it served as a bound, not as
/// known. `--policy` takes a whole gateway configuration and reads only its `[policy]`: the
/// admin token's variable is not needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whatif_reports_a_cut_count_as_a_bound() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records.jsonl");
    let config = dir.path().join("gateway.toml");
    let text = |version: &str, limit: u64| {
        format!(
            "[records]\npath = \"{}\"\n\
             [admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"TOLLGATE_WHATIF_UNSET_TOKEN\"\n\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
             [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\nallow_user = true\n\
             [policy]\nversion = \"{version}\"\n\
             [[policy.scopes]]\nname = \"tenant\"\nkey = \"tenant\"\ninput_tokens = {limit}\n",
            records.display(),
            sim.base_url(),
            tollgate_gateway::hash_key("sk-acme"),
        )
    };
    std::fs::write(
        &config,
        text("then", 40).replace(
            "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"TOLLGATE_WHATIF_UNSET_TOKEN\"\n",
            "",
        ),
    )
    .unwrap();
    let (gateway, url) = start_instance(&config);
    assert_eq!(chat(&url, "sk-acme", "alice", 120), 400);
    let mut written = String::new();
    tollgate_testkit::wait::until_blocking("a record", Duration::from_secs(5), || {
        written = std::fs::read_to_string(&records).unwrap_or_default();
        written.contains('\n')
    });
    let line: Value = serde_json::from_str(written.lines().next().unwrap()).unwrap();
    drop(gateway);
    assert_eq!(
        line["input_tokens"], 41,
        "cut at the limit plus one: {line}"
    );
    assert_eq!(line["input_lower_bound"], true, "{line}");

    // The looser policy, as a whole gateway configuration whose admin token is not set.
    let looser = dir.path().join("looser.toml");
    std::fs::write(&looser, text("now", 100_000)).unwrap();
    let report: Value = serde_json::from_str(&whatif(&records, &looser, true)).unwrap();
    assert_eq!(report["policy_version"], "now");
    assert_eq!(report["bounded_inputs"], 1);
    assert_eq!(report["newly_served_bounded"], 1);
    let table = whatif(&records, &looser, false);
    assert!(table.contains("newly reserved: at least "), "{table}");
    assert!(
        table.contains("counted only up to the input limits then"),
        "{table}"
    );
}
