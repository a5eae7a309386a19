//! Anthropic's `POST /v1/messages` through the gateway, against the simulator's Anthropic
//! endpoint: `x-api-key` on both sides, the output cap written into `max_tokens`, settlement
//! from Anthropic's usage (body, or `message_start` and `message_delta` when streamed), and
//! refusals in Anthropic's error format. Memory store and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{Value, json};
use tollgate_testkit::sim::SimConfig;

use crate::common;

const KEY: &str = "sk-ant-acme";
const UPSTREAM_KEY: &str = "upstream-anthropic-secret";
const MODEL: &str = "claude-sonnet-4";

use common::{Env, Reply};

async fn env(redis: bool, budget: u64) -> Env {
    env_with(
        redis,
        &format!(
            "[[policy.scopes]]\nkey = \"tenant\"\nrequests = {{ limit = 100, window = \"1m\" }}\n\
             output_tokens = {{ max = 200, mode = \"clamp\", default = 12 }}\n\
             concurrency = {{ limit = 4, lease_ttl = \"30s\" }}\n\
             budget = {{ tokens = {budget}, period = \"day\" }}\n"
        ),
    )
    .await
}

/// A gateway for the `acme` tenant's key in front of the simulator's Anthropic endpoint, with
/// this policy.
async fn env_with(redis: bool, policy: &str) -> Env {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, UPSTREAM_KEY, SimConfig::default(), "ant").await;
    let text = format!(
        "{store}[[upstreams]]\nname = \"anthropic\"\nbase_url = \"{}\"\nmodels = [\"{MODEL}\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n{policy}",
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
    // One request each, whose answer does not depend on the connection: no socket.
    env.post_oneshot("/v1/messages", &headers, serde_json::to_vec(&body).unwrap())
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

/// A gateway whose `acme` tenant has a daily budget in money, with the model priced at 3 USD per
/// million input tokens, 0.30 cached and 15 output.
async fn money_env(redis: bool, budget: u64) -> Env {
    // The vocabulary the simulator bills this model with, named as an operator may: the
    // reservation is then what the upstream bills, and only the cache's price moves it.
    env_with(
        redis,
        &format!(
            "[tokenizers]\n\"{MODEL}\" = \"cl100k_base\"\n[policy.prices.\"{MODEL}\"]\ninput = 3000000\ncached_input = 300000\noutput = 15000000\n\
             [[policy.scopes]]\nkey = \"tenant\"\nbudget = {{ micro_usd = {budget}, period = \"day\" }}\n"
        ),
    )
    .await
}

/// The tenant's settled money once nothing is reserved and it has reached `want`.
async fn settled_money(env: &Env, want: u64) -> u64 {
    common::tenant_usage_when(&env.store, &format!("settled {want}"), |u| {
        u.reserved == 0 && u.settled >= want
    })
    .await
    .settled
}

/// What Anthropic's usage object costs at the test's prices, written out: fresh input at 3,
/// cache reads at 0.3, five-minute writes 1.25 x 3 and one-hour writes 2 x 3 micro-USD a token,
/// output at 15.
fn billed(u: &Value) -> u64 {
    let n = |k: &str| u[k].as_u64().unwrap_or(0);
    let hour = u["cache_creation"]["ephemeral_1h_input_tokens"]
        .as_u64()
        .unwrap_or(0);
    let five = n("cache_creation_input_tokens") - hour;
    // In tenths of a micro-USD, rounded up at the end (every part here is a whole number
    // except the reads; the settlement rounds each part up on its own, which is the same here).
    let tenths = 30 * n("input_tokens")
        + 3 * n("cache_read_input_tokens")
        + 30 * five
        + 30 * five / 4
        + 60 * hour
        + 150 * n("output_tokens");
    tenths.div_ceil(10)
}

/// A request with a long system prompt marked for the prompt cache (`ttl`: Anthropic's
/// `cache_control` lifetime, five minutes by default).
fn cached(text: &str, ttl: Option<&str>, stream: bool) -> Value {
    let mut control = json!({"type": "ephemeral"});
    if let Some(t) = ttl {
        control["ttl"] = t.into();
    }
    json!({"model": MODEL, "max_tokens": 8, "stream": stream,
        "system": [{"type": "text", "text": text, "cache_control": control}],
        "messages": [{"role": "user", "content": "Hello there!"}]})
}

fn long_prompt() -> String {
    "You answer questions about the weather, briefly. ".repeat(40)
}

/// The usage of a stream's `message_start` event.
fn start_usage(r: &Reply) -> Value {
    let text = String::from_utf8_lossy(&r.body).into_owned();
    let start = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .find(|l| l.contains("message_start"))
        .unwrap();
    let mut v: Value = serde_json::from_str(start).unwrap();
    v["message"]["usage"].take()
}

/// Prompt-cache writes are charged at Anthropic's multiples of the input price (1.25 for five
/// minutes, 2 for an hour) and reads at the cached price, from the body's usage and from a
/// stream's `message_start`.
async fn cache_writes_are_charged_at_their_price(redis: bool) {
    let env = money_env(redis, 100_000_000).await;
    let long = long_prompt();
    // Written for five minutes: input 3 + 0.75 a token.
    let r = send(&env, Some(KEY), cached(&long, None, false)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let u = r.json()["usage"].clone();
    let written = u["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(written > 300, "{u}");
    let mut want = billed(&u);
    assert_eq!(want, written * 3 + (written * 3).div_ceil(4) + 8 * 15);
    assert_eq!(settled_money(&env, want).await, want);
    // The same prompt again, streamed: read from the cache at 0.3 a token.
    let r = send(&env, Some(KEY), cached(&long, None, true)).await;
    assert_eq!(r.status, 200);
    let u = start_usage(&r);
    assert_eq!(u["cache_read_input_tokens"].as_u64(), Some(written), "{u}");
    want += (written * 3).div_ceil(10) + 8 * 15;
    assert_eq!(settled_money(&env, want).await, want);
    // Another prompt written for an hour, streamed: twice the input price.
    let other = format!("{long} Answer in French.");
    let r = send(&env, Some(KEY), cached(&other, Some("1h"), true)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let mut u = start_usage(&r);
    u["output_tokens"] = 8.into();
    let hour = u["cache_creation"]["ephemeral_1h_input_tokens"]
        .as_u64()
        .unwrap();
    assert!(hour > written, "{u}");
    assert_eq!(billed(&u), hour * 6 + 8 * 15);
    want += billed(&u);
    assert_eq!(settled_money(&env, want).await, want);
}

#[tokio::test]
async fn memory_cache_writes_are_charged_at_their_price() {
    cache_writes_are_charged_at_their_price(false).await;
}

#[tokio::test]
async fn redis_cache_writes_are_charged_at_their_price() {
    cache_writes_are_charged_at_their_price(true).await;
}

/// A request that marks blocks for the prompt cache reserves its input at the dearest write
/// price (twice the input price), so that its settlement cannot take a money budget past its
/// limit: with room for the input at three times 1.33, the plain request is admitted and the
/// marked one refused before anything is sent.
async fn cache_marked_requests_reserve_the_dearest_write(redis: bool) {
    // The prompt's size in tokens, as the upstream bills it.
    let probe = money_env(redis, 100_000_000).await;
    let r = send(&probe, Some(KEY), cached(&long_prompt(), None, false)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let input = r.json()["usage"]["cache_creation_input_tokens"]
        .as_u64()
        .unwrap();
    // Plain: input x 3 + 8 x 15 reserved; marked: input x 6 + 8 x 15.
    let env = money_env(redis, input * 4 + 8 * 15).await;
    let mut plain = cached(&long_prompt(), None, false);
    plain["system"][0]
        .as_object_mut()
        .unwrap()
        .remove("cache_control");
    let r = send(&env, Some(KEY), cached(&long_prompt(), None, false)).await;
    assert_eq!(r.status, 429, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "budget_limit", "{:?}", r.body);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("may be written to the prompt cache at twice the input price"),
        "{message}"
    );
    assert_eq!(env.sim.stats().requests.values().sum::<u64>(), 0);
    let r = send(&env, Some(KEY), plain).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let u = r.json()["usage"].clone();
    assert_eq!(u["cache_creation_input_tokens"], Value::Null, "{u}");
    settled_money(&env, billed(&u)).await;
}

#[tokio::test]
async fn memory_cache_marked_requests_reserve_the_dearest_write() {
    cache_marked_requests_reserve_the_dearest_write(false).await;
}

#[tokio::test]
async fn redis_cache_marked_requests_reserve_the_dearest_write() {
    cache_marked_requests_reserve_the_dearest_write(true).await;
}
