//! Time as a value. The decision logic never reads a clock: a store asks its [`Clock`] once per
//! call and passes the instant down, so tests drive time with a [`ManualClock`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (UTC). Every limit is computed on this integer.
pub type Millis = u64;

/// A source of the current time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current time in milliseconds since the Unix epoch.
    fn now(&self) -> Millis;
}

/// The operating system's wall clock (`SystemTime`, a vDSO read on Linux): a step or slew of
/// the wall clock is followed at once.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    /// Milliseconds since the Unix epoch; a clock before 1970 is treated as the epoch rather
    /// than failing admission.
    fn now(&self) -> Millis {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// A clock chosen at run time: the gateway's memory store holds one, so that a test can run it
/// on paused time.
pub type SharedClock = Arc<dyn Clock>;

/// A shared clock is a clock: a store can be given one chosen at run time (`Arc<dyn Clock>`).
impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Millis {
        (**self).now()
    }
}

/// A clock that only moves when told to. Clones share the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Millis) -> Self {
        Self(Arc::new(AtomicU64::new(start)))
    }
    /// Moves the clock forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
    /// Sets the clock to `t`, which may be earlier than now (to test clocks going backwards).
    pub fn set(&self, t: Millis) {
        self.0.store(t, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Millis {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wall_ms() -> Millis {
        let d = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
    }

    /// The system clock is the wall clock in ms: between two reads of it around, never a
    /// counter's drift.
    #[test]
    fn system_clock_is_the_wall_clock() {
        for _ in 0..1_000 {
            let (w0, t, w1) = (wall_ms(), SystemClock.now(), wall_ms());
            assert!(w0 <= t && t <= w1, "clock {t}, wall {w0}..{w1}");
        }
        let m = ManualClock::new(5);
        m.advance(10);
        assert_eq!(m.now(), 15);
    }
}
