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

mod anthropic;
mod billing;
pub mod limits;
mod media;
mod responses;
mod tools;

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
use tollgate_tokens::Format;
use tools::{fetched_input, function_calls};

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
    /// Input tokens billed for what each such call fetches (a file search: its results, each
    /// a whole chunk of `file_search_chunk_tokens`).
    pub tool_call_input_tokens: u64,
    /// The tokens of one file-search result (the vector store's chunk size).
    pub file_search_chunk_tokens: u64,
    /// Calls to the first function tool a request offers (unless its `tool_choice` is `none`)
    /// that each answer makes: an agent's model that keeps asking for tools.
    pub function_calls: u64,
    /// A model that runs past the cap it is given: it produces `output_tokens` whatever the
    /// request's cap, and is billed for all of them.
    pub ignore_cap: bool,
    /// A usage report that says this many output tokens, whatever was billed (a report lower than
    /// the truth); the stats keep what was billed.
    pub reported_output: Option<u64>,
    /// The provider's own rate of chat requests, and of tokens, per window ([`limits`]).
    pub rate: Option<limits::Rate>,
    /// Hidden output a reasoning model produces before its answer, billed as output and never
    /// streamed (OpenAI's reasoning tokens; Anthropic's thinking when a request enables it,
    /// within its `budget_tokens`, streamed only as a short summary); it counts against the cap.
    pub reasoning_tokens: u64,
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
            file_search_chunk_tokens: 800,
            function_calls: 0,
            ignore_cap: false,
            reported_output: None,
            rate: None,
            reasoning_tokens: 0,
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
    /// Requests answered 429 by the provider's own rate, unserved.
    pub rate_limited: u64,
    /// Calls of the tools the upstream runs, by kind (`web_search`, `file_search`,
    /// `code_interpreter`...), each billed its fee by a provider.
    pub server_tool_calls: HashMap<String, u64>,
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
    window: limits::Window,
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
            window: Mutex::new((None, None)),
        });
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let app = router(state.clone());
        tokio::spawn(async move {
            // Each event of a stream goes out as written, as a provider's server sends it (with
            // Nagle's algorithm a client that delays its acknowledgements waits 40 ms a chunk).
            use axum::serve::ListenerExt as _;
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
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
        .route(
            "/v1/chat/completions",
            post(chat).layer(axum::middleware::from_fn_with_state(
                state.clone(),
                limits::layer,
            )),
        )
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route(
            "/v1/messages",
            post(anthropic::messages).layer(axum::middleware::from_fn_with_state(
                state.clone(),
                limits::layer,
            )),
        )
        .route("/v1/responses", post(responses::responses))
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
    /// What is billed if the request is cancelled now (prompt, output produced so far): a
    /// provider bills the tokens it produced before the client went away.
    produced: (u64, u64),
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
            produced: (0, 0),
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
                s.prompt_tokens += self.produced.0;
                s.completion_tokens += self.produced.1;
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
    count_server_calls(&state, &req, Format::ChatCompletions);
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
    event_stream(frames, delay, guard, (prompt, billed), out.reasoning)
}

/// Sends `frames` (whole server-sent events) one every `delay`, the request counted done with
/// `usage` (prompt, completion) when the last one goes. Cancelled before that, it is billed its
/// prompt, the hidden output (`hidden`: reasoning, produced before the first frame) and a
/// token for each frame sent since.
fn event_stream(
    frames: Vec<String>,
    delay: Duration,
    mut guard: InFlight,
    usage: (u64, u64),
    hidden: u64,
) -> Response {
    guard.produced = (usage.0, hidden.min(usage.1));
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
            } else if let Some(g) = guard.as_mut() {
                g.produced.1 = (g.produced.1 + 1).min(usage.1);
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

/// The request's JSON and its prompt tokens, counted with the real tokenizer; or the 400 to send.
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
    let (text_only, media) = media::split(&req, format);
    let counter = billing::counter(req["model"].as_str().unwrap_or(""));
    let counted = if media > 0 {
        counter.count(
            format,
            &serde_json::to_vec(&text_only).unwrap_or_default(),
            None,
        )
    } else {
        counter.count(format, body, None)
    };
    let prompt = counted.map(|c| c.input_tokens).unwrap_or(0) + media;
    let fetched = fetched_input(&req, format, config);
    Ok((req, prompt + fetched))
}

/// Counts a request's calls of tools the upstream runs in the stats, by kind.
pub(crate) fn count_server_calls(
    state: &SimState,
    req: &Value,
    format: Format,
) -> Vec<(String, u64, u64)> {
    let calls = tools::server_calls(req, format, &state.config);
    if let Ok(mut s) = state.stats.lock() {
        for (kind, n, _) in &calls {
            *s.server_tool_calls.entry(kind.clone()).or_default() += n;
        }
    }
    calls
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
