//! The settle step: an admitted request's [`Ticket`] ends in the store exactly once, with the
//! usage metered (settle) or what is known of it (release), retried in the background when the
//! store does not take it, and released by itself when it is dropped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tollgate_core::record::DecisionRecord;
use tollgate_core::{Finish, Renewal, Store, StoreError, Usage};

use crate::records::RecordSink;
use crate::store::AnyStore;

/// An admitted request's hold on the store. It must end in [`Ticket::settle`] or
/// [`Ticket::release`]; dropped without either (a client gone, a task cancelled), it releases
/// itself in the background with the usage known so far, or, when none is known, with what the
/// policy charges for an abandoned request. Long requests renew it. An ending that the store
/// does not take (unreachable, timed out) is retried in the background until it lands or the
/// ticket's lifetime has passed (then the store expires it): settlements and releases are
/// idempotent by request id, so a retry of one that did land changes nothing.
#[must_use = "an admitted request holds leases and a reservation"]
#[derive(Debug)]
pub struct Ticket<S: Store + Clone + 'static = AnyStore> {
    store: S,
    id: String,
    /// Usage known so far (streamed output), charged if the ticket is dropped.
    pub partial: Option<Usage>,
    ended: bool,
    renewer: Option<tokio::task::JoinHandle<()>>,
    record: Option<Box<Recording>>,
    in_flight: Option<crate::telemetry::InFlightGuard>,
    price: Option<tollgate_core::policy::Price>,
    /// Input + granted output: a settlement above it is flagged.
    estimate: u64,
    /// How long the store keeps the ticket without renewal: retries stop after it.
    lifetime: Duration,
    /// How long a dropped ticket waits before it releases (see [`Ticket::release_after`]).
    drop_grace: Duration,
    /// Admitted without the store (fail open): nothing to settle or release there.
    detached: bool,
    /// Counts the ticket as open until its request has ended in the store.
    open: Option<Open>,
    /// The request's admission under its shadow rules: renewed, settled and released with it.
    shadow: Option<String>,
    /// Where its ending is written in the spend ledger, when one is kept.
    booking: Option<Box<crate::books::Booking>>,
    /// How its fees are reckoned (tools the upstream runs, audio, a long context).
    fees: Option<tollgate_core::policy::FeeRule>,
    /// The fee-carrying calls its answer showed, once read (`None`: not known).
    used: Option<tollgate_core::Metered>,
    /// Its OpenTelemetry operation, when exported.
    op: Option<Box<crate::otel::Operation>>,
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

/// Endings being retried in the background, at most [`MAX_RETRYING`]: past it a failed ending
/// is given up at once (counted as lost; the store expires the ticket).
static RETRYING: AtomicUsize = AtomicUsize::new(0);
const MAX_RETRYING: usize = 10_000;

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

/// A settlement (with usage) or a release (with what is known, or the policy's charge).
#[derive(Debug, Clone, Copy)]
enum End {
    Settle(Usage),
    Release(Option<Usage>),
}

impl End {
    fn op(self) -> &'static str {
        match self {
            End::Settle(_) => "settle",
            End::Release(_) => "release",
        }
    }

    fn usage(self) -> Option<Usage> {
        match self {
            End::Settle(u) => Some(u),
            End::Release(u) => u,
        }
    }

    async fn call<S: Store>(self, store: &S, id: &str) -> Result<Finish, StoreError> {
        match self {
            End::Settle(u) => store.settle(id, u).await,
            End::Release(u) => store.release(id, u).await,
        }
    }
}

/// Calls `end` until the store answers, with backoff from 50 ms to 2 s, for at most `within`.
/// Returns the last answer and the attempts made.
async fn end_with_retries<S: Store>(
    store: &S,
    id: &str,
    end: End,
    first: Result<Finish, StoreError>,
    within: Duration,
) -> (Result<Finish, StoreError>, u32) {
    let deadline = tokio::time::Instant::now() + within;
    let mut wait = Duration::from_millis(50);
    let (mut last, mut attempts) = (first, 1u32);
    while matches!(last, Err(StoreError::Unavailable(_)))
        && tokio::time::Instant::now() + wait < deadline
    {
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(2));
        crate::telemetry::end_retried(end.op());
        attempts += 1;
        last = end.call(store, id).await;
    }
    if last.is_err() {
        crate::telemetry::end_lost(end.op());
    }
    (last, attempts)
}

/// Ends a shadow admission like its request; an ending the store did not take is retried in
/// the background, like any.
async fn end_shadow<S: Store + Clone + 'static>(
    store: &S,
    id: Option<String>,
    end: End,
    within: Duration,
) {
    let Some(id) = id else { return };
    let first = end.call(store, &id).await;
    if !matches!(first, Err(StoreError::Unavailable(_))) {
        return;
    }
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        crate::telemetry::end_lost(end.op());
        return;
    };
    if RETRYING.fetch_add(1, Ordering::SeqCst) >= MAX_RETRYING {
        RETRYING.fetch_sub(1, Ordering::SeqCst);
        crate::telemetry::end_lost(end.op());
        return;
    }
    let (store, open) = (store.clone(), Open::new());
    handle.spawn(async move {
        let _ = end_with_retries(&store, &id, end, first, within).await;
        RETRYING.fetch_sub(1, Ordering::SeqCst);
        drop(open);
    });
}

/// Releases, by id, a request whose admission the store may have applied although its answer
/// never came (the call timed out): nothing was forwarded, so nothing is charged. Retried in
/// the background like any ending; a release of an id the store never admitted is a no-op.
pub fn release_unanswered<S: Store + Clone + 'static>(store: &S, id: &str, within: Duration) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if RETRYING.fetch_add(1, Ordering::SeqCst) >= MAX_RETRYING {
        RETRYING.fetch_sub(1, Ordering::SeqCst);
        crate::telemetry::end_lost("release");
        return;
    }
    let (store, id, open) = (store.clone(), id.to_owned(), Open::new());
    handle.spawn(async move {
        let end = End::Release(Some(Usage::default()));
        // An admission still queued to be sent may be applied after a first release finds
        // nothing: "unknown" is asked again a little later, twice.
        for wait in [0, 500, 2000] {
            tokio::time::sleep(Duration::from_millis(wait)).await;
            let first = end.call(&store, &id).await;
            let (f, _) = end_with_retries(&store, &id, end, first, within).await;
            if !matches!(f, Ok(Finish::Unknown)) {
                break;
            }
        }
        RETRYING.fetch_sub(1, Ordering::SeqCst);
        drop(open);
    });
}

impl<S: Store + Clone + 'static> Ticket<S> {
    /// A ticket for an admitted request.
    pub fn new(store: S, id: String) -> Self {
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
            estimate: u64::MAX,
            lifetime: Duration::from_secs(60),
            drop_grace: Duration::ZERO,
            detached: false,
            shadow: None,
            booking: None,
            fees: None,
            used: None,
            op: None,
        }
    }

    /// Writes the request's ending to the spend ledger too.
    pub fn book_to(&mut self, booking: crate::books::Booking) {
        self.booking = Some(Box::new(booking));
    }

    /// Ends the shadow admission `id` with this ticket, the same way and with the same usage.
    pub fn shadow(&mut self, id: Option<String>) {
        self.shadow = id;
    }

    /// A ticket for a request admitted without the store (fail open): it counts and records
    /// like any other, but makes no store calls.
    pub fn detached(store: S, id: String) -> Self {
        let mut t = Self::new(store, id);
        t.detached = true;
        t
    }

    /// The ticket of a request admitted on plan `p`: tracked, and detached when it was admitted
    /// without the store.
    pub fn admitted(store: S, p: &tollgate_core::Plan, a: &tollgate_core::Admitted) -> Self {
        let id = p.request_id.clone();
        let mut t = if a.fail_open {
            Self::detached(store, id)
        } else {
            Self::new(store, id)
        };
        t.track(
            p.estimate_tokens(),
            p.price,
            Duration::from_millis(p.ttl_ms),
        );
        t.fees = p.fees;
        t
    }

    /// Notes the fee-carrying calls the answer showed: its fees are reckoned from them, not from
    /// the most the request allowed.
    pub fn tools_used(&mut self, used: tollgate_core::Metered) {
        self.used = Some(used);
    }

    /// `usage` with its fees, reckoned from what the answer showed (else the most allowed).
    fn with_fees(&self, usage: Usage) -> Usage {
        match &self.fees {
            Some(rule) => Usage {
                fees: rule.fees(&usage, self.used.as_ref()),
                ..usage
            },
            None => usage,
        }
    }

    /// Counts the request in the in-flight metrics until it ends, prices its settlement, and
    /// notes how long the store keeps it without renewal (`lifetime`).
    pub fn track(
        &mut self,
        estimate_tokens: u64,
        price: Option<tollgate_core::policy::Price>,
        lifetime: Duration,
    ) {
        self.in_flight = Some(crate::telemetry::InFlightGuard::new(estimate_tokens));
        self.price = price;
        self.estimate = estimate_tokens;
        self.lifetime = lifetime;
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

    /// Traces the request as `op` until it ends.
    pub fn trace(&mut self, op: Option<crate::otel::Operation>) {
        self.op = op.map(Box::new);
    }

    /// The first chunk of its stream arrived.
    pub fn first_chunk(&mut self) {
        if let Some(op) = self.op.as_mut() {
            op.first_chunk();
        }
    }

    /// Sets the upstream status for the record.
    pub fn upstream_status(&mut self, status: u16) {
        if let Some(op) = self.op.as_mut() {
            op.upstream_status(status);
        }
        if let Some(r) = self.record.as_mut() {
            r.record.upstream_status = Some(status);
        }
    }

    /// Notes that the upstream's usage numbers were not counts (the reservation is charged).
    pub fn usage_invalid(&mut self) {
        crate::telemetry::usage_invalid();
        if let Some(r) = self.record.as_mut() {
            r.record.usage_invalid = true;
        }
    }

    /// Notes that the upstream reported `reported` output tokens, fewer than were counted
    /// passing through (the count is charged).
    pub fn usage_underreported(&mut self, reported: u64) {
        crate::telemetry::usage_underreported();
        if let Some(r) = self.record.as_mut() {
            r.record.reported_output_tokens = Some(reported);
        }
    }

    /// Notes that the client went away before the answer's end (the answer is read on).
    pub fn client_left(&mut self) {
        crate::telemetry::client_left();
        if let Some(r) = self.record.as_mut() {
            r.record.client_left = true;
        }
    }

    /// Dropped without an ending (its client left), the ticket waits `grace` before it releases:
    /// the upstream may go on working until it notices the closed connection.
    pub fn release_after(&mut self, grace: Duration) {
        self.drop_grace = grace;
    }

    /// Renews the leases every `every` until the ticket ends.
    pub fn renew_every(&mut self, every: Duration) {
        let (store, id, shadow) = (self.store.clone(), self.id.clone(), self.shadow.clone());
        self.renewer = Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                if let Some(s) = &shadow {
                    let _ = store.renew(s).await;
                }
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

    /// Input + granted output: what a settlement may reach before it is flagged.
    pub fn estimate(&self) -> u64 {
        self.estimate
    }

    /// Leaves the request to the store without ending it: another instance may end it, or its
    /// lease expires and the policy charges the reservation. Its record says so.
    pub fn let_go(mut self) {
        self.ended = true;
        self.stop_renewing();
        self.in_flight = None;
        if let Some(op) = self.op.take() {
            op.end(None, "left_to_store");
        }
        self.write_record("left_to_store", None, 1);
    }

    /// Ends the request with its reported usage (bounded, see [`Usage::bounded`]); a settlement
    /// above the reservation is charged, counted and flagged in the record.
    pub async fn settle(self, usage: Usage) -> Result<Finish, StoreError> {
        let usage = self.with_fees(usage).bounded();
        self.end(End::Settle(usage), "settled").await
    }

    /// Ends a failed or cancelled request.
    pub async fn release(self, usage: Option<Usage>) -> Result<Finish, StoreError> {
        let usage = usage.map(|u| self.with_fees(u).bounded());
        self.end(End::Release(usage), "released").await
    }

    async fn end(mut self, end: End, ending: &'static str) -> Result<Finish, StoreError> {
        self.ended = true;
        self.stop_renewing();
        let usage = end.usage();
        if usage.is_some_and(|u| u.total() > self.estimate) {
            crate::telemetry::over_reservation();
            if let Some(r) = self.record.as_mut() {
                r.record.over_reservation = true;
            }
        }
        self.count_usage(usage.as_ref());
        if let Some(op) = self.op.take() {
            op.end(usage.as_ref(), ending);
        }
        self.in_flight = None;
        if let Some(r) = self.record.as_mut() {
            r.record.usage = usage;
        }
        let shadow = self.shadow.take();
        if self.detached {
            end_shadow(&self.store, shadow, end, self.lifetime).await;
            self.write_record(ending, Some(&Ok(Finish::Unknown)), 1);
            if let Some(b) = self.booking.take() {
                b.book(&self.id, "fail_open", &Ok(Finish::Unknown), usage);
            }
            return Ok(Finish::Unknown);
        }
        // Joined: on Redis both endings travel in one batch.
        let (f, ()) = tokio::join!(
            end.call(&self.store, &self.id),
            end_shadow(&self.store, shadow, end, self.lifetime)
        );
        if !matches!(f, Err(StoreError::Unavailable(_))) {
            self.write_record(ending, Some(&f), 1);
            if let Some(b) = self.booking.take() {
                b.book(&self.id, ending, &f, usage);
            }
            return f;
        }
        self.retry_in_background(end, ending, f.clone());
        f
    }

    /// Retries an ending the store did not take, off the request's path; the record is written
    /// once it lands (or is given up: `lost`).
    fn retry_in_background(
        &mut self,
        end: End,
        ending: &'static str,
        first: Result<Finish, StoreError>,
    ) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            self.write_record("lost", None, 1);
            return;
        };
        if RETRYING.fetch_add(1, Ordering::SeqCst) >= MAX_RETRYING {
            RETRYING.fetch_sub(1, Ordering::SeqCst);
            crate::telemetry::end_lost(end.op());
            self.write_record("lost", None, 1);
            return;
        }
        let (store, id, open, lifetime) = (
            self.store.clone(),
            std::mem::take(&mut self.id),
            self.open.take(),
            self.lifetime,
        );
        let mut record = self.record.take();
        let booking = self.booking.take();
        handle.spawn(async move {
            let (f, attempts) = end_with_retries(&store, &id, end, first, lifetime).await;
            if let Some(b) = booking {
                b.book(&id, ending, &f, end.usage());
            }
            let ending = if f.is_ok() { ending } else { "lost" };
            write_record(&mut record, ending, Some(&f), attempts);
            RETRYING.fetch_sub(1, Ordering::SeqCst);
            drop(open);
        });
    }

    fn write_record(
        &mut self,
        ending: &'static str,
        finish: Option<&Result<Finish, StoreError>>,
        attempts: u32,
    ) {
        write_record(&mut self.record, ending, finish, attempts);
    }

    fn stop_renewing(&mut self) {
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
    }
}

fn write_record(
    record: &mut Option<Box<Recording>>,
    ending: &'static str,
    finish: Option<&Result<Finish, StoreError>>,
    attempts: u32,
) {
    if let Some(mut r) = record.take() {
        r.record.ending = Some(ending);
        r.record.upstream_ms =
            Some(u64::try_from(r.admitted_at.elapsed().as_millis()).unwrap_or(u64::MAX));
        if let Some(Ok(Finish::Done { charged })) = finish {
            r.record.settled = Some(charged.clone());
        }
        if attempts > 1 {
            r.record.end_attempts = Some(attempts);
        }
        r.sink.emit(r.record);
    }
}

impl<S: Store + Clone + 'static> Drop for Ticket<S> {
    fn drop(&mut self) {
        self.stop_renewing();
        if self.ended {
            return;
        }
        self.partial = self.partial.map(|u| self.with_fees(u));
        if let (Some(r), Some(u)) = (self.record.as_mut(), self.partial) {
            r.record.usage = Some(u.bounded());
        }
        self.count_usage(self.partial.as_ref());
        if let Some(op) = self.op.take() {
            op.end(self.partial.as_ref(), "abandoned");
        }
        if self.detached {
            self.write_record("abandoned", None, 1);
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            self.write_record("abandoned", None, 1);
            return;
        };
        let (store, id, usage, open, lifetime, grace) = (
            self.store.clone(),
            std::mem::take(&mut self.id),
            self.partial.map(Usage::bounded),
            self.open.take(),
            self.lifetime,
            self.drop_grace,
        );
        let shadow = self.shadow.take();
        let booking = self.booking.take();
        let mut record = self.record.take();
        handle.spawn(async move {
            if !grace.is_zero() {
                tokio::time::sleep(grace).await;
            }
            // Retried like any ending; if it never lands, the lease expires and the policy
            // charges the reservation.
            let end = End::Release(usage);
            end_shadow(&store, shadow, end, lifetime).await;
            let first = end.call(&store, &id).await;
            let (f, attempts) = end_with_retries(&store, &id, end, first, lifetime).await;
            if let Some(b) = booking {
                b.book(&id, "released", &f, usage);
            }
            // The record says what the store charged, once it has.
            write_record(&mut record, "abandoned", Some(&f), attempts);
            drop(open);
        });
    }
}
