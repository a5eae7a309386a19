//! Shadow rules in the store: one step admits a request and evaluates its shadow plan
//! ([`Store::admit_shadowed`]).

use tollgate_core::{
    Decision, Expiry, Finish, ManualClock, Plan, Policy, Reason, ShadowOutcome, Store, StoreError,
    Unit, Usage, plan, shadow_plan,
};

use super::{DAY, budget_of, leases_of, setup, usage};
use crate::{Harness, facts, policy};

/// The request's plan and its shadow's, as the gateway makes them (the shadow's leases live as
/// long as the request's).
fn plans(p: &Policy, id: &str, user: &str, input: u64, output: u64) -> (Plan, Plan) {
    let f = facts(id, user, input, output);
    let enforced = plan(p, &f).unwrap_or_else(|e| panic!("plan: {e}"));
    let mut shadow = shadow_plan(p, &f)
        .unwrap_or_else(|e| panic!("shadow plan: {e}"))
        .unwrap_or_else(|| panic!("no shadow rule applies"));
    shadow.ttl_ms = enforced.ttl_ms;
    (enforced, shadow)
}

/// One admission with its shadow, ended the way the gateway ends it: a shadow admitted apart
/// (a sharded store) is released at once when the request is not admitted. Returns the
/// decision, the shadow's outcome, and the id of a shadow to end with the request, if apart.
async fn admit_both<S: Store>(
    s: &S,
    p: &Policy,
    id: &str,
    input: u64,
    output: u64,
) -> (Decision, ShadowOutcome, Option<String>) {
    let (e, sh) = plans(p, id, "u", input, output);
    let (d, o) = s
        .admit_shadowed(&e, &sh)
        .await
        .unwrap_or_else(|e| panic!("admit_shadowed {id}: {e}"));
    let apart = match &o {
        ShadowOutcome::Apart(sid) if matches!(d, Decision::Admit(_)) => Some(sid.clone()),
        ShadowOutcome::Apart(sid) => {
            let _ = s.release(sid, Some(Usage::default())).await;
            None
        }
        _ => None,
    };
    (d, o, apart)
}

/// Whether the shadow would have admitted and holds its leases and reservations now.
fn held(o: &ShadowOutcome) -> bool {
    matches!(o, ShadowOutcome::Held | ShadowOutcome::Apart(_))
}

fn refused(o: &ShadowOutcome) -> Option<Reason> {
    match o {
        ShadowOutcome::Refused(d) => Some(d.reason),
        _ => None,
    }
}

async fn settle_both<S: Store>(s: &S, id: &str, apart: Option<&str>, u: Usage) -> Finish {
    let f = s
        .settle(id, u)
        .await
        .unwrap_or_else(|e| panic!("settle {id}: {e}"));
    if let Some(a) = apart {
        let _ = s.settle(a, u).await;
    }
    f
}

const TRIAL: &str = "trial|tenant:acme/user:u";
const OWN: &str = "own|tenant:acme/user:u";

fn trial_policy() -> Policy {
    policy(
        r#"
        reservation_ttl = "30s"
        [[scopes]]
        name = "own"
        key = "user"
        concurrency = { limit = 10, lease_ttl = "30s" }
        budget = { tokens = 1000, period = "day" }
        [[scopes]]
        name = "trial"
        key = "user"
        mode = "shadow"
        requests = { limit = 4, window = "1m" }
        concurrency = { limit = 1, lease_ttl = "30s" }
        budget = { tokens = 150, period = "day" }
        "#,
    )
}

/// A shadow rule's checks are made and its holds taken with the request's; they end with it,
/// and its charges are not the request's. It never changes the decision.
pub async fn shadow_holds_end_with_the_request<H: Harness>(h: &H) {
    let p = trial_policy();
    let (s, clock) = setup(h).await;
    // a: both admit; the shadow holds a lease and 100 tokens.
    let (d, o, a_apart) = admit_both(&s, &p, "a", 50, 50).await;
    assert!(matches!(d, Decision::Admit(_)), "{d:?}");
    assert!(held(&o), "{o:?}");
    assert_eq!(leases_of(&s, TRIAL).await, 1);
    assert_eq!(budget_of(&s, TRIAL, DAY).await, (0, 100));
    assert_eq!(budget_of(&s, OWN, DAY).await, (0, 100));
    // b: the shadow's one lease is held, so it would refuse; the request is admitted and its
    // shadow holds nothing.
    let (d, o, _) = admit_both(&s, &p, "b", 10, 10).await;
    assert!(matches!(d, Decision::Admit(_)), "{d:?}");
    assert_eq!(refused(&o), Some(Reason::ConcurrencyLimit));
    assert_eq!(budget_of(&s, TRIAL, DAY).await, (0, 100));
    assert_eq!(budget_of(&s, OWN, DAY).await, (0, 120));
    // a settles: the shadow's lease and reservation end with it, charged the same usage, and
    // the settlement reports the request's own charge alone.
    let f = settle_both(&s, "a", a_apart.as_deref(), usage(30, 20)).await;
    assert_eq!(f, Finish::Done { charged: vec![50] });
    assert_eq!(leases_of(&s, TRIAL).await, 0);
    assert_eq!(budget_of(&s, TRIAL, DAY).await, (50, 0));
    assert_eq!(budget_of(&s, OWN, DAY).await, (50, 20));
    assert_eq!(
        settle_both(&s, "b", None, usage(5, 5)).await,
        Finish::Done { charged: vec![10] }
    );
    // c: a request the shadow's budget (100 left) would refuse.
    let (d, o, _) = admit_both(&s, &p, "c", 60, 60).await;
    assert!(matches!(d, Decision::Admit(_)), "{d:?}");
    assert_eq!(refused(&o), Some(Reason::BudgetLimit));
    let _ = settle_both(&s, "c", None, usage(1, 1)).await;
    // The shadow's rate has counted a, b and c: the fifth attempt would be refused; the fourth
    // is held until it expires, and its expiry charges the shadow as the request.
    let (d, o, _) = admit_both(&s, &p, "d", 10, 10).await;
    assert!(matches!(d, Decision::Admit(_)), "{d:?}");
    assert!(held(&o), "{o:?}");
    let (d, o, _) = admit_both(&s, &p, "e", 1, 1).await;
    assert!(matches!(d, Decision::Admit(_)), "{d:?}");
    assert_eq!(refused(&o), Some(Reason::RequestRateLimit));
    let _ = settle_both(&s, "e", None, usage(1, 1)).await;
    let own_before = budget_of(&s, OWN, DAY).await.0;
    clock.advance(30_000);
    // Any call sweeps; a sharded store's shadow admitted apart expires on its own.
    let _ = s.usage(TRIAL, Some(DAY)).await;
    let _ = s.usage(OWN, Some(DAY)).await;
    let own_after = budget_of(&s, OWN, DAY).await.0;
    assert_eq!(own_after - own_before, 20, "the request's expiry charge");
    assert_eq!(budget_of(&s, TRIAL, DAY).await, (50 + 20, 0));
    assert_eq!(leases_of(&s, TRIAL).await, 0);
}

/// A request that is refused or killed holds nothing under its shadow rules, though their
/// attempts count; a known id counts nowhere.
pub async fn a_refused_request_holds_no_shadow<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        name = "own"
        key = "user"
        budget = { tokens = 100, period = "day" }
        [[scopes]]
        name = "trial"
        key = "user"
        mode = "shadow"
        requests = { limit = 4, window = "1m" }
        concurrency = { limit = 1 }
        budget = { tokens = 1000, period = "day" }
        "#,
    );
    let (s, _clock) = setup(h).await;
    // Over the request's own budget: refused; its shadow would have admitted.
    let (d, o, _) = admit_both(&s, &p, "big", 60, 60).await;
    assert_eq!(d.deny().map(|d| d.reason), Some(Reason::BudgetLimit));
    assert!(
        matches!(o, ShadowOutcome::Passed | ShadowOutcome::Apart(_)),
        "{o:?}"
    );
    assert_eq!(leases_of(&s, TRIAL).await, 0);
    assert_eq!(budget_of(&s, TRIAL, DAY).await, (0, 0));
    // Killed: nothing is counted for the request, but its shadow's attempt is.
    s.set_kill("tenant:acme", Some("incident"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (d, o, _) = admit_both(&s, &p, "killed", 1, 1).await;
    assert!(matches!(d, Decision::Killed(_)), "{d:?}");
    assert!(
        matches!(o, ShadowOutcome::Passed | ShadowOutcome::Apart(_)),
        "{o:?}"
    );
    s.set_kill("tenant:acme", None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(budget_of(&s, TRIAL, DAY).await, (0, 0));
    // An admitted id again: a duplicate, counted nowhere.
    let (d, o, _) = admit_both(&s, &p, "ok", 1, 1).await;
    assert!(matches!(d, Decision::Admit(_)) && held(&o), "{d:?} {o:?}");
    let (e, sh) = plans(&p, "ok", "u", 1, 1);
    assert!(matches!(
        s.admit_shadowed(&e, &sh).await,
        Err(StoreError::DuplicateRequestId(_))
    ));
    // Attempts so far: big, killed, ok (the duplicate not counted): the fourth passes the
    // shadow's rate, the fifth does not.
    let (_, o, _) = admit_both(&s, &p, "fourth", 1, 1).await;
    assert_eq!(refused(&o), Some(Reason::ConcurrencyLimit), "{o:?}");
    let (_, o, _) = admit_both(&s, &p, "fifth", 1, 1).await;
    assert_eq!(refused(&o), Some(Reason::RequestRateLimit), "{o:?}");
}

/// A shadow rule's reservation, held by its request's ticket, is charged when the ticket
/// expires, but is no spend: the expiry kept for a ledger holds the request's own charge alone.
/// For a store `s` on `clock` that keeps expiries; `expiries` sweeps it and reads them. (Not in
/// the suite: keeping expiries is each store's own API.)
pub async fn a_shadow_reservation_is_no_expiry_charge<S: Store>(
    s: &S,
    clock: &ManualClock,
    expiries: impl AsyncFnOnce() -> Vec<Expiry>,
) {
    let p = policy(
        r#"
        [[scopes]]
        name = "own"
        key = "user"
        concurrency = { limit = 5, lease_ttl = "1s" }
        budget = { tokens = 1000, period = "day" }
        [[scopes]]
        name = "trial"
        key = "user"
        mode = "shadow"
        budget = { tokens = 500, period = "day" }
        "#,
    );
    let (e, sh) = plans(&p, "gone", "u", 10, 20);
    let (_, o) = s
        .admit_shadowed(&e, &sh)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(o, ShadowOutcome::Held);
    clock.advance(1500);
    let kept = expiries().await;
    assert_eq!(budget_of(s, TRIAL, DAY).await, (30, 0));
    assert_eq!(budget_of(s, OWN, DAY).await, (30, 0));
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].request_id, "gone");
    let charges: Vec<_> = kept[0]
        .charges
        .iter()
        .map(|c| (c.scope.as_str(), c.unit, c.amount))
        .collect();
    assert_eq!(charges, vec![(OWN, Unit::Tokens, 30)]);
}
