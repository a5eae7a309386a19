//! What the operator and the client are told: one wait in every header of a refusal, numbers
//! with their units. Memory store and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use serde_json::{Value, json};
use tollgate_testkit::sim::SimConfig;

use common::{Env, Reply};

const KEY: &str = "sk-operator";

async fn env(redis: bool, policy: &str) -> Env {
    env_with(redis, policy, "").await
}

async fn env_with(redis: bool, policy: &str, extra: &str) -> Env {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, SimConfig::default(), "op").await;
    let text = format!(
        "{store}{extra}\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\nallow_user = true\n[policy]\n{}\n",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
        policy.replace("[[scopes]]", "[[policy.scopes]]"),
    );
    Env::start(&text, common::SIM_KEY, sim, redis_server).await
}

async fn chat(env: &Env, max_tokens: u64) -> Reply {
    let body: Value = json!({"model": "gpt-4o", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}]});
    common::post(
        env.addr,
        "/v1/chat/completions",
        &[("authorization", format!("Bearer {KEY}"))],
        body.to_string(),
    )
    .await
}

/// Seconds in OpenAI's reset format (`6m0s`, `57s`).
fn openai_seconds(v: &str) -> u64 {
    let (mut total, mut n) = (0, 0);
    for c in v.chars() {
        match c {
            '0'..='9' => n = n * 10 + u64::from(c.to_digit(10).unwrap()),
            'h' => (total, n) = (total + n * 3600, 0),
            'm' => (total, n) = (total + n * 60, 0),
            's' => (total, n) = (total + n, 0),
            _ => panic!("{v}"),
        }
    }
    total
}

/// A refused attempt's `RateLimit` `t`, `x-ratelimit-reset-requests` and `retry-after-ms` name
/// one instant (the last with a jitter of at most a tenth, at most a second), refused attempts
/// counted; the message says the wait in words with its instant.
async fn a_refusal_names_one_wait(redis: bool) {
    let policy = r#"
[[scopes]]
name = "rate"
key = "tenant"
requests = { limit = 2, window = "20s" }
"#;
    let env = env(redis, policy).await;
    for _ in 0..2 {
        assert_eq!(chat(&env, 5).await.status, 200);
    }
    for _ in 0..3 {
        let r = chat(&env, 5).await;
        assert_eq!(r.status, 429);
        let t: u64 = r
            .header("ratelimit")
            .unwrap()
            .rsplit(";t=")
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let reset = openai_seconds(r.header("x-ratelimit-reset-requests").unwrap());
        let ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
        let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert_eq!(t, reset, "RateLimit and x-ratelimit-reset disagree");
        assert!(
            ms + 1000 > t * 1000 && ms <= t * 1000 + 1000,
            "{ms} ms against t={t}"
        );
        assert_eq!(secs, ms.div_ceil(1000));
        assert_eq!(r.header("x-should-retry"), None, "a short wait is retried");
        let m = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(m.contains("limit 2 requests, remaining 0 requests"), "{m}");
        assert!(m.contains(" Retry in ") && m.contains("(at 20"), "{m}");
    }
}

/// A money budget's refusal speaks in dollars; a wait longer than an SDK sleeps says
/// `x-should-retry: false`.
async fn a_money_refusal_speaks_in_dollars(redis: bool) {
    let policy = r#"
[prices."gpt-4o"]
input = 2500000
output = 10000000
[[scopes]]
name = "spend"
key = "tenant"
budget = { micro_usd = 20000, period = "1d" }
"#
    .replace("[prices.", "[policy.prices.");
    let env = env(redis, &policy).await;
    let r = chat(&env, 5000).await;
    assert_eq!(r.status, 429);
    let m = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(m.contains("limit $0.02,"), "{m}");
    assert!(m.contains("this request reserves $0.05"), "{m}");
    assert!(!m.contains("micro"), "{m}");
    assert_eq!(r.header("x-should-retry"), Some("false"));
}

/// A record keeps no value a client chose in clear: a refusal's scope names the end user by the
/// same digest as the record's facts.
async fn records_digest_the_scopes_a_client_chose(redis: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("records.jsonl");
    let policy = r#"
[[scopes]]
name = "per-user"
key = "tenant/user"
requests = { limit = 1, window = "1m" }
"#;
    let extra = format!("[records]\npath = {:?}\n", path.display().to_string());
    let env = env_with(redis, policy, &extra).await;
    let body = json!({"model": "gpt-4o", "max_tokens": 5, "user": "alice@example.com",
        "messages": [{"role": "user", "content": "hi"}]});
    for want in [200, 429] {
        let r = common::post(
            env.addr,
            "/v1/chat/completions",
            &[("authorization", format!("Bearer {KEY}"))],
            body.to_string(),
        )
        .await;
        assert_eq!(r.status, want);
    }
    let text = tollgate_testkit::wait::at_most(
        std::time::Duration::from_secs(3),
        async || std::fs::read_to_string(&path).unwrap_or_default(),
        |t| t.lines().count() >= 2,
    )
    .await;
    assert!(
        !text.contains("alice"),
        "a record keeps the user in clear: {text}"
    );
    let deny: Value = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|l| l["decision"] == "deny")
        .unwrap();
    let user = deny["facts"]["user"].as_str().unwrap();
    assert_eq!(deny["scope"], format!("tenant:acme/user:{user}"));
}

mod stores {
    on_both_stores!(
        a_refusal_names_one_wait,
        a_money_refusal_speaks_in_dollars,
        records_digest_the_scopes_a_client_chose
    );
}
