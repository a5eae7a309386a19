//! The store the gateway was configured with, and the ticket of an admitted request.

use std::sync::Arc;

use tollgate_core::pipeline::Plan;
use tollgate_core::{
    Decision, Finish, MemoryStore, Period, Renewal, ScopeUsage, Store, StoreError, Usage,
};
use tollgate_redis::RedisStore;

/// Memory or Redis.
#[derive(Debug, Clone)]
pub enum AnyStore {
    /// In this process.
    Memory(Arc<MemoryStore>),
    /// Shared through Redis.
    Redis(RedisStore),
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            AnyStore::Memory($s) => $e.await,
            AnyStore::Redis($s) => $e.await,
        }
    };
}

impl Store for AnyStore {
    async fn admit(&self, plan: &Plan) -> Result<Decision, StoreError> {
        both!(self, s => s.admit(plan))
    }
    async fn settle(&self, id: &str, usage: Usage) -> Result<Finish, StoreError> {
        both!(self, s => s.settle(id, usage))
    }
    async fn release(&self, id: &str, usage: Option<Usage>) -> Result<Finish, StoreError> {
        both!(self, s => s.release(id, usage))
    }
    async fn renew(&self, id: &str) -> Result<Renewal, StoreError> {
        both!(self, s => s.renew(id))
    }
    async fn usage(&self, scope: &str, period: Option<Period>) -> Result<ScopeUsage, StoreError> {
        both!(self, s => s.usage(scope, period))
    }
}

/// An admitted request's hold on the store. It must end in [`Ticket::settle`] or
/// [`Ticket::release`]; dropped without either (a client gone, a task cancelled), it releases
/// itself in the background with the usage known so far, or, when none is known, with what the
/// policy charges for an abandoned request. Long requests renew it.
#[must_use = "an admitted request holds leases and a reservation"]
#[derive(Debug)]
pub struct Ticket {
    store: AnyStore,
    id: String,
    /// Usage known so far (streamed output), charged if the ticket is dropped.
    pub partial: Option<Usage>,
    ended: bool,
    renewer: Option<tokio::task::JoinHandle<()>>,
}

impl Ticket {
    /// A ticket for an admitted request.
    pub fn new(store: AnyStore, id: String) -> Self {
        Self {
            store,
            id,
            partial: None,
            ended: false,
            renewer: None,
        }
    }

    /// Renews the leases every `every` until the ticket ends.
    pub fn renew_every(&mut self, every: std::time::Duration) {
        let (store, id) = (self.store.clone(), self.id.clone());
        self.renewer = Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                if !matches!(store.renew(&id).await, Ok(Renewal::Renewed { .. }) | Err(_)) {
                    break;
                }
            }
        }));
    }

    /// The request id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Ends the request with its reported usage.
    pub async fn settle(mut self, usage: Usage) -> Result<Finish, StoreError> {
        self.ended = true;
        self.stop_renewing();
        self.store.settle(&self.id, usage).await
    }

    /// Ends a failed or cancelled request.
    pub async fn release(mut self, usage: Option<Usage>) -> Result<Finish, StoreError> {
        self.ended = true;
        self.stop_renewing();
        self.store.release(&self.id, usage).await
    }

    fn stop_renewing(&mut self) {
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.stop_renewing();
        if self.ended {
            return;
        }
        let (store, id, usage) = (
            self.store.clone(),
            std::mem::take(&mut self.id),
            self.partial,
        );
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                // If this fails too, the lease expires and the policy charges the reservation.
                let _ = store.release(&id, usage).await;
            });
        }
    }
}
