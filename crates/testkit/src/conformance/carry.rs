//! The conformance cases of carry-over: what a period leaves unused of its budget is added to
//! the next period's, up to the rule's cap, and only from the period just before.

use tollgate_core::{Clock, Reason, Store};

use super::{deny, reason, setup, usage};
use crate::{Harness, facts, policy};

const HOUR: u64 = 3_600_000;
const SCOPE: &str = "user|tenant:acme/user:u";

const CARRY: &str = r#"
[[scopes]]
key = "user"
budget = { tokens = 100, period = "1h", carry_over = "50%" }
"#;

async fn settle<S: Store>(s: &S, id: &str, input: u64, output: u64) {
    s.settle(id, usage(input, output))
        .await
        .unwrap_or_else(|e| panic!("settle: {e}"));
}

/// 70 used of 100: the next hour has 130. 120 used of those: the hour after has 110.
pub async fn unused_budget_carries_over_to_the_next_period<H: Harness>(h: &H) {
    let p = policy(CARRY);
    let (s, clock) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u", 35, 35)).await, None);
    settle(&s, "a", 35, 35).await;
    clock.advance(HOUR);
    assert_eq!(reason(&s, &p, facts("b", "u", 60, 60)).await, None);
    let d = deny(&s, &p, facts("c", "u", 6, 5)).await;
    assert_eq!((d.reason, d.remaining), (Reason::BudgetLimit, 10));
    let period = p.scopes[0].budget.map(|b| b.period);
    let u = s
        .usage("user|tenant:acme/user:u", period)
        .await
        .unwrap_or_else(|e| panic!("usage: {e}"));
    assert_eq!((u.carried, u.reserved), (30, 120));
    settle(&s, "b", 60, 60).await;
    clock.advance(HOUR);
    assert_eq!(reason(&s, &p, facts("d", "u", 55, 55)).await, None);
    let d = deny(&s, &p, facts("e", "u", 1, 0)).await;
    assert_eq!((d.reason, d.remaining), (Reason::BudgetLimit, 0));
}

/// 10 used of 100: 90 unused, 50 carried (the cap). An hour with no request carries nothing
/// into the one after it, and without `carry_over` nothing is carried.
pub async fn a_carry_is_capped_and_only_from_the_period_before<H: Harness>(h: &H) {
    let p = policy(CARRY);
    let (s, clock) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u", 5, 5)).await, None);
    settle(&s, "a", 5, 5).await;
    clock.advance(HOUR);
    assert_eq!(reason(&s, &p, facts("b", "u", 75, 75)).await, None);
    let d = deny(&s, &p, facts("c", "u", 1, 0)).await;
    assert_eq!((d.reason, d.remaining), (Reason::BudgetLimit, 0));
    clock.advance(2 * HOUR);
    let d = deny(&s, &p, facts("d", "u", 51, 50)).await;
    assert_eq!((d.reason, d.remaining), (Reason::BudgetLimit, 100));
    let plain = policy(&CARRY.replace(", carry_over = \"50%\"", ""));
    assert_eq!(reason(&s, &plain, facts("e", "v", 5, 5)).await, None);
    settle(&s, "e", 5, 5).await;
    clock.advance(HOUR);
    let d = deny(&s, &plain, facts("f", "v", 51, 50)).await;
    assert_eq!((d.reason, d.remaining), (Reason::BudgetLimit, 100));
}

/// What a period will carry over is read before any admission starts it: the usage of a
/// budget that carries over shows the carry its first admission will count (with the store's
/// time of the reading), and after an idle period, nothing.
pub async fn a_carry_is_read_before_the_period_starts<H: Harness>(h: &H) {
    let p = policy(CARRY);
    let (s, clock) = setup(h).await;
    let b = p.scopes[0].budget.unwrap_or_else(|| panic!("a budget"));
    assert_eq!(reason(&s, &p, facts("a", "u", 35, 35)).await, None);
    settle(&s, "a", 35, 35).await;
    assert_eq!(
        read(&s, b).await.carried,
        0,
        "this period carries nothing in"
    );
    clock.advance(HOUR);
    let u = read(&s, b).await;
    assert_eq!((u.carried, u.settled, u.reserved), (30, 0, 0));
    assert_eq!(u.at_ms, clock.now());
    // The first admission counts what the reading said.
    let d = deny(&s, &p, facts("b", "u", 66, 65)).await;
    assert_eq!((d.reason, d.remaining), (Reason::BudgetLimit, 130));
    clock.advance(2 * HOUR);
    assert_eq!(
        read(&s, b).await.carried,
        0,
        "after an idle period, nothing"
    );
}

async fn read<S: Store>(s: &S, b: tollgate_core::policy::BudgetLimit) -> tollgate_core::ScopeUsage {
    s.usage_carrying(SCOPE, b.period, (b.carry_cap, 100))
        .await
        .unwrap_or_else(|e| panic!("usage: {e}"))
}
