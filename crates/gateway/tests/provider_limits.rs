//! The provider's own limits: a provider that says, in its answers' headers or in a 429, that
//! no request will be admitted before an instant gets none from the gateway before then (every
//! instance sharing the store holds back), its clients are told to wait, and what the provider
//! refused is charged to no budget. On the memory store and on Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[macro_use]
mod common;

use std::time::Duration;

use serde_json::json;
use tollgate_core::Store;
use tollgate_testkit::sim::SimConfig;

use common::{Env, Reply};

const KEY: &str = "sk-provider";

/// A gateway whose tenant has a day's budget, in front of a provider that admits two chat
/// requests a minute.
async fn env(redis: bool) -> Env {
    let sim = SimConfig {
        requests_per_window: Some((2, Duration::from_secs(60))),
        ..SimConfig::default()
    };
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, sim, "provider").await;
    let text = format!(
        "{store}\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[[policy.scopes]]\nkey = \"tenant\"\n\
         budget = {{ tokens = 100000, period = \"day\" }}\n",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
    );
    Env::start(&text, common::SIM_KEY, sim, redis_server).await
}

async fn chat(env: &Env) -> Reply {
    let body = json!({"model": "gpt-4o", "max_tokens": 20,
        "messages": [{"role": "user", "content": "hi"}]});
    env.post_oneshot(
        "/v1/chat/completions",
        &[("authorization", format!("Bearer {KEY}"))],
        serde_json::to_vec(&body).unwrap(),
    )
    .await
}

/// The hold is written by a task of its own: wait for it to be in the store.
async fn held(env: &Env) {
    for _ in 0..300 {
        let kills = env.store.kills().await.unwrap();
        if kills.iter().any(|(t, _)| t == "provider:gpt-4o") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the provider's hold was never kept");
}

/// The second answer says no request is left this minute: the third is refused by the gateway
/// (429 `upstream_rate_limited`, with the provider's wait) and never reaches the provider.
async fn a_provider_with_no_requests_left_gets_none(redis: bool) {
    let env = env(redis).await;
    for _ in 0..2 {
        assert_eq!(chat(&env).await.status, 200);
    }
    held(&env).await;
    let r = chat(&env).await;
    assert_eq!(
        (r.status, r.code()),
        (429, "upstream_rate_limited".into()),
        "{:?}",
        r.body
    );
    let wait: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((50..=60).contains(&wait), "{wait}");
    let stats = env.sim.stats();
    assert_eq!(
        (stats.requests.values().sum::<u64>(), stats.rate_limited),
        (2, 0)
    );
}

/// A 429 the provider answers (its limit reached by traffic the gateway did not see) is passed
/// on, charged nothing, and holds the model: the next request is not sent.
async fn a_providers_429_is_not_charged_and_holds_the_model(redis: bool) {
    let env = env(redis).await;
    for _ in 0..2 {
        assert_eq!(chat(&env).await.status, 200);
    }
    held(&env).await;
    let settled = common::tenant_usage_when(&env.store, "the two settled", |u| {
        u.reserved == 0 && u.settled > 0
    })
    .await
    .settled;
    // The hold lifted by hand: the provider is asked, and refuses.
    env.store.set_kill("provider:gpt-4o", None).await.unwrap();
    let r = chat(&env).await;
    assert_eq!(
        (r.status, r.code()),
        (429, "rate_limit_exceeded".into()),
        "{:?}",
        r.body
    );
    assert_eq!(env.sim.stats().rate_limited, 1);
    let u = common::tenant_usage_when(&env.store, "the 429 released", |u| u.reserved == 0).await;
    assert_eq!(u.settled, settled);
    held(&env).await;
    let r = chat(&env).await;
    assert_eq!((r.status, r.code()), (429, "upstream_rate_limited".into()));
    assert_eq!(env.sim.stats().rate_limited, 1);
}

mod both {
    on_both_stores!(
        a_provider_with_no_requests_left_gets_none,
        a_providers_429_is_not_charged_and_holds_the_model
    );
}
