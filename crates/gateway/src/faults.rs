//! Run-time faults in the log: each logged once when it begins, with its cause, and once when
//! it ends, not once per request it touches.

use std::fmt::Display;
use std::sync::atomic::{AtomicBool, Ordering};

/// One kind of fault, on or off.
#[derive(Debug)]
pub struct Latch {
    failing: AtomicBool,
    name: &'static str,
}

impl Latch {
    /// A fault named `name` in the log's `fault` field.
    pub const fn new(name: &'static str) -> Self {
        Self {
            failing: AtomicBool::new(false),
            name,
        }
    }

    /// The fault is on: logged with its `cause` and what it means (`effect`) unless it was
    /// already on. True when it begins here.
    pub fn fail(&self, cause: &dyn Display, effect: &str) -> bool {
        let begins = !self.failing.swap(true, Ordering::AcqRel);
        if begins {
            tracing::error!(fault = self.name, cause = %cause, "{effect}");
        }
        begins
    }

    /// The fault is off: its end logged if it was on. A load alone while it is off.
    pub fn ok(&self) {
        if self.failing.load(Ordering::Relaxed) && self.failing.swap(false, Ordering::AcqRel) {
            tracing::info!(fault = self.name, "{} recovered", self.name);
        }
    }
}

/// The store did not answer an admission.
pub static STORE: Latch = Latch::new("store");
/// The store lost its state.
pub static STORE_LOST: Latch = Latch::new("store_state_lost");
/// The store holds no marker: new, or forgotten while no instance watched.
pub static STORE_UNINITIALISED: Latch = Latch::new("store_uninitialised");
/// Leased slices cannot be maintained (reported, renewed, grown, given back).
pub static SLICES: Latch = Latch::new("slices");
/// Alerts dropped: the webhook queue is full.
pub static ALERTS_DROPPED: Latch = Latch::new("alerts_dropped");
/// Decision records dropped: their writer is behind.
pub static RECORDS_DROPPED: Latch = Latch::new("records_dropped");
