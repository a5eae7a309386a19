//! OpenAI's Responses API (`POST /v1/responses`), flagged as an estimate: OpenAI publishes no
//! framing rule for it. Its messages are counted with the chat rule (3 per message, the role,
//! the content, 3 priming the reply), `instructions` as a system message, function tools with
//! the chat rule for functions, and every other item, part or tool from its JSON text.
//!
//! Only the body is counted. Context the upstream keeps (`previous_response_id`,
//! `conversation`, `item_reference` items, stored `prompt` templates) is not in it: the
//! gateway adds it (see `docs/apis.md`).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::openai::content;
use crate::openai::parse;
use crate::{Counting, Encoding, RequestCount, RequestError, Tally, TokenCounter};

#[derive(Deserialize)]
struct ResponsesRequest<'a> {
    #[serde(borrow)]
    model: Cow<'a, str>,
    #[serde(default, borrow)]
    input: Option<&'a RawValue>,
    #[serde(default, borrow)]
    instructions: Option<&'a RawValue>,
    #[serde(default, borrow)]
    tools: Option<Vec<&'a RawValue>>,
    #[serde(default, borrow)]
    text: Option<&'a RawValue>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
}

/// An input item: a message (with `role`), or a typed item (function call, its output, ...).
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    role: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    content: Option<&'a RawValue>,
    #[serde(default, borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    arguments: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    output: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ToolKind<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
}

pub(crate) fn count_responses(
    counter: &TokenCounter,
    body: &[u8],
    limit: Option<u64>,
) -> Result<RequestCount, RequestError> {
    let req: ResponsesRequest<'_> = parse(body)?;
    let counting = counter.counting_for(&req.model);
    let mut t = Tally::new(counting.clone(), limit).with_memo(counter.memo.clone());
    t.estimated();
    if let Some(raw) = req.instructions.filter(|r| r.get() != "null") {
        t.add(3);
        t.text("system");
        t.json_string(raw, "instructions")?;
    }
    match req.input.map(|r| (r, r.get().as_bytes().first().copied())) {
        None | Some((_, Some(b'n'))) => {}
        Some((raw, Some(b'"'))) => {
            t.add(3);
            t.text("user");
            t.json_string(raw, "input")?;
        }
        Some((raw, Some(b'['))) => {
            let items: Vec<&RawValue> = serde_json::from_str(raw.get())
                .map_err(|e| RequestError::invalid("input", e.to_string()))?;
            for (i, raw) in items.into_iter().enumerate() {
                item(&mut t, &req.model, raw, &format!("input[{i}]"))?;
            }
        }
        Some(_) => {
            return Err(RequestError::invalid(
                "input",
                "expected a string or an array of input items",
            ));
        }
    }
    t.add(3);
    let func_init = match &counting {
        Counting::Exact(Encoding::Cl100kBase) => 10,
        _ => 7,
    };
    let mut any_function = false;
    for (i, raw) in req.tools.iter().flatten().enumerate() {
        let path = format!("tools[{i}]");
        let k: ToolKind<'_> = serde_json::from_str(raw.get())
            .map_err(|e| RequestError::invalid(&path, e.to_string()))?;
        if k.kind == "function" {
            any_function = true;
            // Responses' function tools are flat: {type, name, description, parameters}.
            crate::openai::tool(&mut t, raw, false, func_init, &path)?;
        } else {
            // Built-in tools (web search, file search, MCP, ...): their JSON text.
            t.text(raw.get());
        }
    }
    if any_function {
        t.add(12);
    }
    if let Some(text) = req.text.filter(|r| r.get().contains("json_schema")) {
        t.text(text.get());
    }
    Ok(t.into_count(
        req.model.into_owned(),
        &counting,
        req.max_output_tokens,
        req.stream.unwrap_or(false),
    ))
}

fn item(t: &mut Tally, model: &str, raw: &RawValue, path: &str) -> Result<(), RequestError> {
    let it: Item<'_> =
        serde_json::from_str(raw.get()).map_err(|e| RequestError::invalid(path, e.to_string()))?;
    match (it.kind.as_deref(), &it.role) {
        (None | Some("message"), Some(role)) => {
            t.add(3);
            t.text(role);
            let Some(c) = it.content else {
                return Err(RequestError::invalid(format!("{path}.content"), "missing"));
            };
            content(t, model, c, &format!("{path}.content"))
        }
        (None | Some("message"), None) => {
            Err(RequestError::invalid(format!("{path}.role"), "missing"))
        }
        (Some("function_call"), _) => {
            t.add(3);
            t.text(it.name.as_deref().unwrap_or(""));
            t.text(it.arguments.as_deref().unwrap_or(""));
            Ok(())
        }
        (Some("function_call_output"), _) => {
            t.add(3);
            match it.output {
                Some(o) if o.get().starts_with('"') => t.json_string(o, &format!("{path}.output")),
                Some(o) => content(t, model, o, &format!("{path}.output")),
                None => Err(RequestError::invalid(format!("{path}.output"), "missing")),
            }
        }
        _ => {
            // Reasoning items, tool calls of built-in tools, references: their JSON text.
            t.add(3);
            t.text(raw.get());
            Ok(())
        }
    }
}
