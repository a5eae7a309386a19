//! The usage of one scope, read outside admissions (the admin API, `/v1/limits`).

use super::{Cell, MemoryStore};
use crate::clock::Clock;
use crate::ledger::Period;
use crate::store::{ScopeUsage, StoreError};

impl<C: Clock> MemoryStore<C> {
    /// [`Store::usage`], synchronously.
    pub fn usage_sync(
        &self,
        scope_id: &str,
        period: Option<Period>,
    ) -> Result<ScopeUsage, StoreError> {
        self.usage_sync_carrying(scope_id, period, None)
    }

    /// [`Store::usage_carrying`], synchronously (`carry`: the cap and the limit).
    pub fn usage_sync_carrying(
        &self,
        scope_id: &str,
        period: Option<Period>,
        carry: Option<(u64, u64)>,
    ) -> Result<ScopeUsage, StoreError> {
        let (st, now) = self.lock()?;
        let scope = st.scopes.get(scope_id).and_then(|&i| st.slots.get(i));
        let leases = scope.map_or(0, |s| s.leases);
        let cell = period
            .and_then(|p| {
                let pid = p.at(now).0;
                let held = scope.and_then(|s| s.cell((p, pid)).copied());
                held.or_else(|| {
                    // A period no admission has started: what its first will carry over.
                    let (cap, limit) = carry?;
                    let before = p.previous(pid).and_then(|b| scope?.cell((p, b)).copied())?;
                    let committed = before.settled.saturating_add(before.reserved);
                    let carry = crate::controls::budget::carried(
                        cap,
                        limit,
                        Some((before.carry, committed)),
                    );
                    Some(Cell {
                        carry,
                        ..Default::default()
                    })
                })
            })
            .unwrap_or_default();
        Ok(ScopeUsage {
            settled: cell.settled,
            reserved: cell.reserved,
            carried: cell.carry,
            leases,
            at_ms: now,
        })
    }
}
