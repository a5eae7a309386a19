//! Time as a value. The decision logic never reads a clock: a store asks its [`Clock`] once per
//! call and passes the instant down, so tests drive time with a [`ManualClock`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (UTC). Every limit is computed on this integer.
pub type Millis = u64;

/// A source of the current time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current time in milliseconds since the Unix epoch.
    fn now(&self) -> Millis;
}

/// The operating system's wall clock, read between anchorings through the CPU's time-stamp
/// counter ([`quanta`]): a store reads it on every call, and a counter read costs about a third
/// of a system clock read (the admit bench's `system_clock_now` and `wall_clock_now` rows compare
/// them). The system's clock is read again once a second, so a step or slew of the wall clock is followed within a second. Where the counter is
/// not usable, quanta reads the system's monotonic clock instead.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

/// Milliseconds since the Unix epoch by the system's wall clock; a clock before 1970 is treated
/// as the epoch rather than failing admission.
fn wall_clock_ms() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// How often [`SystemClock`] reads the system's wall clock again.
const ANCHOR_EVERY_MS: u64 = 1_000;

/// The counter's time at the start, and the wall clock's lead over it in ms at the last anchoring.
#[derive(Debug)]
struct Anchor {
    /// Read directly, not through `quanta::Instant::now()`, which first looks for a test's mock
    /// clock in thread-local storage (about 30 instructions a read).
    clock: quanta::Clock,
    /// The counter's raw value at the start.
    base: u64,
    /// Wall-clock ms minus counter ms since `base`, at the last anchoring.
    offset: AtomicU64,
    /// Counter ms since `base` at which to anchor again.
    next: AtomicU64,
}

static ANCHOR: OnceLock<Anchor> = OnceLock::new();

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        let a = ANCHOR.get_or_init(|| {
            let clock = quanta::Clock::new();
            Anchor {
                base: clock.raw(),
                clock,
                offset: AtomicU64::new(0),
                next: AtomicU64::new(0),
            }
        });
        let since = a.clock.delta_as_nanos(a.base, a.clock.raw()) / 1_000_000;
        if since >= a.next.load(Ordering::Relaxed) {
            // Threads racing here each store a valid anchoring; any of them may win.
            let wall = wall_clock_ms();
            a.offset
                .store(wall.saturating_sub(since), Ordering::Relaxed);
            a.next
                .store(since.saturating_add(ANCHOR_EVERY_MS), Ordering::Relaxed);
            return wall;
        }
        since.saturating_add(a.offset.load(Ordering::Relaxed))
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

    #[test]
    fn system_clock_follows_the_wall_clock() {
        let before = wall_clock_ms();
        let mut last = 0;
        // Past at least one re-anchoring.
        let end = std::time::Instant::now() + std::time::Duration::from_millis(1_300);
        while std::time::Instant::now() < end {
            let (w0, t, w1) = (wall_clock_ms(), SystemClock.now(), wall_clock_ms());
            // Between the system clock's reads around it, give or take a rounding and the
            // counter's drift since the last anchoring.
            assert!(
                t + 2 >= w0 && t <= w1 + 2,
                "counter clock {t}, wall {w0}..{w1}"
            );
            last = t;
            std::thread::sleep(std::time::Duration::from_millis(7));
        }
        assert!(
            last >= before + 1_200,
            "the clock moved {} ms in 1.3 s",
            last - before
        );
    }
}
