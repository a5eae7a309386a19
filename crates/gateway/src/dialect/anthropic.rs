//! Anthropic's Messages API (`/v1/messages`): its own credentials, version and beta headers,
//! prompt-cache writes billed above input, and errors in its own format.

use axum::body::Bytes;
use axum::response::Response;
use http::request::Builder;
use http::{HeaderMap, HeaderValue};
use serde_json::{Map, Value};
use tollgate_core::Usage;
use tollgate_tokens::Format;

use super::{Dialect, Volatile, plain};
use crate::config::{GatewayConfig, Upstream};
use crate::respond::{self, ApiError};
use crate::sse::SseMeter;

/// The `anthropic-version` sent upstream when the client sent none.
const ANTHROPIC_VERSION: &str = "2023-06-01";

#[derive(Debug)]
pub(super) struct Messages;

impl Dialect for Messages {
    fn upstream_tools(
        &self,
        json: &mut Value,
        cfg: crate::upstream_tools::UpstreamTools,
    ) -> crate::upstream_tools::Allowance {
        crate::upstream_tools::anthropic(json, cfg)
    }

    fn answer_items<'a>(&self, answer: &'a Value) -> Option<&'a Value> {
        Some(&answer["content"])
    }

    fn format(&self) -> Format {
        Format::AnthropicMessages
    }

    fn path(&self) -> &'static str {
        "/v1/messages"
    }

    /// Every `anthropic-beta` value must be one the configuration allows: a beta may switch on
    /// input the gateway never sees (the MCP connector's tool lists and results, for one).
    fn check_headers(&self, cfg: &GatewayConfig, headers: &HeaderMap) -> Result<(), ApiError> {
        for v in headers.get_all("anthropic-beta") {
            let text = v.to_str().unwrap_or("\u{fffd}");
            for beta in text.split(',').map(str::trim).filter(|b| !b.is_empty()) {
                if !cfg.anthropic_betas.iter().any(|a| a == beta) {
                    return Err(respond::unsupported_beta(beta));
                }
            }
        }
        Ok(())
    }

    fn fields(&self) -> &'static [(&'static str, super::fields::Cost)] {
        super::fields::MESSAGES
    }

    /// `auto` may use Priority Tier capacity, billed against the operator's commitment rather
    /// than per token; a region of its own (`inference_geo`) other than `global` is priced
    /// above the standard rate and needs a tier price.
    fn standard_tiers(&self) -> &'static [&'static str] {
        &["auto", "standard_only", "global"]
    }

    /// A request that marks any block may write all of its input to the prompt cache.
    fn cache_write_tokens(&self, json: &Value, input: u64) -> u64 {
        if marks_cache(json) { input } else { 0 }
    }

    fn set_cap(&self, body: &mut Map<String, Value>, per_choice: u64, _stream: bool) -> bool {
        // Anthropic requires it: a request without one gets the admitted default.
        body.insert("max_tokens".into(), per_choice.into());
        false
    }

    fn upstream_headers(&self, b: Builder, upstream: &Upstream, client: &HeaderMap) -> Builder {
        let mut b = match &upstream.api_key {
            Some(k) => b.header("x-api-key", k.as_str()),
            None => b,
        };
        // The client's API version and beta features go through; the version is required.
        let version = client.get("anthropic-version").cloned();
        b = b.header(
            "anthropic-version",
            version.unwrap_or(HeaderValue::from_static(ANTHROPIC_VERSION)),
        );
        // Only the betas the configuration allows (checked at intake) go through.
        for beta in client.get_all("anthropic-beta") {
            b = b.header("anthropic-beta", beta.clone());
        }
        b
    }

    fn meter(&self, model: &str, _strip_usage: bool) -> SseMeter {
        SseMeter::anthropic(model)
    }

    fn usage(&self, u: &Value, _input: u64, bad: &mut bool) -> Option<Usage> {
        crate::sse::anthropic_usage(u, bad).map(|(i, c)| {
            let (w5, w1h) = crate::sse::anthropic_cache_writes(u, bad);
            let out = crate::sse::usage_number(&u["output_tokens"], bad).unwrap_or(0);
            Usage {
                cache_write_tokens: w5,
                cache_write_1h_tokens: w1h,
                ..plain((i, c, out))
            }
        })
    }

    fn tool_calls(&self, answer: &Value) -> u64 {
        answer["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|b| crate::sse::is_anthropic_tool_call(b))
            .count() as u64
    }

    fn starts_turn(&self, item: &Value) -> bool {
        // A user message carrying tool results answers the turn before: it stays with it.
        let results = item["content"].as_array().into_iter().flatten();
        item["role"] == "user" && !results.into_iter().any(|b| b["type"] == "tool_result")
    }

    fn pinned(&self, _item: &Value) -> bool {
        // The system prompt is a field of its own.
        false
    }

    fn content_fields(&self) -> &'static [(&'static str, Volatile)] {
        &[
            ("model", Volatile::None),
            ("system", Volatile::None),
            ("messages", Volatile::Ids),
            ("tools", Volatile::None),
            ("tool_choice", Volatile::None),
        ]
    }

    fn history_tool_calls<'a>(&self, json: &'a Value) -> Vec<(&'a Value, &'a Value)> {
        let blocks = json["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["content"].as_array())
            .flatten();
        blocks
            .filter(|b| crate::sse::is_anthropic_tool_call(b))
            .map(|b| (&b["name"], &b["input"]))
            .collect()
    }

    fn output_parts(&self, answer: &Value) -> Vec<String> {
        crate::sse::anthropic_output_parts(&answer["content"])
    }

    /// `{"type": "error", "error": {"type", "message"}}`, the type following the class as
    /// Anthropic's API names it, and Tollgate's own code in `error.code` (an addition clients
    /// may read or ignore). The headers are every format's (`retry-after`, `retry-after-ms` and
    /// `x-should-retry`, which Anthropic's SDKs read too).
    fn error_response(&self, e: ApiError) -> Response {
        let body = serde_json::json!({"type": "error", "error": {
            "type": e.class.anthropic_type(), "message": e.message(), "code": e.code}});
        e.response_with(body)
    }

    fn stream_error(&self, _code: &str, message: &str) -> Bytes {
        let error = serde_json::json!({"type": "error",
            "error": {"type": "api_error", "message": message}});
        Bytes::from(format!("event: error\ndata: {error}\n\n"))
    }
}

/// Whether an Anthropic request marks anything for its prompt cache, where Anthropic reads a
/// `cache_control`: on the request itself (automatic caching), on a tool, on a system block, on
/// a message's content block, or on a block inside one (a tool result's, a search result's). A
/// key of that name anywhere else, such as a property in a tool's input schema or in a tool
/// call's arguments, marks nothing. Walked without recursion: blocks may nest deeply.
fn marks_cache(json: &Value) -> bool {
    fn list(v: Option<&Value>) -> impl Iterator<Item = &Value> {
        v.and_then(Value::as_array).into_iter().flatten()
    }
    let marked = |v: &Value| v.get("cache_control").is_some_and(|c| !c.is_null());
    if marked(json) || list(json.get("tools")).any(marked) || list(json.get("system")).any(marked) {
        return true;
    }
    let mut blocks: Vec<&Value> = list(json.get("messages"))
        .flat_map(|m| list(m.get("content")))
        .collect();
    while let Some(b) = blocks.pop() {
        if marked(b) {
            return true;
        }
        blocks.extend(list(b.get("content")));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::marks_cache;
    use serde_json::json;

    #[test]
    fn cache_marks_are_found_where_anthropic_reads_them() {
        let mark = json!({"type": "ephemeral"});
        let marked = [
            json!({"cache_control": mark, "messages": []}),
            json!({"tools": [{"name": "a"}, {"name": "b", "cache_control": mark}]}),
            json!({"system": [{"type": "text", "text": "s", "cache_control": mark}]}),
            json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "text", "text": "b", "cache_control": mark},
            ]}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": "t", "content": [{"type": "search_result", "content": [
                {"type": "text", "text": "r", "cache_control": mark},
            ]}]}]}]}),
        ];
        for body in marked {
            assert!(marks_cache(&body), "{body}");
        }
    }

    #[test]
    fn a_key_named_cache_control_elsewhere_marks_nothing() {
        let mark = json!({"type": "ephemeral"});
        let unmarked = [
            // A tool whose input has a property of that name.
            json!({"tools": [{"name": "t", "input_schema": {"type": "object",
                "properties": {"cache_control": {"type": "string"}}}}]}),
            // A tool call's arguments, and a document's metadata.
            json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use",
                "id": "t", "name": "t", "input": {"cache_control": mark}}]}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "document",
                "source": {"type": "text", "data": "d", "cache_control": mark}}]}]}),
            // Text that only mentions it, and a null marker.
            json!({"system": "cache_control", "messages": [{"role": "user",
                "content": "{\"cache_control\": 1}"}]}),
            json!({"cache_control": null, "system": [{"type": "text", "text": "s",
                "cache_control": null}]}),
        ];
        for body in unmarked {
            assert!(!marks_cache(&body), "{body}");
        }
    }
}
