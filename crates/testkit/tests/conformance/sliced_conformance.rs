//! The conformance suite against slices ([`Sliced`]) over the in-memory store: one instance
//! that slices every plan from its first request must decide as the store alone does.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use tollgate_core::{ManualClock, MemoryStore};
use tollgate_slices::{SliceConfig, Sliced};
use tollgate_testkit::Harness;

struct SlicedMemory;

/// Slices from the first request, and lives longer than the suite's clock jumps: a slice that
/// expired while its instance lived would be charged in full, as a dead instance's is (tested on
/// its own in `tollgate-core`).
pub fn eager() -> SliceConfig {
    SliceConfig {
        hot_after: 0,
        ttl_ms: Some(400 * 86_400_000),
        ..SliceConfig::default()
    }
}

impl Harness for SlicedMemory {
    type S = Sliced<MemoryStore<ManualClock>, ManualClock>;
    async fn store(&self, clock: ManualClock) -> Self::S {
        Sliced::with_clock(MemoryStore::with_clock(clock.clone()), clock, eager())
    }
}

tollgate_testkit::conformance_tests!(SlicedMemory);

mod orders {
    use tollgate_core::{ManualClock, MemoryStore};
    use tollgate_testkit::conformance::SliceHarness;

    struct Memory;

    impl SliceHarness for Memory {
        type S = MemoryStore<ManualClock>;
        async fn store(&self, clock: ManualClock) -> Self::S {
            MemoryStore::with_clock(clock)
        }
    }

    tollgate_testkit::slice_conformance_tests!(Memory);
}
