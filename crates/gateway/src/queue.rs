//! The bounded queue in front of a full lease, and its turns. A request a lease refused waits
//! here for a slot; requests waiting for the same lease (a line: its control, scope and limit)
//! are tried in turn, one at a time, so that a freed slot goes to the request whose turn it
//! is, not to whichever asks first or most often. A new request for a lease others wait for
//! takes its turn behind them rather than the slot they wait for.
//!
//! Turns are shared between tenants by weight (start-time fair queueing): each request of a
//! tenant takes a turn `1 / weight` after that tenant's last one, and never before the turn
//! being served, so a tenant that sends many requests waits behind its own, and a class of
//! weight 3 is served three times for each request of weight 1 while both wait. Turns are kept
//! by each instance: instances sharing a store each order their own waiters.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use tollgate_core::{Deny, Plan, Policy, Reason, RequestFacts, ScopeKey};

use crate::config::QueueConfig;

/// The turn of a request of weight 1; a weight divides it.
const TURN: u64 = 1_000_000;

/// Whose turns a waiting request takes, and by what weight.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Flow<'a> {
    /// The key its places are counted against (`per_key`).
    pub key: &'a str,
    /// The tenant whose turns it takes.
    pub tenant: &'a str,
    /// Its class's weight.
    pub weight: u32,
}

impl<'a> Flow<'a> {
    /// The flow of a request: its key and tenant, and its priority class's weight.
    pub fn of(policy: &Policy, facts: &'a RequestFacts) -> Self {
        let id = &facts.identity;
        let tenant = id.tenant.as_deref();
        let key = id.key.as_deref().or(tenant).unwrap_or("");
        let class = policy.classes.of(facts.class.as_deref(), tenant);
        Flow {
            key,
            tenant: tenant.unwrap_or(key),
            weight: policy.classes.weight(class),
        }
    }
}

/// The requests waiting, by key and in all, and the lines they wait in.
#[derive(Debug, Default)]
pub struct Queue {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    per_key: HashMap<String, usize>,
    total: usize,
    lines: HashMap<String, Line>,
    /// Ties between equal turns go to the earlier.
    next: u64,
}

/// The requests waiting for one lease.
#[derive(Debug, Default)]
struct Line {
    /// The turn last served: a newcomer's first turn is after it.
    served: u64,
    /// Each tenant's last turn taken.
    last: HashMap<String, u64>,
    /// (turn, order of arrival) of every request in line.
    turns: BTreeSet<(u64, u64)>,
}

/// The line of a lease refused or asked for: its control, scope and limit (a class kept out of
/// a reserve waits in another line than one that may use it).
fn line(reason: Reason, scope: &ScopeKey, limit: u64) -> String {
    format!("{}|{}|{limit}", reason.code(), scope.key())
}

/// The line a lease refusal waits in.
pub(crate) fn line_of(d: &Deny) -> String {
    line(d.reason, &d.scope, d.limit)
}

impl Queue {
    /// A place for `flow`, unless its key's share or the whole queue is full.
    pub(crate) fn enter<'q>(&'q self, flow: &Flow<'_>, q: QueueConfig) -> Option<Place<'q>> {
        let mut st = self.state.lock().ok()?;
        let n = st.per_key.get(flow.key).copied().unwrap_or(0);
        if n >= q.per_key || st.total >= q.global {
            return None;
        }
        *st.per_key.entry(flow.key.to_owned()).or_default() += 1;
        st.total += 1;
        crate::telemetry::queue_waiting(1.0);
        Some(Place {
            q: self,
            key: flow.key.to_owned(),
            tenant: flow.tenant.to_owned(),
            weight: u64::from(flow.weight.max(1)),
            turn: None,
        })
    }

    /// Where a new request of plan `p` stands when others wait for one of its leases: in line
    /// behind them, so that it does not take the slot they wait for, or refused at that lease
    /// when no place is free. `None` when none waits: it is tried at once.
    pub(crate) fn behind<'q>(
        &'q self,
        p: &Plan,
        flow: &Flow<'_>,
        q: QueueConfig,
    ) -> Option<Behind<'q>> {
        let (at, waited) = {
            let st = self.state.lock().ok()?;
            if st.lines.is_empty() {
                return None;
            }
            p.leases().find_map(|(i, l)| {
                let name = line(p.checks.get(i)?.reason, &l.scope, l.limit);
                st.lines.contains_key(&name).then_some((i, name))
            })?
        };
        Some(match self.enter(flow, q) {
            Some(mut place) => {
                place.line_up(waited);
                Behind::InLine(place)
            }
            None => {
                let hint = Some(tollgate_core::controls::concurrency::RETRY_HINT_MS);
                match p.checks.get(at) {
                    Some(c) => Behind::Full(c.deny(0, hint, None)),
                    None => return None,
                }
            }
        })
    }
}

/// Where a new request stands behind others waiting for one of its leases.
#[derive(Debug)]
pub(crate) enum Behind<'q> {
    /// In line.
    InLine(Place<'q>),
    /// The queue is full: refused at that lease, as the store would refuse it with the slot
    /// taken (its attempt was counted before its body was read).
    Full(Deny),
}

/// A place in the queue, and the request's turn in a line once it has one. Leaving it (also by
/// being dropped) frees it.
#[derive(Debug)]
pub(crate) struct Place<'q> {
    q: &'q Queue,
    key: String,
    tenant: String,
    weight: u64,
    /// (line, turn, order of arrival).
    turn: Option<(String, u64, u64)>,
}

impl Place<'_> {
    /// Takes a turn in `name`, leaving the line it was in for another (a retry refused for
    /// another lease); in the same line it keeps its turn.
    pub fn line_up(&mut self, name: String) {
        if self.turn.as_ref().is_some_and(|(n, _, _)| *n == name) {
            return;
        }
        let Ok(mut st) = self.q.state.lock() else {
            return;
        };
        if let Some(old) = self.turn.take() {
            leave(&mut st, &old, false);
        }
        st.next += 1;
        let order = st.next;
        let line = st.lines.entry(name.clone()).or_default();
        let after = line.last.get(&self.tenant).copied().unwrap_or(0);
        let turn = after.max(line.served) + TURN / self.weight;
        line.last.insert(self.tenant.clone(), turn);
        line.turns.insert((turn, order));
        self.turn = Some((name, turn, order));
    }

    /// Whether it is this request's turn: no one in its line is before it.
    pub fn first(&self) -> bool {
        let Some((name, turn, order)) = &self.turn else {
            return true;
        };
        let Ok(st) = self.q.state.lock() else {
            return true;
        };
        st.lines
            .get(name)
            .and_then(|l| l.turns.first())
            .is_none_or(|first| *first == (*turn, *order))
    }

    /// Leaves the queue served: the line's next newcomers take turns after this one.
    pub fn served(mut self) {
        if let (Some(t), Ok(mut st)) = (self.turn.take(), self.q.state.lock()) {
            leave(&mut st, &t, true);
        }
    }
}

/// Takes turn `t` out of its line (advancing the line to it when it was served); a line no one
/// waits in is forgotten.
fn leave(st: &mut State, t: &(String, u64, u64), served: bool) {
    let (name, turn, order) = t;
    if let Some(line) = st.lines.get_mut(name) {
        line.turns.remove(&(*turn, *order));
        if served {
            line.served = line.served.max(*turn);
        }
        if line.turns.is_empty() {
            st.lines.remove(name);
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        crate::telemetry::queue_waiting(-1.0);
        let Ok(mut st) = self.q.state.lock() else {
            return;
        };
        if let Some(t) = self.turn.take() {
            leave(&mut st, &t, false);
        }
        st.total = st.total.saturating_sub(1);
        if let Some(n) = st.per_key.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                st.per_key.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const Q: QueueConfig = QueueConfig {
        max_wait: Duration::from_secs(1),
        per_key: 10,
        global: 20,
    };

    fn flow(tenant: &str, weight: u32) -> Flow<'_> {
        Flow {
            key: tenant,
            tenant,
            weight,
        }
    }

    /// Serves the first of `places` (in line "l") until none is left: the tenants in order.
    fn served_order(mut places: Vec<(String, Place<'_>)>) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(i) = places.iter().position(|(_, p)| p.first()) {
            let (t, p) = places.remove(i);
            p.served();
            out.push(t);
        }
        assert!(places.is_empty());
        out
    }

    #[test]
    fn turns_alternate_between_tenants_and_follow_weights() {
        let q = Queue::default();
        let mut places = Vec::new();
        for (tenant, weight, n) in [("a", 1, 4), ("b", 1, 2), ("c", 2, 4)] {
            for _ in 0..n {
                let mut p = q
                    .enter(&flow(tenant, weight), Q)
                    .unwrap_or_else(|| unreachable!());
                p.line_up("l".into());
                places.push((tenant.to_owned(), p));
            }
        }
        let order = served_order(places).concat();
        // Turns: c at 0.5, 1, 1.5, 2; a at 1, 2, 3, 4; b at 1, 2; ties to the earlier arrival.
        assert_eq!(order, "cabccabcaa");
    }

    #[test]
    fn places_are_bounded_and_given_back() {
        let q = Queue::default();
        let one = QueueConfig { per_key: 1, ..Q };
        let p = q.enter(&flow("a", 1), one);
        assert!(p.is_some());
        assert!(q.enter(&flow("a", 1), one).is_none());
        drop(p);
        assert!(q.enter(&flow("a", 1), one).is_some());
        let st = q.state.lock().unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!((st.total, st.per_key.len(), st.lines.len()), (0, 0, 0));
    }
}
