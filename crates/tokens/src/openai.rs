//! OpenAI request formats: chat completions, completions, embeddings.
//!
//! Chat messages follow OpenAI's cookbook ("How to count tokens with tiktoken"): 3 tokens per
//! message, every string field's tokens (role, content, name, tool_call_id), +1 for a name,
//! +3 priming the reply. Tools follow the cookbook's function-schema rule. Parts the cookbook
//! does not cover (assistant tool calls, nested parameter schemas, response-format schemas,
//! unknown content parts) are counted conservatively from their JSON text and flag the count
//! as an estimate.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::{Counting, Encoding, RequestCount, RequestError, Tally, TokenCounter, image_tokens};

/// Parses `body` as `T`, mapping serde's error into a client error.
pub(crate) fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, RequestError> {
    serde_json::from_slice(body).map_err(|e| RequestError::Json(e.to_string()))
}

/// A JSON string, borrowed when it has no escapes.
pub(crate) fn string<'a>(raw: &'a RawValue, field: &str) -> Result<Cow<'a, str>, RequestError> {
    // Only a literal without escapes can be borrowed. Tried on one with escapes, serde's error
    // would quote the whole decoded string (and find its line), which for a long message cost
    // more than counting it.
    if !raw.get().contains('\\') {
        if let Ok(s) = serde_json::from_str::<&'a str>(raw.get()) {
            return Ok(Cow::Borrowed(s));
        }
    }
    serde_json::from_str::<String>(raw.get())
        .map(Cow::Owned)
        .map_err(|_| RequestError::invalid(field, "expected a string"))
}

fn first_byte(raw: &RawValue) -> u8 {
    raw.get().as_bytes().first().copied().unwrap_or(b' ')
}

#[derive(Deserialize)]
struct ChatRequest<'a> {
    #[serde(borrow)]
    model: Cow<'a, str>,
    #[serde(borrow)]
    messages: Vec<Message<'a>>,
    #[serde(default, borrow)]
    tools: Option<Vec<&'a RawValue>>,
    #[serde(default, borrow)]
    functions: Option<Vec<&'a RawValue>>,
    #[serde(default, borrow)]
    response_format: Option<&'a RawValue>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(default, borrow)]
    content: Option<&'a RawValue>,
    #[serde(default, borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    tool_call_id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    tool_calls: Option<Vec<&'a RawValue>>,
    #[serde(default, borrow)]
    function_call: Option<&'a RawValue>,
    /// An earlier audio answer, named by id: the upstream bills its audio again as input.
    #[serde(default, borrow)]
    audio: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    refusal: Option<Cow<'a, str>>,
    /// An object `{url, detail}` in chat; the URL itself in the Responses API's `input_image`.
    #[serde(default, borrow)]
    image_url: Option<&'a RawValue>,
    /// The Responses API's `input_image` detail.
    #[serde(default, borrow)]
    detail: Option<Cow<'a, str>>,
    /// The Responses API's `input_image` held by the upstream.
    #[serde(default, borrow)]
    file_id: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ImageUrl<'a> {
    #[serde(borrow)]
    url: Cow<'a, str>,
    #[serde(default, borrow)]
    detail: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(borrow)]
    function: FunctionCall<'a>,
}

#[derive(Deserialize)]
struct FunctionCall<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(default, borrow)]
    arguments: Option<Cow<'a, str>>,
}

pub(crate) fn count_chat(
    counter: &TokenCounter,
    body: &[u8],
    limit: Option<u64>,
) -> Result<RequestCount, RequestError> {
    // One pass over the body; only a body that fails is parsed again, message by message, to
    // name the field at fault (escape-heavy bodies make every extra pass expensive).
    let req: ChatRequest<'_> = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return Err(locate_chat_error(body).unwrap_or(RequestError::Json(e.to_string()))),
    };
    if req.messages.is_empty() {
        return Err(RequestError::invalid(
            "messages",
            "must contain at least one message",
        ));
    }
    let counting = counter.counting_for(&req.model);
    let mut t = Tally::new(counting.clone(), limit).with_memo(counter.memo.clone());
    for (i, m) in req.messages.iter().enumerate() {
        let path = format!("messages[{i}]");
        t.add(3);
        t.text(&m.role);
        if let Some(name) = &m.name {
            t.text(name);
            t.add(1);
        }
        if let Some(id) = &m.tool_call_id {
            t.text(id);
        }
        if let Some(c) = m.content {
            content(&mut t, &req.model, c, &format!("{path}.content"))?;
        }
        if m.audio.is_some_and(|a| a.get() != "null") {
            t.audio_reference();
        }
        for (j, call) in m.tool_calls.iter().flatten().enumerate() {
            let call: ToolCall<'_> = serde_json::from_str(call.get()).map_err(|e| {
                RequestError::invalid(format!("{path}.tool_calls[{j}]"), e.to_string())
            })?;
            function_call(&mut t, &call.function);
        }
        if let Some(fc) = m.function_call {
            let f: FunctionCall<'_> = serde_json::from_str(fc.get()).map_err(|e| {
                RequestError::invalid(format!("{path}.function_call"), e.to_string())
            })?;
            function_call(&mut t, &f);
        }
    }
    t.add(3);
    let tools = req.tools.iter().flatten().map(|raw| (raw, true));
    let functions = req.functions.iter().flatten().map(|raw| (raw, false));
    let mut any_tool = false;
    let func_init = match &counting {
        Counting::Exact(Encoding::Cl100kBase) => 10,
        _ => 7,
    };
    for (i, (raw, wrapped)) in tools.chain(functions).enumerate() {
        any_tool = true;
        tool(&mut t, raw, wrapped, func_init, &format!("tools[{i}]"))?;
    }
    if any_tool {
        t.add(12);
    }
    if let Some(rf) = req.response_format {
        // A JSON schema steers decoding; its exact cost is not published: count its text.
        if rf.get().contains("json_schema") {
            t.text(rf.get());
            t.estimated();
        }
    }
    Ok(t.into_count(
        req.model.into_owned(),
        &counting,
        req.max_completion_tokens.or(req.max_tokens),
        req.stream.unwrap_or(false),
    ))
}

/// The first message that does not parse, as a field error; `None` when the fault is elsewhere.
fn locate_chat_error(body: &[u8]) -> Option<RequestError> {
    #[derive(Deserialize)]
    struct Shallow<'a> {
        #[serde(borrow)]
        messages: Vec<&'a RawValue>,
    }
    let shallow: Shallow<'_> = serde_json::from_slice(body).ok()?;
    shallow.messages.iter().enumerate().find_map(|(i, raw)| {
        serde_json::from_str::<Message<'_>>(raw.get())
            .err()
            .map(|e| RequestError::invalid(format!("messages[{i}]"), e.to_string()))
    })
}

fn function_call(t: &mut Tally, f: &FunctionCall<'_>) {
    // Not covered by the cookbook: name + arguments + 3 framing tokens, flagged.
    t.add(3);
    t.text(&f.name);
    if let Some(a) = &f.arguments {
        t.text(a);
    }
    t.estimated();
}

/// A message's content: a string, null, or an array of parts, chat's or the Responses API's.
pub(crate) fn content(
    t: &mut Tally,
    model: &str,
    raw: &RawValue,
    path: &str,
) -> Result<(), RequestError> {
    match first_byte(raw) {
        b'"' => t.json_string(raw, path)?,
        b'n' => {}
        b'[' => {
            let parts: Vec<&RawValue> = serde_json::from_str(raw.get())
                .map_err(|e| RequestError::invalid(path, e.to_string()))?;
            for (k, raw) in parts.into_iter().enumerate() {
                let ppath = format!("{path}[{k}]");
                let p: Part<'_> = serde_json::from_str(raw.get())
                    .map_err(|e| RequestError::invalid(&ppath, e.to_string()))?;
                match p.kind.as_ref() {
                    "text" | "input_text" | "output_text" => match &p.text {
                        Some(s) => t.text(s),
                        None => {
                            return Err(RequestError::invalid(format!("{ppath}.text"), "missing"));
                        }
                    },
                    "refusal" => t.text(p.refusal.as_deref().unwrap_or("")),
                    kind @ ("image_url" | "input_image") => {
                        let field = format!("{ppath}.image_url");
                        let Some(raw) = p.image_url else {
                            if kind == "input_image" && p.file_id.is_some() {
                                // Held by the upstream: its size is unknown, its most charged.
                                let cost = image_tokens(model, p.detail.as_deref(), None);
                                t.add(cost.tokens);
                                t.estimated();
                                continue;
                            }
                            return Err(RequestError::invalid(field, "missing"));
                        };
                        let (url, detail) = if kind == "image_url" {
                            let img: ImageUrl<'_> = serde_json::from_str(raw.get())
                                .map_err(|e| RequestError::invalid(&field, e.to_string()))?;
                            (img.url, img.detail)
                        } else {
                            (string(raw, &field)?, p.detail)
                        };
                        let size = crate::image::data_url_size(&url);
                        let cost = image_tokens(model, detail.as_deref(), size);
                        t.add(cost.tokens);
                        if !cost.exact {
                            t.estimated();
                        }
                    }
                    "file" | "input_file" => crate::media::file_part(t, model, raw, &ppath)?,
                    "input_audio" => crate::media::audio_part(t, raw, &ppath)?,
                    _ => {
                        // Audio and future part types: their JSON text, flagged.
                        t.text(raw.get());
                        t.estimated();
                    }
                }
            }
        }
        _ => {
            return Err(RequestError::invalid(
                path,
                "expected a string, an array of parts or null",
            ));
        }
    }
    Ok(())
}

#[derive(Deserialize)]
struct ToolDef<'a> {
    #[serde(borrow)]
    function: &'a RawValue,
}

#[derive(Deserialize)]
struct FunctionDef<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(default, borrow)]
    description: Option<Cow<'a, str>>,
    #[serde(default)]
    parameters: Option<serde_json::Value>,
}

/// The cookbook's rule for one function: 7 (10 on cl100k) + "name:description" + 3 for the
/// properties block + per property 3 + "name:type:description" (+ enum items: −3, then 3 +
/// the item each); 12 after all functions. Nested or untyped properties are counted from their
/// JSON text and flag the count.
pub(crate) fn tool(
    t: &mut Tally,
    raw: &RawValue,
    wrapped: bool,
    func_init: u64,
    path: &str,
) -> Result<(), RequestError> {
    let fraw = if wrapped {
        let d: ToolDef<'_> = serde_json::from_str(raw.get())
            .map_err(|e| RequestError::invalid(path, e.to_string()))?;
        d.function
    } else {
        raw
    };
    let f: FunctionDef<'_> = serde_json::from_str(fraw.get())
        .map_err(|e| RequestError::invalid(format!("{path}.function"), e.to_string()))?;
    t.add(func_init);
    let desc = f.description.as_deref().unwrap_or("");
    t.text(&format!(
        "{}:{}",
        f.name,
        desc.strip_suffix('.').unwrap_or(desc)
    ));
    let props = f
        .parameters
        .as_ref()
        .and_then(|p| p.get("properties"))
        .and_then(|p| p.as_object());
    if let Some(props) = props.filter(|p| !p.is_empty()) {
        t.add(3);
        for (name, schema) in props {
            t.add(3);
            let ty = schema.get("type").and_then(|v| v.as_str());
            let nested = schema.get("properties").is_some() || schema.get("items").is_some();
            let Some(ty) = ty.filter(|_| !nested) else {
                t.text(name);
                t.text(&schema.to_string());
                t.estimated();
                continue;
            };
            if let Some(items) = schema.get("enum").and_then(|e| e.as_array()) {
                // −3 for the enum, then 3 + the item's tokens per item.
                t.add(3 * (items.len() as u64).saturating_sub(1));
                for item in items {
                    match item.as_str() {
                        Some(s) => t.text(s),
                        None => t.text(&item.to_string()),
                    }
                }
            }
            let pdesc = schema
                .get("description")
                .and_then(|v| v.as_str())
                .unwrap_or("");
            t.text(&format!(
                "{name}:{ty}:{}",
                pdesc.strip_suffix('.').unwrap_or(pdesc)
            ));
        }
    }
    Ok(())
}

#[derive(Deserialize)]
struct CompletionRequest<'a> {
    #[serde(borrow)]
    model: Cow<'a, str>,
    #[serde(borrow)]
    prompt: &'a RawValue,
    /// Text after the insertion point: input like the prompt.
    #[serde(default, borrow)]
    suffix: Option<Cow<'a, str>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
struct EmbeddingRequest<'a> {
    #[serde(borrow)]
    model: Cow<'a, str>,
    #[serde(borrow)]
    input: &'a RawValue,
}

/// A prompt or embedding input: a string, strings, token ids, or arrays of token ids.
fn text_or_tokens(t: &mut Tally, raw: &RawValue, path: &str) -> Result<(), RequestError> {
    match first_byte(raw) {
        b'"' => {
            t.text(&string(raw, path)?);
            Ok(())
        }
        b'[' => {
            let items: Vec<&RawValue> = serde_json::from_str(raw.get())
                .map_err(|e| RequestError::invalid(path, e.to_string()))?;
            for (i, item) in items.into_iter().enumerate() {
                let ipath = format!("{path}[{i}]");
                match first_byte(item) {
                    b'"' => t.text(&string(item, &ipath)?),
                    b'[' => {
                        let ids: Vec<u32> = serde_json::from_str(item.get()).map_err(|_| {
                            RequestError::invalid(&ipath, "expected an array of token ids")
                        })?;
                        t.add(ids.len() as u64);
                    }
                    b'0'..=b'9' => {
                        let _: u32 = serde_json::from_str(item.get())
                            .map_err(|_| RequestError::invalid(&ipath, "expected a token id"))?;
                        t.add(1);
                    }
                    _ => {
                        return Err(RequestError::invalid(
                            &ipath,
                            "expected a string or token ids",
                        ));
                    }
                }
            }
            Ok(())
        }
        _ => Err(RequestError::invalid(path, "expected a string or an array")),
    }
}

pub(crate) fn count_completions(
    counter: &TokenCounter,
    body: &[u8],
    limit: Option<u64>,
) -> Result<RequestCount, RequestError> {
    let req: CompletionRequest<'_> = parse(body)?;
    let counting = counter.counting_for(&req.model);
    let mut t = Tally::new(counting.clone(), limit).with_memo(counter.memo.clone());
    text_or_tokens(&mut t, req.prompt, "prompt")?;
    if let Some(s) = &req.suffix {
        t.text(s);
    }
    Ok(t.into_count(
        req.model.into_owned(),
        &counting,
        req.max_tokens,
        req.stream.unwrap_or(false),
    ))
}

pub(crate) fn count_embeddings(
    counter: &TokenCounter,
    body: &[u8],
    limit: Option<u64>,
) -> Result<RequestCount, RequestError> {
    let req: EmbeddingRequest<'_> = parse(body)?;
    let counting = counter.counting_for(&req.model);
    let mut t = Tally::new(counting.clone(), limit).with_memo(counter.memo.clone());
    text_or_tokens(&mut t, req.input, "input")?;
    Ok(t.into_count(req.model.into_owned(), &counting, None, false))
}
