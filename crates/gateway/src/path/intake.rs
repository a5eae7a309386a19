//! The intake step: who is calling (the key, the client's address), and the body, read within
//! its size and time limits. Nothing is parsed or counted yet.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

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

/// The key a request presents: one of the configuration's, or one issued at run time.
#[derive(Debug, Clone)]
pub(crate) enum Caller<'a> {
    Configured(&'a KeyConfig),
    Issued(Arc<crate::keys::Found>),
}

impl std::ops::Deref for Caller<'_> {
    type Target = KeyConfig;
    fn deref(&self) -> &KeyConfig {
        match self {
            Caller::Configured(k) => k,
            Caller::Issued(f) => &f.key,
        }
    }
}

/// A request past intake.
#[derive(Debug)]
pub(crate) struct Intake<'a> {
    /// The caller's key.
    pub key: Caller<'a>,
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
    issued: &crate::keys::Registry,
    dialect: &dyn Dialect,
    req: Request<Body>,
) -> Result<Intake<'a>, ApiError> {
    let (parts, body) = req.into_parts();
    let key = authenticate(cfg, issued, &parts.headers)?;
    if !key.uses.proxy() {
        return Err(respond::key_not_for("requests through the proxy"));
    }
    dialect.check_headers(cfg, &parts.headers)?;
    let peer = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]));
    let body = read_body(cfg, body, &parts.headers).await?;
    let ip = client_ip(&cfg.trusted_proxies, peer, &parts.headers).to_string();
    Ok(Intake {
        key,
        ip,
        headers: parts.headers,
        body,
    })
}

/// The key a request presents (OpenAI's clients send `Authorization: Bearer`, Anthropic's
/// `x-api-key`), among the configured ones and those issued at run time (while they work).
pub(crate) fn authenticate<'a>(
    cfg: &'a GatewayConfig,
    issued: &crate::keys::Registry,
    headers: &HeaderMap,
) -> Result<Caller<'a>, ApiError> {
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
    let digest = hash.trim_start_matches("sha256:");
    if let Some(k) = cfg.keys.get(digest) {
        return Ok(Caller::Configured(k));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    issued
        .lookup(digest, now)
        .map(Caller::Issued)
        .ok_or_else(|| respond::unauthorized("Incorrect API key provided."))
}

/// The client's address: the peer, unless it is a trusted proxy; then `x-forwarded-for` walked
/// from the right past the trusted proxies, to the first address that is not one. Entries may
/// carry ports (`1.2.3.4:5678`, `[2001:db8::1]:443`), as some proxies append them. An entry that
/// cannot be read ends the walk: the request is attributed to the last trusted hop, which wrote
/// what follows it, never to an entry further left, which the client may have written.
pub(crate) fn client_ip(trusted: &[IpAddr], peer: IpAddr, headers: &HeaderMap) -> IpAddr {
    if !trusted.contains(&peer) {
        return peer;
    }
    let mut hops: Vec<&str> = Vec::new();
    for v in headers.get_all("x-forwarded-for") {
        match v.to_str() {
            Ok(v) => hops.extend(v.split(',')),
            // A header that is not text cannot be read: nothing left of the peer is believed.
            Err(_) => hops.clear(),
        }
    }
    let mut last_trusted = peer;
    for hop in hops.into_iter().rev() {
        match forwarded_ip(hop) {
            Some(ip) if trusted.contains(&ip) => last_trusted = ip,
            Some(ip) => return ip,
            None => return last_trusted,
        }
    }
    last_trusted
}

/// One `x-forwarded-for` entry: an address, with or without a port (an IPv6 address with a port
/// in brackets); `None` for anything else (an empty entry, a name, `unknown`).
pub(crate) fn forwarded_ip(entry: &str) -> Option<IpAddr> {
    let e = entry.trim();
    if let Ok(ip) = e.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(sa) = e.parse::<SocketAddr>() {
        return Some(sa.ip());
    }
    // `[2001:db8::1]` without a port.
    e.strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .and_then(|r| r.parse::<std::net::Ipv6Addr>().ok())
        .map(IpAddr::V6)
}

/// The body, refused past `max_body_bytes` (by its declared length before it is read) or
/// `body_timeout`.
pub(crate) async fn read_body(
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn from(xff: &[&str]) -> IpAddr {
        let trusted: Vec<IpAddr> = vec![[127, 0, 0, 1].into(), [10, 0, 0, 9].into()];
        let mut h = HeaderMap::new();
        for v in xff {
            h.append("x-forwarded-for", v.parse().unwrap());
        }
        client_ip(&trusted, [127, 0, 0, 1].into(), &h)
    }

    #[test]
    fn entries_with_ports_are_read() {
        assert_eq!(
            from(&["9.9.9.9, 203.0.113.7:5678"]),
            IpAddr::from([203, 0, 113, 7])
        );
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(from(&["9.9.9.9, [2001:db8::1]:443"]), v6);
        assert_eq!(from(&["[2001:db8::1]"]), v6);
        assert_eq!(from(&["9.9.9.9", "2001:db8::1, 10.0.0.9:80"]), v6);
    }

    #[test]
    fn an_entry_that_cannot_be_read_ends_the_walk_at_the_last_trusted_hop() {
        // The forged entry left of the unreadable one is never believed.
        assert_eq!(from(&["9.9.9.9, unknown"]), IpAddr::from([127, 0, 0, 1]));
        assert_eq!(
            from(&["9.9.9.9, garbage:port, 10.0.0.9"]),
            IpAddr::from([10, 0, 0, 9])
        );
        assert_eq!(from(&["9.9.9.9,, 10.0.0.9"]), IpAddr::from([10, 0, 0, 9]));
        assert_eq!(from(&[]), IpAddr::from([127, 0, 0, 1]));
    }

    #[test]
    fn an_untrusted_peer_is_the_client_whatever_it_forwards() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "9.9.9.9".parse().unwrap());
        let peer = IpAddr::from([198, 51, 100, 1]);
        assert_eq!(client_ip(&[], peer, &h), peer);
    }
}
