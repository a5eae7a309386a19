//! `tollgate count`: what the gateway will charge for a request body.

use anyhow::Context;
use tollgate_tokens::{Format, RequestCount, TokenCounter};

use crate::cli::BodyFormat;

/// Counts `body`, with `model` replacing the body's model and `format` its detected format.
pub fn count(
    body: &[u8],
    model: Option<&str>,
    format: Option<BodyFormat>,
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
        None if obj.contains_key("messages") => Format::ChatCompletions,
        None if obj.contains_key("prompt") => Format::Completions,
        None if obj.contains_key("input") => Format::Embeddings,
        None => anyhow::bail!(
            "cannot tell the format: no `messages`, `prompt` or `input`; pass --format"
        ),
    };
    let body = serde_json::to_vec(&value)?;
    Ok(TokenCounter::default().count(format, &body, None)?)
}
