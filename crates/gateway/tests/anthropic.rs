//! Anthropic's `POST /v1/messages` through the gateway, against the simulator's Anthropic
//! endpoint: `x-api-key` on both sides, the output cap written into `max_tokens`, settlement
//! from Anthropic's usage (body, or `message_start` and `message_delta` when streamed), and
//! refusals in Anthropic's error format. Memory store and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{Value, json};
use tollgate_testkit::sim::SimConfig;

mod common;

const KEY: &str = "sk-ant-acme";
const UPSTREAM_KEY: &str = "upstream-anthropic-secret";
const MODEL: &str = "claude-sonnet-4";

use common::{Env, Reply};

async fn env(redis: bool, budget: u64) -> Env {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, UPSTREAM_KEY, SimConfig::default(), "ant").await;
    let text = format!(
        "{store}[[upstreams]]\nname = \"anthropic\"\nbase_url = \"{}\"\nmodels = [\"{MODEL}\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
         [[policy.scopes]]\nkey = \"tenant\"\nrequests = {{ limit = 100, window = \"1m\" }}\n\
         output_tokens = {{ max = 200, mode = \"clamp\", default = 12 }}\n\
         concurrency = {{ limit = 4, lease_ttl = \"30s\" }}\nbudget = {{ tokens = {budget}, period = \"day\" }}\n",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
    );
    Env::start(&text, UPSTREAM_KEY, sim, redis_server).await
}

async fn send(env: &Env, key: Option<&str>, body: Value) -> Reply {
    let mut headers = vec![("anthropic-version", "2023-06-01".to_owned())];
    if let Some(k) = key {
        headers.push(("x-api-key", k.to_owned()));
    }
    common::post(
        env.addr,
        "/v1/messages",
        &headers,
        serde_json::to_vec(&body).unwrap(),
    )
    .await
}

fn message(max_tokens: Option<u64>, stream: bool) -> Value {
    let mut v = json!({"model": MODEL, "stream": stream,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}]});
    if let Some(m) = max_tokens {
        v["max_tokens"] = m.into();
    }
    v
}

async fn messages_are_capped_forwarded_and_settled(redis: bool) {
    let env = env(redis, 100_000).await;
    // Above the cap: clamped to 200, which the upstream gets with its own key.
    let r = send(&env, Some(KEY), message(Some(5000), false)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["usage"]["output_tokens"], 16);
    let sent = env.sim.stats().last_body.unwrap();
    assert_eq!(sent["max_tokens"], 200);
    assert_eq!(env.sim.stats().requests.get(UPSTREAM_KEY), Some(&1));
    assert!(r.headers.contains_key("x-ratelimit-remaining-requests"));
    let one = common::settled_as_the_upstream_served(&env).await;
    assert!(one > 16, "{one}");
    // No max_tokens (Anthropic requires one): the policy's default is written in.
    let r = send(&env, Some(KEY), message(None, false)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(env.sim.stats().last_body.unwrap()["max_tokens"], 12);
    assert_eq!(r.json()["usage"]["output_tokens"], 12);
    common::settled_as_the_upstream_served(&env).await;
    // Streamed: Anthropic's events pass unchanged, and the usage they carry is settled.
    let r = send(&env, Some(KEY), message(Some(8), true)).await;
    assert_eq!(r.status, 200);
    let text = String::from_utf8_lossy(&r.body);
    assert!(text.starts_with("event: message_start\n"), "{text}");
    assert_eq!(text.matches("event: content_block_delta").count(), 8);
    assert!(text.contains("\"usage\":{\"output_tokens\":8}"), "{text}");
    assert!(
        text.trim_end()
            .ends_with("data: {\"type\":\"message_stop\"}"),
        "{text}"
    );
    common::settled_as_the_upstream_served(&env).await;
    // Web search, which the upstream runs: its `max_uses` is lowered to the gateway's bound
    // (the default, 4), and the input the upstream bills for each use is settled.
    let mut m = message(Some(8), false);
    m["tools"] = json!([{"type": "web_search_20250305", "name": "web_search", "max_uses": 9}]);
    let r = send(&env, Some(KEY), m).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(
        env.sim.stats().last_body.unwrap()["tools"][0]["max_uses"],
        4
    );
    let input = r.json()["usage"]["input_tokens"].as_u64().unwrap();
    assert!((2_000..2_100).contains(&input), "{input}");
    common::settled_as_the_upstream_served(&env).await;
}

async fn refusals_take_anthropics_error_format(redis: bool) {
    // Room for one request of 12 output tokens and its input, not for a second.
    let env = env(redis, 40).await;
    let r = send(&env, None, message(Some(8), false)).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["type"], "error");
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    let r = send(&env, Some(KEY), message(None, false)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = send(&env, Some(KEY), message(None, false)).await;
    assert_eq!(r.status, 429, "{:?}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    assert_eq!(v["error"]["code"], "budget_limit", "{v}");
    assert!(r.headers.contains_key("retry-after"), "{:?}", r.headers);
    // An unknown model: Anthropic's not_found_error.
    let mut m = message(Some(8), false);
    m["model"] = "claude-unknown".into();
    let r = send(&env, Some(KEY), m).await;
    assert_eq!(
        (r.status, r.json()["error"]["type"].clone()),
        (404, json!("not_found_error"))
    );
    assert_eq!(env.sim.stats().requests.values().sum::<u64>(), 1);
    common::settled_as_the_upstream_served(&env).await;
}

#[tokio::test]
async fn memory_messages_are_capped_forwarded_and_settled() {
    messages_are_capped_forwarded_and_settled(false).await;
}

#[tokio::test]
async fn redis_messages_are_capped_forwarded_and_settled() {
    messages_are_capped_forwarded_and_settled(true).await;
}

#[tokio::test]
async fn memory_refusals_take_anthropics_error_format() {
    refusals_take_anthropics_error_format(false).await;
}

#[tokio::test]
async fn redis_refusals_take_anthropics_error_format() {
    refusals_take_anthropics_error_format(true).await;
}
