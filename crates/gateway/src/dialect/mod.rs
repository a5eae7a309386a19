//! API formats. Each is one small module behind [`Dialect`]: what its body calls the output cap,
//! how many choices it asks for, how the granted cap is written back, the headers its upstream
//! needs, how its answers are metered and what they report as usage, and the shape of its
//! errors. Adding a format is one new file here and one line in [`ALL`] (the tokenizer crate
//! counts its body under a [`Format`] of its own).

mod anthropic;
mod chat;
mod completions;
mod embeddings;
pub mod fields;
mod responses;

use axum::response::Response;
use bytes::Bytes;
use http::HeaderMap;
use http::request::Builder;
use serde_json::{Map, Value};
use tollgate_core::Usage;
use tollgate_tokens::Format;

use crate::config::{GatewayConfig, Upstream};
use crate::respond::{ApiError, Param};
use crate::sse::SseMeter;

/// One API format, from the request's intake to its error body.
pub trait Dialect: Sync + Send + std::fmt::Debug {
    /// How the tokenizer crate counts this format's body.
    fn format(&self) -> Format;

    /// The URL path it is served on, and forwarded to.
    fn path(&self) -> &'static str;

    /// The body field of the output cap, as errors name it.
    fn cap_field(&self) -> &'static str {
        "max_tokens"
    }

    /// Refuses request headers that would switch on what the gateway cannot see.
    fn check_headers(&self, _cfg: &GatewayConfig, _headers: &HeaderMap) -> Result<(), ApiError> {
        Ok(())
    }

    /// Refuses body fields whose usage could not be settled.
    fn check_body(&self, _json: &Value) -> Result<(), ApiError> {
        Ok(())
    }

    /// Whether the upstream keeps context that a follow-up carries as input (Responses API).
    fn keeps_context(&self) -> bool {
        false
    }

    /// Whether this response's context is kept for its follow-ups.
    fn stores_response(&self, _json: &Value) -> bool {
        false
    }

    /// How many choices the request asks for: the output cap is shared among them.
    fn choices(&self, _json: &Value) -> Result<u64, ApiError> {
        Ok(1)
    }

    /// What the upstream-run tools the body asks for may add to its input, with their calls
    /// bounded in the body ([`crate::upstream_tools`]); none by default.
    fn upstream_tools(
        &self,
        _json: &mut Value,
        _cfg: crate::upstream_tools::UpstreamTools,
    ) -> crate::upstream_tools::Allowance {
        crate::upstream_tools::Allowance::default()
    }

    /// The items of a non-streamed answer that show the fee-carrying calls made, where the
    /// format shows them all; `None` where it does not (chat's web search).
    fn answer_items<'a>(&self, _answer: &'a Value) -> Option<&'a Value> {
        None
    }

    /// The body fields this API accepts, each with its cost ([`fields`]); any other is refused.
    fn fields(&self) -> &'static [(&'static str, fields::Cost)];

    /// The service-tier values billed at the model's standard price.
    fn standard_tiers(&self) -> &'static [&'static str] {
        &["auto", "default"]
    }

    /// How many prompts the request holds, each answered in full (completions' prompt lists).
    fn prompts(&self, _json: &Value) -> u64 {
        1
    }

    /// The predicted output's text, billed as output where the model rejects it.
    fn predicted_text(&self, _json: &Value) -> Result<Option<String>, ApiError> {
        Ok(None)
    }

    /// Whether the answer has output tokens at all (embeddings have none).
    fn has_output(&self) -> bool {
        true
    }

    /// Input tokens the request may write to the upstream's prompt cache (billed above input).
    fn cache_write_tokens(&self, _json: &Value, _input: u64) -> u64 {
        0
    }

    /// This API's name for a field a control names (the input, the output cap).
    fn param_name(&self, param: &Param) -> String {
        param.chat_name().to_owned()
    }

    /// Writes the granted cap (per choice) into the body; returns whether the stream's usage
    /// event was asked for by the gateway only, and is to be kept from the client.
    fn set_cap(&self, body: &mut Map<String, Value>, per_choice: u64, stream: bool) -> bool;

    /// The upstream's credentials and this API's own headers.
    fn upstream_headers(&self, b: Builder, upstream: &Upstream, _client: &HeaderMap) -> Builder {
        match &upstream.api_key {
            Some(k) => b.header("authorization", format!("Bearer {k}")),
            None => b,
        }
    }

    /// The meter of a streamed answer.
    fn meter(&self, model: &str, strip_usage: bool) -> SseMeter {
        SseMeter::new(model, strip_usage)
    }

    /// What a non-streamed answer reports as usage (`None`: nothing); `bad` is set when a
    /// number is not a count. `input` is the counted input.
    fn usage(&self, usage: &Value, input: u64, bad: &mut bool) -> Option<Usage> {
        crate::sse::chat_usage(usage, input, bad).map(plain)
    }

    /// The tool calls a non-streamed answer makes (chat's `tool_calls` and legacy
    /// `function_call`, in every choice).
    fn tool_calls(&self, answer: &Value) -> u64 {
        let mut n = 0u64;
        for m in answer["choices"].as_array().into_iter().flatten() {
            let m = &m["message"];
            n = n.saturating_add(m["tool_calls"].as_array().map_or(0, |c| c.len() as u64));
            n = n.saturating_add(u64::from(m["function_call"].is_object()));
        }
        n
    }

    /// The body fields that make a request what it is, for loop detection; those whose entries
    /// carry ids (of tool calls, of items) that change from one sending to the next are marked.
    fn content_fields(&self) -> &'static [(&'static str, Volatile)] {
        &[
            ("model", Volatile::None),
            ("messages", Volatile::Ids),
            ("tools", Volatile::None),
            ("tool_choice", Volatile::None),
            ("functions", Volatile::None),
            ("response_format", Volatile::None),
        ]
    }

    /// The tool calls a request's history holds, as (name, arguments).
    fn history_tool_calls<'a>(&self, json: &'a Value) -> Vec<(&'a Value, &'a Value)> {
        let mut calls = Vec::new();
        for m in json["messages"].as_array().into_iter().flatten() {
            for c in m["tool_calls"].as_array().into_iter().flatten() {
                calls.push((&c["function"]["name"], &c["function"]["arguments"]));
            }
            if m["function_call"].is_object() {
                calls.push((
                    &m["function_call"]["name"],
                    &m["function_call"]["arguments"],
                ));
            }
        }
        calls
    }

    /// The body's list of turns that trimming drops from (`None`: this format has none).
    fn turn_list(&self) -> Option<&'static str> {
        Some("messages")
    }

    /// Whether an entry of the list starts a turn: a user's message.
    fn starts_turn(&self, item: &Value) -> bool {
        item["role"] == "user"
    }

    /// Whether an entry of the list is never dropped: the system prompt.
    fn pinned(&self, item: &Value) -> bool {
        matches!(item["role"].as_str(), Some("system" | "developer"))
    }

    /// The output of a non-streamed answer, each part's text apart (each is tokenized on its
    /// own): every choice's content, refusal and text, its tool calls' arguments. All are billed
    /// as output, and counted whatever the upstream reports.
    fn output_parts(&self, answer: &Value) -> Vec<String> {
        let mut parts = Vec::new();
        for c in answer["choices"].as_array().into_iter().flatten() {
            let m = &c["message"];
            let calls = m["tool_calls"].as_array().into_iter().flatten();
            let texts = [&m["content"], &m["refusal"], &c["text"]]
                .into_iter()
                .chain([&m["function_call"]["arguments"]])
                .chain(calls.map(|t| &t["function"]["arguments"]));
            parts.extend(texts.filter_map(Value::as_str).map(str::to_owned));
        }
        parts
    }

    /// An error, in this API's format: OpenAI's, with a control's field named as this API
    /// names it.
    fn error_response(&self, e: ApiError) -> Response {
        e.response_with(e.openai_body(|p| self.param_name(p)))
    }

    /// The event that ends a stream cut off by the gateway, in this API's format.
    fn stream_error(&self, code: &str, message: &str) -> Bytes {
        let error = serde_json::json!({"error": {"message": message, "type": "upstream_error",
            "code": code, "param": null}});
        Bytes::from(format!("data: {error}\n\n"))
    }
}

/// Which keys of a content field change between two sendings of the same request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Volatile {
    /// None.
    None,
    /// The ids of tool calls, their results and items (`id`, `tool_call_id`, `call_id`,
    /// `tool_use_id`), at any depth.
    Ids,
}

/// Every format served, in the order routes are registered.
pub static ALL: [&dyn Dialect; 5] = [
    &chat::Chat,
    &completions::Completions,
    &embeddings::Embeddings,
    &responses::Responses,
    &anthropic::Messages,
];

/// The dialect of `format`.
pub fn of(format: Format) -> &'static dyn Dialect {
    ALL.iter()
        .copied()
        .find(|d| d.format() == format)
        .unwrap_or(ALL[0])
}

/// Usage from (input, cached input, output).
fn plain((input_tokens, cached_input_tokens, output_tokens): (u64, u64, u64)) -> Usage {
    Usage {
        input_tokens,
        cached_input_tokens,
        output_tokens,
        ..Usage::default()
    }
}

/// `n` or `best_of`: absent or null is one; otherwise a positive integer.
fn choice_count(json: &Value, field: &str) -> Result<u64, ApiError> {
    match json.get(field) {
        None | Some(Value::Null) => Ok(1),
        Some(v) => v
            .as_u64()
            .filter(|n| *n >= 1)
            .ok_or_else(|| crate::respond::not_a_choice_count(field)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_format_has_one_dialect_and_one_path() {
        let formats = [
            Format::ChatCompletions,
            Format::Completions,
            Format::Embeddings,
            Format::Responses,
            Format::AnthropicMessages,
        ];
        for f in formats {
            assert_eq!(of(f).format(), f);
        }
        let mut paths: Vec<_> = ALL.iter().map(|d| d.path()).collect();
        paths.sort_unstable();
        paths.dedup();
        assert_eq!(paths.len(), ALL.len());
    }
}

/// One error value, rendered by each dialect in its own format: the same status, headers and
/// message everywhere; the type as each API names the class; a control's field named as each
/// API names it.
#[cfg(test)]
mod errors {
    use super::*;
    use tollgate_core::{Deny, Dimension, Identity, Reason, ScopeKey};

    fn refusal(reason: Reason, retry_after_ms: Option<u64>) -> ApiError {
        let id = Identity::default().with(Dimension::Key, "k1");
        let scope =
            ScopeKey::derive("per key", &[Dimension::Key], &id).unwrap_or_else(|| unreachable!());
        let d = Deny {
            reason,
            scope,
            limit: 5_000_000,
            remaining: 1_000,
            requested: 2_000_000,
            retry_after_ms,
            reset_after_ms: retry_after_ms,
        };
        let mut e = crate::respond::deny_in(&d, Some(tollgate_core::Unit::MicroUsd));
        if let crate::respond::Words::Denied(w) = &mut e.words {
            w.allowances = [300, 0, 0];
        }
        e
    }

    async fn rendered(d: &dyn Dialect, e: ApiError) -> (u16, HeaderMap, Value) {
        let r = d.error_response(e);
        let (parts, body) = r.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 16)
            .await
            .unwrap_or_default();
        let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (parts.status.as_u16(), parts.headers, v)
    }

    #[tokio::test]
    async fn every_dialect_renders_the_same_refusal_in_its_format() {
        let mut seen = Vec::new();
        for d in ALL {
            let (status, headers, body) =
                rendered(d, refusal(Reason::BudgetLimit, Some(90_000))).await;
            assert_eq!(status, 429);
            let h = |n: &str| {
                headers
                    .get(n)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            assert_eq!(h("x-tollgate-reason").as_deref(), Some("budget_limit"));
            assert_eq!(
                h("x-should-retry").as_deref(),
                Some("false"),
                "a wait past a minute"
            );
            let wait: u64 = h("retry-after-ms")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            assert!((90_000..=91_000).contains(&wait), "{wait}");
            assert!(h("ratelimit").is_some_and(|v| v.contains("per_key-budget")));
            let message = if d.format() == Format::AnthropicMessages {
                assert_eq!(body["type"], "error");
                assert_eq!(body["error"]["type"], "rate_limit_error");
                assert!(body["error"].get("param").is_none());
                body["error"]["message"].clone()
            } else {
                assert_eq!(body["error"]["type"], "insufficient_quota");
                assert_eq!(body["error"]["param"], Value::Null);
                body["error"]["message"].clone()
            };
            assert_eq!(body["error"]["code"], "budget_limit");
            let message = message.as_str().unwrap_or_default().to_owned();
            assert!(message.contains("limit $5.00"), "{message}");
            assert!(message.contains(" Retry in 1m 30s (at "), "{message}");
            assert!(
                message.contains("includes 300 for the earlier context"),
                "{message}"
            );
            // The instant in the message moves with the clock: compare what precedes it.
            seen.push(
                message
                    .split(" Retry")
                    .next()
                    .unwrap_or_default()
                    .to_owned(),
            );
        }
        seen.dedup();
        assert_eq!(seen.len(), 1, "{seen:?}");
    }

    #[tokio::test]
    async fn a_controls_field_is_named_by_each_dialect() {
        for (format, name) in [
            (Format::ChatCompletions, Value::from("max_tokens")),
            (Format::Completions, Value::from("max_tokens")),
            (Format::Responses, Value::from("max_output_tokens")),
        ] {
            let (status, _, body) =
                rendered(of(format), refusal(Reason::OutputTokenLimit, None)).await;
            assert_eq!(status, 400);
            assert_eq!(body["error"]["type"], "invalid_request_error");
            assert_eq!(body["error"]["param"], name, "{format:?}");
        }
        let (_, _, body) = rendered(
            of(Format::Responses),
            refusal(Reason::InputTokenLimit, None),
        )
        .await;
        assert_eq!(body["error"]["param"], "input");
        let (_, _, body) = rendered(
            of(Format::AnthropicMessages),
            refusal(Reason::InputTokenLimit, None),
        )
        .await;
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
}
