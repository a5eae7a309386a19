//! `deploy/prometheus-alerts.yml`: valid rules (`promtool check rules`), each alert firing on
//! the series it is written for and quiet on healthy ones (`promtool test rules`), and every
//! metric they name one the gateway exports. `.ci/run` installs `promtool`; elsewhere put it on
//! the `PATH` or name it in `TOLLGATE_PROMTOOL`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;

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
        panic!("promtool is needed: run .ci/run, or install it (Debian: prometheus) or set TOLLGATE_PROMTOOL")
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

#[test]
fn every_metric_an_alert_names_is_exported() {
    let rules = std::fs::read_to_string(repo("deploy/prometheus-alerts.yml")).unwrap();
    let exported = std::fs::read_to_string(repo("crates/gateway/src/telemetry.rs")).unwrap();
    let mut named: Vec<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("tollgate_"))
        .collect();
    named.sort_unstable();
    named.dedup();
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
