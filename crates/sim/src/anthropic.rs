//! Anthropic's Messages API as the simulator serves it.

use super::*;

/// An error in Anthropic's format.
fn anthropic_error(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        Json(json!({"type": "error", "error": {"type": kind, "message": message}})),
    )
        .into_response()
}

/// Anthropic's `POST /v1/messages`: `x-api-key` and `anthropic-version` required, `max_tokens`
/// required, usage in the body or, streamed, in `message_start` (input) and `message_delta`
/// (output).
pub(crate) async fn messages(
    State(state): State<Arc<SimState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key_ok = match &state.config.api_key {
        None => true,
        Some(k) => headers.get("x-api-key").and_then(|v| v.to_str().ok()) == Some(k.as_str()),
    };
    if !key_ok {
        return anthropic_error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid x-api-key",
        );
    }
    if !headers.contains_key("anthropic-version") {
        return anthropic_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "anthropic-version: header is required",
        );
    }
    let (req, prompt) = match read_request(&body, Format::AnthropicMessages, &state.config) {
        Ok(r) => r,
        Err(e) => return *e,
    };
    if let Ok(mut s) = state.stats.lock() {
        s.last_body = Some(req.clone());
    }
    let Some(cap) = req["max_tokens"].as_u64() else {
        return anthropic_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "max_tokens: Field required",
        );
    };
    let model = req["model"].as_str().unwrap_or("").to_owned();
    let server = crate::count_server_calls(&state, &req, Format::AnthropicMessages);
    let searches: u64 = server
        .iter()
        .filter(|(k, _, _)| k == "web_search")
        .map(|(_, n, _)| n)
        .sum();
    let calls = function_calls(&state, &req, Format::AnthropicMessages);
    let out = billing::output(
        &state.config,
        &req,
        Format::AnthropicMessages,
        Some(cap),
        &calls,
    );
    let (n, billed, reported) = (out.per_answer, out.billed(), out.reported(&state.config));
    let stop = if !calls.is_empty() {
        "tool_use"
    } else if n >= cap {
        "max_tokens"
    } else {
        "end_turn"
    };
    let tool_use = |(id, name, _): &(String, String, String), input: Value| json!({"type": "tool_use", "id": id, "name": name, "input": input});
    let mut usage = cache_usage(&state, &req, prompt);
    if searches > 0 {
        usage["server_tool_use"] = json!({"web_search_requests": searches});
    }
    let guard = InFlight::new(&state, &headers);
    pause(state.config.latency).await;
    if req["stream"].as_bool() != Some(true) {
        pause(state.config.token_delay * u32::try_from(n).unwrap_or(u32::MAX)).await;
        guard.done(prompt, billed);
        let text = "tok ".repeat(usize::try_from(n).unwrap_or(0));
        let mut content = vec![json!({"type": "text", "text": text.trim_end()})];
        if out.reasoning > 0 {
            content.insert(
                0,
                json!({"type": "thinking", "thinking": SUMMARY, "signature": "sig"}),
            );
        }
        // Each call of a tool it ran is a block of its own, before the answer.
        for (k, n, _) in &server {
            for _ in 0..*n {
                content.insert(
                    0,
                    json!({"type": "server_tool_use", "id": "srvtoolu_sim", "name": k, "input": {}}),
                );
            }
        }
        for c in &calls {
            content.push(tool_use(
                c,
                serde_json::from_str(&c.2).unwrap_or(Value::Null),
            ));
        }
        return Json(
            json!({"id": "msg_sim", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop,
            "stop_sequence": null, "usage": with_output(usage, reported)}),
        )
        .into_response();
    }
    let mut events = stream_events(&model, usage, n, &calls, (stop, reported));
    if out.reasoning > 0 {
        thinking_first(&mut events);
    }
    let frames = events
        .iter()
        .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
        .collect();
    event_stream(
        frames,
        state.config.token_delay,
        guard,
        (prompt, billed),
        out.reasoning,
    )
}

/// What a Claude 4 model streams of its thinking: a summary, not the tokens it bills.
const SUMMARY: &str = "Weighing the request.";

/// Puts a thinking block, streamed as its summary, before the answer's blocks (whose indexes
/// move up by one), right after `message_start`.
fn thinking_first(events: &mut Vec<(&'static str, Value)>) {
    for (_, e) in events.iter_mut() {
        if let Some(i) = e["index"].as_u64() {
            e["index"] = json!(i + 1);
        }
    }
    let block = [
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "thinking", "thinking": ""}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "thinking_delta", "thinking": SUMMARY}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "signature_delta", "signature": "sig"}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
    ];
    events.splice(1..1, block);
}

/// The events of a streamed answer: the message begun with its `usage`, `n` text deltas, each
/// call as a `tool_use` block, and the message's end with its stop reason and `reported`
/// output.
fn stream_events(
    model: &str,
    usage: Value,
    n: u64,
    calls: &[(String, String, String)],
    (stop, reported): (&str, u64),
) -> Vec<(&'static str, Value)> {
    let tool_use = |(id, name, _): &(String, String, String), input: Value| json!({"type": "tool_use", "id": id, "name": name, "input": input});
    let mut events: Vec<(&'static str, Value)> = vec![
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_sim",
            "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": with_output(usage, 1)}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
        ),
    ];
    for _ in 0..n {
        events.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": " tok"}}),
        ));
    }
    events.push((
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    ));
    for (k, c) in calls.iter().enumerate() {
        let index = k + 1;
        events.push((
            "content_block_start",
            json!({"type": "content_block_start",
            "index": index, "content_block": tool_use(c, json!({}))}),
        ));
        events.push((
            "content_block_delta",
            json!({"type": "content_block_delta",
            "index": index, "delta": {"type": "input_json_delta", "partial_json": c.2}}),
        ));
        events.push((
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    }
    events.push((
        "message_delta",
        json!({"type": "message_delta",
        "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": reported}}),
    ));
    events.push(("message_stop", json!({"type": "message_stop"})));
    events
}

/// Anthropic's usage object for a prompt of `prompt` tokens, without its output tokens. A request
/// with `cache_control` on any block is simulated as caching its whole prompt (system,
/// messages and tools): written the first time that prompt is seen (for one hour when a
/// `cache_control` says `"ttl": "1h"`, else for five minutes), read from the cache after that;
/// `input_tokens`, the part after the last cache breakpoint, is then 0.
fn cache_usage(state: &SimState, req: &Value, prompt: u64) -> Value {
    let cached = ["system", "messages", "tools"]
        .iter()
        .any(|k| req[k].to_string().contains("\"cache_control\""));
    if !cached {
        return json!({"input_tokens": prompt});
    }
    let key = format!("{}|{}|{}", req["system"], req["messages"], req["tools"]);
    let first = state
        .cached_prompts
        .lock()
        .map(|mut seen| seen.insert(key))
        .unwrap_or(true);
    if !first {
        return json!({"input_tokens": 0, "cache_read_input_tokens": prompt,
            "cache_creation_input_tokens": 0});
    }
    let hour = ["system", "messages", "tools"]
        .iter()
        .any(|k| req[k].to_string().contains("\"ttl\":\"1h\""));
    let (m5, h1) = if hour { (0, prompt) } else { (prompt, 0) };
    json!({"input_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": prompt,
        "cache_creation": {"ephemeral_5m_input_tokens": m5, "ephemeral_1h_input_tokens": h1}})
}

/// `usage` with its `output_tokens` set.
fn with_output(mut usage: Value, output: u64) -> Value {
    usage["output_tokens"] = json!(output);
    usage
}
