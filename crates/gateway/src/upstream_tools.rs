//! Tools that the upstream runs itself during a call: the Responses API's built-in tools (web
//! search, file search, remote MCP servers, code interpreter, image generation), chat's
//! `web_search_options`, and Anthropic's web search and web fetch. What they fetch is billed as
//! input, yet the request's body does not hold it. Counting the body alone would let a request
//! of a few tokens pull in any amount of input past the input-token limit, with a reservation
//! too small for what settlement then charges.
//!
//! So a request that enables such a tool is admitted with `[upstream_tools] tokens_per_call`
//! input tokens for every call it may make, and the number of calls is bounded in the body the
//! upstream gets: the Responses API's `max_tool_calls` (across all built-in tools), Anthropic's
//! `max_uses` (per tool), each at most `[upstream_tools] max_calls`. A chat request with
//! `web_search_options` counts as one call (chat has no bound to write). Settlement still
//! charges what the upstream reports, so an allowance set too low shows as settled input above
//! the estimate, never as a lost charge.

use serde_json::Value;
use tollgate_tokens::Format;

/// `[upstream_tools]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpstreamTools {
    /// Input tokens admitted for each call a request may make.
    pub tokens_per_call: u64,
    /// The most calls a request may make (written into its body).
    pub max_calls: u64,
}

impl Default for UpstreamTools {
    fn default() -> Self {
        Self {
            tokens_per_call: 8_000,
            max_calls: 4,
        }
    }
}

/// Responses API tool types that the client runs: their results come back in a later request's
/// body, where they are counted. Any other type is taken as run by the upstream, so a built-in
/// tool newer than this list is admitted with an allowance rather than without one.
const CLIENT_RUN: &[&str] = &[
    "function",
    "custom",
    "local_shell",
    "shell",
    "apply_patch",
    "computer_use_preview",
    "computer_use",
];

/// Anthropic's server tools that fetch input and take `max_uses`, by their type's prefix (the
/// type carries a version date, `web_search_20250305`).
const ANTHROPIC_FETCHING: &[&str] = &["web_search_", "web_fetch_"];

fn tools(json: &Value) -> impl Iterator<Item = &Value> {
    json.get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

fn tool_type(tool: &Value) -> Option<&str> {
    tool.get("type").and_then(Value::as_str)
}

/// The calls asked for, bounded by `max`: absent (or not a whole number) asks for `max`.
fn bounded(asked: Option<&Value>, max: u64) -> u64 {
    asked.and_then(Value::as_u64).map_or(max, |a| a.min(max))
}

/// Bounds the calls of upstream-run tools in `json` (a request body of `format`) and returns
/// the input tokens to admit for them.
pub fn bound(format: Format, json: &mut Value, cfg: UpstreamTools) -> u64 {
    match format {
        Format::Responses => {
            let runs = tools(json)
                .filter_map(tool_type)
                .any(|t| !CLIENT_RUN.contains(&t));
            if !runs {
                return 0;
            }
            let calls = bounded(json.get("max_tool_calls"), cfg.max_calls);
            if let Some(obj) = json.as_object_mut() {
                obj.insert("max_tool_calls".into(), calls.into());
            }
            calls.saturating_mul(cfg.tokens_per_call)
        }
        Format::ChatCompletions => {
            let searches = json.get("web_search_options").is_some_and(|o| !o.is_null());
            u64::from(searches).saturating_mul(cfg.tokens_per_call)
        }
        Format::AnthropicMessages => {
            let Some(list) = json.get_mut("tools").and_then(Value::as_array_mut) else {
                return 0;
            };
            let mut calls: u64 = 0;
            for tool in list {
                let fetching = tool_type(tool)
                    .is_some_and(|t| ANTHROPIC_FETCHING.iter().any(|p| t.starts_with(p)));
                if !fetching {
                    continue;
                }
                let uses = bounded(tool.get("max_uses"), cfg.max_calls);
                if let Some(obj) = tool.as_object_mut() {
                    obj.insert("max_uses".into(), uses.into());
                }
                calls = calls.saturating_add(uses);
            }
            calls.saturating_mul(cfg.tokens_per_call)
        }
        Format::Completions | Format::Embeddings => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CFG: UpstreamTools = UpstreamTools {
        tokens_per_call: 1_000,
        max_calls: 3,
    };

    #[test]
    fn responses_built_in_tools_are_bounded_and_allowed_for() {
        let mut j = json!({"tools": [{"type": "function", "name": "f"}, {"type": "web_search"}]});
        assert_eq!(bound(Format::Responses, &mut j, CFG), 3_000);
        assert_eq!(j["max_tool_calls"], 3);
        // A lower bound of the client's stays; a higher one is lowered.
        let mut j = json!({"tools": [{"type": "file_search"}], "max_tool_calls": 1});
        assert_eq!(bound(Format::Responses, &mut j, CFG), 1_000);
        assert_eq!(j["max_tool_calls"], 1);
        let mut j = json!({"tools": [{"type": "mcp"}], "max_tool_calls": 50});
        assert_eq!(bound(Format::Responses, &mut j, CFG), 3_000);
        assert_eq!(j["max_tool_calls"], 3);
        // A type this list does not know is taken as the upstream's.
        let mut j = json!({"tools": [{"type": "some_future_tool"}]});
        assert_eq!(bound(Format::Responses, &mut j, CFG), 3_000);
        // Client-run tools only, or none: nothing added, nothing written.
        for tools in [
            json!([{"type": "function", "name": "f"}]),
            json!([]),
            json!(null),
        ] {
            let mut j = json!({"tools": tools});
            assert_eq!(bound(Format::Responses, &mut j, CFG), 0);
            assert!(j.get("max_tool_calls").is_none());
        }
    }

    #[test]
    fn chat_web_search_is_one_call() {
        let mut j = json!({"web_search_options": {}});
        assert_eq!(bound(Format::ChatCompletions, &mut j, CFG), 1_000);
        let mut j = json!({"web_search_options": null, "tools": [{"type": "function"}]});
        assert_eq!(bound(Format::ChatCompletions, &mut j, CFG), 0);
    }

    #[test]
    fn anthropic_fetching_tools_are_bounded_each() {
        let mut j = json!({"tools": [
            {"type": "web_search_20250305", "name": "web_search"},
            {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 2},
            {"name": "get_weather", "input_schema": {}},
            {"type": "bash_20250124", "name": "bash"}
        ]});
        assert_eq!(bound(Format::AnthropicMessages, &mut j, CFG), 5_000);
        assert_eq!(j["tools"][0]["max_uses"], 3);
        assert_eq!(j["tools"][1]["max_uses"], 2);
        assert!(j["tools"][2].get("max_uses").is_none());
        assert!(j["tools"][3].get("max_uses").is_none());
    }

    #[test]
    fn other_formats_add_nothing() {
        let mut j = json!({"tools": [{"type": "web_search"}]});
        assert_eq!(bound(Format::Completions, &mut j, CFG), 0);
        assert_eq!(bound(Format::Embeddings, &mut j, CFG), 0);
    }
}
