use super::*;

/// A concurrency refusal's retry hint: the time to the earliest expiry of a lease held when
/// that is known and within the hint's cap (1 s), the cap otherwise. Counts of leases come
/// back exactly as requests end.
#[test]
fn concurrency_hints_come_from_the_earliest_known_expiry() {
    use crate::{Dimension, Identity, ManualClock, Policy, RequestFacts, plan};
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        concurrency = { limit = 2, lease_ttl = "800ms" }
        "#,
    )
    .unwrap();
    let clock = ManualClock::new(1_767_225_600_000);
    let store = MemoryStore::with_clock(clock.clone());
    let admit = |id: &str| {
        let facts = RequestFacts {
            request_id: id.into(),
            identity: Identity::default().with(Dimension::User, "u"),
            input_tokens: 10,
            max_output_tokens: Some(10),
            ..RequestFacts::default()
        };
        store.admit_sync(&plan(&policy, &facts).unwrap()).unwrap()
    };
    let hint = |d: Decision| match d {
        Decision::Deny(d) if d.reason == Reason::ConcurrencyLimit => d.retry_after_ms,
        other => panic!("not a concurrency refusal: {other:?}"),
    };
    let leases =
        |store: &MemoryStore<ManualClock>| store.usage_sync("user|user:u", None).unwrap().leases;
    assert!(matches!(admit("a"), Decision::Admit(_))); // expires at 800
    clock.advance(300);
    assert!(matches!(admit("b"), Decision::Admit(_))); // expires at 1,100
    assert_eq!(hint(admit("c")), Some(500), "a expires 500 ms from now");
    store.settle_sync("a", Usage::default()).unwrap();
    assert_eq!(leases(&store), 1);
    assert!(matches!(admit("d"), Decision::Admit(_))); // expires at 1,100
    clock.advance(600); // 900: past a's expiry, which bounded b's and d's
    assert_eq!(hint(admit("e")), Some(CONCURRENCY_RETRY_HINT_MS));
    clock.advance(200); // 1,100: b and d expire
    assert!(matches!(admit("f"), Decision::Admit(_)));
    assert_eq!(leases(&store), 1);
    assert_eq!(store.footprint().unwrap().in_flight, 1);
}

/// The cache answers what `Period::at` answers, across period ends, for more periods than
/// it holds at once.
#[test]
fn period_cache_answers_as_period_at() {
    let periods = [
        Period::CalendarMonth,
        Period::Fixed(86_400_000),
        Period::Fixed(3_600_000),
        Period::Fixed(7_000),
        Period::Fixed(1),
        Period::Fixed(604_800_000),
    ];
    let mut cache = PeriodCache::default();
    // From 2028-02-28 (a leap year) over the end of February, in uneven steps.
    let mut now = 1_835_308_800_000;
    for step in 0..5_000u64 {
        for p in periods {
            let (_, start, end) = p.at(now);
            for t in [now, end - 1, end, start] {
                assert_eq!(cache.at(p, t), p.at(t), "{p:?} at {t}");
            }
        }
        now += 17_000 + (step % 7) * 1_234_567;
    }
}

/// Expiries kept for a ledger: an expired request's charges per budget, with scope and
/// period; settled requests are not among them; acknowledged ones are forgotten; none are kept
/// unless asked for.
#[test]
fn expiries_are_kept_for_a_ledger_when_asked() {
    use crate::{Dimension, Identity, ManualClock, Policy, RequestFacts, plan};
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        concurrency = { limit = 5, lease_ttl = "1s" }
        budget = { tokens = 1000, period = "day" }
        "#,
    )
    .unwrap();
    let clock = ManualClock::new(1_767_225_600_000);
    let admit = |store: &MemoryStore<ManualClock>, id: &str| {
        let facts = RequestFacts {
            request_id: id.into(),
            identity: Identity::default().with(Dimension::User, "u"),
            input_tokens: 10,
            max_output_tokens: Some(20),
            ..RequestFacts::default()
        };
        store.admit_sync(&plan(&policy, &facts).unwrap()).unwrap();
    };
    let off = MemoryStore::with_clock(clock.clone());
    let store = MemoryStore::with_clock(clock.clone()).keep_expiries(10);
    for s in [&off, &store] {
        admit(s, "gone");
        admit(s, "done");
        s.settle_sync("done", Usage::default()).unwrap();
    }
    clock.advance(1500);
    off.sweep_all().unwrap();
    store.sweep_all().unwrap();
    assert!(off.expiries(10).unwrap().is_empty());
    let kept = store.expiries(10).unwrap();
    assert_eq!(kept.len(), 1);
    let (tag, e) = &kept[0];
    assert_eq!((e.request_id.as_str(), e.at), ("gone", 1_767_225_601_500));
    assert_eq!(
        e.charges,
        vec![crate::ExpiryCharge {
            scope: "user|user:u".into(),
            period: Period::Fixed(86_400_000),
            period_id: 1_767_225_600_000 / 86_400_000,
            unit: Unit::Tokens,
            amount: 30,
        }]
    );
    store.ack_expiries(*tag).unwrap();
    assert!(store.expiries(10).unwrap().is_empty());
}
