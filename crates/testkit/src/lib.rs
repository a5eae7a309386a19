//! Test support for Tollgate (not published): the store conformance suite that every [`Store`]
//! must pass, and helpers shared by test binaries.
//!
//! The suite is a table of async cases over a [`Harness`]; [`conformance_tests!`] expands to one
//! `#[tokio::test]` per case, so every store lists the same case names.
//!
//! [`Store`]: tollgate_core::Store

// This crate is test code: its assertions panic by design.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod conformance;
pub mod faults;
pub mod paused;
pub mod pg_server;
pub mod redis_server;
pub use tollgate_sim as sim;

use tollgate_core::{Dimension, Identity, ManualClock, Policy, RequestFacts, Store};

/// Makes fresh, isolated stores for the conformance suite.
pub trait Harness: Send + Sync {
    /// The store under test.
    type S: Store;
    /// A clean store whose time is `clock` (a Redis store passes it as the script's time).
    fn store(&self, clock: ManualClock) -> impl std::future::Future<Output = Self::S> + Send;
}

/// 2026-01-01T00:00:00Z: a day, month and every window boundary in the suite.
pub const T0: u64 = 1_767_225_600_000;

/// Parses a policy or fails the test with its error.
pub fn policy(text: &str) -> Policy {
    Policy::from_toml(text).unwrap_or_else(|e| panic!("test policy invalid: {e}"))
}

/// Facts of a request by `user` with declared tokens.
pub fn facts(id: &str, user: &str, input: u64, max_output: u64) -> RequestFacts {
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
            a_reserve_keeps_its_share_for_its_class,
            a_calendar_day_resets_at_its_local_time_across_dst,
            a_clock_stepping_back_does_not_reopen_a_calendar_period,
            unused_budget_carries_over_to_the_next_period,
            a_carry_is_capped_and_only_from_the_period_before,
            a_provider_hold_refuses_its_model_until_it_ends);
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
