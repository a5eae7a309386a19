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
        ..Usage::default()
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
            "user|tenant:acme/user:u",
            Some(tollgate_core::Period::Fixed(86_400_000)),
        )
        .unwrap();
    assert_eq!((used.settled, used.reserved), (10, 0));
}

/// A scope the sweep drops gives up its slot, and a later scope takes it: neither the new
/// scope nor the dropped one, when it comes back, sees the other's leases or budget.
#[test]
fn slots_of_dropped_scopes_are_reused_without_mixing_scopes() {
    use tollgate_core::{Decision, Finish, Period, Usage, plan};
    use tollgate_testkit::{T0, facts, policy};
    let clock = ManualClock::new(T0);
    let store = MemoryStore::with_clock(clock.clone()).retention_ms(1_000);
    let p = policy(
        "[[scopes]]\nkey = \"user\"\nrequests = { limit = 100, window = \"1s\" }\n\
         concurrency = { limit = 1, lease_ttl = \"1m\" }\n\
         budget = { tokens = 1000, period = \"1s\" }\n",
    );
    let admit = |id: &str, user: &str| {
        let d = store.admit_sync(&plan(&p, &facts(id, user, 10, 10)).unwrap());
        assert!(matches!(d, Ok(Decision::Admit(_))), "{id} by {user}: {d:?}");
    };
    let u = Usage {
        input_tokens: 10,
        cached_input_tokens: 0,
        output_tokens: 5,
        ..Usage::default()
    };
    admit("a1", "a");
    assert!(matches!(
        store.settle_sync("a1", u),
        Ok(Finish::Done { .. })
    ));
    // Two rate windows and the budget period later, user a's scope holds nothing.
    clock.advance(5_000);
    store.sweep_all().unwrap();
    let fp = store.footprint().unwrap();
    assert_eq!(
        (fp.rate_scopes, fp.lease_scopes, fp.budget_cells),
        (0, 0, 0)
    );
    admit("b1", "b"); // takes the freed slot
    admit("a2", "a"); // a again: a scope of its own, not b's lease
    admit("c1", "c");
    let period = Some(Period::Fixed(1_000));
    for user in ["a", "b", "c"] {
        let used = store
            .usage_sync(&format!("user|tenant:acme/user:{user}"), period)
            .unwrap();
        assert_eq!(
            (used.leases, used.reserved, used.settled),
            (1, 20, 0),
            "{user}"
        );
    }
    assert!(matches!(
        store.settle_sync("b1", u),
        Ok(Finish::Done { .. })
    ));
    let b = store.usage_sync("user|tenant:acme/user:b", period).unwrap();
    let a = store.usage_sync("user|tenant:acme/user:a", period).unwrap();
    assert_eq!((b.leases, b.reserved, b.settled), (0, 0, 15));
    assert_eq!((a.leases, a.reserved, a.settled), (1, 20, 0));
    let fp = store.footprint().unwrap();
    assert_eq!((fp.rate_scopes, fp.lease_scopes, fp.in_flight), (3, 2, 2));
}

/// The pass that drops scope state nothing needs is spread over calls (at most 1,024 slots
/// each): no single call pays for a million scopes. It still drops every stale scope, and
/// nothing that is still needed.
#[test]
fn stale_scopes_are_dropped_a_little_per_call() {
    use tollgate_core::{Decision, Finish, Usage, plan};
    use tollgate_testkit::{T0, facts, policy};
    let clock = ManualClock::new(T0);
    let store = MemoryStore::with_clock(clock.clone()).retention_ms(1_000);
    let p = policy(
        "[[scopes]]\nkey = \"user\"\nrequests = { limit = 100, window = \"1s\" }\n\
         concurrency = { limit = 1, lease_ttl = \"1m\" }\n",
    );
    let u = Usage::default();
    let n = 3_000;
    for i in 0..n {
        let id = format!("r{i}");
        let d = store.admit_sync(&plan(&p, &facts(&id, &format!("u{i}"), 1, 1)).unwrap());
        assert!(matches!(d, Ok(Decision::Admit(_))), "{d:?}");
        assert!(matches!(store.settle_sync(&id, u), Ok(Finish::Done { .. })));
    }
    // One request stays in flight: its scope holds a lease and must survive every pass.
    let d = store.admit_sync(&plan(&p, &facts("held", "keeper", 1, 1)).unwrap());
    assert!(matches!(d, Ok(Decision::Admit(_))), "{d:?}");
    clock.advance(5_000);
    // The first call after the rate windows went stale starts a pass and takes one step.
    let first = store.footprint().unwrap().rate_scopes;
    assert!(
        first > n - 2 * 1_024,
        "one call dropped {} scopes",
        n + 1 - first
    );
    let mut calls = 1;
    while store.footprint().unwrap().lease_scopes + store.footprint().unwrap().rate_scopes > 1 {
        calls += 2;
        assert!(calls < 20, "the pass never finished");
    }
    let fp = store.footprint().unwrap();
    assert_eq!((fp.rate_scopes, fp.lease_scopes, fp.in_flight), (0, 1, 1));
    let keeper = store
        .usage_sync("user|tenant:acme/user:keeper", None)
        .unwrap();
    assert_eq!(keeper.leases, 1);
}

/// A shadow rule's reservation is charged when its request's ticket expires, and is no spend.
#[tokio::test]
async fn a_shadow_reservation_is_no_expiry_charge() {
    let clock = ManualClock::new(tollgate_testkit::T0);
    let store = MemoryStore::with_clock(clock.clone()).keep_expiries(10);
    tollgate_testkit::conformance::a_shadow_reservation_is_no_expiry_charge(
        &store,
        &clock,
        async || {
            store.sweep_all().unwrap();
            store
                .expiries(10)
                .unwrap()
                .into_iter()
                .map(|(_, e)| e)
                .collect()
        },
    )
    .await;
}
