//! What a money budget is charged besides token prices, attacked against a simulator that
//! bills the way the providers document: the tools the upstream runs (web search per call, file
//! search by its results, code-interpreter sessions), audio input at its own price, a long
//! context at its own price, and prices read from the pinned catalog. Each case holds when the
//! request is refused before the upstream, or billed no more than was reserved and charged no
//! less than was billed; each runs on the memory store and on Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::time::Duration;

use serde_json::{Value, json};
use tollgate_core::{Period, Store};
use tollgate_testkit::sim::SimConfig;

use common::Env;

const KEY: &str = "sk-fees";

/// Where one case's decision records go.
struct Case {
    env: Env,
    dir: tempfile::TempDir,
}

/// A gateway serving `model` with a daily budget `budget` (`tokens = ..` or `micro_usd = ..`)
/// for tenant `acme` and the `[policy]` lines `prices`, in front of the simulator.
async fn case(redis: bool, model: &str, budget: &str, prices: &str) -> Case {
    let sim = SimConfig::default();
    let dir = tempfile::tempdir().unwrap();
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, sim, "fees").await;
    let text = format!(
        "{store}[records]\npath = \"{}\"\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\n\
         models = [\"{model}\"]\n\
         [tokenizers]\n\"house-model\" = \"o200k_base\"\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[policy]\n{prices}\n\
         [[policy.scopes]]\nname = \"spend\"\nkey = \"tenant\"\n\
         budget = {{ {budget}, period = \"1d\" }}\n",
        dir.path().join("records.jsonl").display(),
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
    );
    let env = Env::start(&text, common::SIM_KEY, sim, redis_server).await;
    Case { env, dir }
}

impl Case {
    async fn post(&self, path: &str, body: &Value) -> common::Reply {
        self.env
            .post_oneshot(
                path,
                &[
                    ("authorization", format!("Bearer {KEY}")),
                    ("anthropic-version", "2023-06-01".to_owned()),
                ],
                body.to_string(),
            )
            .await
    }

    /// The first record with an ending, once nothing is held (fails after 5 s).
    async fn ended(&self) -> Value {
        tollgate_testkit::wait::poll(Duration::from_secs(5), async || {
            let u = self
                .env
                .store
                .usage("spend|tenant:acme", Some(Period::Fixed(86_400_000)))
                .await
                .unwrap();
            let text =
                std::fs::read_to_string(self.dir.path().join("records.jsonl")).unwrap_or_default();
            let line = text.lines().find(|l| l.contains("\"ending\""));
            match (line, u.reserved, u.leases) {
                (Some(line), 0, 0) => Ok(serde_json::from_str(line).unwrap()),
                _ => Err(format!("not ended: {u:?} {text}")),
            }
        })
        .await
    }

    /// The tenant's settled amount.
    async fn settled(&self) -> u64 {
        let day = Some(Period::Fixed(86_400_000));
        self.env
            .store
            .usage("spend|tenant:acme", day)
            .await
            .unwrap()
            .settled
    }

    /// Calls of tools the upstream ran, of `kind`.
    fn calls(&self, kind: &str) -> u64 {
        let s = self.env.sim.stats();
        s.server_tool_calls.get(kind).copied().unwrap_or(0)
    }

    /// Served, and the books hold: what the upstream billed (`billed`, from the simulator's
    /// stats) is within the reservation, and the store charged at least that.
    async fn holds(&self, billed: impl Fn(&Self) -> u64) {
        let record = self.ended().await;
        let billed = billed(self);
        let reserved = record["reserved"][0].as_u64().unwrap();
        assert!(
            billed <= reserved,
            "billed {billed} over {reserved} reserved: {record}"
        );
        let charged = self.settled().await;
        assert!(charged >= billed, "charged {charged} of {billed} billed");
    }
}

/// A price per million tokens, in micro-dollars, as the pinned catalog's JSON states it
/// (dollars per token), read here apart from the gateway's own reading.
fn catalog(model: &str, field: &str) -> u64 {
    let raw: Value = serde_json::from_str(tollgate_prices::PINNED).unwrap();
    let v = &raw[model][field];
    let per_token = v.as_f64().unwrap_or_else(|| panic!("{model} {field}: {v}"));
    (per_token * 1e12).round() as u64
}

/// Tokens at their prices per million, in micro-dollars, the sum rounded up once (as a
/// provider rounds a bill).
fn at(parts: &[(u64, u64)]) -> u64 {
    parts
        .iter()
        .map(|(tokens, price)| tokens * price)
        .sum::<u64>()
        .div_ceil(1_000_000)
}

/// The simulator's tokens billed: (input, output).
fn tokens(c: &Case) -> (u64, u64) {
    let s = c.env.sim.stats();
    (s.prompt_tokens, s.completion_tokens)
}

/// Responses `file_search` with `max_num_results: 50`: each call pulls in up to 50 chunks of
/// 800 tokens, all billed as input; the reservation holds them.
async fn file_search_is_reserved_for_all_its_results(redis: bool) {
    let c = case(redis, "gpt-4o", "tokens = 1000000", "").await;
    let body = json!({"model": "gpt-4o", "max_output_tokens": 50, "input": "find the clause",
        "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"], "max_num_results": 50}]});
    let r = c.post("/v1/responses", &body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(c.calls("file_search"), 4);
    c.holds(|c| {
        let (i, o) = tokens(c);
        i + o
    })
    .await;
}

/// Responses `web_search` under a money budget: each call's fee ($25 per 1,000 calls for
/// gpt-4o-mini in the catalog) is reserved for the most calls allowed and charged for the calls
/// the answer shows.
async fn web_search_fees_are_charged_under_a_money_budget(redis: bool) {
    let c = case(redis, "gpt-4o-mini", "micro_usd = 10000000", "").await;
    let body = json!({"model": "gpt-4o-mini", "max_output_tokens": 50, "input": "news today",
        "tools": [{"type": "web_search"}]});
    let r = c.post("/v1/responses", &body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let searches = c.calls("web_search");
    assert_eq!(searches, 4);
    c.holds(|c| {
        let (i, o) = tokens(c);
        at(&[
            (i, catalog("gpt-4o-mini", "input_cost_per_token")),
            (o, catalog("gpt-4o-mini", "output_cost_per_token")),
        ]) + searches * 25_000
    })
    .await;
}

/// The same over a stream, whose calls are counted as their items begin.
async fn streamed_web_search_fees_are_charged(redis: bool) {
    let c = case(redis, "gpt-4o-mini", "micro_usd = 10000000", "").await;
    let body = json!({"model": "gpt-4o-mini", "max_output_tokens": 50, "input": "news today",
        "stream": true, "tools": [{"type": "web_search"}], "max_tool_calls": 2});
    let r = c.post("/v1/responses", &body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(c.calls("web_search"), 2);
    c.holds(|c| {
        let (i, o) = tokens(c);
        at(&[
            (i, catalog("gpt-4o-mini", "input_cost_per_token")),
            (o, catalog("gpt-4o-mini", "output_cost_per_token")),
        ]) + 2 * 25_000
    })
    .await;
}

/// Anthropic's web search ($10 per 1,000 searches in the catalog for claude-sonnet-4-5),
/// counted from the answer's `server_tool_use`.
async fn anthropic_web_search_fees_are_charged(redis: bool) {
    let c = case(redis, "claude-sonnet-4-5", "micro_usd = 10000000", "").await;
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 50,
        "messages": [{"role": "user", "content": "news today"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]});
    let r = c.post("/v1/messages", &body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(c.calls("web_search"), 3);
    c.holds(|c| {
        let (i, o) = tokens(c);
        at(&[
            (i, catalog("claude-sonnet-4-5", "input_cost_per_token")),
            (o, catalog("claude-sonnet-4-5", "output_cost_per_token")),
        ]) + 3 * 10_000
    })
    .await;
}

/// A 30-second clip to an audio model: its 300 audio tokens cost $40 per million, sixteen
/// times the text input price, and are reserved and charged at it.
async fn audio_input_is_charged_at_its_own_price(redis: bool) {
    let c = case(
        redis,
        "gpt-4o-audio-preview-2024-12-17",
        "micro_usd = 10000000",
        "",
    )
    .await;
    let model = "gpt-4o-audio-preview-2024-12-17";
    let wav = {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(common::wav(30))
    };
    let body = json!({"model": model, "max_tokens": 50, "messages": [{"role": "user",
        "content": [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}]});
    let r = c.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    c.holds(|c| {
        let (i, o) = tokens(c);
        // The provider's rule: ten audio tokens a second.
        let audio = 300;
        at(&[
            (i - audio, catalog(model, "input_cost_per_token")),
            (audio, catalog(model, "input_cost_per_audio_token")),
            (o, catalog(model, "output_cost_per_token")),
        ])
    })
    .await;
}

/// Above its long-context threshold the whole request is billed at the long-context price.
async fn a_long_context_is_charged_at_its_own_price(redis: bool) {
    let prices = "price_catalog = \"none\"\n[policy.prices.\"house-model\"]\n\
                  input = 1000000\noutput = 2000000\n\
                  long_context = { above = 1000, input = 3000000, output = 6000000 }\n";
    let c = case(redis, "house-model", "micro_usd = 10000000", prices).await;
    let body = json!({"model": "house-model", "max_tokens": 50,
        "messages": [{"role": "user", "content": "word ".repeat(3_000)}]});
    let r = c.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    c.holds(|c| {
        let (i, o) = tokens(c);
        assert!(i > 1_000);
        at(&[(i, 3_000_000), (o, 6_000_000)])
    })
    .await;
}

/// A tool whose fee the model has no price for cannot be reserved in money: refused, named,
/// before the upstream.
async fn an_unpriced_tool_is_refused_under_a_money_budget(redis: bool) {
    let prices = "price_catalog = \"none\"\n[policy.prices.\"gpt-4o\"]\n\
                  input = 2500000\noutput = 10000000\n";
    let c = case(redis, "gpt-4o", "micro_usd = 10000000", prices).await;
    let body = json!({"model": "gpt-4o", "max_output_tokens": 50, "input": "plot it",
        "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]});
    let r = c.post("/v1/responses", &body).await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "unpriced_use", "{:?}", r.body);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("code interpreter")
    );
    assert_eq!(c.env.sim.stats().requests.values().sum::<u64>(), 0);
}

/// With no `[prices]` at all, a money budget prices gpt-4o from the pinned catalog.
async fn the_catalog_prices_a_model_the_policy_does_not(redis: bool) {
    let c = case(redis, "gpt-4o", "micro_usd = 10000000", "").await;
    let body = json!({"model": "gpt-4o", "max_tokens": 50,
        "messages": [{"role": "user", "content": "hello"}]});
    let r = c.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    // A money budget is told in dollars, never in the token headers.
    assert_eq!(r.header("x-ratelimit-limit-tokens"), None);
    assert_eq!(r.header("x-tollgate-budget-limit-usd"), Some("$10.00"));
    assert!(
        r.header("x-tollgate-budget-remaining-usd")
            .is_some_and(|v| v.starts_with("$9.99"))
    );
    c.holds(|c| {
        let (i, o) = tokens(c);
        at(&[
            (i, catalog("gpt-4o", "input_cost_per_token")),
            (o, catalog("gpt-4o", "output_cost_per_token")),
        ])
    })
    .await;
    let (i, o) = tokens(&c);
    let exact = at(&[
        (i, catalog("gpt-4o", "input_cost_per_token")),
        (o, catalog("gpt-4o", "output_cost_per_token")),
    ]);
    assert!(c.settled().await <= exact + 1);
}

mod both {
    on_both_stores!(
        file_search_is_reserved_for_all_its_results,
        web_search_fees_are_charged_under_a_money_budget,
        streamed_web_search_fees_are_charged,
        anthropic_web_search_fees_are_charged,
        audio_input_is_charged_at_its_own_price,
        a_long_context_is_charged_at_its_own_price,
        an_unpriced_tool_is_refused_under_a_money_budget,
        the_catalog_prices_a_model_the_policy_does_not
    );
}
