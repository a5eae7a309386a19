//! The official OpenAI and Anthropic Python SDKs end to end (`tests/sdk/sdk_e2e.py`,
//! `tests/sdk/responses_e2e.py`, `tests/sdk/anthropic_e2e.py`, `tests/sdk/idempotency_e2e.py`, `tests/sdk/cap_e2e.py`) against the gateway and the simulator. `scripts/test` makes the venv
//! (`.venv`, `tests/sdk/requirements.txt`); elsewhere set `TOLLGATE_PYTHON` to a Python with
//! `openai` and `anthropic` installed.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr
)]

use crate::common;

use std::path::PathBuf;

use tollgate_gateway::hash_key;
use tollgate_sim::{Sim, SimConfig};

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn python() -> PathBuf {
    if let Ok(p) = std::env::var("TOLLGATE_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = repo(".venv/bin/python");
    assert!(
        venv.exists(),
        "no Python with the openai and anthropic SDKs: run scripts/test, or `python3 -m venv .venv && .venv/bin/pip install -r tests/sdk/requirements.txt`"
    );
    venv
}

/// Runs `script` (in `tests/sdk/`) against a gateway whose one upstream, the simulator, serves
/// `model`; three keys of three tenants: plain, 2 requests per 2 s, a 30-token daily budget.
async fn run_sdk_script(script: &str, model: &str) {
    run_sdk_script_with(script, model, SimConfig::default(), 3).await;
}

/// [`run_sdk_script`] with the simulator's configuration, expecting `checks` passed; returns
/// the simulator, for what it saw.
async fn run_sdk_script_with(script: &str, model: &str, sim: SimConfig, checks: u32) -> Sim {
    let sim = Sim::start(sim).await.unwrap();
    let keys = [
        ("sk-plain", "plain"),
        ("sk-retry", "retry"),
        ("sk-budget", "budget"),
    ];
    let mut text = format!(
        "[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"{model}\"]\n",
        sim.base_url()
    );
    for (k, tenant) in keys {
        text.push_str(&format!(
            "[[keys]]\nhash = \"{}\"\ntenant = \"{tenant}\"\n",
            hash_key(k)
        ));
    }
    text.push_str(
        "[[policy.scopes]]\nname = \"retry\"\nkey = \"tenant\"\nmatch = { tenant = \"retry\" }\nrequests = { limit = 2, window = \"2s\" }\n\
         [[policy.scopes]]\nname = \"budget\"\nkey = \"tenant\"\nmatch = { tenant = \"budget\" }\nbudget = { tokens = 30, period = \"day\" }\n",
    );
    let addr = common::serve_in_process(&text).await;
    let out = tokio::process::Command::new(python())
        .arg(repo(&format!("tests/sdk/{script}")))
        .env("TOLLGATE_BASE_URL", format!("http://{addr}"))
        .env("TOLLGATE_MODEL", model)
        .env("TOLLGATE_KEY", "sk-plain")
        .env("TOLLGATE_RETRY_KEY", "sk-retry")
        .env("TOLLGATE_BUDGET_KEY", "sk-budget")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("{checks} passed, 0 failed")),
        "{stdout}"
    );
    sim
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_sdk_works_through_the_gateway() {
    run_sdk_script("sdk_e2e.py", "gpt-4o").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_sdk_responses_api_works_through_the_gateway() {
    run_sdk_script("responses_e2e.py", "gpt-4o").await;
}

/// The OpenAI SDK retries a call with an `Idempotency-Key` through its client timeouts: the
/// upstream gets it once, and its tenant is charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_sdk_retries_an_idempotent_call_charged_once() {
    let slow = SimConfig {
        latency: std::time::Duration::from_secs(1),
        ..SimConfig::default()
    };
    let sim = run_sdk_script_with("idempotency_e2e.py", "gpt-4o", slow, 7).await;
    let stats = sim.stats();
    assert_eq!(
        stats.requests.values().sum::<u64>(),
        1,
        "the upstream got the call once"
    );
    assert_eq!(stats.completed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_anthropic_sdk_works_through_the_gateway() {
    run_sdk_script("anthropic_e2e.py", "claude-sonnet-4").await;
}

/// A model that runs past its cap: the gateway ends each stream at the cap in its API's shape,
/// and the official SDKs finish the answer as one cut by its cap (chat, Responses, Anthropic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_read_a_stream_ended_at_its_cap() {
    let runaway = SimConfig {
        output_tokens: 2_000,
        ignore_cap: true,
        token_delay: std::time::Duration::from_millis(1),
        ..SimConfig::default()
    };
    let sim = run_sdk_script_with("cap_e2e.py", "gpt-4o", runaway, 3).await;
    assert_eq!(sim.stats().completed, 0, "an upstream ran to its end");
}
