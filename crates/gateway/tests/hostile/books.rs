//! The books cannot be fooled: each test is an attack that made the upstream bill more than
//! was reserved, against a simulator that bills the way OpenAI and Anthropic bill (every
//! choice of every prompt, rejected predictions as output, tool-call arguments as output, the
//! tier's price). Where a store is involved, each runs on the memory store and on Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tollgate_core::{Period, ScopeUsage, Store};
use tollgate_testkit::sim::SimConfig;

use common::{Env, Reply};

const KEY: &str = "sk-books";

/// A gateway with the policy `policy` (rules as `[[scopes]]`) and `extra` sections, in front of
/// a simulator configured by `sim`; its key belongs to tenant `acme`.
async fn env(redis: bool, policy: &str, extra: &str, sim: SimConfig) -> Env {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, sim, "books").await;
    let text = format!(
        "{store}{extra}\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\n\
         models = [\"gpt-4o\", \"claude-sonnet-4-5\", \"house-model\"]\n{}\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[policy]\n{}\n",
        sim.base_url(),
        extra_upstream(extra),
        tollgate_gateway::hash_key(KEY),
        policy.replace("[[scopes]]", "[[policy.scopes]]"),
    );
    Env::start(&text, common::SIM_KEY, sim, redis_server).await
}

/// Lines of the upstream's section a test asks for, after the marker `#upstream: ` in `extra`.
fn extra_upstream(extra: &str) -> String {
    extra
        .lines()
        .filter_map(|l| l.strip_prefix("#upstream: "))
        .collect::<Vec<_>>()
        .join("\n")
}

async fn post(env: &Env, path: &str, body: &Value) -> Reply {
    post_with(env, path, &[], body).await
}

async fn post_with(env: &Env, path: &str, headers: &[(&str, String)], body: &Value) -> Reply {
    let mut h = vec![
        ("authorization", format!("Bearer {KEY}")),
        ("anthropic-version", "2023-06-01".to_owned()),
    ];
    h.extend(headers.iter().cloned());
    // One request each, whose answer does not depend on the connection: no socket.
    env.post_oneshot(path, &h, serde_json::to_vec(body).unwrap())
        .await
}

/// Tokens (or micro-dollars) the simulator billed: input and output.
fn billed(env: &Env) -> u64 {
    let s = env.sim.stats();
    s.prompt_tokens + s.completion_tokens
}

fn served(env: &Env) -> u64 {
    env.sim.stats().requests.values().sum()
}

/// The tenant's daily usage once nothing is held (fails after 3 s).
async fn settled_usage(env: &Env) -> ScopeUsage {
    tollgate_testkit::wait::poll(Duration::from_secs(3), async || {
        let u = env
            .store
            .usage("spend|tenant:acme", Some(Period::Fixed(86_400_000)))
            .await
            .unwrap();
        if u.reserved == 0 && u.leases == 0 {
            // The reading's instant is not what is compared.
            return Ok(ScopeUsage { at_ms: 0, ..u });
        }
        Err(format!("still held: {u:?}"))
    })
    .await
}

const TOKEN_BUDGET: &str = r#"
[[scopes]]
name = "spend"
key = "tenant"
budget = { tokens = BUDGET, period = "1d" }
"#;

fn token_budget(tokens: u64) -> String {
    TOKEN_BUDGET.replace("BUDGET", &tokens.to_string())
}

// ---------------------------------------------------------------------------------------------
// Field by field.

/// A completions prompt list is answered once per prompt: twenty prompts of 40 tokens' cap
/// reserve 800 output tokens, more than a 500-token budget holds, so the request is refused
/// before the upstream sees it. A budget that holds it settles what the upstream billed.
async fn prompt_lists_are_reserved_for_every_prompt(redis: bool) {
    let sim = SimConfig {
        output_tokens: 30,
        ..SimConfig::default()
    };
    let env = env(redis, &token_budget(500), "", sim.clone()).await;
    let prompts: Vec<String> = (0..20).map(|i| format!("prompt {i}")).collect();
    let body = json!({"model": "gpt-4o", "max_tokens": 40, "prompt": prompts});
    let r = post(&env, "/v1/completions", &body).await;
    assert_eq!(r.status, 429, "{:?}", r.json());
    assert_eq!(r.code(), "budget_limit");
    assert_eq!(served(&env), 0);
    // Token-id prompts too: two lists of ids are two prompts.
    let ids = json!({"model": "gpt-4o", "max_tokens": 300, "prompt": [[1, 2, 3], [4, 5, 6]]});
    let r = post(&env, "/v1/completions", &ids).await;
    assert_eq!(r.status, 429, "600 output tokens reserved: {:?}", r.json());

    let env = env_big(redis, sim).await;
    let r = post(&env, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    assert_eq!(r.json()["choices"].as_array().unwrap().len(), 20);
    assert_eq!(settled_usage(&env).await.settled, billed(&env));
    assert_eq!(env.sim.stats().completion_tokens, 20 * 30);
}

async fn env_big(redis: bool, sim: SimConfig) -> Env {
    env(redis, &token_budget(1_000_000), "", sim).await
}

/// A prediction's rejected tokens are billed as output: 2,000 predicted tokens do not fit a
/// 1,000-token budget whatever the cap; with room, the settlement is the upstream's bill.
async fn predictions_are_reserved_as_output(redis: bool) {
    let predicted = "word ".repeat(2_000);
    let body = json!({"model": "gpt-4o", "max_tokens": 10,
        "messages": [{"role": "user", "content": "rewrite this"}],
        "prediction": {"type": "content", "content": predicted}});
    let env = env(redis, &token_budget(1_000), "", SimConfig::default()).await;
    let r = post(&env, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 429, "{:?}", r.json());
    assert_eq!(served(&env), 0);

    let env = env_big(redis, SimConfig::default()).await;
    let r = post(&env, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    // The cap written upstream is the client's, not the prediction's share of the grant.
    assert_eq!(env.sim.stats().last_body.unwrap()["max_tokens"], 10);
    assert!(env.sim.stats().completion_tokens >= 2_000);
    assert_eq!(settled_usage(&env).await.settled, billed(&env));
}

const MONEY: &str = r#"
[policy.prices."gpt-4o"]
input = 2500000
output = 10000000
[policy.prices."gpt-4o".tiers.priority]
input = 5000000
output = 20000000
[policy.prices."claude-sonnet-4-5"]
input = 3000000
output = 15000000
[policy.prices."house-model"]
input = 1000000
output = 2000000
[[scopes]]
name = "spend"
key = "tenant"
budget = { micro_usd = 100000000, period = "1d" }
"#;

/// A service tier is charged at its price; a tier the price table does not price is refused
/// under a money budget, naming the field, and never reaches the upstream.
async fn service_tiers_are_priced_or_refused(redis: bool) {
    let env = env(redis, MONEY, "", SimConfig::default()).await;
    let chat = |tier: &str| {
        json!({"model": "gpt-4o", "max_tokens": 20, "service_tier": tier,
        "messages": [{"role": "user", "content": "hello"}]})
    };
    let r = post(&env, "/v1/chat/completions", &chat("flex")).await;
    assert_eq!(r.status, 400, "{:?}", r.json());
    assert_eq!(r.code(), "unpriced_service_tier");
    assert_eq!(r.json()["error"]["param"], "service_tier");
    assert_eq!(served(&env), 0);

    let r = post(&env, "/v1/chat/completions", &chat("priority")).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    let s = env.sim.stats();
    assert_eq!(s.service_tiers, ["priority"]);
    let want = (s.prompt_tokens * 5_000_000 + s.completion_tokens * 20_000_000).div_ceil(1_000_000);
    assert_eq!(
        settled_usage(&env).await.settled,
        want,
        "the priority price"
    );
    // The standard names are the standard price.
    let before = settled_usage(&env).await.settled;
    let r = post(&env, "/v1/chat/completions", &chat("default")).await;
    assert_eq!(r.status, 200);
    let s = env.sim.stats();
    let (p, c) = (s.prompt_tokens / 2, s.completion_tokens / 2);
    let want = (p * 2_500_000 + c * 10_000_000).div_ceil(1_000_000);
    assert_eq!(settled_usage(&env).await.settled - before, want);
    // Anthropic's region of its own is a tier like any other.
    let geo = json!({"model": "claude-sonnet-4-5", "max_tokens": 20, "inference_geo": "us",
        "messages": [{"role": "user", "content": "hello"}]});
    let r = post(&env, "/v1/messages", &geo).await;
    assert_eq!(r.status, 400, "{:?}", r.json());
    assert_eq!(r.json()["type"], "error");
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
}

/// One request may not cost more than its cap, on any model: a large `max_tokens` is refused
/// 400 with its cost in dollars before the upstream sees it, and nothing is reserved; the same
/// request in a tier priced higher is refused at a cap its standard price fits.
async fn a_request_over_its_cost_cap_never_reaches_the_upstream(redis: bool) {
    let env = env(
        redis,
        &format!("{MONEY}request_cost = \"$0.05\"\n"),
        "",
        SimConfig::default(),
    )
    .await;
    let chat = |max: u64, tier: Option<&str>| {
        let mut b = json!({"model": "gpt-4o", "max_tokens": max,
            "messages": [{"role": "user", "content": "hello"}]});
        if let Some(t) = tier {
            b["service_tier"] = json!(t);
        }
        b
    };
    // 5,000 output tokens at $10 per million are $0.05, with the input over the cap.
    let r = post(&env, "/v1/chat/completions", &chat(5_000, None)).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "request_cost_limit"),
        "{:?}",
        r.json()
    );
    let m = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        m.contains("limit $0.05,") && m.contains("maximum output cost $0.05"),
        "{m}"
    );
    assert_eq!(r.json()["error"]["param"], "max_tokens");
    assert_eq!(served(&env), 0);
    assert_eq!(settled_usage(&env).await.reserved, 0);
    // 4,000 fit at the standard price, not at the priority tier's $20 per million.
    let r = post(&env, "/v1/chat/completions", &chat(4_000, Some("priority"))).await;
    assert_eq!((r.status, r.code().as_str()), (400, "request_cost_limit"));
    assert_eq!(served(&env), 0);
    let r = post(&env, "/v1/chat/completions", &chat(4_000, None)).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    assert_eq!(served(&env), 1);
}

/// Two cap fields: the one the gateway grants is written, the other removed; a cap set to null
/// is replaced by the granted one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_granted_cap_reaches_the_upstream() {
    let env = env(false, &token_budget(100_000), "", SimConfig::default()).await;
    let body = json!({"model": "gpt-4o", "max_completion_tokens": 10, "max_tokens": 5000,
        "messages": [{"role": "user", "content": "hi"}]});
    let r = post(&env, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    let sent = env.sim.stats().last_body.unwrap();
    assert_eq!(sent["max_completion_tokens"], 10);
    assert!(sent.get("max_tokens").is_none(), "{sent}");
    for (field, other) in [
        ("max_tokens", "max_completion_tokens"),
        ("max_completion_tokens", "max_tokens"),
    ] {
        let body = json!({"model": "gpt-4o", field: null,
            "messages": [{"role": "user", "content": "hi"}]});
        let r = post(&env, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{:?}", r.json());
        let sent = env.sim.stats().last_body.unwrap();
        assert!(sent[field].as_u64().is_some_and(|n| n > 0), "{sent}");
        assert!(sent.get(other).is_none(), "{sent}");
    }
}

/// A field the gateway does not know is refused in the API's own format, naming it, unless the
/// operator declared it free for the upstream; audio output is refused as unpriced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_fields_are_refused_by_name() {
    let env = env(false, &token_budget(100_000), "", SimConfig::default()).await;
    let chat = json!({"model": "gpt-4o", "max_tokens": 5, "x_new_feature": {"fanout": 50},
        "messages": [{"role": "user", "content": "hi"}]});
    let r = post(&env, "/v1/chat/completions", &chat).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.code(), "unknown_parameter");
    assert_eq!(r.json()["error"]["param"], "x_new_feature");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("x_new_feature")
    );
    let msg = json!({"model": "claude-sonnet-4-5", "max_tokens": 5, "x_new_feature": true,
        "messages": [{"role": "user", "content": "hi"}]});
    let r = post(&env, "/v1/messages", &msg).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("x_new_feature")
    );
    let audio = json!({"model": "gpt-4o", "max_tokens": 5, "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
        "messages": [{"role": "user", "content": "hi"}]});
    let r = post(&env, "/v1/chat/completions", &audio).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.code(), "unpriced_parameter");
    assert_eq!(served(&env), 0, "nothing reached the upstream");

    let env = self::env(
        false,
        &token_budget(100_000),
        "#upstream: free_fields = [\"x_new_feature\"]",
        SimConfig::default(),
    )
    .await;
    let r = post(&env, "/v1/chat/completions", &chat).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    assert_eq!(
        env.sim.stats().last_body.unwrap()["x_new_feature"]["fanout"],
        50
    );
}

// ---------------------------------------------------------------------------------------------
// What is forwarded.

/// An upstream that reports less output than it streamed is charged what the gateway counted
/// passing through: 500 tokens delivered and 1 reported settle as the 500 billed. Tool-call
/// arguments are output too.
async fn output_is_charged_as_counted_not_as_reported(redis: bool) {
    let sim = SimConfig {
        output_tokens: 500,
        reported_output: Some(1),
        token_delay: Duration::ZERO,
        ..SimConfig::default()
    };
    let env = env_big(redis, sim).await;
    for stream in [true, false] {
        let body = json!({"model": "gpt-4o", "max_tokens": 1000, "stream": stream,
            "messages": [{"role": "user", "content": "write"}]});
        let r = post(&env, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(env.sim.stats().completion_tokens, 1_000);
    assert_eq!(settled_usage(&env).await.settled, billed(&env));

    let sim = SimConfig {
        output_tokens: 1,
        function_calls: 40,
        reported_output: Some(0),
        token_delay: Duration::ZERO,
        ..SimConfig::default()
    };
    let env = env_big(redis, sim).await;
    let tools = json!([{"type": "function", "function": {"name": "step",
        "parameters": {"type": "object"}}}]);
    let body = json!({"model": "gpt-4o", "max_tokens": 1000, "stream": true, "tools": tools,
        "messages": [{"role": "user", "content": "go"}]});
    let r = post(&env, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200);
    assert!(env.sim.stats().completion_tokens > 40);
    assert_eq!(settled_usage(&env).await.settled, billed(&env));
}

/// A model that runs past its cap is cut off near it: the client gets the end of an answer cut
/// by its cap in its own format, the upstream is let go of, and what was forwarded is settled.
async fn the_cap_holds_while_the_answer_streams(redis: bool) {
    let sim = SimConfig {
        output_tokens: 3_000,
        ignore_cap: true,
        token_delay: Duration::from_millis(1),
        ..SimConfig::default()
    };
    let env = env_big(redis, sim).await;
    let body = json!({"model": "gpt-4o", "max_tokens": 100, "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "go on forever"}]});
    let r = post(&env, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200);
    let text = String::from_utf8_lossy(&r.body).to_string();
    let delivered = text.matches("\"content\":\" tok\"").count() as u64;
    assert!(delivered > 100 && delivered <= 121, "{delivered} delivered");
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let u = settled_usage(&env).await;
    assert!(u.settled >= delivered, "{u:?}");
    // The upstream was let go of: its connection closed before it finished.
    common::instance::until("the upstream stopped", async || {
        !(env.sim.stats().cancelled.is_empty())
    })
    .await;
    assert_eq!(env.sim.stats().completed, 0, "the upstream ran to its end");
}

/// The cap is held in Anthropic's and the Responses API's streams too, ended in their shapes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_holds_in_every_format() {
    let sim = SimConfig {
        output_tokens: 3_000,
        ignore_cap: true,
        token_delay: Duration::from_millis(1),
        ..SimConfig::default()
    };
    let env = env_big(false, sim).await;
    let msg = json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "stream": true,
        "messages": [{"role": "user", "content": "go"}]});
    let r = post(&env, "/v1/messages", &msg).await;
    let text = String::from_utf8_lossy(&r.body).to_string();
    assert!(text.matches("text_delta").count() <= 121, "{text}");
    assert!(text.contains("\"stop_reason\":\"max_tokens\""), "{text}");
    assert!(
        text.trim_end()
            .ends_with("data: {\"type\":\"message_stop\"}"),
        "{text}"
    );
    let resp = json!({"model": "gpt-4o", "max_output_tokens": 100, "stream": true,
        "input": "go"});
    let r = post(&env, "/v1/responses", &resp).await;
    let text = String::from_utf8_lossy(&r.body).to_string();
    assert!(text.matches("\"delta\":\" tok\"").count() <= 121, "{text}");
    assert!(text.contains("event: response.incomplete"), "{text}");
    assert!(text.contains("\"reason\":\"max_output_tokens\""), "{text}");
}

// ---------------------------------------------------------------------------------------------
// Retries and addresses.

/// Streams a chat request with `Idempotency-Key: key`, reads until `[DONE]`, and hangs up at
/// once, as the official OpenAI SDK does.
async fn stream_and_hang_up(env: &Env, key: &str) {
    let body = json!({"model": "gpt-4o", "max_tokens": 5, "stream": true,
        "messages": [{"role": "user", "content": "pay the invoice"}]});
    let req = hyper::Request::post(format!("http://{}/v1/chat/completions", env.addr))
        .header("authorization", format!("Bearer {KEY}"))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut seen = Vec::new();
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.unwrap().into_data() {
            seen.extend_from_slice(&d);
        }
        if String::from_utf8_lossy(&seen).contains("[DONE]") {
            break;
        }
    }
    drop(body);
    drop(client);
}

/// A retry of a stream whose client hung up right after `[DONE]` is a replay: the upstream is
/// not called again and nothing more is charged.
async fn a_retried_stream_is_replayed_however_its_client_hung_up(redis: bool) {
    let env = env(
        redis,
        &token_budget(1_000_000),
        "[idempotency]\nmax_response_bytes = 65536\n",
        SimConfig::default(),
    )
    .await;
    for i in 0..5 {
        let key = format!("retry-{i}");
        stream_and_hang_up(&env, &key).await;
        let again = post_with(
            &env,
            "/v1/chat/completions",
            &[("idempotency-key", key.clone())],
            &json!({"model": "gpt-4o", "max_tokens": 5, "stream": true,
                "messages": [{"role": "user", "content": "pay the invoice"}]}),
        )
        .await;
        assert_eq!(again.status, 200, "{:?}", again.body);
        assert_eq!(
            again.header("x-tollgate-idempotent-replay"),
            Some("true"),
            "try {i}: served again"
        );
        assert_eq!(served(&env), i + 1, "try {i}");
    }
    assert_eq!(settled_usage(&env).await.settled, billed(&env));
}

/// Behind a proxy that appends `ip:port`, the address is read with its port, and a forged entry
/// to its left is never believed: 5 of 12 served against a limit of 5.
async fn forwarded_addresses_with_ports_are_limited(redis: bool) {
    let policy = r#"
[[scopes]]
name = "per-ip"
key = "ip"
requests = { limit = 5, window = "1m" }
"#;
    let env = env(
        redis,
        policy,
        "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n",
        SimConfig::default(),
    )
    .await;
    let chat = json!({"model": "gpt-4o", "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}]});
    let mut ok = 0;
    for i in 0..12 {
        let xff = [(
            "x-forwarded-for",
            format!("198.51.100.{i}, 203.0.113.7:{}", 40_000 + i),
        )];
        let r = post_with(&env, "/v1/chat/completions", &xff, &chat).await;
        if r.status == 200 {
            ok += 1;
        } else {
            assert_eq!(r.header("x-tollgate-scope"), Some("ip:203.0.113.7"));
        }
    }
    assert_eq!(ok, 5, "served against a limit of 5");
    // An entry that cannot be read: the proxy's own address, not the forged one to its left.
    let xff = [(
        "x-forwarded-for",
        "198.51.100.77, not-an-address".to_owned(),
    )];
    let r = post_with(&env, "/v1/chat/completions", &xff, &chat).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    let xff = [(
        "x-forwarded-for",
        "198.51.100.78, [2001:db8::7]:443".to_owned(),
    )];
    let r = post_with(&env, "/v1/chat/completions", &xff, &chat).await;
    assert_eq!(r.status, 200);
}

/// A key its rate refuses costs no count of its large bodies: the rate decides first, so a
/// large body that is not even JSON is refused by the rate (it was read, parsed and counted
/// before, and refused as invalid JSON); below the rate, the same body is a 400 and its attempt
/// is counted once.
async fn large_bodies_meet_the_rate_before_they_are_counted(redis: bool) {
    let policy = r#"
[[scopes]]
name = "per-key"
key = "key"
requests = { limit = 2, window = "1m" }
[[scopes]]
name = "spend"
key = "tenant"
budget = { tokens = 1000000, period = "1d" }
"#;
    let env = env(
        redis,
        policy,
        "[server]\nmax_body_bytes = 4194304\n",
        SimConfig::default(),
    )
    .await;
    let garbage = format!(
        "{{\"model\": \"gpt-4o\", \"messages\": \"{}",
        "x".repeat(300_000)
    );
    let auth = [("authorization", format!("Bearer {KEY}"))];
    let send = |body: String| common::post(env.addr, "/v1/chat/completions", &auth, body);
    // Below the rate: read, refused as what it is, and counted as an attempt.
    let r = send(garbage.clone()).await;
    assert_eq!(r.status, 400, "{:?}", r.json());
    let small = json!({"model": "gpt-4o", "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(post(&env, "/v1/chat/completions", &small).await.status, 200);
    // The third attempt in the window: refused by the rate before anything is counted.
    let r = send(garbage).await;
    assert_eq!(r.status, 429, "{:?}", r.json());
    assert_eq!(r.code(), "request_rate_limit");
    assert!(r.header("retry-after").is_some());
    assert_eq!(served(&env), 1);
    // Each attempt was counted once: the next small one is refused too, by the same rate.
    let r = post(&env, "/v1/chat/completions", &small).await;
    assert_eq!((r.status, r.code().as_str()), (429, "request_rate_limit"));
}

/// A model counted by the tokenizer the configuration names for it: its input is counted
/// exactly (it was estimated at a quarter more by the default counter), so a request of exactly
/// the input limit is served, and the stream's output is counted with it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_tokenizers_count_the_input() {
    use tollgate_tokens::{Counting, Encoding, Format, TokenCounter};
    let body = json!({"model": "house-model", "max_tokens": 5,
        "messages": [{"role": "user", "content": "a house model, counted as it counts"}]});
    let exact = TokenCounter::default()
        .with_model("house-model", Counting::Exact(Encoding::O200kBase))
        .count(
            Format::ChatCompletions,
            &serde_json::to_vec(&body).unwrap(),
            None,
        )
        .unwrap()
        .input_tokens;
    let policy =
        format!("[[scopes]]\nname = \"limit\"\nkey = \"tenant\"\ninput_tokens = {exact}\n");
    let env = env(
        false,
        &policy,
        "[tokenizers]\n\"house-model\" = \"o200k_base\"\n",
        SimConfig::default(),
    )
    .await;
    let r = post(&env, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{exact} input tokens: {:?}", r.json());
}

mod both {
    on_both_stores!(
        large_bodies_meet_the_rate_before_they_are_counted,
        prompt_lists_are_reserved_for_every_prompt,
        predictions_are_reserved_as_output,
        service_tiers_are_priced_or_refused,
        a_request_over_its_cost_cap_never_reaches_the_upstream,
        output_is_charged_as_counted_not_as_reported,
        the_cap_holds_while_the_answer_streams,
        a_retried_stream_is_replayed_however_its_client_hung_up,
        forwarded_addresses_with_ports_are_limited
    );
}
