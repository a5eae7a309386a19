//! OpenAI's embeddings (`/v1/embeddings`): input only, no output cap.

use serde_json::{Map, Value};
use tollgate_tokens::Format;

use super::Dialect;

#[derive(Debug)]
pub(super) struct Embeddings;

impl Dialect for Embeddings {
    fn format(&self) -> Format {
        Format::Embeddings
    }

    fn path(&self) -> &'static str {
        "/v1/embeddings"
    }

    fn has_output(&self) -> bool {
        false
    }

    fn fields(&self) -> &'static [(&'static str, super::fields::Cost)] {
        super::fields::EMBEDDINGS
    }

    fn turn_list(&self) -> Option<&'static str> {
        None
    }

    fn content_fields(&self) -> &'static [(&'static str, super::Volatile)] {
        &[
            ("model", super::Volatile::None),
            ("input", super::Volatile::None),
        ]
    }

    fn set_cap(&self, _body: &mut Map<String, Value>, _per_choice: u64, _stream: bool) -> bool {
        false
    }
}
