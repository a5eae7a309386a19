//! The memory store's state under its lock: scope slots found and made, what a sweep forgets,
//! a ticket's end, and what one admission remembers while it runs (periods, slots).

#[allow(clippy::wildcard_imports)] // the parent's private types, which this module works on
use super::*;

impl State {
    pub(super) fn live_scopes(&self) -> impl Iterator<Item = &ScopeState> {
        self.scopes.values().filter_map(|&i| self.slots.get(i))
    }

    /// The slot of a scope that has one.
    pub(super) fn find(&self, key: &ScopeKey, seen: &mut Resolved) -> Option<usize> {
        if let Some(slot) = seen.get(key) {
            return Some(slot);
        }
        let slot = *self.scopes.get(key.id())?;
        seen.put(key, slot);
        Some(slot)
    }

    /// The slot of a scope, given one if it has none.
    pub(super) fn slot(&mut self, key: &ScopeKey, seen: &mut Resolved) -> usize {
        if let Some(slot) = self.find(key, seen) {
            return slot;
        }
        let slot = self.new_slot(key.shared_id());
        seen.put(key, slot);
        slot
    }

    /// The slot of a scope by its id, given one if it has none.
    pub(super) fn slot_by_id(&mut self, id: &Arc<str>) -> usize {
        match self.scopes.get(id) {
            Some(&slot) => slot,
            None => self.new_slot(id),
        }
    }

    /// A slot for a scope that has none.
    pub(super) fn new_slot(&mut self, id: &Arc<str>) -> usize {
        let state = ScopeState {
            id: Some(id.clone()),
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
        // Absent: the callers just missed it.
        self.scopes.insert_new(id.clone(), slot);
        slot
    }

    /// Expires due tickets, forgets ids past their retention (or beyond the cap) and, once a
    /// second, passes over the scopes to drop state nothing needs: the pass a little per call,
    /// unless `complete`.
    pub(super) fn sweep(
        &mut self,
        now: Millis,
        retention: u64,
        max_remembered: usize,
        complete: bool,
    ) {
        while let Some((slot, id, t)) = self.tickets.due(now) {
            let id = id.clone();
            let charged = end_ticket(&mut self.slots, t, None);
            self.expiries.record(&id, now, t, &charged, &self.slots);
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
    pub(super) fn sweep_slot(&mut self, i: usize, now: Millis) {
        let Some(s) = self.slots.get_mut(i) else {
            return;
        };
        if s.id.is_none() {
            return;
        }
        if s.rate.is_some_and(|(w, r)| r.is_stale(now, w)) {
            s.rate = None;
        }
        s.cells
            .retain(|(_, c)| c.end.max(c.keep) > now || c.outstanding > 0);
        if s.rate.is_none() && s.leases == 0 && s.cells.is_empty() {
            if let Some(id) = s.id.take() {
                self.scopes.remove(&id);
            }
            *s = ScopeState::default();
            self.free.push(i);
        }
    }

    pub(super) fn finish(
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
}

/// Returns leases and replaces reservations with the charge for `usage` (`None`: the ticket's
/// expired usage).
pub(super) fn end_ticket(slots: &mut Slots, t: &Ticket, usage: Option<Usage>) -> Vec<u64> {
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
        let amount = match r.slice {
            Some(_) => r.amount,
            None => charge(r.unit, t.price, &usage),
        };
        if let Some(c) = slots
            .get_mut(r.slot)
            .and_then(|s| s.cell_mut((r.period, r.period_id)))
        {
            c.reserved = c.reserved.saturating_sub(r.amount);
            c.settled = c.settled.saturating_add(amount);
            c.outstanding = c.outstanding.saturating_sub(1);
        }
        if !r.shadow {
            charged.push(amount);
        }
    }
    charged
}

/// The last [`PeriodCache::N`] periods found, each with the span its answer holds for.
#[derive(Debug, Default)]
pub(super) struct PeriodCache {
    /// (period, id, start, end); an entry with `start == end` (the default) matches no instant.
    found: [(Option<Period>, u64, Millis, Millis); PeriodCache::N],
    next: usize,
}

impl PeriodCache {
    const N: usize = 4;

    /// [`Period::at`], from the cache when `now` is in a span found before.
    pub(super) fn at(&mut self, period: Period, now: Millis) -> (u64, Millis, Millis) {
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
pub(super) struct Fresh {
    pub(super) id: Id,
    pub(super) quotas: Vec<Quota>,
}

/// The slots of a plan's scopes found so far in one admission. A plan's checks share their
/// scope's key, so comparing pointers finds a repeat without hashing the id again.
#[derive(Default)]
pub(super) struct Resolved {
    seen: [(usize, usize); 8],
    n: usize,
}

impl Resolved {
    pub(super) fn addr(key: &ScopeKey) -> usize {
        Arc::as_ptr(key.shared_id()).cast::<u8>().addr()
    }

    pub(super) fn get(&self, key: &ScopeKey) -> Option<usize> {
        let a = Self::addr(key);
        self.seen
            .iter()
            .take(self.n)
            .find(|(k, _)| *k == a)
            .map(|(_, slot)| *slot)
    }

    pub(super) fn put(&mut self, key: &ScopeKey, slot: usize) {
        // Beyond eight scopes the rest are hashed each time: still correct.
        if let Some(e) = self.seen.get_mut(self.n) {
            *e = (Self::addr(key), slot);
            self.n += 1;
        }
    }
}
