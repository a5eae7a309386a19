//! Requests made idempotent by an `Idempotency-Key` header (draft-ietf-httpapi-idempotency-key-
//! header): the key is claimed in the store before admission, so a retry is never admitted or
//! charged again. While the first request is answered, the same key and body get 409; once it
//! is, its response is sent again, marked `x-tollgate-idempotent-replay`, for the configured
//! time; the same key with another body (or on another endpoint) gets 422. A key belongs to its
//! virtual key. A request refused or failed lets go of its key, so that its retry is a new
//! request.

use axum::response::Response;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tollgate_core::{KeyClaim, KeyUse, Store};

use super::intake::Intake;
use crate::config::{IdempotencyConfig, hex};
use crate::respond::{self, ApiError};
use crate::store::AnyStore;

/// The header.
pub(crate) const HEADER: &str = "idempotency-key";
/// The longest key accepted, in bytes.
pub(crate) const MAX_KEY_BYTES: usize = 255;

/// What a request's key says to do.
pub(crate) enum Keyed {
    /// Go on; the claim, if the request has a key, is ended when it is answered.
    Go(Option<Claim>),
    /// Answered before: this is its response.
    Replay(Response),
}

/// How a kept response is written: this header as a JSON line, then the body.
#[derive(Serialize, Deserialize)]
struct Kept {
    status: u16,
    content_type: String,
    /// Whether the body was kept (it was larger than the bound, otherwise).
    kept: bool,
}

/// Claims the request's key, if it has one.
pub(crate) async fn claim(
    store: &AnyStore,
    cfg: &IdempotencyConfig,
    path: &str,
    intake: &Intake<'_>,
    request_id: &str,
) -> Result<Keyed, ApiError> {
    let mut values = intake.headers.get_all(HEADER).iter();
    let Some(value) = values.next() else {
        return Ok(Keyed::Go(None));
    };
    let text = value
        .to_str()
        .ok()
        .filter(|v| (1..=MAX_KEY_BYTES).contains(&v.len()) && values.next().is_none())
        .filter(|v| v.bytes().all(|b| b.is_ascii_graphic() || b == b' '))
        .ok_or_else(|| respond::idempotency_key_invalid(MAX_KEY_BYTES))?;
    let key = format!("{}|{text}", intake.key.key_id);
    let mut h = Sha256::new();
    h.update(path.as_bytes());
    h.update(b"\n");
    h.update(&intake.body);
    let digest = hex(&h.finalize());
    let claimed = store
        .claim_key(KeyUse {
            key: &key,
            digest: &digest,
            request_id,
            in_flight_ms: millis(cfg.in_flight),
        })
        .await;
    crate::telemetry::idempotency(match &claimed {
        Ok(KeyClaim::Claimed) => "claimed",
        Ok(KeyClaim::InFlight) => "in_flight",
        Ok(KeyClaim::Conflict) => "conflict",
        Ok(KeyClaim::Answered(_)) => "replayed",
        Ok(KeyClaim::NoRoom) => "no_room",
        Err(_) => "store_error",
    });
    match claimed.map_err(super::admit::store_error)? {
        KeyClaim::Claimed => Ok(Keyed::Go(Some(Claim {
            store: store.clone(),
            key,
            request_id: request_id.to_owned(),
            cfg: *cfg,
            ended: false,
        }))),
        KeyClaim::InFlight => Err(respond::idempotency_key_in_flight()),
        KeyClaim::Conflict => Err(respond::idempotency_key_reused()),
        KeyClaim::NoRoom => Err(respond::idempotency_keys_full()),
        KeyClaim::Answered(bytes) => replay(bytes).map(Keyed::Replay),
    }
}

/// The response kept in `bytes`.
fn replay(bytes: Vec<u8>) -> Result<Response, ApiError> {
    if bytes.is_empty() {
        // Answered, but the store had no room to keep it.
        return Err(respond::idempotent_response_not_kept());
    }
    let cut = bytes
        .iter()
        .position(|b| *b == b'\n')
        .unwrap_or(bytes.len());
    let head: Kept = serde_json::from_slice(&bytes[..cut])
        .map_err(|e| respond::internal("idempotency_store", e))?;
    if !head.kept {
        return Err(respond::idempotent_response_not_kept());
    }
    let body = bytes.get(cut + 1..).unwrap_or_default().to_vec();
    respond::replayed(head.status, &head.content_type, body)
        .ok_or_else(|| respond::internal("idempotency_store", "a kept status is not one"))
}

/// A claimed key: ended with the request's response, or, dropped unanswered, let go of.
pub(crate) struct Claim {
    store: AnyStore,
    key: String,
    request_id: String,
    cfg: IdempotencyConfig,
    ended: bool,
}

impl Claim {
    /// The largest response kept.
    pub fn max_bytes(&self) -> usize {
        self.cfg.max_response_bytes
    }

    /// Keeps the request's answer for the key's later uses (only its head when `body` is
    /// `None`: it was larger than the bound).
    pub async fn answered(mut self, status: u16, content_type: &str, body: Option<&[u8]>) {
        self.ended = true;
        let head = Kept {
            status,
            content_type: content_type.to_owned(),
            kept: body.is_some(),
        };
        let mut bytes = serde_json::to_vec(&head).unwrap_or_default();
        bytes.push(b'\n');
        bytes.extend_from_slice(body.unwrap_or_default());
        let keep = millis(self.cfg.keep);
        let r = self
            .store
            .end_claim(&self.key, &self.request_id, Some(&bytes), keep)
            .await;
        if r.is_err() {
            // Not kept: the claim ends by its in-flight time, and a retry then is a new request.
            crate::telemetry::idempotency("keep_failed");
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, key, id) = (
            self.store.clone(),
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.request_id),
        );
        handle.spawn(async move {
            if store.end_claim(&key, &id, None, 1).await.is_err() {
                crate::telemetry::idempotency("release_failed");
            }
        });
    }
}

fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
