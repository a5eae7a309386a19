//! `/admin/keys`: virtual keys issued at run time (see [`crate::keys`]).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::AdminScope;
use crate::gateway::Shared;
use crate::keys::{self, KeyError};
use crate::respond::{ApiError, Class, Fault};

pub(super) fn refused(e: KeyError) -> Response {
    let (class, code) = match &e {
        KeyError::Invalid(_) => (Class::Client(Fault::Invalid), "invalid_key_request"),
        KeyError::NotFound(_) => (Class::Client(Fault::NotFound), "key_not_found"),
        KeyError::Forbidden(_) => (Class::Client(Fault::Forbidden), "admin_scope_forbidden"),
        KeyError::Changed(_) => (Class::Client(Fault::Conflict), "key_changed"),
        KeyError::Unavailable(_) => (Class::Books, "store_unavailable"),
        KeyError::Unknown(_) => (Class::Unknown, "key_change_unknown"),
    };
    if matches!(e, KeyError::Unavailable(_) | KeyError::Unknown(_)) {
        tracing::warn!(cause = %e, "a change of an issued key was not made, or not known to be");
    }
    ApiError::new(class, code, e.to_string()).into_response()
}

/// A JSON body, or a 400 that says what is wrong with it; an empty body is `{}`.
fn body<T: serde::de::DeserializeOwned>(b: &Bytes) -> Result<T, Response> {
    let text: &[u8] = if b.is_empty() { b"{}" } else { b };
    serde_json::from_slice(text)
        .map_err(|e| refused(KeyError::Invalid(format!("the request body: {e}"))))
}

/// `POST /admin/keys`: 201 with the key and its secret, shown this once.
pub(super) async fn create(
    State(gw): State<Shared>,
    axum::Extension(who): axum::Extension<AdminScope>,
    b: Bytes,
) -> Response {
    let new: keys::NewKey = match body(&b) {
        Ok(n) => n,
        Err(r) => return r,
    };
    if let Some(t) = who.tenant().filter(|t| *t != new.tenant) {
        return crate::respond::admin_scope_forbidden(t).into_response();
    }
    let layer = match who.tenant() {
        Some(_) => crate::overrides::Layer::Tenant,
        None => crate::overrides::Layer::Operator,
    };
    match keys::create(&gw, new, layer).await {
        Ok((record, secret)) => {
            tracing::info!(id = %record.key.id, tenant = %record.key.tenant, "a key was issued");
            (
                StatusCode::CREATED,
                axum::Json(json!({"key": record.shown(keys::now_ms()), "secret": secret})),
            )
                .into_response()
        }
        Err(e) => refused(e),
    }
}

/// `GET /admin/keys`: every issued key that works, without secrets.
pub(super) async fn list(
    State(gw): State<Shared>,
    axum::Extension(who): axum::Extension<AdminScope>,
) -> Response {
    let _ = keys::refresh(&gw).await;
    let now = keys::now_ms();
    let listed: Vec<serde_json::Value> = gw
        .keys
        .list(now)
        .iter()
        .filter(|k| who.tenant().is_none_or(|t| k.key.tenant == t))
        .map(|k| k.shown(now))
        .collect();
    axum::Json(json!({"keys": listed})).into_response()
}

/// `POST /admin/keys/{id}/rotate`: a new secret; the old one works for the grace period.
pub(super) async fn rotate(
    State(gw): State<Shared>,
    axum::Extension(who): axum::Extension<AdminScope>,
    Path(id): Path<String>,
    b: Bytes,
) -> Response {
    let r = match body(&b) {
        Ok(r) => r,
        Err(r) => return r,
    };
    match keys::rotate(&gw, &id, who.tenant(), r).await {
        Ok((record, secret)) => {
            tracing::info!(id = %record.key.id, version = record.version, "a key was rotated");
            axum::Json(json!({"key": record.shown(keys::now_ms()), "secret": secret}))
                .into_response()
        }
        Err(e) => refused(e),
    }
}

/// `DELETE /admin/keys/{id}`: every secret of the key stops working, for good; again, the same
/// answer.
pub(super) async fn revoke(
    State(gw): State<Shared>,
    axum::Extension(who): axum::Extension<AdminScope>,
    Path(id): Path<String>,
) -> Response {
    match keys::revoke(&gw, &id, who.tenant()).await {
        Ok(record) => {
            tracing::info!(id = %id, version = record.version, "a key was revoked");
            axum::Json(json!({
                "id": id,
                "revoked": true,
                "revoked_at_ms": record.revoked_at_ms,
                "version": record.version,
            }))
            .into_response()
        }
        Err(e) => refused(e),
    }
}
