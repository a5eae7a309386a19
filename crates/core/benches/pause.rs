//! The slowest admissions of a memory store at its cap of remembered ids: the tail a busy
//! gateway's requests see, since every call holds the store's one lock.
//!
//! `cargo bench -p tollgate-core --bench pause`
//!
//! The store (default retention and cap) is filled with 1,000,000 admitted and settled requests
//! at 10,000 requests per second of its manual clock, so its periodic clean-up runs every 10,000
//! requests. Then 200,000 more are timed one by one (admission only; settlement untimed).
//! Reported: median, 99.9th percentile and worst admission, for requests spread over 64 users
//! and for every request by a new user (each user's daily budget keeps its scope for the day:
//! 1,200,000 scopes at the end). Also the worst admission and the worst settlement while the
//! store was filling: the store's maps grow then, and a map that grows in one step moves every
//! entry under the lock.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

use std::time::{Duration, Instant};

use tollgate_core::{
    Decision, Dimension, Identity, ManualClock, MemoryStore, Policy, RequestFacts, Usage, plan,
};

const FILL: u64 = 1_000_000;
const TIMED: u64 = 200_000;

fn main() {
    run("64 users", 64);
    run("a new user each", u64::MAX);
}

fn run(label: &str, users: u64) {
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 1000000000, window = "1s" }
        concurrency = { limit = 1000000, lease_ttl = "1m" }
        budget = { tokens = 1000000000000, period = "day" }
        "#,
    )
    .unwrap();
    let clock = ManualClock::new(1_767_225_600_000);
    let store = MemoryStore::with_clock(clock.clone());
    let u = Usage {
        input_tokens: 100,
        cached_input_tokens: 0,
        output_tokens: 50,
        ..Usage::default()
    };
    let mut times = Vec::with_capacity(TIMED as usize);
    let (mut fill_admit, mut fill_settle) = (Duration::ZERO, Duration::ZERO);
    for i in 0..FILL + TIMED {
        let f = RequestFacts {
            // The gateway's id shape: a per-process nonce and a sequence number.
            request_id: format!("tg-0123456789ab-{i:x}"),
            identity: Identity::default()
                .with(Dimension::User, format!("u{}", i % users))
                .with(Dimension::Tenant, "acme"),
            input_tokens: 100,
            max_output_tokens: Some(100),
            ..RequestFacts::default()
        };
        let p = plan(&policy, &f).unwrap();
        let start = Instant::now();
        let d = store.admit_sync(&p).unwrap();
        let took = start.elapsed();
        assert!(matches!(d, Decision::Admit(_)), "{d:?}");
        if i >= FILL {
            times.push(took);
        } else {
            fill_admit = fill_admit.max(took);
        }
        let start = Instant::now();
        store.settle_sync(&p.request_id, u).unwrap();
        if i < FILL {
            fill_settle = fill_settle.max(start.elapsed());
        }
        if i % 10 == 0 {
            clock.advance(1);
        }
    }
    times.sort();
    let at = |q: f64| times[((times.len() as f64 - 1.0) * q) as usize];
    let worst = times.last().copied().unwrap_or(Duration::ZERO);
    println!(
        "{label}: {TIMED} admissions after {FILL} remembered ids: median {:?}, p99.9 {:?}, worst {worst:?}",
        at(0.5),
        at(0.999)
    );
    println!(
        "{label}: while filling, worst admission {fill_admit:?}, worst settlement {fill_settle:?}"
    );
}
