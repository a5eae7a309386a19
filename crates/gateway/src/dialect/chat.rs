//! OpenAI's chat completions (`/v1/chat/completions`).

use serde_json::{Map, Value};
use tollgate_tokens::Format;

use super::{Dialect, choice_count};
use crate::respond::ApiError;

#[derive(Debug)]
pub(super) struct Chat;

impl Dialect for Chat {
    fn format(&self) -> Format {
        Format::ChatCompletions
    }

    fn path(&self) -> &'static str {
        "/v1/chat/completions"
    }

    fn choices(&self, json: &Value) -> Result<u64, ApiError> {
        Ok(choice_count(json, "n")?.max(choice_count(json, "best_of")?))
    }

    fn set_cap(&self, body: &mut Map<String, Value>, per_choice: u64, stream: bool) -> bool {
        // The newer field, when the client uses it; else the one every model reads.
        let field = if body.contains_key("max_completion_tokens") {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
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
