//! The conformance suite against the in-memory store.

use tollgate_core::{ManualClock, MemoryStore};
use tollgate_testkit::Harness;

struct Memory;

impl Harness for Memory {
    type S = MemoryStore<ManualClock>;
    async fn store(&self, clock: ManualClock) -> Self::S {
        MemoryStore::with_clock(clock)
    }
}

tollgate_testkit::conformance_tests!(Memory);
