//! Orders that take, grow, renew and give back an instance's slices, for the admission's
//! shortfalls and before the store decides a request.

use super::{
    Book, BudgetKey, BudgetSlice, Held, LeaseKey, LeaseSlice, Mark, Pending, RateKey, RateSlice,
};
use crate::SliceConfig;
use tollgate_core::clock::{Clock, Millis};
use tollgate_core::exchange::{BudgetOrder, LeaseOrder, Order, RateOrder};
use tollgate_core::ledger::RateWindow;
use tollgate_core::memory::MemoryStore;
use tollgate_core::pipeline::Plan;
use tollgate_core::store::StoreError;

pub(super) fn rate_order_of(key: &RateKey, take: u64, back: u64, back_start: Millis) -> Order {
    Order::Rate(RateOrder {
        scope: key.scope.clone(),
        limit: key.limit,
        window_ms: key.window_ms,
        take,
        back,
        back_start,
    })
}

pub(super) fn lease_order_of(key: &LeaseKey, s: &LeaseSlice, slots: u64, create: bool) -> Order {
    Order::Lease(LeaseOrder {
        slice: s.id.clone(),
        scope: key.scope.clone(),
        limit: key.limit,
        slots,
        ttl_ms: s.ttl_ms,
        create,
    })
}

pub(super) fn budget_order_of(
    key: &BudgetKey,
    s: &BudgetSlice,
    amount: u64,
    keep: u64,
    settled: u64,
    create: bool,
) -> Order {
    Order::Budget(BudgetOrder {
        slice: s.id.clone(),
        scope: key.scope.clone(),
        limit: key.limit,
        unit: key.unit,
        period: key.period,
        period_id: key.period_id,
        amount,
        keep,
        settled,
        ttl_ms: s.ttl_ms,
        create,
    })
}

impl Book {
    /// Orders for every slice `plan` lacks or that is short of its request: rate (when the
    /// attempt is still to be counted), then slots, then budgets. True when a slice cannot be
    /// had now (a budget period about to end, reservations of a lost slice still out): the
    /// store decides.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn want_missing<C: Clock>(
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
            for (_, _, c) in plan.counts() {
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
        for (_, c) in plan.leases() {
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
        for (_, b) in plan.reserves() {
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
    pub(super) fn room_for<C: Clock>(
        &self,
        engine: &MemoryStore<C>,
        plan: &Plan,
        now: Millis,
    ) -> Result<bool, StoreError> {
        for (_, c) in plan.leases() {
            let slots = self.leases.get(&Self::lease_key(c)).map_or(0, |s| s.slots);
            if engine.held(c.scope.id(), None)?.0 >= slots {
                return Ok(false);
            }
        }
        for (_, b) in plan.reserves() {
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
    pub(super) fn grow_all<C: Clock>(
        &mut self,
        cfg: &SliceConfig,
        engine: &MemoryStore<C>,
        plan: &Plan,
        now: Millis,
        want: &mut Pending,
    ) -> Result<(), StoreError> {
        let ttl = cfg.slice_ttl(plan.ttl_ms);
        for (_, c) in plan.leases() {
            let key = Self::lease_key(c);
            if want.has_lease(&key) {
                continue;
            }
            let (in_use, _, _) = engine.held(c.scope.id(), None)?;
            if self.leases.get(&key).is_none_or(|s| in_use >= s.slots) {
                self.lease_order(key, in_use, ttl, want);
            }
        }
        for (_, b) in plan.reserves() {
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

    pub(super) fn rate_order(&mut self, key: RateKey, take: u64, now: Millis, want: &mut Pending) {
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
        want.push(rate_order_of(&key, take, back, back_start), Mark::Rate(key));
    }

    pub(super) fn lease_order(
        &mut self,
        key: LeaseKey,
        in_use: u64,
        ttl_ms: u64,
        want: &mut Pending,
    ) {
        if let Some(s) = self.leases.get(&key) {
            // Doubling at least: a burst of requests in flight reaches its size in a few
            // exchanges.
            let target = in_use.saturating_add(s.peak.saturating_mul(2).max(in_use).max(4));
            let slots = target.max(s.slots);
            want.push(lease_order_of(&key, s, slots, !s.made), Mark::Lease(key));
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
    pub(super) fn budget_order(
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
            budget_order_of(&key, s, amount, reserved, settled_total, !s.made),
            Mark::Budget(key, settled_total),
        );
        true
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
            for (_, _, c) in p.counts() {
                let key = Self::rate_key(c);
                if let Some(s) = self.rate.get_mut(&key).filter(|s| s.left > 0) {
                    let back = std::mem::take(&mut s.left);
                    let back_start = s.window.start;
                    out.push(rate_order_of(&key, 0, back, back_start), Mark::Rate(key));
                }
            }
            for (_, c) in p.leases() {
                let key = Self::lease_key(c);
                let Some(s) = self.leases.get_mut(&key).filter(|s| s.made) else {
                    continue;
                };
                let (in_use, _, _) = engine.held(&key.scope, None)?;
                if s.slots > in_use {
                    s.slots = in_use;
                    out.push(lease_order_of(&key, s, in_use, false), Mark::Lease(key));
                }
            }
            for (_, b) in p.reserves() {
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
                        budget_order_of(&key, s, reserved, reserved, total, !s.made),
                        Mark::Budget(key, total),
                    );
                }
            }
        }
        Ok(out)
    }

    /// Orders renewing every slice that would expire before `until`.
    pub fn renewals(&mut self, until: Millis) -> Pending {
        let mut out = Pending::default();
        for (key, s) in &self.leases {
            if s.made && s.expires < until {
                out.push(
                    lease_order_of(key, s, s.slots, false),
                    Mark::Lease(key.clone()),
                );
            }
        }
        for (key, s) in &self.budgets {
            if s.made && s.expires < until {
                out.push(
                    budget_order_of(key, s, s.amount, 0, s.reported, false),
                    Mark::Budget(key.clone(), s.reported),
                );
            }
        }
        out
    }
}
