//! The conformance cases of a plan as an ordered list of checks: a store knows the checks'
//! kinds, never their controls. It counts every count first, walks the checks in the plan's
//! order to the first refusal, and names that check's reason, whatever the reason is; so a
//! control of a known kind needs no store of its own.

use tollgate_core::pipeline::{Check, Kind};
use tollgate_core::{Decision, Deny, Dimension, Plan, Reason, Store};

use super::{DAY, plan_of, setup};
use crate::{Harness, facts, policy};

const POLICY: &str = r#"
[[scopes]]
key = "user"
requests = { limit = 1, window = "1m" }
concurrency = { limit = 1 }
budget = { tokens = 1000, period = "day" }
"#;

/// The plan of request `id` by `user`, its checks rearranged by `f`.
fn rearranged(id: &str, user: &str, f: impl FnOnce(Vec<Check>) -> Vec<Check>) -> Plan {
    let mut p = plan_of(&policy(POLICY), &facts(id, user, 10, 10));
    p.checks = f(std::mem::take(&mut p.checks));
    p
}

fn of_kind(checks: &[Check], kind: fn(&Kind) -> bool) -> Check {
    checks
        .iter()
        .find(|c| kind(&c.kind))
        .cloned()
        .unwrap_or_else(|| panic!("no such check in {checks:?}"))
}

fn count(k: &Kind) -> bool {
    matches!(k, Kind::Count(_))
}

fn lease(k: &Kind) -> bool {
    matches!(k, Kind::Lease(_))
}

fn refusal(d: Decision) -> Deny {
    match d {
        Decision::Deny(d) => d,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Checks are walked in the plan's order, not the controls': a full lease set placed before an
/// over-limit count refuses first. And the refusal is the check's reason as the plan gives it.
pub async fn checks_are_walked_in_the_plans_order<H: Harness>(h: &H) {
    let (s, _) = setup(h).await;
    let first = plan_of(&policy(POLICY), &facts("a", "u", 10, 10));
    assert!(matches!(s.admit(&first).await, Ok(Decision::Admit(_))));
    // The second attempt is over the rate, and the one lease is held: the lease comes first.
    let b = rearranged("b", "u", |c| vec![of_kind(&c, lease), of_kind(&c, count)]);
    let d = refusal(s.admit(&b).await.unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(d.reason, Reason::ConcurrencyLimit);
    // The same count under another reason refuses with that reason.
    let c = rearranged("c", "u", |c| {
        let mut n = of_kind(&c, count);
        n.reason = Reason::LoopDetected;
        vec![n]
    });
    let d = refusal(s.admit(&c).await.unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(
        (d.reason, d.limit, d.requested),
        (Reason::LoopDetected, 1, 1)
    );
}

/// A verdict refuses at its place, and every count is counted first all the same: the next
/// attempt finds the count over its limit.
pub async fn a_verdict_refuses_at_its_place_after_every_count<H: Harness>(h: &H) {
    let (s, _) = setup(h).await;
    let base = plan_of(&policy(POLICY), &facts("v0", "v", 10, 10));
    let scope = of_kind(&base.checks, count)
        .scope()
        .cloned()
        .unwrap_or_else(|| panic!("a count has a scope"));
    let verdict = Deny {
        reason: Reason::InputTokenLimit,
        scope,
        limit: 5,
        remaining: 5,
        requested: 10,
        retry_after_ms: None,
        reset_after_ms: None,
    };
    let v = Check {
        reason: verdict.reason,
        kind: Kind::Verdict(verdict.clone()),
    };
    let p = rearranged("v1", "v", |c| {
        let mut out = vec![v];
        out.extend(c);
        out
    });
    let d = refusal(s.admit(&p).await.unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(d, verdict);
    // Nothing was held, and the attempt was counted: the rate refuses the next one.
    let next = plan_of(&policy(POLICY), &facts("v2", "v", 10, 10));
    let d = refusal(s.admit(&next).await.unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(d.reason, Reason::RequestRateLimit);
}

/// A request whose estimate costs more than its cost cap is refused with what it would cost,
/// before anything is held: its attempt is counted, its budget keeps nothing, and a cheaper
/// request of the same caller is admitted. A model without a price cannot be checked.
pub async fn a_request_over_its_cost_cap_is_refused_before_anything_is_held<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [prices."gpt-4o"]
        input = 2500000
        output = 10000000
        [[scopes]]
        key = "user"
        requests = { limit = 2, window = "1m" }
        request_cost = "$0.01"
        budget = { micro_usd = 1000000, period = "day" }
        "#,
    );
    let (s, _) = setup(h).await;
    // 1000 in x 2.5 + 1000 out x 10 = 12,500 micro-USD, over the cap of 10,000.
    let d = refusal(
        s.admit(&plan_of(&p, &facts("big", "u", 1000, 1000)))
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    assert_eq!(
        (
            d.reason,
            d.scope.key(),
            d.limit,
            d.requested,
            d.retry_after_ms
        ),
        (
            Reason::RequestCostLimit,
            "tenant:acme/user:u",
            10_000,
            12_500,
            None
        )
    );
    assert_eq!(
        super::budget_of(&s, "user|tenant:acme/user:u", DAY).await,
        (0, 0)
    );
    // 400 x 2.5 + 400 x 10 = 5,000: admitted, and it is the second attempt of the window.
    let ok = s.admit(&plan_of(&p, &facts("small", "u", 400, 400))).await;
    assert!(matches!(ok, Ok(Decision::Admit(_))), "{ok:?}");
    assert_eq!(
        super::budget_of(&s, "user|tenant:acme/user:u", DAY).await,
        (0, 5_000)
    );
    let third = s.admit(&plan_of(&p, &facts("third", "u", 1, 1))).await;
    let d = refusal(third.unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(d.reason, Reason::RequestRateLimit);
    let mut unpriced = facts("o1", "w", 1, 1);
    unpriced.identity = unpriced.identity.with(Dimension::Model, "house-model");
    assert!(tollgate_core::plan(&p, &unpriced).is_err());
}

/// A read of a rate window (`Kind::Peek`) counts nothing and never refuses: it reports what the
/// window has left, the same before and after, and over the limit reads 0 left and the reset.
pub async fn a_peek_reads_a_window_without_counting<H: Harness>(h: &H) {
    let (s, _) = setup(h).await;
    let counted = |id: &str| {
        rearranged(id, "p", |c| {
            let mut n = of_kind(&c, count);
            if let Kind::Count(r) = &mut n.kind {
                r.limit = 3;
            }
            vec![n]
        })
    };
    let peek = |id: &str| counted(id).peeking();
    let left = |d: Decision| match d {
        Decision::Admit(a) => {
            let q = a
                .quotas
                .first()
                .cloned()
                .unwrap_or_else(|| panic!("no quota"));
            (
                q.remaining,
                q.reset_after_ms.is_some_and(|r| r > 0 && r <= 60_000),
            )
        }
        other => panic!("a peek is admitted, got {other:?}"),
    };
    let ask = |p: Plan| {
        let s = &s;
        async move { s.admit(&p).await.unwrap_or_else(|e| panic!("{e}")) }
    };
    assert_eq!(
        left(ask(peek("p0")).await),
        (3, true),
        "nothing counted yet"
    );
    assert!(matches!(ask(counted("c1")).await, Decision::Admit(_)));
    for id in ["p1", "p2"] {
        assert_eq!(
            left(ask(peek(id)).await),
            (2, true),
            "a peek counts nothing"
        );
    }
    for id in ["c2", "c3"] {
        assert!(matches!(ask(counted(id)).await, Decision::Admit(_)));
    }
    assert_eq!(
        refusal(ask(counted("c4")).await).reason,
        Reason::RequestRateLimit
    );
    assert_eq!(
        left(ask(peek("p3")).await),
        (0, true),
        "over: a peek still answers"
    );
}
