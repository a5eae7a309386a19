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
//!
//! File search pulls in up to `max_num_results` chunks per call (20 when the request does not
//! say, OpenAI's default for the models that run it), each at most the vector store's chunk
//! size (`[upstream_tools] file_search_chunk_tokens`, 800 by default, OpenAI's default
//! chunking): a call is admitted with the larger of that and `tokens_per_call`. The calls that
//! carry a fee (web search and file search per call, a code-interpreter session per request)
//! are counted too, for the money budgets ([`tollgate_core::Metered`]).

use serde_json::Value;
use tollgate_core::Metered;

/// `[upstream_tools]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpstreamTools {
    /// Input tokens admitted for each call a request may make.
    pub tokens_per_call: u64,
    /// The most calls a request may make (written into its body).
    pub max_calls: u64,
    /// The most tokens one file-search result holds (the vector store's chunk size).
    pub file_search_chunk_tokens: u64,
}

impl Default for UpstreamTools {
    fn default() -> Self {
        Self {
            tokens_per_call: 8_000,
            max_calls: 4,
            file_search_chunk_tokens: 800,
        }
    }
}

/// File search's results per call when the request does not bound them.
const FILE_SEARCH_DEFAULT_RESULTS: u64 = 20;

/// What the tools the upstream runs may add to a request: input tokens, and the calls that
/// carry a fee.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Allowance {
    /// Input tokens.
    pub tokens: u64,
    /// The calls and sessions that carry a fee.
    pub metered: Metered,
}

/// The kind of a Responses API built-in tool, as it is priced.
fn responses_kind(t: &str) -> Option<Kind> {
    if t.starts_with("web_search") {
        Some(Kind::WebSearch)
    } else if t == "file_search" {
        Some(Kind::FileSearch)
    } else if t == "code_interpreter" {
        Some(Kind::Code)
    } else {
        None
    }
}

/// A tool that carries a fee.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Web search, per call.
    WebSearch,
    /// File search, per call.
    FileSearch,
    /// Code interpreter, per session.
    Code,
}

/// The fee-carrying calls an answer shows: Responses output items (`web_search_call`,
/// `file_search_call`, `code_interpreter_call`: one session however many calls) or Anthropic
/// `server_tool_use` blocks named `web_search`.
pub fn used_by(item: &Value, m: &mut Metered) {
    let t = item["type"].as_str().unwrap_or("");
    let kind = match t {
        "server_tool_use" if item["name"] == "web_search" => Some(Kind::WebSearch),
        _ => t.strip_suffix("_call").and_then(responses_kind),
    };
    match kind {
        Some(Kind::WebSearch) => m.web_searches = m.web_searches.saturating_add(1),
        Some(Kind::FileSearch) => m.file_searches = m.file_searches.saturating_add(1),
        Some(Kind::Code) => m.code_sessions = 1,
        None => {}
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

/// The Responses API's upstream-run tools in `json`: their calls bounded by `max_tool_calls`
/// (written into the body), each allowed for at its type's most.
pub fn responses(json: &mut Value, cfg: UpstreamTools) -> Allowance {
    let mut metered = Metered::default();
    let runs: Vec<(&str, u64)> = tools(json)
        .filter_map(|t| Some((tool_type(t)?, t)))
        .filter(|(ty, _)| !CLIENT_RUN.contains(ty))
        .map(|(ty, t)| (ty, per_call(ty, t, cfg)))
        .collect();
    if runs.is_empty() {
        return Allowance::default();
    }
    let calls = bounded(json.get("max_tool_calls"), cfg.max_calls);
    let most = runs.iter().map(|(_, n)| *n).max().unwrap_or(0);
    for (ty, _) in &runs {
        match responses_kind(ty) {
            Some(Kind::WebSearch) => metered.web_searches = calls,
            Some(Kind::FileSearch) => metered.file_searches = calls,
            Some(Kind::Code) => metered.code_sessions = 1,
            None => {}
        }
    }
    if let Some(obj) = json.as_object_mut() {
        obj.insert("max_tool_calls".into(), calls.into());
    }
    Allowance {
        tokens: calls.saturating_mul(most),
        metered,
    }
}

/// Chat's one upstream-run tool: a web search when `web_search_options` is given.
pub fn chat(json: &Value, cfg: UpstreamTools) -> Allowance {
    let searches = u64::from(json.get("web_search_options").is_some_and(|o| !o.is_null()));
    Allowance {
        tokens: searches.saturating_mul(cfg.tokens_per_call),
        metered: Metered {
            web_searches: searches,
            ..Metered::default()
        },
    }
}

/// Anthropic's server tools that fetch (web search and fetch): each one's `max_uses` bounded
/// (written into the body), each use allowed for at `tokens_per_call`.
pub fn anthropic(json: &mut Value, cfg: UpstreamTools) -> Allowance {
    let mut metered = Metered::default();
    let Some(list) = json.get_mut("tools").and_then(Value::as_array_mut) else {
        return Allowance::default();
    };
    let mut calls: u64 = 0;
    for tool in list {
        let ty = tool_type(tool).unwrap_or("");
        if !ANTHROPIC_FETCHING.iter().any(|p| ty.starts_with(p)) {
            continue;
        }
        let searches = ty.starts_with("web_search_");
        let uses = bounded(tool.get("max_uses"), cfg.max_calls);
        if let Some(obj) = tool.as_object_mut() {
            obj.insert("max_uses".into(), uses.into());
        }
        if searches {
            metered.web_searches = metered.web_searches.saturating_add(uses);
        }
        calls = calls.saturating_add(uses);
    }
    Allowance {
        tokens: calls.saturating_mul(cfg.tokens_per_call),
        metered,
    }
}

/// Input tokens one call of a Responses tool of type `ty` may add: file search its results
/// times the chunk size (at least `tokens_per_call`), any other `tokens_per_call`.
fn per_call(ty: &str, tool: &Value, cfg: UpstreamTools) -> u64 {
    if ty != "file_search" {
        return cfg.tokens_per_call;
    }
    let results = tool
        .get("max_num_results")
        .and_then(Value::as_u64)
        .unwrap_or(FILE_SEARCH_DEFAULT_RESULTS);
    results
        .saturating_mul(cfg.file_search_chunk_tokens)
        .max(cfg.tokens_per_call)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tollgate_tokens::Format;

    const CFG: UpstreamTools = UpstreamTools {
        tokens_per_call: 1_000,
        max_calls: 3,
        file_search_chunk_tokens: 100,
    };

    fn bound(format: Format, j: &mut Value, cfg: UpstreamTools) -> Allowance {
        match format {
            Format::Responses => responses(j, cfg),
            Format::ChatCompletions => chat(j, cfg),
            Format::AnthropicMessages => anthropic(j, cfg),
            Format::Completions | Format::Embeddings => Allowance::default(),
        }
    }

    fn tokens(format: Format, j: &mut Value) -> u64 {
        bound(format, j, CFG).tokens
    }

    #[test]
    fn responses_built_in_tools_are_bounded_and_allowed_for() {
        let mut j = json!({"tools": [{"type": "function", "name": "f"}, {"type": "web_search"}]});
        assert_eq!(tokens(Format::Responses, &mut j), 3_000);
        assert_eq!(j["max_tool_calls"], 3);
        // A lower bound of the client's stays; a higher one is lowered.
        // (File search: 20 results of 100 tokens a call.)
        let mut j = json!({"tools": [{"type": "file_search"}], "max_tool_calls": 1});
        assert_eq!(tokens(Format::Responses, &mut j), 2_000);
        assert_eq!(j["max_tool_calls"], 1);
        let mut j = json!({"tools": [{"type": "mcp"}], "max_tool_calls": 50});
        assert_eq!(tokens(Format::Responses, &mut j), 3_000);
        assert_eq!(j["max_tool_calls"], 3);
        // A type this list does not know is taken as the upstream's.
        let mut j = json!({"tools": [{"type": "some_future_tool"}]});
        assert_eq!(tokens(Format::Responses, &mut j), 3_000);
        // Client-run tools only, or none: nothing added, nothing written.
        for tools in [
            json!([{"type": "function", "name": "f"}]),
            json!([]),
            json!(null),
        ] {
            let mut j = json!({"tools": tools});
            assert_eq!(tokens(Format::Responses, &mut j), 0);
            assert!(j.get("max_tool_calls").is_none());
        }
    }

    #[test]
    fn chat_web_search_is_one_call() {
        let mut j = json!({"web_search_options": {}});
        assert_eq!(tokens(Format::ChatCompletions, &mut j), 1_000);
        let mut j = json!({"web_search_options": null, "tools": [{"type": "function"}]});
        assert_eq!(tokens(Format::ChatCompletions, &mut j), 0);
    }

    #[test]
    fn anthropic_fetching_tools_are_bounded_each() {
        let mut j = json!({"tools": [
            {"type": "web_search_20250305", "name": "web_search"},
            {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 2},
            {"name": "get_weather", "input_schema": {}},
            {"type": "bash_20250124", "name": "bash"}
        ]});
        assert_eq!(tokens(Format::AnthropicMessages, &mut j), 5_000);
        assert_eq!(j["tools"][0]["max_uses"], 3);
        assert_eq!(j["tools"][1]["max_uses"], 2);
        assert!(j["tools"][2].get("max_uses").is_none());
        assert!(j["tools"][3].get("max_uses").is_none());
    }

    #[test]
    fn file_search_is_allowed_its_results_times_the_chunk_size() {
        // 50 results of 100 tokens: 5,000 a call, three calls.
        let mut j = json!({"tools": [{"type": "file_search", "max_num_results": 50},
                                     {"type": "web_search"}]});
        let a = bound(Format::Responses, &mut j, CFG);
        assert_eq!(a.tokens, 15_000);
        assert_eq!((a.metered.file_searches, a.metered.web_searches), (3, 3));
        // Unbounded: 20 results, 2,000 a call.
        let mut j = json!({"tools": [{"type": "file_search"}], "max_tool_calls": 2});
        assert_eq!(tokens(Format::Responses, &mut j), 4_000);
        // Few small results: never below the allowance per call.
        let mut j = json!({"tools": [{"type": "file_search", "max_num_results": 1}]});
        assert_eq!(tokens(Format::Responses, &mut j), 3_000);
        let mut j = json!({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]});
        assert_eq!(
            bound(Format::Responses, &mut j, CFG).metered.code_sessions,
            1
        );
    }

    #[test]
    fn an_answers_fee_carrying_calls_are_counted_by_kind() {
        let mut m = Metered::default();
        for item in [
            json!({"type": "web_search_call"}),
            json!({"type": "web_search_call"}),
            json!({"type": "file_search_call"}),
            json!({"type": "code_interpreter_call"}),
            json!({"type": "code_interpreter_call"}),
            json!({"type": "function_call"}),
            json!({"type": "server_tool_use", "name": "web_search"}),
            json!({"type": "server_tool_use", "name": "web_fetch"}),
        ] {
            used_by(&item, &mut m);
        }
        assert_eq!(
            (m.web_searches, m.file_searches, m.code_sessions),
            (3, 1, 1)
        );
    }

    #[test]
    fn other_formats_add_nothing() {
        let mut j = json!({"tools": [{"type": "web_search"}]});
        assert_eq!(tokens(Format::Completions, &mut j), 0);
        assert_eq!(tokens(Format::Embeddings, &mut j), 0);
    }
}
