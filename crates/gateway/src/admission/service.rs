//! The service.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::Request;
use http_body_util::{BodyExt, Limited};
use tollgate_core::{Decision, RequestFacts, Store, Usage, plan};

use super::future::ResponseFuture;
use super::layer::AdmissionLayer;
use crate::respond::{self, ApiError};
use crate::store::Ticket;

/// Turns a request into its facts, or into the response to send instead.
pub type FactsFn = Arc<
    dyn Fn(&http::request::Parts, &bytes::Bytes) -> Result<RequestFacts, Response> + Send + Sync,
>;

/// The admission middleware (see the module docs).
#[derive(Clone)]
pub struct Admission<S> {
    pub(super) inner: S,
    pub(super) layer: AdmissionLayer,
}

impl<S> std::fmt::Debug for Admission<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission").finish_non_exhaustive()
    }
}

/// An admitted request's handle, in the request's extensions. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AdmissionHandle {
    ticket: Arc<Mutex<Option<Ticket>>>,
    /// The output cap granted: send no more than this upstream.
    pub max_output_tokens: u64,
}

impl AdmissionHandle {
    /// Settles with the real usage. A second call does nothing.
    pub async fn settle(&self, usage: Usage) {
        let t = self.ticket.lock().ok().and_then(|mut g| g.take());
        if let Some(t) = t {
            let _ = t.settle(usage).await;
        }
    }
}

impl<S> tower::Service<Request<Body>> for Admission<S>
where
    S: tower::Service<Request<Body>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The clone that was polled ready serves this call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let bytes = match Limited::new(body, layer.max_body_bytes).collect().await {
                Ok(c) => c.to_bytes(),
                Err(_) => {
                    return Ok(ApiError::new(
                        http::StatusCode::PAYLOAD_TOO_LARGE,
                        "invalid_request_error",
                        "request_too_large",
                        "Request body too large.",
                    )
                    .into_response());
                }
            };
            let facts = match (layer.facts)(&parts, &bytes) {
                Ok(f) => f,
                Err(resp) => return Ok(resp),
            };
            let p = match plan(&layer.policy, &facts) {
                Ok(p) => p,
                Err(e) => {
                    return Ok(ApiError::invalid("unpriced_model", e.to_string()).into_response());
                }
            };
            let admitted = match layer.store.admit(&p).await {
                Ok(Decision::Admit(a)) => a,
                Ok(Decision::Deny(d)) => return Ok(respond::deny(&d).into_response()),
                Ok(Decision::Killed(k)) => return Ok(respond::killed(&k).into_response()),
                Err(_) => return Ok(respond::store_unavailable().into_response()),
            };
            let handle = AdmissionHandle {
                ticket: Arc::new(Mutex::new(Some(Ticket::new(
                    layer.store.clone(),
                    p.request_id.clone(),
                )))),
                max_output_tokens: admitted.max_output_tokens,
            };
            let mut req = Request::from_parts(parts, Body::from(bytes));
            req.extensions_mut().insert(handle);
            let mut resp = inner.call(req).await?;
            respond::admitted_headers(resp.headers_mut(), &p, &admitted);
            Ok(resp)
        })
    }
}
