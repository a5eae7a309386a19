//! Property tests of the ledger invariants: random operation sequences against the memory store
//! give exactly what a small, obviously-correct reference model gives, and many threads racing
//! on one store never break invariants 1–3 of `docs/design.md`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use proptest::prelude::*;
use tollgate_core::ledger::WEIGHT_SCALE;
use tollgate_core::{
    Clock, Decision, Ending, Finish, ManualClock, MemoryStore, Period, Reason, Renewal, Usage, plan,
};
use tollgate_testkit::{T0, facts, policy};

const W: u64 = 10_000; // rate window
const L: u64 = 4; // attempts per window
const C: u64 = 2; // leases per user
const TTL: u64 = 15_000;
/// User 2's requests are planned by the same policy with this shorter lease lifetime, so that
/// tickets of two lifetimes are in flight at once (the store orders each lifetime on its own).
const SHORT_TTL: u64 = 7_000;
const B: u64 = 300; // per-user budget per period
const G: u64 = 500; // global budget per period
const P: u64 = 60_000; // budget period
const POLICY: &str = r#"
    [[scopes]]
    key = "user"
    requests = { limit = 4, window = "10s" }
    input_tokens = 50
    total_tokens = 90
    concurrency = { limit = 2, lease_ttl = "15s" }
    budget = { tokens = 300, period = "1m" }
    [[scopes]]
    name = "all"
    key = "global"
    budget = { tokens = 500, period = "1m" }
"#;

#[derive(Debug, Clone)]
enum Op {
    Admit { user: u8, input: u64, max: u64 },
    Settle { idx: usize, output: u64 },
    Release { idx: usize, output: Option<u64> },
    Renew { idx: usize },
    Advance { ms: u64 },
    Back { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u64..60, 0u64..60).prop_map(|(user, input, max)| Op::Admit { user, input, max }),
        2 => (0usize..40, 0u64..60).prop_map(|(idx, output)| Op::Settle { idx, output }),
        1 => (0usize..40, proptest::option::of(0u64..60)).prop_map(|(idx, output)| Op::Release { idx, output }),
        1 => (0usize..40).prop_map(|idx| Op::Renew { idx }),
        2 => (0u64..20_000).prop_map(|ms| Op::Advance { ms }),
        1 => (0u64..30_000).prop_map(|ms| Op::Back { ms }),
    ]
}

/// The reference: a log of attempts and a list of tickets, nothing incremental.
#[derive(Default)]
struct Model {
    now: u64,
    attempts: Vec<(u8, u64)>,
    tickets: Vec<Ticket>,
}

struct Ticket {
    id: String,
    user: u8,
    input: u64,
    est: u64,
    period: u64,
    expires_at: u64,
    ttl: u64,
    ended: Option<(Ending, u64)>,
}

impl Model {
    fn expire(&mut self) {
        for t in &mut self.tickets {
            if t.ended.is_none() && t.expires_at <= self.now {
                t.ended = Some((Ending::Expired, t.est));
            }
        }
    }

    fn rate_ok(&self, user: u8) -> bool {
        let ws = self.now - self.now % W;
        let cur = self
            .attempts
            .iter()
            .filter(|(u, t)| *u == user && *t >= ws)
            .count() as u64;
        let prev = self
            .attempts
            .iter()
            .filter(|(u, t)| *u == user && *t + W >= ws && *t < ws)
            .count() as u64;
        let weight = (W - (self.now - ws)) * WEIGHT_SCALE / W;
        prev * weight + cur * WEIGHT_SCALE <= L * WEIGHT_SCALE
    }

    fn committed(&self, user: Option<u8>, period: u64) -> (u64, u64) {
        let mut settled = 0;
        let mut reserved = 0;
        for t in self
            .tickets
            .iter()
            .filter(|t| t.period == period && user.is_none_or(|u| t.user == u))
        {
            match t.ended {
                Some((_, c)) => settled += c,
                None => reserved += t.est,
            }
        }
        (settled, reserved)
    }

    fn leases(&self, user: u8) -> u64 {
        self.tickets
            .iter()
            .filter(|t| t.user == user && t.ended.is_none())
            .count() as u64
    }

    fn admit(&mut self, id: String, user: u8, input: u64, max: u64) -> Option<Reason> {
        self.attempts.push((user, self.now));
        if !self.rate_ok(user) {
            return Some(Reason::RequestRateLimit);
        }
        if input > 50 {
            return Some(Reason::InputTokenLimit);
        }
        if input + max > 90 {
            return Some(Reason::TotalTokenLimit);
        }
        if self.leases(user) >= C {
            return Some(Reason::ConcurrencyLimit);
        }
        let period = self.now / P;
        let est = input + max;
        let (s, r) = self.committed(Some(user), period);
        if s + r + est > B {
            return Some(Reason::BudgetLimit);
        }
        let (s, r) = self.committed(None, period);
        if s + r + est > G {
            return Some(Reason::BudgetLimit);
        }
        self.tickets.push(Ticket {
            id,
            user,
            input,
            est,
            period,
            expires_at: self.now + ttl_of(user),
            ttl: ttl_of(user),
            ended: None,
        });
        None
    }

    fn finish(&mut self, id: &str, how: Ending, charge: Option<u64>) -> Finish {
        let Some(t) = self.tickets.iter_mut().find(|t| t.id == id) else {
            return Finish::Unknown;
        };
        if let Some((e, _)) = t.ended {
            return Finish::AlreadyEnded(e);
        }
        let c = charge.unwrap_or(t.est);
        t.ended = Some((how, c));
        Finish::Done {
            charged: vec![c, c],
        }
    }
}

fn ttl_of(user: u8) -> u64 {
    if user == 2 { SHORT_TTL } else { TTL }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let p = policy(POLICY);
    let short = policy(&POLICY.replace(r#"lease_ttl = "15s""#, r#"lease_ttl = "7s""#));
    let clock = ManualClock::new(T0);
    let store = MemoryStore::with_clock(clock.clone());
    let mut m = Model::default();
    let mut ids: Vec<String> = Vec::new();
    for (n, op) in ops.into_iter().enumerate() {
        match op {
            Op::Advance { ms } => clock.advance(ms),
            Op::Back { ms } => clock.set(clock.now().saturating_sub(ms)),
            _ => {}
        }
        // The store never lets time go backwards; neither does the model.
        m.now = m.now.max(clock.now());
        m.expire();
        let pick = |idx: usize| {
            ids.get(idx % ids.len().max(1))
                .cloned()
                .unwrap_or_else(|| "none".into())
        };
        match op {
            Op::Admit { user, input, max } => {
                let id = format!("r{n}");
                let f = facts(&id, &format!("u{user}"), input, max);
                let p = if user == 2 { &short } else { &p };
                let got = store.admit_sync(&plan(p, &f).unwrap()).unwrap();
                let want = m.admit(id.clone(), user, input, max);
                prop_assert_eq!(
                    got.deny().map(|d| d.reason),
                    want,
                    "op {} admit u{}",
                    n,
                    user
                );
                if let Decision::Admit(_) = got {
                    ids.push(id);
                }
            }
            Op::Settle { idx, output } => {
                let id = pick(idx);
                let input = m.tickets.iter().find(|t| t.id == id).map_or(0, |t| t.input);
                let u = Usage {
                    input_tokens: input,
                    cached_input_tokens: 0,
                    output_tokens: output,
                    ..Usage::default()
                };
                let got = store.settle_sync(&id, u).unwrap();
                prop_assert_eq!(got, m.finish(&id, Ending::Settled, Some(input + output)));
            }
            Op::Release { idx, output } => {
                let id = pick(idx);
                let input = m.tickets.iter().find(|t| t.id == id).map_or(0, |t| t.input);
                let u = output.map(|o| Usage {
                    input_tokens: input,
                    cached_input_tokens: 0,
                    output_tokens: o,
                    ..Usage::default()
                });
                let got = store.release_sync(&id, u).unwrap();
                prop_assert_eq!(
                    got,
                    m.finish(&id, Ending::Released, output.map(|o| input + o))
                );
            }
            Op::Renew { idx } => {
                let id = pick(idx);
                let got = store.renew_sync(&id).unwrap();
                let want = match m
                    .tickets
                    .iter_mut()
                    .find(|t| t.id == id && t.ended.is_none())
                {
                    Some(t) => {
                        t.expires_at = m.now + t.ttl;
                        Renewal::Renewed {
                            expires_at: t.expires_at,
                        }
                    }
                    None => Renewal::NotInFlight,
                };
                prop_assert_eq!(got, want);
            }
            Op::Advance { .. } | Op::Back { .. } => {}
        }
        // Usage of every scope equals the model's, and invariants 1 and 2 hold.
        let period = Period::Fixed(P);
        let pid = m.now / P;
        for user in 0u8..3 {
            let got = store
                .usage_sync(&format!("user|tenant:acme/user:u{user}"), Some(period))
                .unwrap();
            let (s, r) = m.committed(Some(user), pid);
            prop_assert_eq!(
                (got.settled, got.reserved, got.leases),
                (s, r, m.leases(user)),
                "op {} u{}",
                n,
                user
            );
            prop_assert!(got.leases <= C);
        }
        let got = store.usage_sync("all|global", Some(period)).unwrap();
        prop_assert_eq!((got.settled, got.reserved), m.committed(None, pid));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn memory_store_equals_reference_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops)?;
    }
}

/// Many threads admit, settle, release and abandon on one store while the clock moves; a
/// checker thread samples usage throughout. No budget or lease limit is ever exceeded, and
/// every admission ends in exactly one settlement, release or expiry.
#[test]
fn threads_never_overshoot_and_nothing_leaks() {
    let p = Arc::new(policy(
        r#"
        reservation_ttl = "5s"
        [[scopes]]
        key = "user"
        concurrency = { limit = 3, lease_ttl = "5s" }
        [[scopes]]
        name = "all"
        key = "global"
        concurrency = { limit = 8, lease_ttl = "5s" }
        budget = { tokens = 5000, period = "1h" }
        "#,
    ));
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(AtomicU64::new(0));
    let checker = {
        let (store, stop, violations) = (store.clone(), stop.clone(), violations.clone());
        std::thread::spawn(move || {
            let mut samples = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let u = store
                    .usage_sync("all|global", Some(Period::Fixed(3_600_000)))
                    .unwrap();
                if u.settled + u.reserved > 5000 || u.leases > 8 {
                    violations.fetch_add(1, Ordering::Relaxed);
                }
                samples += 1;
            }
            samples
        })
    };
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let (store, p, clock) = (store.clone(), p.clone(), clock.clone());
            std::thread::spawn(move || {
                let mut admitted = Vec::new();
                let mut done = 0u64;
                for i in 0..3000u64 {
                    let id = format!("w{w}-{i}");
                    let f = facts(&id, &format!("u{}", i % 4), 5 + i % 7, 10);
                    if let Decision::Admit(_) = store.admit_sync(&plan(&p, &f).unwrap()).unwrap() {
                        admitted.push((id, 5 + i % 7));
                    }
                    // Finish most requests soon; abandon every 7th so that it must expire.
                    if admitted.len() > 2 {
                        let (id, input) = admitted.remove(0);
                        if !id.ends_with('7') {
                            let u = Usage {
                                input_tokens: input,
                                cached_input_tokens: 0,
                                output_tokens: i % 10,
                                ..Usage::default()
                            };
                            let f = if i % 3 == 0 {
                                store.release_sync(&id, Some(u))
                            } else {
                                store.settle_sync(&id, u)
                            };
                            if let Finish::Done { .. } = f.unwrap() {
                                done += 1;
                            }
                        } else {
                            admitted.push((id, input));
                            admitted.rotate_right(1);
                            admitted.remove(0);
                        }
                    }
                    if i % 50 == 0 {
                        clock.advance(100);
                    }
                }
                (done, admitted)
            })
        })
        .collect();
    let mut finished_by_workers = 0;
    for h in workers {
        let (done, _) = h.join().unwrap();
        finished_by_workers += done;
    }
    stop.store(true, Ordering::Relaxed);
    let samples = checker.join().unwrap();
    assert_eq!(
        violations.load(Ordering::Relaxed),
        0,
        "over {samples} samples"
    );
    assert!(samples > 100, "the checker ran ({samples} samples)");
    // Past every TTL: every admission has ended; nothing is reserved or leased.
    clock.advance(10_000);
    store.sweep_all().unwrap();
    let fp = store.footprint().unwrap();
    assert_eq!(fp.in_flight, 0);
    assert_eq!(fp.lease_scopes, 0);
    let u = store
        .usage_sync("all|global", Some(Period::Fixed(3_600_000)))
        .unwrap();
    assert_eq!((u.reserved, u.leases), (0, 0));
    assert!(finished_by_workers > 0 && fp.remembered as u64 >= finished_by_workers);
    let _ = HashMap::<(), ()>::new();
}
