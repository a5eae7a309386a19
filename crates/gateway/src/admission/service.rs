//! The service.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::Request;
use http_body_util::{BodyExt, Limited};
use tollgate_core::{Decision, Store, Usage};

use super::future::ResponseFuture;
use super::layer::Admission;
use crate::path::admit::Controls;
use crate::respond;
use crate::store::AnyStore;
use crate::ticket::Ticket;

/// An admitted request's handle, in the request's extensions. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AdmissionHandle<S: Store + Clone + 'static = AnyStore> {
    ticket: Arc<Mutex<Option<Ticket<S>>>>,
    /// The output cap granted: send no more than this upstream.
    pub max_output_tokens: u64,
}

impl<S: Store + Clone + 'static> AdmissionHandle<S> {
    /// Settles with the real usage. A second call does nothing.
    pub async fn settle(&self, usage: Usage) {
        let t = self.ticket.lock().ok().and_then(|mut g| g.take());
        if let Some(t) = t {
            let _ = t.settle(usage).await;
        }
    }
}

impl<I, S> tower::Service<Request<Body>> for Admission<I, S>
where
    I: tower::Service<Request<Body>, Response = Response> + Clone + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store + Clone + std::fmt::Debug + 'static,
{
    type Response = Response;
    type Error = I::Error;
    type Future = ResponseFuture<I::Error>;

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
            let max = layer.max_body_bytes;
            let bytes = match Limited::new(body, max).collect().await {
                Ok(c) => c.to_bytes(),
                Err(_) => return Ok(respond::body_too_large(max).into_response()),
            };
            let facts = match (layer.facts)(&parts, &bytes) {
                Ok(f) => f,
                Err(resp) => return Ok(resp),
            };
            let (mut p, shadow) = match crate::path::plans(&layer.policy, &facts) {
                Ok(p) => p,
                Err(e) => return Ok(respond::unpriced_model(e).into_response()),
            };
            let controls = Controls {
                store: &layer.store,
                exempt: &layer.exempt,
                kills: &layer.kills,
                queue: layer.queue.as_ref().map(|(q, c)| (&**q, *c)),
                flow: crate::queue::Flow::of(&layer.policy, &facts),
                alerts: layer.alerts.as_ref(),
                on_lost: None,
            };
            let (admitted, shadowed) = match controls.decide_shadowed(&mut p, shadow).await {
                Ok((Decision::Admit(a), s)) => (a, s),
                Ok((refused, _)) => return Ok(respond::refusal(&refused).into_response()),
                Err(e) => return Ok(e.into_response()),
            };
            let mut ticket = Ticket::admitted(layer.store.clone(), &p, &admitted);
            ticket.shadow(shadowed.admitted());
            let handle = AdmissionHandle {
                ticket: Arc::new(Mutex::new(Some(ticket))),
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
