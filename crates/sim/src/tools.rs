//! The tools a simulated answer calls: the request's function tools, and the tools the upstream
//! runs itself (web search and the like), billed as input.

use serde_json::Value;
use tollgate_tokens::Format;

use crate::{SimConfig, SimState};

/// The function calls an answer makes: [`SimConfig::function_calls`] calls to the first function
/// tool the request offers, as (call id, name, arguments), counted in the stats.
pub(crate) fn function_calls(
    state: &SimState,
    req: &Value,
    format: Format,
) -> Vec<(String, String, String)> {
    let tools = req["tools"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let name = tools.iter().find_map(|t| match format {
        Format::ChatCompletions => {
            (t["type"] == "function").then(|| t["function"]["name"].as_str())?
        }
        Format::Responses => (t["type"] == "function").then(|| t["name"].as_str())?,
        // A client tool has an input schema; the server tools Anthropic runs have none.
        _ => t.get("input_schema").and_then(|_| t["name"].as_str()),
    });
    let Some(name) = name.filter(|_| req["tool_choice"] != "none") else {
        return Vec::new();
    };
    let n = state.config.function_calls;
    if let Ok(mut s) = state.stats.lock() {
        s.function_calls += n;
    }
    (0..n)
        .map(|k| {
            (
                format!("call_sim_{k}"),
                name.to_owned(),
                format!("{{\"step\":{k}}}"),
            )
        })
        .collect()
}

/// The Responses API's built-in tools that fetch input during a call, as the upstream knows them.
const FETCHING_TOOLS: &[&str] = &[
    "web_search",
    "web_search_preview",
    "file_search",
    "mcp",
    "code_interpreter",
    "image_generation",
];

/// File search's results per call when the request does not bound them (OpenAI's default).
const FILE_SEARCH_RESULTS: u64 = 20;

/// The calls of tools the upstream runs that a request makes, in order: (the tool's kind, the
/// calls, the input tokens each call fetches). [`SimConfig::tool_calls`] calls per such tool,
/// within the request's bound; a file search returns as many results as it may, each a whole
/// chunk ([`SimConfig::file_search_chunk_tokens`]); any other call fetches
/// [`SimConfig::tool_call_input_tokens`].
pub(crate) fn server_calls(
    req: &Value,
    format: Format,
    config: &SimConfig,
) -> Vec<(String, u64, u64)> {
    let tools = req["tools"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let kind = |t: &Value| t["type"].as_str().unwrap_or("").to_owned();
    let fetch = config.tool_call_input_tokens;
    match format {
        Format::Responses => {
            let mut left = req["max_tool_calls"].as_u64().unwrap_or(u64::MAX);
            let mut out = Vec::new();
            for t in tools {
                let k = kind(t);
                if !FETCHING_TOOLS.contains(&k.as_str()) {
                    continue;
                }
                let n = config.tool_calls.min(left);
                left -= n;
                let per = if k == "file_search" {
                    t["max_num_results"].as_u64().unwrap_or(FILE_SEARCH_RESULTS)
                        * config.file_search_chunk_tokens
                } else {
                    fetch
                };
                let k = if k == "web_search_preview" {
                    "web_search".into()
                } else {
                    k
                };
                out.push((k, n, per));
            }
            out
        }
        Format::ChatCompletions if !req["web_search_options"].is_null() => {
            vec![("web_search".into(), config.tool_calls.min(1), fetch)]
        }
        Format::AnthropicMessages => tools
            .iter()
            .filter(|t| kind(t).starts_with("web_search_") || kind(t).starts_with("web_fetch_"))
            .map(|t| {
                let n = config
                    .tool_calls
                    .min(t["max_uses"].as_u64().unwrap_or(u64::MAX));
                let k = t["name"].as_str().unwrap_or("web_search").to_owned();
                (k, n, fetch)
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// Input billed for what the tools the upstream runs fetched.
pub(crate) fn fetched_input(req: &Value, format: Format, config: &SimConfig) -> u64 {
    server_calls(req, format, config)
        .iter()
        .map(|(_, n, per)| n * per)
        .sum()
}

/// The Responses API's output items of the calls of tools the upstream ran.
pub(crate) fn responses_items(calls: &[(String, u64, u64)]) -> Vec<Value> {
    let mut out = Vec::new();
    for (kind, n, _) in calls {
        for k in 0..*n {
            out.push(serde_json::json!({"type": format!("{kind}_call"),
                "id": format!("{kind}_sim_{k}"), "status": "completed"}));
        }
    }
    out
}
