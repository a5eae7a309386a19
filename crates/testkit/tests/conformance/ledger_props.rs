//! Property tests of the ledger invariants: random operation sequences against the memory store
//! give exactly what a small, obviously-correct reference model gives, and many threads racing
//! on one store never break invariants 1–3 of `docs/design.md`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use futures_util::FutureExt;
use proptest::prelude::*;
use tollgate_core::ledger::WEIGHT_SCALE;
use tollgate_core::{
    Clock, Decision, Ending, Finish, ManualClock, MemoryStore, Period, Reason, Renewal, Store,
    Usage, plan,
};
use tollgate_slices::{SliceConfig, Sliced};
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
    Admit {
        user: u8,
        input: u64,
        max: u64,
    },
    Settle {
        idx: usize,
        output: u64,
    },
    Release {
        idx: usize,
        output: Option<u64>,
    },
    Renew {
        idx: usize,
    },
    Advance {
        ms: u64,
    },
    Back {
        ms: u64,
    },
    /// A sliced store's maintenance (nothing for the others).
    Tend,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u64..60, 0u64..60).prop_map(|(user, input, max)| Op::Admit { user, input, max }),
        2 => (0usize..40, 0u64..60).prop_map(|(idx, output)| Op::Settle { idx, output }),
        1 => (0usize..40, proptest::option::of(0u64..60)).prop_map(|(idx, output)| Op::Release { idx, output }),
        1 => (0usize..40).prop_map(|idx| Op::Renew { idx }),
        2 => (0u64..20_000).prop_map(|ms| Op::Advance { ms }),
        1 => (0u64..30_000).prop_map(|ms| Op::Back { ms }),
        1 => Just(Op::Tend),
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

/// Runs `ops` on `store` (whose time is `clock`) and on the model; `tend` runs between
/// operations where the op says so (a sliced store's maintenance). With `within`, every charge
/// is within its request's reservation.
fn run_on<S: Store>(
    store: &S,
    clock: &ManualClock,
    ops: Vec<Op>,
    within: bool,
    tend: impl Fn(),
) -> Result<(), TestCaseError> {
    let p = policy(POLICY);
    let short = policy(&POLICY.replace(r#"lease_ttl = "15s""#, r#"lease_ttl = "7s""#));
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
                let got = ready(store.admit(&plan(p, &f).unwrap())).unwrap();
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
                let output = bound(&m, &id, output, within);
                let u = Usage {
                    input_tokens: input,
                    cached_input_tokens: 0,
                    output_tokens: output,
                    ..Usage::default()
                };
                let got = ready(store.settle(&id, u)).unwrap();
                prop_assert_eq!(got, m.finish(&id, Ending::Settled, Some(input + output)));
            }
            Op::Release { idx, output } => {
                let id = pick(idx);
                let input = m.tickets.iter().find(|t| t.id == id).map_or(0, |t| t.input);
                let output = output.map(|o| bound(&m, &id, o, within));
                let u = output.map(|o| Usage {
                    input_tokens: input,
                    cached_input_tokens: 0,
                    output_tokens: o,
                    ..Usage::default()
                });
                let got = ready(store.release(&id, u)).unwrap();
                prop_assert_eq!(
                    got,
                    m.finish(&id, Ending::Released, output.map(|o| input + o))
                );
            }
            Op::Renew { idx } => {
                let id = pick(idx);
                let got = ready(store.renew(&id)).unwrap();
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
            Op::Tend => tend(),
        }
        // Usage of every scope equals the model's, and invariants 1 and 2 hold.
        let period = Period::Fixed(P);
        let pid = m.now / P;
        for user in 0u8..3 {
            let got = ready(store.usage(&format!("user|tenant:acme/user:u{user}"), Some(period)))
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
        let got = ready(store.usage("all|global", Some(period))).unwrap();
        prop_assert_eq!((got.settled, got.reserved), m.committed(None, pid));
    }
    Ok(())
}

/// An output within the request's reservation when `within` (none known: as given).
fn bound(m: &Model, id: &str, output: u64, within: bool) -> u64 {
    match m.tickets.iter().find(|t| t.id == id) {
        Some(t) if within => output.min(t.est - t.input),
        _ => output,
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::with_clock(clock.clone());
    run_on(&store, &clock, ops, false, || {})
}

/// One instance slicing every plan from its first request, its slices living past the
/// clock's jumps (one left to expire is a dead instance's: charged in full, tested apart).
/// Charges stay within their reservations: one beyond takes a scope past its limit, and an
/// instance learns that a request the store admitted did so only at its next exchange with the
/// store, until which its slices may still admit.
fn run_sliced(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(T0);
    let store = Sliced::with_clock(
        MemoryStore::with_clock(clock.clone()),
        clock.clone(),
        eager(),
    );
    run_on(&store, &clock, ops, true, || {
        ready(store.maintain()).unwrap()
    })?;
    let st = store.stats();
    prop_assert_eq!(st.failed, 0);
    Ok(())
}

fn eager() -> SliceConfig {
    SliceConfig {
        hot_after: 0,
        ttl_ms: Some(400 * 86_400_000),
        ..SliceConfig::default()
    }
}

/// Runs a future that cannot wait: every store here answers at once.
fn ready<F: std::future::Future>(f: F) -> F::Output {
    f.now_or_never().expect("a store call waited")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn memory_store_equals_reference_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops)?;
    }

    #[test]
    fn one_sliced_instance_equals_reference_model(ops in proptest::collection::vec(op(), 1..80)) {
        run_sliced(ops)?;
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

/// Instances sharing one store, each slicing every plan: never more than the limits together.
mod instances {
    use super::*;

    /// Limits: tight ones, which most requests meet near their end, and roomy ones, which
    /// most requests take from slices.
    #[derive(Debug, Clone, Copy)]
    pub struct Limits {
        rate: u64,
        user_budget: u64,
        all_budget: u64,
        user_slots: u64,
        all_slots: u64,
    }

    pub const TIGHT: Limits = Limits {
        rate: 4,
        user_budget: 400,
        all_budget: 900,
        user_slots: 3,
        all_slots: 6,
    };

    pub const ROOMY: Limits = Limits {
        rate: 40,
        user_budget: 3_000,
        all_budget: 6_000,
        user_slots: 12,
        all_slots: 24,
    };

    const WINDOW: u64 = 10_000;
    const HOUR: Period = Period::Fixed(3_600_000);

    /// Nothing expires within a run: every admission ends in a settlement or release that the
    /// test sees, so the books can be checked to the unit.
    fn policy_of(l: Limits) -> tollgate_core::Policy {
        policy(&format!(
            r#"
            reservation_ttl = "1h"
            [[scopes]]
            key = "user"
            requests = {{ limit = {}, window = "10s" }}
            concurrency = {{ limit = {}, lease_ttl = "1h" }}
            budget = {{ tokens = {}, period = "1h" }}
            [[scopes]]
            name = "all"
            key = "global"
            concurrency = {{ limit = {}, lease_ttl = "1h" }}
            budget = {{ tokens = {}, period = "1h" }}
            "#,
            l.rate, l.user_slots, l.user_budget, l.all_slots, l.all_budget
        ))
    }

    #[derive(Debug, Clone)]
    pub enum Op {
        Admit {
            at: usize,
            user: u8,
            input: u64,
            max: u64,
        },
        Settle {
            idx: usize,
            output: u64,
        },
        Release {
            idx: usize,
        },
        Advance {
            ms: u64,
        },
        Tend {
            at: usize,
        },
        GiveBack {
            at: usize,
        },
    }

    pub fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0usize..3, 0u8..3, 1u64..40, 0u64..60)
                .prop_map(|(at, user, input, max)| Op::Admit { at, user, input, max }),
            3 => (0usize..64, 0u64..100).prop_map(|(idx, output)| Op::Settle { idx, output }),
            1 => (0usize..64).prop_map(|idx| Op::Release { idx }),
            2 => (0u64..3_000).prop_map(|ms| Op::Advance { ms }),
            2 => (0usize..3).prop_map(|at| Op::Tend { at }),
            1 => (0usize..3).prop_map(|at| Op::GiveBack { at }),
        ]
    }

    type Inst = Sliced<Arc<MemoryStore<ManualClock>>, ManualClock>;

    /// The store's own usage of every scope: within every limit, slices included.
    fn check_store(store: &MemoryStore<ManualClock>, l: Limits) -> Result<(), TestCaseError> {
        for (scope, budget, slots) in [
            ("user|tenant:acme/user:u0", l.user_budget, l.user_slots),
            ("user|tenant:acme/user:u1", l.user_budget, l.user_slots),
            ("user|tenant:acme/user:u2", l.user_budget, l.user_slots),
            ("all|global", l.all_budget, l.all_slots),
        ] {
            let u = store.usage_sync(scope, Some(HOUR)).unwrap();
            prop_assert!(u.settled + u.reserved <= budget, "{scope}: {u:?}");
            prop_assert!(u.leases <= slots, "{scope}: {u:?}");
        }
        Ok(())
    }

    pub fn run(ops: Vec<Op>, l: Limits) -> Result<(), TestCaseError> {
        let p = policy_of(l);
        let clock = ManualClock::new(T0);
        let store = Arc::new(MemoryStore::with_clock(clock.clone()));
        let cfg = SliceConfig {
            hot_after: 0,
            ..SliceConfig::default()
        };
        let inst: Vec<Inst> = (0..3)
            .map(|_| Sliced::with_clock(store.clone(), clock.clone(), cfg))
            .collect();
        // Requests in flight: (instance, id, input, max); what their endings charged.
        let mut open: Vec<(usize, String, u64, u64)> = Vec::new();
        let mut charged: HashMap<String, u64> = HashMap::new();
        let mut charge = |users: &str, c: u64| *charged.entry(users.to_owned()).or_default() += c;
        // Attempts past the rate, per user: a window of what was truly let through.
        let mut passed: HashMap<u8, tollgate_core::ledger::RateWindow> = HashMap::new();
        for (n, op) in ops.into_iter().enumerate() {
            match op {
                Op::Admit {
                    at,
                    user,
                    input,
                    max,
                } => {
                    let id = format!("r{n}");
                    let f = facts(&id, &format!("u{user}"), input, max);
                    let d = ready(inst[at].admit(&plan(&p, &f).unwrap())).unwrap();
                    if d.deny()
                        .is_none_or(|d| d.reason != Reason::RequestRateLimit)
                    {
                        let w = passed.entry(user).or_default();
                        let now = clock.now();
                        w.roll(now, WINDOW);
                        w.current += 1;
                        prop_assert!(
                            w.scaled_count(now, WINDOW) <= l.rate * WEIGHT_SCALE,
                            "op {n}: u{user} let through past its rate: {w:?}"
                        );
                    }
                    if let Decision::Admit(_) = d {
                        open.push((at, id, input, max));
                    }
                }
                Op::Settle { idx, output } if !open.is_empty() => {
                    let (at, id, input, max) = open.remove(idx % open.len());
                    // Within the reservation: a charge beyond it may take a store past its
                    // limit, with or without slices.
                    let u = Usage {
                        input_tokens: input,
                        output_tokens: output % (max + 1),
                        ..Usage::default()
                    };
                    let f = ready(inst[at].settle(&id, u)).unwrap();
                    let Finish::Done { charged: c } = f else {
                        return Err(TestCaseError::fail(format!("op {n}: {id} {f:?}")));
                    };
                    charge(&id, c.iter().sum());
                }
                Op::Release { idx } if !open.is_empty() => {
                    let (at, id, _, _) = open.remove(idx % open.len());
                    let f = ready(inst[at].release(&id, None)).unwrap();
                    let Finish::Done { charged: c } = f else {
                        return Err(TestCaseError::fail(format!("op {n}: {id} {f:?}")));
                    };
                    charge(&id, c.iter().sum());
                }
                Op::Advance { ms } => clock.advance(ms),
                Op::Tend { at } => ready(inst[at].maintain()).unwrap(),
                Op::GiveBack { at } => ready(inst[at].return_all()).unwrap(),
                Op::Settle { .. } | Op::Release { .. } => {}
            }
            check_store(&store, l)?;
            for (i, s) in inst.iter().enumerate() {
                prop_assert!(s.audit().is_ok(), "op {n}, instance {i}: {:?}", s.audit());
            }
        }
        // Everything ends; every instance gives back what it holds: the store holds nothing,
        // and has charged exactly what the endings reported, each budget once per request.
        for (at, id, input, _) in std::mem::take(&mut open) {
            let u = Usage {
                input_tokens: input,
                ..Usage::default()
            };
            let Finish::Done { charged: c } = ready(inst[at].settle(&id, u)).unwrap() else {
                return Err(TestCaseError::fail(format!("{id} did not end")));
            };
            charge(&id, c.iter().sum());
        }
        for s in &inst {
            ready(s.return_all()).unwrap();
            ready(s.return_all()).unwrap();
        }
        let total: u64 = charged.values().sum();
        let mut settled = 0;
        for scope in [
            "user|tenant:acme/user:u0",
            "user|tenant:acme/user:u1",
            "user|tenant:acme/user:u2",
            "all|global",
        ] {
            let u = store.usage_sync(scope, Some(HOUR)).unwrap();
            prop_assert_eq!((u.reserved, u.leases), (0, 0), "{}", scope);
            settled += u.settled;
        }
        // Each request is charged in its user's budget and in the global one alike.
        prop_assert_eq!(settled, total);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn sliced_instances_never_overshoot_together(
        ops in proptest::collection::vec(instances::op(), 1..120)
    ) {
        instances::run(ops, instances::TIGHT)?;
    }

    #[test]
    fn sliced_instances_never_overshoot_together_with_room(
        ops in proptest::collection::vec(instances::op(), 1..120)
    ) {
        instances::run(ops, instances::ROOMY)?;
    }
}

/// Instances with slices on one store, their requests racing on two threads (exchanges waiting
/// on each other, maintenance ticking), a checker sampling the store: no budget or lease limit
/// is ever exceeded, every instance's slices cover what it admitted, and once every request
/// has ended and the slices have gone back, the store holds nothing and has charged exactly
/// what the endings reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliced_instances_racing_never_overshoot() {
    let p = Arc::new(policy(
        r#"
        reservation_ttl = "1h"
        [[scopes]]
        key = "user"
        concurrency = { limit = 6, lease_ttl = "1h" }
        [[scopes]]
        name = "all"
        key = "global"
        concurrency = { limit = 16, lease_ttl = "1h" }
        budget = { tokens = 30000, period = "1h" }
        "#,
    ));
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let cfg = SliceConfig {
        hot_after: 0,
        ..SliceConfig::default()
    };
    let inst: Vec<Arc<Sliced<Arc<MemoryStore<ManualClock>>, ManualClock>>> = (0..3)
        .map(|_| Arc::new(Sliced::with_clock(store.clone(), clock.clone(), cfg)))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(AtomicU64::new(0));
    let first = Arc::new(std::sync::Mutex::new(String::new()));
    let checker = {
        let (store, stop, violations, inst, first) = (
            store.clone(),
            stop.clone(),
            violations.clone(),
            inst.clone(),
            first.clone(),
        );
        tokio::spawn(async move {
            let mut samples = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let u = store
                    .usage_sync("all|global", Some(Period::Fixed(3_600_000)))
                    .unwrap();
                let uncovered: Vec<String> = inst.iter().filter_map(|s| s.audit().err()).collect();
                let over = u.settled + u.reserved > 30_000 || u.leases > 16;
                if (over || !uncovered.is_empty())
                    && violations.fetch_add(1, Ordering::Relaxed) == 0
                {
                    *first.lock().unwrap() = format!("{u:?}, uncovered: {uncovered:?}");
                }
                samples += 1;
                tokio::task::yield_now().await;
            }
            samples
        })
    };
    let tending: Vec<_> = inst
        .iter()
        .map(|s| {
            let (s, stop, clock) = (s.clone(), stop.clone(), clock.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    clock.advance(20);
                    let _ = s.maintain().await;
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let (s, p) = (inst[w % 3].clone(), p.clone());
            tokio::spawn(async move {
                let mut charged = 0u64;
                let mut open = Vec::new();
                for i in 0..400u64 {
                    let id = format!("w{w}-{i}");
                    let f = facts(&id, &format!("u{}", i % 4), 5 + i % 7, 10);
                    if let Decision::Admit(_) = s.admit(&plan(&p, &f).unwrap()).await.unwrap() {
                        open.push((id, 5 + i % 7));
                    }
                    if open.len() > 2 || (i % 5 == 0 && !open.is_empty()) {
                        let (id, input) = open.remove(0);
                        let u = Usage {
                            input_tokens: input,
                            output_tokens: i % 10,
                            ..Usage::default()
                        };
                        let f = if i % 3 == 0 {
                            s.release(&id, Some(u)).await
                        } else {
                            s.settle(&id, u).await
                        };
                        if let Finish::Done { charged: c } = f.unwrap() {
                            charged += c.iter().sum::<u64>();
                        }
                    }
                    tokio::task::yield_now().await;
                }
                for (id, input) in open {
                    let u = Usage {
                        input_tokens: input,
                        ..Usage::default()
                    };
                    if let Finish::Done { charged: c } = s.settle(&id, u).await.unwrap() {
                        charged += c.iter().sum::<u64>();
                    }
                }
                charged
            })
        })
        .collect();
    let mut charged = 0;
    for w in workers {
        charged += w.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let samples = checker.await.unwrap();
    for t in tending {
        t.await.unwrap();
    }
    assert_eq!(
        violations.load(Ordering::Relaxed),
        0,
        "over {samples} samples, the first: {}",
        first.lock().unwrap()
    );
    assert!(samples > 100, "the checker ran ({samples} samples)");
    for s in &inst {
        s.return_all().await.unwrap();
        s.return_all().await.unwrap();
    }
    let u = store
        .usage_sync("all|global", Some(Period::Fixed(3_600_000)))
        .unwrap();
    assert_eq!((u.reserved, u.leases), (0, 0));
    let settled = u.settled;
    // Each request is charged in the global budget (the users' rules have none).
    assert_eq!(settled, charged);
    let local: u64 = inst.iter().map(|s| s.stats().local).sum();
    assert!(
        local > 100,
        "requests were admitted against slices: {local}"
    );
}
