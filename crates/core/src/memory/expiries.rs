//! Expiries kept for a spend ledger: the memory store's twin of the Redis store's `P:expired`
//! stream. Bounded; off unless asked for.

use std::collections::VecDeque;

use super::{Hold, Slots};
use crate::clock::Millis;
use crate::ledger::Period;
use crate::store::{Expiry, ExpiryCharge, StoreError};

#[derive(Debug, Default)]
pub(super) struct Expiries {
    max: usize,
    next_tag: u64,
    kept: VecDeque<(u64, Expiry)>,
}

impl Expiries {
    pub(super) fn new(max: usize) -> Self {
        Self {
            max,
            ..Self::default()
        }
    }

    /// Keeps the expiry of ticket `t` of request `id`, which was charged `charged` per budget.
    pub(super) fn record(
        &mut self,
        id: &str,
        now: Millis,
        t: &super::Ticket,
        charged: &[u64],
        slots: &Slots,
    ) {
        if self.max == 0 {
            return;
        }
        let budgets = t.holds.iter().filter_map(|h| match h {
            Hold::Budget(r) if !r.shadow => Some(r),
            Hold::Budget(_) => None,
            Hold::Lease(_) => None,
        });
        let charges = budgets
            .zip(charged)
            .map(|(r, amount)| ExpiryCharge {
                scope: slots
                    .get(r.slot)
                    .and_then(|s| s.id.as_deref())
                    .unwrap_or_default()
                    .to_owned(),
                period: r.period,
                period_id: r.period_id,
                unit: r.unit,
                amount: *amount,
            })
            .collect();
        if self.kept.len() >= self.max {
            self.kept.pop_front();
        }
        self.next_tag += 1;
        self.kept.push_back((
            self.next_tag,
            Expiry {
                request_id: id.to_owned(),
                at: now,
                charges,
            },
        ));
    }

    pub(super) fn peek(&self, max: usize) -> Vec<(u64, Expiry)> {
        self.kept.iter().take(max).cloned().collect()
    }

    pub(super) fn ack(&mut self, tag: u64) {
        while self.kept.front().is_some_and(|(t, _)| *t <= tag) {
            self.kept.pop_front();
        }
    }
}

impl<C: crate::clock::Clock> super::MemoryStore<C> {
    /// Adds `amount` to what is settled in one period (`period`, `period_id`, ending at
    /// `end_ms`) of a budget scope: a spend ledger's totals restored into a store that started
    /// empty, the memory store's twin of the Redis store's `add_settled`.
    pub fn add_settled(
        &self,
        scope_id: &str,
        period: Period,
        period_id: u64,
        end_ms: Millis,
        amount: u64,
    ) -> Result<(), StoreError> {
        let (mut st, _) = self.lock()?;
        let id: std::sync::Arc<str> = std::sync::Arc::from(scope_id);
        let slot = st.slot_by_id(&id);
        let Some(scope) = st.slots.get_mut(slot) else {
            return Err(StoreError::Protocol(format!("no slot for {scope_id}")));
        };
        let key = (period, period_id);
        match scope.cells.iter_mut().find(|(k, _)| *k == key) {
            Some((_, cell)) => cell.settled = cell.settled.saturating_add(amount),
            None => scope.cells.push((
                key,
                super::Cell {
                    settled: amount,
                    end: end_ms,
                    ..super::Cell::default()
                },
            )),
        }
        Ok(())
    }
}

/// The memory store forgets nothing while the process lives and keeps no records for other
/// instances: it takes the keeper's defaults but for its own expiries and restored totals.
impl<C: crate::clock::Clock> crate::keeper::Keeper for super::MemoryStore<C> {
    async fn restore_settled(
        &self,
        scope_id: &str,
        (period, period_id, _): crate::keeper::PeriodRef<'_>,
        end_ms: u64,
        amount: u64,
    ) -> Result<(), StoreError> {
        self.add_settled(scope_id, period, period_id, end_ms, amount)
    }

    async fn expiries(
        &self,
        max: usize,
    ) -> Result<Vec<(crate::keeper::ExpiryTag, Expiry)>, StoreError> {
        Ok(super::MemoryStore::expiries(self, max)?
            .into_iter()
            .map(|(t, e)| (crate::keeper::ExpiryTag::Local(t), e))
            .collect())
    }

    async fn ack_expiries(&self, tags: Vec<crate::keeper::ExpiryTag>) -> Result<(), StoreError> {
        match crate::keeper::last_local(&tags) {
            Some(last) => super::MemoryStore::ack_expiries(self, last),
            None => Ok(()),
        }
    }
}
