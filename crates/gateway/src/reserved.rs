//! The reservations an instance made and has not ended (the reservation API's), and the
//! answers of those it ended, kept for a settlement sent again.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;

use crate::ticket::Ticket;

/// Open reservations one instance keeps; past it a new one is refused (503) until some end.
pub const MAX_OPEN: usize = 100_000;
/// Ended reservations whose answer is kept, so that a settlement sent again gets the same one.
const KEPT_ENDINGS: usize = 10_000;

/// The reservations this instance made and has not ended, and the answers of those it ended.
#[derive(Debug, Default)]
pub struct Reservations {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    open: HashMap<String, Held>,
    ended: HashMap<String, Value>,
    order: VecDeque<String>,
}

/// What an open reservation needs at its end.
#[derive(Debug)]
pub(crate) struct Held {
    pub ticket: Ticket,
    /// Its API's index in [`crate::dialect::ALL`].
    pub dialect: usize,
    pub model: String,
    pub input: u64,
    pub granted: u64,
    /// The lease's end as last known here (ms, store clock); another instance may renew it.
    pub expires_at: u64,
}

impl Reservations {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn take(&self, id: &str) -> Option<Held> {
        self.lock().open.remove(id)
    }

    pub(crate) fn put_back(&self, id: String, held: Held) {
        self.lock().open.insert(id, held);
    }

    pub(crate) fn ended(&self, id: &str) -> Option<Value> {
        self.lock().ended.get(id).cloned()
    }

    pub(crate) fn remember(&self, id: &str, answer: &Value) {
        let mut inner = self.lock();
        if inner.ended.insert(id.to_owned(), answer.clone()).is_none() {
            inner.order.push_back(id.to_owned());
        }
        while inner.order.len() > KEPT_ENDINGS {
            if let Some(old) = inner.order.pop_front() {
                inner.ended.remove(&old);
            }
        }
    }

    /// Leaves every open reservation to the store (a shutdown): another instance may end it,
    /// else its lease expires and the policy charges it.
    pub fn let_go_all(&self) {
        let open: Vec<Held> = self.lock().open.drain().map(|(_, h)| h).collect();
        for h in open {
            h.ticket.let_go();
        }
    }

    /// Lets go of those whose lease ended here more than `grace_ms` ago, by the store's clock
    /// at `now_ms` (renewed elsewhere, the store still holds them; expired, it charged them).
    pub(crate) fn let_go_stale(&self, now_ms: u64, grace_ms: u64) {
        let stale: Vec<Held> = {
            let mut inner = self.lock();
            let ids: Vec<String> = inner
                .open
                .iter()
                .filter(|(_, h)| h.expires_at.saturating_add(grace_ms) < now_ms)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| inner.open.remove(id)).collect()
        };
        for h in stale {
            h.ticket.let_go();
        }
    }

    /// Notes the lease's new end of an open reservation.
    pub(crate) fn renewed(&self, id: &str, expires_at: u64) {
        if let Some(h) = self.lock().open.get_mut(id) {
            h.expires_at = h.expires_at.max(expires_at);
        }
    }

    /// How many are open here.
    pub fn open(&self) -> usize {
        self.lock().open.len()
    }
}
