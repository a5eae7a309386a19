//! Agent loops through the gateway: tool calls counted from every format's answers, streamed or
//! not, and settled as an operation's budget; identical requests and histories that repeat one
//! tool call refused as loops. Memory store and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[macro_use]
mod common;

use std::time::Duration;

use serde_json::{Value, json};
use tollgate_core::{Period, Store};
use tollgate_testkit::sim::SimConfig;

use common::{Env, Reply};

const KEY: &str = "sk-agents-acme";
const OP: &str = "x-tollgate-operation";

async fn env(redis: bool, policy: &str, sim: SimConfig) -> Env {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, sim, "agents").await;
    let text = format!(
        "{store}[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\n\
         models = [\"gpt-4o\", \"claude-sonnet-4\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[policy]\n{}",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
        policy.replace("[[scopes]]", "[[policy.scopes]]"),
    );
    Env::start(&text, common::SIM_KEY, sim, redis_server).await
}

/// One round of an agent in `format` (`chat`, `responses` or `anthropic`), offering one
/// function tool.
async fn round(env: &Env, format: &str, stream: bool, op: &str) -> Reply {
    let schema = json!({"type": "object", "properties": {"q": {"type": "string"}}});
    let (path, body, auth) = match format {
        "chat" => (
            "/v1/chat/completions",
            json!({"model": "gpt-4o", "max_tokens": 10, "stream": stream,
                "messages": [{"role": "user", "content": "find it"}],
                "tools": [{"type": "function", "function": {"name": "search", "parameters": schema}}]}),
            ("authorization", format!("Bearer {KEY}")),
        ),
        "responses" => (
            "/v1/responses",
            json!({"model": "gpt-4o", "max_output_tokens": 10, "stream": stream,
                "input": "find it", "store": false,
                "tools": [{"type": "function", "name": "search", "parameters": schema}]}),
            ("authorization", format!("Bearer {KEY}")),
        ),
        _ => (
            "/v1/messages",
            json!({"model": "claude-sonnet-4", "max_tokens": 10, "stream": stream,
                "messages": [{"role": "user", "content": "find it"}],
                "tools": [{"name": "search", "input_schema": schema}]}),
            ("x-api-key", KEY.to_owned()),
        ),
    };
    let headers = vec![
        auth,
        (OP, op.to_owned()),
        ("anthropic-version", "2023-06-01".to_owned()),
    ];
    common::post(env.addr, path, &headers, body.to_string()).await
}

/// The operation's tool calls (settled, reserved), once nothing is reserved or after 2 s.
async fn calls_of(env: &Env, op: &str) -> (u64, u64) {
    let scope = format!("calls|tenant:acme/operation:{op}?tool_calls");
    let mut u = (0, 0);
    for _ in 0..100 {
        let s = env
            .store
            .usage(&scope, Some(Period::Fixed(3_600_000)))
            .await
            .unwrap();
        u = (s.settled, s.reserved);
        if u.1 == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    u
}

/// Each answer makes two calls: the limit of five admits three rounds (0, 2, 4 made before
/// each) and refuses the fourth, in every format, streamed or not; the books hold what the
/// upstream made.
async fn tool_calls_are_settled_from_every_format(redis: bool) {
    let policy = "[[scopes]]\nname = \"calls\"\nkey = \"operation\"\n\
                  tool_calls = { limit = 5, period = \"1h\" }\n";
    let sim = SimConfig {
        function_calls: 2,
        ..SimConfig::default()
    };
    let env = env(redis, policy, sim).await;
    let mut made = 0;
    for format in ["chat", "responses", "anthropic"] {
        for stream in [false, true] {
            let op = format!("{format}-{stream}");
            for n in 0..3 {
                let r = round(&env, format, stream, &op).await;
                assert_eq!(r.status, 200, "{op} round {n}: {:?}", r.body);
                made += 2;
                assert_eq!(calls_of(&env, &op).await, (2 * (n + 1), 0), "{op}");
            }
            let r = round(&env, format, stream, &op).await;
            assert_eq!(r.status, 429, "{op}");
            assert_eq!(r.header("x-tollgate-reason"), Some("tool_call_limit"));
            assert!(r.header("retry-after").is_some());
            assert_eq!(env.sim.stats().function_calls, made, "{op}");
        }
    }
}

/// The same request past `max_identical` is refused `loop_detected` with `x-should-retry:
/// false`, and not sent upstream; one whose history repeats a tool call too often likewise.
async fn loops_are_refused(redis: bool) {
    let policy = "[[scopes]]\nname = \"loops\"\nkey = \"operation\"\n\
                  loops = { max_identical = 2, window = \"10m\" }\n";
    let env = env(redis, policy, SimConfig::default()).await;
    for _ in 0..2 {
        assert_eq!(round(&env, "chat", false, "op-a").await.status, 200);
    }
    let r = round(&env, "chat", false, "op-a").await;
    assert_eq!(r.status, 429);
    assert_eq!(r.code(), "loop_detected");
    assert_eq!(r.header("x-should-retry"), Some("false"));
    let sent = env.sim.stats().requests.values().sum::<u64>();
    assert_eq!(sent, 2, "the repeat never reached the upstream");
    // Another operation's identical request is its own.
    assert_eq!(round(&env, "chat", false, "op-b").await.status, 200);
    // A history that holds the same call three times (ids differ, as each round's do).
    let call = |i: usize| {
        json!([{"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{i}"),
            "type": "function", "function": {"name": "search", "arguments": "{\"q\":\"x\"}"}}]},
            {"role": "tool", "tool_call_id": format!("c{i}"), "content": "nothing"}])
    };
    let mut messages = vec![json!({"role": "user", "content": "find it"})];
    for i in 0..3 {
        messages.extend(call(i).as_array().unwrap().iter().cloned());
    }
    let body = json!({"model": "gpt-4o", "max_tokens": 10, "messages": messages});
    let headers = [
        ("authorization", format!("Bearer {KEY}")),
        (OP, "op-c".to_owned()),
    ];
    let r = common::post(env.addr, "/v1/chat/completions", &headers, body.to_string()).await;
    assert_eq!(r.status, 429, "{:?}", r.body);
    assert_eq!(r.code(), "loop_detected");
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("appears 3 times"), "{message}");
    // Two repeats are within the limit.
    messages.truncate(5);
    let body: Value = json!({"model": "gpt-4o", "max_tokens": 10, "messages": messages});
    let r = common::post(env.addr, "/v1/chat/completions", &headers, body.to_string()).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
}

mod both {
    on_both_stores!(tool_calls_are_settled_from_every_format, loops_are_refused);
}
