//! Work per operation counted in instructions, for machines whose timings are too noisy to
//! compare two builds: `bench/instructions.sh` runs this under Valgrind's callgrind, counting
//! only inside `measured`, and divides by the number of operations.
//!
//! `instructions OP N`: OP is `governor` (a direct limiter's `check()`), `governor_keyed` (a
//! keyed limiter's `check_key()` over 64 keys, as in the admit bench), `plan1` / `plan5`
//! (`plan()` for one scope / five, its plan dropped), `store1` / `store5` (admit + settle on the
//! memory store of a plan built beforehand); `plans1` / `plans_shadow` (`plans()` for one scope,
//! without and with a shadow rule) and `store_shadow` (admit with the shadow plan + settle): what a
//! shadow rule adds; N operations.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

use std::num::NonZeroU32;

use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};
use tollgate_core::{Decision, MemoryStore, Plan, Policy, RequestFacts, plan, plans};

mod common;
use common::USAGE;

/// Request facts like the admit bench's, with ids shaped like the gateway's.
fn facts(n: u64) -> RequestFacts {
    common::facts(format!("tg-0123456789ab-{n:x}"), n)
}

enum Work<'a> {
    Governor(&'a DefaultDirectRateLimiter, u64),
    GovernorKeyed(&'a DefaultKeyedRateLimiter<u64>, u64),
    Plan(&'a Policy, &'a [RequestFacts]),
    Plans(&'a Policy, &'a [RequestFacts]),
    Store(&'a MemoryStore, &'a [Plan]),
    Shadowed(&'a MemoryStore, &'a [(Plan, Plan)]),
}

/// The only function whose instructions are counted.
#[inline(never)]
fn measured(work: &Work<'_>) {
    match work {
        Work::Governor(limiter, n) => {
            for _ in 0..*n {
                std::hint::black_box(limiter.check().is_ok());
            }
        }
        Work::GovernorKeyed(limiter, n) => {
            for i in 0..*n {
                std::hint::black_box(limiter.check_key(&(i % 64)).is_ok());
            }
        }
        Work::Plan(policy, facts) => {
            for f in *facts {
                drop(std::hint::black_box(plan(policy, f).unwrap()));
            }
        }
        Work::Plans(policy, facts) => {
            for f in *facts {
                drop(std::hint::black_box(plans(policy, f).unwrap()));
            }
        }
        Work::Shadowed(store, plans) => {
            for (p, shadow) in *plans {
                let (Decision::Admit(_), _) = store.admit_shadowed_sync(p, shadow).unwrap() else {
                    panic!("benchmark policy refused");
                };
                std::hint::black_box(store.settle_sync(&p.request_id, USAGE).unwrap());
            }
        }
        Work::Store(store, plans) => {
            for p in *plans {
                let Decision::Admit(_) = store.admit_sync(p).unwrap() else {
                    panic!("benchmark policy refused");
                };
                std::hint::black_box(store.settle_sync(&p.request_id, USAGE).unwrap());
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` runs every bench target with `--bench`: nothing to do without an OP.
    let (Some(op), Some(n)) = (args.get(1), args.get(2).and_then(|n| n.parse::<u64>().ok())) else {
        println!(
            "usage: instructions governor|governor_keyed|plan1|plan5|store1|store5|plans1|plans_shadow|store_shadow N (see bench/instructions.sh)"
        );
        return;
    };
    match op.as_str() {
        "governor" => {
            let limiter =
                RateLimiter::direct(Quota::per_second(NonZeroU32::new(u32::MAX).unwrap()));
            // The first check calibrates the clock (quanta): not part of a check's work.
            assert!(limiter.check().is_ok());
            measured(&Work::Governor(&limiter, n));
        }
        "governor_keyed" => {
            let limiter = RateLimiter::keyed(Quota::per_second(NonZeroU32::new(u32::MAX).unwrap()));
            // Every key's first check inserts it and calibrates the clock: not a check's work.
            for k in 0..64 {
                assert!(limiter.check_key(&k).is_ok());
            }
            measured(&Work::GovernorKeyed(&limiter, n));
        }
        "plan1" | "plan5" => {
            let policy = common::policy(op);
            let facts: Vec<_> = (0..n).map(facts).collect();
            measured(&Work::Plan(&policy, &facts));
        }
        "store1" | "store5" => {
            let policy = common::policy(op);
            let store = MemoryStore::new().retention_ms(1_000);
            let plans: Vec<_> = (0..n).map(|i| plan(&policy, &facts(i)).unwrap()).collect();
            // The first call makes the scope (and `MemoryStore::new` has calibrated the clock,
            // as governor's first check does its own): not part of an admission's work.
            let warm = plan(&policy, &facts(n)).unwrap();
            assert!(matches!(store.admit_sync(&warm), Ok(Decision::Admit(_))));
            store.settle_sync(&warm.request_id, USAGE).unwrap();
            measured(&Work::Store(&store, &plans));
        }
        "plans1" | "plans_shadow" => {
            let policy = common::policy(op);
            let facts: Vec<_> = (0..n).map(facts).collect();
            measured(&Work::Plans(&policy, &facts));
        }
        "store_shadow" => {
            let policy = common::policy(op);
            let store = MemoryStore::new().retention_ms(1_000);
            let both = |i| {
                let (p, shadow) = plans(&policy, &facts(i)).unwrap();
                (p, shadow.unwrap().unwrap())
            };
            let all: Vec<_> = (0..n).map(both).collect();
            // Both plans' scopes made before counting, as for `store1`.
            let (p, shadow) = both(n);
            let (decision, _) = store.admit_shadowed_sync(&p, &shadow).unwrap();
            assert!(matches!(decision, Decision::Admit(_)));
            store.settle_sync(&p.request_id, USAGE).unwrap();
            measured(&Work::Shadowed(&store, &all));
        }
        other => panic!("unknown operation {other}"),
    }
}
