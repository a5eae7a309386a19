//! The conformance suite against the in-memory store.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

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

/// Finished ids beyond the cap are forgotten oldest first, before their retention ends: memory
/// stays bounded at any rate, and a late settlement of a forgotten id is still a no-op.
#[test]
fn remembered_ids_are_capped_oldest_first() {
    use tollgate_core::{Decision, Ending, Finish, Usage, plan};
    use tollgate_testkit::{T0, facts, policy};
    let clock = ManualClock::new(T0);
    let store = MemoryStore::with_clock(clock.clone()).max_remembered(3);
    let p = policy("[[scopes]]\nkey = \"user\"\nbudget = { tokens = 1000, period = \"day\" }\n");
    let u = Usage {
        input_tokens: 1,
        cached_input_tokens: 0,
        output_tokens: 1,
    };
    for i in 0..5 {
        let id = format!("r{i}");
        let d = store.admit_sync(&plan(&p, &facts(&id, "u", 1, 1)).unwrap());
        assert!(matches!(d, Ok(Decision::Admit(_))), "{d:?}");
        assert!(matches!(store.settle_sync(&id, u), Ok(Finish::Done { .. })));
        clock.advance(1);
    }
    store.sweep_all().unwrap();
    assert_eq!(store.footprint().unwrap().remembered, 3);
    assert_eq!(store.settle_sync("r0", u).unwrap(), Finish::Unknown);
    assert_eq!(store.settle_sync("r1", u).unwrap(), Finish::Unknown);
    assert_eq!(
        store.settle_sync("r4", u).unwrap(),
        Finish::AlreadyEnded(Ending::Settled)
    );
    // Forgetting an id releases nothing twice: the budget holds exactly five settlements.
    let used = store
        .usage_sync(
            "user|user:u",
            Some(tollgate_core::Period::Fixed(86_400_000)),
        )
        .unwrap();
    assert_eq!((used.settled, used.reserved), (10, 0));
}
