//! The layer.

use std::sync::Arc;

use tollgate_core::Policy;

use super::service::{Admission, FactsFn};
use crate::store::AnyStore;

/// Applies [`Admission`] to a service.
#[derive(Clone)]
pub struct AdmissionLayer {
    pub(super) policy: Policy,
    pub(super) store: AnyStore,
    pub(super) facts: FactsFn,
    pub(super) max_body_bytes: usize,
}

impl std::fmt::Debug for AdmissionLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionLayer")
            .field("policy", &self.policy.version)
            .finish()
    }
}

impl AdmissionLayer {
    /// A layer deciding with `policy` on `store`; `facts` turns a request (head and body) into
    /// its facts, or into the response to send instead.
    pub fn new(
        policy: Policy,
        store: AnyStore,
        facts: impl Fn(
            &http::request::Parts,
            &bytes::Bytes,
        ) -> Result<tollgate_core::RequestFacts, axum::response::Response>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self {
            policy,
            store,
            facts: Arc::new(facts),
            max_body_bytes: 1 << 20,
        }
    }

    /// Sets the body limit (default 1 MiB); larger bodies get 413.
    #[must_use]
    pub fn max_body_bytes(mut self, n: usize) -> Self {
        self.max_body_bytes = n;
        self
    }
}

impl<S> tower::Layer<S> for AdmissionLayer {
    type Service = Admission<S>;
    fn layer(&self, inner: S) -> Admission<S> {
        Admission {
            inner,
            layer: self.clone(),
        }
    }
}
