//! The admin listener's door, beyond its tokens. A browser sends a logged-in operator's Basic
//! credentials by itself, to whichever site asks: so a change of state is made only on a request
//! a page of another site could not have sent (no `Sec-Fetch-Site` or `Origin` of another site,
//! and a JSON body; the status page's forms carry their form token instead). Every answer says
//! `nosniff` and `no-store` (some carry a secret). Failed logins are counted by route and logged
//! with their source, at most once a second with how many were not.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::response::{IntoResponse, Response};

use crate::respond::{ApiError, Class, Fault};

/// Whether `method` changes state (everything but reads).
fn changes(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// The refusal of a change of state that another site's page may have sent, if it is one:
/// a `Sec-Fetch-Site` other than `same-origin` or `none` (typed by the user), an `Origin` whose
/// host is not the one asked, or a body that is not JSON (a form or `text/plain`, which a page
/// may post anywhere without asking) outside the status page's forms.
pub(super) fn refusal(method: &Method, path: &str, headers: &HeaderMap) -> Option<Response> {
    if !changes(method) {
        return None;
    }
    let text = |name: header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    let refuse = |code: &str, message: String| {
        Some(ApiError::new(Class::Client(Fault::Forbidden), code, message).into_response())
    };
    if let Some(site) = headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !matches!(*s, "same-origin" | "none"))
    {
        return refuse(
            "cross_site_request",
            format!("A change asked by a page of another site ({site}) is refused."),
        );
    }
    if let Some(origin) = text(header::ORIGIN) {
        let host = origin.split_once("://").map_or(origin, |(_, h)| h);
        if Some(host) != text(header::HOST) {
            return refuse(
                "cross_site_request",
                format!("A change asked from the origin {origin:?} is refused."),
            );
        }
    }
    let has_body = text(header::CONTENT_LENGTH).is_some_and(|n| n.trim() != "0")
        || headers.contains_key(header::TRANSFER_ENCODING);
    let json = text(header::CONTENT_TYPE).is_some_and(|t| {
        t.split(';')
            .next()
            .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
    });
    if has_body && !json && !path.starts_with("/admin/ui/") {
        return Some(
            ApiError::invalid(
                "json_required",
                "A change takes a JSON body: send Content-Type: application/json.",
            )
            .into_response(),
        );
    }
    None
}

/// The request with its body read, within the listener's `body_timeout` and `max_body_bytes`
/// as on the public listener: a body that stalls is 408 and its connection closed, so that
/// stalled bodies cannot hold the listener's connections (any tenant's token could).
pub(super) async fn read(
    cfg: &crate::config::GatewayConfig,
    req: axum::extract::Request,
) -> Result<axum::extract::Request, Response> {
    if !changes(req.method()) {
        return Ok(req);
    }
    let (parts, body) = req.into_parts();
    match crate::path::intake::read_body(cfg, body, &parts.headers).await {
        Ok(bytes) => Ok(axum::extract::Request::from_parts(
            parts,
            axum::body::Body::from(bytes),
        )),
        Err(e) => {
            let mut r = e.into_response();
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            Err(r)
        }
    }
}

/// How many calls one tenant's token may have in flight on the admin listener: what its
/// connections can hold (a body being read, a change being made) is bounded, whatever the
/// operator's connections need. The operator's token is not counted.
pub(super) const TENANT_IN_FLIGHT: usize = 4;

/// Each tenant's calls in flight.
#[derive(Debug, Default)]
pub(super) struct InFlight(
    std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<tokio::sync::Semaphore>>>,
);

impl InFlight {
    /// A turn for one call of `tenant`'s, held until it is answered; past
    /// [`TENANT_IN_FLIGHT`], 429 and the connection closed.
    pub(super) fn enter(
        &self,
        tenant: &str,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, Response> {
        let sem = self.0.lock().ok().map(|mut m| {
            m.entry(tenant.to_owned())
                .or_insert_with(|| {
                    std::sync::Arc::new(tokio::sync::Semaphore::new(TENANT_IN_FLIGHT))
                })
                .clone()
        });
        sem.and_then(|s| s.try_acquire_owned().ok()).ok_or_else(|| {
            let mut r = ApiError::new(
                Class::Refused(crate::respond::Refusal::Limit),
                "admin_busy",
                format!(
                    "Tenant {tenant:?} has {TENANT_IN_FLIGHT} admin calls in flight already: \
                     try again when one is answered."
                ),
            )
            .retry_after(1_000)
            .into_response();
            // Not the error's: this listener's way of shedding a caller.
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            r
        })
    }
}

/// Puts the headers every admin answer carries.
pub(super) fn seal(r: &mut Response) {
    let h = r.headers_mut();
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}

/// The route a path is counted under: a fixed set, whatever the path asked.
fn route(path: &str) -> &'static str {
    const ROUTES: [&str; 9] = [
        "keys", "limits", "usage", "kill", "status", "ui", "store", "reload", "metrics",
    ];
    let first = path
        .trim_start_matches("/admin/")
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or_default();
    ROUTES.into_iter().find(|r| *r == first).unwrap_or("other")
}

/// A failed login: counted by route and principal (`none` presented, an `unknown` token, a
/// `tenant`'s token beyond its tenant), and logged with its source and route at most once a
/// second (with how many were not logged since).
pub(super) fn failed_login(peer: Option<IpAddr>, path: &str, principal: &'static str) {
    static LAST_SECOND: AtomicU64 = AtomicU64::new(0);
    static UNLOGGED: AtomicU64 = AtomicU64::new(0);
    let route = route(path);
    crate::telemetry::admin_login_failed(route, principal);
    let second = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST_SECOND.load(Ordering::Relaxed);
    if last != second
        && LAST_SECOND
            .compare_exchange(last, second, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let unlogged = UNLOGGED.swap(0, Ordering::Relaxed);
        let source = peer.map_or_else(|| "unknown".to_owned(), |p| p.to_string());
        tracing::warn!(%source, route, principal, unlogged,
            "an admin call's credentials were refused (none, a wrong token, or a tenant's \
             beyond its tenant)");
    } else {
        UNLOGGED.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            if let (Ok(k), Ok(v)) = (
                header::HeaderName::from_bytes(k.as_bytes()),
                HeaderValue::from_str(v),
            ) {
                h.insert(k, v);
            }
        }
        h
    }

    #[test]
    fn a_change_another_site_may_have_sent_is_refused() {
        let post = Method::POST;
        let ok = |p: &[(&str, &str)]| refusal(&post, "/admin/keys", &headers(p)).is_none();
        assert!(ok(&[
            ("content-type", "application/json"),
            ("content-length", "9")
        ]));
        assert!(ok(&[]), "no body");
        assert!(ok(&[
            ("host", "127.0.0.1:8081"),
            ("origin", "http://127.0.0.1:8081"),
            ("sec-fetch-site", "same-origin"),
        ]));
        assert!(!ok(&[("sec-fetch-site", "cross-site")]));
        assert!(!ok(&[("sec-fetch-site", "same-site")]));
        assert!(!ok(&[
            ("host", "127.0.0.1:8081"),
            ("origin", "https://evil.example")
        ]));
        assert!(!ok(&[
            ("content-type", "text/plain"),
            ("content-length", "9")
        ]));
        assert!(!ok(&[
            ("content-type", "application/x-www-form-urlencoded"),
            ("content-length", "9")
        ]));
        // Reads are never refused; the page's forms carry their own token.
        assert!(
            refusal(
                &Method::GET,
                "/admin/keys",
                &headers(&[("sec-fetch-site", "cross-site")])
            )
            .is_none()
        );
        assert!(
            refusal(
                &post,
                "/admin/ui/kill",
                &headers(&[
                    ("content-type", "application/x-www-form-urlencoded"),
                    ("content-length", "9")
                ])
            )
            .is_none()
        );
    }

    #[test]
    fn a_route_is_one_of_a_fixed_set() {
        assert_eq!(route("/admin/keys/vk_1/rotate"), "keys");
        assert_eq!(route("/metrics"), "metrics");
        assert_eq!(route("/admin/../../etc/passwd"), "other");
    }
}
