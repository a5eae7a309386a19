//! Server-sent events passing through: forwarded chunk by chunk, read on the way for usage and
//! streamed output, with the usage event removed when the client did not ask for it. OpenAI's
//! chunks carry usage in a last event the gateway asks for; Anthropic's carry the input in
//! `message_start` and the output, cumulative, in `message_delta`; the Responses API's carry
//! the whole usage in the response of their last event (`response.completed`, `.incomplete` or
//! `.failed`).

use bytes::{Bytes, BytesMut};
use serde_json::Value;
use tollgate_core::ledger::MAX_USAGE_TOKENS;
use tollgate_tokens::TokenCounter;

/// What a stream reported or produced so far.
#[derive(Debug)]
pub struct SseMeter {
    buf: BytesMut,
    strip_usage: bool,
    counter: TokenCounter,
    model: String,
    /// Usage reported by the upstream: (prompt, cached, completion).
    pub usage: Option<(u64, u64, u64)>,
    /// Output tokens counted from the streamed output, every part of it (text, refusals,
    /// reasoning, tool-call arguments), each event on its own: a running count, an upper bound
    /// of [`Self::exact_output`] but for tokenizer differences at event boundaries.
    pub counted_output: u64,
    /// The same count's floor ([`TokenCounter::count_output`]), summed event by event.
    counted_floor: u64,
    /// The running floor at which [`Self::past`] next counts the output exactly.
    next_exact: u64,
    /// The streamed output's text, each part of the answer apart (a choice's content, a tool
    /// call's arguments, a content block), for its exact count ([`Self::exact_output`]); bounded
    /// by the cap the stream is held to.
    parts: Vec<(u64, String)>,
    /// Chat: the chunks' `object` and `id`, and how many choices they carried, to end a stream
    /// the gateway cuts off in the same shape.
    object: Option<String>,
    id: Option<String>,
    choices: u64,
    /// Anthropic: the content block open now, closed before a stream is cut off.
    open_block: Option<u64>,
    /// Tool calls the stream began (counted at their first event, so a stream cut short still
    /// counts the calls it started).
    pub tool_calls: u64,
    /// The fee-carrying calls of tools the upstream ran, as their items began.
    used: tollgate_core::Metered,
    /// Whether `[DONE]` was seen.
    pub done: bool,
    /// Anthropic's events rather than OpenAI's chunks.
    anthropic: bool,
    /// OpenAI Responses API events rather than chat chunks.
    responses: bool,
    /// Responses API: the response's id (from `response.created`), to remember its context.
    pub response_id: Option<String>,
    /// Anthropic: the input (with cache reads and writes) and cache reads of `message_start`.
    anthropic_input: Option<(u64, u64)>,
    /// Anthropic: the prompt-cache writes of `message_start`, for five minutes and for one hour
    /// (see [`anthropic_cache_writes`]).
    pub cache_writes: (u64, u64),
    /// Whether a usage number the stream reported was not a count (see [`usage_number`]).
    pub bad_usage: bool,
    /// Events with data seen so far (comments such as `: keep-alive` are not events).
    pub events: u64,
    /// How much of `buf` has been searched for an event's end already: each byte is scanned
    /// once, however the stream is split.
    scanned: usize,
}

/// The output of Anthropic's content blocks, each block's text apart (each is tokenized on its
/// own): text, thinking, and tool calls' input as JSON (all are billed as output).
pub fn anthropic_output_parts(content: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for block in content.as_array().into_iter().flatten() {
        if let Some(s) = block["text"].as_str().or(block["thinking"].as_str()) {
            out.push(s.to_owned());
        } else if block["type"] == "tool_use" {
            out.push(block["input"].to_string());
        }
    }
    out
}

/// Whether a Responses API output or input item is a tool call the model made: a function
/// call, or a built-in tool's (web and file search, code interpreter, computer use, image
/// generation, shell, MCP, custom tools), whose types all end in `_call`.
pub fn is_responses_tool_call(item: &Value) -> bool {
    item["type"].as_str().is_some_and(|t| t.ends_with("_call"))
}

/// Whether an Anthropic content block is a tool call the model made: a client tool's
/// (`tool_use`), or one Anthropic runs (`server_tool_use`, `mcp_tool_use`).
pub fn is_anthropic_tool_call(block: &Value) -> bool {
    matches!(
        block["type"].as_str(),
        Some("tool_use" | "server_tool_use" | "mcp_tool_use")
    )
}

/// One usage number as an upstream reported it, which is outside input: `None` when absent
/// (or null); a non-negative integer, written as an integer or a float, at most
/// [`MAX_USAGE_TOKENS`] (larger ones, up to 2^64 − 1 or 1e30, are clamped to it and charged);
/// anything else (negative, fractional, a string, an object) sets `bad` and counts as absent,
/// and the caller charges the reservation instead of guessing.
pub fn usage_number(v: &Value, bad: &mut bool) -> Option<u64> {
    match v {
        Value::Null => None,
        Value::Number(n) => match (n.as_u64(), n.as_f64()) {
            (Some(u), _) => Some(u.min(MAX_USAGE_TOKENS)),
            (None, Some(f)) if f >= 0.0 && f.fract() == 0.0 => {
                // At or above 2^64 (or a float of an integer): the bound, or the integer.
                Some(if f >= MAX_USAGE_TOKENS as f64 {
                    MAX_USAGE_TOKENS
                } else {
                    f as u64
                })
            }
            _ => {
                *bad = true;
                None
            }
        },
        _ => {
            *bad = true;
            None
        }
    }
}

/// Anthropic's usage object as (input, cached input): its `input_tokens` leaves out the tokens
/// read from and written to the prompt cache, which are input all the same. `None` without
/// `input_tokens`.
pub fn anthropic_usage(u: &Value, bad: &mut bool) -> Option<(u64, u64)> {
    let plain = usage_number(&u["input_tokens"], bad);
    let read = usage_number(&u["cache_read_input_tokens"], bad).unwrap_or(0);
    let written = usage_number(&u["cache_creation_input_tokens"], bad).unwrap_or(0);
    Some((plain?.saturating_add(read).saturating_add(written), read))
}

/// Anthropic's prompt-cache writes as (five-minute, one-hour) tokens, billed at 1.25 and 2 times
/// the input price: `cache_creation_input_tokens`, split by its `cache_creation` breakdown where
/// there is one (what the breakdown does not place counts as five-minute, the cheaper).
pub fn anthropic_cache_writes(u: &Value, bad: &mut bool) -> (u64, u64) {
    let split = &u["cache_creation"];
    let hour = usage_number(&split["ephemeral_1h_input_tokens"], bad).unwrap_or(0);
    let five = usage_number(&split["ephemeral_5m_input_tokens"], bad).unwrap_or(0);
    let total = usage_number(&u["cache_creation_input_tokens"], bad)
        .unwrap_or_else(|| five.saturating_add(hour));
    let hour = hour.min(total);
    (total - hour, hour)
}

/// The Responses API's usage object as (input, cached input, output); `None` without
/// `input_tokens`.
pub fn responses_usage(u: &Value, bad: &mut bool) -> Option<(u64, u64, u64)> {
    let input = usage_number(&u["input_tokens"], bad);
    let cached = usage_number(&u["input_tokens_details"]["cached_tokens"], bad).unwrap_or(0);
    let output = usage_number(&u["output_tokens"], bad).unwrap_or(0);
    Some((input?, cached, output))
}

/// OpenAI's chat and completions usage object as (prompt, cached, completion); `None` when
/// there is no usage object. A missing prompt count is `estimate`.
pub fn chat_usage(u: &Value, estimate: u64, bad: &mut bool) -> Option<(u64, u64, u64)> {
    if !u.is_object() {
        return None;
    }
    let prompt = usage_number(&u["prompt_tokens"], bad).unwrap_or(estimate);
    let cached = usage_number(&u["prompt_tokens_details"]["cached_tokens"], bad).unwrap_or(0);
    let completion = usage_number(&u["completion_tokens"], bad).unwrap_or(0);
    Some((prompt, cached, completion))
}

/// The output of a Responses API response, each part's text apart: message text and
/// refusals, function-call arguments, reasoning summaries (all billed as output).
pub fn responses_output_parts(output: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for item in output.as_array().into_iter().flatten() {
        if let Some(a) = item["arguments"].as_str() {
            out.push(a.to_owned());
        }
        for part in ["content", "summary"]
            .iter()
            .filter_map(|k| item[*k].as_array())
            .flatten()
        {
            if let Some(s) = part["text"].as_str().or(part["refusal"].as_str()) {
                out.push(s.to_owned());
            }
        }
    }
    out
}

impl SseMeter {
    /// A meter; `strip_usage` removes the usage-only event the gateway asked for.
    pub fn new(model: &str, strip_usage: bool) -> Self {
        Self {
            buf: BytesMut::new(),
            strip_usage,
            counter: TokenCounter::default(),
            model: model.to_owned(),
            usage: None,
            counted_output: 0,
            counted_floor: 0,
            next_exact: 0,
            parts: Vec::new(),
            object: None,
            id: None,
            choices: 0,
            open_block: None,
            tool_calls: 0,
            used: tollgate_core::Metered::default(),
            done: false,
            anthropic: false,
            responses: false,
            response_id: None,
            anthropic_input: None,
            cache_writes: (0, 0),
            bad_usage: false,
            events: 0,
            scanned: 0,
        }
    }

    /// The same meter, counting with `counter` (the configuration's, with its tokenizers).
    #[must_use]
    pub fn with_counter(mut self, counter: TokenCounter) -> Self {
        self.counter = counter;
        self
    }

    /// A meter of the Responses API's typed events (none removed).
    pub fn responses(model: &str) -> Self {
        Self {
            responses: true,
            ..Self::new(model, false)
        }
    }

    /// A meter of Anthropic's events (none removed).
    pub fn anthropic(model: &str) -> Self {
        Self {
            anthropic: true,
            ..Self::new(model, false)
        }
    }

    /// Takes upstream bytes and returns the bytes to send on: whole events only.
    pub fn feed(&mut self, chunk: &[u8]) -> Bytes {
        self.buf.extend_from_slice(chunk);
        let mut out = BytesMut::new();
        while let Some(end) = find_event_end(&self.buf, self.scanned) {
            let event = self.buf.split_to(end);
            self.scanned = 0;
            if self.inspect(&event) {
                out.extend_from_slice(&event);
            }
        }
        // An event's end (at most four bytes) may straddle the next chunk.
        self.scanned = self.buf.len().saturating_sub(3);
        out.freeze()
    }

    /// Bytes of an event not yet ended.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// What is left at the end of the stream (an unterminated event), sent as is.
    pub fn finish(&mut self) -> Bytes {
        let rest = self.buf.split();
        let _ = self.inspect(&rest);
        rest.freeze()
    }

    /// Reads one event; returns whether to forward it.
    fn inspect(&mut self, event: &[u8]) -> bool {
        let text = String::from_utf8_lossy(event);
        let mut forward = true;
        for line in text.lines() {
            let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                continue;
            };
            self.events += 1;
            if data == "[DONE]" {
                self.done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if self.anthropic {
                self.inspect_anthropic(&v);
                continue;
            }
            if self.responses {
                self.inspect_responses(&v);
                continue;
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                if let Some(usage) = chat_usage(u, 0, &mut self.bad_usage) {
                    self.usage = Some(usage);
                }
                if self.strip_usage && v["choices"].as_array().is_none_or(|c| c.is_empty()) {
                    forward = false;
                }
            }
            if self.object.is_none() {
                self.object = v["object"].as_str().map(str::to_owned);
                self.id = v["id"].as_str().map(str::to_owned);
            }
            for choice in v["choices"].as_array().into_iter().flatten() {
                let index = choice["index"].as_u64().unwrap_or(0);
                self.choices = self.choices.max(index.saturating_add(1));
                let delta = &choice["delta"];
                // A tool call's first chunk carries its id; its arguments follow without one.
                let calls = delta["tool_calls"].as_array().into_iter().flatten();
                let started = calls.clone().filter(|c| c["id"].is_string()).count() as u64;
                let legacy = u64::from(delta["function_call"]["name"].is_string());
                self.tool_calls = self.tool_calls.saturating_add(started + legacy);
                // Every part of the answer is billed output, whichever field carries it; each
                // part is its own text (a key per choice, field and tool call).
                let fields = ["content", "refusal", "reasoning_content", "reasoning"]
                    .into_iter()
                    .map(|k| &delta[k])
                    .chain([&choice["text"], &delta["function_call"]["arguments"]])
                    .enumerate();
                let calls = calls.map(|c| {
                    let k = c["index"].as_u64().unwrap_or(0).saturating_add(8);
                    (k as usize, &c["function"]["arguments"])
                });
                let parts: Vec<(u64, &str)> = fields
                    .chain(calls)
                    .filter_map(|(k, v)| Some(((index << 20) | k as u64, v.as_str()?)))
                    .collect();
                for (key, s) in parts {
                    self.output(key, s);
                }
            }
        }
        forward
    }

    /// Usage so far when the stream has not reported it whole: the input the upstream reported
    /// (Anthropic's `message_start`), else `estimate`, and the output counted from the content.
    pub fn usage_so_far(&self, estimate: u64) -> (u64, u64, u64) {
        let (input, cached) = self.anthropic_input.unwrap_or((estimate, 0));
        (input, cached, self.counted_output)
    }

    /// Counts a piece of the output passing through, of the part `key`.
    fn output(&mut self, key: u64, s: &str) {
        let (floor, count) = self.counter.count_output(&self.model, s);
        self.counted_output = self.counted_output.saturating_add(count);
        self.counted_floor = self.counted_floor.saturating_add(floor);
        match self.parts.iter_mut().rev().find(|(k, _)| *k == key) {
            Some((_, text)) => text.push_str(s),
            None => self.parts.push((key, s.to_owned())),
        }
    }

    /// The output that passed through, counted exactly: each part's text joined and counted
    /// once, as the upstream tokenized it (for a model counted by estimate, the floor of
    /// [`TokenCounter::count_output`]: the fewest tokens an honest report can say).
    pub fn exact_output(&self) -> u64 {
        self.parts
            .iter()
            .map(|(_, t)| self.counter.count_output(&self.model, t).0)
            .fold(0, u64::saturating_add)
    }

    /// Whether the output that passed through is certainly past `limit` tokens. The running
    /// count, event by event, may overstate at the edges of events, so the exact count decides;
    /// it is taken again only once the running count has grown by a sixteenth, so that a stream
    /// of tiny events is not counted over and over.
    pub fn past(&mut self, limit: u64) -> bool {
        if self.counted_floor <= limit.max(self.next_exact) {
            return false;
        }
        if self.exact_output() > limit {
            return true;
        }
        self.next_exact = self
            .counted_floor
            .saturating_add((self.counted_floor / 16).max(16));
        false
    }

    /// The fee-carrying calls the stream showed, where its format shows them all (the
    /// Responses API's items, Anthropic's blocks); `None` for chat, whose web search is not
    /// shown.
    pub fn tools_seen(&self) -> Option<tollgate_core::Metered> {
        (self.anthropic || self.responses).then_some(self.used)
    }

    /// The events that end a stream the gateway cut off at its output cap, in the stream's own
    /// format, as the upstream would have ended it there (finish reason `length`, Anthropic's
    /// `max_tokens`, a Responses API response `incomplete` for `max_output_tokens`), with the
    /// usage charged: (input, cached input, output).
    pub fn cap_end(&self, (input, cached, output): (u64, u64, u64)) -> Bytes {
        end::cap_end(self, (input, cached, output))
    }

    fn inspect_responses(&mut self, v: &Value) {
        let Some(kind) = v["type"].as_str() else {
            return;
        };
        match kind {
            "response.created" => {
                self.response_id = v["response"]["id"].as_str().map(str::to_owned);
            }
            "response.output_item.added" if is_responses_tool_call(&v["item"]) => {
                self.tool_calls = self.tool_calls.saturating_add(1);
                crate::upstream_tools::used_by(&v["item"], &mut self.used);
            }
            // The last event of a response, whatever its end, carries its usage.
            "response.completed" | "response.incomplete" | "response.failed" => {
                if let Some(u) = responses_usage(&v["response"]["usage"], &mut self.bad_usage) {
                    self.usage = Some(u);
                }
                self.done = true;
            }
            // Text, refusals, tool-call arguments and reasoning are all output (audio deltas
            // are base64, not text: the usage that ends the stream counts them).
            _ if kind.ends_with(".delta") && !kind.contains("audio") => {
                if let Some(s) = v["delta"].as_str() {
                    let item = v["output_index"].as_u64().unwrap_or(0);
                    let part = v["content_index"]
                        .as_u64()
                        .or(v["summary_index"].as_u64())
                        .unwrap_or(0);
                    self.output((item << 20) | (part & 0xfffff), s);
                }
            }
            _ => {}
        }
    }

    fn inspect_anthropic(&mut self, v: &Value) {
        match v["type"].as_str() {
            Some("message_start") => {
                let u = &v["message"]["usage"];
                self.anthropic_input = anthropic_usage(u, &mut self.bad_usage);
                self.cache_writes = anthropic_cache_writes(u, &mut self.bad_usage);
            }
            Some("content_block_start") => {
                self.open_block = v["index"].as_u64();
                if is_anthropic_tool_call(&v["content_block"]) {
                    self.tool_calls = self.tool_calls.saturating_add(1);
                    crate::upstream_tools::used_by(&v["content_block"], &mut self.used);
                }
            }
            Some("content_block_stop") => self.open_block = None,
            Some("content_block_delta") => {
                let d = &v["delta"];
                // Text, thinking and tool input are all output.
                if let Some(s) = d["text"]
                    .as_str()
                    .or(d["partial_json"].as_str())
                    .or(d["thinking"].as_str())
                {
                    let block = v["index"].as_u64().unwrap_or(0);
                    self.output(block, s);
                }
            }
            Some("message_delta") => {
                // Cumulative: the last one is the whole output and, where it carries them, the
                // whole input and cache counts, which are what Anthropic bills (the input that
                // server tools such as web search fetched included).
                let u = &v["usage"];
                if u["input_tokens"].is_number() {
                    self.anthropic_input = anthropic_usage(u, &mut self.bad_usage);
                }
                if !u["cache_creation_input_tokens"].is_null() || !u["cache_creation"].is_null() {
                    self.cache_writes = anthropic_cache_writes(u, &mut self.bad_usage);
                }
                let out = usage_number(&u["output_tokens"], &mut self.bad_usage);
                if let (Some((input, cached)), Some(out)) = (self.anthropic_input, out) {
                    self.usage = Some((input, cached, out));
                }
            }
            Some("message_stop") => self.done = true,
            _ => {}
        }
    }
}

/// The property the `sse` fuzz target checks, shared with the test that replays its corpus on
/// stable: any upstream bytes, split anywhere, in both formats, never panic; a meter that
/// removes nothing forwards exactly the bytes it got; and where the bytes are split changes
/// neither what is forwarded nor what is metered. The first byte picks the split points.
#[doc(hidden)]
#[allow(clippy::panic)] // a failed check must crash the fuzzer
pub fn fuzz_check(data: &[u8]) {
    let Some((&seed, body)) = data.split_first() else {
        return;
    };
    let step = usize::from(seed % 13) + 1;
    for kind in ["openai", "anthropic", "responses"] {
        // Only OpenAI's chat meter removes anything (the usage event it asked for).
        let removes_nothing = kind != "openai";
        for strip in [false, true] {
            let meter = || match kind {
                "anthropic" => SseMeter::anthropic("claude-sonnet-4"),
                "responses" => SseMeter::responses("gpt-4o"),
                _ => SseMeter::new("gpt-4o", strip),
            };
            let (mut whole, mut split) = (meter(), meter());
            let mut a = whole.feed(body).to_vec();
            a.extend_from_slice(&whole.finish());
            let mut b = Vec::new();
            for chunk in body.chunks(step) {
                b.extend_from_slice(&split.feed(chunk));
            }
            b.extend_from_slice(&split.finish());
            assert_eq!(a, b, "the split changed what is forwarded");
            assert_eq!(
                (
                    whole.usage,
                    whole.counted_output,
                    whole.tool_calls,
                    whole.done,
                    &whole.response_id
                ),
                (
                    split.usage,
                    split.counted_output,
                    split.tool_calls,
                    split.done,
                    &split.response_id
                ),
                "the split changed what is metered"
            );
            if removes_nothing || !strip {
                assert_eq!(a, body, "a meter that removes nothing changed the stream");
            } else {
                assert!(a.len() <= body.len(), "stripping added bytes");
            }
        }
    }
}

/// Where the first event of `buf` ends, searching from `from` (what lies before it holds no end).
fn find_event_end(buf: &[u8], from: usize) -> Option<usize> {
    let rest = buf.get(from..)?;
    let lf = rest
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|p| from + p + 2);
    let crlf = rest
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| from + p + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

mod end;
#[cfg(test)]
mod tests;
