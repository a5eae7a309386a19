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

/// Input billed for what the tools the upstream runs fetched: [`SimConfig::tool_calls`] calls
/// per such tool, within the request's bound.
pub(crate) fn fetched_input(req: &Value, format: Format, config: &SimConfig) -> u64 {
    let tools = req["tools"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let kind = |t: &Value| t["type"].as_str().unwrap_or("").to_owned();
    let calls = match format {
        Format::Responses => {
            let n = tools
                .iter()
                .filter(|t| FETCHING_TOOLS.contains(&kind(t).as_str()))
                .count() as u64;
            (n * config.tool_calls).min(req["max_tool_calls"].as_u64().unwrap_or(u64::MAX))
        }
        Format::ChatCompletions if !req["web_search_options"].is_null() => config.tool_calls,
        Format::AnthropicMessages => tools
            .iter()
            .filter(|t| kind(t).starts_with("web_search_") || kind(t).starts_with("web_fetch_"))
            .map(|t| {
                config
                    .tool_calls
                    .min(t["max_uses"].as_u64().unwrap_or(u64::MAX))
            })
            .sum(),
        _ => 0,
    };
    calls * config.tool_call_input_tokens
}
