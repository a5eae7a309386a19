//! A store clock that follows tokio's timer clock, so that a test on paused time
//! (`#[tokio::test(start_paused = true)]`) moves the store's time with `tokio::time::advance`
//! (and with the sleeps that paused time skips) instead of waiting for it.

use tollgate_core::{Clock, Millis};

/// Milliseconds since the Unix epoch: the wall clock when made, plus tokio's time since then.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    wall: Millis,
    start: tokio::time::Instant,
}

impl TokioClock {
    /// A clock standing at `wall` now.
    pub fn at(wall: Millis) -> Self {
        Self {
            wall,
            start: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Millis {
        let elapsed = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.wall.saturating_add(elapsed)
    }
}
