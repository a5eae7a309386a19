//! One admission, in the steps of the Redis script's `admit_one`: the kill switch, the duplicate
//! check, count the attempt in every rate scope and the request's repeats, the token verdict,
//! concurrency, budgets and tool calls (check all), the repeats' verdict and the history's, then
//! take the holds (leases, reservations, the ticket). Every step before the last only reads or
//! counts, so a refusal takes nothing.

use super::{
    CONCURRENCY_RETRY_HINT_MS, Cell, Fresh, Hold, Request, Reservation, Resolved, State, Ticket,
    lost_slot, too_many_in_flight,
};
use crate::clock::Millis;
use crate::decision::{Admitted, Decision, Deny, Quota, Reason};
use crate::ledger::RateWindow;
use crate::pipeline::Plan;
use crate::store::StoreError;

/// Each budget's period (id and end), found once in the check and kept for the reservation:
/// a calendar month takes some arithmetic. Up to eight budgets.
type Periods = [(u64, Millis); 8];

impl State {
    pub(super) fn admit(
        &mut self,
        plan: &Plan,
        now: Millis,
        fresh: Fresh,
    ) -> Result<Decision, StoreError> {
        let Fresh { id, mut quotas } = fresh;
        // The kill switch comes before everything, attempt counting included.
        if let Some(k) = self.kill_switch(plan) {
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
        let rate = self.count(
            &plan.rate,
            Reason::RequestRateLimit,
            now,
            &mut seen,
            Some(&mut quotas),
        );
        // Repeats are counted with the attempt, whatever refuses it, and refuse last.
        let repeated = self.count(&plan.repeats, Reason::LoopDetected, now, &mut seen, None)?;
        if let Some(d) = rate? {
            return Ok(Decision::Deny(d));
        }
        // 2–4. Token controls, decided by the pure pipeline.
        if let Some(d) = &plan.token_verdict {
            return Ok(Decision::Deny(d.clone()));
        }
        if let Some(d) = self.check_concurrency(plan, now, &mut seen, &mut quotas) {
            return Ok(d);
        }
        if let Some(d) = self.check_budgets(plan, now, &mut seen, &mut quotas, &mut periods) {
            return Ok(d);
        }
        if let Some(d) = repeated.or_else(|| plan.loop_verdict.clone()) {
            return Ok(Decision::Deny(d));
        }
        let expires_at = self.take_holds(plan, now, &mut seen, &periods, id, id_hash)?;
        Ok(Decision::Admit(Admitted {
            max_output_tokens: plan.max_output_tokens,
            expires_at,
            quotas,
            fail_open: false,
        }))
    }

    /// The first of the plan's targets that is switched off.
    fn kill_switch(&self, plan: &Plan) -> Option<Decision> {
        if self.kills.is_empty() {
            return None;
        }
        plan.kill_targets.iter().find_map(|t| {
            self.kills.get(t).map(|r| {
                Decision::Killed(crate::decision::Killed {
                    target: t.to_owned(),
                    reason: r.clone(),
                })
            })
        })
    }

    /// Step 1: every attempt counts in every rate scope (and every repeat in its scope),
    /// admitted or not; the first scope over its limit refuses, for `reason`. The rate's
    /// quotas go into `quotas`.
    fn count(
        &mut self,
        checks: &[crate::pipeline::RateCheck],
        reason: Reason,
        now: Millis,
        seen: &mut Resolved,
        mut quotas: Option<&mut Vec<Quota>>,
    ) -> Result<Option<Deny>, StoreError> {
        let mut rate_deny: Option<Deny> = None;
        for (check, c) in checks.iter().enumerate() {
            let slot = self.slot(&c.scope, seen);
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
                    reason,
                    scope: c.scope.clone(),
                    limit: c.limit,
                    remaining: 0,
                    requested: 1,
                    retry_after_ms: Some(w.retry_after(now, c.window_ms, c.limit)),
                    reset_after_ms: Some(reset),
                });
            }
            if let Some(q) = quotas.as_deref_mut() {
                q.push(Quota {
                    reason,
                    check,
                    limit: c.limit,
                    remaining: w.remaining(now, c.window_ms, c.limit),
                    window_ms: Some(c.window_ms),
                    reset_after_ms: Some(reset),
                });
            }
        }
        Ok(rate_deny)
    }

    /// Step 5: concurrency; a scope whose leases are all held refuses.
    fn check_concurrency(
        &self,
        plan: &Plan,
        now: Millis,
        seen: &mut Resolved,
        quotas: &mut Vec<Quota>,
    ) -> Option<Decision> {
        for (check, c) in plan.concurrency.iter().enumerate() {
            let scope = self.find(&c.scope, seen).and_then(|i| self.slots.get(i));
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
                return Some(Decision::Deny(Deny {
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
        None
    }

    /// Steps 6 and 7: budgets, then tool calls, all checked before any is reserved; settled, reserved and this
    /// request's amount must stay within each limit.
    fn check_budgets(
        &mut self,
        plan: &Plan,
        now: Millis,
        seen: &mut Resolved,
        quotas: &mut Vec<Quota>,
        periods: &mut Periods,
    ) -> Option<Decision> {
        for (i, c) in plan.budget.iter().enumerate() {
            let (pid, start, end) = self.periods.at(c.period, now);
            if let Some(p) = periods.get_mut(i) {
                *p = (pid, end);
            }
            let cell = self
                .find(&c.scope, seen)
                .and_then(|i| self.slots.get(i))
                .and_then(|s| s.cell((c.period, pid)))
                .copied()
                .unwrap_or(Cell {
                    end,
                    ..Cell::default()
                });
            let committed = cell.settled.saturating_add(cell.reserved);
            if committed.saturating_add(c.amount) > c.limit {
                return Some(Decision::Deny(Deny {
                    reason: c.unit.reason(),
                    scope: c.scope.clone(),
                    limit: c.limit,
                    remaining: c.limit.saturating_sub(committed),
                    requested: c.amount,
                    retry_after_ms: (c.amount <= c.limit).then_some(end - now),
                    reset_after_ms: Some(end - now),
                }));
            }
            quotas.push(Quota {
                reason: c.unit.reason(),
                check: i,
                limit: c.limit,
                remaining: c.limit - committed - c.amount,
                window_ms: Some(end - start),
                reset_after_ms: Some(end - now),
            });
        }
        None
    }

    /// Everything passed: take the leases, make the reservations and keep the ticket. Returns
    /// when they expire.
    fn take_holds(
        &mut self,
        plan: &Plan,
        now: Millis,
        seen: &mut Resolved,
        periods: &Periods,
        id: super::Id,
        id_hash: u64,
    ) -> Result<Millis, StoreError> {
        let expires_at = now.saturating_add(plan.ttl_ms);
        let mut holds = self
            .tickets
            .spare_holds(plan.concurrency.len() + plan.budget.len());
        for c in &plan.concurrency {
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
        for (i, c) in plan.budget.iter().enumerate() {
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
        Ok(expires_at)
    }
}
