//! Agent loops through the gateway: tool calls counted from every format's answers, streamed or
//! not, and settled as an operation's budget; identical requests and histories that repeat one
//! tool call refused as loops. Memory store and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

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
    env.post_oneshot(path, &headers, body.to_string()).await
}

/// The operation's tool calls (settled, reserved), once nothing is reserved or after 2 s.
async fn calls_of(env: &Env, op: &str) -> (u64, u64) {
    let scope = format!("calls|tenant:acme/operation:{op}?tool_calls");
    let read = async || {
        let s = env
            .store
            .usage(&scope, Some(Period::Fixed(3_600_000)))
            .await;
        let s = s.unwrap();
        (s.settled, s.reserved)
    };
    tollgate_testkit::wait::until_within("nothing reserved", Duration::from_secs(2), async || {
        read().await.1 == 0
    })
    .await;
    read().await
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

/// A history of `n` turns after a system prompt, each a long question and a short answer;
/// the second turn's answer is a tool call and its result.
fn history(n: usize) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content": "Answer in one word."})];
    for i in 0..n {
        m.push(
            json!({"role": "user", "content": format!("question {i}: {}", "words ".repeat(60))}),
        );
        if i == 1 {
            m.push(
                json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                "type": "function", "function": {"name": "search", "arguments": "{}"}}]}),
            );
            m.push(json!({"role": "tool", "tool_call_id": "c1", "content": "found"}));
        }
        m.push(json!({"role": "assistant", "content": "ok"}));
    }
    m.pop();
    m
}

fn input_of(messages: &[Value]) -> u64 {
    let body = json!({"model": "gpt-4o", "max_tokens": 10, "messages": messages});
    tollgate_tokens::TokenCounter::default()
        .count(
            tollgate_tokens::Format::ChatCompletions,
            body.to_string().as_bytes(),
            None,
        )
        .unwrap()
        .input_tokens
}

/// Above a `trim`-mode input limit the oldest turns are dropped, the fewest that make the
/// request fit: the system prompt stays, a tool call keeps its result, the client is told how
/// many went. A last turn too large on its own is refused.
async fn history_is_trimmed_by_rule(redis: bool) {
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records.jsonl");
    let policy = format!(
        "[[scopes]]\nname = \"context\"\nkey = \"tenant\"\n\
         input_tokens = {{ max = 300, mode = \"trim\" }}\n[records]\npath = \"{}\"\n",
        records.display()
    );
    let env = env(redis, &policy, SimConfig::default()).await;
    let messages = history(6);
    assert!(input_of(&messages) > 300);
    let body = json!({"model": "gpt-4o", "max_tokens": 10, "messages": messages});
    let headers = [("authorization", format!("Bearer {KEY}"))];
    let r = common::post(env.addr, "/v1/chat/completions", &headers, body.to_string()).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let dropped: usize = r
        .header("x-tollgate-trimmed-turns")
        .unwrap()
        .parse()
        .unwrap();
    let sent = env.sim.stats().last_body.unwrap();
    let kept = sent["messages"].as_array().unwrap().clone();
    assert_eq!(kept[0]["role"], "system");
    assert_eq!(kept[1]["role"], "user", "a turn starts with its question");
    assert_eq!(kept.last(), messages.last(), "the question asked stays");
    let users = kept.iter().filter(|m| m["role"] == "user").count();
    assert_eq!(users, 6 - dropped);
    assert!(input_of(&kept) <= 300);
    // The fewest: one turn fewer dropped would not fit.
    let start = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m["role"] == "user")
        .nth(dropped - 1)
        .map(|(i, _)| i)
        .unwrap();
    let mut one_less = vec![messages[0].clone()];
    one_less.extend(messages[start..].iter().cloned());
    assert!(
        input_of(&one_less) > 300,
        "dropped {dropped}, one fewer would fit"
    );
    // No tool result without its call.
    let calls: Vec<&Value> = kept
        .iter()
        .filter_map(|m| m["tool_calls"].as_array())
        .flatten()
        .collect();
    for m in kept.iter().filter(|m| m["role"] == "tool") {
        assert!(calls.iter().any(|c| c["id"] == m["tool_call_id"]));
    }
    // The decision record says so.
    tollgate_testkit::wait::until("the record names the dropped turns", async || {
        let text = std::fs::read_to_string(&records).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|r| r["trimmed_turns"] == dropped as u64 && r["decision"] == "admit")
    })
    .await;
    // A question too large to fit alone.
    let huge = json!({"model": "gpt-4o", "max_tokens": 10, "messages": [
        {"role": "user", "content": "words ".repeat(400)}]});
    let r = common::post(env.addr, "/v1/chat/completions", &headers, huge.to_string()).await;
    assert_eq!((r.status, r.code().as_str()), (400, "input_token_limit"));
}

mod both {
    on_both_stores!(
        tool_calls_are_settled_from_every_format,
        loops_are_refused,
        history_is_trimmed_by_rule
    );
}
