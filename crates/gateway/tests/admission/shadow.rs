//! Shadow rules through the gateway: evaluated and kept as if enforced, never refusing. The
//! same traffic gets the same answers with and without them; their would-be refusals are in
//! the decision records and the metrics; their books hold what they would have held. Memory
//! store and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use tollgate_core::{Period, ScopeUsage, Store};
use tollgate_testkit::sim::SimConfig;

use common::Env;

const KEY: &str = "sk-shadow-acme";
const DAY: Option<Period> = Some(Period::Fixed(86_400_000));

const ENFORCED: &str = "[[scopes]]\nname = \"tenant\"\nkey = \"tenant\"\n\
    requests = { limit = 6, window = \"1m\" }\nconcurrency = { limit = 4 }\n\
    budget = { tokens = 100000, period = \"day\" }\n";

/// Stricter than the enforced rule in every control they have: a rate of four, one lease at a
/// time, a budget of 30 tokens and an output cap of 15.
const SHADOW: &str = "[[scopes]]\nname = \"shadow-rate\"\nkey = \"tenant\"\nmode = \"shadow\"\n\
    requests = { limit = 4, window = \"1m\" }\nconcurrency = { limit = 1 }\n\
    [[scopes]]\nname = \"shadow-budget\"\nkey = \"tenant\"\nmode = \"shadow\"\n\
    budget = { tokens = 30, period = \"day\" }\n\
    [[scopes]]\nname = \"shadow-cap\"\nkey = \"tenant\"\nmode = \"shadow\"\n\
    output_tokens = { max = 15 }\n";

async fn env(redis: bool, policy: &str, records: &Path) -> Env {
    env_with(redis, policy, records, SimConfig::default()).await
}

async fn env_with(redis: bool, policy: &str, records: &Path, sim: SimConfig) -> Env {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, sim, "shadow").await;
    let text = format!(
        "{store}[records]\npath = \"{}\"\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\n\
         models = [\"gpt-4o\"]\n[[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[policy]\n{}",
        records.display(),
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
        policy.replace("[[scopes]]", "[[policy.scopes]]"),
    );
    Env::start(&text, common::SIM_KEY, sim, redis_server).await
}

async fn ask(env: &Env, max_tokens: u64) -> (u16, Option<String>) {
    let body = json!({"model": "gpt-4o", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hello there"}]});
    let headers = [("authorization", format!("Bearer {KEY}"))];
    let r = common::post(env.addr, "/v1/chat/completions", &headers, body.to_string()).await;
    (r.status, r.header("x-tollgate-reason").map(str::to_owned))
}

/// The usage of `scope` once nothing is reserved or held (endings follow responses); 3 s at
/// most.
async fn settled_usage(env: &Env, scope: &str) -> ScopeUsage {
    let u = tollgate_testkit::wait::at_most(
        Duration::from_secs(3),
        async || env.store.usage(scope, DAY).await.unwrap(),
        |u| u.reserved == 0 && u.leases == 0,
    )
    .await;
    // The reading's instant is not what is compared.
    ScopeUsage { at_ms: 0, ..u }
}

/// The decision records, in order, once `n` are written (3 s at most).
async fn records(path: &Path, n: usize) -> Vec<Value> {
    let read = async || -> Vec<Value> {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let mut rs =
        tollgate_testkit::wait::at_most(Duration::from_secs(3), read, |rs| rs.len() >= n).await;
    // Ids end in the gateway's sequence number, in hex.
    rs.sort_by_key(|r| {
        let id = r["request_id"].as_str().unwrap_or("");
        u64::from_str_radix(id.rsplit('-').next().unwrap_or(""), 16).unwrap_or(0)
    });
    rs
}

/// One admitted request, one killed while its shadow admission succeeded, one the shadow cap
/// would refuse, one the shadow budget would, then more than either rate allows.
async fn traffic(env: &Env) -> Vec<(u16, Option<String>)> {
    let mut answers = vec![ask(env, 10).await];
    env.store
        .set_kill("tenant:acme", Some("test"))
        .await
        .unwrap();
    answers.push(ask(env, 1).await);
    env.store.set_kill("tenant:acme", None).await.unwrap();
    answers.push(ask(env, 20).await);
    for _ in 0..6 {
        answers.push(ask(env, 10).await);
    }
    answers
}

async fn shadow_rules_never_change_answers(redis: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (plain_records, shadow_records) = (dir.path().join("a"), dir.path().join("b"));
    let plain = env(redis, ENFORCED, &plain_records).await;
    let shadowed = env(redis, &format!("{ENFORCED}{SHADOW}"), &shadow_records).await;
    let expected = traffic(&plain).await;
    let got = traffic(&shadowed).await;
    assert_eq!(
        got, expected,
        "the same answers with and without shadow rules"
    );
    assert_eq!(
        expected.iter().map(|a| a.0).collect::<Vec<_>>(),
        [200, 503, 200, 200, 200, 200, 200, 429, 429],
        "the traffic meets a kill switch and the enforced rate: {expected:?}"
    );
    let (a, b) = (plain.sim.stats(), shadowed.sim.stats());
    assert_eq!(a.prompt_tokens, b.prompt_tokens);
    assert_eq!(a.completion_tokens, b.completion_tokens);
    // The shadow cap would refuse max_tokens 20; the request went upstream as it was.
    let enforced = settled_usage(&plain, "tenant|tenant:acme").await;
    assert_eq!(
        settled_usage(&shadowed, "tenant|tenant:acme").await,
        enforced
    );

    // What the shadow rules would have refused, request by request.
    let rs = records(&shadow_records, expected.len()).await;
    let shadow: Vec<Option<(&str, &str)>> = rs
        .iter()
        .map(|r| {
            r.get("shadow")
                .map(|s| (s["reason"].as_str().unwrap(), s["rule"].as_str().unwrap()))
        })
        .collect();
    let rate = Some(("request_rate_limit", "shadow-rate"));
    assert_eq!(
        shadow,
        [
            None,
            None,
            Some(("output_token_limit", "shadow-cap")),
            Some(("budget_limit", "shadow-budget")),
            rate,
            rate,
            rate,
            rate,
            rate,
        ],
        "{rs:#?}"
    );
    let plain_rs = records(&plain_records, expected.len()).await;
    assert!(plain_rs.iter().all(|r| r.get("shadow").is_none()));

    // The shadow budget holds the one request it admitted and that ran: the first (the second
    // was killed, so its shadow reservation was given back).
    let first_settled = rs[0]["settled"][0].as_u64().unwrap();
    let budget = settled_usage(&shadowed, "shadow-budget|tenant:acme").await;
    assert_eq!(
        budget,
        ScopeUsage {
            settled: first_settled,
            reserved: 0,
            leases: 0,
            carried: 0,
            at_ms: 0,
        }
    );
    assert!(first_settled > 0 && first_settled <= 30);
    let leases = settled_usage(&shadowed, "shadow-rate|tenant:acme").await;
    assert_eq!(leases.leases, 0, "the shadow leases were given back");

    let metrics = common::get(shadowed.metrics, "/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    for (reason, rule) in [
        ("request_rate_limit", "shadow-rate"),
        ("budget_limit", "shadow-budget"),
        ("output_token_limit", "shadow-cap"),
    ] {
        let series =
            format!("tollgate_shadow_refusals_total{{reason=\"{reason}\",rule=\"{rule}\"}}");
        assert!(text.contains(&series), "{series} in\n{text}");
    }
}

/// A shadow rule's lease is held while its request runs, as an enforced one would be, and
/// given back with it.
async fn shadow_leases_live_with_their_request(redis: bool) {
    let dir = tempfile::tempdir().unwrap();
    let records_path = dir.path().join("r");
    let sim = SimConfig {
        latency: Duration::from_millis(400),
        ..SimConfig::default()
    };
    let env = env_with(redis, SHADOW, &records_path, sim).await;
    // The first request loads the tokenizer: not the one to time.
    assert_eq!(ask(&env, 5).await.0, 200);
    let (a, b) = tokio::join!(ask(&env, 5), async {
        tollgate_testkit::wait::until("the first request holds the shadow lease", async || {
            let held = env.store.usage("shadow-rate|tenant:acme", DAY).await;
            held.unwrap().leases == 1
        })
        .await;
        ask(&env, 5).await
    });
    assert_eq!(
        (a.0, b.0),
        (200, 200),
        "and the second is served all the same"
    );
    let rs = records(&records_path, 3).await;
    let reasons: Vec<&str> = rs
        .iter()
        .filter_map(|r| r.get("shadow").map(|s| s["reason"].as_str().unwrap()))
        .collect();
    assert_eq!(reasons, ["concurrency_limit"], "{rs:#?}");
    assert_eq!(
        settled_usage(&env, "shadow-rate|tenant:acme").await.leases,
        0
    );
}

mod both {
    on_both_stores!(
        shadow_rules_never_change_answers,
        shadow_leases_live_with_their_request
    );
}
