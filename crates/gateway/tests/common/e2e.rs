//! What the end-to-end tests (`e2e_*.rs`) share: a gateway in front of the simulator with two
//! keys, on the memory store or a Redis of its own, and the checks every test ends with.

#![allow(clippy::unwrap_used, clippy::panic, dead_code)]

use std::time::Duration;

use bytes::Bytes;
use serde_json::json;
use tollgate_testkit::sim::SimConfig;

use super::{Env, Reply};

pub const KEY: &str = "sk-test-acme";
pub const OTHER_KEY: &str = "sk-test-other";
pub const UPSTREAM_KEY: &str = "upstream-secret";

pub async fn env(redis: bool, policy: &str, extra: &str, sim: SimConfig) -> Env {
    let (sim, redis_server, store_cfg) =
        super::upstream_and_store(redis, UPSTREAM_KEY, sim, "e2e").await;
    let text = format!(
        "{store_cfg}{extra}\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\", \"gpt-4o-fail\", \"text-embedding-3-small\", \"gpt-3.5-turbo-instruct\"]\n\
         [[keys]]\nname = \"acme\"\nhash = \"{}\"\ntenant = \"acme\"\nallow_user = true\n\
         [[keys]]\nname = \"other\"\nhash = \"{}\"\ntenant = \"other\"\nmodels = [\"text-embedding-3-small\"]\n\
         [policy]\n{policy}\n",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
        tollgate_gateway::hash_key(OTHER_KEY),
    )
    .replace("[[scopes]]", "[[policy.scopes]]");
    Env::start(&text, UPSTREAM_KEY, sim, redis_server).await
}

pub async fn send(env: &Env, path: &str, key: Option<&str>, body: impl Into<Bytes>) -> Reply {
    let auth: Vec<(&str, String)> = key
        .map(|k| ("authorization", format!("Bearer {k}")))
        .into_iter()
        .collect();
    super::post(env.addr, path, &auth, body).await
}

pub fn chat(content: &str, max: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": max, "messages": [{"role": "user", "content": content}]})).unwrap()
}

pub async fn tenant_usage(env: &Env) -> tollgate_core::ScopeUsage {
    super::tenant_usage(&env.store).await
}

/// The tenant's settled total once it reaches `expected` (settlement happens after the
/// response, off its path); fails after 3 s.
pub async fn settled_becomes(env: &Env, expected: u64) {
    tollgate_testkit::wait::poll(Duration::from_secs(3), async || {
        let u = tenant_usage(env).await;
        if u.settled == expected {
            return Ok(());
        }
        Err(format!("settled {} never became {expected}", u.settled))
    })
    .await;
}

/// Every test ends with nothing held: leases back, nothing reserved.
pub async fn assert_nothing_leaks(env: &Env) {
    tollgate_testkit::wait::poll(Duration::from_secs(3), async || {
        let u = tenant_usage(env).await;
        match (u.leases, u.reserved) {
            (0, 0) => Ok(()),
            _ => Err(format!("leaked: {u:?}")),
        }
    })
    .await;
}

pub const BASIC: &str = r#"
[[scopes]]
key = "tenant"
requests = { limit = 100, window = "1m" }
input_tokens = 1000
output_tokens = { max = 200, mode = "clamp", default = 50 }
concurrency = { limit = 4, lease_ttl = "30s" }
budget = { tokens = 100000, period = "day" }
"#;
