//! `tollgate count`: what the gateway will charge for a request body.

use anyhow::Context;
use tollgate_tokens::{Format, RequestCount, TokenCounter};

use crate::cli::BodyFormat;

/// Counts `body`, with `model` replacing the body's model and `format` its detected format.
pub fn count(
    body: &[u8],
    model: Option<&str>,
    format: Option<BodyFormat>,
    tokenizer: Option<&std::path::Path>,
) -> anyhow::Result<RequestCount> {
    let mut value: serde_json::Value =
        serde_json::from_slice(body).context("the request is not JSON")?;
    let obj = value
        .as_object_mut()
        .context("the request is not a JSON object")?;
    if let Some(m) = model {
        obj.insert("model".into(), serde_json::Value::String(m.to_owned()));
    }
    let format = match format {
        Some(BodyFormat::Chat) => Format::ChatCompletions,
        Some(BodyFormat::Completions) => Format::Completions,
        Some(BodyFormat::Embeddings) => Format::Embeddings,
        Some(BodyFormat::Anthropic) => Format::AnthropicMessages,
        Some(BodyFormat::Responses) => Format::Responses,
        None if obj.contains_key("messages") => Format::ChatCompletions,
        None if obj.contains_key("prompt") => Format::Completions,
        None if [
            "instructions",
            "max_output_tokens",
            "tools",
            "previous_response_id",
        ]
        .iter()
        .any(|k| obj.contains_key(*k))
            || obj["input"]
                .as_array()
                .is_some_and(|a| a.iter().any(|i| i.is_object())) =>
        {
            Format::Responses
        }
        None if obj.contains_key("input") => Format::Embeddings,
        None => anyhow::bail!(
            "cannot tell the format: no `messages`, `prompt` or `input`; pass --format"
        ),
    };
    let mut counter = TokenCounter::default();
    if let Some(path) = tokenizer {
        let name = value["model"].as_str().unwrap_or_default().to_owned();
        let hf = tollgate_tokens::hf::HfTokenizer::from_file(path).map_err(anyhow::Error::msg)?;
        counter = counter.with_model(
            name,
            tollgate_tokens::Counting::HuggingFace(std::sync::Arc::new(hf)),
        );
    }
    let body = serde_json::to_vec(&value)?;
    Ok(counter.count(format, &body, None)?)
}
