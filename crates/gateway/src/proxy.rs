//! The request path: identity → body limit → parse and count (bounded) → one admission →
//! forward with the output cap set → settle from the upstream's usage → release.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde_json::Value;
use tollgate_core::record::DecisionRecord;
use tollgate_core::{
    Decision, Dimension, Identity, Reason, RequestFacts, Store, StoreError, Usage, plan,
};
use tollgate_tokens::{Format, TokenCounter};

use crate::config::{GatewayConfig, KeyConfig, hash_key};
use crate::contexts::{Contexts, carried, conversation_id, hidden_input};
use crate::records::RecordSink;
use crate::respond::{self, ApiError};
use crate::sse::SseMeter;
use crate::store::{AnyStore, Ticket};

/// The `anthropic-version` sent upstream when the client sent none.
const ANTHROPIC_VERSION: &str = "2023-06-01";
/// Upstream response bodies larger than this are refused (not streamed ones).
const MAX_UPSTREAM_BODY: usize = 64 << 20;
/// Headers of an admitted request's response: up to eight quota headers, `content-type`,
/// `cache-control` for a stream, and `x-request-id`.
const RESPONSE_HEADERS: usize = 11;

/// The gateway's shared state.
#[derive(Debug)]
pub struct Gateway {
    /// Configuration; replaced whole on reload (requests keep the snapshot they started with).
    config: std::sync::RwLock<Arc<GatewayConfig>>,
    /// Where the configuration was read from, for reloads.
    config_path: Option<std::path::PathBuf>,
    /// The store.
    pub store: AnyStore,
    counter: TokenCounter,
    /// 48 random bits per gateway process: ids stay unique across the instances that share a
    /// store, and `tg-` + 12 hex digits + `-` + the sequence number in hex fits in the 23 bytes
    /// the memory store keeps inline (up to 268 million requests per process; beyond, an id
    /// is one allocation longer, nothing else changes).
    nonce: u64,
    seq: AtomicU64,
    queue: QueueState,
    records: Option<RecordSink>,
    /// Set when a shutdown begins (`/readyz` then answers 503).
    draining: std::sync::atomic::AtomicBool,
    /// Responses API: the context of each response served, for its follow-ups.
    contexts: Contexts,
}

#[derive(Debug, Default)]
struct QueueState {
    waiting: Mutex<HashMap<String, usize>>,
    total: AtomicU64,
}

/// A place in the bounded queue; leaving it (also by being dropped) frees it.
struct QueueSlot<'a> {
    q: &'a QueueState,
    key: String,
}

impl Drop for QueueSlot<'_> {
    fn drop(&mut self) {
        crate::telemetry::queue_waiting(-1.0);
        self.q.total.fetch_sub(1, Ordering::SeqCst);
        if let Ok(mut w) = self.q.waiting.lock() {
            if let Some(n) = w.get_mut(&self.key) {
                *n -= 1;
                if *n == 0 {
                    w.remove(&self.key);
                }
            }
        }
    }
}

impl Gateway {
    /// A gateway over `store`.
    pub fn new(config: GatewayConfig, store: AnyStore) -> Self {
        // Load the vocabularies now, off the request path: the first request would otherwise
        // wait for them (about 50 ms in a release build).
        std::thread::spawn(TokenCounter::warm_up);
        let nonce = {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one((std::process::id(), Instant::now())) & 0xffff_ffff_ffff
        };
        Self {
            config: std::sync::RwLock::new(Arc::new(config)),
            config_path: None,
            store,
            counter: TokenCounter::default(),
            nonce,
            seq: AtomicU64::new(0),
            queue: QueueState::default(),
            records: None,
            draining: std::sync::atomic::AtomicBool::new(false),
            contexts: Contexts::default(),
        }
    }

    /// Whether a shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Marks the gateway as shutting down.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Writes decision records to `sink`.
    #[must_use]
    pub fn with_records(mut self, sink: RecordSink) -> Self {
        self.records = Some(sink);
        self
    }

    /// The configuration in force now.
    pub fn config(&self) -> Arc<GatewayConfig> {
        match self.config.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Remembers the file the configuration came from, for [`Gateway::reload`].
    #[must_use]
    pub fn with_config_path(mut self, path: std::path::PathBuf) -> Self {
        self.config_path = Some(path);
        self
    }

    /// Reads the configuration file again and swaps it in atomically. A file that does not
    /// validate is refused with the field at fault, and the old configuration stays. The
    /// listener, store and record settings are fixed at start-up and are not changed.
    pub fn reload(&self) -> Result<Arc<GatewayConfig>, String> {
        let path = self
            .config_path
            .as_ref()
            .ok_or("this gateway was not started from a file")?;
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        let new = Arc::new(GatewayConfig::from_toml(&text).map_err(|e| e.to_string())?);
        match self.config.write() {
            Ok(mut c) => *c = new.clone(),
            Err(poisoned) => *poisoned.into_inner() = new.clone(),
        }
        Ok(new)
    }

    /// Remembers what a Responses API follow-up of this response (and of its conversation)
    /// carries as input: the response's input and output. In the Redis store, for every
    /// instance, for `ttl`; a failure to write it only makes a follow-up count as unknown
    /// context.
    pub(crate) async fn remember_context(
        &self,
        response: Option<&str>,
        conversation: Option<&str>,
        u: Usage,
        ttl: Duration,
    ) {
        let carried = u.input_tokens.saturating_add(u.output_tokens);
        let ids = [response, conversation].into_iter().flatten();
        for id in ids.filter(|id| crate::contexts::keepable(id)) {
            match &self.store {
                AnyStore::Redis(r) => {
                    let _ = r.put_note(&format!("ctx:{id}"), carried, ttl).await;
                }
                AnyStore::Memory(_) => self.contexts.remember(id, carried),
            }
        }
    }

    /// What a follow-up of response or conversation `id` carries, if it is known here.
    async fn context_of(&self, id: &str) -> Option<u64> {
        if !crate::contexts::keepable(id) {
            // Not an id this gateway kept: unknown, and not looked up.
            return None;
        }
        match &self.store {
            // An unreachable store makes it unknown: counted as the configured worst case.
            AnyStore::Redis(r) => r.note(&format!("ctx:{id}")).await.ok().flatten(),
            AnyStore::Memory(_) => self.contexts.get(id),
        }
    }

    fn next_id(&self) -> String {
        format!(
            "tg-{:012x}-{:x}",
            self.nonce,
            self.seq.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn enter_queue(&self, key: &str) -> Option<QueueSlot<'_>> {
        let q = self.config().queue?;
        let mut w = self.queue.waiting.lock().ok()?;
        let n = w.entry(key.to_owned()).or_default();
        if *n >= q.per_key || self.queue.total.load(Ordering::SeqCst) >= q.global as u64 {
            if *n == 0 {
                w.remove(key);
            }
            return None;
        }
        *n += 1;
        self.queue.total.fetch_add(1, Ordering::SeqCst);
        crate::telemetry::queue_waiting(1.0);
        Some(QueueSlot {
            q: &self.queue,
            key: key.to_owned(),
        })
    }
}

/// Shared gateway state for handlers.
pub type Shared = Arc<Gateway>;

/// `POST /v1/chat/completions`, `/v1/responses`, `/v1/completions`, `/v1/embeddings`, and
/// Anthropic's `/v1/messages` (whose errors take Anthropic's format).
pub async fn handle(
    State(gw): State<Shared>,
    format: Format,
    path: &'static str,
    req: Request<Body>,
) -> Response {
    let id = gw.next_id();
    let mut resp = match admit_and_forward(&gw, format, path, &id, req).await {
        Ok(r) => r,
        Err(e) if format == Format::AnthropicMessages => e.into_anthropic_response(),
        Err(e) => e.into_response(),
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

fn authenticate<'a>(
    cfg: &'a GatewayConfig,
    headers: &HeaderMap,
) -> Result<&'a KeyConfig, ApiError> {
    let unauthorized = respond::unauthorized;
    // OpenAI's clients send `Authorization: Bearer`, Anthropic's `x-api-key`.
    let value = headers
        .get("authorization")
        .or_else(|| headers.get("x-api-key"))
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            unauthorized("Missing API key: send Authorization: Bearer <key> or x-api-key: <key>.")
        })?;
    let key = value.strip_prefix("Bearer ").unwrap_or(value).trim();
    let hash = hash_key(key);
    cfg.keys
        .get(hash.trim_start_matches("sha256:"))
        .ok_or_else(|| unauthorized("Incorrect API key provided."))
}

fn client_ip(cfg: &GatewayConfig, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
    if !cfg.trusted_proxies.contains(&peer) {
        return peer;
    }
    // The rightmost address that is not a trusted proxy is the client.
    let forwarded: Vec<IpAddr> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    forwarded
        .into_iter()
        .rev()
        .find(|ip| !cfg.trusted_proxies.contains(ip))
        .unwrap_or(peer)
}

async fn read_body(
    cfg: &GatewayConfig,
    body: Body,
    headers: &HeaderMap,
) -> Result<Bytes, ApiError> {
    let max = cfg.max_body_bytes;
    let too_large = || respond::body_too_large(max);
    let declared = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    match tokio::time::timeout(cfg.body_timeout, Limited::new(body, max).collect()).await {
        Err(_) => Err(respond::body_timeout()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Ok(Err(e)) => Err(ApiError::invalid(
            "invalid_body",
            format!("Could not read the request body: {e}"),
        )),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

async fn admit_and_forward(
    gw: &Shared,
    format: Format,
    path: &'static str,
    id: &str,
    req: Request<Body>,
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let cfg = gw.config();
    let key = authenticate(&cfg, &parts.headers)?;
    if format == Format::AnthropicMessages {
        allowed_betas(&cfg, &parts.headers)?;
    }
    let peer = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]));
    let body = read_body(&cfg, body, &parts.headers).await?;
    let policy = &cfg.policy;
    let ip = client_ip(&cfg, peer, &parts.headers).to_string();
    let count_limit = count_limit(policy, key, &ip);
    let count = gw
        .counter
        .count(format, &body, count_limit)
        .map_err(|e| match e.field() {
            Some(f) => ApiError::invalid("invalid_value", e.to_string()).param(f),
            None => ApiError::invalid("invalid_json", e.to_string()),
        })?;
    let Some(&upstream_idx) = cfg.models.get(&count.model) else {
        return Err(respond::model_not_found(&shown(&count.model)));
    };
    if key
        .models
        .as_ref()
        .is_some_and(|m| !m.contains(&count.model))
    {
        return Err(respond::model_not_allowed(&count.model));
    }
    let cap_field = if format == Format::Responses {
        "max_output_tokens"
    } else {
        "max_tokens"
    };
    if let Some(m) = count
        .max_output_tokens
        .filter(|m| *m > cfg.max_output_tokens)
    {
        return Err(ApiError::invalid(
            "invalid_value",
            format!(
                "{cap_field} {m} is above the largest accepted, {}.",
                cfg.max_output_tokens
            ),
        )
        .param(cap_field));
    }
    let mut json: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid("invalid_json", e.to_string()))?;
    // Responses API: context the upstream keeps is input too (see `contexts`).
    let mut input = count.input_tokens;
    let mut kept_context = 0;
    if format == Format::Responses {
        if json.get("background").and_then(Value::as_bool) == Some(true) {
            // Its usage arrives after the call returns, where no settlement can see it.
            return Err(ApiError::invalid(
                "unsupported_parameter",
                "background responses are not served through this gateway: their usage is \
                 known only after the call returns, so they could not be settled.",
            )
            .param("background"));
        }
        let (ids, references) = carried(&json);
        let mut known = Vec::with_capacity(ids.len());
        for id in ids {
            let k = gw.context_of(id).await;
            crate::telemetry::followup_context(k.is_some());
            known.push(k);
        }
        kept_context = hidden_input(known, references, cfg.unknown_context_tokens);
        input = input.saturating_add(kept_context);
    }
    // What tools the upstream runs will fetch is input too; their calls are bounded in the body.
    let tool_input = crate::upstream_tools::bound(format, &mut json, cfg.upstream_tools);
    input = input.saturating_add(tool_input);
    // So is the content of files and documents named by URL or id.
    let remote_input = u64::from(count.remote_items).saturating_mul(cfg.remote_tokens_per_item);
    input = input.saturating_add(remote_input);
    let user = end_user(key, &json, &parts.headers)?;
    let mut identity = Identity::default()
        .with(Dimension::Tenant, key.tenant.clone())
        .with(Dimension::Key, key.key_id.clone())
        .with(Dimension::Ip, ip)
        .with(Dimension::Model, count.model.clone());
    if let Some(u) = user {
        identity = identity.with(Dimension::User, u);
    }
    // Several choices (`n`, or `best_of` for completions) multiply the output: the cap and the
    // estimate are for the whole request, and each choice gets its share.
    let choices = match format {
        Format::Embeddings | Format::AnthropicMessages | Format::Responses => 1,
        _ => choice_count(&json, "n")?.max(choice_count(&json, "best_of")?),
    };
    if choices > 128 {
        return Err(ApiError::invalid(
            "invalid_value",
            format!("n = {choices} is above the largest accepted, 128."),
        )
        .param("n"));
    }
    let facts = RequestFacts {
        request_id: id.to_owned(),
        identity,
        input_tokens: input,
        max_output_tokens: if format == Format::Embeddings {
            Some(0)
        } else {
            count.max_output_tokens.map(|m| m.saturating_mul(choices))
        },
        // Anthropic bills what a request writes to its prompt cache above the input price: a
        // request that marks any block may write all of its input.
        cache_write_tokens: if format == Format::AnthropicMessages && marks_cache(&json) {
            input
        } else {
            0
        },
    };
    let facts_cache_writes = facts.cache_write_tokens;
    let mut p = plan(policy, &facts).map_err(|e| respond::internal("unpriced_model", e))?;
    for r in &key.exempt {
        match r {
            Reason::RequestRateLimit => p.rate.clear(),
            Reason::ConcurrencyLimit => p.concurrency.clear(),
            Reason::BudgetLimit => p.budget.clear(),
            _ => {
                if p.token_verdict.as_ref().is_some_and(|d| d.reason == *r) {
                    p.token_verdict = None;
                }
            }
        }
    }
    let decided = Instant::now();
    // Kill switches of the configuration file hold whatever the store holds or forgets.
    let configured_kill = p.kill_targets.iter().find_map(|t| {
        cfg.kills
            .iter()
            .find(|(target, _)| target == t)
            .map(|(target, reason)| {
                Decision::Killed(tollgate_core::decision::Killed {
                    target: target.clone(),
                    reason: reason.clone(),
                })
            })
    });
    let admission = match configured_kill {
        Some(k) => k,
        None => admit(gw, &mut p, &key.key_id).await?,
    };
    let decision_us = u64::try_from(decided.elapsed().as_micros()).unwrap_or(u64::MAX);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let admitted = match admission {
        Decision::Admit(a) => a,
        refused => {
            if let Some(sink) = &gw.records {
                let mut r = DecisionRecord::new(now_ms, &p, &refused);
                r.decision_us = Some(decision_us);
                sink.emit(r);
            }
            let mut e = match &refused {
                Decision::Deny(d) => respond::deny(d),
                Decision::Killed(k) => respond::killed(k),
                Decision::Admit(_) => unreachable_admit(),
            };
            if let Decision::Deny(d) = &refused {
                explain_allowances(&mut e, d.reason, [kept_context, tool_input, remote_input]);
                // A money budget reserved marked input at the dearest cache-write price.
                let money = p
                    .budget
                    .iter()
                    .any(|b| b.unit == tollgate_core::Unit::MicroUsd && b.scope == d.scope);
                if d.reason == Reason::BudgetLimit && money && facts_cache_writes > 0 {
                    e.message = format!(
                        "{} The reservation prices the {facts_cache_writes} input tokens that \
                         may be written to the prompt cache at twice the input price, the \
                         one-hour write price.",
                        e.message
                    );
                }
            }
            if format == Format::Responses {
                // This API's names for the fields at fault.
                e.param = e.param.map(|p| match p.as_str() {
                    "messages" => "input".to_owned(),
                    "max_tokens" => "max_output_tokens".to_owned(),
                    _ => p,
                });
            }
            return Err(e);
        }
    };
    let mut ticket = if admitted.fail_open {
        Ticket::detached(gw.store.clone(), id.to_owned())
    } else {
        Ticket::new(gw.store.clone(), id.to_owned())
    };
    ticket.track(
        p.estimate_tokens(),
        p.price,
        Duration::from_millis(p.ttl_ms),
    );
    if let Some(sink) = &gw.records {
        let mut r = DecisionRecord::new(now_ms, &p, &Decision::Admit(admitted.clone()));
        r.decision_us = Some(decision_us);
        ticket.record_to(r, sink.clone());
    }

    // Forward with the admitted output cap: the upstream never sees an unchecked one.
    let per_choice = admitted.max_output_tokens / choices;
    if format != Format::Embeddings && per_choice == 0 {
        let _ = ticket.release(Some(Usage::default())).await;
        return Err(ApiError::invalid(
            "invalid_value",
            format!(
                "The output cap {} leaves no tokens for each of {choices} choices.",
                admitted.max_output_tokens
            ),
        )
        .param("n"));
    }
    let stream = json.get("stream").and_then(Value::as_bool) == Some(true);
    // A Responses API response that the upstream stores (the default) can be followed up:
    // what that follow-up carries is kept for this long.
    let keep_context = (format == Format::Responses
        && json.get("store").and_then(Value::as_bool) != Some(false))
    .then_some(cfg.context_ttl);
    let mut strip_usage = false;
    if let Some(obj) = json.as_object_mut() {
        match format {
            Format::ChatCompletions => {
                let field = if obj.contains_key("max_completion_tokens") {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                };
                obj.insert(field.into(), per_choice.into());
                if stream {
                    let so = obj
                        .entry("stream_options")
                        .or_insert_with(|| Value::Object(Default::default()));
                    strip_usage = so.get("include_usage").and_then(Value::as_bool) != Some(true);
                    if let Some(so) = so.as_object_mut() {
                        so.insert("include_usage".into(), Value::Bool(true));
                    }
                }
            }
            Format::Completions | Format::AnthropicMessages => {
                // Anthropic requires it: a request without one gets the admitted default.
                obj.insert("max_tokens".into(), per_choice.into());
            }
            Format::Responses => {
                obj.insert("max_output_tokens".into(), per_choice.into());
            }
            Format::Embeddings => {}
        }
    }
    let upstream = &cfg.upstreams[upstream_idx];
    let out_body = serde_json::to_vec(&json).map_err(|e| respond::internal("internal", e))?;
    let mut builder = Request::post(format!("{}{path}", upstream.base_url))
        .header("content-type", "application/json")
        .header(
            "accept",
            if stream {
                "text/event-stream"
            } else {
                "application/json"
            },
        )
        .header("x-request-id", id);
    if format == Format::AnthropicMessages {
        if let Some(k) = &upstream.api_key {
            builder = builder.header("x-api-key", k.as_str());
        }
        // The client's API version and beta features go through; the version is required.
        let version = parts.headers.get("anthropic-version").cloned();
        builder = builder.header(
            "anthropic-version",
            version.unwrap_or(HeaderValue::from_static(ANTHROPIC_VERSION)),
        );
        // Only the betas the configuration allows (checked at intake) go through.
        for beta in parts.headers.get_all("anthropic-beta") {
            builder = builder.header("anthropic-beta", beta.clone());
        }
    } else if let Some(k) = &upstream.api_key {
        builder = builder.header("authorization", format!("Bearer {k}"));
    }
    let up_req = builder
        .body(Full::new(Bytes::from(out_body)))
        .map_err(|e| respond::internal("internal", e))?;

    // The response's own header map, made at its final size: grown from empty, it was
    // reallocated as it filled, then merged into the response's map, which grew in turn.
    let mut headers = HeaderMap::with_capacity(RESPONSE_HEADERS);
    respond::admitted_headers(&mut headers, &p, &admitted);
    // From here the request runs in a task of its own, so that a client who leaves does not
    // cut it off half way: a non-streamed request goes on until the upstream answers (within
    // `upstream_timeout`) and settles its true usage, its lease held while the upstream may
    // still be working. A stream is cancelled when its client leaves (the response body that
    // holds it is dropped), its lease held `cancel_grace` longer. Before this point (intake,
    // count, admission, the queue) a client that leaves ends the request at once.
    let forward = Forward {
        gw: gw.clone(),
        cfg: cfg.clone(),
        upstream_idx,
        up_req,
        ticket,
        headers,
        format,
        stream,
        strip_usage,
        model: count.model.clone(),
        ttl_ms: p.ttl_ms,
        input,
        granted: admitted.max_output_tokens,
        json,
        keep_context,
    };
    match tokio::spawn(forward_and_settle(forward)).await {
        Ok(r) => r,
        Err(_) => Err(respond::internal(
            "internal",
            "The request's task ended unexpectedly.",
        )),
    }
}

/// What the forward step needs of an admitted request.
struct Forward {
    gw: Shared,
    cfg: Arc<GatewayConfig>,
    upstream_idx: usize,
    up_req: Request<Full<Bytes>>,
    ticket: Ticket,
    headers: HeaderMap,
    format: Format,
    stream: bool,
    strip_usage: bool,
    model: String,
    ttl_ms: u64,
    input: u64,
    granted: u64,
    json: Value,
    keep_context: Option<Duration>,
}

/// Forward → meter → settle: calls the upstream, passes its answer on, and ends the ticket.
async fn forward_and_settle(f: Forward) -> Result<Response, ApiError> {
    let Forward {
        gw,
        cfg,
        upstream_idx,
        up_req,
        mut ticket,
        mut headers,
        format,
        stream,
        strip_usage,
        model,
        ttl_ms,
        input,
        granted,
        json,
        keep_context,
    } = f;
    let upstream = &cfg.upstreams[upstream_idx];
    if stream {
        // Dropped with its client: the upstream notices the closed connection only when it
        // next writes, so the lease is held a little longer.
        let ttl = Duration::from_millis(ttl_ms.max(3));
        ticket.release_after(cfg.cancel_grace.min(ttl));
    }
    let sent = Instant::now();
    let up = match tokio::time::timeout(cfg.upstream_timeout, upstream.client.request(up_req)).await
    {
        Ok(Ok(r)) => {
            crate::telemetry::upstream(r.status().as_u16(), sent.elapsed().as_secs_f64());
            r
        }
        Ok(Err(e)) => {
            let why = crate::upstream::error_chain(&e);
            return Err(upstream_failed(ticket, Some(why)).await);
        }
        Err(_) => return Err(upstream_failed(ticket, None).await),
    };
    let status = up.status();
    ticket.upstream_status(status.as_u16());
    let content_type = up.headers().get("content-type").cloned();
    if !status.is_success() {
        let body = Limited::new(up.into_body(), MAX_UPSTREAM_BODY)
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let _ = ticket.release(Some(Usage::default())).await;
        return Ok(relay(status, content_type, body, headers));
    }

    if stream {
        let ttl = Duration::from_millis(ttl_ms.max(3));
        ticket.renew_every(ttl / 3);
        ticket.partial = Some(Usage {
            input_tokens: input,
            cached_input_tokens: 0,
            output_tokens: 0,
            ..Usage::default()
        });
        let meter = match format {
            Format::AnthropicMessages => SseMeter::anthropic(&model),
            Format::Responses => SseMeter::responses(&model),
            _ => SseMeter::new(&model, strip_usage),
        };
        // Where and for how long the stream's context is remembered at its end.
        let remember = (
            gw.clone(),
            conversation_id(&json).map(str::to_owned),
            keep_context,
        );
        let now = tokio::time::Instant::now();
        let metered = crate::meter::MeteredStream {
            body: up.into_body(),
            meter,
            ticket,
            remember,
            format,
            input,
            granted,
            bounds: cfg.stream,
            started: now,
            last_event: now,
        };
        let stream =
            futures_util::stream::unfold(Some(metered), |s| async move { s?.next().await });
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(with_headers(status, headers, Body::from_stream(stream)));
    }

    let collected = tokio::time::timeout(
        cfg.upstream_timeout,
        Limited::new(up.into_body(), MAX_UPSTREAM_BODY).collect(),
    )
    .await;
    let bytes = match collected {
        Ok(Ok(c)) => c.to_bytes(),
        _ => {
            let _ = ticket.release(None).await;
            return Err(respond::upstream_body());
        }
    };
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let (usage, invalid) = answered_usage(format, &v, input, granted, &cfg.counter, &model);
    if invalid {
        ticket.usage_invalid();
    }
    if let Some(ttl) = keep_context {
        gw.remember_context(v["id"].as_str(), conversation_id(&json), usage, ttl)
            .await;
    }
    let _ = ticket.settle(usage).await;
    Ok(relay(status, content_type, bytes, headers))
}

/// Ends the ticket of a request whose upstream failed: unreachable (`why`, nothing charged: it
/// never reached the model) or silent past the timeout (charged what the policy says: the
/// upstream may have done the work).
async fn upstream_failed(ticket: Ticket, unreachable: Option<String>) -> ApiError {
    match unreachable {
        Some(why) => {
            crate::telemetry::upstream_failed("unreachable");
            let _ = ticket.release(Some(Usage::default())).await;
            respond::upstream_unreachable(&why)
        }
        None => {
            crate::telemetry::upstream_failed("timeout");
            let _ = ticket.release(None).await;
            respond::upstream_timeout()
        }
    }
}

/// The usage of a non-streamed answer `v`: what the upstream reported (each number checked, see
/// [`crate::sse::usage_number`]), or, when it reported none, the counted `input` and the output
/// counted from the answer's text. When a reported number is not a count, the reservation
/// (`input` and the `granted` cap) and `true`.
fn answered_usage(
    format: Format,
    v: &Value,
    input: u64,
    granted: u64,
    counter: &TokenCounter,
    model: &str,
) -> (Usage, bool) {
    let u = &v["usage"];
    // What the upstream reported as (input, cached input, output).
    let plain = |(input_tokens, cached_input_tokens, output_tokens)| Usage {
        input_tokens,
        cached_input_tokens,
        output_tokens,
        ..Usage::default()
    };
    // What the upstream reported, with Anthropic's prompt-cache writes.
    let mut bad = false;
    let reported = match format {
        Format::AnthropicMessages => crate::sse::anthropic_usage(u, &mut bad).map(|(i, c)| {
            let (w5, w1h) = crate::sse::anthropic_cache_writes(u, &mut bad);
            let out = crate::sse::usage_number(&u["output_tokens"], &mut bad).unwrap_or(0);
            Usage {
                cache_write_tokens: w5,
                cache_write_1h_tokens: w1h,
                ..plain((i, c, out))
            }
        }),
        Format::Responses => crate::sse::responses_usage(u, &mut bad).map(plain),
        _ => crate::sse::chat_usage(u, input, &mut bad).map(plain),
    };
    let reported = if bad {
        // Numbers that are not counts: the gateway cannot know what was used, so it charges
        // what it reserved.
        Some(Usage {
            input_tokens: input,
            output_tokens: granted,
            ..Usage::default()
        })
    } else {
        reported
    };
    let usage = match reported {
        Some(usage) => usage,
        None => {
            // No usage reported: count the output ourselves.
            let text = match format {
                Format::AnthropicMessages => crate::sse::anthropic_output_text(&v["content"]),
                Format::Responses => crate::sse::responses_output_text(&v["output"]),
                _ => v["choices"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c["message"]["content"].as_str().or(c["text"].as_str()))
                    .collect(),
            };
            Usage {
                input_tokens: input,
                cached_input_tokens: 0,
                output_tokens: counter.count_text(model, &text, None).0,
                ..Usage::default()
            }
        }
    };
    (usage, bad)
}

/// The longest end-user id accepted, in bytes (OpenAI's own bound on `user`).
pub const MAX_USER_BYTES: usize = 256;

/// A client-chosen value as shown in an error message: at most 64 characters.
fn shown(v: &str) -> String {
    let mut s: String = v.chars().take(64).collect();
    if s.len() < v.len() {
        s.push('…');
    }
    s
}

/// How far counting must go. It may stop once past the largest input or total limit among the
/// rules this request may fall under (past it, each of those is exceeded and the first in order
/// is reported), but not when one of them has a budget, which reserves the whole count. Rules
/// another tenant, key or address is matched by do not count; a rule whose match depends on
/// what the body says (model, end user) is taken as applying.
fn count_limit(policy: &tollgate_core::Policy, key: &KeyConfig, ip: &str) -> Option<u64> {
    let known = |d: Dimension| match d {
        Dimension::Tenant => Some(key.tenant.as_str()),
        Dimension::Key => Some(key.key_id.as_str()),
        Dimension::Ip => Some(ip),
        Dimension::User if !key.allow_user => key.user.as_deref().or(Some("")),
        Dimension::User | Dimension::Model => None,
    };
    let mut limit = None;
    for rule in &policy.scopes {
        let may_apply = rule
            .matches
            .iter()
            .all(|(d, v)| known(*d).is_none_or(|k| k == v));
        if !may_apply {
            continue;
        }
        if rule.budget.is_some() {
            return None;
        }
        if let Some(l) = rule.input_tokens.or(rule.total_tokens) {
            limit = Some(limit.unwrap_or(0).max(l.get()));
        }
    }
    limit
}

/// The end user a request names (`user` in the body, else `x-tollgate-user`) when its key
/// allows that, else the key's own; at most [`MAX_USER_BYTES`], wherever it is given.
fn end_user(
    key: &KeyConfig,
    json: &Value,
    headers: &HeaderMap,
) -> Result<Option<String>, ApiError> {
    let body = match json.get("user") {
        None | Some(Value::Null) => None,
        Some(Value::String(u)) => Some(u.as_str()),
        Some(_) => {
            return Err(ApiError::invalid("invalid_type", "user must be a string.").param("user"));
        }
    };
    let header = match headers.get("x-tollgate-user") {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| {
            ApiError::invalid("invalid_value", "x-tollgate-user must be visible ASCII.")
                .param("user")
        })?),
    };
    for u in [body, header].into_iter().flatten() {
        if u.len() > MAX_USER_BYTES {
            return Err(ApiError::invalid(
                "invalid_value",
                format!(
                    "user is {} bytes long; at most {MAX_USER_BYTES} are accepted.",
                    u.len()
                ),
            )
            .param("user"));
        }
    }
    Ok(if key.allow_user {
        body.or(header)
            .map(str::to_owned)
            .or_else(|| key.user.clone())
    } else {
        key.user.clone()
    })
}

/// `n` or `best_of`: absent or null is one; otherwise a positive integer.
fn choice_count(json: &Value, field: &str) -> Result<u64, ApiError> {
    match json.get(field) {
        None | Some(Value::Null) => Ok(1),
        Some(v) => v.as_u64().filter(|n| *n >= 1).ok_or_else(|| {
            ApiError::invalid(
                "invalid_value",
                format!("{field} must be a positive integer."),
            )
            .param(field)
        }),
    }
}

/// Every `anthropic-beta` value must be one the configuration allows: a beta may switch on
/// input the gateway never sees (the MCP connector's tool lists and results, for one).
fn allowed_betas(cfg: &GatewayConfig, headers: &HeaderMap) -> Result<(), ApiError> {
    for v in headers.get_all("anthropic-beta") {
        let text = v.to_str().unwrap_or("\u{fffd}");
        for beta in text.split(',').map(str::trim).filter(|b| !b.is_empty()) {
            if !cfg.anthropic_betas.iter().any(|a| a == beta) {
                return Err(ApiError::invalid(
                    "unsupported_beta",
                    format!(
                        "The anthropic-beta value {:?} is not allowed by this gateway.",
                        shown(beta)
                    ),
                )
                .param("anthropic-beta"));
            }
        }
    }
    Ok(())
}

/// Whether an Anthropic request marks anything for its prompt cache, where Anthropic reads a
/// `cache_control`: on the request itself (automatic caching), on a tool, on a system block, on
/// a message's content block, or on a block inside one (a tool result's, a search result's). A
/// key of that name anywhere else, such as a property in a tool's input schema or in a tool
/// call's arguments, marks nothing. Walked without recursion: blocks may nest deeply.
fn marks_cache(json: &Value) -> bool {
    fn list(v: Option<&Value>) -> impl Iterator<Item = &Value> {
        v.and_then(Value::as_array).into_iter().flatten()
    }
    let marked = |v: &Value| v.get("cache_control").is_some_and(|c| !c.is_null());
    if marked(json) || list(json.get("tools")).any(marked) || list(json.get("system")).any(marked) {
        return true;
    }
    let mut blocks: Vec<&Value> = list(json.get("messages"))
        .flat_map(|m| list(m.get("content")))
        .collect();
    while let Some(b) = blocks.pop() {
        if marked(b) {
            return true;
        }
        blocks.extend(list(b.get("content")));
    }
    false
}

/// The upstream's answer passed on, with the gateway's headers added.
fn relay(
    status: StatusCode,
    content_type: Option<HeaderValue>,
    body: Bytes,
    mut headers: HeaderMap,
) -> Response {
    if let Some(ct) = content_type {
        headers.insert(CONTENT_TYPE, ct);
    }
    with_headers(status, headers, Body::from(body))
}

/// A response whose header map is `headers` itself, not a copy of it merged into another.
fn with_headers(status: StatusCode, headers: HeaderMap, body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

/// One admission; a request that meets a full concurrency scope may wait in the bounded queue
/// (its attempt was counted once: retries skip the rate checks).
async fn admit(
    gw: &Gateway,
    p: &mut tollgate_core::Plan,
    key_id: &str,
) -> Result<Decision, ApiError> {
    let first = timed_admit(gw, p).await?;
    let deny = match first {
        Decision::Deny(d) => d,
        other => return Ok(other),
    };
    let Some(q) = gw
        .config()
        .queue
        .filter(|_| deny.reason == Reason::ConcurrencyLimit)
    else {
        return Ok(Decision::Deny(deny));
    };
    let Some(_slot) = gw.enter_queue(key_id) else {
        return Ok(Decision::Deny(deny));
    };
    p.rate.clear();
    let entered = Instant::now();
    let deadline = entered + q.max_wait;
    let mut wait = Duration::from_millis(5);
    let mut last = deny;
    while Instant::now() + wait <= deadline {
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(50));
        match timed_admit(gw, p).await? {
            Decision::Deny(d) if d.reason == Reason::ConcurrencyLimit => last = d,
            other => {
                crate::telemetry::queue_wait(
                    entered.elapsed().as_secs_f64(),
                    matches!(other, Decision::Admit(_)),
                );
                return Ok(other);
            }
        }
    }
    crate::telemetry::queue_wait(entered.elapsed().as_secs_f64(), false);
    Ok(Decision::Deny(last))
}

async fn timed_admit(gw: &Gateway, p: &tollgate_core::Plan) -> Result<Decision, ApiError> {
    let t = Instant::now();
    // The store may apply an admission whose answer never reaches this request: the call timed
    // out, or the client left while it was under way (this future is then dropped). Its leases
    // and reservation are given back by id rather than held until they expire.
    let unanswered = Unanswered(Some((&gw.store, &p.request_id)));
    let r = gw.store.admit(p).await;
    crate::telemetry::store_call("admit", t.elapsed().as_secs_f64(), r.is_ok());
    if !matches!(r, Err(StoreError::Unavailable(_))) {
        unanswered.answered();
    }
    let d = match r {
        Ok(d) => d,
        Err(StoreError::Unavailable(_)) if p.token_verdict.is_some() => {
            // Token limits need no store: refuse as usual.
            Decision::Deny(p.token_verdict.clone().ok_or_else(unreachable_admit)?)
        }
        Err(StoreError::Unavailable(_)) if p.fail_open => {
            crate::telemetry::fail_open();
            Decision::Admit(tollgate_core::Admitted {
                max_output_tokens: p.max_output_tokens,
                expires_at: 0,
                quotas: Vec::new(),
                fail_open: true,
            })
        }
        Err(e) => return Err(store_error(e)),
    };
    match &d {
        Decision::Admit(_) => crate::telemetry::decision("admit", ""),
        Decision::Deny(x) => crate::telemetry::decision(x.reason.code(), x.scope.rule()),
        Decision::Killed(_) => crate::telemetry::decision("kill_switch", ""),
    }
    Ok(d)
}

/// An admission under way; dropped before it is answered, it releases its request by id.
struct Unanswered<'a>(Option<(&'a AnyStore, &'a str)>);

impl Unanswered<'_> {
    fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some((store, id)) = self.0.take() {
            crate::store::release_unanswered(store, id, UNANSWERED_RELEASE_WINDOW);
        }
    }
}

/// How long the release of an unanswered admission is retried: an admission still in flight in
/// the store when the call timed out has been applied (or dropped) well within it.
const UNANSWERED_RELEASE_WINDOW: Duration = Duration::from_secs(30);

fn unreachable_admit() -> ApiError {
    respond::internal("internal", "inconsistent decision")
}

fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::Unavailable(_) => respond::store_unavailable(),
        StoreError::StateLost => {
            crate::telemetry::store_state_lost();
            respond::store_state_lost()
        }
        other => respond::internal("store_error", other),
    }
}

/// `GET /v1/models`: the models this key may use.
pub async fn models(State(gw): State<Shared>, req: Request<Body>) -> Response {
    let cfg = gw.config();
    let key = match authenticate(&cfg, req.headers()) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    let data: Vec<Value> = cfg
        .models
        .iter()
        .filter(|(m, _)| key.models.as_ref().is_none_or(|ms| ms.contains(m)))
        .map(|(m, u)| serde_json::json!({"id": m, "object": "model", "owned_by": cfg.upstreams[*u].name}))
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

/// `GET /metrics`: Prometheus text format. Budget figures are the last refresh's (see
/// [`crate::telemetry::spawn_budget_refresh`]): a scrape never calls the store.
pub async fn metrics(State(gw): State<Shared>) -> Response {
    crate::telemetry::scrape_gauges(gw.records.as_ref().map_or(0, RecordSink::dropped));
    match crate::telemetry::handle() {
        Some(h) => ([("content-type", "text/plain; version=0.0.4")], h.render()).into_response(),
        None => respond::internal("metrics_unavailable", "No metrics recorder.").into_response(),
    }
}

/// Says, in a refusal by a control that counts input, how much of it the body does not hold: a
/// client that sent a few tokens would not otherwise see why it passed the limit.
/// `allowances` are, in order, the earlier context the upstream keeps, what the tools it runs
/// may fetch, and the files and documents named by URL or id.
fn explain_allowances(e: &mut ApiError, reason: Reason, allowances: [u64; 3]) {
    let counts_input = matches!(
        reason,
        Reason::InputTokenLimit | Reason::TotalTokenLimit | Reason::BudgetLimit
    );
    const WHAT: [&str; 3] = [
        "for the earlier context the upstream keeps",
        "for what the tools the upstream runs may fetch",
        "for the files and documents named by URL or id, which the upstream fetches",
    ];
    let parts: Vec<String> = allowances
        .iter()
        .zip(WHAT)
        .filter(|(n, _)| **n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
    if !counts_input || parts.is_empty() {
        return;
    }
    e.message = format!(
        "{} The input counted includes {}.",
        e.message,
        parts.join(" and ")
    );
}

#[cfg(test)]
mod tests {
    use super::marks_cache;
    use serde_json::json;

    #[test]
    fn cache_marks_are_found_where_anthropic_reads_them() {
        let mark = json!({"type": "ephemeral"});
        let marked = [
            json!({"cache_control": mark, "messages": []}),
            json!({"tools": [{"name": "a"}, {"name": "b", "cache_control": mark}]}),
            json!({"system": [{"type": "text", "text": "s", "cache_control": mark}]}),
            json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "text", "text": "b", "cache_control": mark},
            ]}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": "t", "content": [{"type": "search_result", "content": [
                {"type": "text", "text": "r", "cache_control": mark},
            ]}]}]}]}),
        ];
        for body in marked {
            assert!(marks_cache(&body), "{body}");
        }
    }

    #[test]
    fn a_key_named_cache_control_elsewhere_marks_nothing() {
        let mark = json!({"type": "ephemeral"});
        let unmarked = [
            // A tool whose input has a property of that name.
            json!({"tools": [{"name": "t", "input_schema": {"type": "object",
                "properties": {"cache_control": {"type": "string"}}}}]}),
            // A tool call's arguments, and a document's metadata.
            json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use",
                "id": "t", "name": "t", "input": {"cache_control": mark}}]}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "document",
                "source": {"type": "text", "data": "d", "cache_control": mark}}]}]}),
            // Text that only mentions it, and a null marker.
            json!({"system": "cache_control", "messages": [{"role": "user",
                "content": "{\"cache_control\": 1}"}]}),
            json!({"cache_control": null, "system": [{"type": "text", "text": "s",
                "cache_control": null}]}),
        ];
        for body in unmarked {
            assert!(!marks_cache(&body), "{body}");
        }
    }
}
