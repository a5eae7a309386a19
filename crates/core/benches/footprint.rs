//! Bytes per tracked scope in the memory store, measured from the process's resident set size.
//!
//! `cargo bench -p tollgate-core --bench footprint`
//!
//! Each of N distinct users makes one admitted request that is then settled: the user's scope
//! holds a rate window and a budget cell (one per rule with a budget), and the finished request
//! id is remembered for idempotency until the retention time. Reported: RSS growth divided by N,
//! for the scope state alone and with the remembered ids: ids like the gateway's own (up to 23
//! bytes, kept inline) and 36-byte ids (a client's UUID, kept in a shared allocation); and the
//! scope state of users whose ids are 256 bytes long, the longest the gateway accepts.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

use tollgate_core::{
    Decision, Dimension, Identity, ManualClock, MemoryStore, Policy, RequestFacts, Usage, plan,
};

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn main() {
    // Each configuration runs in a fresh process: freed memory is not returned to the OS, so a
    // second run in the same process would measure reuse, not growth.
    let configs = [
        ("scope state, finished ids forgotten", 0u64, false, 17),
        (
            "scope state + finished ids remembered 1h (gateway ids, 19-21 bytes)",
            3_600_000,
            false,
            17,
        ),
        (
            "scope state + finished ids remembered 1h (36-byte ids)",
            3_600_000,
            true,
            17,
        ),
        (
            "scope state, finished ids forgotten, 256-byte user ids (the longest accepted)",
            0u64,
            false,
            256,
        ),
    ];
    if let Some(i) = std::env::var("FOOTPRINT_CONFIG")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        match configs.get(i) {
            Some(&(label, retention, long_ids, user_len)) => {
                measure(label, retention, long_ids, user_len);
            }
            None => measure_keys(1024),
        }
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for i in 0..=configs.len() {
        let out = std::process::Command::new(&exe)
            .env("FOOTPRINT_CONFIG", i.to_string())
            .output()
            .unwrap();
        print!("{}", String::from_utf8_lossy(&out.stdout));
    }
}

fn measure(label: &str, retention: u64, long_ids: bool, user_len: usize) {
    const N: u64 = 200_000;
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 100, window = "1m" }
        concurrency = { limit = 4 }
        budget = { tokens = 100000, period = "day" }
        "#,
    )
    .unwrap();
    {
        let clock = ManualClock::new(1_767_225_600_000);
        let store = MemoryStore::with_clock(clock.clone()).retention_ms(retention);
        let before = rss_bytes();
        for i in 0..N {
            let f = RequestFacts {
                request_id: if long_ids {
                    format!("{i:08x}-0000-4000-8000-{i:012x}")
                } else {
                    format!("tg-0123456789ab-{i:x}")
                },
                // A user scope is inside its tenant, as the gateway's always are.
                identity: Identity::default().with(Dimension::Tenant, "acme").with(
                    Dimension::User,
                    format!("user-{i:012}{}", "u".repeat(user_len - 17)),
                ),
                input_tokens: 10,
                max_output_tokens: Some(10),
                ..RequestFacts::default()
            };
            let Decision::Admit(_) = store.admit_sync(&plan(&policy, &f).unwrap()).unwrap() else {
                panic!("denied");
            };
            let u = Usage {
                input_tokens: 10,
                cached_input_tokens: 0,
                output_tokens: 5,
                ..Usage::default()
            };
            store.settle_sync(&f.request_id, u).unwrap();
            if retention == 0 && i % 1024 == 0 {
                clock.advance(1);
            }
        }
        clock.advance(1);
        store.sweep_all().unwrap();
        let fp = store.footprint().unwrap();
        let grown = rss_bytes().saturating_sub(before);
        println!(
            "{label}: {N} scopes ({} rate windows, {} budget cells, {} remembered ids): {:.0} bytes per scope",
            fp.rate_scopes,
            fp.budget_cells,
            fp.remembered,
            grown as f64 / N as f64
        );
        // Everything stale is dropped: two windows later and after the period, nothing is left.
        clock.advance(86_400_000 + 3_600_000);
        store.sweep_all().unwrap();
        let fp = store.footprint().unwrap();
        println!("  after the window, period and retention have passed: {fp:?}");
        drop(store);
    }
}

/// Idempotency keys: as many as the store holds (100,000), each claimed and answered with a
/// response of `response_bytes`, as the gateway keeps them (a 40-byte scoped key, a 64-byte
/// digest, its request id).
fn measure_keys(response_bytes: usize) {
    const N: usize = tollgate_core::memory::MAX_KEYS;
    let clock = ManualClock::new(1_767_225_600_000);
    let store = MemoryStore::with_clock(clock.clone());
    let response = vec![b'x'; response_bytes];
    let before = rss_bytes();
    for i in 0..N {
        let key = format!("k-{i:012}|order-{i:024}");
        let id = format!("tg-0123456789ab-{i:x}");
        let digest = format!("{i:064x}");
        let claim = tollgate_core::KeyUse {
            key: &key,
            digest: &digest,
            request_id: &id,
            in_flight_ms: 600_000,
        };
        assert_eq!(
            store.claim_key_sync(claim).unwrap(),
            tollgate_core::KeyClaim::Claimed
        );
        store
            .end_claim_sync(&key, &id, Some(&response), 86_400_000)
            .unwrap();
    }
    let grown = rss_bytes().saturating_sub(before);
    let fp = store.footprint().unwrap();
    println!(
        "idempotency keys answered with {response_bytes}-byte responses: {} keys, {} bytes kept: {:.0} bytes per key ({:.0} beyond the response)",
        fp.idempotency_keys,
        fp.kept_response_bytes,
        grown as f64 / N as f64,
        grown as f64 / N as f64 - response_bytes as f64
    );
    clock.advance(86_400_001);
    let claim = tollgate_core::KeyUse {
        key: "after",
        digest: "d",
        request_id: "r",
        in_flight_ms: 1,
    };
    store.claim_key_sync(claim).unwrap();
    // Each call sweeps a few: a pass of calls empties the store once their time is up.
    for _ in 0..N / 64 {
        store.claim_key_sync(claim).unwrap();
    }
    println!(
        "  after their keep time, swept by later calls: {} keys left",
        store.footprint().unwrap().idempotency_keys
    );
}
