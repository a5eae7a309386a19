//! `GET /v1/limits` with the caller's own key: every scope that applies to it, with limit, used,
//! reserved, remaining and reset instant in the policy's units; read from the store every
//! instance shares; counted and refused by the request rate like any request.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

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
/// not apply to the key are not listed; the call does not count against the request rate, and
/// answers when it is spent.
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
    assert_eq!(row(&before, "per-key", "requests")["remaining"], 6);
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
    // The chat request counted; the calls did not: they have a bucket of their own.
    assert_eq!(row(&after, "per-key", "requests")["remaining"], 5);
    for _ in 0..5 {
        assert_eq!(a.ask("acme").await.0, 200);
    }
    assert_eq!(a.ask("acme").await.0, 429);
    // Limited, the key holder still reads when it resets, by the store's clock.
    let (status, limited, _) = limits(&b, "sk-acme").await;
    assert_eq!(status, 200, "{limited}");
    let rate = row(&limited, "per-key", "requests");
    assert_eq!(rate["remaining"], 0, "{limited}");
    let now = limited["now_ms"].as_u64().unwrap();
    let reset = rate["resets_at_ms"].as_u64().unwrap();
    assert!(reset > now && reset <= now + 60_000, "{limited}");
    assert_eq!(limited["reads"]["limit"], 120, "{limited}");

    // beta sees its own rule, and a key that is not one is refused.
    let (_, beta, _) = limits(&a, "sk-beta").await;
    assert_eq!(row(&beta, "beta-only", "budget")["limit"], 5);
    assert_eq!(limits(&a, "sk-nobody").await.0, 401);
}

/// `/v1/limits` has a bucket of its own per key (120 a minute): spent, the call is refused 429
/// with a Retry-After, while the key's requests still pass; on both stores.
mod reads {
    use super::*;

    async fn reads_have_a_bucket_of_their_own(text: &str, redis: bool) {
        let sim = sim().await;
        let gw = Instance::start_with(&sim, text, SCOPES).await;
        if redis {
            gw.admin("POST", "/admin/store/init", None).await;
        }
        for i in 0..120 {
            let (status, v, _) = limits(&gw, "sk-gamma").await;
            assert_eq!(status, 200, "call {i}: {v}");
        }
        let (status, refused, retry) = limits(&gw, "sk-gamma").await;
        assert_eq!(
            (status, refused["error"]["code"].as_str()),
            (429, Some("request_rate_limit"))
        );
        assert!(retry.is_some());
        assert_eq!(
            gw.ask("gamma").await.0,
            200,
            "the requests have their own rate"
        );
        assert_eq!(
            limits(&gw, "sk-acme").await.0,
            200,
            "each key its own bucket"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_memory() {
        reads_have_a_bucket_of_their_own("", false).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_redis() {
        let redis = RedisServer::start();
        reads_have_a_bucket_of_their_own(&redis_text(&redis), true).await;
    }
}
