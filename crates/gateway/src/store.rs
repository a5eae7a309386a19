//! The store the gateway was configured with, and the ticket of an admitted request.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tollgate_core::pipeline::Plan;
use tollgate_core::record::DecisionRecord;
use tollgate_core::{
    Decision, Finish, MemoryStore, Period, Renewal, ScopeUsage, Store, StoreError, Usage,
};
use tollgate_redis::RedisStore;

use crate::records::RecordSink;

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

impl AnyStore {
    /// Whether the store answers (`/readyz`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(_) => Ok(()),
            AnyStore::Redis(r) => r.ping().await,
        }
    }
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
    async fn set_kill(&self, target: &str, reason: Option<&str>) -> Result<(), StoreError> {
        both!(self, s => s.set_kill(target, reason))
    }
    async fn kills(&self) -> Result<Vec<(String, String)>, StoreError> {
        both!(self, s => s.kills())
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
    record: Option<Box<Recording>>,
    in_flight: Option<crate::telemetry::InFlightGuard>,
    price: Option<tollgate_core::policy::Price>,
    /// Admitted without the store (fail open): nothing to settle or release there.
    detached: bool,
    /// Counts the ticket as open until its request has ended in the store.
    open: Option<Open>,
}

/// A request's decision record, completed and written when the ticket ends.
#[derive(Debug)]
pub struct Recording {
    /// The record so far.
    pub record: DecisionRecord,
    /// Where it goes.
    pub sink: RecordSink,
    /// When the request was admitted.
    pub admitted_at: std::time::Instant,
}

/// Tickets of this process whose request has not ended in the store yet (a release spawned by
/// a dropped ticket counts until it has run): a shutdown waits for them.
static OPEN_TICKETS: AtomicUsize = AtomicUsize::new(0);

/// How many tickets of this process have not ended in the store yet.
pub fn open_tickets() -> usize {
    OPEN_TICKETS.load(Ordering::SeqCst)
}

/// One open ticket, counted in [`OPEN_TICKETS`] until dropped.
#[derive(Debug)]
struct Open;

impl Open {
    fn new() -> Self {
        OPEN_TICKETS.fetch_add(1, Ordering::SeqCst);
        Self
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        OPEN_TICKETS.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Ticket {
    /// A ticket for an admitted request.
    pub fn new(store: AnyStore, id: String) -> Self {
        Self {
            open: Some(Open::new()),
            store,
            id,
            partial: None,
            ended: false,
            renewer: None,
            record: None,
            in_flight: None,
            price: None,
            detached: false,
        }
    }

    /// A ticket for a request admitted without the store (fail open): it counts and records
    /// like any other, but makes no store calls.
    pub fn detached(store: AnyStore, id: String) -> Self {
        let mut t = Self::new(store, id);
        t.detached = true;
        t
    }

    /// Counts the request in the in-flight metrics until it ends, and prices its settlement.
    pub fn track(&mut self, estimate_tokens: u64, price: Option<tollgate_core::policy::Price>) {
        self.in_flight = Some(crate::telemetry::InFlightGuard::new(estimate_tokens));
        self.price = price;
    }

    fn count_usage(&self, usage: Option<&Usage>) {
        match usage {
            Some(u) => crate::telemetry::settled(
                u.input_tokens,
                u.output_tokens,
                self.price.map(|p| p.cost(u)),
            ),
            None => crate::telemetry::abandoned(),
        }
    }

    /// Writes `record` when the ticket ends, completed with how it ended.
    pub fn record_to(&mut self, record: DecisionRecord, sink: RecordSink) {
        self.record = Some(Box::new(Recording {
            record,
            sink,
            admitted_at: std::time::Instant::now(),
        }));
    }

    /// Sets the upstream status for the record.
    pub fn upstream_status(&mut self, status: u16) {
        if let Some(r) = self.record.as_mut() {
            r.record.upstream_status = Some(status);
        }
    }

    fn write_record(&mut self, ending: &'static str, finish: Option<&Result<Finish, StoreError>>) {
        if let Some(mut r) = self.record.take() {
            r.record.ending = Some(ending);
            r.record.upstream_ms =
                Some(u64::try_from(r.admitted_at.elapsed().as_millis()).unwrap_or(u64::MAX));
            if let Some(Ok(Finish::Done { charged })) = finish {
                r.record.settled = Some(charged.clone());
            }
            r.sink.emit(r.record);
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
        let f = if self.detached {
            Ok(Finish::Unknown)
        } else {
            self.store.settle(&self.id, usage).await
        };
        self.count_usage(Some(&usage));
        self.in_flight = None;
        self.write_record("settled", Some(&f));
        f
    }

    /// Ends a failed or cancelled request.
    pub async fn release(mut self, usage: Option<Usage>) -> Result<Finish, StoreError> {
        self.ended = true;
        self.stop_renewing();
        let f = if self.detached {
            Ok(Finish::Unknown)
        } else {
            self.store.release(&self.id, usage).await
        };
        self.count_usage(usage.as_ref());
        self.in_flight = None;
        self.write_record("released", Some(&f));
        f
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
        self.write_record("abandoned", None);
        self.count_usage(self.partial.as_ref());
        if self.detached {
            return;
        }
        let (store, id, usage, open) = (
            self.store.clone(),
            std::mem::take(&mut self.id),
            self.partial,
            self.open.take(),
        );
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                // If this fails too, the lease expires and the policy charges the reservation.
                let _ = store.release(&id, usage).await;
                drop(open);
            });
        }
    }
}
