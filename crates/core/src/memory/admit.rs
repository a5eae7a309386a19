//! One admission, in the steps of the Redis script's `admit_one`: the kill switch, the duplicate
//! check, count every count of the plan, walk its checks in order to the first refusal (a count
//! over its limit, a verdict, a full lease set, a budget without room), then take the holds
//! (leases, reservations, the ticket). Every step before the last only reads or counts, so a
//! refusal takes nothing.

use super::{
    Cell, Fresh, Hold, Request, Reservation, Resolved, State, Ticket, lost_slot, too_many_in_flight,
};
use crate::clock::Millis;
use crate::controls::{BudgetCheck, ConcurrencyCheck, Kind, budget, concurrency, rate};
use crate::decision::{Admitted, Decision, Deny, Quota, Reason};
use crate::ledger::RateWindow;
use crate::pipeline::Plan;
use crate::store::{ShadowOutcome, StoreError};

/// Each reservation's period (id and end), by its rank among the plan's reservations, found
/// once in the check and kept for the reservation: a calendar month takes some arithmetic. Up
/// to eight; later ones are found again.
type Periods = [(u64, Millis); 8];

impl State {
    pub(super) fn admit(
        &mut self,
        plan: &Plan,
        now: Millis,
        fresh: Fresh,
    ) -> Result<Decision, StoreError> {
        self.admit_holding(plan, now, fresh, None)
    }

    /// [`crate::Store::admit_shadowed`]: the shadow plan's checks first (its attempts counted,
    /// nothing taken), then the request's admission, which takes the shadow's holds as well
    /// when both admit. The shadow's scopes are its rules', never the request's, so what the
    /// request's admission does between the two leaves the shadow's checks true.
    pub(super) fn admit_shadowed(
        &mut self,
        plan: &Plan,
        shadow: &Plan,
        now: Millis,
        fresh: Fresh,
    ) -> Result<(Decision, ShadowOutcome), StoreError> {
        // A known id counts nowhere, the shadow's scopes included.
        if self.requests.get(&plan.request_id).is_some() {
            return Err(StoreError::DuplicateRequestId(plan.request_id.clone()));
        }
        let mut periods: Periods = [(0, 0); 8];
        let mut quotas = Vec::new();
        let probe = self.checks(
            shadow,
            now,
            &mut Resolved::default(),
            &mut quotas,
            &mut periods,
        )?;
        let Some(refused) = probe else {
            let d = self.admit_holding(plan, now, fresh, Some((shadow, &periods)))?;
            let held = if matches!(d, Decision::Admit(_)) {
                ShadowOutcome::Held
            } else {
                ShadowOutcome::Passed
            };
            return Ok((d, held));
        };
        let d = self.admit_holding(plan, now, fresh, None)?;
        Ok(match refused {
            Decision::Deny(r) => (d, ShadowOutcome::Refused(r)),
            _ => (d, ShadowOutcome::Failed),
        })
    }

    /// One admission; when it admits, it also holds what `shadow`'s plan would take (checked
    /// before, with the periods of its budgets).
    fn admit_holding(
        &mut self,
        plan: &Plan,
        now: Millis,
        fresh: Fresh,
        shadow: Option<(&Plan, &Periods)>,
    ) -> Result<Decision, StoreError> {
        let Fresh { id, mut quotas } = fresh;
        // The kill switch comes before everything, attempt counting included.
        if let Some(k) = self.kill_switch(plan, now) {
            return Ok(k);
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
        let mut periods: Periods = [(0, 0); 8];
        if let Some(d) = self.checks(plan, now, &mut seen, &mut quotas, &mut periods)? {
            return Ok(d);
        }
        let holds = Holds {
            plan,
            periods: &periods,
            shadow,
        };
        let expires_at = self.take_holds(holds, now, &mut seen, id, id_hash)?;
        Ok(Decision::Admit(Admitted {
            max_output_tokens: plan.max_output_tokens,
            expires_at,
            quotas,
            fail_open: false,
        }))
    }

    /// Every step before the holds: count every count, then walk the checks in order to the
    /// first refusal. Each reservation's period is kept in `periods`, by its rank.
    fn checks(
        &mut self,
        plan: &Plan,
        now: Millis,
        seen: &mut Resolved,
        quotas: &mut Vec<Quota>,
        periods: &mut Periods,
    ) -> Result<Option<Decision>, StoreError> {
        // Every attempt counts in every count, whatever refuses it; a count over its limit
        // refuses at its place.
        let mut over = self.count(plan, now, seen, quotas)?;
        let mut rank = 0;
        for (i, check) in plan.checks.iter().enumerate() {
            let refused = match &check.kind {
                Kind::Count(_) => match over.take() {
                    Some((at, d)) if at == i => Some(d),
                    other => {
                        over = other;
                        None
                    }
                },
                Kind::Verdict(d) => Some(d.clone()),
                Kind::Peek(_) => None,
                Kind::Lease(c) => self.check_lease(check.reason, i, c, now, seen, quotas),
                Kind::Reserve(c) => {
                    let p = self.check_reserve(check.reason, i, c, now, seen, quotas);
                    if let Some(slot) = periods.get_mut(rank) {
                        *slot = p.0;
                    }
                    rank += 1;
                    p.1
                }
            };
            if let Some(d) = refused {
                return Ok(Some(Decision::Deny(d)));
            }
        }
        quotas.sort_by_key(|q| q.check);
        Ok(None)
    }

    /// The first of the plan's targets that is switched off.
    fn kill_switch(&self, plan: &Plan, now: Millis) -> Option<Decision> {
        if self.kills.is_empty() {
            return None;
        }
        plan.kill_targets.iter().find_map(|t| {
            let v = self.kills.get(t)?;
            crate::decision::Killed::kept(t, v, Some((now, plan.size()))).map(Decision::Killed)
        })
    }

    /// Every attempt counts in every count of the plan, admitted or not. The first count over
    /// its limit, with its place in the plan and its refusal; the counts' quotas go into
    /// `quotas`.
    fn count(
        &mut self,
        plan: &Plan,
        now: Millis,
        seen: &mut Resolved,
        quotas: &mut Vec<Quota>,
    ) -> Result<Option<(usize, Deny)>, StoreError> {
        let mut first_over = None;
        for (i, reason, c) in plan.peeks() {
            let slot = self.slot(&c.scope, seen);
            let Some(scope) = self.slots.get(slot) else {
                return Err(lost_slot());
            };
            let window = scope.rate.unwrap_or((c.window_ms, RateWindow::default()));
            if reason.reports_quota() {
                quotas.push(rate::quota(reason, i, c, rate::peek(&window, c, now)));
            }
        }
        if plan.attempt_counted {
            return Ok(None);
        }
        for (i, reason, c) in plan.counts() {
            let slot = self.slot(&c.scope, seen);
            let Some(scope) = self.slots.get_mut(slot) else {
                return Err(lost_slot());
            };
            let window = scope
                .rate
                .get_or_insert((c.window_ms, RateWindow::default()));
            let counted = rate::count(window, c, now);
            if counted.over && first_over.is_none() {
                first_over = Some((i, rate::deny(c, counted, reason)));
            }
            if reason.reports_quota() {
                quotas.push(rate::quota(reason, i, c, counted));
            }
        }
        Ok(first_over)
    }

    /// One more lease in the scope of `c`, the `i`th check; a scope whose leases are all held
    /// refuses.
    fn check_lease(
        &self,
        reason: Reason,
        i: usize,
        c: &ConcurrencyCheck,
        now: Millis,
        seen: &mut Resolved,
        quotas: &mut Vec<Quota>,
    ) -> Option<Deny> {
        let scope = self.find(&c.scope, seen).and_then(|i| self.slots.get(i));
        let held = scope.map_or(0, |s| s.leases);
        match concurrency::check(reason, c, held, scope.map(|s| s.soonest), now) {
            Ok(remaining) => {
                if reason.reports_quota() {
                    quotas.push(concurrency::quota(reason, i, c, remaining));
                }
                None
            }
            Err(d) => Some(d),
        }
    }

    /// The reservation of `c`, the `i`th check: settled, reserved and its amount must stay
    /// within its limit in the period containing now. Returns that period (id and end) with
    /// the refusal, if any.
    fn check_reserve(
        &mut self,
        reason: Reason,
        i: usize,
        c: &BudgetCheck,
        now: Millis,
        seen: &mut Resolved,
        quotas: &mut Vec<Quota>,
    ) -> ((u64, Millis), Option<Deny>) {
        let (pid, start, end) = self.periods.at(c.period, now);
        let cell = self
            .find(&c.scope, seen)
            .and_then(|i| self.slots.get(i))
            .map(|s| s.cell_or_new(c, pid, (start, end)))
            .unwrap_or(Cell {
                end,
                ..Cell::default()
            });
        let committed = cell.settled.saturating_add(cell.reserved);
        match budget::check_carrying(reason, i, (c, cell.carry), committed, (start, end), now) {
            Ok(q) => {
                if reason.reports_quota() {
                    quotas.push(q);
                }
                ((pid, end), None)
            }
            Err(d) => ((pid, end), Some(d)),
        }
    }

    /// Everything passed: take the leases, make the reservations (the shadow plan's too, when
    /// given) and keep the ticket. Returns when they expire.
    fn take_holds(
        &mut self,
        h: Holds<'_>,
        now: Millis,
        seen: &mut Resolved,
        id: super::Id,
        id_hash: u64,
    ) -> Result<Millis, StoreError> {
        let plan = h.plan;
        let expires_at = now.saturating_add(plan.ttl_ms);
        let extra = h.shadow.map_or(0, |(s, _)| s.holds());
        let mut holds = self.tickets.spare_holds(plan.holds() + extra);
        self.hold(plan, h.periods, false, expires_at, now, seen, &mut holds)?;
        if let Some((s, periods)) = h.shadow {
            self.hold(s, periods, true, expires_at, now, seen, &mut holds)?;
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
        Ok(expires_at)
    }

    /// Takes `plan`'s leases and makes its reservations (in the periods it was checked in),
    /// into `holds`.
    #[allow(clippy::too_many_arguments)]
    fn hold(
        &mut self,
        plan: &Plan,
        periods: &Periods,
        shadow: bool,
        expires_at: Millis,
        now: Millis,
        seen: &mut Resolved,
        holds: &mut Vec<Hold>,
    ) -> Result<(), StoreError> {
        for (_, c) in plan.leases() {
            let slot = self.slot(&c.scope, seen);
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
        for (i, (_, c)) in plan.reserves().enumerate() {
            // The same period as checked: `now` has not moved.
            let (pid, end) = match periods.get(i) {
                Some(&p) => p,
                None => {
                    let (pid, _, end) = self.periods.at(c.period, now);
                    (pid, end)
                }
            };
            let slot = self.slot(&c.scope, seen);
            let Some(scope) = self.slots.get_mut(slot) else {
                return Err(lost_slot());
            };
            let key = (c.period, pid);
            let at = match scope.cells.iter().position(|(k, _)| *k == key) {
                Some(at) => at,
                None => {
                    let (start, _) = c.period.span(pid);
                    let fresh = scope.cell_or_new(c, pid, (start, end));
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
                shadow,
                slice: None,
            }));
        }
        Ok(())
    }
}

/// What an admission that passed takes: its plan's holds (in the periods checked) and, when
/// the shadow's checks passed too, the shadow plan's.
struct Holds<'a> {
    plan: &'a Plan,
    periods: &'a Periods,
    shadow: Option<(&'a Plan, &'a Periods)>,
}
