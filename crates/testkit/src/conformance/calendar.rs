//! The conformance cases of calendar periods in a time zone: a budget that resets at a local
//! time across a daylight-saving change, and a store clock that steps back across a reset. The
//! memory store finds the period itself; the Redis scripts take it among the starts the
//! encoder gives them around the caller's instant, by their own clock.

use tollgate_core::Reason;

use super::{deny, reason, setup};
use crate::{Harness, facts, policy};

/// 2026-03-30T00:30:00Z: 02:30 in Berlin the day after the clocks went forward (CEST, UTC+2).
const MARCH_30_0230_BERLIN: u64 = 1_774_830_600_000;
const MINUTE: u64 = 60_000;

const DAILY_AT_0230: &str = r#"
[[scopes]]
key = "user"
budget = { tokens = 100, period = { every = "day", zone = "Europe/Berlin", starts = "02:30" } }
"#;

/// A day's budget resetting at 02:30 Berlin time: on the night the clocks go forward, 02:30
/// does not exist and the day starts at 03:30 CEST (01:30Z); the next starts at 02:30 CEST
/// (00:30Z), an hour earlier in UTC than a fixed offset would put it. A refusal's wait runs
/// to that instant.
pub async fn a_calendar_day_resets_at_its_local_time_across_dst<H: Harness>(h: &H) {
    let p = policy(DAILY_AT_0230);
    let (s, clock) = setup(h).await;
    clock.set(MARCH_30_0230_BERLIN - 10 * MINUTE);
    assert_eq!(reason(&s, &p, facts("a", "u", 50, 50)).await, None);
    let d = deny(&s, &p, facts("b", "u", 1, 1)).await;
    assert_eq!(
        (d.reason, d.retry_after_ms),
        (Reason::BudgetLimit, Some(10 * MINUTE))
    );
    clock.set(MARCH_30_0230_BERLIN - 1);
    assert_eq!(
        reason(&s, &p, facts("c", "u", 1, 1)).await,
        Some(Reason::BudgetLimit)
    );
    clock.set(MARCH_30_0230_BERLIN);
    assert_eq!(reason(&s, &p, facts("d", "u", 50, 50)).await, None);
}

/// A store clock that steps back across a reset does not reopen the period before it: the
/// store's time never goes back, so requests still fall in the newer period (full here), not
/// in the older one that has room.
pub async fn a_clock_stepping_back_does_not_reopen_a_calendar_period<H: Harness>(h: &H) {
    let p = policy(DAILY_AT_0230);
    let (s, clock) = setup(h).await;
    clock.set(MARCH_30_0230_BERLIN - 20 * MINUTE);
    assert_eq!(reason(&s, &p, facts("a", "u", 30, 30)).await, None);
    clock.set(MARCH_30_0230_BERLIN + MINUTE);
    assert_eq!(reason(&s, &p, facts("b", "u", 50, 50)).await, None);
    clock.set(MARCH_30_0230_BERLIN - 10 * MINUTE);
    let d = deny(&s, &p, facts("c", "u", 15, 15)).await;
    assert_eq!((d.reason, d.remaining), (Reason::BudgetLimit, 0));
}
