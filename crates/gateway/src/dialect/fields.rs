//! Request fields by allowlist. Each API's body fields are listed with what they cost, and a
//! field that is not listed is refused, naming it: a provider's new feature cannot reach the
//! upstream, and its bill, before someone has decided what it costs. An operator may declare a
//! field free of cost for one upstream (`free_fields`). `docs/requests.md`, "What a request
//! costs", is the same list in words.

use serde_json::Value;

use crate::respond::{self, ApiError};

/// What a body field costs, and so how the gateway treats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cost {
    /// Nothing on the bill depends on it: sampling, stop sequences, metadata, identifiers,
    /// the answer's format, whether the provider stores the answer.
    Free,
    /// Input, counted with the body (messages, tools, schemas, prompts).
    Input,
    /// Read and acted on by the gateway: the model (routing, price), the stream (metering),
    /// context the upstream keeps, bounds on tools the upstream runs.
    Handled,
    /// An output cap: the gateway writes the cap it grants into one cap field and removes the
    /// others.
    Cap,
    /// Multiplies the output: each choice (`n`, `best_of`) and each prompt of a list is a whole
    /// answer, each up to the cap.
    Multiplies,
    /// Output billed beyond the cap: a prediction's tokens that the model rejects are billed as
    /// output, so they are reserved as output on top of the cap.
    Predicted,
    /// A service tier or region: the request is reserved and settled at that tier's price from
    /// the price table; under a money budget, a tier without a price is refused.
    Tier,
    /// Output kinds: text only. Audio output is not in the price table, so a request for it is
    /// refused.
    OutputKinds,
    /// A cost the price table cannot state (audio output, server-side compaction, code
    /// containers, remote MCP servers): refused unless declared free.
    Unpriced,
}

/// OpenAI's chat completions.
pub const CHAT: &[(&str, Cost)] = &[
    ("model", Cost::Handled),
    ("messages", Cost::Input),
    ("tools", Cost::Input),
    ("functions", Cost::Input),
    ("response_format", Cost::Input),
    ("tool_choice", Cost::Free),
    ("function_call", Cost::Free),
    ("parallel_tool_calls", Cost::Free),
    ("max_tokens", Cost::Cap),
    ("max_completion_tokens", Cost::Cap),
    ("n", Cost::Multiplies),
    ("best_of", Cost::Multiplies),
    ("prediction", Cost::Predicted),
    ("service_tier", Cost::Tier),
    ("modalities", Cost::OutputKinds),
    ("audio", Cost::Unpriced),
    ("stream", Cost::Handled),
    ("stream_options", Cost::Handled),
    ("web_search_options", Cost::Handled),
    // Reasoning tokens are output within `max_completion_tokens`, which the gateway writes.
    ("reasoning_effort", Cost::Free),
    ("verbosity", Cost::Free),
    ("temperature", Cost::Free),
    ("top_p", Cost::Free),
    ("frequency_penalty", Cost::Free),
    ("presence_penalty", Cost::Free),
    ("logit_bias", Cost::Free),
    ("logprobs", Cost::Free),
    ("top_logprobs", Cost::Free),
    ("seed", Cost::Free),
    ("stop", Cost::Free),
    ("user", Cost::Free),
    ("safety_identifier", Cost::Free),
    ("metadata", Cost::Free),
    ("store", Cost::Free),
    ("prompt_cache_key", Cost::Free),
    ("prompt_cache_retention", Cost::Free),
    ("prompt_cache_options", Cost::Free),
    ("moderation", Cost::Free),
];

/// OpenAI's legacy completions.
pub const COMPLETIONS: &[(&str, Cost)] = &[
    ("model", Cost::Handled),
    ("prompt", Cost::Multiplies),
    ("suffix", Cost::Input),
    ("max_tokens", Cost::Cap),
    ("n", Cost::Multiplies),
    ("best_of", Cost::Multiplies),
    ("stream", Cost::Handled),
    ("stream_options", Cost::Handled),
    // The prompt echoed back is billed as the input it already is.
    ("echo", Cost::Free),
    ("temperature", Cost::Free),
    ("top_p", Cost::Free),
    ("frequency_penalty", Cost::Free),
    ("presence_penalty", Cost::Free),
    ("logit_bias", Cost::Free),
    ("logprobs", Cost::Free),
    ("seed", Cost::Free),
    ("stop", Cost::Free),
    ("user", Cost::Free),
];

/// OpenAI's embeddings.
pub const EMBEDDINGS: &[(&str, Cost)] = &[
    ("model", Cost::Handled),
    ("input", Cost::Input),
    ("dimensions", Cost::Free),
    ("encoding_format", Cost::Free),
    ("user", Cost::Free),
];

/// OpenAI's Responses API.
pub const RESPONSES: &[(&str, Cost)] = &[
    ("model", Cost::Handled),
    ("input", Cost::Input),
    ("instructions", Cost::Input),
    ("tools", Cost::Input),
    ("text", Cost::Input),
    ("tool_choice", Cost::Free),
    ("parallel_tool_calls", Cost::Free),
    ("max_output_tokens", Cost::Cap),
    ("max_tool_calls", Cost::Handled),
    ("previous_response_id", Cost::Handled),
    ("conversation", Cost::Handled),
    ("background", Cost::Handled),
    ("stream", Cost::Handled),
    ("stream_options", Cost::Handled),
    ("service_tier", Cost::Tier),
    // Reasoning tokens are output within `max_output_tokens`, which the gateway writes.
    ("reasoning", Cost::Free),
    ("include", Cost::Free),
    ("truncation", Cost::Free),
    ("temperature", Cost::Free),
    ("top_p", Cost::Free),
    ("top_logprobs", Cost::Free),
    ("user", Cost::Free),
    ("safety_identifier", Cost::Free),
    ("metadata", Cost::Free),
    ("store", Cost::Free),
    ("prompt_cache_key", Cost::Free),
    ("prompt_cache_retention", Cost::Free),
    ("prompt_cache_options", Cost::Free),
    ("moderation", Cost::Free),
    // A stored prompt's text is input the body does not hold.
    ("prompt", Cost::Unpriced),
    // Server-side compaction runs the model again on the context.
    ("context_management", Cost::Unpriced),
];

/// Anthropic's Messages API.
pub const MESSAGES: &[(&str, Cost)] = &[
    ("model", Cost::Handled),
    ("messages", Cost::Input),
    ("system", Cost::Input),
    ("tools", Cost::Input),
    ("tool_choice", Cost::Free),
    ("max_tokens", Cost::Cap),
    ("stream", Cost::Handled),
    ("service_tier", Cost::Tier),
    ("inference_geo", Cost::Tier),
    // Thinking tokens are output within `max_tokens`, which the gateway writes.
    ("thinking", Cost::Free),
    ("temperature", Cost::Free),
    ("top_k", Cost::Free),
    ("top_p", Cost::Free),
    ("stop_sequences", Cost::Free),
    ("metadata", Cost::Free),
    // Structured output: its schema is input the body holds as JSON.
    ("output_config", Cost::Input),
    ("output_format", Cost::Input),
    // Billed by the hour of container, and by what the MCP servers return.
    ("container", Cost::Unpriced),
    ("mcp_servers", Cost::Unpriced),
    ("context_management", Cost::Unpriced),
];

/// The cost of `field` in the list `fields`.
pub fn cost(fields: &[(&str, Cost)], field: &str) -> Option<Cost> {
    fields.iter().find(|(f, _)| *f == field).map(|(_, c)| *c)
}

/// Refuses a body with a field that is not in `fields` nor declared free (`free`), or whose
/// cost the price table cannot state.
pub fn check(fields: &[(&str, Cost)], json: &Value, free: &[String]) -> Result<(), ApiError> {
    let Some(body) = json.as_object() else {
        return Err(respond::invalid_json("the body must be a JSON object"));
    };
    for (field, value) in body {
        if free.iter().any(|f| f == field) {
            continue;
        }
        match cost(fields, field) {
            None => return Err(respond::unknown_field(field)),
            Some(Cost::Unpriced) if !value.is_null() => {
                return Err(respond::unpriced_field(field));
            }
            Some(Cost::OutputKinds) if !text_only(value) => {
                return Err(respond::unpriced_field(field));
            }
            Some(Cost::Tier) if !(value.is_null() || value.is_string()) => {
                return Err(respond::invalid_field(field, "expected a string"));
            }
            _ => {}
        }
    }
    Ok(())
}

/// `modalities` absent, null, or text alone.
fn text_only(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(kinds) => kinds.iter().all(|k| k == "text"),
        _ => false,
    }
}

/// The longest tier name accepted, in bytes.
const MAX_TIER_BYTES: usize = 64;

/// The service tier a request asks for, as the price table names it, when it is not one of the
/// `standard` names: the tier fields' values, joined by `+` when several (Anthropic's region
/// with its own tier, `inference_geo:us`); a field other than `service_tier` is named in front.
pub fn price_tier(
    fields: &[(&str, Cost)],
    json: &Value,
    standard: &[&str],
) -> Result<Option<String>, ApiError> {
    let mut tiers: Vec<String> = Vec::new();
    for (field, _) in fields.iter().filter(|(_, c)| *c == Cost::Tier) {
        let Some(v) = json.get(*field).and_then(Value::as_str) else {
            continue;
        };
        let readable = v
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        if v.is_empty() || v.len() > MAX_TIER_BYTES || !readable {
            return Err(respond::invalid_field(
                field,
                format!("a tier name of 1 to {MAX_TIER_BYTES} letters, digits, '_', '-' or '.'"),
            ));
        }
        if standard.contains(&v) {
            continue;
        }
        tiers.push(match *field {
            "service_tier" => v.to_owned(),
            f => format!("{f}:{v}"),
        });
    }
    Ok((!tiers.is_empty()).then(|| tiers.join("+")))
}

/// How many prompts a completions `prompt` holds: a string or a list of token ids is one, a
/// list of strings or of token-id lists is one each.
pub fn prompts(prompt: Option<&Value>) -> u64 {
    match prompt {
        Some(Value::Array(items)) => match items.first() {
            None | Some(Value::Number(_)) => 1,
            Some(_) => items.len() as u64,
        },
        _ => 1,
    }
}

/// The text of a chat request's predicted output (`prediction.content`, a string or text
/// parts); `None` without one.
pub fn predicted_text(json: &Value) -> Result<Option<String>, ApiError> {
    let Some(p) = json.get("prediction").filter(|p| !p.is_null()) else {
        return Ok(None);
    };
    match &p["content"] {
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(parts) => {
            let mut text = String::new();
            for (i, part) in parts.iter().enumerate() {
                let Some(t) = part["text"].as_str() else {
                    return Err(respond::invalid_field(
                        &format!("prediction.content[{i}]"),
                        "expected a text part",
                    ));
                };
                text.push_str(t);
            }
            Ok(Some(text))
        }
        _ => Err(respond::invalid_field(
            "prediction.content",
            "expected a string or text parts",
        )),
    }
}

/// The property the `fields` fuzz target checks, shared with the test that replays its corpus:
/// any body, in every API's list, is accepted or refused without panicking; a refusal names a
/// field of the body that is not on the list, or one whose cost cannot be stated; declaring
/// that field free lets the body past it; what the body asks for (tier, prompts, prediction)
/// is read without panicking, and at least one prompt.
#[doc(hidden)]
#[allow(clippy::panic)] // a failed check must crash the fuzzer
pub fn fuzz_check(data: &[u8]) {
    let Ok(json) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    for list in [CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES] {
        let mut free: Vec<String> = Vec::new();
        // Each refusal names one field; declared free, the next refusal names another.
        for _ in 0..=json.as_object().map_or(0, |o| o.len()) {
            match check(list, &json, &free) {
                Ok(()) => break,
                Err(e) => {
                    let Some(field) = e.param.as_ref().map(|p| p.chat_name().to_owned()) else {
                        assert!(!json.is_object(), "a refusal without its field: {e:?}");
                        break;
                    };
                    let known = cost(list, &field);
                    assert!(json.get(&field).is_some(), "named {field}, not in the body");
                    assert!(
                        matches!(
                            known,
                            None | Some(Cost::Unpriced | Cost::OutputKinds | Cost::Tier)
                        ),
                        "refused {field}, a field of known cost"
                    );
                    assert!(!free.contains(&field), "refused {field} once declared free");
                    free.push(field);
                }
            }
        }
        let _ = price_tier(list, &json, &["auto", "default"]);
    }
    assert!(prompts(json.get("prompt")) >= 1);
    let _ = predicted_text(&json);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_list_names_each_field_once() {
        for list in [CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES] {
            let mut names: Vec<_> = list.iter().map(|(f, _)| *f).collect();
            names.sort_unstable();
            let n = names.len();
            names.dedup();
            assert_eq!(names.len(), n);
        }
    }

    /// `docs/requests.md`, "What a request costs", lists every field of every API with its cost.
    #[test]
    fn the_docs_list_every_field_with_its_cost() {
        let doc = include_str!("../../../../docs/requests.md");
        let apis = [
            ("chat completions", CHAT),
            ("completions", COMPLETIONS),
            ("embeddings", EMBEDDINGS),
            ("Responses", RESPONSES),
            ("Anthropic Messages", MESSAGES),
        ];
        let mut rows = 0;
        for (api, list) in apis {
            for (field, c) in list {
                let kind = match c {
                    Cost::Free => "free",
                    Cost::Input => "input",
                    Cost::Handled => "handled",
                    Cost::Cap => "cap",
                    Cost::Multiplies => "multiplies",
                    Cost::Predicted => "predicted",
                    Cost::Tier => "tier",
                    Cost::OutputKinds => "output kinds",
                    Cost::Unpriced => "*unpriced*",
                };
                let row = format!("| {api} | `{field}` | {kind} |");
                assert!(doc.contains(&row), "docs/requests.md lacks {row}");
                rows += 1;
            }
        }
        let listed = doc
            .lines()
            .filter(|l| {
                apis.iter()
                    .any(|(a, _)| l.starts_with(&format!("| {a} | `")))
            })
            .count();
        assert_eq!(listed, rows, "the docs list a field the gateway does not");
    }

    #[test]
    fn an_unknown_field_is_refused_by_name_unless_declared_free() {
        let body = json!({"model": "m", "messages": [], "x_new_feature": {"a": 1}});
        let e = check(CHAT, &body, &[]).unwrap_err();
        assert_eq!(
            e.param,
            Some(crate::respond::Param::Field("x_new_feature".into()))
        );
        assert_eq!(e.code, "unknown_parameter");
        assert!(check(CHAT, &body, &["x_new_feature".to_owned()]).is_ok());
    }

    #[test]
    fn audio_output_is_refused_and_text_passes() {
        let text = json!({"model": "m", "modalities": ["text"]});
        assert!(check(CHAT, &text, &[]).is_ok());
        let audio = json!({"model": "m", "modalities": ["text", "audio"]});
        assert_eq!(
            check(CHAT, &audio, &[]).unwrap_err().code,
            "unpriced_parameter"
        );
        let audio = json!({"model": "m", "audio": {"voice": "alloy", "format": "wav"}});
        assert_eq!(
            check(CHAT, &audio, &[]).unwrap_err().code,
            "unpriced_parameter"
        );
    }

    #[test]
    fn tiers_are_named_as_the_price_table_names_them() {
        let std = ["auto", "default"];
        let t = |v: Value| price_tier(CHAT, &v, &std).unwrap();
        assert_eq!(
            t(json!({"service_tier": "priority"})),
            Some("priority".into())
        );
        assert_eq!(t(json!({"service_tier": "default"})), None);
        assert_eq!(t(json!({})), None);
        let a = |v: Value| price_tier(MESSAGES, &v, &["auto", "standard_only", "global"]).unwrap();
        assert_eq!(
            a(json!({"inference_geo": "us"})),
            Some("inference_geo:us".into())
        );
        assert_eq!(
            a(json!({"service_tier": "priority", "inference_geo": "us"})),
            Some("priority+inference_geo:us".into())
        );
        assert!(price_tier(CHAT, &json!({"service_tier": "a b"}), &std).is_err());
    }

    #[test]
    fn prompt_lists_count_each_prompt() {
        assert_eq!(prompts(Some(&json!("one"))), 1);
        assert_eq!(prompts(Some(&json!([1, 2, 3]))), 1);
        assert_eq!(prompts(Some(&json!(["a", "b", "c"]))), 3);
        assert_eq!(prompts(Some(&json!([[1, 2], [3]]))), 2);
        assert_eq!(prompts(None), 1);
    }

    #[test]
    fn predictions_are_read_as_text() {
        let p = |v: Value| predicted_text(&v);
        assert_eq!(p(json!({})).unwrap(), None);
        let s = json!({"prediction": {"type": "content", "content": "abc"}});
        assert_eq!(p(s).unwrap(), Some("abc".into()));
        let parts = json!({"prediction": {"type": "content",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}});
        assert_eq!(p(parts).unwrap(), Some("ab".into()));
        assert!(p(json!({"prediction": {"content": 5}})).is_err());
    }
}
