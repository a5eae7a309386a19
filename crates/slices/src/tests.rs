//! The slice layer over memory stores on a manual clock: a plan seen rarely is the store's, a
//! busy one is admitted here; what an idle or dead instance held comes back; the kill switch
//! reaches a leasing instance within its bound; a long request keeps its slices; a store that
//! forgets takes the slices with it. (One instance deciding as the store does, and instances
//! never overshooting together, are property tests in `tollgate-testkit`.)

use futures_util::FutureExt;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{Exchange, Exchanged, Granted, SliceSource};
use crate::{SliceConfig, Sliced};
use tollgate_core::store::{KeyClaim, KeyUse, Renewal, ScopeUsage, ShadowOutcome, StoreError};
use tollgate_core::{
    Decision, Dimension, Finish, Identity, ManualClock, MemoryStore, Period, Plan, Policy,
    RequestFacts, Store, Usage, plan,
};

const T0: u64 = 1_767_225_600_000;
const DAY: Period = Period::Fixed(86_400_000);
const KEY: &str = "per-key|tenant:acme";

/// Runs a future that never waits (every store here answers at once).
fn now<F: std::future::Future>(f: F) -> F::Output {
    f.now_or_never().expect("a slice call waited")
}

fn facts(id: &str, user: &str, input: u64, max_output: u64) -> RequestFacts {
    RequestFacts {
        request_id: id.to_owned(),
        identity: Identity::default()
            .with(Dimension::User, user)
            .with(Dimension::Tenant, "acme")
            .with(Dimension::Model, "gpt-4o"),
        input_tokens: input,
        max_output_tokens: Some(max_output),
        ..RequestFacts::default()
    }
}

fn policy() -> Policy {
    Policy::from_toml(
        r#"
        [[scopes]]
        name = "per-key"
        key = "tenant"
        requests = { limit = 100000, window = "1m" }
        concurrency = { limit = 1000, lease_ttl = "10s" }
        budget = { tokens = 10000000, period = "day" }
        "#,
    )
    .unwrap()
}

type Shared = Arc<MemoryStore<ManualClock>>;

fn instance(store: &Shared, clock: &ManualClock, cfg: SliceConfig) -> Sliced<Shared, ManualClock> {
    Sliced::with_clock(store.clone(), clock.clone(), cfg)
}

fn admit<S: Store>(s: &S, p: &Policy, id: &str, user: &str) -> Decision {
    now(s.admit(&plan(p, &facts(id, user, 10, 10)).unwrap())).unwrap()
}

fn used(out: u64) -> Usage {
    Usage {
        input_tokens: 10,
        output_tokens: out,
        ..Usage::default()
    }
}

/// A plan shape seen fewer times a second than `hot_after` is admitted by the store, one call
/// each, and takes no slice; one seen more is admitted here.
#[test]
fn only_busy_plans_are_sliced() {
    let p = Policy::from_toml(
        "[[scopes]]\nkey = \"user\"\nbudget = { tokens = 100000, period = \"day\" }\n",
    )
    .unwrap();
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let s = instance(&store, &clock, SliceConfig::default());
    for i in 0..200 {
        assert!(matches!(
            admit(&s, &p, &format!("d{i}"), &format!("u{i}")),
            Decision::Admit(_)
        ));
    }
    assert_eq!((s.stats().local, s.stats().store), (0, 200));
    assert_eq!(s.stats().exchanges, 0, "distinct users take no slice");
    for i in 0..200 {
        assert!(matches!(
            admit(&s, &p, &format!("b{i}"), "busy"),
            Decision::Admit(_)
        ));
    }
    let st = s.stats();
    assert_eq!(st.store, 200 + 16, "the busy user's first 16: {st:?}");
    assert_eq!(st.local, 200 - 16);
    assert!(st.exchanges < 20, "{st:?}");
}

/// Requests of shapes seen rarely (each with a user of its own) that share a busy scope with a
/// sliced shape go to the store without taking that scope's slice back: its slice stays, and
/// no exchange is made for them.
#[test]
fn rare_shapes_leave_a_busy_scopes_slice_alone() {
    let p = Policy::from_toml(
        "[[scopes]]\nkey = \"tenant\"\nbudget = { tokens = 1000000, period = \"day\" }\n\
         [[scopes]]\nkey = \"user\"\nbudget = { tokens = 100000, period = \"day\" }\n",
    )
    .unwrap();
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let s = instance(&store, &clock, SliceConfig::default());
    for i in 0..100 {
        assert!(matches!(
            admit(&s, &p, &format!("b{i}"), "busy"),
            Decision::Admit(_)
        ));
    }
    let before = s.stats();
    assert!(before.local > 60, "{before:?}");
    for i in 0..100 {
        assert!(matches!(
            admit(&s, &p, &format!("c{i}"), &format!("u{i}")),
            Decision::Admit(_)
        ));
    }
    let after = s.stats();
    assert_eq!(after.store, before.store + 100);
    assert_eq!(after.exchanges, before.exchanges, "{before:?} {after:?}");
    assert!(matches!(
        admit(&s, &p, "b-last", "busy"),
        Decision::Admit(_)
    ));
    assert_eq!(s.stats().local, after.local + 1);
}

/// Requests ended and maintenance run: every slot and every unit of budget the instance held
/// beyond its requests is back in the store, and the store has charged exactly the endings.
#[test]
fn idle_slices_go_back() {
    let p = policy();
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let s = instance(&store, &clock, eager());
    let mut charged = 0;
    for i in 0..100 {
        let id = format!("r{i}");
        assert!(matches!(admit(&s, &p, &id, "u"), Decision::Admit(_)));
        let Finish::Done { charged: c } = now(s.settle(&id, used(i % 7))).unwrap() else {
            panic!("{id} not ended");
        };
        charged += c[0];
    }
    assert!(s.stats().local > 90, "{:?}", s.stats());
    let held = store.usage_sync(KEY, Some(DAY)).unwrap();
    assert!(
        held.reserved > 0 && held.leases > 0,
        "slices held: {held:?}"
    );
    for _ in 0..3 {
        clock.advance(100);
        now(s.maintain()).unwrap();
    }
    let u = store.usage_sync(KEY, Some(DAY)).unwrap();
    assert_eq!((u.settled, u.reserved, u.leases), (charged, 0, 0));
    assert_eq!(now(s.usage(KEY, Some(DAY))).unwrap(), u);
}

/// An instance that dies holding slices: its slots come back when the slices expire, and each
/// budget slice is charged in full (what its requests spent since the last report is unknown).
#[test]
fn a_dead_instance_gives_back_its_slots_and_pays_its_budget_slices() {
    let p = policy();
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let s = instance(&store, &clock, eager());
    for i in 0..50 {
        assert!(matches!(
            admit(&s, &p, &format!("r{i}"), "u"),
            Decision::Admit(_)
        ));
    }
    for i in 0..40 {
        assert!(matches!(
            now(s.settle(&format!("r{i}"), used(3))).unwrap(),
            Finish::Done { .. }
        ));
    }
    now(s.maintain()).unwrap();
    let before = store.usage_sync(KEY, Some(DAY)).unwrap();
    assert!(
        before.leases >= 10 && before.reserved >= 10 * 20,
        "{before:?}"
    );
    drop(s);
    // Twice the lease lifetime, and a little: the slices' lifetime.
    clock.advance(20_001);
    store.sweep_all().unwrap();
    let after = store.usage_sync(KEY, Some(DAY)).unwrap();
    assert_eq!(
        (after.settled, after.reserved, after.leases),
        (before.settled + before.reserved, 0, 0)
    );
    // 40 settled at 13 each, 10 in flight at 20 each: charged at least that.
    assert!(after.settled >= 40 * 13 + 10 * 20, "{after:?}");
}

/// A kill switch set by another instance stops a leasing instance at its next call to the
/// store, and at the latest once its copy is older than the bound; the instance that set it
/// stops at once.
#[test]
fn the_kill_switch_reaches_a_leasing_instance_within_its_bound() {
    let p = policy();
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let cfg = eager();
    let (a, b) = (instance(&store, &clock, cfg), instance(&store, &clock, cfg));
    assert!(matches!(admit(&a, &p, "a0", "u"), Decision::Admit(_)));
    assert!(matches!(admit(&b, &p, "b0", "u"), Decision::Admit(_)));
    now(b.set_kill("tenant:acme", Some("incident"))).unwrap();
    assert!(matches!(admit(&b, &p, "b1", "u"), Decision::Killed(_)));
    // a has not spoken to the store since: within the bound, its copy still admits.
    clock.advance(cfg.kill_bound_ms);
    assert!(matches!(admit(&a, &p, "a1", "u"), Decision::Admit(_)));
    clock.advance(1);
    assert!(matches!(admit(&a, &p, "a2", "u"), Decision::Killed(_)));
    // Lifted: a learns it at its next maintenance.
    now(b.set_kill("tenant:acme", None)).unwrap();
    now(a.maintain()).unwrap();
    assert!(matches!(admit(&a, &p, "a3", "u"), Decision::Admit(_)));
}

/// A request renewed for far longer than a slice lives keeps its slot and reservation: the
/// renewals and the maintenance keep its slices alive in the store.
#[test]
fn a_long_request_keeps_its_slices() {
    let p = policy();
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let s = instance(&store, &clock, eager());
    assert!(matches!(admit(&s, &p, "long", "u"), Decision::Admit(_)));
    for _ in 0..30 {
        clock.advance(3_000);
        assert!(matches!(
            now(s.renew("long")).unwrap(),
            Renewal::Renewed { .. }
        ));
        now(s.maintain()).unwrap();
        assert!(store.usage_sync(KEY, None).unwrap().leases >= 1);
        assert_eq!(now(s.usage(KEY, None)).unwrap().leases, 1);
    }
    assert_eq!(
        now(s.settle("long", used(5))).unwrap(),
        Finish::Done { charged: vec![15] }
    );
    assert_eq!(s.stats().failed, 0);
}

/// Slices from a plan's first request.
fn eager() -> SliceConfig {
    SliceConfig {
        hot_after: 0,
        ..SliceConfig::default()
    }
}

/// An instance over a store that can be made to forget, and that lies when `lies`.
fn forgetful(clock: &ManualClock, lies: bool) -> Sliced<Forgetful, ManualClock> {
    let store = Forgetful {
        inner: MemoryStore::with_clock(clock.clone()),
        lost: AtomicBool::new(false),
        lies: AtomicBool::new(lies),
    };
    Sliced::with_clock(store, clock.clone(), eager())
}

/// A store that can be made to forget (its state lost, as a Redis restarted empty).
#[derive(Debug)]
struct Forgetful {
    inner: MemoryStore<ManualClock>,
    lost: AtomicBool,
    /// Answers a thousand times what it grants, in a window a day off.
    lies: AtomicBool,
}

impl Forgetful {
    fn check(&self) -> Result<(), StoreError> {
        if self.lost.load(Ordering::Relaxed) {
            Err(StoreError::StateLost)
        } else {
            Ok(())
        }
    }
}

impl SliceSource for Forgetful {
    async fn exchange(&self, ex: &Exchange) -> Result<Exchanged, StoreError> {
        self.check()?;
        let mut got = self.inner.exchange_sync(ex)?;
        if self.lies.load(Ordering::Relaxed) {
            for g in &mut got.granted {
                *g = match *g {
                    Granted::Rate {
                        granted,
                        mut window,
                    } => {
                        window.start += 86_400_000;
                        Granted::Rate {
                            granted: granted * 1000,
                            window,
                        }
                    }
                    Granted::Lease { slots, held } => Granted::Lease {
                        slots: slots * 1000 + 1,
                        held,
                    },
                    Granted::Budget { amount, committed } => Granted::Budget {
                        amount: amount * 1000 + 1,
                        committed,
                    },
                    Granted::Gone => Granted::Gone,
                };
            }
        }
        Ok(got)
    }
}

impl Store for Forgetful {
    async fn admit(&self, plan: &Plan) -> Result<Decision, StoreError> {
        self.check()?;
        self.inner.admit_sync(plan)
    }
    async fn admit_shadowed(
        &self,
        p: &Plan,
        s: &Plan,
    ) -> Result<(Decision, ShadowOutcome), StoreError> {
        self.check()?;
        self.inner.admit_shadowed_sync(p, s)
    }
    async fn settle(&self, id: &str, u: Usage) -> Result<Finish, StoreError> {
        self.inner.settle_sync(id, u)
    }
    async fn release(&self, id: &str, u: Option<Usage>) -> Result<Finish, StoreError> {
        self.inner.release_sync(id, u)
    }
    async fn renew(&self, id: &str) -> Result<Renewal, StoreError> {
        self.inner.renew_sync(id)
    }
    async fn set_kill(&self, t: &str, r: Option<&str>) -> Result<(), StoreError> {
        self.inner.set_kill_sync(t, r)
    }
    async fn kills(&self) -> Result<Vec<(String, String)>, StoreError> {
        self.inner.kills().await
    }
    async fn usage(&self, scope: &str, p: Option<Period>) -> Result<ScopeUsage, StoreError> {
        self.inner.usage_sync(scope, p)
    }
    async fn usage_carrying(
        &self,
        scope: &str,
        p: Period,
        carry: (u64, u64),
    ) -> Result<ScopeUsage, StoreError> {
        self.inner.usage_sync_carrying(scope, Some(p), Some(carry))
    }
    async fn claim_key(&self, k: KeyUse<'_>) -> Result<KeyClaim, StoreError> {
        self.inner.claim_key_sync(k)
    }
    async fn end_claim(
        &self,
        k: &str,
        id: &str,
        r: Option<&[u8]>,
        keep: u64,
    ) -> Result<(), StoreError> {
        self.inner.end_claim_sync(k, id, r, keep)
    }
}

/// The store forgets: the slices are gone with it, a request admitted here before ends as one
/// the store does not know (its charge goes to the books another way), new requests meet the
/// store's refusal; once the store is back, slicing resumes.
#[test]
fn a_store_that_forgets_takes_the_slices_with_it() {
    let p = policy();
    let clock = ManualClock::new(T0);
    let s = forgetful(&clock, false);
    assert!(matches!(admit(&s, &p, "before", "u"), Decision::Admit(_)));
    s.inner().lost.store(true, Ordering::Relaxed);
    assert_eq!(now(s.maintain()), Err(StoreError::StateLost));
    assert_eq!(now(s.settle("before", used(1))).unwrap(), Finish::Unknown);
    assert_eq!(
        now(s.admit(&plan(&p, &facts("during", "u", 1, 1)).unwrap())),
        Err(StoreError::StateLost)
    );
    s.inner().lost.store(false, Ordering::Relaxed);
    now(s.maintain()).unwrap();
    let local = s.stats().local;
    for i in 0..5 {
        assert!(matches!(
            admit(&s, &p, &format!("after{i}"), "u"),
            Decision::Admit(_)
        ));
    }
    assert!(s.stats().local > local, "{:?}", s.stats());
}

/// A store that answers more than it grants (a bug, a proxy in the way, a hostile server) gets
/// no more admitted than was asked of it: every answer is held to its order.
#[test]
fn a_store_answering_more_than_asked_is_held_to_the_order() {
    let p = Policy::from_toml(
        "[[scopes]]\nkey = \"tenant\"\nrequests = { limit = 1000, window = \"1m\" }\n\
         concurrency = { limit = 10 }\nbudget = { tokens = 1000, period = \"day\" }\n",
    )
    .unwrap();
    let clock = ManualClock::new(T0);
    let s = forgetful(&clock, true);
    let mut admitted = 0;
    for i in 0..200 {
        if let Decision::Admit(_) = admit(&s, &p, &format!("r{i}"), "u") {
            admitted += 1;
        }
    }
    // Ten slots, and 1000 tokens at 20 each: ten requests in flight at most.
    assert_eq!(admitted, 10, "{:?}", s.stats());
    assert!(s.stats().anomalies > 0);
    let u = s
        .inner()
        .inner
        .usage_sync("tenant|tenant:acme", Some(DAY))
        .unwrap();
    assert!(u.reserved <= 1000 && u.leases <= 10, "{u:?}");
}

/// A shadow rule's slices grow with its use as the enforced ones do: requests with a shadow
/// plan are admitted here, and few of them wait for an exchange.
#[test]
fn shadow_slices_grow_with_their_use() {
    let p = Policy::from_toml(
        r#"
        [[scopes]]
        name = "per-key"
        key = "key"
        requests = { limit = 100000000, window = "1m" }
        concurrency = { limit = 100000, lease_ttl = "1m" }
        budget = { tokens = 1000000000000, period = "day" }
        [[scopes]]
        name = "per-key-trial"
        key = "key"
        mode = "shadow"
        requests = { limit = 50000000, window = "1m" }
        budget = { tokens = 500000000000, period = "day" }
        "#,
    )
    .unwrap();
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let s = instance(&store, &clock, SliceConfig::default());
    for i in 0..1000 {
        let id = format!("r{i}");
        let mut f = facts(&id, "u", 10, 16);
        f.identity = f.identity.with(Dimension::Key, "k1");
        let e = plan(&p, &f).unwrap();
        let mut sh = tollgate_core::shadow_plan(&p, &f).unwrap().unwrap();
        sh.ttl_ms = e.ttl_ms;
        let (d, o) = now(s.admit_shadowed(&e, &sh)).unwrap();
        assert!(matches!(d, Decision::Admit(_)), "{d:?}");
        assert_eq!(o, ShadowOutcome::Held);
        assert!(matches!(
            now(s.settle(&id, used(5))).unwrap(),
            Finish::Done { .. }
        ));
    }
    let st = s.stats();
    assert!(st.local > 950 && st.exchanges < 40, "{st:?}");
}
