//! The provider's own limits: a provider that says, in its answers' headers or in a 429, that
//! no request will be admitted before an instant gets none from the gateway before then (every
//! instance sharing the store holds back), its clients are told to wait, and what the provider
//! refused is charged to no budget. On the memory store and on Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::time::Duration;

use serde_json::json;
use tollgate_core::Store;
use tollgate_testkit::sim::SimConfig;
use tollgate_testkit::sim::limits::Rate;

use common::{Env, Reply};

const KEY: &str = "sk-provider";

/// A gateway whose tenant has a day's budget, in front of a provider that admits two chat
/// requests a minute.
async fn env(redis: bool) -> Env {
    env_with(redis, Duration::from_secs(60), "").await.0
}

/// A gateway in front of a provider that admits two chat requests per `window`, with `extra`
/// configuration, and the configuration's text (another instance may share its store).
async fn env_with(redis: bool, window: Duration, extra: &str) -> (Env, String) {
    let rate = Rate {
        requests: 2,
        tokens: None,
        window,
    };
    env_rate(redis, rate, extra).await
}

/// A gateway in front of a provider of `rate`, with `extra` configuration.
async fn env_rate(redis: bool, rate: Rate, extra: &str) -> (Env, String) {
    let sim = SimConfig {
        rate: Some(rate),
        ..SimConfig::default()
    };
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, sim, "provider").await;
    let text = format!(
        "{store}\n{extra}\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\", \"claude-sonnet-4\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[[policy.scopes]]\nkey = \"tenant\"\n\
         budget = {{ tokens = 100000, period = \"day\" }}\n",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
    );
    (
        Env::start(&text, common::SIM_KEY, sim, redis_server).await,
        text,
    )
}

async fn chat(env: &Env) -> Reply {
    ask(env, 20).await
}

/// A chat request with an output cap of `max`.
async fn ask(env: &Env, max: u64) -> Reply {
    let body = json!({"model": "gpt-4o", "max_tokens": max,
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
    tollgate_testkit::wait::until("the provider's hold kept", async || {
        let kills = env.store.kills().await.unwrap();
        kills.iter().any(|(t, _)| t == "provider:gpt-4o")
    })
    .await;
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
    // Counted as the provider's refusal, not as an operator's kill switch.
    let metrics = common::get(env.metrics, "/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let count = |decision: &str| {
        let prefix = format!("tollgate_decisions_total{{decision=\"{decision}\",rule=\"\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.parse::<f64>().ok())
    };
    assert_eq!(
        (count("upstream_rate_limited"), count("kill_switch")),
        (Some(1.0), Some(0.0)),
        "{text}"
    );
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

/// With a queue, a request the provider's hold refuses waits for the hold's end, when it comes
/// within the queue's wait, and is then served: the provider never answers 429.
async fn a_held_request_waits_in_the_queue_for_the_reset(redis: bool) {
    let queue = "[queue]\nmax_wait = \"5s\"\nper_key = 4\nglobal = 4\n";
    let (env, _) = env_with(redis, Duration::from_secs(1), queue).await;
    for _ in 0..2 {
        assert_eq!(chat(&env).await.status, 200);
    }
    held(&env).await;
    let r = chat(&env).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let stats = env.sim.stats();
    assert_eq!(
        (stats.requests.values().sum::<u64>(), stats.rate_limited),
        (3, 0)
    );
}

/// Without a queue, or when the hold ends past the queue's wait, the request is refused at
/// once with the provider's wait.
async fn a_hold_past_the_queues_wait_is_refused_at_once(redis: bool) {
    let queue = "[queue]\nmax_wait = \"2s\"\nper_key = 4\nglobal = 4\n";
    let (env, _) = env_with(redis, Duration::from_secs(60), queue).await;
    for _ in 0..2 {
        assert_eq!(chat(&env).await.status, 200);
    }
    held(&env).await;
    let r = chat(&env).await;
    assert_eq!((r.status, r.code()), (429, "upstream_rate_limited".into()));
    assert_eq!(env.sim.stats().requests.values().sum::<u64>(), 2);
}

/// A provider with few tokens left in its window (it says so in every answer) is sent no
/// request larger than what is left: that one is refused 429 `upstream_rate_limited` until the
/// tokens reset, while a smaller one is still served. The provider never answers 429.
async fn a_request_larger_than_the_tokens_left_is_not_sent(redis: bool) {
    let rate = Rate {
        requests: 100,
        tokens: Some(10_000),
        window: Duration::from_secs(60),
    };
    let (env, _) = env_rate(redis, rate, "").await;
    // About 8,000 of the 10,000 taken: under a quarter left.
    assert_eq!(ask(&env, 8_000).await.status, 200);
    held(&env).await;
    let r = ask(&env, 3_000).await;
    assert_eq!(
        (r.status, r.code()),
        (429, "upstream_rate_limited".into()),
        "{:?}",
        r.body
    );
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("tokens are left")
    );
    let wait: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((50..=60).contains(&wait), "{wait}");
    assert_eq!(ask(&env, 500).await.status, 200);
    let stats = env.sim.stats();
    assert_eq!(
        (stats.requests.values().sum::<u64>(), stats.rate_limited),
        (2, 0)
    );
}

/// Two gateway instances on one Redis: the hold one of them learns from the provider's answer
/// holds the other, which sends nothing.
#[tokio::test]
async fn instances_on_one_redis_share_a_providers_hold() {
    let (first, text) = env_with(true, Duration::from_secs(60), "").await;
    let second = Env::start(&text, common::SIM_KEY, first.sim.clone(), None).await;
    assert_eq!(chat(&first).await.status, 200);
    assert_eq!(chat(&second).await.status, 200);
    held(&first).await;
    let r = chat(&second).await;
    assert_eq!(
        (r.status, r.code()),
        (429, "upstream_rate_limited".into()),
        "{:?}",
        r.body
    );
    let r = chat(&first).await;
    assert_eq!((r.status, r.code()), (429, "upstream_rate_limited".into()));
    let stats = first.sim.stats();
    assert_eq!(
        (stats.requests.values().sum::<u64>(), stats.rate_limited),
        (2, 0)
    );
}

/// A request of `max` output tokens in Anthropic's format.
async fn ask_anthropic(env: &Env, max: u64) -> Reply {
    let body = json!({"model": "claude-sonnet-4", "max_tokens": max,
        "messages": [{"role": "user", "content": "hi"}]});
    env.post_oneshot(
        "/v1/messages",
        &[
            ("x-api-key", KEY.to_owned()),
            ("anthropic-version", "2023-06-01".to_owned()),
        ],
        serde_json::to_vec(&body).unwrap(),
    )
    .await
}

/// A request of `max` output tokens in OpenAI's format, or Anthropic's.
async fn send(env: &Env, anthropic: bool, max: u64) -> Reply {
    match anthropic {
        true => ask_anthropic(env, max).await,
        false => ask(env, max).await,
    }
}

/// Whether `env`'s store still holds the model.
async fn holds(env: &Env, model: &str) -> bool {
    let target = format!("provider:{model}");
    env.store
        .kills()
        .await
        .unwrap()
        .iter()
        .any(|(t, _)| *t == target)
}

/// A tier upgrade (10,000 tokens a minute, then 2,000,000): the hold the first answer asked
/// for is lifted by the next answer that shows room, in OpenAI's headers and in Anthropic's;
/// on Redis, an answer to one instance lifts the hold of another.
async fn a_later_answer_with_room_lifts_the_hold(redis: bool) {
    let rate = |tokens| Rate {
        requests: 100,
        tokens: Some(tokens),
        window: Duration::from_secs(60),
    };
    for (anthropic, model) in [(false, "gpt-4o"), (true, "claude-sonnet-4")] {
        let (first, text) = env_rate(redis, rate(10_000), "").await;
        let second = match redis {
            true => Some(Env::start(&text, common::SIM_KEY, first.sim.clone(), None).await),
            false => None,
        };
        let other = second.as_ref().unwrap_or(&first);
        let first = &first;
        assert_eq!(send(first, anthropic, 8_000).await.status, 200);
        tollgate_testkit::wait::until("the hold kept", async || holds(first, model).await).await;
        let r = send(first, anthropic, 3_000).await;
        assert_eq!(
            (r.status, r.code()),
            (429, "upstream_rate_limited".into()),
            "{model}"
        );
        // The provider upgrades the tier; the next small request's answer shows room.
        first.sim.set_rate(rate(2_000_000));
        assert_eq!(send(other, anthropic, 500).await.status, 200, "{model}");
        tollgate_testkit::wait::until_within(
            &format!("{model}: the hold lifted"),
            Duration::from_secs(3),
            async || !holds(first, model).await,
        )
        .await;
        assert_eq!(send(first, anthropic, 3_000).await.status, 200, "{model}");
    }
}

mod both {
    on_both_stores!(
        a_later_answer_with_room_lifts_the_hold,
        a_provider_with_no_requests_left_gets_none,
        a_held_request_waits_in_the_queue_for_the_reset,
        a_hold_past_the_queues_wait_is_refused_at_once,
        a_request_larger_than_the_tokens_left_is_not_sent,
        a_providers_429_is_not_charged_and_holds_the_model
    );
}
