//! Agent operations: a client-chosen id in a header (`x-tollgate-operation` unless configured)
//! that rules can key on like any dimension, always inside its key's tenant, bounded in length.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

use crate::common;

use std::time::Duration;

use serde_json::json;
use tollgate_core::{Period, Store};
use tollgate_gateway::GatewayConfig;
use tollgate_testkit::sim::SimConfig;

use common::{Env, Reply};

const ACME: &str = "sk-ops-acme";
const OTHER: &str = "sk-ops-other";

async fn env(redis: bool, policy: &str, extra: &str, sim: SimConfig) -> Env {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, sim, "ops").await;
    let text = format!(
        "{store}{extra}\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"other\"\n[policy]\n{}",
        sim.base_url(),
        tollgate_gateway::hash_key(ACME),
        tollgate_gateway::hash_key(OTHER),
        policy.replace("[[scopes]]", "[[policy.scopes]]"),
    );
    Env::start(&text, common::SIM_KEY, sim, redis_server).await
}

async fn send(env: &Env, key: &str, headers: &[(&str, &str)]) -> Reply {
    let mut h: Vec<(&str, String)> = vec![("authorization", format!("Bearer {key}"))];
    h.extend(headers.iter().map(|(n, v)| (*n, (*v).to_owned())));
    let body = json!({"model": "gpt-4o", "max_tokens": 10,
        "messages": [{"role": "user", "content": "next step"}]});
    env.post_oneshot("/v1/chat/completions", &h, body.to_string())
        .await
}

const OP: &str = "x-tollgate-operation";

/// An operation's model rounds and tokens are limited; another operation, another tenant's
/// operation of the same name, and a request without one are not held by it.
async fn operation_rules_limit_rounds_inside_their_tenant(redis: bool) {
    let policy = "[[scopes]]\nkey = \"operation\"\nrequests = { limit = 3, window = \"1h\" }\n\
                  budget = { tokens = 100000, period = \"day\" }\n";
    let env = env(redis, policy, "", SimConfig::default()).await;
    for _ in 0..3 {
        assert_eq!(send(&env, ACME, &[(OP, "op-1")]).await.status, 200);
    }
    let r = send(&env, ACME, &[(OP, "op-1")]).await;
    assert_eq!((r.status, r.code().as_str()), (429, "request_rate_limit"));
    assert_eq!(
        r.header("x-tollgate-scope"),
        Some("tenant:acme/operation:op-1")
    );
    assert_eq!(send(&env, ACME, &[(OP, "op-2")]).await.status, 200);
    assert_eq!(send(&env, OTHER, &[(OP, "op-1")]).await.status, 200);
    assert_eq!(send(&env, ACME, &[]).await.status, 200);
    // The three admitted rounds of op-1 were settled into its budget.
    let scope = "operation|tenant:acme/operation:op-1";
    tollgate_testkit::wait::until("op-1's budget holds its rounds", async || {
        let u = env
            .store
            .usage(scope, Some(Period::Fixed(86_400_000)))
            .await;
        u.unwrap().settled > 0
    })
    .await;
    // Ids out of bounds are refused before anything is counted.
    let long = "o".repeat(tollgate_gateway::MAX_OPERATION_BYTES + 1);
    for bad in [long.as_str(), ""] {
        let r = send(&env, ACME, &[(OP, bad)]).await;
        assert_eq!(
            (r.status, r.code().as_str()),
            (400, "invalid_value"),
            "{bad:?}"
        );
        assert_eq!(r.json()["error"]["param"], "operation");
    }
    let fine = "o".repeat(tollgate_gateway::MAX_OPERATION_BYTES);
    assert_eq!(send(&env, ACME, &[(OP, &fine)]).await.status, 200);
}

/// An operation's concurrency and token budget hold like any scope's.
async fn operation_concurrency_and_budget_hold(redis: bool) {
    let policy = "[[scopes]]\nkey = \"operation\"\nconcurrency = { limit = 1 }\n\
                  budget = { tokens = 60, period = \"day\" }\n";
    let sim = SimConfig {
        latency: Duration::from_millis(300),
        output_tokens: 5,
        ..SimConfig::default()
    };
    let env = env(redis, policy, "", sim).await;
    let (a, b) = tokio::join!(
        send(&env, ACME, &[(OP, "op-c")]),
        send(&env, ACME, &[(OP, "op-c")])
    );
    let mut got = [(a.status, a.code()), (b.status, b.code())];
    got.sort();
    assert_eq!(
        got,
        [(200, String::new()), (429, "concurrency_limit".to_owned())]
    );
    // Each round reserves its input and 10 output tokens; the budget of 60 runs out within a
    // few rounds, and then refuses.
    let mut codes = Vec::new();
    for _ in 0..6 {
        let r = send(&env, ACME, &[(OP, "op-c")]).await;
        codes.push((r.status, r.code()));
    }
    assert!(
        codes.contains(&(429, "budget_limit".to_owned())),
        "the operation's budget ran out: {codes:?}"
    );
}

mod both {
    on_both_stores!(
        operation_rules_limit_rounds_inside_their_tenant,
        operation_concurrency_and_budget_hold
    );
}

/// The header is configurable (a client's own session header), and may not be one the gateway
/// reads for something else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operation_header_is_configurable() {
    let policy = "[[scopes]]\nkey = \"operation\"\nrequests = { limit = 1, window = \"1h\" }\n";
    let env = env(
        false,
        policy,
        "[operations]\nheader = \"X-Session-Id\"\n",
        SimConfig::default(),
    )
    .await;
    assert_eq!(
        send(&env, ACME, &[("x-session-id", "s1")]).await.status,
        200
    );
    let r = send(&env, ACME, &[("x-session-id", "s1")]).await;
    assert_eq!((r.status, r.code().as_str()), (429, "request_rate_limit"));
    // The default header names nothing now.
    assert_eq!(send(&env, ACME, &[(OP, "s1")]).await.status, 200);
    assert_eq!(send(&env, ACME, &[(OP, "s1")]).await.status, 200);

    for bad in ["authorization", "x-tollgate-user", "not a header"] {
        let text = format!(
            "[operations]\nheader = \"{bad}\"\n[[upstreams]]\nname = \"u\"\n\
             base_url = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\n"
        );
        let e = GatewayConfig::from_toml(&text).unwrap_err();
        assert_eq!(e.path, "operations.header", "{e}");
    }
}
