//! A plan that reads rate windows instead of counting in them (`GET /v1/limits`).

use super::{Kind, Plan, RateCheck};
use crate::decision::Reason;

impl Plan {
    /// The reads of rate windows, with their places in the plan and their reasons.
    pub fn peeks(&self) -> impl Iterator<Item = (usize, Reason, &RateCheck)> + '_ {
        self.checks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match &c.kind {
                Kind::Peek(r) => Some((i, c.reason, r)),
                _ => None,
            })
    }

    /// The plan with its counts read instead ([`Kind::Peek`]): it counts nothing and refuses
    /// nowhere by rate, and reports what each window has left.
    #[must_use]
    pub fn peeking(mut self) -> Self {
        for c in &mut self.checks {
            if let Kind::Count(r) = &c.kind {
                c.kind = Kind::Peek(r.clone());
            }
        }
        self
    }
}
