//! OpenAI's Responses API (`POST /v1/responses`) through the gateway, against the simulator's
//! endpoint: the output cap written into `max_output_tokens`, settlement from the usage of the
//! body or of the stream's last event, and follow-ups (`previous_response_id`) admitted with the
//! context the upstream bills them for, which their bodies do not hold (on Redis, known to every
//! instance sharing the store). Memory store and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{Value, json};
use tollgate_testkit::sim::SimConfig;

use crate::common;

const KEY: &str = "sk-acme";
const UPSTREAM_KEY: &str = "upstream-openai-secret";

use common::{Env, Reply};

/// A gateway with an input limit of `max_input` tokens per request and a day's budget, and its
/// configuration (for more instances on the same store); `extra` is more configuration.
async fn env(redis: bool, max_input: u64, extra: &str) -> (Env, String) {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, UPSTREAM_KEY, SimConfig::default(), "resp").await;
    let text = format!(
        "{store}{extra}[responses]\nunknown_context_tokens = 1000\ncontext_ttl = \"2h\"\n\
         [[upstreams]]\nname = \"openai\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
         [[policy.scopes]]\nkey = \"tenant\"\nrequests = {{ limit = 100, window = \"1m\" }}\n\
         input_tokens = {max_input}\n\
         output_tokens = {{ max = 200, mode = \"clamp\", default = 12 }}\n\
         concurrency = {{ limit = 4, lease_ttl = \"30s\" }}\nbudget = {{ tokens = 100000, period = \"day\" }}\n",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
    );
    (
        Env::start(&text, UPSTREAM_KEY, sim, redis_server).await,
        text,
    )
}

async fn send(addr: std::net::SocketAddr, body: Value) -> Reply {
    common::post(
        addr,
        "/v1/responses",
        &[("authorization", format!("Bearer {KEY}"))],
        serde_json::to_vec(&body).unwrap(),
    )
    .await
}

/// The `response.*` event types of a stream, in order.
fn event_types(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .map(|v| v["type"].as_str().unwrap_or("").to_owned())
        .collect()
}

async fn responses_are_capped_forwarded_and_settled(redis: bool) {
    let (env, _) = env(redis, 1000, "").await;
    // Above the cap: clamped to 200, which the upstream gets with its own key.
    let r = send(
        env.addr,
        json!({"model": "gpt-4o", "input": "Hello there!", "max_output_tokens": 5000}),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["usage"]["output_tokens"], 16);
    assert_eq!(env.sim.stats().last_body.unwrap()["max_output_tokens"], 200);
    assert_eq!(
        env.sim
            .stats()
            .requests
            .get(&format!("Bearer {UPSTREAM_KEY}")),
        Some(&1)
    );
    assert!(r.headers.contains_key("x-ratelimit-remaining-requests"));
    common::settled_as_the_upstream_served(&env).await;
    // No cap: the policy's default is written in.
    let r = send(
        env.addr,
        json!({"model": "gpt-4o", "instructions": "Be brief.",
               "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(env.sim.stats().last_body.unwrap()["max_output_tokens"], 12);
    assert_eq!(r.json()["status"], "incomplete");
    common::settled_as_the_upstream_served(&env).await;
    // Streamed: the typed events pass unchanged, and the usage of the last one is settled.
    let r = send(
        env.addr,
        json!({"model": "gpt-4o", "input": "Hello there!", "max_output_tokens": 8, "stream": true}),
    )
    .await;
    assert_eq!(r.status, 200);
    let types = event_types(&r.body);
    assert_eq!(types.first().map(String::as_str), Some("response.created"));
    assert_eq!(
        types.last().map(String::as_str),
        Some("response.incomplete")
    );
    assert_eq!(
        types
            .iter()
            .filter(|t| *t == "response.output_text.delta")
            .count(),
        8
    );
    common::settled_as_the_upstream_served(&env).await;
    // Background responses cannot be settled: refused before anything is counted or sent.
    let r = send(
        env.addr,
        json!({"model": "gpt-4o", "input": "Hello", "background": true}),
    )
    .await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert_eq!(r.code(), "unsupported_parameter");
    assert_eq!(r.json()["error"]["param"], "background");
    assert_eq!(env.sim.stats().requests.values().sum::<u64>(), 3);
}

async fn follow_ups_are_admitted_with_the_context_they_carry(redis: bool) {
    // Each turn's body is the same few tokens; the conversation the upstream bills grows.
    let (env, text) = env(redis, 50, "").await;
    // On Redis, a second instance sharing the store serves every other turn: what a turn carries
    // is known to every instance.
    let mut addrs = vec![env.addr];
    if redis {
        addrs.push(common::spawn_gateway(&text, UPSTREAM_KEY).await.0);
    }
    let at = |turn: usize| addrs[turn % addrs.len()];
    let turn = |previous: Option<&str>, stream: bool| {
        let mut v = json!({"model": "gpt-4o", "input": "Hello there!", "stream": stream});
        if let Some(p) = previous {
            v["previous_response_id"] = p.into();
        }
        v
    };
    let r = send(at(0), turn(None, false)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let own = r.json()["usage"]["input_tokens"].as_u64().unwrap();
    let first = r.json()["id"].as_str().unwrap().to_owned();
    common::settled_as_the_upstream_served(&env).await;
    if let Some(redis) = &env._redis {
        // Kept in Redis for the configured two hours, in about 120 bytes.
        let key = format!("resp:n:ctx:{first}");
        let ttl: u64 = redis.cli_run(&["PTTL", &key]).parse().unwrap();
        assert!((7_190_000..=7_200_000).contains(&ttl), "{ttl}");
        let bytes: u64 = redis.cli_run(&["MEMORY", "USAGE", &key]).parse().unwrap();
        assert!(bytes <= 160, "{bytes}");
    }
    // Second turn, streamed: billed its own input and the first turn's input and output.
    let r = send(at(1), turn(Some(&first), true)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let text = String::from_utf8_lossy(&r.body).into_owned();
    let last = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .unwrap();
    let second = last["response"]["id"].as_str().unwrap().to_owned();
    assert_eq!(
        last["response"]["usage"]["input_tokens"].as_u64(),
        Some(own + own + 12)
    );
    common::settled_as_the_upstream_served(&env).await;
    // Third turn: its body is as small as the first's, but with what it carries (2 × own + 24
    // tokens of earlier turns) it passes the input limit of 50, so it is refused unsent.
    assert!(3 * own + 24 > 50 && 2 * own + 12 <= 50, "own = {own}");
    let r = send(at(2), turn(Some(&second), false)).await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert_eq!(r.code(), "input_token_limit");
    assert_eq!(r.json()["error"]["param"], "input");
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    let kept = 2 * own + 12 + 12;
    assert!(
        message.ends_with(&format!(
            "The input counted includes {kept} for the earlier context the upstream keeps."
        )),
        "{message}"
    );
    // A response this gateway never served: its context counts as configured (1000 tokens).
    let r = send(at(3), turn(Some("resp_elsewhere"), false)).await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert_eq!(r.code(), "input_token_limit");
    // An id longer than any kept (256 bytes) is not looked up: unknown too.
    let long = "r".repeat(10_000);
    let r = send(at(4), turn(Some(&long), false)).await;
    assert_eq!((r.status, r.code()), (400, "input_token_limit".to_owned()));
    // A response the upstream does not store (`store: false`) cannot be followed up upstream,
    // so nothing is kept for it: a follow-up naming it is unknown context.
    let mut unstored = turn(None, false);
    unstored["store"] = false.into();
    let r = send(at(5), unstored).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_owned();
    let r = send(at(6), turn(Some(&id), false)).await;
    assert_eq!((r.status, r.code()), (400, "input_token_limit".to_owned()));
    assert_eq!(env.sim.stats().requests.values().sum::<u64>(), 3);
    common::settled_as_the_upstream_served(&env).await;
    // Two follow-ups found what they carry, three did not (the process's one recorder).
    let metrics = common::get(env.metrics, "/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    for line in [
        "tollgate_followup_context_total{context=\"known\"} 2",
        "tollgate_followup_context_total{context=\"unknown\"} 3",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
}

/// Tools the upstream runs: the simulator's model calls each one ten times unless the request
/// bounds it, and each call fetches 500 tokens of input. The gateway bounds the calls in the
/// body the upstream gets (at most 2 here) and admits 500 input tokens for each.
async fn upstream_tools_are_bounded_and_admitted_with_their_input(redis: bool) {
    let tools = "[upstream_tools]\ntokens_per_call = 500\nmax_calls = 2\n";
    let (env, _) = env(redis, 1100, tools).await;
    let calls = || env.sim.stats().requests.values().sum::<u64>();
    let ask = |input: &str, tools: Value, bound: Option<u64>| {
        let mut v = json!({"model": "gpt-4o", "input": input, "tools": tools});
        if let Some(b) = bound {
            v["max_tool_calls"] = b.into();
        }
        v
    };
    let search = || json!([{"type": "web_search"}]);
    // A client-run tool: nothing admitted for it, nothing written.
    let f = json!([{"type": "function", "name": "f", "parameters": {"type": "object"}}]);
    let r = send(env.addr, ask("What is new?", f, None)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert!(
        env.sim
            .stats()
            .last_body
            .unwrap()
            .get("max_tool_calls")
            .is_none()
    );
    common::settled_as_the_upstream_served(&env).await;
    // Web search without a bound: two calls written in and admitted (1,000 tokens); the
    // upstream bills both calls' fetched input, and settlement charges it.
    let r = send(env.addr, ask("What is new?", search(), None)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(env.sim.stats().last_body.unwrap()["max_tool_calls"], 2);
    let billed = r.json()["usage"]["input_tokens"].as_u64().unwrap();
    assert!((1_000..1_050).contains(&billed), "{billed}");
    common::settled_as_the_upstream_served(&env).await;
    // A bound above the gateway's is lowered to it.
    let r = send(env.addr, ask("What is new?", search(), Some(50))).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(env.sim.stats().last_body.unwrap()["max_tool_calls"], 2);
    common::settled_as_the_upstream_served(&env).await;
    // A longer question fits the 1,100-token input limit alone, but not with two calls'
    // fetching: refused unsent. Bounded to one call by the client, it fits.
    let long = "Tell me what is new in the world of tokens today. ".repeat(12);
    let served = calls();
    let r = send(env.addr, ask(&long, json!([]), None)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let own = r.json()["usage"]["input_tokens"].as_u64().unwrap();
    assert!(own + 1_000 > 1_100 && own + 500 < 1_100, "own = {own}");
    let r = send(env.addr, ask(&long, search(), None)).await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert_eq!(r.code(), "input_token_limit");
    assert_eq!(r.json()["error"]["param"], "input");
    // The message says what of the input counted the body does not hold.
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.ends_with(
            "The input counted includes 1000 for what the tools the upstream runs may fetch."
        ),
        "{message}"
    );
    let r = send(env.addr, ask(&long, search(), Some(1))).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(env.sim.stats().last_body.unwrap()["max_tool_calls"], 1);
    assert_eq!(calls(), served + 2);
    common::settled_as_the_upstream_served(&env).await;
}

#[tokio::test]
async fn memory_upstream_tools_are_bounded_and_admitted_with_their_input() {
    upstream_tools_are_bounded_and_admitted_with_their_input(false).await;
}

#[tokio::test]
async fn redis_upstream_tools_are_bounded_and_admitted_with_their_input() {
    upstream_tools_are_bounded_and_admitted_with_their_input(true).await;
}

#[tokio::test]
async fn memory_responses_are_capped_forwarded_and_settled() {
    responses_are_capped_forwarded_and_settled(false).await;
}

#[tokio::test]
async fn redis_responses_are_capped_forwarded_and_settled() {
    responses_are_capped_forwarded_and_settled(true).await;
}

#[tokio::test]
async fn memory_follow_ups_are_admitted_with_the_context_they_carry() {
    follow_ups_are_admitted_with_the_context_they_carry(false).await;
}

#[tokio::test]
async fn redis_follow_ups_are_admitted_with_the_context_they_carry() {
    follow_ups_are_admitted_with_the_context_they_carry(true).await;
}
