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

use std::borrow::Borrow;
use std::collections::{BTreeMap, VecDeque};

mod tickets;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};
use tickets::{Ticket, Tickets};

use hashbrown::HashTable;
use smol_str::SmolStr;

use crate::clock::{Clock, Millis, SystemClock};
use crate::decision::{Admitted, Decision, Deny, Quota, Reason};
use crate::ledger::{Period, RateWindow, Usage};
use crate::pipeline::{Plan, charge};
use crate::policy::Unit;
use crate::scope::ScopeKey;
use crate::store::{Ending, Finish, Renewal, ScopeUsage, Store, StoreError};

/// How long finished request ids are remembered, so that a late duplicate settlement is a no-op.
pub const DEFAULT_RETENTION_MS: u64 = 3_600_000;
/// Most finished request ids remembered at once (about 87 MB at the 87 bytes per id of up to 23
/// bytes, such as the gateway's, that the footprint bench measures; 151 MB for 36-byte ids);
/// beyond it the oldest are forgotten early, so memory stays bounded at any request rate. A
/// settlement of a forgotten id answers `Unknown`: still a no-op.
pub const DEFAULT_MAX_REMEMBERED: usize = 1_000_000;
/// The longest hint given for a concurrency retry: a lease usually ends long before it expires.
pub const CONCURRENCY_RETRY_HINT_MS: u64 = 1_000;
const FULL_SWEEP_EVERY_MS: u64 = 1_000;
/// Scope slots examined per call while a pass is under way: a pass over a million scopes is
/// spread over about a thousand calls (some 30 µs each) instead of pausing one call for 60 to
/// 110 ms, which every request waiting on the lock would wait out too.
const PASS_SLOTS_PER_CALL: usize = 1024;
/// Most remembered ids forgotten in one call (a call remembers at most one more), so a clock
/// jump does not make one call forget them all at once.
const FORGET_PER_CALL: usize = 1024;

/// A request id as the store keeps it: inline up to 23 bytes (the gateway's ids fit), so that
/// a remembered id needs no allocation of its own and a lookup compares it where it reads the
/// entry; a longer id is one `Arc<str>` shared by the structures that hold it.
type Id = SmolStr;

/// Entries per block of a [`BlockQueue`].
const BLOCK: usize = 4096;

/// A first-in, first-out queue kept in blocks of at most [`BLOCK`] entries, so that growing
/// moves at most half a block: a `VecDeque` of a million remembered ids (24 MB) copied its
/// wrapped part when it doubled, under the store's lock. A block grows like any vector up to
/// [`BLOCK`], so a small store holds no more than it needs.
#[derive(Debug)]
struct BlockQueue<T> {
    blocks: VecDeque<VecDeque<T>>,
    len: usize,
}

impl<T> Default for BlockQueue<T> {
    fn default() -> Self {
        Self {
            blocks: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> BlockQueue<T> {
    fn push_back(&mut self, v: T) {
        match self.blocks.back_mut() {
            Some(b) if b.len() < BLOCK => b.push_back(v),
            _ => {
                let mut b = VecDeque::new();
                b.push_back(v);
                self.blocks.push_back(b);
            }
        }
        self.len += 1;
    }

    fn front(&self) -> Option<&T> {
        self.blocks.front()?.front()
    }

    fn pop_front(&mut self) -> Option<T> {
        let b = self.blocks.front_mut()?;
        let v = b.pop_front();
        if b.is_empty() {
            self.blocks.pop_front();
        }
        if v.is_some() {
            self.len -= 1;
        }
        v
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// A vector in blocks of at most [`BLOCK`], for the same reasons as [`BlockQueue`]: a vector
/// of a million scopes (about 140 MB) moved when it doubled.
#[derive(Debug)]
struct Blocks<T> {
    blocks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Blocks<T> {
    fn default() -> Self {
        Self {
            blocks: Vec::new(),
            len: 0,
        }
    }
}

/// Every scope's state, by slot.
type Slots = Blocks<ScopeState>;

impl<T> Blocks<T> {
    fn get(&self, i: usize) -> Option<&T> {
        self.blocks.get(i / BLOCK)?.get(i % BLOCK)
    }

    fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.blocks.get_mut(i / BLOCK)?.get_mut(i % BLOCK)
    }

    fn len(&self) -> usize {
        self.len
    }

    /// Appends a slot and returns its index.
    fn push(&mut self, s: T) -> usize {
        match self.blocks.last_mut() {
            Some(b) if b.len() < BLOCK => b.push(s),
            _ => {
                self.blocks.push(vec![s]);
            }
        }
        self.len += 1;
        self.len - 1
    }
}

/// One shard of a [`ShardedMap`]: (id, value) entries.
type Table<K, V> = HashTable<(K, V)>;

/// Maps of [`ShardedMap`].
const SHARDS: usize = 128;

/// A hash map by string id, split into [`SHARDS`] tables by bits of the id's hash that the
/// tables themselves do not use. A hash table grows in one step, moving every entry, and the
/// store grows its maps under its lock: one map of a million remembered ids made one call wait
/// 85 ms. Split, a growth moves a 128th of the entries (256 shards cut the pause further but
/// cost about 50 ns per admission and settlement in the same-run benchmark; 128 cost none
/// measurable). Each operation hashes the id once.
#[derive(Debug)]
struct ShardedMap<K, V> {
    hasher: foldhash::fast::RandomState,
    tables: Box<[Table<K, V>]>,
    len: usize,
}

impl<K, V> Default for ShardedMap<K, V> {
    fn default() -> Self {
        Self {
            hasher: foldhash::fast::RandomState::default(),
            tables: (0..SHARDS).map(|_| HashTable::new()).collect(),
            len: 0,
        }
    }
}

impl<K: Borrow<str>, V> ShardedMap<K, V> {
    fn hash(&self, id: &str) -> u64 {
        self.hasher.hash_one(id)
    }

    /// Bits from 32 up: a table uses the low bits for the bucket and the top seven as the tag.
    fn shard(hash: u64) -> usize {
        (hash >> 32) as usize % SHARDS
    }

    fn get(&self, id: &str) -> Option<&V> {
        self.get_hashed(self.hash(id), id)
    }

    /// [`Self::get`] of an id whose hash `h` the caller has already computed.
    fn get_hashed(&self, h: u64, id: &str) -> Option<&V> {
        let (_, v) = self
            .tables
            .get(Self::shard(h))?
            .find(h, |(k, _)| k.borrow() == id)?;
        Some(v)
    }

    /// The entry's own key (to share it) and its value.
    fn get_entry_mut(&mut self, id: &str) -> Option<(&K, &mut V)> {
        let h = self.hash(id);
        let (k, v) = self
            .tables
            .get_mut(Self::shard(h))?
            .find_mut(h, |(k, _)| k.borrow() == id)?;
        Some((&*k, v))
    }

    fn get_mut(&mut self, id: &str) -> Option<&mut V> {
        self.get_entry_mut(id).map(|(_, v)| v)
    }

    /// Whether the id, whose hash is `h` ([`Self::hash`]), has an entry.
    fn contains_hashed(&self, h: u64, id: &str) -> bool {
        self.get_hashed(h, id).is_some()
    }

    /// Inserts an id that the caller has just found absent (under the same lock).
    fn insert_new(&mut self, id: K, v: V) {
        let h = self.hash(id.borrow());
        self.insert_new_hashed(h, id, v);
    }

    /// [`Self::insert_new`] of an id whose hash `h` the caller has already computed.
    fn insert_new_hashed(&mut self, h: u64, id: K, v: V) {
        let hasher = &self.hasher;
        if let Some(t) = self.tables.get_mut(Self::shard(h)) {
            t.insert_unique(h, (id, v), |(k, _)| hasher.hash_one::<&str>(k.borrow()));
            self.len += 1;
        }
    }

    /// Removes the id's entry if `pred` holds for its value.
    fn remove_if(&mut self, id: &str, pred: impl FnOnce(&V) -> bool) -> Option<V> {
        let h = self.hash(id);
        let t = self.tables.get_mut(Self::shard(h))?;
        let entry = t.find_entry(h, |(k, _)| k.borrow() == id).ok()?;
        if !pred(&entry.get().1) {
            return None;
        }
        let ((_, v), _) = entry.remove();
        self.len -= 1;
        Some(v)
    }

    fn remove(&mut self, id: &str) -> Option<V> {
        self.remove_if(id, |_| true)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn values(&self) -> impl Iterator<Item = &V> {
        self.tables.iter().flat_map(|t| t.iter().map(|(_, v)| v))
    }
}

/// The in-memory [`Store`].
#[derive(Debug)]
pub struct MemoryStore<C = SystemClock> {
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
    /// meets a stale one and nothing needs rebuilding: a heap with entries left behind had to
    /// be rebuilt from every remembered request, a pause of about 16 ms at 1,000,000 of them.
    tickets: Tickets,
    kills: BTreeMap<String, String>,
    /// Budget periods found by recent admissions: a period's id, start and end hold for every
    /// instant from its start to its end, so a calendar month's arithmetic runs once a month
    /// rather than once per admission.
    periods: PeriodCache,
    /// Finished ids in the order they may be forgotten (times only grow: the clock is monotonic
    /// inside the store and the retention is fixed).
    forget: BlockQueue<(Millis, Id)>,
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
}

impl MemoryStore<SystemClock> {
    /// A store on the system clock.
    pub fn new() -> Self {
        // The clock's first read calibrates the CPU's counter (about a millisecond on the test
        // machines, up to 200 ms by quanta's documentation): here, not in the first admission.
        SystemClock.now();
        Self::with_clock(SystemClock)
    }
}

impl Default for MemoryStore<SystemClock> {
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
            quotas: Vec::with_capacity(
                plan.rate.len() + plan.concurrency.len() + plan.budget.len(),
            ),
        };
        let (mut st, now) = self.lock()?;
        st.admit(plan, now, fresh)
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
        let (mut st, _) = self.lock()?;
        match reason {
            Some(r) => st.kills.insert(target.to_owned(), r.to_owned()),
            None => st.kills.remove(target),
        };
        Ok(())
    }

    /// [`Store::usage`], synchronously.
    pub fn usage_sync(
        &self,
        scope_id: &str,
        period: Option<Period>,
    ) -> Result<ScopeUsage, StoreError> {
        let (st, now) = self.lock()?;
        let scope = st.scopes.get(scope_id).and_then(|&i| st.slots.get(i));
        let leases = scope.map_or(0, |s| s.leases);
        let cell = period
            .and_then(|p| scope?.cell((p, p.at(now).0)).copied())
            .unwrap_or_default();
        Ok(ScopeUsage {
            settled: cell.settled,
            reserved: cell.reserved,
            leases,
        })
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
}

/// The last [`PeriodCache::N`] periods found, each with the span its answer holds for.
#[derive(Debug, Default)]
struct PeriodCache {
    /// (period, id, start, end); an entry with `start == end` (the default) matches no instant.
    found: [(Option<Period>, u64, Millis, Millis); PeriodCache::N],
    next: usize,
}

impl PeriodCache {
    const N: usize = 4;

    /// [`Period::at`], from the cache when `now` is in a span found before.
    fn at(&mut self, period: Period, now: Millis) -> (u64, Millis, Millis) {
        if let Some(&(_, id, start, end)) = self
            .found
            .iter()
            .find(|(p, _, start, end)| *p == Some(period) && *start <= now && now < *end)
        {
            return (id, start, end);
        }
        let (id, start, end) = period.at(now);
        if let Some(e) = self.found.get_mut(self.next % Self::N) {
            *e = (Some(period), id, start, end);
        }
        self.next = self.next.wrapping_add(1);
        (id, start, end)
    }
}

/// What an admission allocates, made before the store is locked.
struct Fresh {
    id: Id,
    quotas: Vec<Quota>,
}

/// The slots of a plan's scopes found so far in one admission. A plan's checks share their
/// scope's key, so comparing pointers finds a repeat without hashing the id again.
#[derive(Default)]
struct Resolved {
    seen: [(usize, usize); 8],
    n: usize,
}

impl Resolved {
    fn addr(key: &ScopeKey) -> usize {
        Arc::as_ptr(key.shared_id()).cast::<u8>().addr()
    }

    fn get(&self, key: &ScopeKey) -> Option<usize> {
        let a = Self::addr(key);
        self.seen
            .iter()
            .take(self.n)
            .find(|(k, _)| *k == a)
            .map(|(_, slot)| *slot)
    }

    fn put(&mut self, key: &ScopeKey, slot: usize) {
        // Beyond eight scopes the rest are hashed each time: still correct.
        if let Some(e) = self.seen.get_mut(self.n) {
            *e = (Self::addr(key), slot);
            self.n += 1;
        }
    }
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

impl State {
    fn live_scopes(&self) -> impl Iterator<Item = &ScopeState> {
        self.scopes.values().filter_map(|&i| self.slots.get(i))
    }

    /// The slot of a scope that has one.
    fn find(&self, key: &ScopeKey, seen: &mut Resolved) -> Option<usize> {
        if let Some(slot) = seen.get(key) {
            return Some(slot);
        }
        let slot = *self.scopes.get(key.id())?;
        seen.put(key, slot);
        Some(slot)
    }

    /// The slot of a scope, given one if it has none.
    fn slot(&mut self, key: &ScopeKey, seen: &mut Resolved) -> usize {
        if let Some(slot) = self.find(key, seen) {
            return slot;
        }
        let state = ScopeState {
            id: Some(key.shared_id().clone()),
            ..ScopeState::default()
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                if let Some(s) = self.slots.get_mut(slot) {
                    *s = state;
                }
                slot
            }
            None => self.slots.push(state),
        };
        // Absent: `find` just missed it.
        self.scopes.insert_new(key.shared_id().clone(), slot);
        seen.put(key, slot);
        slot
    }

    /// Expires due tickets, forgets ids past their retention (or beyond the cap) and, once a
    /// second, passes over the scopes to drop state nothing needs: the pass a little per call,
    /// unless `complete`.
    fn sweep(&mut self, now: Millis, retention: u64, max_remembered: usize, complete: bool) {
        while let Some((slot, id, t)) = self.tickets.due(now) {
            let id = id.clone();
            end_ticket(&mut self.slots, t, None);
            self.tickets.remove(slot);
            // Every ticket is an in-flight request's; checked all the same.
            if let Some(r) = self.requests.get_mut(&id) {
                if matches!(r, Request::InFlight(s) if *s == slot) {
                    *r = Request::Ended(Ending::Expired);
                    self.forget.push_back((now.saturating_add(retention), id));
                }
            }
        }
        let mut forgotten = 0;
        while let Some((at, _)) = self.forget.front() {
            if *at > now && self.forget.len() <= max_remembered {
                break;
            }
            if !complete && forgotten == FORGET_PER_CALL {
                break;
            }
            forgotten += 1;
            if let Some((_, id)) = self.forget.pop_front() {
                self.requests
                    .remove_if(&id, |r| matches!(r, Request::Ended(_)));
            }
        }
        if complete || (now >= self.next_full_sweep && self.pass.is_none()) {
            self.next_full_sweep = now + FULL_SWEEP_EVERY_MS;
            self.pass = Some(0);
        }
        if let Some(start) = self.pass {
            let end = if complete {
                self.slots.len()
            } else {
                self.slots.len().min(start + PASS_SLOTS_PER_CALL)
            };
            for i in start..end {
                self.sweep_slot(i, now);
            }
            self.pass = (end < self.slots.len()).then_some(end);
        }
    }

    /// Drops what the scope at slot `i` no longer needs, and frees the slot if nothing is left.
    fn sweep_slot(&mut self, i: usize, now: Millis) {
        let Some(s) = self.slots.get_mut(i) else {
            return;
        };
        if s.id.is_none() {
            return;
        }
        if s.rate.is_some_and(|(w, r)| r.is_stale(now, w)) {
            s.rate = None;
        }
        s.cells.retain(|(_, c)| c.end > now || c.outstanding > 0);
        if s.rate.is_none() && s.leases == 0 && s.cells.is_empty() {
            if let Some(id) = s.id.take() {
                self.scopes.remove(&id);
            }
            *s = ScopeState::default();
            self.free.push(i);
        }
    }

    fn finish(
        &mut self,
        request_id: &str,
        usage: Option<Usage>,
        how: Ending,
        now: Millis,
        retention: u64,
    ) -> Finish {
        let (id, slot) = match self.requests.get_entry_mut(request_id) {
            None => return Finish::Unknown,
            Some((_, Request::Ended(e))) => return Finish::AlreadyEnded(*e),
            Some((id, slot)) => (id.clone(), slot),
        };
        let Request::InFlight(t) = std::mem::replace(slot, Request::Ended(how)) else {
            return Finish::Unknown;
        };
        let charged = match self.tickets.get(t) {
            Some(ticket) => end_ticket(&mut self.slots, ticket, usage),
            None => Vec::new(),
        };
        self.tickets.remove(t);
        self.forget.push_back((now.saturating_add(retention), id));
        Finish::Done { charged }
    }

    fn admit(&mut self, plan: &Plan, now: Millis, fresh: Fresh) -> Result<Decision, StoreError> {
        let Fresh { id, mut quotas } = fresh;
        // The kill switch comes before everything, attempt counting included.
        if !self.kills.is_empty() {
            if let Some((target, reason)) = plan
                .kill_targets
                .iter()
                .find_map(|t| self.kills.get(t).map(|r| (t.to_owned(), r.clone())))
            {
                return Ok(Decision::Killed(crate::decision::Killed { target, reason }));
            }
        }
        // Hashed once for the duplicate check and the insertion at the end.
        let id_hash = self.requests.hash(&plan.request_id);
        if self.requests.contains_hashed(id_hash, &plan.request_id) {
            return Err(StoreError::DuplicateRequestId(plan.request_id.clone()));
        }
        // Checked before anything is counted or taken, so that the ticket's insertion at the
        // end cannot fail after the leases and reservations are made.
        if !self.tickets.has_room() {
            return Err(too_many_in_flight());
        }
        let mut seen = Resolved::default();
        // 1. Every attempt counts in every rate scope, admitted or not.
        let mut rate_deny: Option<Deny> = None;
        for (check, c) in plan.rate.iter().enumerate() {
            let slot = self.slot(&c.scope, &mut seen);
            let Some(scope) = self.slots.get_mut(slot) else {
                return Err(lost_slot());
            };
            let entry = scope
                .rate
                .get_or_insert((c.window_ms, RateWindow::default()));
            if entry.0 != c.window_ms {
                *entry = (c.window_ms, RateWindow::default());
            }
            let w = &mut entry.1;
            let ok = w.attempt(now, c.window_ms, c.limit);
            let reset = w.start + c.window_ms - now;
            if !ok && rate_deny.is_none() {
                rate_deny = Some(Deny {
                    reason: Reason::RequestRateLimit,
                    scope: c.scope.clone(),
                    limit: c.limit,
                    remaining: 0,
                    requested: 1,
                    retry_after_ms: Some(w.retry_after(now, c.window_ms, c.limit)),
                    reset_after_ms: Some(reset),
                });
            }
            quotas.push(Quota {
                reason: Reason::RequestRateLimit,
                check,
                limit: c.limit,
                remaining: w.remaining(now, c.window_ms, c.limit),
                window_ms: Some(c.window_ms),
                reset_after_ms: Some(reset),
            });
        }
        if let Some(d) = rate_deny {
            return Ok(Decision::Deny(d));
        }
        // 2–4. Token controls, decided by the pure pipeline.
        if let Some(d) = &plan.token_verdict {
            return Ok(Decision::Deny(d.clone()));
        }
        // 5. Concurrency.
        for (check, c) in plan.concurrency.iter().enumerate() {
            let scope = self
                .find(&c.scope, &mut seen)
                .and_then(|i| self.slots.get(i));
            let held = scope.map_or(0, |s| s.leases);
            if held >= c.limit {
                // A lease known to expire within the hint shortens it; a bound already past
                // (its lease has ended) says nothing of the others.
                let soonest = scope.map_or(now, |s| s.soonest);
                let wait = if soonest > now {
                    (soonest - now).min(CONCURRENCY_RETRY_HINT_MS)
                } else {
                    CONCURRENCY_RETRY_HINT_MS
                };
                return Ok(Decision::Deny(Deny {
                    reason: Reason::ConcurrencyLimit,
                    scope: c.scope.clone(),
                    limit: c.limit,
                    remaining: 0,
                    requested: 1,
                    retry_after_ms: Some(wait),
                    reset_after_ms: None,
                }));
            }
            quotas.push(Quota {
                reason: Reason::ConcurrencyLimit,
                check,
                limit: c.limit,
                remaining: c.limit - held - 1,
                window_ms: None,
                reset_after_ms: None,
            });
        }
        // 6. Budget: check all, then reserve all. Each period is found once (a calendar month
        // takes some arithmetic) and kept for the reservations, up to eight of them.
        let mut periods = [(0, 0); 8];
        for (i, c) in plan.budget.iter().enumerate() {
            let (pid, start, end) = self.periods.at(c.period, now);
            if let Some(p) = periods.get_mut(i) {
                *p = (pid, end);
            }
            let cell = self
                .find(&c.scope, &mut seen)
                .and_then(|i| self.slots.get(i))
                .and_then(|s| s.cell((c.period, pid)))
                .copied()
                .unwrap_or(Cell {
                    end,
                    ..Cell::default()
                });
            let committed = cell.settled.saturating_add(cell.reserved);
            if committed.saturating_add(c.amount) > c.limit {
                return Ok(Decision::Deny(Deny {
                    reason: Reason::BudgetLimit,
                    scope: c.scope.clone(),
                    limit: c.limit,
                    remaining: c.limit.saturating_sub(committed),
                    requested: c.amount,
                    retry_after_ms: (c.amount <= c.limit).then_some(end - now),
                    reset_after_ms: Some(end - now),
                }));
            }
            quotas.push(Quota {
                reason: Reason::BudgetLimit,
                check: i,
                limit: c.limit,
                remaining: c.limit - committed - c.amount,
                window_ms: Some(end - start),
                reset_after_ms: Some(end - now),
            });
        }
        // Everything passed: take the leases and make the reservations.
        let expires_at = now.saturating_add(plan.ttl_ms);
        let mut holds = self
            .tickets
            .spare_holds(plan.concurrency.len() + plan.budget.len());
        for c in &plan.concurrency {
            let slot = self.slot(&c.scope, &mut seen);
            let Some(scope) = self.slots.get_mut(slot) else {
                return Err(lost_slot());
            };
            scope.soonest = if scope.leases == 0 {
                expires_at
            } else {
                scope.soonest.min(expires_at)
            };
            scope.leases += 1;
            holds.push(Hold::Lease(slot));
        }
        for (i, c) in plan.budget.iter().enumerate() {
            // The same period as checked above: `now` has not moved.
            let (pid, end) = match periods.get(i) {
                Some(&p) => p,
                None => {
                    let (pid, _, end) = self.periods.at(c.period, now);
                    (pid, end)
                }
            };
            let slot = self.slot(&c.scope, &mut seen);
            let Some(scope) = self.slots.get_mut(slot) else {
                return Err(lost_slot());
            };
            let key = (c.period, pid);
            let at = match scope.cells.iter().position(|(k, _)| *k == key) {
                Some(at) => at,
                None => {
                    let fresh = Cell {
                        end,
                        ..Cell::default()
                    };
                    scope.cells.push((key, fresh));
                    scope.cells.len() - 1
                }
            };
            let cell = &mut scope.cells[at].1;
            cell.reserved += c.amount;
            cell.outstanding += 1;
            holds.push(Hold::Budget(Reservation {
                slot,
                period: c.period,
                period_id: pid,
                unit: c.unit,
                amount: c.amount,
            }));
        }
        let ticket = Ticket {
            expires_at,
            ttl_ms: plan.ttl_ms,
            holds,
            price: plan.price,
            expired_usage: plan.expired_usage,
        };
        let Some(slot) = self.tickets.insert(id.clone(), ticket) else {
            return Err(too_many_in_flight());
        };
        // Absent: checked at the top, under the same lock.
        self.requests
            .insert_new_hashed(id_hash, id, Request::InFlight(slot));
        Ok(Decision::Admit(Admitted {
            max_output_tokens: plan.max_output_tokens,
            expires_at,
            quotas,
            fail_open: false,
        }))
    }
}

/// Returns leases and replaces reservations with the charge for `usage` (`None`: the ticket's
/// expired usage).
fn end_ticket(slots: &mut Slots, t: &Ticket, usage: Option<Usage>) -> Vec<u64> {
    let usage = usage.unwrap_or(t.expired_usage);
    let mut charged = Vec::with_capacity(t.holds.len());
    for hold in &t.holds {
        let r = match hold {
            Hold::Lease(slot) => {
                if let Some(s) = slots.get_mut(*slot) {
                    s.leases = s.leases.saturating_sub(1);
                }
                continue;
            }
            Hold::Budget(r) => r,
        };
        let amount = charge(r.unit, t.price, &usage);
        if let Some(c) = slots
            .get_mut(r.slot)
            .and_then(|s| s.cell_mut((r.period, r.period_id)))
        {
            c.reserved = c.reserved.saturating_sub(r.amount);
            c.settled = c.settled.saturating_add(amount);
            c.outstanding = c.outstanding.saturating_sub(1);
        }
        charged.push(amount);
    }
    charged
}

impl<C: Clock> Store for MemoryStore<C> {
    fn admit(&self, plan: &Plan) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        std::future::ready(self.admit_sync(plan))
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
    fn set_kill(
        &self,
        target: &str,
        reason: Option<&str>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.set_kill_sync(target, reason))
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
mod tests {
    use super::*;

    /// A concurrency refusal's retry hint: the time to the earliest expiry of a lease held when
    /// that is known and within the hint's cap (1 s), the cap otherwise. Counts of leases come
    /// back exactly as requests end.
    #[test]
    fn concurrency_hints_come_from_the_earliest_known_expiry() {
        use crate::{Dimension, Identity, ManualClock, Policy, RequestFacts, plan};
        let policy = Policy::from_toml(
            r#"
            [[scopes]]
            key = "user"
            concurrency = { limit = 2, lease_ttl = "800ms" }
            "#,
        )
        .unwrap();
        let clock = ManualClock::new(1_767_225_600_000);
        let store = MemoryStore::with_clock(clock.clone());
        let admit = |id: &str| {
            let facts = RequestFacts {
                request_id: id.into(),
                identity: Identity::default().with(Dimension::User, "u"),
                input_tokens: 10,
                max_output_tokens: Some(10),
                cache_write_tokens: 0,
            };
            store.admit_sync(&plan(&policy, &facts).unwrap()).unwrap()
        };
        let hint = |d: Decision| match d {
            Decision::Deny(d) if d.reason == Reason::ConcurrencyLimit => d.retry_after_ms,
            other => panic!("not a concurrency refusal: {other:?}"),
        };
        let leases = |store: &MemoryStore<ManualClock>| {
            store.usage_sync("user|user:u", None).unwrap().leases
        };
        assert!(matches!(admit("a"), Decision::Admit(_))); // expires at 800
        clock.advance(300);
        assert!(matches!(admit("b"), Decision::Admit(_))); // expires at 1,100
        assert_eq!(hint(admit("c")), Some(500), "a expires 500 ms from now");
        store.settle_sync("a", Usage::default()).unwrap();
        assert_eq!(leases(&store), 1);
        assert!(matches!(admit("d"), Decision::Admit(_))); // expires at 1,100
        clock.advance(600); // 900: past a's expiry, which bounded b's and d's
        assert_eq!(hint(admit("e")), Some(CONCURRENCY_RETRY_HINT_MS));
        clock.advance(200); // 1,100: b and d expire
        assert!(matches!(admit("f"), Decision::Admit(_)));
        assert_eq!(leases(&store), 1);
        assert_eq!(store.footprint().unwrap().in_flight, 1);
    }

    /// The cache answers what `Period::at` answers, across period ends, for more periods than
    /// it holds at once.
    #[test]
    fn period_cache_answers_as_period_at() {
        let periods = [
            Period::CalendarMonth,
            Period::Fixed(86_400_000),
            Period::Fixed(3_600_000),
            Period::Fixed(7_000),
            Period::Fixed(1),
            Period::Fixed(604_800_000),
        ];
        let mut cache = PeriodCache::default();
        // From 2028-02-28 (a leap year) over the end of February, in uneven steps.
        let mut now = 1_835_308_800_000;
        for step in 0..5_000u64 {
            for p in periods {
                let (_, start, end) = p.at(now);
                for t in [now, end - 1, end, start] {
                    assert_eq!(cache.at(p, t), p.at(t), "{p:?} at {t}");
                }
            }
            now += 17_000 + (step % 7) * 1_234_567;
        }
    }

    /// Order is kept across block boundaries, with pushes and pops interleaved.
    #[test]
    fn block_queue_is_first_in_first_out_across_blocks() {
        let mut q = BlockQueue::default();
        let (mut next_in, mut next_out) = (0usize, 0usize);
        for round in 0..6 {
            for _ in 0..(BLOCK + 123 * round) {
                q.push_back(next_in);
                next_in += 1;
            }
            for _ in 0..(BLOCK / 2 + 7 * round) {
                assert_eq!(q.front(), Some(&next_out));
                assert_eq!(q.pop_front(), Some(next_out));
                next_out += 1;
            }
            assert_eq!(q.len(), next_in - next_out);
        }
        while let Some(v) = q.pop_front() {
            assert_eq!(v, next_out);
            next_out += 1;
        }
        assert_eq!((q.len(), next_out), (0, next_in));
        assert!(q.blocks.is_empty());
    }

    /// Slots past the first block are found where they were put.
    #[test]
    fn slots_span_blocks() {
        let mut s = Slots::default();
        for i in 0..(3 * BLOCK + 5) {
            let state = ScopeState {
                id: Some(Arc::from(i.to_string())),
                ..ScopeState::default()
            };
            assert_eq!(s.push(state), i);
        }
        assert_eq!(s.len(), 3 * BLOCK + 5);
        for i in [0, BLOCK - 1, BLOCK, 2 * BLOCK + 1, 3 * BLOCK + 4] {
            assert_eq!(
                s.get(i).and_then(|x| x.id.as_deref()),
                Some(&*i.to_string())
            );
        }
        assert!(s.get(3 * BLOCK + 5).is_none());
    }

    /// Many ids over every shard: each found, counted and removed once; `remove_if` keeps what
    /// its predicate refuses.
    #[test]
    fn sharded_map_finds_counts_and_removes() {
        let mut m = ShardedMap::default();
        let n = 20 * SHARDS;
        for i in 0..n {
            m.insert_new(Arc::from(format!("req-{i}")), i);
        }
        assert_eq!(m.len(), n);
        assert!(
            m.tables.iter().all(|t| !t.is_empty()),
            "ids spread over every shard"
        );
        for i in 0..n {
            assert_eq!(m.get(&format!("req-{i}")), Some(&i));
        }
        assert!(!m.contains_hashed(m.hash("req-x"), "req-x"));
        assert!(m.contains_hashed(m.hash("req-3"), "req-3"));
        if let Some((k, v)) = m.get_entry_mut("req-7") {
            assert_eq!(&**k, "req-7");
            *v = 700;
        }
        assert_eq!(m.get("req-7"), Some(&700));
        assert_eq!(m.remove_if("req-8", |v| *v != 8), None);
        assert_eq!(m.remove_if("req-8", |v| *v == 8), Some(8));
        assert_eq!(m.remove("req-8"), None);
        assert_eq!(m.len(), n - 1);
        assert_eq!(m.values().count(), n - 1);
    }
}
