//! An instance's slices, synchronously: what it holds of each scope, the local admission
//! against them, and the orders that take, grow, report, renew and give them back. Time is the
//! store's, estimated (see [`Book::est`]); nothing here waits.
//!
//! The local engine (a [`MemoryStore`]) keeps the requests admitted here: their tickets,
//! leases, reservations, settlements and expiries, against limits that are the slices' sizes.
//! A budget slice's local limit is `base + reported + amount`: `base` what the engine had
//! settled in the scope's period before the slice was made, `reported` what the slice has told
//! the store its requests were charged, `amount` what the store holds for it. So the engine's
//! committed amount stays within what the store holds, whatever the engine does.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::SliceConfig;
use super::exchange::{BudgetOrder, Exchanged, Granted, LeaseOrder, Order, RateOrder};
use crate::clock::{Clock, Millis};
use crate::decision::{Decision, Quota, Reason};
use crate::ledger::{Period, RateWindow};
use crate::memory::MemoryStore;
use crate::pipeline::Plan;
use crate::policy::Unit;
use crate::scope::ScopeKey;
use crate::store::{ShadowOutcome, StoreError};

type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct RateKey {
    scope: Arc<str>,
    window_ms: u64,
    limit: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct LeaseKey {
    scope: Arc<str>,
    limit: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct BudgetKey {
    scope: Arc<str>,
    unit: Unit,
    period: Period,
    period_id: u64,
    limit: u64,
}

/// Attempts counted ahead in the store's current window.
#[derive(Debug, Clone)]
struct RateSlice {
    left: u64,
    /// The store's window after the last grant (every instance's attempts, these included).
    window: RateWindow,
    /// Attempts used since the last order.
    used: u64,
}

#[derive(Debug, Clone)]
struct LeaseSlice {
    id: Arc<str>,
    slots: u64,
    /// The scope's limit less every lease the store held at the last order (these included).
    headroom: u64,
    /// When the store lets the slots go without another order (estimated store time).
    expires: Millis,
    ttl_ms: u64,
    /// The most held here at once since the last order.
    peak: u64,
    /// Whether the store has been told of it.
    made: bool,
}

#[derive(Debug, Clone)]
struct BudgetSlice {
    id: Arc<str>,
    amount: u64,
    /// What the engine had settled in this period before the slice.
    base: u64,
    /// The slice's settled amount the store knows.
    reported: u64,
    /// The limit less the period's settled + reserved at the last order (this slice's included).
    headroom: u64,
    expires: Millis,
    ttl_ms: u64,
    /// The period's end.
    end: Millis,
    /// Reserved here since the last order.
    used: u64,
    made: bool,
}

impl BudgetSlice {
    fn local_limit(&self) -> u64 {
        self.base
            .saturating_add(self.reported)
            .saturating_add(self.amount)
    }
}

/// How to read the answer to one order.
#[derive(Debug, Clone)]
pub(super) enum Mark {
    Rate(RateKey),
    Lease(LeaseKey),
    /// With the settled total the order reported.
    Budget(BudgetKey, u64),
}

/// Orders to send, each with its mark.
#[derive(Debug, Default)]
pub(super) struct Pending {
    pub orders: Vec<Order>,
    pub marks: Vec<Mark>,
    pub kills: bool,
}

impl Pending {
    pub fn is_empty(&self) -> bool {
        self.orders.is_empty() && !self.kills
    }

    fn push(&mut self, o: Order, m: Mark) {
        self.orders.push(o);
        self.marks.push(m);
    }

    fn has_lease(&self, key: &LeaseKey) -> bool {
        self.marks
            .iter()
            .any(|m| matches!(m, Mark::Lease(k) if k == key))
    }

    fn has_budget(&self, key: &BudgetKey) -> bool {
        self.marks
            .iter()
            .any(|m| matches!(m, Mark::Budget(k, _) if k == key))
    }
}

/// What the local admission came to.
#[derive(Debug)]
pub(super) enum Step {
    /// Decided here.
    Done(Decision, Option<ShadowOutcome>),
    /// Slices to take or grow first; then try again.
    Need(Pending),
    /// Admitted per request by the store; `give_back`: its scopes are near their limits, so
    /// what this instance holds of them goes back first and the store decides on all there is.
    Store { give_back: bool },
}

/// What the engine holds of one scope: leases, and a budget period's settled and reserved.
type Held = (u64, u64, u64);

/// Plan shapes (their scopes) seen lately, to slice only what is admitted often: a fixed table,
/// so that a flood of distinct users costs no memory.
#[derive(Debug)]
struct Hot {
    slots: Vec<(u64, Millis, u32)>,
}

impl Hot {
    const N: usize = 1024;

    fn new() -> Self {
        Self {
            slots: vec![(0, 0, 0); Self::N],
        }
    }

    /// Counts a sighting of `sig` at `now`; whether it was seen more than `after` times in
    /// the last second.
    fn hit(&mut self, sig: u64, now: Millis, after: u32) -> bool {
        let i = (sig % Self::N as u64) as usize;
        let Some(e) = self.slots.get_mut(i) else {
            return false;
        };
        if e.0 != sig || now >= e.1.saturating_add(1_000) {
            *e = (sig, now, 0);
        }
        e.2 = e.2.saturating_add(1);
        e.2 > after
    }
}

/// The instance's slices and what goes with them.
#[derive(Debug)]
pub(super) struct Book {
    prefix: String,
    seq: u64,
    /// The store's clock less the local clock, from the last answer.
    offset: i64,
    /// The store's latest time seen: its time never goes back, even when its clock does.
    floor: Millis,
    /// The last exchange's round trip.
    rtt_ms: u64,
    last: Millis,
    rate: Map<RateKey, RateSlice>,
    leases: Map<LeaseKey, LeaseSlice>,
    budgets: Map<BudgetKey, BudgetSlice>,
    /// Scopes admitted per request until then.
    exact: Map<Arc<str>, Millis>,
    kills: BTreeMap<String, String>,
    /// Local time of the last read of the kill switches.
    kills_at: Option<Millis>,
    hot: Hot,
    /// The store lost its state: nothing is sliced until it answers again.
    pub lost: bool,
}

fn hash_of(parts: impl Iterator<Item = Arc<str>>) -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut h = foldhash::fast::FixedState::with_seed(0x51ce).build_hasher();
    for p in parts {
        p.hash(&mut h);
    }
    h.finish()
}

/// The stateful scopes of a plan and its shadow's.
fn scopes<'a>(plan: &'a Plan, shadow: Option<&'a Plan>) -> impl Iterator<Item = &'a ScopeKey> {
    let of = |p: &'a Plan| {
        p.rate
            .iter()
            .map(|c| &c.scope)
            .chain(p.concurrency.iter().map(|c| &c.scope))
            .chain(p.budget.iter().map(|c| &c.scope))
    };
    of(plan).chain(shadow.into_iter().flat_map(of))
}

impl Book {
    pub fn new(prefix: String) -> Self {
        Self {
            prefix,
            seq: 0,
            offset: 0,
            floor: 0,
            rtt_ms: 0,
            last: 0,
            rate: Map::default(),
            leases: Map::default(),
            budgets: Map::default(),
            exact: Map::default(),
            kills: BTreeMap::new(),
            kills_at: None,
            hot: Hot::new(),
            lost: false,
        }
    }

    /// The store's time, estimated from the local clock and the last answer: the store's clock
    /// moved on as the local one did since, or the latest time the store was seen at if later.
    /// Never ahead of the store's by the answer's timing (its clock was read before the answer
    /// came); never going back.
    pub fn est(&mut self, local: Millis) -> Millis {
        let t = i128::from(local) + i128::from(self.offset);
        let t = u64::try_from(t.max(0)).unwrap_or(u64::MAX);
        self.last = self.last.max(t).max(self.floor);
        self.last
    }

    /// The offset to apply to the local clock, and the floor, for the engine's clock.
    pub fn offset(&self) -> (i64, Millis) {
        (self.offset, self.floor)
    }

    /// How far from a boundary (a window's or period's end, a slice's expiry) a local admission
    /// keeps: the estimate may be behind the store's time by a round trip.
    fn margin(&self, cfg: &SliceConfig) -> u64 {
        cfg.margin_ms.max(self.rtt_ms.saturating_mul(2))
    }

    fn next_id(&mut self) -> Arc<str> {
        self.seq += 1;
        Arc::from(format!("{}{}", self.prefix, self.seq))
    }

    /// Whether the kill switches were read recently enough to admit here.
    fn kills_fresh(&self, local: Millis, cfg: &SliceConfig) -> bool {
        self.kills_at
            .is_some_and(|at| local.saturating_sub(at) <= cfg.kill_bound_ms)
    }

    /// Sets the kill switches as known (after this instance set or lifted one).
    pub fn set_kill(&mut self, target: &str, reason: Option<&str>) {
        match reason {
            Some(r) => self.kills.insert(target.to_owned(), r.to_owned()),
            None => self.kills.remove(target),
        };
    }

    fn killed(&self, plan: &Plan) -> Option<crate::decision::Killed> {
        if self.kills.is_empty() {
            return None;
        }
        plan.kill_targets.iter().find_map(|t| {
            self.kills.get(t).map(|r| crate::decision::Killed {
                target: t.to_owned(),
                reason: r.clone(),
            })
        })
    }

    fn is_exact(&self, scope: &Arc<str>, now: Millis) -> bool {
        self.exact.get(scope).is_some_and(|&until| until > now)
    }

    /// Sends the request's scopes to the store for `hold_ms` from local time `local_now`.
    pub fn mark_exact_for(
        &mut self,
        plan: &Plan,
        shadow: Option<&Plan>,
        local_now: Millis,
        hold_ms: u64,
    ) {
        let now = self.est(local_now);
        self.mark_exact(plan, shadow, now.saturating_add(hold_ms));
    }

    fn mark_exact(&mut self, plan: &Plan, shadow: Option<&Plan>, until: Millis) {
        for s in scopes(plan, shadow) {
            self.exact.insert(s.shared_id().clone(), until);
        }
    }

    fn rate_key(c: &crate::pipeline::RateCheck) -> RateKey {
        RateKey {
            scope: c.scope.shared_id().clone(),
            window_ms: c.window_ms,
            limit: c.limit,
        }
    }

    fn lease_key(c: &crate::pipeline::ConcurrencyCheck) -> LeaseKey {
        LeaseKey {
            scope: c.scope.shared_id().clone(),
            limit: c.limit,
        }
    }

    fn budget_key(c: &crate::pipeline::BudgetCheck, now: Millis) -> (BudgetKey, Millis) {
        let (period_id, _, end) = c.period.at(now);
        let key = BudgetKey {
            scope: c.scope.shared_id().clone(),
            unit: c.unit,
            period: c.period,
            period_id,
            limit: c.limit,
        };
        (key, end)
    }

    /// Admits here what the slices cover; says what to take first otherwise, or that the store
    /// must decide. `counted` holds the rate's quotas once the attempt was counted in the rate
    /// slices (it never is twice); `last_try`: slices were grown for this request already, so a
    /// shortfall now sends its scopes to the store for a while.
    #[allow(clippy::too_many_arguments)]
    pub fn local<C: Clock>(
        &mut self,
        cfg: &SliceConfig,
        engine: &MemoryStore<C>,
        plan: &Plan,
        shadow: Option<&Plan>,
        counted: &mut Option<Vec<Quota>>,
        local_now: Millis,
        last_try: bool,
    ) -> Result<Step, StoreError> {
        let now = self.est(local_now);
        if scopes(plan, shadow).any(|s| self.is_exact(s.shared_id(), now)) {
            return Ok(Step::Store { give_back: true });
        }
        if self.lost || !plan.repeats.is_empty() || shadow.is_some_and(|s| !s.repeats.is_empty()) {
            return Ok(Step::Store { give_back: false });
        }
        let margin = self.margin(cfg);
        let mut want = Pending::default();
        let mut store =
            self.want_missing(cfg, engine, plan, now, margin, &mut want, counted.is_none())?;
        if let Some(s) = shadow {
            store |=
                self.want_missing(cfg, engine, s, now, margin, &mut want, counted.is_none())?;
        }
        if store {
            return Ok(Step::Store { give_back: false });
        }
        if !want.is_empty() {
            // One exchange for every slice the request is short of, not one per discovery.
            self.grow_all(cfg, engine, plan, now, &mut want)?;
            if let Some(s) = shadow {
                self.grow_all(cfg, engine, s, now, &mut want)?;
            }
            return Ok(self.short(cfg, plan, shadow, now, want, last_try));
        }
        if counted.is_none() {
            if !self.kills_fresh(local_now, cfg) {
                return Ok(Step::Need(Pending {
                    kills: true,
                    ..Pending::default()
                }));
            }
            if let Some(k) = self.killed(plan) {
                // A killed request's shadow attempts count: the store decides that one.
                return Ok(match shadow {
                    None => Step::Done(Decision::Killed(k), None),
                    Some(_) => Step::Store { give_back: false },
                });
            }
        }
        if let Some(s) = shadow {
            // The engine admits a request whose shadow it refuses: a shadow short of its
            // slices must be found before, while nothing is held.
            if !self.room_for(engine, s, now)? {
                let mut want = Pending::default();
                self.grow_all(cfg, engine, s, now, &mut want)?;
                return Ok(self.short(cfg, plan, shadow, now, want, last_try));
            }
        }
        if counted.is_none() {
            *counted = Some(self.count(plan, shadow, now));
        }
        let (Some(lp), ls) = (
            self.rewrite(plan, now),
            shadow.map(|s| self.rewrite(s, now)),
        ) else {
            return Ok(Step::Store { give_back: false });
        };
        let (decided, outcome) = match (shadow, ls) {
            (None, _) => (engine.admit_sync(&lp)?, None),
            (Some(_), Some(Some(ls))) => {
                let (d, o) = engine.admit_shadowed_sync(&lp, &ls)?;
                (d, Some(o))
            }
            (Some(_), _) => return Ok(Step::Store { give_back: false }),
        };
        let slice_short = |r: Reason| {
            matches!(
                r,
                Reason::ConcurrencyLimit | Reason::BudgetLimit | Reason::ToolCallLimit
            )
        };
        let short_here = matches!(&decided, Decision::Deny(d) if slice_short(d.reason))
            || matches!(&outcome, Some(ShadowOutcome::Refused(d)) if slice_short(d.reason));
        if short_here {
            // The enforced plan was refused (nothing held): a shadow short of its slices was
            // found before the engine was asked.
            let mut want = Pending::default();
            self.grow_all(cfg, engine, plan, now, &mut want)?;
            if let Some(s) = shadow {
                self.grow_all(cfg, engine, s, now, &mut want)?;
            }
            return Ok(self.short(cfg, plan, shadow, now, want, last_try));
        }
        Ok(Step::Done(
            self.translated(plan, decided, counted.as_deref()),
            outcome,
        ))
    }

    /// What a request short of slices comes to: take them (when its shape is admitted often),
    /// or, after a try, the store for its scopes for a while.
    fn short(
        &mut self,
        cfg: &SliceConfig,
        plan: &Plan,
        shadow: Option<&Plan>,
        now: Millis,
        want: Pending,
        last_try: bool,
    ) -> Step {
        if last_try || want.orders.is_empty() {
            // Slices that could not grow enough: near a limit the store decides, on all there
            // is, for a while; otherwise this request alone goes to the store.
            if self.tight(plan, shadow, now) {
                self.mark_exact(plan, shadow, now.saturating_add(cfg.exact_hold_ms));
                return Step::Store { give_back: true };
            }
            return Step::Store { give_back: false };
        }
        let sig = hash_of(scopes(plan, shadow).map(|s| s.shared_id().clone()));
        if !self.hot.hit(sig, now, cfg.hot_after) {
            return Step::Store { give_back: false };
        }
        Step::Need(want)
    }

    /// Whether, at the last exchange, the store had too little left beyond this instance's
    /// slices for one more of the request in any of its scopes (or one has no slice to tell).
    fn tight(&self, plan: &Plan, shadow: Option<&Plan>, now: Millis) -> bool {
        std::iter::once(plan).chain(shadow).any(|p| {
            p.rate.iter().any(|c| {
                self.rate
                    .get(&Self::rate_key(c))
                    .is_none_or(|s| s.window.remaining(now, c.window_ms, c.limit) == 0)
            }) || p.concurrency.iter().any(|c| {
                self.leases
                    .get(&Self::lease_key(c))
                    .is_none_or(|s| s.headroom == 0)
            }) || p.budget.iter().any(|b| {
                self.budgets
                    .get(&Self::budget_key(b, now).0)
                    .is_none_or(|s| s.headroom < b.amount)
            })
        })
    }

    /// Orders for every slice `plan` lacks or that is short of its request: rate (when the
    /// attempt is still to be counted), then slots, then budgets. True when a slice cannot be
    /// had now (a budget period about to end, reservations of a lost slice still out): the
    /// store decides.
    #[allow(clippy::too_many_arguments)]
    fn want_missing<C: Clock>(
        &mut self,
        cfg: &SliceConfig,
        engine: &MemoryStore<C>,
        plan: &Plan,
        now: Millis,
        margin: u64,
        want: &mut Pending,
        rate_too: bool,
    ) -> Result<bool, StoreError> {
        let live_until = now.saturating_add(plan.ttl_ms).saturating_add(margin);
        let ttl = cfg.slice_ttl(plan.ttl_ms);
        if rate_too {
            for c in &plan.rate {
                let key = Self::rate_key(c);
                let usable = self.rate.get(&key).is_some_and(|s| {
                    s.left > 0
                        && now.saturating_add(margin) < s.window.start.saturating_add(c.window_ms)
                        && s.window.start <= now
                });
                if !usable {
                    let take = self.rate.get(&key).map_or(0, |s| s.used).saturating_mul(2);
                    self.rate_order(key, take.max(8), now, want);
                }
            }
        }
        for c in &plan.concurrency {
            let key = Self::lease_key(c);
            let ok = self
                .leases
                .get(&key)
                .is_some_and(|s| s.made && s.slots > 0 && s.expires >= live_until);
            if !ok {
                let (in_use, _, _) = engine.held(c.scope.id(), None)?;
                self.lease_order(key, in_use, ttl, want);
            }
        }
        for b in &plan.budget {
            let (key, end) = Self::budget_key(b, now);
            if now.saturating_add(margin) >= end {
                // Too close to the period's end: the store decides.
                return Ok(true);
            }
            let ok = self
                .budgets
                .get(&key)
                .is_some_and(|s| s.made && s.expires >= live_until);
            if !ok {
                let held = engine.held(b.scope.id(), Some((b.period, key.period_id)))?;
                if !self.budgets.contains_key(&key)
                    && engine.open_reservations(b.scope.id(), b.period, key.period_id)? > 0
                {
                    // Reservations of a slice the store let go of are still out here: a new
                    // slice must not count their release as room. The store decides until
                    // they end.
                    return Ok(true);
                }
                if !self.budget_order(key, end, held, b.amount, ttl, want) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Whether `plan`'s slot and budget slices have room here for its request.
    fn room_for<C: Clock>(
        &self,
        engine: &MemoryStore<C>,
        plan: &Plan,
        now: Millis,
    ) -> Result<bool, StoreError> {
        for c in &plan.concurrency {
            let slots = self.leases.get(&Self::lease_key(c)).map_or(0, |s| s.slots);
            if engine.held(c.scope.id(), None)?.0 >= slots {
                return Ok(false);
            }
        }
        for b in &plan.budget {
            let (key, _) = Self::budget_key(b, now);
            let limit = self.budgets.get(&key).map_or(0, BudgetSlice::local_limit);
            let (_, settled, reserved) =
                engine.held(b.scope.id(), Some((b.period, key.period_id)))?;
            if settled.saturating_add(reserved).saturating_add(b.amount) > limit {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Orders to grow every slot and budget slice of `plan` that has less room here than its
    /// request needs.
    fn grow_all<C: Clock>(
        &mut self,
        cfg: &SliceConfig,
        engine: &MemoryStore<C>,
        plan: &Plan,
        now: Millis,
        want: &mut Pending,
    ) -> Result<(), StoreError> {
        let ttl = cfg.slice_ttl(plan.ttl_ms);
        for c in &plan.concurrency {
            let key = Self::lease_key(c);
            if want.has_lease(&key) {
                continue;
            }
            let (in_use, _, _) = engine.held(c.scope.id(), None)?;
            if self.leases.get(&key).is_none_or(|s| in_use >= s.slots) {
                self.lease_order(key, in_use, ttl, want);
            }
        }
        for b in &plan.budget {
            let (key, end) = Self::budget_key(b, now);
            if want.has_budget(&key) {
                continue;
            }
            let held = engine.held(b.scope.id(), Some((b.period, key.period_id)))?;
            let room = self.budgets.get(&key).map_or(0, |s| {
                s.local_limit()
                    .saturating_sub(held.1.saturating_add(held.2))
            });
            let fresh = !self.budgets.contains_key(&key);
            if room < b.amount
                && !(fresh && engine.open_reservations(b.scope.id(), b.period, key.period_id)? > 0)
            {
                // A slice that cannot be had leaves the order set short: the store decides.
                self.budget_order(key, end, held, b.amount, ttl, want);
            }
        }
        Ok(())
    }

    fn rate_order(&mut self, key: RateKey, take: u64, now: Millis, want: &mut Pending) {
        let s = self.rate.entry(key.clone()).or_insert_with(|| RateSlice {
            left: 0,
            window: RateWindow::default(),
            used: 0,
        });
        // Attempts of a window that has ended are given back to it (they count as the previous
        // window's until the next one rolls): they were never made. No admission uses them any
        // more, so they stay counted here until the answer (an order dropped unsent leaves them
        // for the next).
        let stale = s.window.start.saturating_add(key.window_ms) <= now;
        let back = if stale { s.left } else { 0 };
        let back_start = s.window.start;
        want.push(
            Order::Rate(RateOrder {
                scope: key.scope.clone(),
                limit: key.limit,
                window_ms: key.window_ms,
                take,
                back,
                back_start,
            }),
            Mark::Rate(key),
        );
    }

    fn lease_order(&mut self, key: LeaseKey, in_use: u64, ttl_ms: u64, want: &mut Pending) {
        if let Some(s) = self.leases.get(&key) {
            // Doubling at least: a burst of requests in flight reaches its size in a few
            // exchanges.
            let target = in_use.saturating_add(s.peak.saturating_mul(2).max(in_use).max(4));
            let slots = target.max(s.slots);
            want.push(
                Order::Lease(LeaseOrder {
                    slice: s.id.clone(),
                    scope: key.scope.clone(),
                    limit: key.limit,
                    slots,
                    ttl_ms: s.ttl_ms,
                    create: !s.made,
                }),
                Mark::Lease(key),
            );
            return;
        }
        let id = self.next_id();
        want.push(
            Order::Lease(LeaseOrder {
                slice: id.clone(),
                scope: key.scope.clone(),
                limit: key.limit,
                slots: in_use.saturating_add(4),
                ttl_ms,
                create: true,
            }),
            Mark::Lease(key.clone()),
        );
        self.leases.insert(
            key,
            LeaseSlice {
                id,
                slots: 0,
                headroom: 0,
                expires: 0,
                ttl_ms,
                peak: 0,
                made: false,
            },
        );
    }

    /// An order taking or growing the budget slice of `key` for a request of `need`; false
    /// when no slice may be made now.
    fn budget_order(
        &mut self,
        key: BudgetKey,
        end: Millis,
        held: Held,
        need: u64,
        ttl_ms: u64,
        want: &mut Pending,
    ) -> bool {
        let (_, settled, reserved) = held;
        if !self.budgets.contains_key(&key) {
            if reserved > 0 {
                // Reservations of a slice the store let go of are still out here: a new slice
                // must not count their release as room. The store decides until they end.
                return false;
            }
            let id = self.next_id();
            self.budgets.insert(
                key.clone(),
                BudgetSlice {
                    id,
                    amount: 0,
                    base: settled,
                    reported: 0,
                    headroom: 0,
                    expires: 0,
                    ttl_ms,
                    end,
                    used: 0,
                    made: false,
                },
            );
        }
        let Some(s) = self.budgets.get(&key) else {
            return false;
        };
        let settled_total = settled.saturating_sub(s.base);
        let unreported = settled_total.saturating_sub(s.reported);
        let extra = need.saturating_mul(4).max(s.used.saturating_mul(2));
        let amount = reserved
            .saturating_add(extra)
            .max(s.amount.saturating_sub(unreported));
        want.push(
            Order::Budget(BudgetOrder {
                slice: s.id.clone(),
                scope: key.scope.clone(),
                limit: key.limit,
                unit: key.unit,
                period: key.period,
                period_id: key.period_id,
                amount,
                keep: reserved,
                settled: settled_total,
                ttl_ms: s.ttl_ms,
                create: !s.made,
            }),
            Mark::Budget(key, settled_total),
        );
        true
    }

    /// Counts the attempt in every rate slice of the plan and its shadow's; the plan's rate
    /// quotas, as the store would give them.
    fn count(&mut self, plan: &Plan, shadow: Option<&Plan>, now: Millis) -> Vec<Quota> {
        let mut quotas = Vec::with_capacity(plan.rate.len());
        for (check, c) in plan.rate.iter().enumerate() {
            if let Some(s) = self.rate.get_mut(&Self::rate_key(c)) {
                s.left -= 1;
                s.used += 1;
                // The window as if only the attempts made were counted.
                let mut w = s.window;
                w.current = w.current.saturating_sub(s.left);
                quotas.push(Quota {
                    reason: Reason::RequestRateLimit,
                    check,
                    limit: c.limit,
                    remaining: w.remaining(now, c.window_ms, c.limit),
                    window_ms: Some(c.window_ms),
                    reset_after_ms: Some(w.start.saturating_add(c.window_ms).saturating_sub(now)),
                });
            }
        }
        for c in shadow.iter().flat_map(|s| &s.rate) {
            if let Some(s) = self.rate.get_mut(&Self::rate_key(c)) {
                s.left -= 1;
                s.used += 1;
            }
        }
        quotas
    }

    /// The plan against the slices: no rate checks (counted already), each slot and budget
    /// limit the slice's room here. `None` when a slice went missing.
    fn rewrite(&self, plan: &Plan, now: Millis) -> Option<Plan> {
        let mut lp = plan.clone();
        lp.rate.clear();
        lp.kill_targets = crate::pipeline::KillTargets::default();
        for c in &mut lp.concurrency {
            c.limit = self.leases.get(&Self::lease_key(c))?.slots;
        }
        for b in &mut lp.budget {
            b.limit = self.budgets.get(&Self::budget_key(b, now).0)?.local_limit();
        }
        Some(lp)
    }

    /// The engine's decision in the store's terms: its quotas against the scopes' own limits,
    /// the rate's first.
    fn translated(&mut self, plan: &Plan, d: Decision, rate: Option<&[Quota]>) -> Decision {
        let Decision::Admit(mut a) = d else {
            return d;
        };
        let now = self.last;
        let mut quotas = Vec::with_capacity(a.quotas.len() + rate.map_or(0, <[Quota]>::len));
        quotas.extend(rate.unwrap_or_default().iter().cloned());
        for mut q in a.quotas {
            match q.reason {
                Reason::ConcurrencyLimit => {
                    if let Some(c) = plan.concurrency.get(q.check) {
                        if let Some(s) = self.leases.get_mut(&Self::lease_key(c)) {
                            s.peak = s.peak.max(s.slots.saturating_sub(q.remaining));
                            q.remaining = q.remaining.saturating_add(s.headroom);
                        }
                        q.limit = c.limit;
                    }
                }
                _ => {
                    if let Some(b) = plan.budget.get(q.check) {
                        if let Some(s) = self.budgets.get_mut(&Self::budget_key(b, now).0) {
                            s.used = s.used.saturating_add(b.amount);
                            q.remaining = q.remaining.saturating_add(s.headroom);
                        }
                        q.limit = b.limit;
                    }
                }
            }
            quotas.push(q);
        }
        a.quotas = quotas;
        Decision::Admit(a)
    }

    /// Orders giving back what this instance holds of `plan`'s (and `shadow`'s) scopes beyond
    /// its requests in flight, applied here before they are sent (no local admission uses what
    /// is on its way back), so that the store decides on what it holds.
    pub fn give_back<C: Clock>(
        &mut self,
        engine: &MemoryStore<C>,
        plan: &Plan,
        shadow: Option<&Plan>,
    ) -> Result<Pending, StoreError> {
        let mut out = Pending::default();
        let now = self.last;
        for p in std::iter::once(plan).chain(shadow) {
            for c in &p.rate {
                let key = Self::rate_key(c);
                if let Some(s) = self.rate.get_mut(&key).filter(|s| s.left > 0) {
                    let back = std::mem::take(&mut s.left);
                    let back_start = s.window.start;
                    out.push(
                        Order::Rate(RateOrder {
                            scope: key.scope.clone(),
                            limit: key.limit,
                            window_ms: key.window_ms,
                            take: 0,
                            back,
                            back_start,
                        }),
                        Mark::Rate(key),
                    );
                }
            }
            for c in &p.concurrency {
                let key = Self::lease_key(c);
                let Some(s) = self.leases.get_mut(&key).filter(|s| s.made) else {
                    continue;
                };
                let (in_use, _, _) = engine.held(&key.scope, None)?;
                if s.slots > in_use {
                    s.slots = in_use;
                    out.push(
                        Order::Lease(LeaseOrder {
                            slice: s.id.clone(),
                            scope: key.scope.clone(),
                            limit: key.limit,
                            slots: in_use,
                            ttl_ms: s.ttl_ms,
                            create: false,
                        }),
                        Mark::Lease(key),
                    );
                }
            }
            for b in &p.budget {
                let key = Self::budget_key(b, now).0;
                // One the store has ended may still have settlements to report.
                let Some(s) = self.budgets.get_mut(&key) else {
                    continue;
                };
                let (_, settled, reserved) =
                    engine.held(&key.scope, Some((key.period, key.period_id)))?;
                let total = settled.saturating_sub(s.base);
                let unreported = total.saturating_sub(s.reported);
                let keep = reserved.saturating_add(unreported);
                if s.amount > keep || unreported > 0 {
                    s.amount = s.amount.min(keep);
                    out.push(
                        Order::Budget(BudgetOrder {
                            slice: s.id.clone(),
                            scope: key.scope.clone(),
                            limit: key.limit,
                            unit: key.unit,
                            period: key.period,
                            period_id: key.period_id,
                            amount: reserved,
                            keep: reserved,
                            settled: total,
                            ttl_ms: s.ttl_ms,
                            create: !s.made,
                        }),
                        Mark::Budget(key, total),
                    );
                }
            }
        }
        Ok(out)
    }

    /// Takes in an attempt of `plan` the store counted (one call of its own): the rate
    /// slices' windows count it too, so that their quotas stay the store's.
    pub fn learn_attempt(&mut self, plan: &Plan) {
        let now = self.last;
        for c in &plan.rate {
            if let Some(s) = self.rate.get_mut(&Self::rate_key(c)) {
                if s.window.start.saturating_add(c.window_ms) > now {
                    s.window.current = s.window.current.saturating_add(1);
                }
            }
        }
    }

    /// Takes in what the store admitted for `plan`: what each of its scopes has left.
    pub fn learn(&mut self, plan: &Plan, d: &Decision) {
        let now = self.last;
        let Decision::Admit(a) = d else {
            return;
        };
        for q in &a.quotas {
            match q.reason {
                Reason::ConcurrencyLimit => {
                    if let Some(c) = plan.concurrency.get(q.check) {
                        if let Some(s) = self.leases.get_mut(&Self::lease_key(c)) {
                            s.headroom = q.remaining;
                        }
                    }
                }
                Reason::BudgetLimit | Reason::ToolCallLimit => {
                    if let Some(b) = plan.budget.get(q.check) {
                        if let Some(s) = self.budgets.get_mut(&Self::budget_key(b, now).0) {
                            s.headroom = q.remaining;
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// Orders for maintenance: give back what went unused, grow what is busy, renew what
    /// expires within half its lifetime, report settlements, read the kill switches. With
    /// `all`, everything beyond the requests in flight goes back (shutdown, reload).
    pub fn maintain<C: Clock>(
        &mut self,
        cfg: &SliceConfig,
        engine: &MemoryStore<C>,
        local_now: Millis,
        all: bool,
    ) -> Result<Pending, StoreError> {
        let now = self.est(local_now);
        let margin = self.margin(cfg).saturating_add(cfg.tick_ms);
        self.exact.retain(|_, until| *until > now);
        let mut out = Pending {
            kills: true,
            ..Pending::default()
        };
        // Rate: attempts of a window about to end go back; a busy slice takes more.
        let keys: Vec<RateKey> = self.rate.keys().cloned().collect();
        for key in keys {
            let Some(s) = self.rate.get_mut(&key) else {
                continue;
            };
            let ending = s.window.start.saturating_add(key.window_ms) <= now.saturating_add(margin);
            if all || ending || s.used == 0 {
                if s.left > 0 {
                    let back = std::mem::take(&mut s.left);
                    out.push(
                        Order::Rate(RateOrder {
                            scope: key.scope.clone(),
                            limit: key.limit,
                            window_ms: key.window_ms,
                            take: 0,
                            back,
                            back_start: s.window.start,
                        }),
                        Mark::Rate(key.clone()),
                    );
                } else {
                    self.rate.remove(&key);
                }
            } else if s.left < s.used {
                let take = s.used.saturating_mul(2).saturating_sub(s.left);
                self.rate_order(key, take, now, &mut out);
            }
        }
        self.tend_leases(engine, now, all, &mut out)?;
        self.tend_budgets(engine, now, margin, all, &mut out)?;
        Ok(out)
    }

    fn tend_leases<C: Clock>(
        &mut self,
        engine: &MemoryStore<C>,
        now: Millis,
        all: bool,
        out: &mut Pending,
    ) -> Result<(), StoreError> {
        let keys: Vec<LeaseKey> = self.leases.keys().cloned().collect();
        for key in keys {
            let (in_use, _, _) = engine.held(&key.scope, None)?;
            let Some(s) = self.leases.get_mut(&key) else {
                continue;
            };
            let busy = if all { 0 } else { s.peak.saturating_mul(2) };
            let target = in_use.saturating_add(busy);
            let renew = s.expires.saturating_sub(now) < s.ttl_ms / 2;
            s.peak = 0;
            if !s.made && target == 0 && s.slots == 0 {
                // Nothing held here or in the store (an unanswered order for a new slice is
                // sent again below while anything may be held).
                if in_use == 0 {
                    self.leases.remove(&key);
                }
                continue;
            }
            if s.made && target == s.slots && !renew {
                continue;
            }
            // Fewer slots take effect here at once; more when the store grants them.
            s.slots = s.slots.min(target);
            out.push(
                Order::Lease(LeaseOrder {
                    slice: s.id.clone(),
                    scope: key.scope.clone(),
                    limit: key.limit,
                    slots: target,
                    ttl_ms: s.ttl_ms,
                    create: !s.made,
                }),
                Mark::Lease(key),
            );
        }
        Ok(())
    }

    fn tend_budgets<C: Clock>(
        &mut self,
        engine: &MemoryStore<C>,
        now: Millis,
        margin: u64,
        all: bool,
        out: &mut Pending,
    ) -> Result<(), StoreError> {
        let keys: Vec<BudgetKey> = self.budgets.keys().cloned().collect();
        for key in keys {
            let (_, settled, reserved) =
                engine.held(&key.scope, Some((key.period, key.period_id)))?;
            let Some(s) = self.budgets.get_mut(&key) else {
                continue;
            };
            let total = settled.saturating_sub(s.base);
            let unreported = total.saturating_sub(s.reported);
            let open = !all && now.saturating_add(margin) < s.end;
            let target = if open {
                reserved.saturating_add(s.used.saturating_mul(2))
            } else {
                reserved
            };
            let renew = s.expires.saturating_sub(now) < s.ttl_ms / 2;
            s.used = 0;
            if unreported == 0 && target == s.amount && (!s.made || !renew) {
                // Kept while any request admitted against it may still settle a charge.
                if !s.made
                    && s.amount == 0
                    && engine.open_reservations(&key.scope, key.period, key.period_id)? == 0
                {
                    self.budgets.remove(&key);
                }
                continue;
            }
            // Less is given back here at once; more when the store grants it.
            if target < s.amount.saturating_sub(unreported) {
                s.amount = target.saturating_add(unreported);
            }
            out.push(
                Order::Budget(BudgetOrder {
                    slice: s.id.clone(),
                    scope: key.scope.clone(),
                    limit: key.limit,
                    unit: key.unit,
                    period: key.period,
                    period_id: key.period_id,
                    amount: target,
                    keep: reserved,
                    settled: total,
                    ttl_ms: s.ttl_ms,
                    create: !s.made,
                }),
                Mark::Budget(key, total),
            );
        }
        Ok(())
    }

    /// Orders renewing every slice that would expire before `until`.
    pub fn renewals(&mut self, until: Millis) -> Pending {
        let mut out = Pending::default();
        for (key, s) in &self.leases {
            if s.made && s.expires < until {
                out.push(
                    Order::Lease(LeaseOrder {
                        slice: s.id.clone(),
                        scope: key.scope.clone(),
                        limit: key.limit,
                        slots: s.slots,
                        ttl_ms: s.ttl_ms,
                        create: false,
                    }),
                    Mark::Lease(key.clone()),
                );
            }
        }
        for (key, s) in &self.budgets {
            if s.made && s.expires < until {
                out.push(
                    Order::Budget(BudgetOrder {
                        slice: s.id.clone(),
                        scope: key.scope.clone(),
                        limit: key.limit,
                        unit: key.unit,
                        period: key.period,
                        period_id: key.period_id,
                        amount: s.amount,
                        keep: 0,
                        settled: s.reported,
                        ttl_ms: s.ttl_ms,
                        create: false,
                    }),
                    Mark::Budget(key.clone(), s.reported),
                );
            }
        }
        out
    }

    /// Takes in the store's answer to `sent`, which was sent at local time `sent_at` and
    /// answered at `local_now`.
    pub fn apply(&mut self, marks: &[Mark], ex: &Exchanged, sent_at: Millis, local_now: Millis) {
        self.rtt_ms = local_now.saturating_sub(sent_at);
        // The store read its clock before it answered: this estimate is never ahead of it.
        self.offset = i64::try_from(i128::from(ex.clock) - i128::from(local_now)).unwrap_or(0);
        self.floor = self.floor.max(ex.now);
        let now = self.est(local_now);
        if let Some(k) = &ex.kills {
            self.kills = k.iter().cloned().collect();
            self.kills_at = Some(local_now);
        }
        self.lost = false;
        for (mark, granted) in marks.iter().zip(&ex.granted) {
            self.take_in(mark, *granted, ex.now.max(now));
        }
    }

    fn take_in(&mut self, mark: &Mark, granted: Granted, now: Millis) {
        match (mark, granted) {
            (Mark::Rate(key), Granted::Rate { granted, window }) => {
                if let Some(s) = self.rate.get_mut(key) {
                    if window.start != s.window.start {
                        // A new window: attempts of the old one no longer count here.
                        s.left = 0;
                    }
                    s.left = s.left.saturating_add(granted);
                    s.window = window;
                    s.used = 0;
                    if s.left == 0 && granted == 0 {
                        self.rate.remove(key);
                    }
                }
            }
            (Mark::Lease(key), Granted::Lease { slots, held }) => {
                let fresh = if slots == 0 {
                    Some(self.next_id())
                } else {
                    None
                };
                if let Some(s) = self.leases.get_mut(key) {
                    s.slots = slots;
                    s.headroom = key.limit.saturating_sub(held);
                    s.expires = now.saturating_add(s.ttl_ms);
                    s.made = slots > 0;
                    if let Some(id) = fresh {
                        // The store ended the slice: a later one is new there.
                        s.id = id;
                    }
                }
            }
            (Mark::Budget(key, settled), Granted::Budget { amount, committed }) => {
                let fresh = if amount == 0 {
                    Some(self.next_id())
                } else {
                    None
                };
                if let Some(s) = self.budgets.get_mut(key) {
                    s.reported = *settled;
                    s.amount = amount;
                    s.headroom = key.limit.saturating_sub(committed);
                    s.expires = now.saturating_add(s.ttl_ms);
                    s.made = amount > 0;
                    if let Some(id) = fresh {
                        // The store ended the slice (it holds nothing): what was reported to it
                        // joins the base, and a later slice is new there.
                        s.base = s.base.saturating_add(s.reported);
                        s.reported = 0;
                        s.id = id;
                    }
                }
            }
            (Mark::Lease(key), Granted::Gone) => {
                // Expired in the store: its slots were given back there. Requests still in
                // flight here hold local leases the store no longer counts (as an expired
                // lease of a request served by the store is).
                self.leases.remove(key);
            }
            (Mark::Budget(key, _), Granted::Gone) => {
                // Expired in the store, charged in full: what its requests settle from now on
                // is already charged, and their reservations must not become room. The store
                // decides for the scope until they have ended.
                if let Some(s) = self.budgets.remove(key) {
                    self.exact
                        .insert(key.scope.clone(), now.saturating_add(s.ttl_ms));
                }
            }
            _ => {}
        }
    }

    /// Checks that every slice covers what was admitted against it here: the engine's leases
    /// within the slots, and its reservations and unreported settlements within the amount (a
    /// request charged beyond its reservation may take a slice past it until the next report,
    /// as it takes a store past its limit).
    pub fn audit<C: Clock>(&self, engine: &MemoryStore<C>) -> Result<(), String> {
        let fail = |e: StoreError| e.to_string();
        let mut slots: Map<Arc<str>, u64> = Map::default();
        for (k, s) in &self.leases {
            *slots.entry(k.scope.clone()).or_default() += s.slots;
        }
        for (scope, n) in slots {
            let (in_use, _, _) = engine.held(&scope, None).map_err(fail)?;
            if in_use > n {
                return Err(format!("{scope}: {in_use} leases here, {n} slots"));
            }
        }
        for (k, s) in &self.budgets {
            let (_, settled, reserved) = engine
                .held(&k.scope, Some((k.period, k.period_id)))
                .map_err(fail)?;
            let used = settled.saturating_add(reserved);
            if used > s.local_limit() {
                return Err(format!(
                    "{}: {used} used here, {} covered (base {}, reported {}, amount {})",
                    k.scope,
                    s.local_limit(),
                    s.base,
                    s.reported,
                    s.amount
                ));
            }
        }
        Ok(())
    }

    /// The store lost its state: every slice with it.
    pub fn forget_all(&mut self) {
        self.lost = true;
        self.rate.clear();
        self.leases.clear();
        self.budgets.clear();
        self.exact.clear();
    }

    /// What the store's usage of `scope` counts for this instance's slices, and what it does
    /// not know yet, for the period `period` contains now (see [`Correction`]).
    pub fn correction<C: Clock>(
        &mut self,
        engine: &MemoryStore<C>,
        scope: &str,
        period: Option<Period>,
        local_now: Millis,
    ) -> Result<Correction, StoreError> {
        let now = self.est(local_now);
        let mut c = Correction::default();
        let mut sliced = false;
        for (_, s) in self.leases.iter().filter(|(k, _)| &*k.scope == scope) {
            c.slice_leases += s.slots;
            sliced = true;
        }
        if sliced {
            c.local_leases = engine.held(scope, None)?.0;
        }
        if let Some(p) = period {
            let pid = p.at(now).0;
            let mut sliced = false;
            for (_, s) in self
                .budgets
                .iter()
                .filter(|(k, _)| &*k.scope == scope && k.period == p && k.period_id == pid)
            {
                let (_, settled, _) = engine.held(scope, Some((p, pid)))?;
                c.slice_amount += s.amount;
                c.unreported += settled.saturating_sub(s.base).saturating_sub(s.reported);
                sliced = true;
            }
            if sliced {
                c.local_reserved = engine.held(scope, Some((p, pid)))?.2;
            }
        }
        Ok(c)
    }
}

/// What an instance's slices change in the store's usage of a scope: the store counts the
/// slices' slots and amounts, where the truth is the leases and reservations of the requests
/// admitted here, and it does not know yet what was settled here since the last report.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Correction {
    pub slice_leases: u64,
    pub local_leases: u64,
    pub slice_amount: u64,
    pub local_reserved: u64,
    pub unreported: u64,
}
