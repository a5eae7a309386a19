//! Leased slices: admission without a round trip to a shared store for the scopes an instance
//! admits often.
//!
//! [`Sliced`] wraps a shared store (a [`SliceSource`]: Redis; the memory store too, for tests).
//! For a scope it admits often, an instance takes a *slice* in one call: attempts counted ahead
//! in the rate window, concurrency slots held as leases, an amount of a budget reserved in the
//! period. The slice is a reservation in the store like any request's, so settled + reserved
//! never passes a limit, on any number of instances. The instance then admits against its
//! slices locally (an in-memory engine: the same code as [`tollgate_core::MemoryStore`]), settles
//! locally, and reports what its requests were charged when it next speaks to the store; what
//! it did not use goes back when it is idle, at a window's or period's end, before a request the
//! store must decide, and at shutdown ([`Sliced::return_all`]).
//!
//! A request is admitted locally only when every scope of its plan has a slice with room: its
//! attempt, a slot, its reservation. A request whose scopes have no slice (many distinct users:
//! a plan shape seen fewer than [`SliceConfig::hot_after`] times a second) is admitted by the
//! store, one call, as without slices; so is one whose slices cannot grow enough (a scope near
//! its limit), after this instance gives back what it holds of its scopes, so that the store
//! decides on all it has. One instance alone decides exactly as the store would.
//!
//! What it trades, with several instances:
//! - **A refusal a little early.** A grant takes at most `1/divisor` of what a scope has free;
//!   what one instance holds unused, another cannot have until it is given back (within
//!   [`SliceConfig::tick_ms`] of going idle, or at once before a request the store decides).
//! - **The kill switch** reaches a leasing instance at its next call to the store, and at the
//!   latest [`SliceConfig::kill_bound_ms`] after it was set: past that, a local admission first
//!   reads the switches again. The instance that sets one sees it at once.
//! - **A dead instance's slices** expire like leases ([`SliceConfig::slice_ttl`]): its slots
//!   come back then, and each budget slice is charged in full, since what its requests spent
//!   since the last report is unknown (the books may then count up to a slice twice; they
//!   never count less than was spent).
//! - **Quotas** in rate-limit headers count what other instances did up to this instance's
//!   last call to the store.
//!
//! [`Sliced::maintain`] must run every [`SliceConfig::tick_ms`] (the gateway does it): it
//! reports settlements, renews slices before they expire, grows busy slices ahead of need and
//! gives back idle ones. Without it a slice left idle would expire and be charged in full.

mod book;
mod keeper;
mod store;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use book::{Book, Pending, Step};
pub use tollgate_core::exchange::{
    BudgetOrder, Exchange, Exchanged, Granted, LeaseOrder, Order, RateOrder, SliceSource, share,
};

use tollgate_core::clock::{Clock, Millis, SystemClock};
use tollgate_core::controls::Kind;
use tollgate_core::decision::{Decision, Quota};
use tollgate_core::ledger::{Period, Usage};
use tollgate_core::memory::MemoryStore;
use tollgate_core::pipeline::Plan;
use tollgate_core::store::{
    Finish, KeyClaim, KeyUse, Renewal, ScopeUsage, ShadowOutcome, Store, StoreError,
};

/// How an instance takes and keeps its slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceConfig {
    /// A plan shape (its scopes) is sliced once admitted more than this many times within a
    /// second; 0 slices every one from its first request.
    pub hot_after: u32,
    /// A grant takes at most `1/divisor` of what a scope has free (at least one unit).
    pub divisor: u64,
    /// How long a slice lives in the store without an order; `None`: twice the lease (or
    /// reservation) lifetime of the plan that made it.
    pub ttl_ms: Option<u64>,
    /// How old the copy of the kill switches may be for a local admission.
    pub kill_bound_ms: u64,
    /// The least distance a local admission keeps from a window's or period's end and from a
    /// slice's expiry (at least twice the last round trip to the store).
    pub margin_ms: u64,
    /// How long a scope whose slices could not cover a request is admitted by the store.
    pub exact_hold_ms: u64,
    /// How often [`Sliced::maintain`] runs.
    pub tick_ms: u64,
    /// Expiries of requests admitted here kept for a spend ledger ([`Sliced::local_expiries`]).
    pub keep_expiries: usize,
}

impl Default for SliceConfig {
    fn default() -> Self {
        Self {
            hot_after: 16,
            divisor: 4,
            ttl_ms: None,
            kill_bound_ms: 1_000,
            margin_ms: 50,
            exact_hold_ms: 250,
            tick_ms: 100,
            keep_expiries: 0,
        }
    }
}

impl SliceConfig {
    /// The lifetime in the store of a slice made for a plan whose requests live `plan_ttl_ms`.
    pub fn slice_ttl(&self, plan_ttl_ms: u64) -> u64 {
        self.ttl_ms
            .unwrap_or_else(|| plan_ttl_ms.saturating_mul(2))
            .max(1)
    }
}

/// The engine's clock: the local clock moved to the store's time (see `Book::est`).
#[derive(Debug, Clone)]
pub struct EstClock<C> {
    base: C,
    shift: Arc<Shift>,
}

/// The store's clock less the local one, and the store's latest time seen.
#[derive(Debug, Default)]
struct Shift {
    offset: AtomicI64,
    floor: std::sync::atomic::AtomicU64,
}

impl<C: Clock> Clock for EstClock<C> {
    fn now(&self) -> Millis {
        let t = i128::from(self.base.now()) + i128::from(self.shift.offset.load(Ordering::Relaxed));
        let t = u64::try_from(t.max(0)).unwrap_or(u64::MAX);
        t.max(self.shift.floor.load(Ordering::Relaxed))
    }
}

type Engine<C> = Arc<MemoryStore<EstClock<C>>>;

#[derive(Debug)]
struct State<C> {
    book: Book,
    engine: Engine<C>,
    /// The engine of before the store lost its state, while its requests end.
    orphan: Option<Engine<C>>,
}

/// A store whose hot scopes are admitted against slices held by this instance (see the module
/// documentation). Every [`Store`] method works as the wrapped store's does.
#[derive(Debug)]
pub struct Sliced<S, C = SystemClock> {
    inner: S,
    clock: C,
    cfg: SliceConfig,
    shift: Arc<Shift>,
    state: Mutex<State<C>>,
    /// One exchange with the store at a time: each sets what a slice holds from what this
    /// instance holds now.
    gate: futures_util::lock::Mutex<()>,
    stats: Counters,
}

#[derive(Debug, Default)]
struct Counters {
    local: std::sync::atomic::AtomicU64,
    store: std::sync::atomic::AtomicU64,
    exchanges: std::sync::atomic::AtomicU64,
    failed: std::sync::atomic::AtomicU64,
}

/// What a [`Sliced`] store has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SliceStats {
    /// Admissions decided here, against slices.
    pub local: u64,
    /// Admissions decided by the store, one call each.
    pub store: u64,
    /// Exchanges with the store (takes, reports, renewals, give-backs).
    pub exchanges: u64,
    /// Exchanges that failed.
    pub failed: u64,
    /// Answers of the store that granted more than was asked, cut down to it.
    pub anomalies: u64,
}

fn instance_prefix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("~s:{:016x}:", h.finish())
}

impl<S: SliceSource> Sliced<S, SystemClock> {
    /// Slices over `inner`, on the system clock.
    pub fn new(inner: S, cfg: SliceConfig) -> Self {
        Self::with_clock(inner, SystemClock, cfg)
    }
}

impl<S: SliceSource, C: Clock + Clone + 'static> Sliced<S, C> {
    /// Slices over `inner`, with `clock` as this instance's clock (tests pass the store's
    /// manual clock).
    pub fn with_clock(inner: S, clock: C, cfg: SliceConfig) -> Self {
        let shift = Arc::new(Shift::default());
        let engine = Self::engine(&clock, &shift, &cfg);
        Self {
            inner,
            clock,
            cfg,
            state: Mutex::new(State {
                book: Book::new(instance_prefix()),
                engine,
                orphan: None,
            }),
            shift,
            gate: futures_util::lock::Mutex::new(()),
            stats: Counters::default(),
        }
    }

    fn engine(clock: &C, shift: &Arc<Shift>, cfg: &SliceConfig) -> Engine<C> {
        let est = EstClock {
            base: clock.clone(),
            shift: shift.clone(),
        };
        Arc::new(MemoryStore::with_clock(est).keep_expiries(cfg.keep_expiries))
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The configuration.
    pub fn config(&self) -> &SliceConfig {
        &self.cfg
    }

    /// What it has done so far.
    pub fn stats(&self) -> SliceStats {
        let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        SliceStats {
            local: n(&self.stats.local),
            store: n(&self.stats.store),
            exchanges: n(&self.stats.exchanges),
            failed: n(&self.stats.failed),
            anomalies: self.lock().map_or(0, |st| st.book.anomalies),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, State<C>>, StoreError> {
        self.state
            .lock()
            .map_err(|_| StoreError::Unavailable("slice book lock poisoned".into()))
    }

    fn engines(&self) -> Result<(Engine<C>, Option<Engine<C>>), StoreError> {
        let st = self.lock()?;
        Ok((st.engine.clone(), st.orphan.clone()))
    }

    /// Sends `p`'s orders (and reads the kill switches) in one exchange, and takes in the
    /// answer. The caller holds the gate.
    async fn send(&self, p: Pending) -> Result<(), StoreError> {
        let ex = Exchange {
            orders: p.orders,
            divisor: self.cfg.divisor,
            kills: true,
        };
        let sent_at = self.clock.now();
        let r = self.inner.exchange(&ex).await;
        let at = self.clock.now();
        let counter = if r.is_ok() {
            &self.stats.exchanges
        } else {
            &self.stats.failed
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let mut st = self.lock()?;
        match r {
            Ok(got) if got.granted.len() == p.marks.len() => {
                st.book.apply(&p.marks, &ex.orders, &got, sent_at, at);
                let (offset, floor) = st.book.offset();
                self.shift.offset.store(offset, Ordering::Relaxed);
                self.shift.floor.fetch_max(floor, Ordering::Relaxed);
                Ok(())
            }
            Ok(got) => Err(StoreError::Protocol(format!(
                "{} answers to {} slice orders",
                got.granted.len(),
                p.marks.len()
            ))),
            Err(StoreError::StateLost) => {
                self.lost(&mut st);
                Err(StoreError::StateLost)
            }
            Err(e) => Err(e),
        }
    }

    /// The store forgot everything, slices included: the requests admitted here end in an
    /// engine of their own, their settlements answered as the store's would be (unknown).
    fn lost(&self, st: &mut State<C>) {
        if st.book.lost {
            return;
        }
        st.book.forget_all();
        let fresh = Self::engine(&self.clock, &self.shift, &self.cfg);
        st.orphan = Some(std::mem::replace(&mut st.engine, fresh));
    }

    /// One admission, with its shadow plan when given.
    async fn decide(
        &self,
        plan: &Plan,
        shadow: Option<&Plan>,
    ) -> Result<(Decision, Option<ShadowOutcome>), StoreError> {
        if plan.peeks().next().is_some() {
            return Ok((self.peek(plan).await?, None));
        }
        let mut counted: Option<Vec<Quota>> = None;
        let mut gate = None;
        // Slices are grown at most four times for one request; short after that, it goes to
        // the store (and its scopes too for a while, when they are near their limits).
        let mut grown = 0;
        let mut give_back = false;
        for _ in 0..8 {
            let step = {
                let mut st = self.lock()?;
                let State { book, engine, .. } = &mut *st;
                let now = self.clock.now();
                book.local(
                    &self.cfg,
                    engine,
                    plan,
                    shadow,
                    &mut counted,
                    now,
                    grown >= 2,
                )?
            };
            match step {
                Step::Done(d, o) => {
                    self.stats.local.fetch_add(1, Ordering::Relaxed);
                    return Ok((d, o));
                }
                Step::Store { give_back: g } => {
                    give_back = g;
                    break;
                }
                Step::Need(p) => {
                    if gate.is_none() {
                        // Another request may be taking the same slices: look again after it.
                        gate = Some(self.gate.lock().await);
                        continue;
                    }
                    let orders = !p.orders.is_empty();
                    if self.send(p).await.is_err() {
                        break;
                    }
                    grown += usize::from(orders);
                }
            }
        }
        drop(gate);
        self.store_path(plan, shadow, counted, give_back).await
    }

    /// The store decides. `give_back`: the request's scopes are near their limits, so what this
    /// instance holds of them goes back first and the store decides on all there is; otherwise
    /// that happens only when the store refuses for a limit this instance holds some of unused
    /// (then the request is asked again, its attempt counted once). `counted`: the attempt was
    /// counted in the rate slices already (with these quotas), so the store does not count it.
    async fn store_path(
        &self,
        plan: &Plan,
        shadow: Option<&Plan>,
        counted: Option<Vec<Quota>>,
        give_back: bool,
    ) -> Result<(Decision, Option<ShadowOutcome>), StoreError> {
        self.stats.store.fetch_add(1, Ordering::Relaxed);
        if give_back {
            self.give_back_for(plan, shadow).await?;
        }
        let (mut d, mut o) = self.ask_store(plan, shadow, counted.is_some()).await?;
        // A lease or a reservation: what this instance holds of it may be what is missing.
        let held_back = |p: Option<&Plan>, x: &tollgate_core::decision::Deny| {
            p.and_then(|p| p.check_of(x))
                .is_some_and(|c| matches!(c.kind, Kind::Lease(_) | Kind::Reserve(_)))
        };
        let refused = matches!(&d, Decision::Deny(x) if held_back(Some(plan), x))
            || matches!(&o, Some(ShadowOutcome::Refused(x)) if held_back(shadow, x));
        if !give_back && refused && self.give_back_for(plan, shadow).await? {
            {
                let mut st = self.lock()?;
                let now = self.clock.now();
                st.book
                    .mark_exact_for(plan, shadow, now, self.cfg.exact_hold_ms);
            }
            (d, o) = self.ask_store(plan, shadow, true).await?;
        }
        if let (Some(q), Decision::Admit(a)) = (counted, &mut d) {
            a.quotas.splice(0..0, q);
            a.quotas.sort_by_key(|q| q.check);
        }
        Ok((d, o))
    }

    /// Gives back what this instance holds of the request's scopes beyond its requests in
    /// flight; whether there was anything.
    async fn give_back_for(&self, plan: &Plan, shadow: Option<&Plan>) -> Result<bool, StoreError> {
        // Orders are made under the gate: one made before another exchange's answer would set
        // a slice back to what it held before that answer.
        let _gate = self.gate.lock().await;
        let back = {
            let mut st = self.lock()?;
            let State { book, engine, .. } = &mut *st;
            book.give_back(engine, plan, shadow)?
        };
        if back.orders.is_empty() {
            return Ok(false);
        }
        // A failure leaves more held than needed: a refusal a little early at worst.
        let _ = self.send(back).await;
        Ok(true)
    }

    /// One admission by the store, without the rate checks when `stripped` (the attempt was
    /// counted already), taken into the book.
    async fn ask_store(
        &self,
        plan: &Plan,
        shadow: Option<&Plan>,
        stripped: bool,
    ) -> Result<(Decision, Option<ShadowOutcome>), StoreError> {
        let strip = |p: &Plan| {
            let mut p = p.clone();
            p.attempt_counted = true;
            p
        };
        let (p, s);
        let (plan, shadow) = if stripped {
            p = strip(plan);
            s = shadow.map(strip);
            (&p, s.as_ref())
        } else {
            (plan, shadow)
        };
        let r = match shadow {
            None => self.inner.admit(plan).await.map(|d| (d, None)),
            Some(sh) => self
                .inner
                .admit_shadowed(plan, sh)
                .await
                .map(|(d, o)| (d, Some(o))),
        };
        let mut st = self.lock()?;
        if matches!(r, Err(StoreError::StateLost)) {
            self.lost(&mut st);
        }
        let (d, o) = r?;
        if !stripped {
            // A killed request's attempt counts nowhere; its shadow's does.
            if !matches!(d, Decision::Killed(_)) {
                st.book.learn_attempt(plan);
            }
            if let Some(s) = shadow {
                st.book.learn_attempt(s);
            }
        }
        st.book.learn(plan, &d);
        Ok((d, o))
    }

    /// Reports settlements, renews, grows busy slices and gives back idle ones, and reads the
    /// kill switches: run it every [`SliceConfig::tick_ms`].
    pub async fn maintain(&self) -> Result<(), StoreError> {
        self.tend(false).await
    }

    /// Gives back everything held beyond the requests in flight (shutdown, a new policy).
    pub async fn return_all(&self) -> Result<(), StoreError> {
        self.tend(true).await
    }

    async fn tend(&self, all: bool) -> Result<(), StoreError> {
        let _gate = self.gate.lock().await;
        let p = {
            let mut st = self.lock()?;
            if st
                .orphan
                .as_ref()
                .is_some_and(|o| o.footprint().is_ok_and(|f| f.in_flight == 0))
            {
                st.orphan = None;
            }
            let State { book, engine, .. } = &mut *st;
            book.maintain(&self.cfg, engine, self.clock.now(), all)?
        };
        self.send(p).await
    }

    /// Expiries of requests admitted here, kept for a spend ledger (see
    /// [`MemoryStore::expiries`]).
    pub fn local_expiries(
        &self,
        max: usize,
    ) -> Result<Vec<(u64, tollgate_core::Expiry)>, StoreError> {
        self.engines()?.0.expiries(max)
    }

    /// Forgets local expiries up to `tag`.
    pub fn ack_local_expiries(&self, tag: u64) -> Result<(), StoreError> {
        self.engines()?.0.ack_expiries(tag)
    }

    /// Checks that every slice covers what this instance admitted against it (see the property
    /// tests): leases within the slots, reservations and unreported settlements within the
    /// amount.
    pub fn audit(&self) -> Result<(), String> {
        let st = self.state.lock().map_err(|e| e.to_string())?;
        st.book.audit(&st.engine)
    }

    /// What this instance admitted itself and holds now: requests in flight here.
    pub fn in_flight_here(&self) -> Result<usize, StoreError> {
        Ok(self.engines()?.0.footprint()?.in_flight)
    }

    async fn finish(
        &self,
        id: &str,
        usage: Option<Usage>,
        settle: bool,
    ) -> Result<Finish, StoreError> {
        let (engine, orphan) = self.engines()?;
        let end = |e: &MemoryStore<EstClock<C>>| match (settle, usage) {
            (true, Some(u)) => e.settle_sync(id, u),
            _ => e.release_sync(id, usage),
        };
        if engine.knows(id)? {
            return end(&engine);
        }
        if let Some(o) = orphan.filter(|o| o.knows(id).unwrap_or(false)) {
            // Its slices went with the store's state: the store does not know the request.
            return end(&o).map(|f| match f {
                Finish::Done { .. } => Finish::Unknown,
                other => other,
            });
        }
        match (settle, usage) {
            (true, Some(u)) => self.inner.settle(id, u).await,
            _ => self.inner.release(id, usage).await,
        }
    }

    async fn renew_here(&self, id: &str) -> Result<Renewal, StoreError> {
        let (engine, orphan) = self.engines()?;
        if engine.knows(id)? {
            let r = engine.renew_sync(id)?;
            if let Renewal::Renewed { expires_at } = r {
                // The slices must outlive the request.
                let until = expires_at.saturating_add(self.cfg.margin_ms);
                let _gate = self.gate.lock().await;
                let p = self.lock()?.book.renewals(until);
                if !p.is_empty() {
                    self.send(p).await?;
                }
            }
            return Ok(r);
        }
        if let Some(o) = orphan.filter(|o| o.knows(id).unwrap_or(false)) {
            return o.renew_sync(id);
        }
        self.inner.renew(id).await
    }
}
