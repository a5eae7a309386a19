//! Which plan shapes are admitted often enough to be sliced.

use tollgate_core::clock::Millis;

/// Plan shapes (their scopes) seen lately, to slice only what is admitted often: a fixed table,
/// so that a flood of distinct users costs no memory.
#[derive(Debug)]
pub(super) struct Hot {
    slots: Vec<(u64, Millis, u32)>,
}

impl Hot {
    const N: usize = 1024;

    pub(super) fn new() -> Self {
        Self {
            slots: vec![(0, 0, 0); Self::N],
        }
    }

    /// Counts a sighting of `sig` at `now`; whether it was seen more than `after` times in
    /// the last second.
    pub(super) fn hit(&mut self, sig: u64, now: Millis, after: u32) -> bool {
        let i = (sig % Self::N as u64) as usize;
        let Some(e) = self.slots.get_mut(i) else {
            return false;
        };
        if e.0 != sig || now >= e.1.saturating_add(1_000) {
            *e = (sig, now, 0);
        }
        e.2 = e.2.saturating_add(1);
        e.2 > after
    }
}
