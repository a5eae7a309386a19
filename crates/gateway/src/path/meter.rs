//! The meter step: what the upstream used, read from its answer.
//!
//! A whole answer is read within a size limit and its reported usage checked (or its output
//! counted when it reports none). A stream's events pass to the client as they come, read on
//! the way ([`SseMeter`]), within bounds (the wait for the next event, the stream's length, an
//! event's size); past a bound, the client gets an error event in its API's format, the usage
//! metered so far is charged, and the lease is released. Either way the end settles the ticket.
//!
//! A stream is read by a task of its own, which hands each piece to the client's body. When the
//! client goes away, the task stops handing on but keeps reading, within the same bounds and
//! the cap, until the upstream's usage arrives: the upstream bills what it produced (hidden
//! reasoning included) whether anyone reads it. If the usage never comes, the whole reservation
//! is charged.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::HeaderMap;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde_json::Value;
use tokio::time::Instant;
use tollgate_core::Usage;
use tollgate_tokens::TokenCounter;

use crate::config::{GatewayConfig, StreamBounds};
use crate::dialect::Dialect;
use crate::gateway::Shared;
use crate::respond::{self, ApiError};
use crate::sse::SseMeter;
use crate::ticket::Ticket;

/// Upstream response bodies larger than this are refused (not streamed ones).
pub(crate) const MAX_UPSTREAM_BODY: usize = 64 << 20;

/// What metering an admitted request's answer needs.
pub(crate) struct Answer {
    pub gw: Shared,
    pub cfg: Arc<GatewayConfig>,
    pub dialect: &'static dyn Dialect,
    pub ticket: Ticket,
    /// The response's headers so far (the quotas).
    pub headers: HeaderMap,
    pub stream: bool,
    /// The stream's usage event was asked for by the gateway only (see [`Dialect::set_cap`]).
    pub strip_usage: bool,
    pub model: String,
    pub ttl_ms: u64,
    /// The counted input.
    pub input: u64,
    /// The granted output cap, for the whole request.
    pub granted: u64,
    /// The request's conversation (Responses API), and how long its context is kept.
    pub conversation: Option<String>,
    pub keep_context: Option<Duration>,
    /// The request's idempotency key, ended with its answer.
    pub claim: Option<super::idempotent::Claim>,
}

/// A whole answer: read, its usage settled; the bytes to pass on and the response's headers.
pub(crate) async fn answer(
    a: Answer,
    body: hyper::body::Incoming,
) -> Result<(Bytes, HeaderMap), ApiError> {
    let collected = tokio::time::timeout(
        a.cfg.upstream_timeout,
        Limited::new(body, MAX_UPSTREAM_BODY).collect(),
    )
    .await;
    let bytes = match collected {
        Ok(Ok(c)) => c.to_bytes(),
        _ => {
            let _ = a.ticket.release(None).await;
            return Err(respond::upstream_body());
        }
    };
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let (usage, report) =
        answered_usage(a.dialect, &v, a.input, a.granted, &a.cfg.counter, &a.model);
    let mut ticket = a.ticket;
    if let Some(used) = tools_used(a.dialect, &v) {
        ticket.tools_used(used);
    }
    match report {
        Report::Sound => {}
        Report::Invalid => ticket.usage_invalid(),
        Report::Under(reported) => ticket.usage_underreported(reported),
    }
    if let Some(ttl) = a.keep_context {
        a.gw.remember_context(v["id"].as_str(), a.conversation.as_deref(), usage, ttl)
            .await;
    }
    let _ = ticket.settle(usage).await;
    Ok((bytes, a.headers))
}

/// The fee-carrying calls a non-streamed answer shows, where its format shows them all (the
/// Responses API's output items; Anthropic's blocks and its count of web searches); `None` for
/// chat, whose web search is not shown.
fn tools_used(dialect: &dyn Dialect, v: &Value) -> Option<tollgate_core::Metered> {
    let list = dialect.answer_items(v)?;
    let mut used = tollgate_core::Metered::default();
    for item in list.as_array().into_iter().flatten() {
        crate::upstream_tools::used_by(item, &mut used);
    }
    let mut bad = false;
    let counted = &v["usage"]["server_tool_use"]["web_search_requests"];
    if let Some(n) = crate::sse::usage_number(counted, &mut bad) {
        used.web_searches = used.web_searches.max(n);
    }
    Some(used)
}

/// How an answer's reported usage compares with what the gateway saw pass through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Report {
    /// Reported (or not reported at all) and no lower than the count.
    Sound,
    /// A reported number was not a count: the reservation is charged.
    Invalid,
    /// The reported output, lower than the count: the count is charged.
    Under(u64),
}

/// The usage of a non-streamed answer `v`: what the upstream reported (each number checked, see
/// [`crate::sse::usage_number`]), its output never below the output counted in the answer
/// (every part of it: text, refusals, tool-call arguments); without a report, the counted
/// `input` and that output. When a reported number is not a count, the reservation (`input`
/// and the `granted` cap).
pub(crate) fn answered_usage(
    dialect: &dyn Dialect,
    v: &Value,
    input: u64,
    granted: u64,
    counter: &TokenCounter,
    model: &str,
) -> (Usage, Report) {
    let mut bad = false;
    let reported = dialect.usage(&v["usage"], input, &mut bad);
    // Counted here whatever the upstream reports: no provider reports tool calls as a number.
    let tool_calls = dialect.tool_calls(v);
    if bad {
        // Numbers that are not counts: the gateway cannot know what was used, so it charges
        // what it reserved.
        let reserved = Usage {
            input_tokens: input,
            output_tokens: granted,
            tool_calls,
            ..Usage::default()
        };
        return (reserved, Report::Invalid);
    }
    let counted = dialect
        .output_parts(v)
        .iter()
        .map(|p| counter.count_output(model, p).0)
        .fold(0u64, u64::saturating_add);
    let report = match reported {
        Some(u) if u.output_tokens < counted => Report::Under(u.output_tokens),
        _ => Report::Sound,
    };
    let usage = reported.unwrap_or(Usage {
        input_tokens: input,
        ..Usage::default()
    });
    let usage = Usage {
        output_tokens: usage.output_tokens.max(counted),
        tool_calls,
        ..usage
    };
    (usage, report)
}

/// A stream's body: metered on its way to the client, settled at its end.
pub(crate) fn stream(mut a: Answer, body: hyper::body::Incoming) -> Body {
    let ttl = Duration::from_millis(a.ttl_ms.max(3));
    a.ticket.renew_every(ttl / 3);
    a.ticket.partial = Some(Usage {
        input_tokens: a.input,
        ..Usage::default()
    });
    let now = Instant::now();
    let cut = a.gw.answers_cut();
    let metered = MeteredStream {
        body,
        meter: a
            .dialect
            .meter(&a.model, a.strip_usage)
            .with_counter(a.cfg.counter.clone()),
        ticket: a.ticket,
        remember: (a.gw, a.conversation, a.keep_context),
        dialect: a.dialect,
        input: a.input,
        granted: a.granted,
        held_at: held_at(a.granted),
        bounds: a.cfg.stream,
        started: now,
        last_event: now,
        kept: a.claim.map(|c| (c, Some(Vec::new()))),
        left: false,
        cut,
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(read_to_the_end(metered, tx));
    Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|piece| (piece, rx))
    }))
}

/// Reads `first` to its end, handing each piece to the client through `tx` while it listens,
/// and on when it has gone (see the module's notes).
async fn read_to_the_end(
    first: MeteredStream,
    tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let mut next = Some(first);
    let mut listening = true;
    while let Some(s) = next.take() {
        let Some((piece, rest)) = s.next().await else {
            return;
        };
        next = rest;
        if listening && tx.send(piece).await.is_err() {
            listening = false;
            if let Some(s) = next.as_mut() {
                s.client_left();
            }
        }
    }
}

/// The output, in tokens, past which a stream is ended at its cap `granted`: the cap, plus a
/// tolerance for the tokenizer's differences from the upstream's at the edges of events
/// (a twentieth of the cap, at least 16 tokens).
pub(crate) fn held_at(granted: u64) -> u64 {
    granted.saturating_add((granted / 20).max(16))
}

/// Where a stream's context is remembered at its end (Responses API): the gateway, the
/// conversation, and for how long.
pub(crate) type Remember = (Shared, Option<String>, Option<Duration>);

/// One upstream stream on its way to the client.
pub(crate) struct MeteredStream {
    pub body: hyper::body::Incoming,
    pub meter: SseMeter,
    pub ticket: Ticket,
    pub remember: Remember,
    pub dialect: &'static dyn Dialect,
    /// The counted input, charged when the upstream reports none.
    pub input: u64,
    /// The granted output cap, charged when the upstream's numbers are not counts.
    pub granted: u64,
    /// The output past which the stream is ended ([`held_at`]).
    pub held_at: u64,
    pub bounds: StreamBounds,
    pub started: Instant,
    pub last_event: Instant,
    /// The request's idempotency key, and what was sent so far to keep for its replay (`None`
    /// once past the bound).
    pub kept: Option<(super::idempotent::Claim, Option<Vec<u8>>)>,
    /// The client went away: what the upstream bills can only come from its usage, and without
    /// it the reservation is charged.
    pub left: bool,
    /// Becomes true when a shutdown's drain is over: the reading is cut off.
    pub cut: tokio::sync::watch::Receiver<bool>,
}

/// Why a stream was cut off.
#[derive(Debug, Clone, Copy)]
enum Breach {
    Idle,
    TooLong,
    EventTooLarge,
    /// The gateway shuts down and its drain is over.
    Shutdown,
}

impl Breach {
    fn code(self) -> &'static str {
        match self {
            Breach::Idle => "stream_idle_timeout",
            Breach::TooLong => "stream_max_duration",
            Breach::EventTooLarge => "stream_event_too_large",
            Breach::Shutdown => "shutting_down",
        }
    }

    fn message(self, bounds: &StreamBounds) -> String {
        match self {
            Breach::Idle => format!(
                "The upstream sent no event for {} s; the stream was ended.",
                bounds.idle.as_secs_f64()
            ),
            Breach::TooLong => format!(
                "The stream passed its longest duration, {} s, and was ended.",
                bounds.max_duration.as_secs_f64()
            ),
            Breach::EventTooLarge => format!(
                "The upstream sent an event larger than {} bytes; the stream was ended.",
                bounds.max_event_bytes
            ),
            Breach::Shutdown => "The gateway is shutting down; the stream was ended.".to_owned(),
        }
    }
}

impl MeteredStream {
    /// The next bytes for the client, or `None` once the stream has ended (and settled).
    pub async fn next(mut self) -> Option<(Result<Bytes, std::io::Error>, Option<Self>)> {
        loop {
            let deadline =
                (self.last_event + self.bounds.idle).min(self.started + self.bounds.max_duration);
            let next = tokio::select! {
                f = tokio::time::timeout_at(deadline, self.body.frame()) => Some(f),
                _ = self.cut.wait_for(|cut| *cut) => None,
            };
            let Some(next) = next else {
                return self.cut_off(Breach::Shutdown).await;
            };
            let frame = match next {
                Ok(f) => f,
                Err(_) => {
                    let breach = if Instant::now() >= self.started + self.bounds.max_duration {
                        Breach::TooLong
                    } else {
                        Breach::Idle
                    };
                    return self.cut_off(breach).await;
                }
            };
            match frame {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    let seen = self.meter.events;
                    let out = self.meter.feed(&data);
                    if self.meter.events > seen {
                        self.last_event = Instant::now();
                        self.ticket.first_chunk();
                    }
                    if !self.left {
                        self.ticket.partial = Some(self.usage_so_far());
                    }
                    if self.meter.pending() > self.bounds.max_event_bytes {
                        return self.cut_off(Breach::EventTooLarge).await;
                    }
                    // The answer is whole: settled, and kept for a retry, before its last
                    // bytes go out (a client may hang up as soon as it has them).
                    if self.meter.done {
                        return self.end(out).await;
                    }
                    // Past the cap: ended here, whatever the upstream meant to send. The running
                    // count may overstate at event edges, so the exact count decides.
                    if self.meter.past(self.held_at) {
                        return self.hold_cap(out).await;
                    }
                    if out.is_empty() {
                        continue;
                    }
                    self.keep(&out);
                    return Some((Ok(out), Some(self)));
                }
                Some(Err(e)) => {
                    // The upstream broke off: charge what was streamed (the reservation when
                    // the client had left).
                    let usage = self.without_usage();
                    let _ = self.ticket.release(Some(usage)).await;
                    return Some((Err(std::io::Error::other(e)), None));
                }
                None => return self.end(Bytes::new()).await,
            }
        }
    }

    /// The client went away: reading goes on.
    fn client_left(&mut self) {
        self.left = true;
        self.ticket.client_left();
        // Dropped from here on (its task cancelled), nothing says what was produced.
        self.ticket.partial = Some(self.reserved());
    }

    /// What is charged when no usage will come: after the client left, the reservation (the
    /// upstream may have produced output nobody saw, reasoning included); before, what was
    /// streamed.
    fn without_usage(&self) -> Usage {
        if self.left {
            self.log_reserved("it ended without the upstream's usage");
        }
        if self.left || self.meter.bad_usage {
            self.reserved()
        } else {
            self.usage_so_far()
        }
    }

    /// The one line for a stream charged its reservation because nothing says what the
    /// upstream produced.
    fn log_reserved(&self, why: &str) {
        tracing::warn!(
            request_id = %self.ticket.id(),
            reserved = self.input.saturating_add(self.granted),
            "a stream was charged its whole reservation: {why}"
        );
    }

    /// Adds what was sent to what is kept for a replay, within its bound.
    fn keep(&mut self, sent: &[u8]) {
        if let Some((claim, Some(buf))) = &mut self.kept {
            if buf.len() + sent.len() > claim.max_bytes() {
                self.kept = self.kept.take().map(|(c, _)| (c, None));
            } else {
                buf.extend_from_slice(sent);
            }
        }
    }

    fn usage_so_far(&self) -> Usage {
        let (i, c, o) = self.meter.usage_so_far(self.input);
        Usage {
            input_tokens: i,
            cached_input_tokens: c,
            output_tokens: o,
            cache_write_tokens: self.meter.cache_writes.0,
            cache_write_1h_tokens: self.meter.cache_writes.1,
            tool_calls: self.meter.tool_calls,
            fees: 0,
        }
    }

    /// Past a bound: the error event, the usage so far charged, the lease released.
    async fn cut_off(
        self,
        breach: Breach,
    ) -> Option<(Result<Bytes, std::io::Error>, Option<Self>)> {
        crate::telemetry::stream_cut_off(breach.code());
        // Cut off by a shutdown, the upstream is left mid-answer: what it bills is not known.
        let usage = match breach {
            Breach::Shutdown => {
                self.log_reserved("the gateway shut down while it was read");
                self.reserved()
            }
            _ => self.without_usage(),
        };
        let event = self
            .dialect
            .stream_error(breach.code(), &breach.message(&self.bounds));
        let _ = self.ticket.release(Some(usage)).await;
        Some((Ok(event), None))
    }

    /// What was reserved: charged when the upstream's numbers are not counts.
    fn reserved(&self) -> Usage {
        Usage {
            input_tokens: self.input,
            output_tokens: self.granted,
            tool_calls: self.meter.tool_calls,
            ..Usage::default()
        }
    }

    /// The stream's end: `sent` and the rest forwarded, the usage reported (its output never
    /// below what was counted passing through) settled.
    async fn end(mut self, sent: Bytes) -> Option<(Result<Bytes, std::io::Error>, Option<Self>)> {
        let rest = if self.meter.done {
            Bytes::new()
        } else {
            self.meter.finish()
        };
        let rest = [sent, rest].concat();
        let counted = self.meter.exact_output();
        let reported = self.meter.usage;
        if reported.is_none() && self.left {
            // Ended without a report after its client left: nothing says what was produced.
            let usage = self.without_usage();
            self.settle_and_keep(usage).await;
            return None;
        }
        let (p, c, o) = reported.unwrap_or_else(|| self.meter.usage_so_far(self.input));
        let mut usage = Usage {
            input_tokens: p,
            cached_input_tokens: c,
            output_tokens: o.max(counted),
            cache_write_tokens: self.meter.cache_writes.0,
            cache_write_1h_tokens: self.meter.cache_writes.1,
            tool_calls: self.meter.tool_calls,
            fees: 0,
        };
        if let Some(used) = self.meter.tools_seen().filter(|_| reported.is_some()) {
            self.ticket.tools_used(used);
        }
        if self.meter.bad_usage {
            self.ticket.usage_invalid();
            usage = self.reserved();
        } else if let Some((_, _, o)) = reported.filter(|r| r.2 < counted) {
            self.ticket.usage_underreported(o);
        }
        let (gw, conversation, keep) = &self.remember;
        if let Some(ttl) = keep {
            gw.remember_context(
                self.meter.response_id.as_deref(),
                conversation.as_deref(),
                usage,
                *ttl,
            )
            .await;
        }
        self.keep(&rest);
        self.settle_and_keep(usage).await;
        if rest.is_empty() {
            return None;
        }
        Some((Ok(Bytes::from(rest)), None))
    }

    /// Past the cap: `sent` forwarded, then the stream ended in its own format as cut by its cap,
    /// the upstream let go of (its body dropped), the output counted on the way settled, and
    /// the answer kept for a retry.
    async fn hold_cap(
        mut self,
        sent: Bytes,
    ) -> Option<(Result<Bytes, std::io::Error>, Option<Self>)> {
        crate::telemetry::output_cap_held();
        // What was forwarded, as counted on the way (the upstream's report never came).
        let usage = self.usage_so_far();
        let end = self.meter.cap_end((
            usage.input_tokens,
            usage.cached_input_tokens,
            usage.output_tokens,
        ));
        let out = Bytes::from([sent, end].concat());
        self.keep(&out);
        self.settle_and_keep(usage).await;
        Some((Ok(out), None))
    }

    /// The ticket settled with `usage`, then the whole answer kept for a retry with the same
    /// idempotency key.
    async fn settle_and_keep(self, usage: Usage) {
        let _ = self.ticket.settle(usage).await;
        if let Some((claim, kept)) = self.kept {
            claim
                .answered(200, "text/event-stream", kept.as_deref())
                .await;
        }
    }
}
