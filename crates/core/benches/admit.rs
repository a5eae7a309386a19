//! admit + settle on the memory store, next to governor's `check()` in the same run.
//!
//! `cargo bench -p tollgate-core --bench admit`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};

use divan::Bencher;
use governor::{Quota, RateLimiter};
use tollgate_core::{Decision, MemoryStore, Policy, RequestFacts, SystemClock, plan};

mod common;
use common::{ONE_SCOPE, USAGE};

fn main() {
    divan::main();
}

static NEXT: AtomicU64 = AtomicU64::new(0);

fn facts(user: u64) -> RequestFacts {
    common::facts(
        format!("req-{}", NEXT.fetch_add(1, Ordering::Relaxed)),
        user,
    )
}

fn admit_settle(store: &MemoryStore, policy: &Policy, f: &RequestFacts) {
    let p = plan(policy, f).unwrap();
    match store.admit_sync(&p).unwrap() {
        Decision::Admit(_) => {
            divan::black_box(store.settle_sync(&p.request_id, USAGE).unwrap());
        }
        other => panic!("benchmark policy refused: {other:?}"),
    }
}

/// Plan (the pure pipeline: scope keys, token verdicts) + admit + settle, from request facts
/// built beforehand; `threads` = 1 and 2 share one store.
#[divan::bench(args = ["1 scope", "5 scopes"], threads = [1, 2], sample_count = 200, sample_size = 50)]
fn tollgate_admit_settle(bencher: Bencher, scopes: &str) {
    let policy = common::policy(scopes);
    let store = MemoryStore::new().retention_ms(1_000);
    bencher
        .with_inputs(|| facts(NEXT.load(Ordering::Relaxed)))
        .bench_values(|f| {
            admit_settle(&store, &policy, &f);
            f // dropped after timing: the caller's input, not the work measured
        });
}

/// Only `plan()`: the pure pipeline (scope keys, token verdicts, kill-switch targets), with the
/// plan dropped after timing.
#[divan::bench(args = ["1 scope", "5 scopes"], sample_count = 200, sample_size = 50)]
fn tollgate_plan_only(bencher: Bencher, scopes: &str) {
    let policy = common::policy(scopes);
    bencher
        .with_inputs(|| facts(NEXT.load(Ordering::Relaxed)))
        .bench_local_values(|f| (plan(&policy, &f).unwrap(), f));
}

/// The timed loop of the store-only rows: admit + settle of a plan built beforehand and dropped
/// after timing; the store's answers are dropped inside it.
fn store_loop(bencher: Bencher, policy: &Policy, store: &MemoryStore) {
    bencher
        .with_inputs(|| plan(policy, &facts(NEXT.load(Ordering::Relaxed))).unwrap())
        .bench_local_values(|p| {
            let d = store.admit_sync(&p).unwrap();
            divan::black_box(&d);
            divan::black_box(store.settle_sync(&p.request_id, USAGE).unwrap());
            p
        });
}

/// Only the store's atomic transition (admit + settle), with the plan built beforehand and
/// dropped after timing; the store's answers are dropped inside it.
#[divan::bench(args = ["1 scope", "5 scopes"], sample_count = 200, sample_size = 50)]
fn tollgate_store_only(bencher: Bencher, scopes: &str) {
    let policy = common::policy(scopes);
    let store = MemoryStore::new().retention_ms(1_000);
    store_loop(bencher, &policy, &store);
}

/// The store-only loop with finished ids forgotten at the next call (retention 0): the store's
/// maps stay small enough for the CPU caches. The difference from `tollgate_store_only` is what
/// remembering a second of ids (a million entries at these rates) costs in cache misses.
#[divan::bench(args = ["1 scope", "5 scopes"], sample_count = 200, sample_size = 50)]
fn tollgate_store_only_forget_at_once(bencher: Bencher, scopes: &str) {
    let policy = common::policy(scopes);
    let store = MemoryStore::new().retention_ms(0);
    store_loop(bencher, &policy, &store);
}

/// The store-only loop in the steady state of a busy store: 1,000,000 finished ids remembered
/// (the default cap, `DEFAULT_MAX_REMEMBERED`), so every settlement also forgets the oldest one.
/// The store is filled before timing.
#[divan::bench(sample_count = 200, sample_size = 50)]
fn tollgate_store_only_at_the_cap(bencher: Bencher) {
    let policy = Policy::from_toml(ONE_SCOPE).unwrap();
    let store = MemoryStore::new();
    for _ in 0..tollgate_core::memory::DEFAULT_MAX_REMEMBERED {
        let p = plan(&policy, &facts(NEXT.load(Ordering::Relaxed))).unwrap();
        assert!(matches!(store.admit_sync(&p), Ok(Decision::Admit(_))));
        store.settle_sync(&p.request_id, USAGE).unwrap();
    }
    assert_eq!(
        store.footprint().unwrap().remembered,
        tollgate_core::memory::DEFAULT_MAX_REMEMBERED
    );
    store_loop(bencher, &policy, &store);
}

/// The store-only loop while 10,000 other requests are in flight (a gateway's state: requests
/// wait seconds for their upstream), each holding a lease and a reservation until the end.
#[divan::bench(sample_count = 200, sample_size = 50)]
fn tollgate_store_only_10k_in_flight(bencher: Bencher) {
    let policy = Policy::from_toml(ONE_SCOPE).unwrap();
    let store = MemoryStore::new().retention_ms(1_000);
    for _ in 0..10_000 {
        let p = plan(&policy, &facts(NEXT.load(Ordering::Relaxed))).unwrap();
        assert!(matches!(store.admit_sync(&p), Ok(Decision::Admit(_))));
    }
    assert_eq!(store.footprint().unwrap().in_flight, 10_000);
    store_loop(bencher, &policy, &store);
}

/// Baseline: governor's keyed GCRA `check_key` on 64 keys, and its direct `check`.
#[divan::bench(threads = [1, 2], sample_count = 200, sample_size = 50)]
fn governor_check_key(bencher: Bencher) {
    let q = Quota::per_second(NonZeroU32::new(u32::MAX).unwrap());
    let limiter = RateLimiter::keyed(q);
    let key = AtomicU64::new(0);
    bencher.bench(|| {
        let k = key.fetch_add(1, Ordering::Relaxed) % 64;
        divan::black_box(limiter.check_key(&k).is_ok());
    });
}

/// The store's clock (`SystemClock::now()`, the system's wall clock in ms), which an
/// admit + settle reads twice: once per call.
#[divan::bench(sample_count = 200, sample_size = 50)]
fn system_clock_now(bencher: Bencher) {
    use tollgate_core::Clock;
    bencher.bench(|| divan::black_box(SystemClock.now()));
}

#[divan::bench(threads = [1, 2], sample_count = 200, sample_size = 50)]
fn governor_check(bencher: Bencher) {
    let q = Quota::per_second(NonZeroU32::new(u32::MAX).unwrap());
    let limiter = RateLimiter::direct(q);
    bencher.bench(|| divan::black_box(limiter.check().is_ok()));
}
