//! OpenAI's Responses API as the simulator serves it.

use super::*;

/// OpenAI's `POST /v1/responses`: `input` counted with the real tokenizer, plus, for a
/// `previous_response_id`, that response's input and output (the upstream keeps the
/// conversation and bills it again; an unknown id is a 404, as upstream); `max_output_tokens`
/// honoured (a response cut by it is `incomplete`); streamed as typed events ending in
/// `response.completed` or `response.incomplete`, which carry the usage.
pub(crate) async fn responses(
    State(state): State<Arc<SimState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !authorized(&state, &headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "bad upstream key",
            "invalid_api_key",
        );
    }
    let (req, own) = match read_request(&body, Format::Responses, &state.config) {
        Ok(r) => r,
        Err(e) => return *e,
    };
    if let Ok(mut s) = state.stats.lock() {
        s.last_body = Some(req.clone());
    }
    let previous = req["previous_response_id"].as_str();
    let earlier = match previous {
        None => 0,
        Some(p) => match state.contexts.lock().ok().and_then(|c| c.get(p).copied()) {
            Some(n) => n,
            None => {
                return (
                    StatusCode::NOT_FOUND,
                    Json(json!({"error": {
                    "message": format!("Previous response with id '{p}' not found."),
                    "type": "invalid_request_error", "param": "previous_response_id",
                    "code": "previous_response_not_found"}})),
                )
                    .into_response();
            }
        },
    };
    let prompt = own + earlier;
    let model = req["model"].as_str().unwrap_or("").to_owned();
    let cap = req["max_output_tokens"].as_u64();
    let made = function_calls(&state, &req, Format::Responses);
    let server =
        crate::tools::responses_items(&crate::count_server_calls(&state, &req, Format::Responses));
    let out = billing::output(&state.config, &req, Format::Responses, cap, &made);
    let (n, billed, reported) = (out.per_answer, out.billed(), out.reported(&state.config));
    let reasoning = out.reasoning;
    let incomplete = cap.is_some_and(|c| n >= c);
    let id = {
        let mut c = match state.contexts.lock() {
            Ok(c) => c,
            Err(p) => p.into_inner(),
        };
        let id = format!("resp_sim_{}", c.len());
        c.insert(id.clone(), prompt + billed);
        id
    };
    let guard = InFlight::new(&state, &headers);
    pause(state.config.latency).await;
    let text = " tok".repeat(usize::try_from(n).unwrap_or(0));
    let message = |text: &str, status: &str| {
        json!({"type": "message", "id": "msg_sim", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    };
    let response = |status: &str, output: Value, usage: Value| {
        json!({"id": id, "object": "response", "created_at": 0, "status": status,
            "error": null,
            "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": req["instructions"], "max_output_tokens": cap, "model": model,
            "output": output, "parallel_tool_calls": true, "previous_response_id": previous,
            "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0,
            "truncation": "disabled", "metadata": {}, "text": {"format": {"type": "text"}},
            "usage": usage})
    };
    let usage = json!({"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": reported, "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + reported});
    let calls: Vec<Value> = made
        .into_iter()
        .map(|(call, name, args)| {
            json!({"type": "function_call", "id": format!("fc_{call}"),
            "call_id": call, "name": name, "arguments": args, "status": "completed"})
        })
        .collect();
    // The calls of tools it ran come first, then the answer and its function calls.
    let with_server = |rest: Vec<Value>| Value::Array(server.iter().cloned().chain(rest).collect());
    let status = if incomplete {
        "incomplete"
    } else {
        "completed"
    };
    if req["stream"].as_bool() != Some(true) {
        pause(state.config.token_delay * u32::try_from(n).unwrap_or(u32::MAX)).await;
        guard.done(prompt, billed);
        let mut out = vec![message(text.trim_start(), "completed")];
        out.extend(calls);
        return Json(response(status, with_server(out), usage)).into_response();
    }
    let opening = response("in_progress", json!([]), Value::Null);
    let mut out = vec![message(&text, "completed")];
    out.extend(calls.iter().cloned());
    let last = json!({"type": format!("response.{status}"),
        "response": response(status, with_server(out), usage)});
    let mut frames = responses_frames(n, &text, &message, &calls, opening, last);
    // Each call of a tool it ran is an item added and done, after the response began.
    let items = server.iter().flat_map(|item| {
        ["added", "done"].map(|e| {
            let event = json!({"type": format!("response.output_item.{e}"), "item": item});
            format!("event: response.output_item.{e}\ndata: {event}\n\n")
        })
    });
    let at = frames.len().min(2);
    frames.splice(at..at, items);
    event_stream(
        frames,
        state.config.token_delay,
        guard,
        (prompt, billed),
        reasoning,
    )
}

/// The Responses API's events of a streamed answer: the response begun (`opening`), its text
/// as `n` deltas of one message (made by `message`), its function calls, and `last`, the event
/// with the whole response.
fn responses_frames(
    n: u64,
    text: &str,
    message: &dyn Fn(&str, &str) -> Value,
    calls: &[Value],
    opening: Value,
    last: Value,
) -> Vec<String> {
    let mut events: Vec<Value> = vec![
        json!({"type": "response.created", "response": opening}),
        json!({"type": "response.in_progress", "response": opening}),
        json!({"type": "response.output_item.added", "output_index": 0,
            "item": {"type": "message", "id": "msg_sim", "status": "in_progress", "role": "assistant", "content": []}}),
        json!({"type": "response.content_part.added", "item_id": "msg_sim", "output_index": 0,
            "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
    ];
    for _ in 0..n {
        events.push(
            json!({"type": "response.output_text.delta", "item_id": "msg_sim",
            "output_index": 0, "content_index": 0, "delta": " tok", "logprobs": []}),
        );
    }
    events.push(
        json!({"type": "response.output_text.done", "item_id": "msg_sim",
        "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
    );
    events.push(
        json!({"type": "response.content_part.done", "item_id": "msg_sim",
        "output_index": 0, "content_index": 0,
        "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}}),
    );
    events.push(
        json!({"type": "response.output_item.done", "output_index": 0,
        "item": message(text, "completed")}),
    );
    // A call's item is added without its arguments, which follow as deltas.
    for (k, c) in calls.iter().enumerate() {
        let mut added = c.clone();
        added["arguments"] = json!("");
        added["status"] = json!("in_progress");
        events.push(
            json!({"type": "response.output_item.added", "output_index": k + 1, "item": added}),
        );
        events.push(json!({"type": "response.function_call_arguments.delta",
            "item_id": c["id"], "output_index": k + 1, "delta": c["arguments"]}));
        events.push(json!({"type": "response.function_call_arguments.done",
            "item_id": c["id"], "output_index": k + 1, "arguments": c["arguments"]}));
        events.push(json!({"type": "response.output_item.done", "output_index": k + 1, "item": c}));
    }
    events.push(last);
    events
        .iter_mut()
        .enumerate()
        .map(|(k, e)| {
            e["sequence_number"] = json!(k);
            format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap_or(""))
        })
        .collect()
}
