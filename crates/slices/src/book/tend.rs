//! Maintenance of an instance's slices (reports, renewals, growth, give-backs), the store's
//! answers taken in, and what the slices change in the store's figures.

use std::sync::Arc;

use super::orders::{budget_order_of, lease_order_of, rate_order_of};
use super::{Book, BudgetKey, LeaseKey, Map, Mark, Pending, RateKey};
use crate::SliceConfig;
use tollgate_core::clock::{Clock, Millis};
use tollgate_core::exchange::{Exchanged, Granted, Order};
use tollgate_core::ledger::Period;
use tollgate_core::ledger::RateWindow;
use tollgate_core::memory::MemoryStore;
use tollgate_core::store::StoreError;

impl Book {
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
                        rate_order_of(&key, 0, back, s.window.start),
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

    pub(super) fn tend_leases<C: Clock>(
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
            out.push(lease_order_of(&key, s, target, !s.made), Mark::Lease(key));
        }
        Ok(())
    }

    pub(super) fn tend_budgets<C: Clock>(
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
                budget_order_of(&key, s, target, reserved, total, !s.made),
                Mark::Budget(key, total),
            );
        }
        Ok(())
    }

    /// Takes in the store's answer to `orders`, which were sent at local time `sent_at` and
    /// answered at `local_now`.
    pub fn apply(
        &mut self,
        marks: &[Mark],
        orders: &[Order],
        ex: &Exchanged,
        sent_at: Millis,
        local_now: Millis,
    ) {
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
        for ((mark, order), granted) in marks.iter().zip(orders).zip(&ex.granted) {
            let granted = self.held_to(order, *granted, ex.now);
            self.take_in(mark, granted, ex.now.max(now));
        }
    }

    /// A store's answer is outside input: it never grants more than was asked, nor attempts
    /// of another window than the one containing its time. Anything beyond is cut down to what
    /// was asked (a window that does not fit grants nothing), and counted.
    fn held_to(&mut self, order: &Order, g: Granted, now: Millis) -> Granted {
        let (fixed, odd) = match (order, g) {
            (Order::Rate(o), Granted::Rate { granted, window }) => {
                let start = now - now % o.window_ms.max(1);
                if window.start != start {
                    let window = RateWindow { start, ..window };
                    (Granted::Rate { granted: 0, window }, true)
                } else {
                    let fit = granted.min(o.take);
                    (
                        Granted::Rate {
                            granted: fit,
                            window,
                        },
                        fit != granted,
                    )
                }
            }
            (Order::Lease(o), Granted::Lease { slots, held }) => {
                let fit = slots.min(o.slots);
                (Granted::Lease { slots: fit, held }, fit != slots)
            }
            (Order::Budget(o), Granted::Budget { amount, committed }) => {
                let fit = amount.min(o.amount.max(o.keep));
                (
                    Granted::Budget {
                        amount: fit,
                        committed,
                    },
                    fit != amount,
                )
            }
            (_, Granted::Gone) => (Granted::Gone, false),
            // An answer of another kind than its order: nothing granted.
            (Order::Rate(_), _) | (Order::Lease(_), _) | (Order::Budget(_), _) => {
                (Granted::Gone, true)
            }
        };
        if odd {
            self.anomalies += 1;
        }
        fixed
    }

    pub(super) fn take_in(&mut self, mark: &Mark, granted: Granted, now: Millis) {
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
pub(crate) struct Correction {
    pub slice_leases: u64,
    pub local_leases: u64,
    pub slice_amount: u64,
    pub local_reserved: u64,
    pub unreported: u64,
}
