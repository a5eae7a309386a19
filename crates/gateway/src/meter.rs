//! The meter step for streams: the upstream's events pass to the client as they come, read on
//! the way for usage ([`SseMeter`]), within bounds (the wait for the next event, the stream's
//! length, an event's size), and the stream's end settles its ticket. Past a bound, the client
//! gets an error event in its API's format, the usage metered so far is charged, and the lease
//! is released.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::time::Instant;
use tollgate_core::Usage;
use tollgate_tokens::Format;

use crate::config::StreamBounds;
use crate::proxy::Shared;
use crate::sse::SseMeter;
use crate::store::Ticket;

/// Where a stream's context is remembered at its end (Responses API): the gateway, the
/// conversation, and for how long.
pub(crate) type Remember = (Shared, Option<String>, Option<Duration>);

/// One upstream stream on its way to the client.
pub(crate) struct MeteredStream {
    pub body: hyper::body::Incoming,
    pub meter: SseMeter,
    pub ticket: Ticket,
    pub remember: Remember,
    pub format: Format,
    /// The counted input, charged when the upstream reports none.
    pub input: u64,
    /// The granted output cap, charged when the upstream's numbers are not counts.
    pub granted: u64,
    pub bounds: StreamBounds,
    pub started: Instant,
    pub last_event: Instant,
}

/// Why a stream was cut off.
#[derive(Debug, Clone, Copy)]
enum Breach {
    Idle,
    TooLong,
    EventTooLarge,
}

impl Breach {
    fn code(self) -> &'static str {
        match self {
            Breach::Idle => "stream_idle_timeout",
            Breach::TooLong => "stream_max_duration",
            Breach::EventTooLarge => "stream_event_too_large",
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
        }
    }
}

/// The error event of a cut-off stream, in the API's own format.
fn error_event(format: Format, code: &str, message: &str) -> Bytes {
    let text = match format {
        Format::AnthropicMessages => format!(
            "event: error\ndata: {}\n\n",
            serde_json::json!({"type": "error", "error": {"type": "api_error", "message": message}})
        ),
        Format::Responses => format!(
            "event: error\ndata: {}\n\n",
            serde_json::json!({"type": "error", "code": code, "message": message, "param": null})
        ),
        _ => format!(
            "data: {}\n\n",
            serde_json::json!({"error": {"message": message, "type": "upstream_error", "code": code, "param": null}})
        ),
    };
    Bytes::from(text)
}

impl MeteredStream {
    /// The next bytes for the client, or `None` once the stream has ended (and settled).
    pub async fn next(mut self) -> Option<(Result<Bytes, std::io::Error>, Option<Self>)> {
        loop {
            let deadline =
                (self.last_event + self.bounds.idle).min(self.started + self.bounds.max_duration);
            let frame = match tokio::time::timeout_at(deadline, self.body.frame()).await {
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
                    }
                    self.ticket.partial = Some(self.usage_so_far());
                    if self.meter.pending() > self.bounds.max_event_bytes {
                        return self.cut_off(Breach::EventTooLarge).await;
                    }
                    if out.is_empty() {
                        continue;
                    }
                    return Some((Ok(out), Some(self)));
                }
                Some(Err(e)) => {
                    // The upstream broke off: charge what was streamed.
                    let partial = self.ticket.partial;
                    let _ = self.ticket.release(partial).await;
                    return Some((Err(std::io::Error::other(e)), None));
                }
                None => return self.end().await,
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
        }
    }

    /// Past a bound: the error event, the usage so far charged, the lease released.
    async fn cut_off(
        self,
        breach: Breach,
    ) -> Option<(Result<Bytes, std::io::Error>, Option<Self>)> {
        crate::telemetry::stream_cut_off(breach.code());
        let usage = if self.meter.bad_usage {
            self.reserved()
        } else {
            self.usage_so_far()
        };
        let event = error_event(self.format, breach.code(), &breach.message(&self.bounds));
        let _ = self.ticket.release(Some(usage)).await;
        Some((Ok(event), None))
    }

    /// What was reserved: charged when the upstream's numbers are not counts.
    fn reserved(&self) -> Usage {
        Usage {
            input_tokens: self.input,
            output_tokens: self.granted,
            ..Usage::default()
        }
    }

    /// The stream's end: the rest forwarded, the usage reported (or counted) settled.
    async fn end(mut self) -> Option<(Result<Bytes, std::io::Error>, Option<Self>)> {
        let rest = self.meter.finish();
        let (p, c, o) = self
            .meter
            .usage
            .unwrap_or_else(|| self.meter.usage_so_far(self.input));
        let mut usage = Usage {
            input_tokens: p,
            cached_input_tokens: c,
            output_tokens: o,
            cache_write_tokens: self.meter.cache_writes.0,
            cache_write_1h_tokens: self.meter.cache_writes.1,
        };
        if self.meter.bad_usage {
            self.ticket.usage_invalid();
            usage = self.reserved();
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
        let _ = self.ticket.settle(usage).await;
        if rest.is_empty() {
            return None;
        }
        Some((Ok(rest), None))
    }
}
