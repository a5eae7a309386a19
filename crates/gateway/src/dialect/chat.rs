//! OpenAI's chat completions (`/v1/chat/completions`).

use serde_json::{Map, Value};
use tollgate_tokens::Format;

use super::fields::{self, Cost};
use super::{Dialect, choice_count};
use crate::respond::ApiError;

#[derive(Debug)]
pub(super) struct Chat;

impl Dialect for Chat {
    fn upstream_tools(
        &self,
        json: &mut Value,
        cfg: crate::upstream_tools::UpstreamTools,
    ) -> crate::upstream_tools::Allowance {
        crate::upstream_tools::chat(json, cfg)
    }

    fn format(&self) -> Format {
        Format::ChatCompletions
    }

    fn path(&self) -> &'static str {
        "/v1/chat/completions"
    }

    fn choices(&self, json: &Value) -> Result<u64, ApiError> {
        Ok(choice_count(json, "n")?.max(choice_count(json, "best_of")?))
    }

    fn fields(&self) -> &'static [(&'static str, Cost)] {
        fields::CHAT
    }

    fn predicted_text(&self, json: &Value) -> Result<Option<String>, ApiError> {
        fields::predicted_text(json)
    }

    fn set_cap(&self, body: &mut Map<String, Value>, per_choice: u64, stream: bool) -> bool {
        // The newer field, when the client uses it; else the one every model reads. The other
        // is removed: an upstream that read it would get a cap nobody granted.
        let (field, other) = if body.contains_key("max_completion_tokens") {
            ("max_completion_tokens", "max_tokens")
        } else {
            ("max_tokens", "max_completion_tokens")
        };
        body.remove(other);
        body.insert(field.into(), per_choice.into());
        if !stream {
            return false;
        }
        // A stream reports usage only when asked: the gateway asks, and keeps the usage event
        // from a client that did not.
        let so = body
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        let strip = so.get("include_usage").and_then(Value::as_bool) != Some(true);
        if let Some(so) = so.as_object_mut() {
            so.insert("include_usage".into(), Value::Bool(true));
        }
        strip
    }
}
