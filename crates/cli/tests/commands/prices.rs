//! `tollgate prices`: what a model costs and where each figure comes from, and how two
//! catalogs differ.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The line of `figure` in a `prices` listing.
fn line<'a>(out: &'a str, figure: &str) -> &'a str {
    out.lines()
        .find(|l| l.trim_start().starts_with(&format!("{figure} ")))
        .unwrap_or_else(|| panic!("no {figure:?} in:\n{out}"))
}

#[test]
fn a_models_prices_name_their_source() {
    // The catalog's figure, in dollars per million tokens, read from its JSON here.
    let raw: serde_json::Value = serde_json::from_str(tollgate_prices::PINNED).unwrap();
    let per_token = raw["gpt-4o"]["input_cost_per_token"].as_f64().unwrap();
    let dollars = format!("${:.2}", per_token * 1e6);
    let (ok, out, err) = run(&["prices", "gpt-4o"]);
    assert!(ok, "{err}");
    let input = line(&out, "input");
    assert!(
        input.contains(&dollars) && input.ends_with("catalog"),
        "{out}"
    );

    // A policy's own price for the model wins, and says so; the catalog's tiers stay.
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(
        &policy,
        "[prices.\"gpt-4o\"]\ninput = 2000000\noutput = 8000000\nfile_search = 2500\n",
    )
    .unwrap();
    let (ok, out, err) = run(&["prices", "gpt-4o", "--policy", policy.to_str().unwrap()]);
    assert!(ok, "{err}");
    let input = line(&out, "input");
    assert!(
        input.contains("$2.00") && input.ends_with("policy"),
        "{out}"
    );
    let search = line(&out, "file search");
    assert!(
        search.contains("$0.0025") && search.ends_with("policy"),
        "{out}"
    );
    assert!(
        line(&out, "tier priority: input").ends_with("catalog"),
        "{out}"
    );

    // A model nobody prices is named, and the command fails.
    let (ok, _, err) = run(&["prices", "no-such-model"]);
    assert!(!ok);
    assert!(err.contains("\"no-such-model\" has no price"), "{err}");
}

#[test]
fn a_diff_lists_each_figure_that_changed() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.json");
    let b = dir.path().join("b.json");
    std::fs::write(
        &a,
        r#"{"m": {"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}}"#,
    )
    .unwrap();
    std::fs::write(
        &b,
        r#"{"m": {"input_cost_per_token": 1e-6, "output_cost_per_token": 3e-6}}"#,
    )
    .unwrap();
    let (ok, out, err) = run(&["prices", "diff", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("m  output  $2.00 -> $3.00"), "{out}");
    assert!(out.contains("1 figures differ"), "{out}");
    let (ok, _, err) = run(&["prices", "diff", a.to_str().unwrap(), "/nonexistent.json"]);
    assert!(!ok);
    assert!(err.contains("/nonexistent.json"), "{err}");
}
