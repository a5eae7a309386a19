//! OpenAI's Responses API (`/v1/responses`): the upstream keeps each response's context, which
//! a follow-up carries as input (see [`crate::contexts`]).

use axum::body::Bytes;
use serde_json::{Map, Value};
use tollgate_core::Usage;
use tollgate_tokens::Format;

use super::{Dialect, Volatile, plain};
use crate::respond::{self, ApiError, Param};
use crate::sse::SseMeter;

#[derive(Debug)]
pub(super) struct Responses;

impl Dialect for Responses {
    fn upstream_tools(
        &self,
        json: &mut Value,
        cfg: crate::upstream_tools::UpstreamTools,
    ) -> crate::upstream_tools::Allowance {
        crate::upstream_tools::responses(json, cfg)
    }

    fn answer_items<'a>(&self, answer: &'a Value) -> Option<&'a Value> {
        Some(&answer["output"])
    }

    fn format(&self) -> Format {
        Format::Responses
    }

    fn path(&self) -> &'static str {
        "/v1/responses"
    }

    fn cap_field(&self) -> &'static str {
        "max_output_tokens"
    }

    fn check_body(&self, json: &Value) -> Result<(), ApiError> {
        if json.get("background").and_then(Value::as_bool) == Some(true) {
            // Its usage arrives after the call returns, where no settlement can see it.
            return Err(respond::background_unsupported());
        }
        Ok(())
    }

    fn keeps_context(&self) -> bool {
        true
    }

    fn fields(&self) -> &'static [(&'static str, super::fields::Cost)] {
        super::fields::RESPONSES
    }

    fn stores_response(&self, json: &Value) -> bool {
        // The upstream stores a response unless told not to.
        json.get("store").and_then(Value::as_bool) != Some(false)
    }

    fn param_name(&self, param: &Param) -> String {
        match param {
            Param::Input => "input".to_owned(),
            Param::OutputCap => "max_output_tokens".to_owned(),
            Param::Field(f) => f.clone(),
        }
    }

    fn set_cap(&self, body: &mut Map<String, Value>, per_choice: u64, _stream: bool) -> bool {
        body.insert("max_output_tokens".into(), per_choice.into());
        false
    }

    fn meter(&self, model: &str, _strip_usage: bool) -> SseMeter {
        SseMeter::responses(model)
    }

    fn usage(&self, usage: &Value, _input: u64, bad: &mut bool) -> Option<Usage> {
        crate::sse::responses_usage(usage, bad).map(plain)
    }

    fn tool_calls(&self, answer: &Value) -> u64 {
        answer["output"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|i| crate::sse::is_responses_tool_call(i))
            .count() as u64
    }

    fn turn_list(&self) -> Option<&'static str> {
        Some("input")
    }

    fn starts_turn(&self, item: &Value) -> bool {
        // A message item (typed or not) of the user; function calls, their outputs and
        // reasoning belong to the turn they follow.
        item["role"] == "user" && item.get("type").is_none_or(|t| t == "message")
    }

    fn content_fields(&self) -> &'static [(&'static str, Volatile)] {
        &[
            ("model", Volatile::None),
            ("instructions", Volatile::None),
            ("input", Volatile::Ids),
            ("previous_response_id", Volatile::None),
            ("conversation", Volatile::None),
            ("tools", Volatile::None),
            ("tool_choice", Volatile::None),
            ("text", Volatile::None),
        ]
    }

    fn history_tool_calls<'a>(&self, json: &'a Value) -> Vec<(&'a Value, &'a Value)> {
        json["input"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|i| crate::sse::is_responses_tool_call(i))
            .map(|i| (&i["name"], i.get("arguments").unwrap_or(&i["input"])))
            .collect()
    }

    fn output_parts(&self, answer: &Value) -> Vec<String> {
        crate::sse::responses_output_parts(&answer["output"])
    }

    fn stream_error(&self, code: &str, message: &str) -> Bytes {
        let error = serde_json::json!({"type": "error", "code": code, "message": message,
            "param": null});
        Bytes::from(format!("event: error\ndata: {error}\n\n"))
    }
}
