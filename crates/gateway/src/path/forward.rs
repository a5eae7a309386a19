//! The forward step: the granted output cap written into the body (the upstream never sees an
//! unchecked one), the upstream request made with its dialect's headers, and the call, whose
//! answer goes to [`super::meter`] and whose ticket ends in [`super::settle`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde_json::Value;
use tollgate_core::Usage;

use super::Admission;
use super::count::Counted;
use super::intake::Intake;
use super::meter::{self, Answer, MAX_UPSTREAM_BODY};
use crate::config::GatewayConfig;
use crate::contexts::conversation_id;
use crate::dialect::Dialect;
use crate::gateway::Shared;
use crate::respond::{self, ApiError};
use crate::ticket::Ticket;

/// Headers of an admitted request's response: up to eight quota headers, `content-type`,
/// `cache-control` for a stream, and `x-request-id`.
const RESPONSE_HEADERS: usize = 11;

/// What the forward step needs of an admitted request: the upstream request, and what its
/// answer will need.
pub(crate) struct Forward {
    /// Index of the upstream in the configuration.
    pub upstream: usize,
    pub request: Request<Full<Bytes>>,
    pub answer: Answer,
}

/// The upstream request of an admitted one, and what its answer will need.
pub(crate) async fn prepare(
    gw: &Shared,
    cfg: &Arc<GatewayConfig>,
    dialect: &'static dyn Dialect,
    intake: &Intake<'_>,
    counted: Counted,
    admission: Admission,
) -> Result<Forward, ApiError> {
    let Admission {
        plan: p,
        granted: admitted,
        ticket,
    } = admission;
    let (p, id) = (&p, p.request_id.as_str());
    let Counted {
        mut json,
        model,
        upstream,
        choices,
        predicted,
        facts,
        ..
    } = counted;
    // A prediction's share of the grant is billed output, not room for the answer.
    let per_choice = admitted.max_output_tokens.saturating_sub(predicted) / choices;
    if dialect.has_output() && per_choice == 0 {
        let _ = ticket.release(Some(Usage::default())).await;
        return Err(respond::no_tokens_per_choice(
            admitted.max_output_tokens,
            choices,
        ));
    }
    let stream = json.get("stream").and_then(Value::as_bool) == Some(true);
    // A response that the upstream stores can be followed up: what that follow-up carries is
    // kept for this long.
    let keep_context =
        (dialect.keeps_context() && dialect.stores_response(&json)).then_some(cfg.context_ttl);
    let strip_usage = json
        .as_object_mut()
        .is_some_and(|body| dialect.set_cap(body, per_choice, stream));
    let up = &cfg.upstreams[upstream];
    let out_body = serde_json::to_vec(&json).map_err(|e| respond::internal("internal", e))?;
    let accept = if stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    let builder = Request::post(format!("{}{}", up.base_url, dialect.path()))
        .header("content-type", "application/json")
        .header("accept", accept)
        .header("x-request-id", id);
    let request = dialect
        .upstream_headers(builder, up, &intake.headers)
        .body(Full::new(Bytes::from(out_body)))
        .map_err(|e| respond::internal("internal", e))?;
    // The response's own header map, made at its final size: grown from empty, it was
    // reallocated as it filled, then merged into the response's map, which grew in turn.
    let mut headers = HeaderMap::with_capacity(RESPONSE_HEADERS);
    respond::admitted_headers(&mut headers, p, &admitted);
    let answer = Answer {
        gw: gw.clone(),
        cfg: cfg.clone(),
        dialect,
        ticket,
        headers,
        stream,
        strip_usage,
        model,
        ttl_ms: p.ttl_ms,
        input: facts.input_tokens,
        granted: admitted.max_output_tokens,
        conversation: conversation_id(&json).map(str::to_owned),
        keep_context,
        claim: None,
    };
    Ok(Forward {
        upstream,
        request,
        answer,
    })
}

/// Forward → meter → settle: calls the upstream, passes its answer on, and ends the ticket.
pub(crate) async fn forward_and_settle(f: Forward) -> Result<Response, ApiError> {
    let Forward {
        upstream,
        request,
        answer: mut f,
    } = f;
    let cfg = f.cfg.clone();
    let upstream = &cfg.upstreams[upstream];
    if f.stream {
        // Dropped with its client: the upstream notices the closed connection only when it
        // next writes, so the lease is held a little longer.
        let ttl = Duration::from_millis(f.ttl_ms.max(3));
        f.ticket.release_after(cfg.cancel_grace.min(ttl));
    }
    let sent = Instant::now();
    let up =
        match tokio::time::timeout(cfg.upstream_timeout, upstream.client.request(request)).await {
            Ok(Ok(r)) => {
                crate::telemetry::upstream(r.status().as_u16(), sent.elapsed().as_secs_f64());
                r
            }
            Ok(Err(e)) => {
                let why = crate::upstream::error_chain(&e);
                return Err(upstream_failed(f.ticket, Some(why)).await);
            }
            Err(_) => return Err(upstream_failed(f.ticket, None).await),
        };
    let status = up.status();
    f.ticket.upstream_status(status.as_u16());
    // The provider's own limit, as its answer tells it: held on every instance until it
    // resets, or until a later answer shows room.
    let now = std::time::SystemTime::now();
    if let Some(h) = crate::provider::hold(status, up.headers(), now) {
        crate::provider::hold_model(&f.gw.store, &f.model, h);
    } else if crate::provider::room(status, up.headers(), now) {
        crate::provider::lift(&f.gw.store, &f.model);
    }
    if !status.is_success() {
        let content_type = up.headers().get("content-type").cloned();
        let body = Limited::new(up.into_body(), MAX_UPSTREAM_BODY)
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let _ = f.ticket.release(Some(Usage::default())).await;
        return Ok(relay(status, content_type, body, f.headers));
    }
    if f.stream {
        let mut headers = std::mem::take(&mut f.headers);
        let body = meter::stream(f, up.into_body());
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(with_headers(status, headers, body));
    }
    let content_type = up.headers().get("content-type").cloned();
    let claim = f.claim.take();
    let (bytes, headers) = meter::answer(f, up.into_body()).await?;
    if let Some(c) = claim {
        let kept = (bytes.len() <= c.max_bytes()).then_some(&bytes[..]);
        let ct = content_type.as_ref().and_then(|v| v.to_str().ok());
        c.answered(status.as_u16(), ct.unwrap_or("application/json"), kept)
            .await;
    }
    Ok(relay(status, content_type, bytes, headers))
}

/// Ends the ticket of a request whose upstream failed: unreachable (`why`, nothing charged: it
/// never reached the model) or silent past the timeout (charged what the policy says: the
/// upstream may have done the work).
async fn upstream_failed(ticket: Ticket, unreachable: Option<String>) -> ApiError {
    let id = ticket.id().to_owned();
    match unreachable {
        Some(why) => {
            tracing::warn!(request_id = %id, cause = %why, "the upstream could not be reached (502, nothing charged)");
            crate::telemetry::upstream_failed("unreachable");
            let _ = ticket.release(Some(Usage::default())).await;
            respond::upstream_unreachable(&why)
        }
        None => {
            tracing::warn!(request_id = %id, "the upstream did not answer within upstream_timeout (504, the policy's abandoned charge)");
            crate::telemetry::upstream_failed("timeout");
            let _ = ticket.release(None).await;
            respond::upstream_timeout()
        }
    }
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
