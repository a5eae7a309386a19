//! The TypeScript client (`clients/typescript`) against the real gateway: its tests run in Node,
//! in Vercel's Edge Runtime and in Cloudflare's workerd, with the official OpenAI and Anthropic
//! SDKs calling the simulated provider themselves. `.ci/run` installs its packages from the npm
//! registry and builds it (`scripts/test`); elsewhere run `npm ci && npm run build` there.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use tollgate_gateway::hash_key;
use tollgate_sim::{Sim, SimConfig};

/// The tests in `clients/typescript/test/`, every one of which must pass.
const TESTS: u32 = 7;

fn client_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../clients/typescript")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typescript_client_keeps_the_books_in_node_and_at_the_edge() {
    let dir = client_dir();
    assert!(
        dir.join("node_modules").is_dir() && dir.join("dist/index.js").is_file(),
        "the client is not built: run scripts/test, or `npm ci && npm run build` in {}",
        dir.display()
    );
    // Answers take long enough that ten proxied requests are all decided before any settles.
    let sim = Sim::start(SimConfig {
        latency: Duration::from_millis(500),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let keys = [
        ("sk-proxy", "proxy", "proxy"),
        ("sk-node", "node", "reservations"),
        ("sk-sdk", "sdk", "reservations"),
        ("sk-edge", "edge", "reservations"),
        ("sk-worker", "worker", "reservations"),
    ];
    let mut text = format!(
        "[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\", \"claude-sonnet-4\"]\n",
        sim.base_url()
    );
    for (secret, tenant, uses) in keys {
        text.push_str(&format!(
            "[[keys]]\nhash = \"{}\"\ntenant = \"{tenant}\"\nuses = \"{uses}\"\n",
            hash_key(secret)
        ));
    }
    text.push_str(
        "[policy.prices.\"gpt-4o\"]\ninput = 2500000\noutput = 10000000\n\
         [policy.prices.\"claude-sonnet-4\"]\ninput = 3000000\noutput = 15000000\n\
         [[policy.scopes]]\nname = \"tenant\"\nkey = \"tenant\"\n\
         budget = { micro_usd = 50000, period = \"day\" }\n",
    );
    let addr = common::serve_in_process(&text).await;
    let out = tokio::process::Command::new("node")
        .args([
            "--test",
            "--test-reporter=tap",
            "test/node.test.mjs",
            "test/edge.test.mjs",
        ])
        .current_dir(&dir)
        .env("TOLLGATE_URL", format!("http://{addr}"))
        .env("TOLLGATE_SIM_URL", sim.base_url())
        .env("TOLLGATE_SIM_KEY", "sk-sim-unchecked")
        .env("TOLLGATE_PROXY_KEY", "sk-proxy")
        .env("TOLLGATE_NODE_KEY", "sk-node")
        .env("TOLLGATE_SDK_KEY", "sk-sdk")
        .env("TOLLGATE_EDGE_KEY", "sk-edge")
        .env("TOLLGATE_WORKER_KEY", "sk-worker")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(180), out)
        .await
        .expect("the client's tests ended within 3 minutes")
        .expect("node runs");
    let report = String::from_utf8_lossy(&out.stdout);
    let count = |what: &str| {
        report
            .lines()
            .find_map(|l| l.strip_prefix(&format!("# {what} ")))
            .and_then(|n| n.trim().parse::<u32>().ok())
    };
    assert!(
        out.status.success()
            && count("pass") == Some(TESTS)
            && count("fail") == Some(0)
            && count("skipped") == Some(0)
            && count("todo") == Some(0),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
