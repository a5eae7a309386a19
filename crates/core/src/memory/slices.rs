//! The memory store as a [`SliceSource`]: the twin of the Redis store's slice orders, so that
//! the slice layer ([`crate::exchange`]) is tested on a manual clock with several instances
//! sharing one store. A slice of slots or of a budget is a ticket of its own under the slice's
//! id: its holds are the slots (one lease each) or one reservation, it expires like a request's
//! (the slots come back; the reservation is charged in full), and an order renews it.

use std::future::Future;

use super::{Cell, Hold, MemoryStore, Request, Reservation, State, Ticket, lost_slot};
use crate::clock::{Clock, Millis};
use crate::exchange::{
    BudgetOrder, Exchange, Exchanged, Granted, LeaseOrder, Order, RateOrder, SliceSource, share,
};
use crate::ledger::{COUNT_CAP, RateWindow, WEIGHT_SCALE};
use crate::store::{Ending, StoreError};

impl<C: Clock> SliceSource for MemoryStore<C> {
    fn exchange(
        &self,
        ex: &Exchange,
    ) -> impl Future<Output = Result<Exchanged, StoreError>> + Send {
        std::future::ready(self.exchange_sync(ex))
    }
}

impl<C: Clock> MemoryStore<C> {
    /// [`SliceSource::exchange`], synchronously.
    pub fn exchange_sync(&self, ex: &Exchange) -> Result<Exchanged, StoreError> {
        let clock = self.clock.now();
        let (mut st, now) = self.lock()?;
        let mut granted = Vec::with_capacity(ex.orders.len());
        for o in &ex.orders {
            granted.push(match o {
                Order::Rate(r) => st.rate_order(r, ex.divisor, now)?,
                Order::Lease(l) => st.lease_order(l, ex.divisor, now, self.retention_ms)?,
                Order::Budget(b) => st.budget_order(b, ex.divisor, now, self.retention_ms)?,
            });
        }
        let kills = ex.kills.then(|| {
            st.kills
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        });
        Ok(Exchanged {
            now,
            clock: clock.min(now),
            kills,
            granted,
        })
    }
}

/// Where a slice's ticket is: in flight at a ticket slot, never made, or ended (expired).
enum Found {
    Live(u32),
    Absent,
    Ended,
}

impl State {
    fn find_slice(&self, id: &str) -> Found {
        match self.requests.get(id) {
            Some(Request::InFlight(t)) => Found::Live(*t),
            Some(Request::Ended(_)) => Found::Ended,
            None => Found::Absent,
        }
    }

    /// A new slice's ticket, holding nothing yet.
    fn new_slice(&mut self, id: &str, ttl_ms: u64, now: Millis) -> Result<u32, StoreError> {
        let ticket = Ticket {
            expires_at: now.saturating_add(ttl_ms),
            ttl_ms,
            ..Ticket::default()
        };
        let id = super::Id::new(id);
        let t = self
            .tickets
            .insert(id.clone(), ticket)
            .ok_or_else(super::too_many_in_flight)?;
        self.requests.insert_new(id, Request::InFlight(t));
        Ok(t)
    }

    /// Ends a slice that holds nothing any more: no charge.
    fn end_slice(&mut self, id: &str, t: u32, now: Millis, retention: u64) {
        self.tickets.remove(t);
        if let Some(r) = self.requests.get_mut(id) {
            *r = Request::Ended(Ending::Released);
        }
        self.forget
            .push_back((now.saturating_add(retention), super::Id::new(id)));
    }

    fn rate_order(
        &mut self,
        o: &RateOrder,
        divisor: u64,
        now: Millis,
    ) -> Result<Granted, StoreError> {
        let slot = self.slot_by_id(&o.scope);
        let scope = self.slots.get_mut(slot).ok_or_else(lost_slot)?;
        let entry = scope
            .rate
            .get_or_insert((o.window_ms, RateWindow::default()));
        if entry.0 != o.window_ms {
            *entry = (o.window_ms, RateWindow::default());
        }
        let w = &mut entry.1;
        w.roll(now, o.window_ms);
        if o.back > 0 {
            if w.start == o.back_start {
                w.current = w.current.saturating_sub(o.back);
            } else if w.start == o.back_start.saturating_add(o.window_ms) {
                w.previous = w.previous.saturating_sub(o.back);
            }
        }
        let used = w.scaled_count(now, o.window_ms);
        let free = o.limit.saturating_mul(WEIGHT_SCALE).saturating_sub(used) / WEIGHT_SCALE;
        let granted = o.take.min(share(free, divisor));
        w.current = w.current.saturating_add(granted).min(COUNT_CAP);
        Ok(Granted::Rate {
            granted,
            window: *w,
        })
    }

    fn lease_order(
        &mut self,
        o: &LeaseOrder,
        divisor: u64,
        now: Millis,
        retention: u64,
    ) -> Result<Granted, StoreError> {
        let slot = self.slot_by_id(&o.scope);
        let t = match self.find_slice(&o.slice) {
            Found::Live(t) => t,
            Found::Absent if o.create && o.slots > 0 => self.new_slice(&o.slice, o.ttl_ms, now)?,
            Found::Absent if o.create => {
                let held = self.slots.get(slot).map_or(0, |s| s.leases);
                return Ok(Granted::Lease { slots: 0, held });
            }
            Found::Absent | Found::Ended => return Ok(Granted::Gone),
        };
        let (Some(ticket), Some(scope)) = (self.tickets.get_mut(t), self.slots.get_mut(slot))
        else {
            return Err(lost_slot());
        };
        let n = ticket.holds.len() as u64;
        if o.slots > n {
            let grow = (o.slots - n).min(share(o.limit.saturating_sub(scope.leases), divisor));
            if grow > 0 && scope.leases == 0 {
                scope.soonest = ticket.expires_at;
            }
            scope.leases += grow;
            ticket.holds.extend((0..grow).map(|_| Hold::Lease(slot)));
        } else if o.slots < n {
            let back = n - o.slots;
            scope.leases = scope.leases.saturating_sub(back);
            ticket.holds.truncate(o.slots as usize);
        }
        let (slots, held) = (ticket.holds.len() as u64, scope.leases);
        if slots == 0 {
            self.end_slice(&o.slice, t, now, retention);
        } else {
            self.tickets.renew(t, now);
        }
        Ok(Granted::Lease { slots, held })
    }

    fn budget_order(
        &mut self,
        o: &BudgetOrder,
        divisor: u64,
        now: Millis,
        retention: u64,
    ) -> Result<Granted, StoreError> {
        let (pid, _, end) = self.periods.at(o.period, now);
        let current = o.period_id == pid;
        let slot = self.slot_by_id(&o.scope);
        let key = (o.period, o.period_id);
        let committed = |st: &State| {
            st.slots
                .get(slot)
                .and_then(|s| s.cell(key))
                .map_or(0, |c| c.settled.saturating_add(c.reserved))
        };
        let t = match self.find_slice(&o.slice) {
            Found::Live(t) => t,
            // A new slice takes only in the period containing now.
            Found::Absent
                if o.create && (current && o.amount > 0 || o.keep > 0 || o.settled > 0) =>
            {
                let t = self.new_slice(&o.slice, o.ttl_ms, now)?;
                let scope = self.slots.get_mut(slot).ok_or_else(lost_slot)?;
                let at = match scope.cells.iter().position(|(k, _)| *k == key) {
                    Some(at) => at,
                    None => {
                        scope.cells.push((
                            key,
                            Cell {
                                end,
                                ..Cell::default()
                            },
                        ));
                        scope.cells.len() - 1
                    }
                };
                scope.cells[at].1.outstanding += 1;
                if let Some(ticket) = self.tickets.get_mut(t) {
                    ticket.holds.push(Hold::Budget(Reservation {
                        slot,
                        period: o.period,
                        period_id: o.period_id,
                        unit: o.unit,
                        amount: 0,
                        shadow: false,
                        slice: Some(0),
                    }));
                }
                t
            }
            Found::Absent if o.create => {
                return Ok(Granted::Budget {
                    amount: 0,
                    committed: committed(self),
                });
            }
            Found::Absent | Found::Ended => return Ok(Granted::Gone),
        };
        let amount = self.adjust_budget_slice(o, t, slot, current, divisor)?;
        let committed = committed(self);
        if amount == 0 {
            if let Some(c) = self.slots.get_mut(slot).and_then(|s| s.cell_mut(key)) {
                c.outstanding = c.outstanding.saturating_sub(1);
            }
            self.end_slice(&o.slice, t, now, retention);
        } else {
            self.tickets.renew(t, now);
        }
        Ok(Granted::Budget { amount, committed })
    }

    /// Charges what the slice's requests were charged since its last report, then sets its
    /// reservation (more only in the current period, as far as the divisor allows); returns the
    /// reservation.
    fn adjust_budget_slice(
        &mut self,
        o: &BudgetOrder,
        t: u32,
        slot: usize,
        current: bool,
        divisor: u64,
    ) -> Result<u64, StoreError> {
        let (Some(ticket), Some(scope)) = (self.tickets.get_mut(t), self.slots.get_mut(slot))
        else {
            return Err(lost_slot());
        };
        let Some(Hold::Budget(r)) = ticket.holds.first_mut() else {
            return Err(StoreError::Protocol(format!(
                "slice {} holds no reservation",
                o.slice
            )));
        };
        let Some(cell) = scope.cell_mut((r.period, r.period_id)) else {
            return Err(lost_slot());
        };
        let reported = r.slice.unwrap_or(0);
        // Charged in full even beyond the reservation, as a request's settlement is.
        let delta = o.settled.saturating_sub(reported);
        let taken = delta.min(r.amount);
        cell.settled = cell.settled.saturating_add(delta);
        cell.reserved = cell.reserved.saturating_sub(taken);
        r.amount -= taken;
        r.slice = Some(reported.saturating_add(delta));
        if r.amount < o.keep {
            cell.reserved = cell.reserved.saturating_add(o.keep - r.amount);
            r.amount = o.keep;
        }
        if o.amount > r.amount && current {
            let free = o
                .limit
                .saturating_sub(cell.settled.saturating_add(cell.reserved));
            let grow = (o.amount - r.amount).min(share(free, divisor));
            cell.reserved += grow;
            r.amount += grow;
        } else if o.amount < r.amount {
            let back = r.amount - o.amount;
            cell.reserved = cell.reserved.saturating_sub(back);
            r.amount = o.amount;
        }
        // A scope past its limit (charges beyond reservations) lends nothing it does not need.
        let over = cell
            .settled
            .saturating_add(cell.reserved)
            .saturating_sub(o.limit);
        let trim = over.min(r.amount.saturating_sub(o.keep));
        cell.reserved = cell.reserved.saturating_sub(trim);
        r.amount -= trim;
        Ok(r.amount)
    }
}
