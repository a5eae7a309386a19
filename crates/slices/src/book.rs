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
//!
//! The orders are in `book/orders.rs`, maintenance and answers in `book/tend.rs`, the orders
//! waiting to be sent in `book/pending.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::SliceConfig;

mod hot;
mod orders;
mod pending;
mod tend;
use hot::Hot;
pub(crate) use pending::{Mark, Pending};
use tollgate_core::clock::{Clock, Millis};
use tollgate_core::controls::{Kind, budget, rate};
use tollgate_core::decision::{Decision, Quota, Reason};
use tollgate_core::ledger::{Period, RateWindow};
use tollgate_core::memory::MemoryStore;
use tollgate_core::pipeline::Plan;
use tollgate_core::policy::Unit;
use tollgate_core::scope::ScopeKey;
use tollgate_core::store::{ShadowOutcome, StoreError};

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
    /// Answers granting more than was asked (or attempts of another window), cut down.
    pub anomalies: u64,
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
    plan.scopes()
        .chain(shadow.into_iter().flat_map(Plan::scopes))
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
            anomalies: 0,
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

    fn killed(&self, plan: &Plan, now: Millis) -> Option<tollgate_core::decision::Killed> {
        if self.kills.is_empty() {
            return None;
        }
        plan.kill_targets.iter().find_map(|t| {
            let v = self.kills.get(t)?;
            tollgate_core::decision::Killed::kept(t, v, Some((now, plan.size())))
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

    fn rate_key(c: &tollgate_core::pipeline::RateCheck) -> RateKey {
        RateKey {
            scope: c.scope.shared_id().clone(),
            window_ms: c.window_ms,
            limit: c.limit,
        }
    }

    fn lease_key(c: &tollgate_core::pipeline::ConcurrencyCheck) -> LeaseKey {
        LeaseKey {
            scope: c.scope.shared_id().clone(),
            limit: c.limit,
        }
    }

    fn budget_key(c: &tollgate_core::pipeline::BudgetCheck, now: Millis) -> (BudgetKey, Millis) {
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
        // A count that reports no quota is a request's own counter (its repeats), not a shared
        // limit worth a slice: the store counts it.
        let own_counter = |p: &Plan| p.counts().any(|(_, r, _)| !r.reports_quota());
        // A budget that carries over is the store's too: what it carries is found there.
        let carries = |p: &Plan| p.reserves().any(|(_, b)| b.carry_cap > 0);
        let store_only = |p: &Plan| own_counter(p) || carries(p);
        if self.lost || plan.held_in_store || store_only(plan) || shadow.is_some_and(store_only) {
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
            if let Some(k) = self.killed(plan, now) {
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
        // Refused by a lease or a reservation: the slices' room, not the scope's, may be short.
        let held_by_slices = |p: &Plan, r: Reason| {
            p.checks
                .iter()
                .any(|c| c.reason == r && matches!(c.kind, Kind::Lease(_) | Kind::Reserve(_)))
        };
        let slice_short =
            |r: Reason| held_by_slices(plan, r) || shadow.is_some_and(|s| held_by_slices(s, r));
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
        if let (Some(s), Some(ShadowOutcome::Held)) = (shadow, &outcome) {
            // The shadow's slices grow with their use too.
            for (_, b) in s.reserves() {
                if let Some(slice) = self.budgets.get_mut(&Self::budget_key(b, now).0) {
                    slice.used = slice.used.saturating_add(b.amount);
                }
            }
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
            p.counts().any(|(_, _, c)| {
                self.rate
                    .get(&Self::rate_key(c))
                    .is_none_or(|s| rate::remaining(&s.window, c, now) == 0)
            }) || p.leases().any(|(_, c)| {
                self.leases
                    .get(&Self::lease_key(c))
                    .is_none_or(|s| s.headroom == 0)
            }) || p.reserves().any(|(_, b)| {
                self.budgets
                    .get(&Self::budget_key(b, now).0)
                    .is_none_or(|s| !budget::fits(b.amount, s.headroom))
            })
        })
    }

    /// Counts the attempt in every rate slice of the plan and its shadow's; the plan's rate
    /// quotas, as the store would give them.
    fn count(&mut self, plan: &Plan, shadow: Option<&Plan>, now: Millis) -> Vec<Quota> {
        let mut quotas = Vec::with_capacity(plan.checks.len());
        for (check, reason, c) in plan.counts() {
            if let Some(s) = self.rate.get_mut(&Self::rate_key(c)) {
                s.left -= 1;
                s.used += 1;
                // The window as if only the attempts made were counted.
                let mut w = s.window;
                w.current = w.current.saturating_sub(s.left);
                let counted = rate::Counted {
                    over: false,
                    remaining: rate::remaining(&w, c, now),
                    reset_after_ms: w.start.saturating_add(c.window_ms).saturating_sub(now),
                    retry_after_ms: 0,
                };
                quotas.push(rate::quota(reason, check, c, counted));
            }
        }
        for (_, _, c) in shadow.iter().flat_map(|s| s.counts()) {
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
        lp.attempt_counted = true;
        lp.kill_targets = tollgate_core::pipeline::KillTargets::default();
        for c in lp.leases_mut() {
            c.limit = self.leases.get(&Self::lease_key(c))?.slots;
        }
        for b in lp.reserves_mut() {
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
            match plan.checks.get(q.check).map(|c| &c.kind) {
                Some(Kind::Lease(c)) => {
                    if let Some(s) = self.leases.get_mut(&Self::lease_key(c)) {
                        s.peak = s.peak.max(s.slots.saturating_sub(q.remaining));
                        q.remaining = q.remaining.saturating_add(s.headroom);
                    }
                    q.limit = c.limit;
                }
                Some(Kind::Reserve(b)) => {
                    if let Some(s) = self.budgets.get_mut(&Self::budget_key(b, now).0) {
                        s.used = s.used.saturating_add(b.amount);
                        q.remaining = q.remaining.saturating_add(s.headroom);
                    }
                    q.limit = b.limit;
                }
                _ => {}
            }
            quotas.push(q);
        }
        quotas.sort_by_key(|q| q.check);
        a.quotas = quotas;
        Decision::Admit(a)
    }

    /// The attempts of `c`'s rate slice here not yet made (0 without one).
    pub fn unused(&self, c: &tollgate_core::pipeline::RateCheck) -> u64 {
        self.rate.get(&Self::rate_key(c)).map_or(0, |s| s.left)
    }

    /// Takes in an attempt of `plan` the store counted (one call of its own): the rate
    /// slices' windows count it too, so that their quotas stay the store's.
    pub fn learn_attempt(&mut self, plan: &Plan) {
        let now = self.last;
        for (_, _, c) in plan.counts() {
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
            match plan.checks.get(q.check).map(|c| &c.kind) {
                Some(Kind::Lease(c)) => {
                    if let Some(s) = self.leases.get_mut(&Self::lease_key(c)) {
                        s.headroom = q.remaining;
                    }
                }
                Some(Kind::Reserve(b)) => {
                    if let Some(s) = self.budgets.get_mut(&Self::budget_key(b, now).0) {
                        s.headroom = q.remaining;
                    }
                }
                _ => {}
            }
        }
    }
}
