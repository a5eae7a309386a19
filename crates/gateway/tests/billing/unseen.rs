//! What the upstream bills that the gateway never sees: hidden reasoning on a stream its client
//! leaves, images and documents priced by their model's rule, audio, the tools the upstream
//! runs, models without a known tokenizer. Each test is an attack against a simulator that
//! bills the way the provider documents; each holds when the request is refused before the
//! upstream, or billed no more than was reserved and charged no less than was billed. Where a
//! store is involved, each runs on the memory store and on Redis.

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

use common::Env;

const KEY: &str = "sk-unseen";

/// A gateway with a daily token budget of `budget` for tenant `acme` (its key's), `extra`
/// sections, in front of a simulator configured by `sim`.
async fn env(redis: bool, budget: u64, extra: &str, sim: SimConfig) -> Env {
    let (sim, redis_server, store) =
        common::upstream_and_store(redis, common::SIM_KEY, sim, "unseen").await;
    let text = format!(
        "{store}{extra}\n[[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\n\
         models = [\"gpt-4o\", \"o3-mini\", \"claude-sonnet-4-5\", \"gpt-4.1-nano\", \"house-model\", \"gpt-4o-audio-preview\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[policy]\n\
         [[policy.scopes]]\nname = \"spend\"\nkey = \"tenant\"\n\
         budget = {{ tokens = {budget}, period = \"1d\" }}\n",
        sim.base_url(),
        tollgate_gateway::hash_key(KEY),
    );
    Env::start(&text, common::SIM_KEY, sim, redis_server).await
}

/// Tokens the simulator billed: input and output.
fn billed(env: &Env) -> u64 {
    let s = env.sim.stats();
    s.prompt_tokens + s.completion_tokens
}

/// The tenant's daily usage once nothing is held and the simulator has nothing in flight
/// (fails after 5 s).
async fn settled_usage(env: &Env) -> ScopeUsage {
    tollgate_testkit::wait::poll(Duration::from_secs(5), async || {
        let day = Some(Period::Fixed(86_400_000));
        let u = env.store.usage("spend|tenant:acme", day).await.unwrap();
        let busy = env.sim.stats().in_flight.values().sum::<u64>();
        if u.reserved == 0 && u.leases == 0 && busy == 0 {
            // The reading's instant is not what is compared.
            return Ok(ScopeUsage { at_ms: 0, ..u });
        }
        Err(format!("still held: {u:?}, {busy} in flight"))
    })
    .await
}

/// Streams `body` to `path` and hangs up as soon as what was received contains `until`, as a
/// client that has what it wanted does. Returns what it received.
async fn stream_until(env: &Env, path: &str, body: &Value, until: &str) -> String {
    let req = hyper::Request::post(format!("http://{}{path}", env.addr))
        .header("authorization", format!("Bearer {KEY}"))
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
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
        if String::from_utf8_lossy(&seen).contains(until) {
            break;
        }
    }
    drop(body);
    drop(client);
    String::from_utf8_lossy(&seen).into_owned()
}

// ---------------------------------------------------------------------------------------------
// Streams the client leaves.

/// A reasoning model's stream whose client hangs up at the first visible token, after 1,800
/// hidden reasoning tokens: the gateway keeps reading the upstream to its usage and charges
/// what the upstream bills, never only the visible token.
async fn a_left_reasoning_stream_is_charged_what_the_upstream_bills(redis: bool) {
    let sim = SimConfig {
        reasoning_tokens: 1_800,
        output_tokens: 200,
        token_delay: Duration::from_millis(2),
        ..SimConfig::default()
    };
    let env = env(redis, 1_000_000, "", sim).await;
    let body = json!({"model": "o3-mini", "stream": true, "reasoning_effort": "high",
        "max_completion_tokens": 2_000,
        "messages": [{"role": "user", "content": "prove the theorem"}]});
    for _ in 0..3 {
        let seen = stream_until(&env, "/v1/chat/completions", &body, "\" tok\"").await;
        assert!(!seen.contains("[DONE]"), "the client left early: {seen}");
    }
    let u = settled_usage(&env).await;
    let billed = billed(&env);
    assert!(
        billed > 3 * 1_800,
        "the upstream billed the reasoning: {billed}"
    );
    assert!(
        u.settled >= billed,
        "charged {} of {billed} billed",
        u.settled
    );
}

/// Claude's extended thinking streams only a summary; the client hangs up at the first text: the
/// gateway reads on to `message_delta`'s output, which counts every thinking token.
async fn a_left_thinking_stream_is_charged_what_the_upstream_bills(redis: bool) {
    let sim = SimConfig {
        reasoning_tokens: 3_000,
        output_tokens: 200,
        token_delay: Duration::from_millis(2),
        ..SimConfig::default()
    };
    let env = env(redis, 1_000_000, "", sim).await;
    let body = json!({"model": "claude-sonnet-4-5", "stream": true, "max_tokens": 4_000,
        "thinking": {"type": "enabled", "budget_tokens": 3_000},
        "messages": [{"role": "user", "content": "prove the theorem"}]});
    for _ in 0..3 {
        let seen = stream_until(&env, "/v1/messages", &body, "text_delta").await;
        assert!(
            !seen.contains("message_stop"),
            "the client left early: {seen}"
        );
    }
    let u = settled_usage(&env).await;
    let billed = billed(&env);
    assert!(
        billed > 3 * 3_000,
        "the upstream billed the thinking: {billed}"
    );
    assert!(
        u.settled >= billed,
        "charged {} of {billed} billed",
        u.settled
    );
}

/// A stream whose client left and whose usage never comes within the stream's bound is charged
/// its whole reservation; every record says what was charged and that the client left.
async fn a_left_stream_without_usage_is_charged_its_reservation(redis: bool) {
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records.jsonl");
    let sim = SimConfig {
        output_tokens: 400,
        token_delay: Duration::from_millis(20),
        ..SimConfig::default()
    };
    let extra = format!(
        "[server]\nstream_max_duration = \"500ms\"\n[records]\npath = \"{}\"\n",
        records.display()
    );
    let env = env(redis, 1_000_000, &extra, sim).await;
    let body = json!({"model": "gpt-4o", "stream": true, "max_tokens": 300,
        "messages": [{"role": "user", "content": "write at length"}]});
    stream_until(&env, "/v1/chat/completions", &body, "\" tok\"").await;
    let u = settled_usage(&env).await;
    let billed = billed(&env);
    let record = tollgate_testkit::wait::poll(Duration::from_secs(5), async || {
        let text = std::fs::read_to_string(&records).unwrap_or_default();
        match text.lines().find(|l| l.contains("\"ending\"")) {
            Some(line) => Ok(serde_json::from_str::<Value>(line).unwrap()),
            None => Err(format!("no ending recorded: {text}")),
        }
    })
    .await;
    let reserved = record["estimated_tokens"].as_u64().unwrap();
    assert_eq!(
        u.settled, reserved,
        "the reservation is charged; billed {billed}"
    );
    assert!(u.settled >= billed);
    assert_eq!(record["client_left"], true, "{record}");
    assert_eq!(record["settled"], json!([reserved]), "{record}");
}

// ---------------------------------------------------------------------------------------------
// Input the body carries but its text does not say the price of.

/// Where a case's decision records go.
struct Records(tempfile::TempDir);

impl Records {
    fn new() -> Self {
        Self(tempfile::tempdir().unwrap())
    }
    fn section(&self) -> String {
        format!("[records]\npath = \"{}\"\n", self.path().display())
    }
    fn path(&self) -> std::path::PathBuf {
        self.0.path().join("records.jsonl")
    }
    /// The first record with an ending (fails after 5 s).
    async fn ended(&self) -> Value {
        tollgate_testkit::wait::poll(Duration::from_secs(5), async || {
            let text = std::fs::read_to_string(self.path()).unwrap_or_default();
            match text.lines().find(|l| l.contains("\"ending\"")) {
                Some(line) => Ok(serde_json::from_str(line).unwrap()),
                None => Err(format!("no ending recorded: {text}")),
            }
        })
        .await
    }
}

/// The books hold for one request: refused before the upstream saw it, or billed no more than
/// was reserved and charged no less than was billed. Returns whether it was served.
async fn books_hold(env: &Env, records: &Records, path: &str, body: &Value) -> bool {
    let r = env
        .post_oneshot(
            path,
            &[
                ("authorization", format!("Bearer {KEY}")),
                ("anthropic-version", "2023-06-01".to_owned()),
            ],
            body.to_string(),
        )
        .await;
    let served = env.sim.stats().requests.values().sum::<u64>();
    if r.status != 200 {
        assert_eq!(served, 0, "refused after the upstream saw it: {:?}", r.body);
        return false;
    }
    let u = settled_usage(env).await;
    let billed = billed(env);
    let record = records.ended().await;
    let reserved = record["estimated_tokens"].as_u64().unwrap();
    assert!(
        billed <= reserved,
        "billed {billed} over {reserved} reserved: {record}"
    );
    assert!(
        u.settled >= billed,
        "charged {} of {billed} billed",
        u.settled
    );
    true
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A PDF of `n` pages without text.
fn blank_pdf(n: u64) -> Vec<u8> {
    let mut s = String::from("%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n");
    s.push_str(&format!(
        "2 0 obj << /Type /Pages /Count {n} /Kids [] >> endobj\n"
    ));
    for k in 0..n {
        s.push_str(&format!(
            "{} 0 obj << /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >> endobj\n",
            k + 3
        ));
    }
    s.push_str("%%EOF\n");
    s.into_bytes()
}

/// Twelve images by URL on gpt-4.1-nano, `detail: high`: its patch rule (×2.46), not the tile
/// rule of gpt-4.1, prices each at up to 3,779 tokens.
async fn images_are_priced_by_their_models_rule(redis: bool) {
    let records = Records::new();
    let env = env(redis, 1_000_000, &records.section(), SimConfig::default()).await;
    let mut parts = vec![json!({"type": "text", "text": "compare these"})];
    for _ in 0..12 {
        parts.push(json!({"type": "image_url",
            "image_url": {"url": "https://images.test/2048x2048.png", "detail": "high"}}));
    }
    let body = json!({"model": "gpt-4.1-nano", "max_tokens": 50,
        "messages": [{"role": "user", "content": parts}]});
    assert!(books_hold(&env, &records, "/v1/chat/completions", &body).await);
    assert!(
        billed(&env) > 12 * 3_700,
        "the upstream billed the patches: {}",
        billed(&env)
    );
}

/// The Responses API's `input_image` by `file_id` is served, reserved at the model's most.
async fn an_image_by_file_id_is_served_at_its_most(redis: bool) {
    let records = Records::new();
    let env = env(redis, 1_000_000, &records.section(), SimConfig::default()).await;
    let body = json!({"model": "gpt-4.1-nano", "max_output_tokens": 50,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this"},
            {"type": "input_image", "file_id": "file-img-2048x2048", "detail": "high"}]}]});
    assert!(books_hold(&env, &records, "/v1/responses", &body).await);
}

/// A chat `file` part holding a PDF of 100 blank pages (a few KiB): each page is billed as its
/// image, so it is priced by its pages, not by its base64 text.
async fn an_inline_pdf_is_priced_by_its_pages(redis: bool) {
    let records = Records::new();
    let env = env(redis, 1_000_000, &records.section(), SimConfig::default()).await;
    let pdf = format!("data:application/pdf;base64,{}", b64(&blank_pdf(100)));
    let body = json!({"model": "gpt-4o", "max_tokens": 50, "messages": [{"role": "user",
        "content": [{"type": "text", "text": "summarise"},
            {"type": "file", "file": {"filename": "blank.pdf", "file_data": pdf}}]}]});
    assert!(books_hold(&env, &records, "/v1/chat/completions", &body).await);
    assert!(
        billed(&env) > 76_000,
        "the upstream billed the pages: {}",
        billed(&env)
    );
}

/// Anthropic's base64 PDF `document` of 60 pages.
async fn an_anthropic_pdf_is_priced_by_its_pages(redis: bool) {
    let records = Records::new();
    let env = env(redis, 1_000_000, &records.section(), SimConfig::default()).await;
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 50, "messages": [{"role": "user",
        "content": [{"type": "document", "source": {"type": "base64",
            "media_type": "application/pdf", "data": b64(&blank_pdf(60))}},
            {"type": "text", "text": "summarise"}]}]});
    assert!(books_hold(&env, &records, "/v1/messages", &body).await);
    assert!(
        billed(&env) > 90_000,
        "the upstream billed the pages: {}",
        billed(&env)
    );
}

/// Earlier audio answers named by id are billed again: refused unless the operator allows for
/// them, then reserved at the allowance.
async fn audio_by_id_is_refused_or_allowed_for(redis: bool) {
    let messages = json!([
        {"role": "user", "content": "read me the news"},
        {"role": "assistant", "audio": {"id": "audio_400s"}},
        {"role": "user", "content": "and again"},
        {"role": "assistant", "audio": {"id": "audio_400s"}},
        {"role": "user", "content": "once more"}]);
    let body = json!({"model": "gpt-4o-audio-preview", "max_tokens": 50, "messages": messages});
    let records = Records::new();
    let env = env(redis, 1_000_000, &records.section(), SimConfig::default()).await;
    let r = env
        .post_oneshot(
            "/v1/chat/completions",
            &[("authorization", format!("Bearer {KEY}"))],
            body.to_string(),
        )
        .await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert_eq!(r.code(), "unpriced_audio_reference");
    assert_eq!(env.sim.stats().requests.values().sum::<u64>(), 0);
    let records = Records::new();
    let extra = format!(
        "[remote_content]\naudio_tokens_per_reference = 6000\n{}",
        records.section()
    );
    let env = self::env(redis, 1_000_000, &extra, SimConfig::default()).await;
    assert!(books_hold(&env, &records, "/v1/chat/completions", &body).await);
}

/// `input_audio` is priced by its duration, read from the clip's header; a clip that cannot be
/// read is refused, named.
async fn input_audio_is_priced_by_its_duration(redis: bool) {
    let records = Records::new();
    let env = env(redis, 1_000_000, &records.section(), SimConfig::default()).await;
    let clip = |data: String| {
        json!({"model": "gpt-4o-audio-preview", "max_tokens": 50, "messages": [{"role": "user",
            "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]}]})
    };
    let bad = env
        .post_oneshot(
            "/v1/chat/completions",
            &[("authorization", format!("Bearer {KEY}"))],
            clip(b64(b"RIFF-not-a-clip")).to_string(),
        )
        .await;
    assert_eq!(bad.status, 400, "{:?}", bad.body);
    assert!(
        bad.json()["error"]["param"]
            .as_str()
            .unwrap()
            .contains("input_audio")
    );
    assert!(
        books_hold(
            &env,
            &records,
            "/v1/chat/completions",
            &clip(b64(&common::wav(30)))
        )
        .await
    );
    assert!(
        billed(&env) >= 300,
        "the upstream billed the audio: {}",
        billed(&env)
    );
}

/// A model without a known tokenizer is reserved at a proven bound: 68k characters of Hindi,
/// which a vocabulary of its own may split far finer than `o200k_base` does.
async fn an_unknown_tokenizer_is_reserved_at_a_proven_bound(redis: bool) {
    let records = Records::new();
    let env = env(redis, 1_000_000, &records.section(), SimConfig::default()).await;
    let text = "भारत एक विशाल देश है जिसकी संस्कृति बहुत पुरानी है। ".repeat(1_300);
    assert!(text.chars().count() > 60_000);
    let body = json!({"model": "house-model", "max_tokens": 50,
        "messages": [{"role": "user", "content": text}]});
    assert!(books_hold(&env, &records, "/v1/chat/completions", &body).await);
}

mod both {
    on_both_stores!(
        a_left_reasoning_stream_is_charged_what_the_upstream_bills,
        a_left_thinking_stream_is_charged_what_the_upstream_bills,
        a_left_stream_without_usage_is_charged_its_reservation,
        images_are_priced_by_their_models_rule,
        an_image_by_file_id_is_served_at_its_most,
        an_inline_pdf_is_priced_by_its_pages,
        an_anthropic_pdf_is_priced_by_its_pages,
        audio_by_id_is_refused_or_allowed_for,
        input_audio_is_priced_by_its_duration,
        an_unknown_tokenizer_is_reserved_at_a_proven_bound
    );
}
