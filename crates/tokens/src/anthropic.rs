//! Anthropic Messages, as a flagged estimate: Anthropic publishes no tokenizer. Text is counted
//! with the model's rule (by default the estimate: `o200k_base` + 25%), every message adds 3
//! framing tokens, tool definitions and tool inputs are counted from their JSON text, images
//! from their size (width × height / 750, at most 1600, which is also the charge when the size
//! is unknown).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::openai::parse;
use crate::{RequestCount, RequestError, Tally, TokenCounter};

#[derive(Deserialize)]
struct MessagesRequest<'a> {
    #[serde(borrow)]
    model: Cow<'a, str>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default, borrow)]
    system: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Vec<&'a RawValue>,
    #[serde(default, borrow)]
    tools: Option<Vec<&'a RawValue>>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow)]
    content: &'a RawValue,
}

#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    source: Option<Source<'a>>,
    #[serde(default, borrow)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Source<'a> {
    /// `base64`, `text`, `content` (held in the body), or `url` and `file` (held elsewhere).
    #[serde(rename = "type", default, borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    data: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    media_type: Option<Cow<'a, str>>,
}

pub(crate) fn count_messages(
    counter: &TokenCounter,
    body: &[u8],
    limit: Option<u64>,
) -> Result<RequestCount, RequestError> {
    let req: MessagesRequest<'_> = parse(body)?;
    let counting = counter.counting_for(&req.model);
    let mut t = Tally::new(counting.clone(), limit).with_memo(counter.memo.clone());
    t.estimated();
    if let Some(sys) = req.system {
        blocks(&mut t, sys, "system", 0)?;
    }
    for (i, raw) in req.messages.iter().enumerate() {
        let path = format!("messages[{i}]");
        let m: Message<'_> = serde_json::from_str(raw.get())
            .map_err(|e| RequestError::invalid(&path, e.to_string()))?;
        t.add(3);
        t.text(&m.role);
        blocks(&mut t, m.content, &format!("{path}.content"), 0)?;
    }
    for raw in req.tools.iter().flatten() {
        t.text(raw.get());
    }
    Ok(t.into_count(
        req.model.into_owned(),
        &counting,
        req.max_tokens,
        req.stream.unwrap_or(false),
    ))
}

fn blocks(t: &mut Tally, raw: &RawValue, path: &str, depth: u8) -> Result<(), RequestError> {
    match raw.get().as_bytes().first() {
        Some(b'"') => t.json_string(raw, path),
        Some(b'[') if depth < 4 => {
            let items: Vec<&RawValue> = serde_json::from_str(raw.get())
                .map_err(|e| RequestError::invalid(path, e.to_string()))?;
            for (k, item) in items.into_iter().enumerate() {
                let bpath = format!("{path}[{k}]");
                let b: Block<'_> = serde_json::from_str(item.get())
                    .map_err(|e| RequestError::invalid(&bpath, e.to_string()))?;
                match b.kind.as_ref() {
                    "text" => t.text(b.text.as_deref().unwrap_or("")),
                    "image" => {
                        let size = b.source.as_ref().and_then(|s| {
                            let data = s.data.as_deref()?;
                            let mt = s.media_type.as_deref().unwrap_or("image/png");
                            crate::image::data_url_size(&format!(
                                "data:{mt};base64,{}",
                                &data[..data.len().min(8192)]
                            ))
                        });
                        let cost = crate::image::anthropic_image_tokens(size);
                        t.add(cost.tokens);
                        if !cost.exact {
                            t.estimated();
                        }
                    }
                    "document" => document(t, item, b.source.as_ref()),
                    "tool_result" => {
                        if let Some(c) = b.content {
                            blocks(t, c, &format!("{bpath}.content"), depth + 1)?;
                        }
                    }
                    _ => t.text(item.get()),
                }
            }
            Ok(())
        }
        _ => Err(RequestError::invalid(
            path,
            "expected a string or an array of content blocks",
        )),
    }
}

/// A `document` block: a base64 PDF by its pages ([`crate::media::ANTHROPIC_PAGE_TOKENS`]
/// each); otherwise its JSON text (an inline text source is in it), and one held elsewhere (by
/// URL or file id), or a base64 source whose pages cannot be read, is also a remote item.
fn document(t: &mut Tally, item: &RawValue, source: Option<&Source<'_>>) {
    use crate::media;
    let kind = source.and_then(|s| s.kind.as_deref());
    if kind == Some("base64") {
        let pages = source
            .and_then(|s| s.data.as_deref())
            .and_then(media::decode)
            .and_then(|b| media::pdf_pages(&b));
        if let Some(pages) = pages {
            t.add(pages.saturating_mul(media::ANTHROPIC_PAGE_TOKENS));
            return;
        }
    }
    t.text(item.get());
    if matches!(kind, Some("url" | "file" | "base64")) {
        t.remote_item();
    }
}
