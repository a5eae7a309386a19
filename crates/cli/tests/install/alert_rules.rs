//! `deploy/prometheus-alerts.yml`: valid rules (`promtool check rules`), each alert firing on
//! the series it is written for and quiet on healthy ones (`promtool test rules`), and every
//! metric they name one the gateway exports. `.ci/run` installs `promtool`; elsewhere put it on
//! the `PATH` or name it in `TOLLGATE_PROMTOOL`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;

use crate::common;

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn promtool() -> PathBuf {
    if let Ok(p) = std::env::var("TOLLGATE_PROMTOOL") {
        return PathBuf::from(p);
    }
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("promtool"))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!("promtool is needed: run scripts/test, or install it (Debian: prometheus) or set TOLLGATE_PROMTOOL")
    })
}

fn run(args: &[&str]) {
    let out = Command::new(promtool())
        .args(args)
        .current_dir(repo("deploy"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool {args:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_alert_rules_are_valid_and_fire_as_written() {
    run(&["check", "rules", "prometheus-alerts.yml"]);
    run(&["test", "rules", "prometheus-alerts.test.yml"]);
}

/// The metrics the alert rules name, each once.
fn named_metrics(rules: &str) -> Vec<&str> {
    let mut named: Vec<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("tollgate_"))
        .collect();
    named.sort_unstable();
    named.dedup();
    named
}

#[test]
fn every_metric_an_alert_names_is_exported() {
    let rules = std::fs::read_to_string(repo("deploy/prometheus-alerts.yml")).unwrap();
    let exported = std::fs::read_to_string(repo("crates/gateway/src/telemetry.rs")).unwrap();
    let named = named_metrics(&rules);
    assert!(named.len() >= 8, "{named:?}");
    for m in named {
        assert!(
            exported.contains(&format!("\"{m}\"")),
            "{m} is not exported"
        );
    }
}

/// The Grafana dashboard lists the rules' alerts and shows the policy version in force.
#[test]
fn the_dashboard_shows_the_alerts() {
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo("deploy/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let panels = dash["panels"].as_array().unwrap();
    let list = panels
        .iter()
        .find(|p| p["type"] == "alertlist")
        .expect("an alert list");
    let rules = std::fs::read_to_string(repo("deploy/prometheus-alerts.yml")).unwrap();
    let filter = list["options"]["alertName"].as_str().unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 8);
    assert!(
        alerts.iter().all(|a| a.contains(filter)),
        "{filter:?} lists {alerts:?}"
    );
    assert!(
        panels
            .iter()
            .any(|p| p["targets"][0]["expr"] == "tollgate_policy_info == 1")
    );
}

/// Every series the alert rules name is exported by a real gateway from its first second, before
/// any request: a rate or an `increase()` sees a fault's first burst, and the rules that join
/// on `tollgate_policy_info` find it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_gateway_exports_every_series_the_alerts_name() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "[metrics]\nlisten = \"127.0.0.1:0\"\n\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"gpt-4o\"]\n\
             [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
             [policy]\nversion = \"v7\"\n\
             [[policy.scopes]]\nname = \"spend\"\nkey = \"tenant\"\nmatch = {{ tenant = \"acme\" }}\n\
             requests = {{ limit = 60, window = \"1m\" }}\nbudget = {{ tokens = 5000, period = \"day\" }}\n\
             [[policy.scopes]]\nname = \"tighter\"\nkey = \"tenant\"\nmode = \"shadow\"\n\
             requests = {{ limit = 6, window = \"1m\" }}\n",
            tollgate_gateway::hash_key("sk-acme"),
        ),
    )
    .unwrap();
    let (_gateway, urls) = common::start_instance_with(&config, &["metrics"]);
    let scrape = scrape(&format!("{}/metrics", urls[1])).await;
    let rules = std::fs::read_to_string(repo("deploy/prometheus-alerts.yml")).unwrap();
    for m in named_metrics(&rules) {
        assert!(
            scrape
                .lines()
                .any(|l| l.starts_with(m) && !l.starts_with('#')),
            "{m} is not exported at start:\n{scrape}"
        );
    }
    assert!(
        scrape.contains("tollgate_policy_info{version=\"v7\"} 1"),
        "{scrape}"
    );
    assert!(
        scrape.contains("tollgate_decisions_total{decision=\"budget_limit\",rule=\"spend\"} 0"),
        "{scrape}"
    );
    assert!(
        scrape.contains(
            "tollgate_shadow_refusals_total{reason=\"request_rate_limit\",rule=\"tighter\"} 0"
        ),
        "{scrape}"
    );
}

/// The body of `GET url`.
async fn scrape(url: &str) -> String {
    use http_body_util::BodyExt;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    // The budget gauges come with the first refresh of the store's figures.
    tollgate_testkit::wait::poll(std::time::Duration::from_secs(5), async || {
        let resp = client.get(url.parse().unwrap()).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&body).into_owned();
        if text.contains("tollgate_budget_remaining") {
            Ok(text)
        } else {
            Err(format!("no budget gauge yet:\n{text}"))
        }
    })
    .await
}
