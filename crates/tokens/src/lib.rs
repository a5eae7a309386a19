//! # tollgate-tokens
//!
//! Token counts of LLM request bodies, the way the provider counts them, bounded in cost.
//!
//! - `o200k_base` and `cl100k_base` are embedded, compressed, and unpacked on first use (or by
//!   [`TokenCounter::warm_up`]) into `bpe-openai`'s tokenizers: nothing is downloaded at build or
//!   run time.
//! - Request formats: OpenAI chat completions (messages, content parts, names, tool calls, tool
//!   results, tools, response-format schemas, images), completions, embeddings; Anthropic
//!   Messages and OpenAI's Responses API as flagged estimates.
//! - **Bounded**: given a limit, counting stops as soon as it is passed; a text longer than
//!   128 bytes × the tokens left is over without counting (no o200k or cl100k token is longer
//!   than 128 bytes); JSON strings are borrowed, not copied, where they have no escapes; nesting
//!   is limited by the JSON parser. No input makes it panic.
//!
//! ```
//! use tollgate_tokens::{TokenCounter, Format};
//!
//! let counter = TokenCounter::default();
//! let body = br#"{"model": "gpt-4o", "max_tokens": 50,
//!                "messages": [{"role": "user", "content": "Hello there!"}]}"#;
//! let c = counter.count(Format::ChatCompletions, body, None).unwrap();
//! assert_eq!(c.encoding, "o200k_base");
//! assert_eq!(c.input_tokens, 3 + 1 + 3 + 3); // message + "user" + "Hello there!" + reply priming
//! assert_eq!(c.max_output_tokens, Some(50));
//! assert!(c.exact);
//!
//! // Over a limit of 8 tokens: counting stops early and says so.
//! let c = counter.count(Format::ChatCompletions, body, Some(8)).unwrap();
//! assert!(c.over_limit && c.input_tokens > 8);
//! ```

mod anthropic;
#[cfg(feature = "huggingface")]
pub mod hf;
mod image;
pub mod media;
pub mod memo;
mod openai;
mod responses;
mod tally;
mod vocab;

use std::collections::BTreeMap;

pub use image::{
    ImageCost, ImageRule, anthropic_image_tokens, base64_head_size, data_url_size, image_rule,
    image_tokens,
};
pub use memo::Memo;
pub use tally::Tally;

/// A BPE vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// GPT-4o, GPT-4.1, GPT-4.5, GPT-5, o-series.
    O200kBase,
    /// GPT-4, GPT-3.5, text-embedding-3, ada-002.
    Cl100kBase,
}

impl Encoding {
    /// The encoding's name.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::O200kBase => "o200k_base",
            Encoding::Cl100kBase => "cl100k_base",
        }
    }

    /// Parses an encoding name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "o200k_base" => Some(Encoding::O200kBase),
            "cl100k_base" => Some(Encoding::Cl100kBase),
            _ => None,
        }
    }

    /// The encoding's tokenizer; `None` only from a build whose vocabulary does not unpack.
    pub(crate) fn tokenizer(self) -> Option<&'static bpe_openai::Tokenizer> {
        match self {
            Encoding::O200kBase => vocab::O200K_BASE.as_ref(),
            Encoding::Cl100kBase => vocab::CL100K_BASE.as_ref(),
        }
    }
}

/// How a model's tokens are counted.
#[derive(Debug, Clone)]
pub enum Counting {
    /// Exactly, with this vocabulary.
    Exact(Encoding),
    /// With the model's own `tokenizer.json`.
    #[cfg(feature = "huggingface")]
    HuggingFace(std::sync::Arc<hf::HfTokenizer>),
    /// An estimate for a model with no public tokenizer: the `o200k_base` count plus a quarter,
    /// rounded up. It can come out low (a script its vocabulary splits finely), so it is only
    /// used where configured. Flagged `exact: false`.
    Estimate,
    /// A proven upper bound for a model with no public tokenizer, the default for such models:
    /// one token per UTF-8 byte. Every byte-level BPE token, and every SentencePiece token with
    /// byte fallback, covers at least one byte, so no such tokenizer can count more. Flagged
    /// `exact: false`; settlement charges what the upstream reports.
    Bytes,
}

impl Counting {
    /// The name reported in counts.
    pub fn name(&self) -> &'static str {
        match self {
            Counting::Exact(e) => e.name(),
            #[cfg(feature = "huggingface")]
            Counting::HuggingFace(_) => "tokenizer.json",
            Counting::Estimate => "estimate",
            Counting::Bytes => "utf8_bytes",
        }
    }
}

/// Model name → counting rule. Built-in prefixes cover OpenAI's families; configured names win.
#[derive(Debug, Clone, Default)]
pub struct TokenCounter {
    overrides: BTreeMap<String, Counting>,
    memo: Option<std::sync::Arc<dyn Memo>>,
}

/// OpenAI model families by name prefix, most specific first.
const PREFIXES: &[(&str, Encoding)] = &[
    ("gpt-4o", Encoding::O200kBase),
    ("chatgpt-4o", Encoding::O200kBase),
    ("gpt-4.1", Encoding::O200kBase),
    ("gpt-4.5", Encoding::O200kBase),
    ("gpt-5", Encoding::O200kBase),
    ("gpt-oss", Encoding::O200kBase),
    ("o1", Encoding::O200kBase),
    ("o3", Encoding::O200kBase),
    ("o4", Encoding::O200kBase),
    ("gpt-4", Encoding::Cl100kBase),
    ("gpt-3.5", Encoding::Cl100kBase),
    ("text-embedding-3", Encoding::Cl100kBase),
    ("text-embedding-ada-002", Encoding::Cl100kBase),
];

impl TokenCounter {
    /// Sets how `model` is counted, overriding the built-in map.
    #[must_use]
    pub fn with_model(mut self, model: impl Into<String>, counting: Counting) -> Self {
        self.overrides.insert(model.into(), counting);
        self
    }

    /// This counter, counting long texts of request bodies through `memo` (one tenant's, in a
    /// gateway): a text counted before is not counted again. The counts are the same.
    #[must_use]
    pub fn with_memo(&self, memo: Option<std::sync::Arc<dyn Memo>>) -> Self {
        Self {
            overrides: self.overrides.clone(),
            memo,
        }
    }

    /// How `model` is counted: a configured name, else a known family, else the byte bound.
    pub fn counting_for(&self, model: &str) -> Counting {
        if let Some(c) = self.overrides.get(model) {
            return c.clone();
        }
        PREFIXES
            .iter()
            .find(|(p, _)| model.starts_with(p))
            .map_or(Counting::Bytes, |(_, e)| Counting::Exact(*e))
    }

    /// Counts the input of a request body in `format`. With `limit`, counting stops once the
    /// count passes it: `input_tokens` is then a lower bound above the limit and `over_limit`
    /// is set.
    pub fn count(
        &self,
        format: Format,
        body: &[u8],
        limit: Option<u64>,
    ) -> Result<RequestCount, RequestError> {
        match format {
            Format::ChatCompletions => openai::count_chat(self, body, limit),
            Format::Completions => openai::count_completions(self, body, limit),
            Format::Embeddings => openai::count_embeddings(self, body, limit),
            Format::AnthropicMessages => anthropic::count_messages(self, body, limit),
            Format::Responses => responses::count_responses(self, body, limit),
        }
    }

    /// Loads the embedded vocabularies (they load lazily, on first use, otherwise).
    pub fn warm_up() {
        let _ = Encoding::O200kBase.tokenizer();
        let _ = Encoding::Cl100kBase.tokenizer();
    }

    /// Counts a plain text with `model`'s rule, up to `limit`.
    pub fn count_text(&self, model: &str, text: &str, limit: Option<u64>) -> (u64, bool) {
        let mut t = Tally::new(self.counting_for(model), limit);
        t.text(text);
        t.finish()
    }

    /// Counts output that passed through as (floor, count): the count is [`Self::count_text`]'s;
    /// the floor is the same where the model's tokenizer is known, and for a model counted by
    /// estimate or bound the `o200k_base` count without the estimate's margin, the fewest tokens an
    /// upstream can honestly report for that text.
    pub fn count_output(&self, model: &str, text: &str) -> (u64, u64) {
        let counting = self.counting_for(model);
        // Output is counted, not reserved: the byte bound would hold a stream at a quarter of
        // its cap, so a model without a tokenizer is counted as by the estimate here.
        let estimated = matches!(counting, Counting::Estimate | Counting::Bytes);
        let floor_counting = if estimated {
            Counting::Exact(Encoding::O200kBase)
        } else {
            counting
        };
        let mut t = Tally::new(floor_counting, None);
        t.text(text);
        let floor = t.finish().0;
        let count = if estimated {
            floor.saturating_mul(5).div_ceil(4)
        } else {
            floor
        };
        (floor, count)
    }
}

/// A request body format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/embeddings`
    Embeddings,
    /// Anthropic `POST /v1/messages` (estimate).
    AnthropicMessages,
    /// OpenAI's Responses API, `POST /v1/responses` (estimate; the body only, not context the
    /// upstream keeps).
    Responses,
}

/// The count of one request.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RequestCount {
    /// The model named in the body.
    pub model: String,
    /// `o200k_base`, `cl100k_base` or `estimate`.
    pub encoding: &'static str,
    /// Input tokens (a lower bound above the limit when `over_limit`).
    pub input_tokens: u64,
    /// The output cap the request asked for, if any.
    pub max_output_tokens: Option<u64>,
    /// Whether every part was counted by a published rule (false when any part was estimated).
    pub exact: bool,
    /// Whether counting stopped because the limit was passed.
    #[serde(skip)]
    pub over_limit: bool,
    /// Whether the request asks for a stream.
    #[serde(skip)]
    pub stream: bool,
    /// Files and documents the body names by URL or file id instead of holding them: the
    /// provider bills their content, which is not counted here (only their JSON text is), so
    /// the caller adds an allowance per item.
    #[serde(skip_serializing_if = "is_zero")]
    pub remote_items: u32,
    /// Earlier audio answers the body names by id (chat's assistant `audio`): the provider
    /// bills their audio again, which is not counted here, so the caller adds an allowance
    /// per reference or refuses the request.
    #[serde(skip_serializing_if = "is_zero")]
    pub audio_references: u32,
    /// Of the input, the tokens of audio clips the body holds (by their duration).
    #[serde(skip_serializing_if = "is_nil")]
    pub audio_tokens: u64,
}

fn is_nil(n: &u64) -> bool {
    *n == 0
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A request body that cannot be counted. Each is a client error (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// Not JSON, or not the shape the format requires.
    #[error("invalid request body: {0}")]
    Json(String),
    /// A field has a value the format forbids.
    #[error("invalid value for {field}: {message}")]
    Invalid {
        /// The field, e.g. `messages[2].content`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

impl RequestError {
    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        RequestError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
    /// The offending field, where known.
    pub fn field(&self) -> Option<&str> {
        match self {
            RequestError::Invalid { field, .. } => Some(field),
            RequestError::Json(_) => None,
        }
    }
}

/// The longest token in `o200k_base` and `cl100k_base`, in bytes.
pub const MAX_TOKEN_BYTES: usize = 128;

#[cfg(test)]
mod tests;

/// The property the fuzz target checks, shared with the test that replays its corpus on
/// stable: any bytes, in every format, with and without a limit, either count or give an error,
/// and a bounded count agrees with the full one.
#[doc(hidden)]
#[allow(clippy::panic)] // a failed check must crash the fuzzer
pub fn fuzz_check(data: &[u8]) {
    let counter = TokenCounter::default();
    for format in [
        Format::ChatCompletions,
        Format::Completions,
        Format::Embeddings,
        Format::AnthropicMessages,
        Format::Responses,
    ] {
        let full = counter.count(format, data, None);
        for limit in [0u64, 7, 100] {
            let bounded = counter.count(format, data, Some(limit));
            match (&full, &bounded) {
                (Ok(f), Ok(b)) => {
                    assert_eq!(b.over_limit, f.input_tokens > limit, "over_limit");
                    let want = if f.input_tokens > limit {
                        limit + 1
                    } else {
                        f.input_tokens
                    };
                    assert_eq!(b.input_tokens, want, "bounded count");
                }
                (Err(_), Err(_)) => {}
                _ => panic!("a limit changed whether the body parses"),
            }
        }
    }
}
