//! The in-memory store, the embedded default: one mutex around the whole state, so a plan is
//! applied atomically across all of its scopes.
//!
//! Memory is bounded by what is live: rate windows are dropped two windows after their last
//! attempt, budget periods once they have ended and hold no reservation (both by a pass over
//! the scopes that starts once a second and goes a little per call, so that no call pays for a
//! million scopes), leases and reservations when their request ends or expires, and finished
//! request ids after the retention time or, beyond [`DEFAULT_MAX_REMEMBERED`] of them, oldest
//! first. The slots of ended tickets are kept for the next ones (with their holds' allocation),
//! so ticket memory stays at its peak of requests in flight at once.

use std::collections::BTreeMap;

mod admit;
mod containers;
mod expiries;
mod keys;
pub use keys::{MAX_KEPT_BYTES, MAX_KEYS};
mod slices;
mod state;
mod usage;
use state::{Fresh, PeriodCache, Resolved};
mod tickets;
use std::sync::{Arc, Mutex, MutexGuard};

use containers::{BlockQueue, Blocks, ShardedMap};
use smol_str::SmolStr;
use tickets::{Ticket, Tickets};

use crate::clock::{Clock, Millis, SharedClock, SystemClock};
#[cfg(test)]
use crate::decision::Reason;
use crate::decision::{Decision, Quota};
use crate::ledger::{Period, RateWindow, Usage};
use crate::pipeline::{Plan, charge};
use crate::policy::Unit;
use crate::scope::ScopeKey;
use crate::store::{Ending, Finish, Renewal, ScopeUsage, ShadowOutcome, Store, StoreError};

/// How long finished request ids are remembered, so that a late duplicate settlement is a no-op.
pub const DEFAULT_RETENTION_MS: u64 = 3_600_000;
/// Most finished request ids remembered at once (about 87 MB at the 87 bytes per id of up to 23
/// bytes, such as the gateway's, that the footprint bench measures; 151 MB for 36-byte ids);
/// beyond it the oldest are forgotten early, so memory stays bounded at any request rate. A
/// settlement of a forgotten id answers `Unknown`: still a no-op.
pub const DEFAULT_MAX_REMEMBERED: usize = 1_000_000;
/// The longest hint given for a concurrency retry: a lease usually ends long before it expires.
pub const CONCURRENCY_RETRY_HINT_MS: u64 = crate::controls::concurrency::RETRY_HINT_MS;
const FULL_SWEEP_EVERY_MS: u64 = 1_000;
/// Scope slots examined per call while a pass is under way: a pass over a million scopes is
/// spread over about a thousand calls instead of pausing one call for the whole pass, which every
/// request waiting on the lock would wait out too.
const PASS_SLOTS_PER_CALL: usize = 1024;
/// Most remembered ids forgotten in one call (a call remembers at most one more), so a clock
/// jump does not make one call forget them all at once.
const FORGET_PER_CALL: usize = 1024;

/// A request id as the store keeps it: inline up to 23 bytes (the gateway's ids fit), so that
/// a remembered id needs no allocation of its own and a lookup compares it where it reads the
/// entry; a longer id is one `Arc<str>` shared by the structures that hold it.
type Id = SmolStr;

/// The scope slots, in blocks.
type Slots = Blocks<ScopeState>;

/// The in-memory [`Store`], on the system clock unless given another (a test's paused time, a
/// replay's manual clock).
#[derive(Debug)]
pub struct MemoryStore<C = SharedClock> {
    clock: C,
    retention_ms: u64,
    max_remembered: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    last_now: Millis,
    next_full_sweep: Millis,
    /// The next slot of the pass over the scopes under way, if one is.
    pass: Option<usize>,
    /// Scope id -> its slot in `slots`. A plan names each scope in several checks and a ticket
    /// keeps slots, so an admission hashes each scope id once and a settlement not at all.
    scopes: ShardedMap<Arc<str>, usize>,
    /// Every control's state of a scope in one entry; slots of dropped scopes are in `free`.
    slots: Slots,
    free: Vec<usize>,
    /// In-flight requests and, for the retention time, how finished ones ended: one map, so an
    /// admission checks for a duplicate id with one lookup.
    requests: ShardedMap<Id, Request>,
    /// In-flight tickets, in order of expiry. A ticket leaves when it ends, so the sweep never
    /// meets a stale one and nothing needs rebuilding (a heap with entries left behind would be
    /// rebuilt from every remembered request, under the lock).
    tickets: Tickets,
    kills: BTreeMap<String, String>,
    /// Budget periods found by recent admissions: a period's id, start and end hold for every
    /// instant from its start to its end, so a calendar month's arithmetic runs once a month
    /// rather than once per admission.
    periods: PeriodCache,
    /// Finished ids in the order they may be forgotten (times only grow: the clock is monotonic
    /// inside the store and the retention is fixed).
    forget: BlockQueue<(Millis, Id)>,
    /// Idempotency keys.
    keys: keys::Keys,
    /// Expiries kept for a spend ledger, when asked for.
    expiries: expiries::Expiries,
}

#[derive(Debug, Default)]
struct ScopeState {
    /// The scope's id, to take it out of the map when the slot is freed; `None` when free.
    id: Option<Arc<str>>,
    /// (window length, window) of the rate control.
    rate: Option<(u64, RateWindow)>,
    /// Leases held: a count, not a set of requests. A ticket lists the scopes it holds a lease
    /// in and ends exactly once (settled, released or expired, under the lock), so the count
    /// is exact; a set cost a hash of the request id per lease at each end of a request.
    leases: u64,
    /// No later than the earliest expiry of a lease held (the earliest of those taken since the
    /// count was last zero), for the retry hint of a concurrency refusal.
    soonest: Millis,
    /// Budget cells by (period, period id): the current one and older ones still settling.
    cells: Vec<((Period, u64), Cell)>,
}

impl ScopeState {
    fn cell(&self, key: (Period, u64)) -> Option<&Cell> {
        self.cells.iter().find(|(k, _)| *k == key).map(|(_, c)| c)
    }

    /// The cell of `c`'s scope in period `pid` (`span`), or the one a first reservation in it
    /// starts: with what it carries over from the period before.
    fn cell_or_new(
        &self,
        c: &crate::controls::BudgetCheck,
        pid: u64,
        (start, end): (Millis, Millis),
    ) -> Cell {
        if let Some(cell) = self.cell((c.period, pid)) {
            return *cell;
        }
        let before = c
            .period
            .previous(pid)
            .and_then(|p| self.cell((c.period, p)))
            .map(|b| (b.carry, b.settled.saturating_add(b.reserved)));
        Cell {
            end,
            carry: crate::controls::budget::carried(c.carry_cap, c.limit, before),
            keep: if c.carry_cap > 0 {
                end.saturating_add(end.saturating_sub(start))
            } else {
                end
            },
            ..Cell::default()
        }
    }

    fn cell_mut(&mut self, key: (Period, u64)) -> Option<&mut Cell> {
        self.cells
            .iter_mut()
            .find(|(k, _)| *k == key)
            .map(|(_, c)| c)
    }
}

#[derive(Debug)]
enum Request {
    /// Its ticket's slot in [`Tickets`]: most entries are remembered ids (`Ended`), and the
    /// map's buckets are sized for its largest value.
    InFlight(u32),
    Ended(Ending),
}

#[derive(Debug, Default, Clone, Copy)]
struct Cell {
    settled: u64,
    reserved: u64,
    outstanding: u64,
    end: Millis,
    /// What the period adds to its limit of what the one before left unused.
    carry: u64,
    /// Kept at least until then: a budget that carries over keeps a period through the next,
    /// whose carry is found from it.
    keep: Millis,
}

#[derive(Debug)]
enum Hold {
    /// A lease in the scope at this slot.
    Lease(usize),
    Budget(Reservation),
}

#[derive(Debug)]
struct Reservation {
    /// The scope's slot: live tickets keep their scopes from being dropped, so it stays valid.
    slot: usize,
    period: Period,
    period_id: u64,
    unit: Unit,
    amount: u64,
    /// A shadow rule's: charged like the others, but not reported as the request's charge.
    shadow: bool,
    /// A slice's ([`crate::exchange`]), with the settled amount its instance has reported so far:
    /// an expiry charges the whole reservation, since what its instance spent of it is unknown.
    slice: Option<u64>,
}

impl MemoryStore {
    /// A store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(std::sync::Arc::new(SystemClock))
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> MemoryStore<C> {
    /// A store on the given clock.
    pub fn with_clock(clock: C) -> Self {
        Self {
            clock,
            retention_ms: DEFAULT_RETENTION_MS,
            max_remembered: DEFAULT_MAX_REMEMBERED,
            state: Mutex::new(State::default()),
        }
    }

    /// Sets how long finished request ids are remembered.
    #[must_use]
    pub fn retention_ms(mut self, ms: u64) -> Self {
        self.retention_ms = ms;
        self
    }

    /// Keeps up to `max` expiries for [`MemoryStore::expiries`] (a spend ledger drains them);
    /// past it the oldest are dropped and counted. Off (0) by default.
    #[must_use]
    pub fn keep_expiries(self, max: usize) -> Self {
        if let Ok(mut st) = self.state.lock() {
            st.expiries = expiries::Expiries::new(max);
        }
        self
    }

    /// Up to `max` expiries kept, oldest first, each with its tag for
    /// [`MemoryStore::ack_expiries`]; they stay until acknowledged.
    pub fn expiries(&self, max: usize) -> Result<Vec<(u64, crate::store::Expiry)>, StoreError> {
        let (st, _) = self.lock()?;
        Ok(st.expiries.peek(max))
    }

    /// Forgets the expiries up to and including `tag` (written to the ledger).
    pub fn ack_expiries(&self, tag: u64) -> Result<(), StoreError> {
        let (mut st, _) = self.lock()?;
        st.expiries.ack(tag);
        Ok(())
    }

    /// Sets the most finished request ids remembered at once (oldest forgotten first).
    #[must_use]
    pub fn max_remembered(mut self, n: usize) -> Self {
        self.max_remembered = n;
        self
    }

    fn lock(&self) -> Result<(MutexGuard<'_, State>, Millis), StoreError> {
        // Read before locking: the lock is held for as short a time as can be.
        let clock = self.clock.now();
        let mut st = self
            .state
            .lock()
            .map_err(|_| StoreError::Unavailable("memory store lock poisoned".into()))?;
        // Time never goes backwards inside the store: no negative windows, no refunds.
        let now = clock.max(st.last_now);
        st.last_now = now;
        st.sweep(now, self.retention_ms, self.max_remembered, false);
        Ok((st, now))
    }

    /// [`Store::admit`], synchronously.
    pub fn admit_sync(&self, plan: &Plan) -> Result<Decision, StoreError> {
        // Allocated before locking (wasted on a refusal, which is the rarer case).
        let fresh = Fresh {
            id: Id::new(&plan.request_id),
            quotas: Vec::with_capacity(plan.checks.len()),
        };
        let (mut st, now) = self.lock()?;
        st.admit(plan, now, fresh)
    }

    /// [`Store::admit_shadowed`], synchronously.
    pub fn admit_shadowed_sync(
        &self,
        plan: &Plan,
        shadow: &Plan,
    ) -> Result<(Decision, ShadowOutcome), StoreError> {
        let fresh = Fresh {
            id: Id::new(&plan.request_id),
            quotas: Vec::with_capacity(plan.checks.len()),
        };
        let (mut st, now) = self.lock()?;
        st.admit_shadowed(plan, shadow, now, fresh)
    }

    /// [`Store::settle`], synchronously.
    pub fn settle_sync(&self, request_id: &str, usage: Usage) -> Result<Finish, StoreError> {
        self.finish_sync(request_id, Some(usage), Ending::Settled)
    }

    fn finish_sync(
        &self,
        request_id: &str,
        usage: Option<Usage>,
        how: Ending,
    ) -> Result<Finish, StoreError> {
        let (mut st, now) = self.lock()?;
        Ok(st.finish(
            request_id,
            usage.map(Usage::bounded),
            how,
            now,
            self.retention_ms,
        ))
    }

    /// [`Store::release`], synchronously.
    pub fn release_sync(
        &self,
        request_id: &str,
        usage: Option<Usage>,
    ) -> Result<Finish, StoreError> {
        self.finish_sync(request_id, usage, Ending::Released)
    }

    /// [`Store::renew`], synchronously.
    pub fn renew_sync(&self, request_id: &str) -> Result<Renewal, StoreError> {
        let (mut st, now) = self.lock()?;
        let Some(&Request::InFlight(slot)) = st.requests.get(request_id) else {
            return Ok(Renewal::NotInFlight);
        };
        match st.tickets.renew(slot, now) {
            Some(expires_at) => Ok(Renewal::Renewed { expires_at }),
            None => Err(lost_ticket()),
        }
    }

    /// [`Store::set_kill`], synchronously.
    pub fn set_kill_sync(&self, target: &str, reason: Option<&str>) -> Result<(), StoreError> {
        let (mut st, now) = self.lock()?;
        match reason {
            Some(r) => st
                .kills
                .insert(target.to_owned(), crate::decision::Killed::anchored(r, now)),
            None => st.kills.remove(target),
        };
        Ok(())
    }

    /// [`Store::claim_key`], synchronously.
    pub fn claim_key_sync(
        &self,
        key: crate::store::KeyUse<'_>,
    ) -> Result<crate::store::KeyClaim, StoreError> {
        self.lock().map(|(mut st, now)| st.keys.claim(key, now))
    }

    /// [`Store::end_claim`], synchronously.
    pub fn end_claim_sync(
        &self,
        key: &str,
        request_id: &str,
        response: Option<&[u8]>,
        keep_ms: u64,
    ) -> Result<(), StoreError> {
        self.lock()
            .map(|(mut st, now)| st.keys.end(key, request_id, response, keep_ms, now))
    }

    /// Whether the store knows request `id`: in flight, or ended and still remembered.
    pub fn knows(&self, id: &str) -> Result<bool, StoreError> {
        let (st, _) = self.lock()?;
        Ok(st.requests.get(id).is_some())
    }

    /// The leases held in a scope and, for one of its budget periods (by id), what is settled
    /// and reserved in it: what a slice layer's engine has used of its slices.
    pub fn held(
        &self,
        scope: &str,
        cell: Option<(Period, u64)>,
    ) -> Result<(u64, u64, u64), StoreError> {
        let (st, _) = self.lock()?;
        let s = st.scopes.get(scope).and_then(|&i| st.slots.get(i));
        let leases = s.map_or(0, |s| s.leases);
        let (settled, reserved) = cell
            .and_then(|k| s?.cell(k))
            .map_or((0, 0), |c| (c.settled, c.reserved));
        Ok((leases, settled, reserved))
    }

    /// How many reservations are out in one budget period (by id) of a scope, whatever their
    /// amounts (a reservation of nothing may still settle a charge).
    pub fn open_reservations(
        &self,
        scope: &str,
        period: Period,
        period_id: u64,
    ) -> Result<u64, StoreError> {
        let (st, _) = self.lock()?;
        Ok(st
            .scopes
            .get(scope)
            .and_then(|&i| st.slots.get(i))
            .and_then(|s| s.cell((period, period_id)))
            .map_or(0, |c| c.outstanding))
    }

    /// How many scopes, tickets and remembered ids the store holds now (after sweeping).
    pub fn footprint(&self) -> Result<Footprint, StoreError> {
        let (st, _) = self.lock()?;
        Ok(Footprint {
            rate_scopes: st.live_scopes().filter(|s| s.rate.is_some()).count(),
            lease_scopes: st.live_scopes().filter(|s| s.leases > 0).count(),
            budget_cells: st.live_scopes().map(|s| s.cells.len()).sum(),
            in_flight: st.tickets.len(),
            remembered: st.requests.len() - st.tickets.len(),
            idempotency_keys: st.keys.footprint().0,
            kept_response_bytes: st.keys.footprint().1,
        })
    }

    /// Forces the periodic clean-up now (normally it runs at most once a second of clock time).
    pub fn sweep_all(&self) -> Result<(), StoreError> {
        let (mut st, now) = self.lock()?;
        st.sweep(now, self.retention_ms, self.max_remembered, true);
        Ok(())
    }
}

/// What a [`MemoryStore`] is holding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Scopes with a live rate window.
    pub rate_scopes: usize,
    /// Scopes with at least one lease.
    pub lease_scopes: usize,
    /// Budget (scope, period) cells.
    pub budget_cells: usize,
    /// Unfinished requests.
    pub in_flight: usize,
    /// Finished request ids remembered for idempotency.
    pub remembered: usize,
    /// Idempotency keys held (claimed or answered).
    pub idempotency_keys: usize,
    /// Bytes of the responses kept for them.
    pub kept_response_bytes: usize,
}

fn lost_slot() -> StoreError {
    StoreError::Protocol("memory store: a scope slot is missing".into())
}

fn too_many_in_flight() -> StoreError {
    StoreError::Protocol("memory store: 2^32 - 1 requests in flight".into())
}

fn lost_ticket() -> StoreError {
    StoreError::Protocol("memory store: a ticket slot is missing".into())
}

impl<C: Clock> Store for MemoryStore<C> {
    fn admit(&self, plan: &Plan) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        std::future::ready(self.admit_sync(plan))
    }
    fn admit_shadowed(
        &self,
        plan: &Plan,
        shadow: &Plan,
    ) -> impl Future<Output = Result<(Decision, ShadowOutcome), StoreError>> + Send {
        std::future::ready(self.admit_shadowed_sync(plan, shadow))
    }
    fn settle(
        &self,
        id: &str,
        usage: Usage,
    ) -> impl Future<Output = Result<Finish, StoreError>> + Send {
        std::future::ready(self.settle_sync(id, usage))
    }
    fn release(
        &self,
        id: &str,
        usage: Option<Usage>,
    ) -> impl Future<Output = Result<Finish, StoreError>> + Send {
        std::future::ready(self.release_sync(id, usage))
    }
    fn renew(&self, id: &str) -> impl Future<Output = Result<Renewal, StoreError>> + Send {
        std::future::ready(self.renew_sync(id))
    }
    fn usage(
        &self,
        scope_id: &str,
        period: Option<Period>,
    ) -> impl Future<Output = Result<ScopeUsage, StoreError>> + Send {
        std::future::ready(self.usage_sync(scope_id, period))
    }
    fn usage_carrying(
        &self,
        scope_id: &str,
        period: Period,
        carry: (u64, u64),
    ) -> impl Future<Output = Result<ScopeUsage, StoreError>> + Send {
        std::future::ready(self.usage_sync_carrying(scope_id, Some(period), Some(carry)))
    }
    fn set_kill(
        &self,
        target: &str,
        reason: Option<&str>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.set_kill_sync(target, reason))
    }
    fn claim_key(
        &self,
        key: crate::store::KeyUse<'_>,
    ) -> impl Future<Output = Result<crate::store::KeyClaim, StoreError>> + Send {
        std::future::ready(self.claim_key_sync(key))
    }
    fn end_claim(
        &self,
        key: &str,
        request_id: &str,
        response: Option<&[u8]>,
        keep_ms: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.end_claim_sync(key, request_id, response, keep_ms))
    }
    fn kills(&self) -> impl Future<Output = Result<Vec<(String, String)>, StoreError>> + Send {
        std::future::ready(self.lock().map(|(st, _)| {
            st.kills
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        }))
    }
}

use std::future::Future;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests;
