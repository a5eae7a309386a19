//! The conformance cases. Each starts from a clean store at [`T0`].
//!
//! This file is over 600 lines: one function per case, in the order the suite runs them, so
//! that every store is held to one list.

use tollgate_core::policy::Unit;
use tollgate_core::{
    Decision, Deny, Ending, Finish, ManualClock, Period, Plan, Policy, Reason, Renewal,
    RequestFacts, Store, Usage, plan,
};

use crate::{Harness, T0, facts, policy};

mod agents;
pub use agents::*;
mod checks;
pub use checks::*;
mod calendar;
pub use calendar::*;
mod carry;
pub use carry::*;
mod classes;
pub use classes::*;
mod fees;
pub use fees::*;
mod holds;
pub use holds::*;
mod keeping;
pub use keeping::*;
mod shadow;
pub use shadow::*;
pub mod slices;
pub use slices::SliceHarness;

// A case module is registered here twice, by its `mod` line above and by its cases in the list
// below, so that a new case file touches this file only.
/// Expands to one `#[tokio::test]` per conformance case, each with a fresh harness from `$make`.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@cases $make;
            each_control_alone, reasons_follow_the_fixed_order, every_attempt_counts,
            all_or_nothing_across_scopes, settle_replaces_the_reservation,
            settle_is_idempotent, release_charges_partial_or_policy_usage,
            leases_expire_and_renew, expiry_holds_when_many_expire_at_once,
            expired_reservation_charge_follows_policy,
            period_rollover, clock_going_backwards, duplicate_request_id_is_refused,
            money_budget, retry_hints, calendar_month_budget, kill_switch,
            quotas_name_their_checks, tool_calls_are_reserved_and_settled,
            tool_calls_come_after_the_budget, repeats_are_refused_last,
            a_history_of_repeated_tool_calls_is_a_loop, idempotency_keys_are_claimed_once,
            shadow_holds_end_with_the_request, a_refused_request_holds_no_shadow,
            checks_are_walked_in_the_plans_order,
            a_verdict_refuses_at_its_place_after_every_count,
            a_peek_reads_a_window_without_counting,
            a_request_over_its_cost_cap_is_refused_before_anything_is_held,
            a_reserve_keeps_its_share_for_its_class,
            a_calendar_day_resets_at_its_local_time_across_dst,
            a_clock_stepping_back_does_not_reopen_a_calendar_period,
            unused_budget_carries_over_to_the_next_period,
            a_carry_is_capped_and_only_from_the_period_before,
            a_carry_is_read_before_the_period_starts,
            a_provider_hold_refuses_its_model_until_it_ends,
            a_providers_token_hold_refuses_only_larger_requests,
            fees_are_reserved_settled_and_charged_on_expiry,
            an_unpriced_fee_is_refused_under_a_money_budget,
            a_restored_total_counts_against_its_budget, an_initialised_store_reads_as_kept,
            a_kept_text_reads_back_where_the_store_is_shared);
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $case() {
                let h = $make;
                $crate::conformance::$case(&h).await;
            }
        )*
    };
}

async fn setup<H: Harness>(h: &H) -> (H::S, ManualClock) {
    let clock = ManualClock::new(T0);
    (h.store(clock.clone()).await, clock)
}

fn plan_of(p: &Policy, f: &RequestFacts) -> Plan {
    plan(p, f).unwrap_or_else(|e| panic!("plan: {e}"))
}

async fn admit<S: Store>(s: &S, p: &Policy, f: RequestFacts) -> Decision {
    s.admit(&plan_of(p, &f))
        .await
        .unwrap_or_else(|e| panic!("admit: {e}"))
}

async fn reason<S: Store>(s: &S, p: &Policy, f: RequestFacts) -> Option<Reason> {
    admit(s, p, f).await.deny().map(|d| d.reason)
}

async fn deny<S: Store>(s: &S, p: &Policy, f: RequestFacts) -> Deny {
    match admit(s, p, f).await {
        Decision::Deny(d) => d,
        other => panic!("expected a denial, got {other:?}"),
    }
}

fn usage(input: u64, output: u64) -> Usage {
    Usage {
        input_tokens: input,
        cached_input_tokens: 0,
        output_tokens: output,
        ..Usage::default()
    }
}

async fn settle<S: Store>(s: &S, id: &str, u: Usage) -> Finish {
    s.settle(id, u)
        .await
        .unwrap_or_else(|e| panic!("settle: {e}"))
}

async fn budget_of<S: Store>(s: &S, scope: &str, period: Period) -> (u64, u64) {
    let u = s
        .usage(scope, Some(period))
        .await
        .unwrap_or_else(|e| panic!("usage: {e}"));
    (u.settled, u.reserved)
}

async fn leases_of<S: Store>(s: &S, scope: &str) -> u64 {
    s.usage(scope, None)
        .await
        .unwrap_or_else(|e| panic!("usage: {e}"))
        .leases
}

const DAY: Period = Period::Fixed(86_400_000);

/// Each of the six controls alone refuses what it should and nothing else.
pub async fn each_control_alone<H: Harness>(h: &H) {
    let cases: [(&str, Reason); 6] = [
        (
            "requests = { limit = 2, window = \"1m\" }",
            Reason::RequestRateLimit,
        ),
        ("input_tokens = 100", Reason::InputTokenLimit),
        ("output_tokens = { max = 100 }", Reason::OutputTokenLimit),
        ("total_tokens = 150", Reason::TotalTokenLimit),
        ("concurrency = { limit = 2 }", Reason::ConcurrencyLimit),
        (
            "budget = { tokens = 300, period = \"day\" }",
            Reason::BudgetLimit,
        ),
    ];
    for (control, expected) in cases {
        let p = policy(&format!("[[scopes]]\nkey = \"user\"\n{control}\n"));
        let (s, _) = setup(h).await;
        // Two small requests pass every control.
        for i in 0..2 {
            assert_eq!(
                reason(&s, &p, facts(&format!("ok{i}"), "u", 50, 50)).await,
                None,
                "{control}"
            );
        }
        // The third request is refused by exactly this control: it is big in tokens (101 in,
        // 101 out) only for the token controls, third for rate and concurrency, and over the
        // remaining 100 of the budget.
        let f = match expected {
            Reason::InputTokenLimit => facts("x", "u", 101, 10),
            Reason::OutputTokenLimit => facts("x", "u", 10, 101),
            Reason::TotalTokenLimit => facts("x", "u", 80, 80),
            Reason::BudgetLimit => facts("x", "u", 51, 50),
            _ => facts("x", "u", 1, 1),
        };
        let d = deny(&s, &p, f).await;
        assert_eq!(d.reason, expected, "{control}");
        assert_eq!(d.scope.key(), "tenant:acme/user:u");
        // Another subject is unaffected.
        assert_eq!(
            reason(&s, &p, facts("other", "v", 50, 50)).await,
            None,
            "{control}"
        );
    }
}

/// A request failing several controls reports the first in the fixed order.
pub async fn reasons_follow_the_fixed_order<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 3, window = "1m" }
        input_tokens = 100
        output_tokens = { max = 100 }
        total_tokens = 150
        concurrency = { limit = 1 }
        budget = { tokens = 120, period = "day" }
        "#,
    );
    let (s, _) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u", 50, 50)).await, None);
    // Over input, output and total: input is reported.
    assert_eq!(
        reason(&s, &p, facts("b", "u", 500, 500)).await,
        Some(Reason::InputTokenLimit)
    );
    // Concurrency full and budget short: concurrency is reported.
    assert_eq!(
        reason(&s, &p, facts("c", "u", 50, 50)).await,
        Some(Reason::ConcurrencyLimit)
    );
    // Fourth attempt: the rate is reported ahead of everything else.
    assert_eq!(
        reason(&s, &p, facts("d", "u", 500, 500)).await,
        Some(Reason::RequestRateLimit)
    );
}

/// Attempts refused by later controls still count against the rate.
pub async fn every_attempt_counts<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 3, window = "1m" }
        input_tokens = 10
        "#,
    );
    let (s, _) = setup(h).await;
    for i in 0..3 {
        let r = reason(&s, &p, facts(&format!("big{i}"), "u", 1_000_000, 1)).await;
        assert_eq!(r, Some(Reason::InputTokenLimit));
    }
    // A small request now meets a spent rate: the refused attempts counted, once each.
    let d = deny(&s, &p, facts("small", "u", 1, 1)).await;
    assert_eq!(d.reason, Reason::RequestRateLimit);
}

/// A request that fails in one scope holds nothing in any other.
pub async fn all_or_nothing_across_scopes<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        concurrency = { limit = 10 }
        budget = { tokens = 1000, period = "day" }
        [[scopes]]
        key = "tenant"
        concurrency = { limit = 10 }
        budget = { tokens = 150, period = "day" }
        "#,
    );
    let (s, _) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u1", 50, 50)).await, None);
    let d = deny(&s, &p, facts("b", "u2", 50, 50)).await;
    assert_eq!(
        (d.reason, d.scope.key()),
        (Reason::BudgetLimit, "tenant:acme")
    );
    assert_eq!(d.remaining, 50);
    // u2's own scope got neither a lease nor a reservation.
    assert_eq!(budget_of(&s, "user|tenant:acme/user:u2", DAY).await, (0, 0));
    assert_eq!(leases_of(&s, "user|tenant:acme/user:u2").await, 0);
    assert_eq!(leases_of(&s, "tenant|tenant:acme").await, 1);

    // The same when a concurrency scope is the one that is full.
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        concurrency = { limit = 10 }
        budget = { tokens = 1000, period = "day" }
        [[scopes]]
        key = "tenant"
        concurrency = { limit = 1 }
        "#,
    );
    let (s, _) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u1", 5, 5)).await, None);
    assert_eq!(
        reason(&s, &p, facts("b", "u2", 5, 5)).await,
        Some(Reason::ConcurrencyLimit)
    );
    assert_eq!(leases_of(&s, "user|tenant:acme/user:u2").await, 0);
    assert_eq!(budget_of(&s, "user|tenant:acme/user:u2", DAY).await, (0, 0));
}

const BUDGET_300: &str = r#"
    [[scopes]]
    key = "user"
    concurrency = { limit = 5, lease_ttl = "10s" }
    budget = { tokens = 300, period = "day" }
"#;

/// Settlement replaces the estimate with input + actual output and frees the rest.
pub async fn settle_replaces_the_reservation<H: Harness>(h: &H) {
    let p = policy(BUDGET_300);
    let (s, _) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u", 50, 150)).await, None);
    assert_eq!(
        budget_of(&s, "user|tenant:acme/user:u", DAY).await,
        (0, 200)
    );
    assert_eq!(
        reason(&s, &p, facts("b", "u", 50, 100)).await,
        Some(Reason::BudgetLimit)
    );
    assert_eq!(
        settle(&s, "a", usage(50, 20)).await,
        Finish::Done { charged: vec![70] }
    );
    assert_eq!(budget_of(&s, "user|tenant:acme/user:u", DAY).await, (70, 0));
    assert_eq!(leases_of(&s, "user|tenant:acme/user:u").await, 0);
    // The released 130 is available again.
    assert_eq!(reason(&s, &p, facts("c", "u", 50, 100)).await, None);
}

/// A duplicate or late settlement changes nothing and says so.
pub async fn settle_is_idempotent<H: Harness>(h: &H) {
    let p = policy(BUDGET_300);
    let (s, _) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u", 10, 10)).await, None);
    assert!(matches!(
        settle(&s, "a", usage(10, 5)).await,
        Finish::Done { .. }
    ));
    assert_eq!(
        settle(&s, "a", usage(10, 10)).await,
        Finish::AlreadyEnded(Ending::Settled)
    );
    let r = s.release("a", None).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r, Finish::AlreadyEnded(Ending::Settled));
    assert_eq!(budget_of(&s, "user|tenant:acme/user:u", DAY).await, (15, 0));
    assert_eq!(settle(&s, "never", usage(1, 1)).await, Finish::Unknown);
    let renew = s.renew("a").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(renew, Renewal::NotInFlight);
}

/// Release charges the usage known, or what the policy says when none is.
pub async fn release_charges_partial_or_policy_usage<H: Harness>(h: &H) {
    let p = policy(BUDGET_300);
    let (s, _) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u", 10, 90)).await, None);
    assert_eq!(reason(&s, &p, facts("b", "u", 10, 90)).await, None);
    let r = s
        .release("a", Some(usage(10, 7)))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r, Finish::Done { charged: vec![17] });
    // No usage known: the default policy charges the full reservation.
    let r = s.release("b", None).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r, Finish::Done { charged: vec![100] });
    assert_eq!(
        budget_of(&s, "user|tenant:acme/user:u", DAY).await,
        (117, 0)
    );
    assert_eq!(leases_of(&s, "user|tenant:acme/user:u").await, 0);
}

/// A lease not renewed expires and its slot comes back; renewal keeps it.
pub async fn leases_expire_and_renew<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        concurrency = { limit = 1, lease_ttl = "10s" }
        budget = { tokens = 1000, period = "day" }
        "#,
    );
    let (s, clock) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u", 10, 10)).await, None);
    clock.advance(9_000);
    let r = s.renew("a").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        r,
        Renewal::Renewed {
            expires_at: T0 + 19_000
        }
    );
    clock.advance(9_000);
    assert_eq!(
        reason(&s, &p, facts("b", "u", 10, 10)).await,
        Some(Reason::ConcurrencyLimit)
    );
    clock.advance(1_000);
    // 19 s after admission, 10 s after renewal: expired, slot back, reservation charged in full.
    assert_eq!(reason(&s, &p, facts("c", "u", 10, 10)).await, None);
    assert_eq!(
        settle(&s, "a", usage(10, 1)).await,
        Finish::AlreadyEnded(Ending::Expired)
    );
    assert_eq!(
        budget_of(&s, "user|tenant:acme/user:u", DAY).await,
        (20, 20)
    );
}

/// Expired leases free their slots, and an expired request cannot be renewed back to life, even
/// when more requests expire together than one call of a store may sweep (the Redis store
/// sweeps 16 per call, so some expired tickets wait for later calls).
pub async fn expiry_holds_when_many_expire_at_once<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        concurrency = { limit = 17, lease_ttl = "10s" }
        budget = { tokens = 100000, period = "day" }
        "#,
    );
    let (s, clock) = setup(h).await;
    for i in 0..17 {
        let id = format!("a{i:02}");
        assert_eq!(reason(&s, &p, facts(&id, "u1", 10, 10)).await, None, "{id}");
    }
    clock.advance(1_000);
    for i in 0..17 {
        let id = format!("b{i:02}");
        assert_eq!(reason(&s, &p, facts(&id, "u2", 10, 10)).await, None, "{id}");
    }
    assert_eq!(
        reason(&s, &p, facts("full", "u2", 10, 10)).await,
        Some(Reason::ConcurrencyLimit)
    );
    // Every lease above has expired: u2's slots are back at once.
    clock.advance(10_500);
    assert_eq!(reason(&s, &p, facts("c", "u2", 10, 10)).await, None);
    let r = s.renew("b16").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r, Renewal::NotInFlight, "renewed after it expired");
    assert_eq!(
        settle(&s, "b16", usage(10, 1)).await,
        Finish::AlreadyEnded(Ending::Expired)
    );
    // 16 more can start next to "c": nothing that expired holds a slot.
    for i in 0..16 {
        let id = format!("d{i:02}");
        assert_eq!(reason(&s, &p, facts(&id, "u2", 10, 10)).await, None, "{id}");
    }
    assert_eq!(
        reason(&s, &p, facts("e", "u2", 10, 10)).await,
        Some(Reason::ConcurrencyLimit)
    );
    assert_eq!(leases_of(&s, "user|tenant:acme/user:u2").await, 17);
}

/// What an expired reservation costs is the policy's choice.
pub async fn expired_reservation_charge_follows_policy<H: Harness>(h: &H) {
    for (charge, expected) in [("full", 110), ("input", 10), ("none", 0)] {
        let p = policy(&format!(
            "expired_reservation_charge = \"{charge}\"\nreservation_ttl = \"30s\"\n\
             [[scopes]]\nkey = \"user\"\nbudget = {{ tokens = 1000, period = \"day\" }}\n"
        ));
        let (s, clock) = setup(h).await;
        assert_eq!(reason(&s, &p, facts("a", "u", 10, 100)).await, None);
        clock.advance(30_000);
        // Any call sweeps; the admission of another request triggers it.
        assert_eq!(reason(&s, &p, facts("b", "v", 1, 1)).await, None);
        assert_eq!(
            budget_of(&s, "user|tenant:acme/user:u", DAY).await,
            (expected, 0),
            "{charge}"
        );
    }
}

/// A new period starts empty; a reservation settles into the period it was made in.
pub async fn period_rollover<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        budget = { tokens = 100, period = "1h" }
        "#,
    );
    let hour = Period::Fixed(3_600_000);
    let (s, clock) = setup(h).await;
    clock.advance(3_500_000);
    assert_eq!(reason(&s, &p, facts("a", "u", 50, 50)).await, None);
    assert_eq!(
        reason(&s, &p, facts("b", "u", 1, 1)).await,
        Some(Reason::BudgetLimit)
    );
    clock.advance(200_000);
    assert_eq!(reason(&s, &p, facts("c", "u", 50, 40)).await, None);
    assert_eq!(
        settle(&s, "a", usage(50, 10)).await,
        Finish::Done { charged: vec![60] }
    );
    // The new hour holds only c's reservation.
    assert_eq!(
        budget_of(&s, "user|tenant:acme/user:u", hour).await,
        (0, 90)
    );
}

/// A clock that goes backwards neither reopens windows nor refunds budgets.
pub async fn clock_going_backwards<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 2, window = "1m" }
        [[scopes]]
        key = "tenant"
        concurrency = { limit = 5, lease_ttl = "10s" }
        budget = { tokens = 100, period = "1h" }
        "#,
    );
    let (s, clock) = setup(h).await;
    clock.advance(3_600_000 + 30_000);
    assert_eq!(reason(&s, &p, facts("a", "u", 50, 50)).await, None);
    assert_eq!(
        reason(&s, &p, facts("b", "u", 1, 1)).await,
        Some(Reason::BudgetLimit)
    );
    // Back by an hour: the rate window must not restart ...
    clock.set(T0 + 30_000);
    let d = deny(&s, &p, facts("c", "u", 1, 1)).await;
    assert_eq!(d.reason, Reason::RequestRateLimit);
    // ... and another user (fresh rate) must not find the earlier, empty hour of the shared
    // tenant budget, nor a lease expired by the jump.
    let d = deny(&s, &p, facts("d", "v", 1, 1)).await;
    assert_eq!(
        (d.reason, d.scope.key()),
        (Reason::BudgetLimit, "tenant:acme")
    );
    assert_eq!(leases_of(&s, "tenant|tenant:acme").await, 1);
}

/// Reusing a live or remembered request id is an error, not a second admission.
pub async fn duplicate_request_id_is_refused<H: Harness>(h: &H) {
    let p = policy(BUDGET_300);
    let (s, _) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u", 10, 10)).await, None);
    assert!(
        s.admit(&plan_of(&p, &facts("a", "u", 10, 10)))
            .await
            .is_err()
    );
    assert!(matches!(
        settle(&s, "a", usage(1, 1)).await,
        Finish::Done { .. }
    ));
    assert!(
        s.admit(&plan_of(&p, &facts("a", "u", 10, 10)))
            .await
            .is_err()
    );
    assert_eq!(budget_of(&s, "user|tenant:acme/user:u", DAY).await, (2, 0));
}

/// Money budgets reserve the estimated cost and settle the actual cost.
pub async fn money_budget<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [prices."gpt-4o"]
        input = 2500000
        cached_input = 1250000
        output = 10000000
        [[scopes]]
        key = "tenant"
        budget = { micro_usd = 20000, period = "day" }
        "#,
    );
    let (s, _) = setup(h).await;
    // 1000 in x 2.5 + 1000 out x 10 = 12500 micro-USD reserved.
    assert_eq!(reason(&s, &p, facts("a", "u", 1000, 1000)).await, None);
    let d = deny(&s, &p, facts("b", "u", 1000, 1000)).await;
    assert_eq!(
        (d.reason, d.remaining, d.requested),
        (Reason::BudgetLimit, 7500, 12500)
    );
    let u = Usage {
        input_tokens: 1000,
        cached_input_tokens: 400,
        output_tokens: 100,
        ..Usage::default()
    };
    // 600 x 2.5 + 400 x 1.25 + 100 x 10 = 3000.
    assert_eq!(
        settle(&s, "a", u).await,
        Finish::Done {
            charged: vec![3000]
        }
    );
    assert_eq!(budget_of(&s, "tenant|tenant:acme", DAY).await, (3000, 0));
    assert_eq!(p.scopes[0].budget.map(|b| b.unit), Some(Unit::MicroUsd));
    // Prompt-cache writes cost 1.25 (five minutes) and 2 (one hour) times the input price.
    assert_eq!(reason(&s, &p, facts("c", "u", 1000, 100)).await, None);
    let u = Usage {
        input_tokens: 1000,
        cached_input_tokens: 100,
        output_tokens: 10,
        cache_write_tokens: 301,
        cache_write_1h_tokens: 201,
        tool_calls: 0,
        fees: 0,
    };
    // 900 x 2.5 + 100 x 1.25 + 10 x 10 = 2475, plus 301 x 0.625 + 201 x 2.5 = 690.625, rounded
    // up to 691: 3166.
    assert_eq!(
        settle(&s, "c", u).await,
        Finish::Done {
            charged: vec![3166]
        }
    );
    // Writes beyond the fresh input are not charged: 10 x 2.5 + 10 x 2.5 = 50.
    assert_eq!(reason(&s, &p, facts("d", "u", 10, 10)).await, None);
    let u = Usage {
        input_tokens: 10,
        cache_write_1h_tokens: 1_000_000,
        ..Usage::default()
    };
    assert_eq!(settle(&s, "d", u).await, Finish::Done { charged: vec![50] });
    assert_eq!(
        budget_of(&s, "tenant|tenant:acme", DAY).await,
        (3000 + 3166 + 50, 0)
    );
}

/// Retry hints: when the rate admits again, budget at the period end, none for token limits.
pub async fn retry_hints<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 2, window = "10s" }
        input_tokens = 100
        budget = { tokens = 100, period = "day" }
        "#,
    );
    let (s, clock) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u", 1, 1)).await, None);
    assert_eq!(reason(&s, &p, facts("b", "u", 1, 1)).await, None);
    let d = deny(&s, &p, facts("c", "u", 1, 1)).await;
    let wait = d
        .retry_after_ms
        .unwrap_or_else(|| panic!("rate denial without retry hint"));
    assert!(wait > 0 && wait <= 20_000, "{wait}");
    clock.advance(wait);
    assert_eq!(
        reason(&s, &p, facts("d", "u", 1, 1)).await,
        None,
        "admitted after {wait} ms"
    );

    let (s, clock) = setup(h).await;
    clock.advance(1_000);
    assert_eq!(reason(&s, &p, facts("e", "u", 50, 50)).await, None);
    let d = deny(&s, &p, facts("f", "u", 1, 1)).await;
    assert_eq!(d.retry_after_ms, Some(86_400_000 - 1_000));
    let d = deny(&s, &p, facts("g", "v", 101, 1)).await;
    assert_eq!(
        (d.reason, d.retry_after_ms),
        (Reason::InputTokenLimit, None)
    );
}

/// A calendar-month budget resets on the first of the month, UTC.
pub async fn calendar_month_budget<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        budget = { tokens = 100, period = "month" }
        "#,
    );
    let (s, clock) = setup(h).await;
    // 2026-01-31 23:59:59.
    clock.set(T0 + 31 * 86_400_000 - 1_000);
    assert_eq!(reason(&s, &p, facts("a", "u", 50, 50)).await, None);
    let d = deny(&s, &p, facts("b", "u", 1, 1)).await;
    assert_eq!(d.retry_after_ms, Some(1_000));
    clock.advance(1_000);
    assert_eq!(reason(&s, &p, facts("c", "u", 50, 50)).await, None);
}

/// The kill switch stops a tenant, a model or everything before any control, counts nothing,
/// and lifts again.
pub async fn kill_switch<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 2, window = "1m" }
        "#,
    );
    let (s, _) = setup(h).await;
    s.set_kill("tenant:acme", Some("incident 42"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for i in 0..3 {
        match admit(&s, &p, facts(&format!("k{i}"), "u", 1, 1)).await {
            Decision::Killed(k) => assert_eq!(
                (k.target.as_str(), k.reason.as_str()),
                ("tenant:acme", "incident 42")
            ),
            other => panic!("expected the kill switch, got {other:?}"),
        }
    }
    let kills = s.kills().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        kills,
        vec![("tenant:acme".to_owned(), "incident 42".to_owned())]
    );
    s.set_kill("tenant:acme", None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Nothing was counted while switched off: the full rate is still there.
    assert_eq!(reason(&s, &p, facts("a", "u", 1, 1)).await, None);
    assert_eq!(reason(&s, &p, facts("b", "u", 1, 1)).await, None);
    s.set_kill("all", Some("maintenance"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        admit(&s, &p, facts("c", "v", 1, 1)).await,
        Decision::Killed(_)
    ));
    s.set_kill("all", None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    s.set_kill("model:gpt-4o", Some("provider outage"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(admit(&s, &p, facts("d", "v", 1, 1)).await, Decision::Killed(k) if k.target == "model:gpt-4o")
    );
}

/// An admission's quotas come in the plan's order, each naming its check by its place in the
/// plan (and so its scope) with what is left after it.
pub async fn quotas_name_their_checks<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 10, window = "1m" }
        concurrency = { limit = 4 }
        budget = { tokens = 1000, period = "day" }
        [[scopes]]
        key = "tenant"
        requests = { limit = 20, window = "1m" }
        budget = { tokens = 5000, period = "day" }
        "#,
    );
    let (s, _) = setup(h).await;
    assert_eq!(reason(&s, &p, facts("a", "u", 100, 100)).await, None);
    let pl = plan_of(&p, &facts("b", "u", 10, 20));
    let Decision::Admit(a) = s.admit(&pl).await.unwrap_or_else(|e| panic!("admit: {e}")) else {
        panic!("refused");
    };
    let got: Vec<(Reason, usize, String, u64, u64)> = a
        .quotas
        .iter()
        .map(|q| {
            let scope = pl
                .scope_of(q)
                .unwrap_or_else(|| panic!("no scope for {q:?}"));
            (
                q.reason,
                q.check,
                scope.key().to_owned(),
                q.limit,
                q.remaining,
            )
        })
        .collect();
    let want = [
        (Reason::RequestRateLimit, 0, "tenant:acme/user:u", 10, 8),
        (Reason::RequestRateLimit, 1, "tenant:acme", 20, 18),
        (Reason::ConcurrencyLimit, 2, "tenant:acme/user:u", 4, 2),
        (Reason::BudgetLimit, 3, "tenant:acme/user:u", 1000, 770),
        (Reason::BudgetLimit, 4, "tenant:acme", 5000, 4770),
    ]
    .map(|(r, c, k, l, left)| (r, c, k.to_owned(), l, left));
    assert_eq!(got, want);
}
