//! What an instance has seen of each shard's marker and write sequence, and the schema the
//! marker names.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tollgate_core::Loss;

pub use crate::contract::SCHEMA;

/// What this store has seen of one shard: its marker (once seen, its absence means the store
/// forgot), and the highest write sequence of the store's epoch (`seq.lua`: a store behind
/// it went back in time).
#[derive(Debug, Default)]
pub struct Mark {
    seen: AtomicBool,
    /// The store's epoch and the highest `n` seen in it.
    high: Mutex<Option<(String, u64)>>,
    /// Why the store was found lost at its last answer (none when it was not).
    pub(crate) cause: Mutex<Option<Loss>>,
}

impl Mark {
    pub(crate) fn seen(&self) -> bool {
        self.seen.load(Ordering::Relaxed)
    }

    pub(crate) fn set_seen(&self) {
        self.seen.store(true, Ordering::Relaxed);
    }

    /// The scripts' `seen` argument: `flag`, and the sequence seen once there is one.
    pub(crate) fn arg(&self, flag: &str) -> String {
        match self.high().filter(|(e, _)| !e.is_empty()) {
            Some((epoch, n)) => format!("{flag}:{epoch}:{n}"),
            None => flag.to_owned(),
        }
    }

    /// A reply's sequence: the highest of an epoch is kept; another epoch (a store initialised
    /// or its loss acknowledged since) starts again from its own.
    pub(crate) fn saw(&self, epoch: &str, n: u64) {
        if epoch.is_empty() {
            return;
        }
        if let Ok(mut h) = self.high.lock() {
            match &mut *h {
                Some((e, high)) if e == epoch => *high = (*high).max(n),
                other => *other = Some((epoch.to_owned(), n)),
            }
        }
    }

    /// What the store's loss flag said at its last answer ('' when it was not lost).
    pub(crate) fn found(&self, why: &str) {
        if let Ok(mut c) = self.cause.lock() {
            *c = (!why.is_empty()).then(|| read_loss(why));
        }
    }

    /// The epoch and the highest sequence seen in it.
    pub(crate) fn high(&self) -> Option<(String, u64)> {
        self.high.lock().ok().and_then(|h| h.clone())
    }
}

/// The loss a flag's cause names.
fn read_loss(why: &str) -> Loss {
    let mut w = why.split(' ');
    match (w.next(), w.next(), w.next(), w.next()) {
        (Some("behind"), Some(epoch), Some(store), Some(seen)) => Loss::Behind {
            epoch: epoch.to_owned(),
            store: store.parse().unwrap_or(0),
            seen: seen.parse().unwrap_or(0),
        },
        (Some("history"), Some(id), Some(ended), Some(seen)) => Loss::CutShort {
            history: id.to_owned(),
            ended: ended.parse().unwrap_or(0),
            seen: seen.parse().unwrap_or(0),
        },
        _ => Loss::Forgot,
    }
}
