//! Degrade before refusing: past a share of a rule's budget, a request for a listed model goes
//! to the cheaper model the rule names, is reserved and charged at its price, and the response
//! header and the decision record say so. On the memory store and on Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use serde_json::{Value, json};
use tollgate_testkit::sim::SimConfig;

use common::{Env, Reply};

const KEY: &str = "sk-degrade";
const NARROW: &str = "sk-degrade-narrow";

/// A tenant with $0.00038 a day, whose gpt-4o requests go to gpt-4o-mini past a quarter of it;
/// the `narrow` key may use gpt-4o only. Its decision records go to `records`.
async fn env(redis: bool, records: &std::path::Path) -> Env {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, SimConfig::default(), "degrade").await;
    let text = format!(
        "{store}\n[records]\npath = \"{}\"\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\", \"gpt-4o-mini\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\nmodels = [\"gpt-4o\"]\n\
         [policy.prices.\"gpt-4o\"]\ninput = 2500000\noutput = 10000000\n\
         [policy.prices.\"gpt-4o-mini\"]\ninput = 150000\noutput = 600000\n\
         [[policy.scopes]]\nkey = \"tenant\"\n\
         budget = {{ micro_usd = 380, period = \"day\" }}\n\
         degrade = {{ at = \"25%\", models = {{ \"gpt-4o\" = \"gpt-4o-mini\" }} }}\n",
        records.display(),
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
        tollgate_gateway::hash_key(NARROW),
    );
    Env::start(&text, common::SIM_KEY, sim, redis_server).await
}

async fn ask(env: &Env, key: &str) -> Reply {
    let body = json!({"model": "gpt-4o", "max_tokens": 20,
        "messages": [{"role": "user", "content": "hi"}]});
    let headers = [("authorization", format!("Bearer {key}"))];
    common::post(env.addr, "/v1/chat/completions", &headers, body.to_string()).await
}

/// The tenant's spend once it is past `before` and nothing is reserved.
async fn spent(env: &Env, before: u64) -> u64 {
    common::tenant_usage_when(&env.store, "settled", |u| {
        u.reserved == 0 && u.settled > before
    })
    .await
    .settled
}

/// The first request (about 225 micro-USD reserved, about 185 charged) passes a quarter of
/// the $0.00038: the next gpt-4o request would not fit what is left, and goes to gpt-4o-mini
/// instead, charged at its price. A key kept to gpt-4o is not degraded, and is refused.
async fn past_its_share_a_model_goes_to_the_cheaper_one(redis: bool) {
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records.jsonl");
    let env = env(redis, &records).await;
    let r = ask(&env, KEY).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.header("x-tollgate-degraded-from"), None);
    let first = spent(&env, 0).await;
    assert!((100..=215).contains(&first), "{first}");

    let r = ask(&env, KEY).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.header("x-tollgate-degraded-from"), Some("gpt-4o"));
    assert_eq!(env.sim.stats().last_body.unwrap()["model"], "gpt-4o-mini");
    let s = env.sim.stats();
    assert_eq!(s.requests.values().sum::<u64>(), 2);
    let mini = spent(&env, first).await - first;
    assert!(
        (1..=20).contains(&mini),
        "charged {mini} micro-USD at gpt-4o-mini's price"
    );

    let r = ask(&env, NARROW).await;
    assert_eq!(
        (r.status, r.code()),
        (429, "budget_limit".into()),
        "{:?}",
        r.body
    );

    // The records: the degraded request names the model it asked for, and went to the other.
    let text = tollgate_testkit::wait::at_most(
        std::time::Duration::from_secs(3),
        async || std::fs::read_to_string(&records).unwrap_or_default(),
        |t| t.lines().count() >= 3,
    )
    .await;
    let degraded: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["degraded_from"] == "gpt-4o")
        .collect();
    assert_eq!(degraded.len(), 1, "{text}");
    assert_eq!(degraded[0]["facts"]["model"], "gpt-4o-mini", "{text}");
}

mod both {
    on_both_stores!(past_its_share_a_model_goes_to_the_cheaper_one);
}
