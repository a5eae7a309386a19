//! # tollgate-sim
//!
//! A faithful OpenAI-compatible upstream simulator: chat completions (streamed with real SSE
//! chunking and the usage chunk, or not), the Responses API (streamed as typed events, with
//! conversations kept by `previous_response_id`), completions, embeddings, Anthropic's
//! Messages, and models. It counts its
//! input with the real tokenizer, honours `max_tokens`, sleeps as configured, and counts
//! in-flight requests per API key so that tests can check concurrency limits from outside. A
//! request whose connection is dropped before the simulator finished is recorded as cancelled,
//! with the time. Tools that the upstream runs (web search and the like) are called
//! [`SimConfig::tool_calls`] times each unless the request bounds them, each call billed as
//! [`SimConfig::tool_call_input_tokens`] of input. A request that offers function tools gets
//! [`SimConfig::function_calls`] calls to the first of them in its answer, in each API's shape,
//! streamed or not, and the simulator counts the calls it made.
//!
//! This file is over 600 lines: the handlers of the five APIs share the simulator's state and
//! counters, and each of them is short.

mod billing;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{Value, json};
use tollgate_tokens::{Format, TokenCounter};

/// How the simulator behaves.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Wait before the first byte.
    pub latency: Duration,
    /// Wait between streamed tokens.
    pub token_delay: Duration,
    /// Tokens produced when the request does not cap them lower.
    pub output_tokens: u64,
    /// The API key the simulator requires (`None`: any).
    pub api_key: Option<String>,
    /// Calls made to each tool the upstream runs (web search and the like) that a request
    /// enables, within the request's own bound (`max_tool_calls`, Anthropic's `max_uses`): a
    /// model that searches until it is stopped.
    pub tool_calls: u64,
    /// Input tokens billed for what each such call fetches.
    pub tool_call_input_tokens: u64,
    /// Calls to the first function tool a request offers (unless its `tool_choice` is `none`)
    /// that each answer makes: an agent's model that keeps asking for tools.
    pub function_calls: u64,
    /// A model that runs past the cap it is given: it produces `output_tokens` whatever the
    /// request's cap, and is billed for all of them.
    pub ignore_cap: bool,
    /// A usage report that says this many output tokens, whatever was billed (a report lower than
    /// the truth); the stats keep what was billed.
    pub reported_output: Option<u64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            latency: Duration::from_millis(5),
            token_delay: Duration::from_millis(1),
            output_tokens: 16,
            api_key: None,
            tool_calls: 10,
            tool_call_input_tokens: 500,
            function_calls: 0,
            ignore_cap: false,
            reported_output: None,
        }
    }
}

/// Waits `d`, and not at all when `d` is zero: `tokio::time::sleep(Duration::ZERO)` waits
/// for the timer's next tick (about a millisecond), which would cap a benchmark's upstream
/// told to add no time near one request per tick per connection.
pub async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// What the simulator observed.
#[derive(Debug, Default, Clone)]
pub struct SimStats {
    /// Requests received per API key (the Authorization header's value).
    pub requests: HashMap<String, u64>,
    /// In flight now, per key.
    pub in_flight: HashMap<String, u64>,
    /// Most in flight at once, per key.
    pub max_in_flight: HashMap<String, u64>,
    /// Completed requests.
    pub completed: u64,
    /// Requests whose connection was dropped before they completed, with when.
    pub cancelled: Vec<Instant>,
    /// Sum of completion tokens reported in usage.
    pub completion_tokens: u64,
    /// Sum of prompt tokens reported in usage.
    pub prompt_tokens: u64,
    /// The last request body received.
    pub last_body: Option<Value>,
    /// Function calls made in answers (streamed ones counted when their stream begins).
    pub function_calls: u64,
    /// The service tiers requests asked for (`service_tier`), in order, where one was named.
    pub service_tiers: Vec<String>,
}

/// A running simulator.
#[derive(Debug, Clone)]
pub struct Sim {
    /// Where it listens.
    pub addr: SocketAddr,
    state: Arc<SimState>,
}

#[derive(Debug)]
struct SimState {
    config: SimConfig,
    stats: Mutex<SimStats>,
    /// Responses API: each response's context (its input and output tokens), which a request
    /// naming it as `previous_response_id` is billed as input on top of its own.
    contexts: Mutex<HashMap<String, u64>>,
    /// Anthropic: the prompts written to the prompt cache (see [`cache_usage`]).
    cached_prompts: Mutex<std::collections::HashSet<String>>,
}

impl Sim {
    /// Starts a simulator on a free loopback port.
    pub async fn start(config: SimConfig) -> std::io::Result<Self> {
        Self::start_on(
            "127.0.0.1:0".parse().map_err(std::io::Error::other)?,
            config,
        )
        .await
    }

    /// Starts a simulator on `addr`.
    pub async fn start_on(addr: SocketAddr, config: SimConfig) -> std::io::Result<Self> {
        let state = Arc::new(SimState {
            config,
            stats: Mutex::new(SimStats::default()),
            contexts: Mutex::new(HashMap::new()),
            cached_prompts: Mutex::new(std::collections::HashSet::new()),
        });
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let app = router(state.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, state })
    }

    /// `http://ADDR`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A snapshot of what it observed.
    pub fn stats(&self) -> SimStats {
        self.state
            .stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }
}

/// The simulator's routes.
fn router(state: Arc<SimState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .route("/sim/stats", get(stats_json))
        .with_state(state)
}

fn error(status: StatusCode, message: &str, code: &str) -> Response {
    (status, Json(json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": code}}))).into_response()
}

/// Counts a request in flight for its key until dropped; records a cancellation if dropped
/// before `done()`.
struct InFlight {
    state: Arc<SimState>,
    key: String,
    done: bool,
}

impl InFlight {
    fn new(state: &Arc<SimState>, headers: &HeaderMap) -> Self {
        // OpenAI's `Authorization: Bearer`, or Anthropic's `x-api-key`.
        let key = headers
            .get("authorization")
            .or_else(|| headers.get("x-api-key"))
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        if let Ok(mut s) = state.stats.lock() {
            *s.requests.entry(key.clone()).or_default() += 1;
            let n = s.in_flight.entry(key.clone()).or_default();
            *n += 1;
            let n = *n;
            let m = s.max_in_flight.entry(key.clone()).or_default();
            *m = (*m).max(n);
        }
        Self {
            state: state.clone(),
            key,
            done: false,
        }
    }
    fn done(mut self, prompt: u64, completion: u64) {
        self.done = true;
        if let Ok(mut s) = self.state.stats.lock() {
            s.completed += 1;
            s.prompt_tokens += prompt;
            s.completion_tokens += completion;
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut s) = self.state.stats.lock() {
            if let Some(n) = s.in_flight.get_mut(&self.key) {
                *n = n.saturating_sub(1);
            }
            if !self.done {
                s.cancelled.push(Instant::now());
            }
        }
    }
}

fn authorized(state: &SimState, headers: &HeaderMap) -> bool {
    match &state.config.api_key {
        None => true,
        Some(k) => {
            headers.get("authorization").and_then(|v| v.to_str().ok())
                == Some(&format!("Bearer {k}"))
        }
    }
}

async fn chat(State(state): State<Arc<SimState>>, headers: HeaderMap, body: Bytes) -> Response {
    if !authorized(&state, &headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "bad upstream key",
            "invalid_api_key",
        );
    }
    let (req, prompt) = match read_request(&body, Format::ChatCompletions, &state.config) {
        Ok(r) => r,
        Err(e) => return *e,
    };
    if let Ok(mut s) = state.stats.lock() {
        s.last_body = Some(req.clone());
    }
    let model = req["model"].as_str().unwrap_or("").to_owned();
    if model.contains("fail") {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated upstream failure",
            "server_error",
        );
    }
    let cap = req["max_completion_tokens"]
        .as_u64()
        .or(req["max_tokens"].as_u64());
    let calls = function_calls(&state, &req, Format::ChatCompletions);
    let out = billing::output(&state.config, &req, Format::ChatCompletions, cap, &calls);
    let (n, billed) = (out.per_answer, out.billed());
    let reported = out.reported(&state.config);
    let tier = req["service_tier"].as_str().map(str::to_owned);
    let guard = InFlight::new(&state, &headers);
    if let (Some(t), Ok(mut s)) = (&tier, state.stats.lock()) {
        s.service_tiers.push(t.clone());
    }
    pause(state.config.latency).await;
    let id = "chatcmpl-sim";
    let usage = json!({"prompt_tokens": prompt, "completion_tokens": reported,
        "total_tokens": prompt + reported, "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": billing::details(&out)});
    let finish = if calls.is_empty() {
        "length"
    } else {
        "tool_calls"
    };
    if req["stream"].as_bool() != Some(true) {
        // Tokens take time to produce whether streamed or not.
        pause(state.config.token_delay * u32::try_from(n).unwrap_or(u32::MAX)).await;
        guard.done(prompt, billed);
        let content = "tok ".repeat(usize::try_from(n).unwrap_or(0));
        let choices: Vec<Value> = (0..out.answers)
            .map(|i| {
                let mut message = json!({"role": "assistant", "content": content.trim_end()});
                if !calls.is_empty() && i == 0 {
                    message["tool_calls"] = calls
                        .iter()
                        .map(|(id, name, args)| {
                            json!({"id": id,
                        "type": "function", "function": {"name": name, "arguments": args}})
                        })
                        .collect();
                }
                json!({"index": i, "message": message, "finish_reason": finish})
            })
            .collect();
        return Json(
            json!({"id": id, "object": "chat.completion", "created": 0, "model": model,
            "choices": choices, "usage": usage, "service_tier": tier.as_deref().unwrap_or("default")}),
        )
        .into_response();
    }
    let include_usage = req["stream_options"]["include_usage"].as_bool() == Some(true);
    let delay = state.config.token_delay;
    let chunk = move |i: u64, delta: Value, finish: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": i, "delta": delta, "finish_reason": finish}]})
    };
    // Events: role, n content tokens per choice (each with a leading space, as tokens are),
    // the calls, finish, optional usage, [DONE].
    let answers = out.answers;
    let mut events: Vec<String> = (0..answers)
        .map(|i| chunk(i, json!({"role": "assistant", "content": ""}), Value::Null).to_string())
        .collect();
    for _ in 0..n {
        for i in 0..answers {
            events.push(chunk(i, json!({"content": " tok"}), Value::Null).to_string());
        }
    }
    // A call's first chunk names it; its arguments follow in the next.
    for (k, (call, name, args)) in calls.iter().enumerate() {
        events.push(
            chunk(
                0,
                json!({"tool_calls": [{"index": k, "id": call, "type": "function",
            "function": {"name": name, "arguments": ""}}]}),
                Value::Null,
            )
            .to_string(),
        );
        events.push(
            chunk(
                0,
                json!({"tool_calls": [{"index": k,
            "function": {"arguments": args}}]}),
                Value::Null,
            )
            .to_string(),
        );
    }
    for i in 0..answers {
        events.push(chunk(i, json!({}), json!(finish)).to_string());
    }
    if include_usage {
        events.push(json!({"id": id, "object": "chat.completion.chunk", "created": 0, "choices": [], "usage": usage}).to_string());
    }
    events.push("[DONE]".to_owned());
    let frames = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    event_stream(frames, delay, guard, (prompt, billed))
}

/// Sends `frames` (whole server-sent events) one every `delay`, the request counted done with
/// `usage` (prompt, completion) when the last one goes.
fn event_stream(
    frames: Vec<String>,
    delay: Duration,
    guard: InFlight,
    usage: (u64, u64),
) -> Response {
    let frames = Arc::new(frames);
    let total = frames.len();
    let stream = futures_util::stream::unfold((0usize, Some(guard)), move |(i, mut guard)| {
        let frames = frames.clone();
        async move {
            if i >= total {
                return None;
            }
            if i > 0 {
                pause(delay).await;
            }
            if i + 1 == total {
                if let Some(g) = guard.take() {
                    g.done(usage.0, usage.1);
                }
            }
            let bytes = Bytes::from(frames[i].clone());
            Some((Ok::<_, std::io::Error>(bytes), (i + 1, guard)))
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(axum::body::Body::from_stream(stream))
        .unwrap_or_else(|_| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "response",
                "server_error",
            )
        })
}

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
async fn messages(State(state): State<Arc<SimState>>, headers: HeaderMap, body: Bytes) -> Response {
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
    let usage = cache_usage(&state, &req, prompt);
    let guard = InFlight::new(&state, &headers);
    pause(state.config.latency).await;
    if req["stream"].as_bool() != Some(true) {
        pause(state.config.token_delay * u32::try_from(n).unwrap_or(u32::MAX)).await;
        guard.done(prompt, billed);
        let text = "tok ".repeat(usize::try_from(n).unwrap_or(0));
        let mut content = vec![json!({"type": "text", "text": text.trim_end()})];
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
    let frames = events
        .iter()
        .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
        .collect();
    event_stream(frames, state.config.token_delay, guard, (prompt, billed))
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

/// OpenAI's `POST /v1/responses`: `input` counted with the real tokenizer, plus, for a
/// `previous_response_id`, that response's input and output (the upstream keeps the
/// conversation and bills it again; an unknown id is a 404, as upstream); `max_output_tokens`
/// honoured (a response cut by it is `incomplete`); streamed as typed events ending in
/// `response.completed` or `response.incomplete`, which carry the usage.
async fn responses(
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
    let out = billing::output(&state.config, &req, Format::Responses, cap, &made);
    let (n, billed, reported) = (out.per_answer, out.billed(), out.reported(&state.config));
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
        "output_tokens": reported, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + reported});
    let calls: Vec<Value> = made
        .into_iter()
        .map(|(call, name, args)| {
            json!({"type": "function_call", "id": format!("fc_{call}"),
            "call_id": call, "name": name, "arguments": args, "status": "completed"})
        })
        .collect();
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
        return Json(response(status, Value::Array(out), usage)).into_response();
    }
    let opening = response("in_progress", json!([]), Value::Null);
    let mut out = vec![message(&text, "completed")];
    out.extend(calls.iter().cloned());
    let last = json!({"type": format!("response.{status}"),
        "response": response(status, Value::Array(out), usage)});
    let frames = responses_frames(n, &text, &message, &calls, opening, last);
    event_stream(frames, state.config.token_delay, guard, (prompt, billed))
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

/// The request's JSON and its prompt tokens, counted with the real tokenizer; or the 400 to send.
/// The function calls an answer makes: [`SimConfig::function_calls`] calls to the first function
/// tool the request offers, as (call id, name, arguments), counted in the stats.
fn function_calls(state: &SimState, req: &Value, format: Format) -> Vec<(String, String, String)> {
    let tools = req["tools"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let name = tools.iter().find_map(|t| match format {
        Format::ChatCompletions => {
            (t["type"] == "function").then(|| t["function"]["name"].as_str())?
        }
        Format::Responses => (t["type"] == "function").then(|| t["name"].as_str())?,
        // A client tool has an input schema; the server tools Anthropic runs have none.
        _ => t.get("input_schema").and_then(|_| t["name"].as_str()),
    });
    let Some(name) = name.filter(|_| req["tool_choice"] != "none") else {
        return Vec::new();
    };
    let n = state.config.function_calls;
    if let Ok(mut s) = state.stats.lock() {
        s.function_calls += n;
    }
    (0..n)
        .map(|k| {
            (
                format!("call_sim_{k}"),
                name.to_owned(),
                format!("{{\"step\":{k}}}"),
            )
        })
        .collect()
}

/// The Responses API's built-in tools that fetch input during a call, as the upstream knows them.
const FETCHING_TOOLS: &[&str] = &[
    "web_search",
    "web_search_preview",
    "file_search",
    "mcp",
    "code_interpreter",
    "image_generation",
];

/// Input billed for what the tools the upstream runs fetched: [`SimConfig::tool_calls`] calls
/// per such tool, within the request's bound.
fn fetched_input(req: &Value, format: Format, config: &SimConfig) -> u64 {
    let tools = req["tools"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let kind = |t: &Value| t["type"].as_str().unwrap_or("").to_owned();
    let calls = match format {
        Format::Responses => {
            let n = tools
                .iter()
                .filter(|t| FETCHING_TOOLS.contains(&kind(t).as_str()))
                .count() as u64;
            (n * config.tool_calls).min(req["max_tool_calls"].as_u64().unwrap_or(u64::MAX))
        }
        Format::ChatCompletions if !req["web_search_options"].is_null() => config.tool_calls,
        Format::AnthropicMessages => tools
            .iter()
            .filter(|t| kind(t).starts_with("web_search_") || kind(t).starts_with("web_fetch_"))
            .map(|t| {
                config
                    .tool_calls
                    .min(t["max_uses"].as_u64().unwrap_or(u64::MAX))
            })
            .sum(),
        _ => 0,
    };
    calls * config.tool_call_input_tokens
}

fn read_request(
    body: &Bytes,
    format: Format,
    config: &SimConfig,
) -> Result<(Value, u64), Box<Response>> {
    let req = serde_json::from_slice::<Value>(body).map_err(|_| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            "invalid JSON",
            "invalid_json",
        ))
    })?;
    let prompt = TokenCounter::default()
        .count(format, body, None)
        .map(|c| c.input_tokens)
        .unwrap_or(0);
    let fetched = fetched_input(&req, format, config);
    Ok((req, prompt + fetched))
}

async fn completions(
    State(state): State<Arc<SimState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (req, prompt) = match read_request(&body, Format::Completions, &state.config) {
        Ok(r) => r,
        Err(e) => return *e,
    };
    let cap = req["max_tokens"].as_u64();
    let out = billing::output(&state.config, &req, Format::Completions, cap, &[]);
    let (billed, reported) = (out.billed(), out.reported(&state.config));
    let guard = InFlight::new(&state, &headers);
    pause(state.config.latency).await;
    guard.done(prompt, billed);
    // `best_of` answers are generated and billed; `n` of them are returned, for each prompt.
    let n = req["n"].as_u64().unwrap_or(1).max(1);
    let returned = out.answers / n.max(req["best_of"].as_u64().unwrap_or(1)) * n;
    let text = "tok ".repeat(usize::try_from(out.per_answer).unwrap_or(0));
    let choices: Vec<Value> = (0..returned.min(out.answers))
        .map(|i| json!({"index": i, "text": text.trim_end(), "finish_reason": "length"}))
        .collect();
    Json(json!({"id": "cmpl-sim", "object": "text_completion", "model": req["model"],
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": reported, "total_tokens": prompt + reported}}))
    .into_response()
}

async fn embeddings(
    State(state): State<Arc<SimState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (req, prompt) = match read_request(&body, Format::Embeddings, &state.config) {
        Ok(r) => r,
        Err(e) => return *e,
    };
    let guard = InFlight::new(&state, &headers);
    pause(state.config.latency).await;
    guard.done(prompt, 0);
    Json(json!({"object": "list", "model": req["model"],
        "data": [{"object": "embedding", "index": 0, "embedding": [0.0, 0.5, 1.0]}],
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}))
    .into_response()
}

async fn models() -> Response {
    Json(
        json!({"object": "list", "data": [{"id": "gpt-4o", "object": "model", "owned_by": "sim"}]}),
    )
    .into_response()
}

async fn stats_json(State(state): State<Arc<SimState>>) -> Response {
    let s = state.stats.lock().map(|s| s.clone()).unwrap_or_default();
    Json(
        json!({"requests": s.requests, "in_flight": s.in_flight, "max_in_flight": s.max_in_flight,
        "completed": s.completed, "cancelled": s.cancelled.len(),
        "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens}),
    )
    .into_response()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use futures_util::FutureExt;

    // A zero wait completes on its first poll; tokio's sleep of zero does not (it waits for the
    // timer's next tick), which is what capped the benchmarks' upstream.
    #[tokio::test]
    async fn a_zero_wait_does_not_wait_for_the_timer() {
        assert!(super::pause(Duration::ZERO).now_or_never().is_some());
        assert!(tokio::time::sleep(Duration::ZERO).now_or_never().is_none());
        assert!(
            super::pause(Duration::from_millis(1))
                .now_or_never()
                .is_none()
        );
    }
}
