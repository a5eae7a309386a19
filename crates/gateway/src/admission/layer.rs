//! The layer.

use std::sync::Arc;

use axum::response::Response;
use tollgate_core::{Policy, Reason, RequestFacts, Store};

use crate::config::QueueConfig;
use crate::queue::Queue;
use crate::store::AnyStore;

/// Applies [`Admission`] to a service. Generic over the store: any [`Store`] (the memory store,
/// Redis, or [`AnyStore`] for either).
pub struct AdmissionLayer<S = AnyStore> {
    pub(super) policy: Arc<Policy>,
    pub(super) store: S,
    pub(super) facts: FactsFn,
    pub(super) max_body_bytes: usize,
    pub(super) exempt: Arc<[Reason]>,
    pub(super) kills: Arc<[(String, String)]>,
    pub(super) queue: Option<(Arc<Queue>, QueueConfig)>,
    pub(super) alerts: Option<crate::alerts::Alerts>,
}

impl<S: Clone> Clone for AdmissionLayer<S> {
    fn clone(&self) -> Self {
        Self {
            policy: self.policy.clone(),
            store: self.store.clone(),
            facts: self.facts.clone(),
            max_body_bytes: self.max_body_bytes,
            exempt: self.exempt.clone(),
            kills: self.kills.clone(),
            queue: self.queue.clone(),
            alerts: self.alerts.clone(),
        }
    }
}

impl<S> std::fmt::Debug for AdmissionLayer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionLayer")
            .field("policy", &self.policy.version)
            .finish_non_exhaustive()
    }
}

impl<S: Store + Clone + 'static> AdmissionLayer<S> {
    /// A layer deciding with `policy` on `store`; `facts` turns a request (head and body) into
    /// its facts, or into the response to send instead.
    pub fn new(
        policy: Policy,
        store: S,
        facts: impl Fn(
            &http::request::Parts,
            &bytes::Bytes,
        ) -> Result<tollgate_core::RequestFacts, axum::response::Response>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self {
            policy: Arc::new(policy),
            store,
            facts: Arc::new(facts),
            max_body_bytes: 1 << 20,
            exempt: Arc::from([]),
            kills: Arc::from([]),
            queue: None,
            alerts: None,
        }
    }

    /// Sets the body limit (default 1 MiB); larger bodies get 413.
    #[must_use]
    pub fn max_body_bytes(mut self, n: usize) -> Self {
        self.max_body_bytes = n;
        self
    }

    /// Exempts every request from these controls (as a key's `exempt` does in the proxy).
    #[must_use]
    pub fn exempt(mut self, reasons: impl IntoIterator<Item = Reason>) -> Self {
        self.exempt = reasons.into_iter().collect();
        self
    }

    /// Kill switches that hold whatever the store holds: `(target, reason)`, as the proxy's
    /// `[[kill]]` entries.
    #[must_use]
    pub fn kills(mut self, kills: impl IntoIterator<Item = (String, String)>) -> Self {
        self.kills = kills.into_iter().collect();
        self
    }

    /// A request that meets a full concurrency scope waits in a bounded queue, as the proxy's
    /// `[queue]`; its place is its identity's key (or tenant).
    #[must_use]
    pub fn queue(mut self, q: QueueConfig) -> Self {
        self.queue = Some((Arc::new(Queue::default()), q));
        self
    }

    /// Tells budget thresholds (`alert_at`), exhausted budgets and a store's loss to `alerts`,
    /// as the proxy does (start their delivery with [`crate::alerts::Alerts::spawn`]).
    #[must_use]
    pub fn alerts(mut self, alerts: crate::alerts::Alerts) -> Self {
        self.alerts = Some(alerts);
        self
    }
}

impl<S: Clone, I> tower::Layer<I> for AdmissionLayer<S> {
    type Service = Admission<I, S>;
    fn layer(&self, inner: I) -> Admission<I, S> {
        Admission {
            inner,
            layer: self.clone(),
        }
    }
}

/// Turns a request into its facts, or into the response to send instead.
pub type FactsFn = Arc<
    dyn Fn(&http::request::Parts, &bytes::Bytes) -> Result<RequestFacts, Response> + Send + Sync,
>;

/// The admission middleware (see the module docs).
pub struct Admission<I, S = AnyStore> {
    pub(super) inner: I,
    pub(super) layer: AdmissionLayer<S>,
}

impl<I: Clone, S: Clone> Clone for Admission<I, S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<I, S> std::fmt::Debug for Admission<I, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission").finish_non_exhaustive()
    }
}
