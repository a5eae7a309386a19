//! OpenAI's legacy completions (`/v1/completions`).

use serde_json::{Map, Value};
use tollgate_tokens::Format;

use super::fields::{self, Cost};
use super::{Dialect, choice_count};
use crate::respond::ApiError;

#[derive(Debug)]
pub(super) struct Completions;

impl Dialect for Completions {
    fn format(&self) -> Format {
        Format::Completions
    }

    fn path(&self) -> &'static str {
        "/v1/completions"
    }

    fn choices(&self, json: &Value) -> Result<u64, ApiError> {
        // `best_of` generates that many server-side: each is output paid for.
        Ok(choice_count(json, "n")?.max(choice_count(json, "best_of")?))
    }

    fn fields(&self) -> &'static [(&'static str, Cost)] {
        fields::COMPLETIONS
    }

    fn prompts(&self, json: &Value) -> u64 {
        // Each prompt of a list is answered with its own choices.
        fields::prompts(json.get("prompt"))
    }

    fn turn_list(&self) -> Option<&'static str> {
        None
    }

    fn content_fields(&self) -> &'static [(&'static str, super::Volatile)] {
        &[
            ("model", super::Volatile::None),
            ("prompt", super::Volatile::None),
            ("suffix", super::Volatile::None),
        ]
    }

    fn set_cap(&self, body: &mut Map<String, Value>, per_choice: u64, _stream: bool) -> bool {
        body.insert("max_tokens".into(), per_choice.into());
        false
    }
}
