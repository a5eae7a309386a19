//! Orders waiting to be sent to the store, each with the mark that says how to read its answer.

use super::{BudgetKey, LeaseKey, RateKey};
use tollgate_core::exchange::Order;

/// How to read the answer to one order.
#[derive(Debug, Clone)]
pub(crate) enum Mark {
    Rate(RateKey),
    Lease(LeaseKey),
    /// With the settled total the order reported.
    Budget(BudgetKey, u64),
}

/// Orders to send, each with its mark.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    pub orders: Vec<Order>,
    pub marks: Vec<Mark>,
    pub kills: bool,
}

impl Pending {
    pub fn is_empty(&self) -> bool {
        self.orders.is_empty() && !self.kills
    }

    pub(super) fn push(&mut self, o: Order, m: Mark) {
        self.orders.push(o);
        self.marks.push(m);
    }

    pub(super) fn has_lease(&self, key: &LeaseKey) -> bool {
        self.marks
            .iter()
            .any(|m| matches!(m, Mark::Lease(k) if k == key))
    }

    pub(super) fn has_budget(&self, key: &BudgetKey) -> bool {
        self.marks
            .iter()
            .any(|m| matches!(m, Mark::Budget(k, _) if k == key))
    }
}
