//! The intake step: who is calling (the key, the client's address), and the body, read within
//! its size and time limits. Nothing is parsed or counted yet.

use std::net::{IpAddr, SocketAddr};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request};
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde_json::Value;

use crate::config::{GatewayConfig, KeyConfig, hash_key};
use crate::dialect::Dialect;
use crate::respond::{self, ApiError};

/// The longest end-user id accepted, in bytes (OpenAI's own bound on `user`).
pub const MAX_USER_BYTES: usize = 256;
/// The longest operation id accepted, in bytes: room for a UUID or a trace id with a prefix.
pub const MAX_OPERATION_BYTES: usize = 128;

/// A request past intake.
#[derive(Debug)]
pub(crate) struct Intake<'a> {
    /// The caller's key.
    pub key: &'a KeyConfig,
    /// The client's address, as the trusted proxies report it.
    pub ip: String,
    /// The request's headers.
    pub headers: HeaderMap,
    /// The body, whole.
    pub body: Bytes,
}

/// Authenticates `req`, checks the headers its API acts on, and reads its body.
pub(crate) async fn intake<'a>(
    cfg: &'a GatewayConfig,
    dialect: &dyn Dialect,
    req: Request<Body>,
) -> Result<Intake<'a>, ApiError> {
    let (parts, body) = req.into_parts();
    let key = authenticate(cfg, &parts.headers)?;
    dialect.check_headers(cfg, &parts.headers)?;
    let peer = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]));
    let body = read_body(cfg, body, &parts.headers).await?;
    let ip = client_ip(cfg, peer, &parts.headers).to_string();
    Ok(Intake {
        key,
        ip,
        headers: parts.headers,
        body,
    })
}

/// The key a request presents (OpenAI's clients send `Authorization: Bearer`, Anthropic's
/// `x-api-key`), among the configured ones.
pub(crate) fn authenticate<'a>(
    cfg: &'a GatewayConfig,
    headers: &HeaderMap,
) -> Result<&'a KeyConfig, ApiError> {
    let value = headers
        .get("authorization")
        .or_else(|| headers.get("x-api-key"))
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            respond::unauthorized(
                "Missing API key: send Authorization: Bearer <key> or x-api-key: <key>.",
            )
        })?;
    let key = value.strip_prefix("Bearer ").unwrap_or(value).trim();
    let hash = hash_key(key);
    cfg.keys
        .get(hash.trim_start_matches("sha256:"))
        .ok_or_else(|| respond::unauthorized("Incorrect API key provided."))
}

/// The client's address: the peer, unless it is a trusted proxy; then the rightmost address of
/// `x-forwarded-for` that is not one.
fn client_ip(cfg: &GatewayConfig, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
    if !cfg.trusted_proxies.contains(&peer) {
        return peer;
    }
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

/// The body, refused past `max_body_bytes` (by its declared length before it is read) or
/// `body_timeout`.
async fn read_body(
    cfg: &GatewayConfig,
    body: Body,
    headers: &HeaderMap,
) -> Result<Bytes, ApiError> {
    let max = cfg.max_body_bytes;
    let declared = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(respond::body_too_large(max));
    }
    match tokio::time::timeout(cfg.body_timeout, Limited::new(body, max).collect()).await {
        Err(_) => Err(respond::body_timeout()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(respond::body_too_large(max))
        }
        Ok(Err(e)) => Err(respond::invalid_body(e)),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

/// The end user a request names (`user` in the body, else `x-tollgate-user`) when its key
/// allows that, else the key's own; at most [`MAX_USER_BYTES`], wherever it is given.
pub(crate) fn end_user(
    key: &KeyConfig,
    json: &Value,
    headers: &HeaderMap,
) -> Result<Option<String>, ApiError> {
    let body = match json.get("user") {
        None | Some(Value::Null) => None,
        Some(Value::String(u)) => Some(u.as_str()),
        Some(_) => return Err(respond::user_not_a_string()),
    };
    let header = match headers.get("x-tollgate-user") {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| respond::user_header_not_ascii())?),
    };
    for u in [body, header].into_iter().flatten() {
        if u.len() > MAX_USER_BYTES {
            return Err(respond::user_too_long(u.len(), MAX_USER_BYTES));
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

/// The agent operation a request names in `cfg.operation_header`: visible ASCII, 1 to
/// [`MAX_OPERATION_BYTES`] bytes; none without the header.
pub(crate) fn operation(
    cfg: &GatewayConfig,
    headers: &HeaderMap,
) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(&cfg.operation_header) else {
        return Ok(None);
    };
    let name = cfg.operation_header.as_str();
    let v = v.to_str().map_err(|_| respond::operation_not_ascii(name))?;
    if v.is_empty() || v.len() > MAX_OPERATION_BYTES {
        return Err(respond::operation_length(
            name,
            v.len(),
            MAX_OPERATION_BYTES,
        ));
    }
    Ok(Some(v.to_owned()))
}
