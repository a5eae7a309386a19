//! `/v1/reservations`: budgets for code that calls the provider itself (an edge function with
//! its own provider key). The caller sends the request body it will send; the gateway counts
//! and admits it exactly as the proxy would (the same controls, scopes, kill switches, records,
//! metrics and books, and one budget with proxied requests), and answers with the body to send,
//! its output cap written in. After the call the caller settles with the provider's usage.
//!
//! A reservation is held by the shared store itself, never against an instance's slices, so
//! any instance may renew, settle or release it; the instance that made it also writes its
//! decision record and spend-ledger entry. A reservation never settled is charged as the policy
//! charges an expired request (`expired_reservation_charge`, in full by default) when its lease
//! ends. Its id names the key that made it and 128 random bits: only that key may end it.

mod kept;

use axum::Json;
use axum::body::Body;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tollgate_core::{Ending, Finish, Renewal, Store, StoreError, Usage};

use crate::config::KeyConfig;
use crate::dialect::{ALL, Dialect};
use crate::gateway::Shared;
use crate::path::intake::{self, Intake};
use crate::path::meter::{Report, answered_usage};
use crate::reserved::{Held, MAX_OPEN};
use crate::respond::{self, ApiError};

/// `POST /v1/reservations`: the body the caller will send, or, when it cannot send it, the
/// model, input tokens and output cap it states.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewReservation {
    /// The API path the call goes to, as the proxy serves it: `/v1/chat/completions`,
    /// `/v1/responses`, `/v1/messages`, `/v1/completions` or `/v1/embeddings`.
    endpoint: String,
    /// The request body the caller will send.
    body: Option<Value>,
    /// Stated instead of a body: the model,
    model: Option<String>,
    /// the input tokens, counted by the caller,
    input_tokens: Option<u64>,
    /// and the output cap it will send.
    max_output_tokens: Option<u64>,
}

/// What a reservation is for: a body, or stated counts.
enum Asked {
    Body(Value),
    Stated(String, u64, u64),
}

impl NewReservation {
    fn asked(self) -> Result<Asked, ApiError> {
        match (
            self.body,
            self.model,
            self.input_tokens,
            self.max_output_tokens,
        ) {
            (Some(b), None, None, None) => Ok(Asked::Body(b)),
            (None, Some(m), Some(i), Some(o)) => Ok(Asked::Stated(m, i, o)),
            _ => Err(respond::invalid_field(
                "body",
                "Send the request body the call will send (`body`), or, when it cannot be sent, \
                 `model`, `input_tokens` and `max_output_tokens`; not both.",
            )),
        }
    }
}

fn answer(r: Result<(StatusCode, HeaderMap, Value), ApiError>) -> Response {
    match r {
        Ok((status, headers, v)) => (status, headers, Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The caller's key, when it may make reservations.
fn caller<'a>(
    cfg: &'a crate::config::GatewayConfig,
    gw: &Shared,
    headers: &HeaderMap,
) -> Result<intake::Caller<'a>, ApiError> {
    let key = intake::authenticate(cfg, &gw.keys, headers)?;
    if !key.uses.reservations() {
        return Err(respond::key_not_for("reservations"));
    }
    Ok(key)
}

/// A new id: the key's id, the API's index and 128 random bits, so that only the key that
/// made it can name it and any instance can tell which API's usage settles it.
fn new_id(key: &KeyConfig, dialect: usize) -> Result<String, ApiError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| respond::internal("internal", e))?;
    Ok(format!(
        "res_{}_{dialect}{}",
        key.key_id,
        crate::config::hex(&bytes)
    ))
}

/// The API index `id` names, when the caller's key made it.
fn owner(gw: &Shared, id: &str, headers: &HeaderMap) -> Result<usize, ApiError> {
    let cfg = gw.config();
    let key = caller(&cfg, gw, headers)?;
    owned(id, &key).ok_or_else(|| respond::reservation_not_found(id))
}

/// The API index an id names, when it belongs to `key`.
fn owned(id: &str, key: &KeyConfig) -> Option<usize> {
    let rest = id.strip_prefix("res_")?.strip_prefix(key.key_id.as_str())?;
    let rest = rest.strip_prefix('_')?;
    let (d, random) = rest.split_at_checked(1)?;
    let d: usize = d.parse().ok()?;
    (d < ALL.len() && random.len() == 32 && random.bytes().all(|b| b.is_ascii_hexdigit()))
        .then_some(d)
}

/// `POST /v1/reservations`.
pub async fn reserve(State(gw): State<Shared>, req: Request<Body>) -> Response {
    answer(make(&gw, req).await)
}

async fn make(gw: &Shared, req: Request<Body>) -> Result<(StatusCode, HeaderMap, Value), ApiError> {
    let cfg = gw.config();
    let (parts, body) = req.into_parts();
    let key = caller(&cfg, gw, &parts.headers)?;
    let bytes = intake::read_body(&cfg, body, &parts.headers).await?;
    let asked: NewReservation = serde_json::from_slice(&bytes).map_err(respond::invalid_body)?;
    let Some(index) = ALL.iter().position(|d| d.path() == asked.endpoint) else {
        let paths: Vec<&str> = ALL.iter().map(|d| d.path()).collect();
        return Err(respond::invalid_field(
            "endpoint",
            format!(
                "{} is not an API this gateway reserves for; one of: {}.",
                respond::shown(&asked.endpoint),
                paths.join(", ")
            ),
        ));
    };
    let dialect: &'static dyn Dialect = ALL[index];
    dialect.check_headers(&cfg, &parts.headers)?;
    if gw.reservations.open() >= MAX_OPEN {
        gw.reservations.let_go_stale(now_ms(), 0);
        if gw.reservations.open() >= MAX_OPEN {
            return Err(respond::reservations_full(MAX_OPEN));
        }
    }
    let peer = parts
        .extensions
        .get::<ConnectInfo<std::net::SocketAddr>>()
        .map_or(std::net::IpAddr::from([127, 0, 0, 1]), |c| c.0.ip());
    let ip = intake::client_ip(&cfg.trusted_proxies, peer, &parts.headers).to_string();
    let asked = asked.asked()?;
    let stated = matches!(asked, Asked::Stated(..));
    let body = match &asked {
        Asked::Body(b) => serde_json::to_vec(b).map_err(|e| respond::internal("internal", e))?,
        Asked::Stated(..) => Vec::new(),
    };
    let id = new_id(&key, index)?;
    let intake = Intake {
        key,
        ip,
        headers: parts.headers,
        body: body.into(),
    };
    let early = crate::path::early::early_rate(gw, &cfg, &intake, &id).await?;
    let mut counted = match asked {
        Asked::Body(_) => crate::path::count::count(gw, &cfg, dialect, &intake, &id).await?,
        Asked::Stated(model, input, output) => {
            crate::path::count::stated(&cfg, &intake, &id, (model, input, output))?
        }
    };
    // A rule's degrade applies as to a proxied request: the body to send names the model.
    counted.degraded_from =
        crate::path::degrade::degrade(gw, &cfg, &intake.key, &mut counted).await;
    let admission =
        crate::path::admit_counted(gw, &cfg, dialect, &intake.key, &counted, &early, true).await?;
    let (p, admitted, ticket) = (admission.plan, admission.granted, admission.ticket);
    // The store's time of the admission, which its reservations' periods were taken at.
    let at = admitted.expires_at.saturating_sub(p.ttl_ms);
    kept::keep(gw, &counted.facts, at, p.ttl_ms).await;
    let per_choice = admitted.max_output_tokens.saturating_sub(counted.predicted) / counted.choices;
    if dialect.has_output() && per_choice == 0 {
        let _ = ticket.release(Some(Usage::default())).await;
        return Err(respond::no_tokens_per_choice(
            admitted.max_output_tokens,
            counted.choices,
        ));
    }
    let mut out = counted.json;
    let stream = out.get("stream").and_then(Value::as_bool) == Some(true);
    if let Some(o) = out.as_object_mut() {
        // For a stream, usage is asked for too: the settlement needs it.
        dialect.set_cap(o, per_choice, stream);
    }
    let mut headers = HeaderMap::new();
    respond::admitted_headers(&mut headers, &p, &admitted);
    // What a money budget holds for it: the most any of its budgets reserved.
    let money = p
        .reserves()
        .filter(|(_, b)| b.unit == tollgate_core::Unit::MicroUsd)
        .map(|(_, b)| b.amount)
        .max();
    let v = json!({
        "id": id,
        "object": "reservation",
        "endpoint": dialect.path(),
        "model": counted.model,
        "input_tokens": counted.facts.input_tokens,
        "max_output_tokens": per_choice,
        "cap_field": dialect.cap_field(),
        "reserved_tokens": ticket.estimate(),
        "reserved_micro_usd": money,
        "reserved_usd": money.map(|m| crate::words::amount(m, tollgate_core::Unit::MicroUsd)),
        "expires_at": crate::words::instant_ms(admitted.expires_at),
        "expires_at_ms": admitted.expires_at,
        "degraded_from": counted.degraded_from,
        "body": if stated { Value::Null } else { out },
    });
    gw.reservations.let_go_stale(admitted.expires_at, p.ttl_ms);
    gw.reservations.put_back(
        id,
        Held {
            ticket,
            dialect: index,
            model: counted.model,
            input: counted.facts.input_tokens,
            granted: admitted.max_output_tokens,
            expires_at: admitted.expires_at,
        },
    );
    Ok((StatusCode::CREATED, headers, v))
}

/// The usage a settlement's body reports: the usage object itself, the provider's final
/// response, or the stream event that carries usage (Anthropic's `message_start` holds it in
/// its message). `None` when it holds none.
fn reported(dialect: &dyn Dialect, body: &Value, input: u64) -> Result<Value, ApiError> {
    let answer = if body.get("usage").is_some_and(Value::is_object) {
        body.clone()
    } else if body["message"].get("usage").is_some_and(Value::is_object) {
        body["message"].clone()
    } else if body
        .as_object()
        .is_some_and(|o| o.keys().any(|k| k.ends_with("_tokens")))
    {
        json!({ "usage": body })
    } else {
        return Err(respond::usage_missing());
    };
    let mut bad = false;
    if dialect.usage(&answer["usage"], input, &mut bad).is_none() && !bad {
        return Err(respond::usage_missing());
    }
    if bad {
        return Err(respond::usage_not_counts());
    }
    Ok(answer)
}

/// `POST /v1/reservations/{id}/settle`: idempotent.
pub async fn settle(
    State(gw): State<Shared>,
    Path(id): Path<String>,
    req: Request<Body>,
) -> Response {
    answer(settle_with(&gw, &id, req).await)
}

async fn settle_with(
    gw: &Shared,
    id: &str,
    req: Request<Body>,
) -> Result<(StatusCode, HeaderMap, Value), ApiError> {
    let cfg = gw.config();
    let (parts, body) = req.into_parts();
    let index = owner(gw, id, &parts.headers)?;
    let bytes = intake::read_body(&cfg, body, &parts.headers).await?;
    let body: Value = serde_json::from_slice(&bytes).map_err(respond::invalid_json)?;
    if let Some(v) = gw.reservations.ended(id) {
        return Ok((StatusCode::OK, HeaderMap::new(), v));
    }
    let Some(held) = gw.reservations.take(id) else {
        // Made by another instance (or this one before a restart): the store holds it.
        let answer = reported(ALL[index], &body, 0)?;
        let model = answer["model"].as_str().unwrap_or_default();
        let (usage, _) = answered_usage(ALL[index], &answer, 0, 0, &cfg.counter, model);
        let f = gw.store.settle(id, usage.bounded()).await;
        kept::book(gw, id, "settled", &f, usage.bounded()).await;
        return ended(gw, id, ("settled", false), f, usage, None);
    };
    let dialect = ALL[held.dialect];
    let answer = match reported(dialect, &body, held.input) {
        Ok(a) => a,
        Err(e) => {
            gw.reservations.put_back(id.to_owned(), held);
            return Err(e);
        }
    };
    let (usage, report) = answered_usage(
        dialect,
        &answer,
        held.input,
        held.granted,
        &cfg.counter,
        &held.model,
    );
    let mut ticket = held.ticket;
    if let Report::Under(reported) = report {
        ticket.usage_underreported(reported);
    }
    let estimate = ticket.estimate();
    let f = ticket.settle(usage).await;
    ended(gw, id, ("settled", true), f, usage, Some(estimate))
}

/// The answer to an ending (`how`, and whether its ticket retries it when the store does not
/// answer), kept for a repeat when the store took it. A store that did not answer is never a
/// 503, which would say nothing changed: a retried ending is pending (202), and one that is not
/// may have been taken (500); either way the ending is idempotent, to be sent again.
fn ended(
    gw: &Shared,
    id: &str,
    (how, retried): (&str, bool),
    f: Result<Finish, StoreError>,
    usage: Usage,
    estimate: Option<u64>,
) -> Result<(StatusCode, HeaderMap, Value), ApiError> {
    let status = match f {
        Ok(Finish::Done { .. }) => how,
        Ok(Finish::AlreadyEnded(Ending::Expired)) => {
            return Err(respond::reservation_expired(id));
        }
        Ok(Finish::AlreadyEnded(Ending::Settled)) => "already_settled",
        Ok(Finish::AlreadyEnded(Ending::Released)) => "already_released",
        Ok(Finish::Unknown) => return Err(respond::reservation_not_found(id)),
        Err(StoreError::Unavailable(_)) if retried => {
            let v = json!({
                "id": id,
                "object": "reservation",
                "status": "pending",
                "message": "The store did not answer; the ending is retried in the background. \
                            Send it again to learn its outcome: endings are idempotent.",
            });
            return Ok((StatusCode::ACCEPTED, HeaderMap::new(), v));
        }
        Err(StoreError::Unavailable(_)) => return Err(respond::reservation_outcome_unknown(id)),
        Err(e) => return Err(respond::store_failed(&e)),
    };
    let over = estimate.is_some_and(|e| usage.total() > e);
    let v = json!({
        "id": id,
        "object": "reservation",
        "status": status,
        "usage": {
            "input_tokens": usage.input_tokens,
            "cached_input_tokens": usage.cached_input_tokens,
            "output_tokens": usage.output_tokens,
        },
        "over_reservation": over,
    });
    if over {
        tracing::warn!(
            reservation = id,
            charged_tokens = usage.total(),
            reserved_tokens = estimate.unwrap_or_default(),
            "a reservation was settled above what it reserved: charged in full"
        );
    }
    gw.reservations.remember(id, &v);
    Ok((StatusCode::OK, HeaderMap::new(), v))
}

/// `POST /v1/reservations/{id}/renew`: the lease and the reservation live one lifetime more.
pub async fn renew(
    State(gw): State<Shared>,
    Path(id): Path<String>,
    req: Request<Body>,
) -> Response {
    answer(renew_with(&gw, &id, req.headers()).await)
}

async fn renew_with(
    gw: &Shared,
    id: &str,
    headers: &HeaderMap,
) -> Result<(StatusCode, HeaderMap, Value), ApiError> {
    owner(gw, id, headers)?;
    // Renewed in the store, with its shadow's admission: any instance may renew it.
    let shadow = [id, tollgate_core::pipeline::SHADOW_ID_SUFFIX].concat();
    let (r, _) = tokio::join!(gw.store.renew(id), gw.store.renew(&shadow));
    match r {
        Ok(Renewal::Renewed { expires_at }) => {
            gw.reservations.renewed(id, expires_at);
            kept::renewed(gw, id).await;
            let v = json!({
                "id": id,
                "object": "reservation",
                "expires_at": crate::words::instant_ms(expires_at),
                "expires_at_ms": expires_at,
            });
            Ok((StatusCode::OK, HeaderMap::new(), v))
        }
        Ok(_) => match gw.reservations.take(id) {
            // Expired in the store: charged, nothing left to renew.
            Some(h) => {
                h.ticket.let_go();
                Err(respond::reservation_expired(id))
            }
            None => Err(respond::reservation_not_found(id)),
        },
        Err(e) => Err(respond::store_failed(&e)),
    }
}

/// `DELETE /v1/reservations/{id}`: the call was not made; nothing is charged.
pub async fn release(
    State(gw): State<Shared>,
    Path(id): Path<String>,
    req: Request<Body>,
) -> Response {
    answer(release_with(&gw, &id, req.headers()).await)
}

async fn release_with(
    gw: &Shared,
    id: &str,
    headers: &HeaderMap,
) -> Result<(StatusCode, HeaderMap, Value), ApiError> {
    owner(gw, id, headers)?;
    if let Some(v) = gw.reservations.ended(id) {
        return Ok((StatusCode::OK, HeaderMap::new(), v));
    }
    let none = Usage::default();
    let (f, retried) = match gw.reservations.take(id) {
        Some(h) => (h.ticket.release(Some(none)).await, true),
        None => {
            let f = gw.store.release(id, Some(none)).await;
            kept::book(gw, id, "released", &f, none).await;
            (f, false)
        }
    };
    ended(gw, id, ("released", retried), f, none, None)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn key(id: &str) -> KeyConfig {
        KeyConfig {
            name: "k".into(),
            key_id: id.into(),
            tenant: "t".into(),
            user: None,
            allow_user: false,
            models: None,
            exempt: Vec::new(),
            class: None,
            uses: crate::config::Uses::Both,
        }
    }

    #[test]
    fn an_id_names_its_key_and_api_and_no_other_key_can_use_it() {
        let (a, b) = (key("0123456789abcdef"), key("fedcba9876543210"));
        let id = new_id(&a, 4).unwrap();
        assert_eq!(owned(&id, &a), Some(4));
        assert_eq!(owned(&id, &b), None);
        assert_ne!(new_id(&a, 4).unwrap(), id, "128 random bits each");
        for bad in [
            "res_0123456789abcdef_9".to_owned(),
            format!("{id}0"),
            id.replace("res_", "rez_"),
            format!("res_0123456789abcdef_7{}", "a".repeat(32)),
        ] {
            assert_eq!(owned(&bad, &a), None, "{bad}");
        }
    }

    #[test]
    fn a_settlement_reads_usage_in_each_shape_and_refuses_none() {
        let chat = ALL[0];
        let usage = json!({"prompt_tokens": 10, "completion_tokens": 5});
        for body in [
            usage.clone(),
            json!({"id": "x", "usage": usage}),
            json!({"message": {"usage": usage}}),
        ] {
            let a = reported(chat, &body, 10).unwrap();
            assert_eq!(a["usage"], usage);
        }
        for body in [json!({}), json!({"usage": "ten"}), json!([1, 2])] {
            assert_eq!(
                reported(chat, &body, 10).unwrap_err().code,
                "usage_missing",
                "{body}"
            );
        }
        let bad = json!({"prompt_tokens": -1, "completion_tokens": 5});
        assert_eq!(reported(chat, &bad, 10).unwrap_err().code, "usage_invalid");
    }
}
