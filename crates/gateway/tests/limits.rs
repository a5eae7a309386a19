//! `GET /v1/limits` with the caller's own key: every scope that applies to it, with limit, used,
//! reserved, remaining and reset instant in the policy's units; read from the store every
//! instance shares; counted and refused by the request rate like any request.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[macro_use]
mod common;

use common::instance::{Instance, redis_text, sim};
use serde_json::{Value, json};
use tollgate_testkit::redis_server::RedisServer;

const SCOPES: &str = "[[policy.scopes]]\nname = \"per-key\"\nkey = \"key\"\n\
    requests = { limit = 6, window = \"1m\" }\nconcurrency = { limit = 2 }\n\
    output_tokens = { max = 500 }\n\
    [[policy.scopes]]\nname = \"spend\"\nkey = \"tenant\"\n\
    budget = { tokens = 10000, period = \"day\" }\n\
    [[policy.scopes]]\nname = \"beta-only\"\nkey = \"tenant\"\nmatch = { tenant = \"beta\" }\n\
    budget = { tokens = 5, period = \"day\" }\n";

async fn limits(on: &Instance, secret: &str) -> (u16, Value, Option<String>) {
    let r = common::get_with(
        on.addr,
        "/v1/limits",
        &[("authorization", format!("Bearer {secret}"))],
    )
    .await;
    let retry = r.header("retry-after").map(str::to_owned);
    (
        r.status,
        serde_json::from_slice(&r.body).unwrap_or(Value::Null),
        retry,
    )
}

fn row<'a>(v: &'a Value, rule: &str, control: &str) -> &'a Value {
    v["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"] == rule && r["control"] == control)
        .unwrap_or_else(|| panic!("no {rule} {control} in {v}"))
}

/// Two instances on Redis: what one spends, the other's `/v1/limits` shows; the rules that do
/// not apply to the key are not listed; the call counts against the request rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_holder_reads_what_is_left() {
    let (sim, redis) = (sim().await, RedisServer::start());
    let a = Instance::start_with(&sim, &redis_text(&redis), SCOPES).await;
    assert_eq!(a.admin("POST", "/admin/store/init", None).await.0, 200);
    let b = Instance::start_with(&sim, &redis_text(&redis), SCOPES).await;

    let (status, before, _) = limits(&b, "sk-acme").await;
    assert_eq!(status, 200, "{before}");
    assert_eq!(before["tenant"], "acme");
    let spend = row(&before, "spend", "budget");
    assert_eq!(
        (&spend["limit"], &spend["used"], &spend["unit"]),
        (&json!(10000), &json!(0), &json!("tokens"))
    );
    assert_eq!(spend["limit_shown"], "10,000 tokens");
    assert!(spend["resets_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(row(&before, "per-key", "requests")["remaining"], 5);
    assert_eq!(row(&before, "per-key", "concurrency")["limit"], 2);
    assert_eq!(row(&before, "per-key", "output_tokens")["limit"], 500);
    assert!(
        !before.to_string().contains("beta-only"),
        "a rule for another tenant is not listed: {before}"
    );

    assert_eq!(a.ask("acme").await.0, 200);
    let (_, after, _) = limits(&b, "sk-acme").await;
    let used = row(&after, "spend", "budget")["used"].as_u64().unwrap();
    assert!(used > 0, "{after}");
    assert_eq!(
        row(&after, "spend", "budget")["remaining"]
            .as_u64()
            .unwrap(),
        10000 - used
    );
    // The chat request and two calls so far: three more calls, then the rate refuses.
    assert_eq!(row(&after, "per-key", "requests")["remaining"], 3);
    for _ in 0..3 {
        assert_eq!(limits(&b, "sk-acme").await.0, 200);
    }
    let (status, refused, retry) = limits(&a, "sk-acme").await;
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["code"], "request_rate_limit");
    assert!(retry.is_some());

    // beta sees its own rule, and a key that is not one is refused.
    let (_, beta, _) = limits(&a, "sk-beta").await;
    assert_eq!(row(&beta, "beta-only", "budget")["limit"], 5);
    assert_eq!(limits(&a, "sk-nobody").await.0, 401);
}
