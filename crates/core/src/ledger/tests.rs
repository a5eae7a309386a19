use super::*;
use proptest::prelude::*;

#[test]
fn window_counts_attempts_and_denies_over_limit() {
    let mut w = RateWindow::default();
    for i in 0..5 {
        assert!(w.attempt(1000 + i, 60_000, 5), "attempt {i}");
    }
    assert!(!w.attempt(2000, 60_000, 5));
    // A denied attempt still counts.
    assert_eq!(w.current, 6);
    assert_eq!(w.remaining(2000, 60_000, 5), 0);
}

#[test]
fn previous_window_decays_linearly() {
    let mut w = RateWindow::default();
    for _ in 0..10 {
        w.attempt(0, 1000, 10);
    }
    // Halfway into the next window, half of the previous count still weighs.
    w.roll(1500, 1000);
    assert_eq!(w.scaled_count(1500, 1000), 5 * WEIGHT_SCALE);
    assert!(w.is_stale(2000, 1000) || !w.is_stale(1999, 1000));
    w.roll(2500, 1000);
    assert_eq!(
        w.scaled_count(2500, 1000),
        0,
        "two windows on, nothing counts"
    );
}

#[test]
fn calendar_round_trips() {
    for days in [0u64, 59, 60, 365, 10_957, 19_782, 20_000, 100_000] {
        let (y, m, d) = civil_from_days(days);
        assert_eq!(days_from_civil(y, m, d), days);
    }
    // 2026-11-29 is day 20_786 (checked with Python datetime).
    assert_eq!(civil_from_days(20_786), (2026, 11, 29));
    // February of a leap year.
    let (_, start, end) = Period::CalendarMonth.at(days_from_civil(2028, 2, 10) * DAY_MS);
    assert_eq!((end - start) / DAY_MS, 29);
}

#[test]
fn period_labels_name_the_length_or_the_month() {
    for (period, label) in [
        (Period::Fixed(86_400_000), "fixed:86400000"),
        (Period::Fixed(0), "fixed:0"),
        (Period::Fixed(u64::MAX), "fixed:18446744073709551615"),
        (Period::CalendarMonth, "month"),
    ] {
        assert_eq!(period.label(), label);
    }
}

#[test]
fn cost_rounds_up() {
    let p = Price {
        input: 2_500_000,
        cached_input: 1_250_000,
        output: 10_000_000,
    };
    let u = Usage {
        input_tokens: 1,
        cached_input_tokens: 0,
        output_tokens: 0,
        ..Usage::default()
    };
    assert_eq!(p.cost(&u), 3); // 2.5 micro-USD rounds up
    let u = Usage {
        input_tokens: 1_000_000,
        cached_input_tokens: 500_000,
        output_tokens: 1_000,
        ..Usage::default()
    };
    assert_eq!(p.cost(&u), 1_250_000 + 625_000 + 10_000);
}

proptest! {
    #[test]
    fn retry_after_is_the_first_admitting_instant(
        prev in 0u64..50, cur in 0u64..50, limit in 1u64..40,
        window in 1u64..5_000, offset in 0u64..5_000,
    ) {
        let w = RateWindow { start: 10_000, current: cur, previous: prev };
        let now = 10_000 + offset % window;
        let ra = w.retry_after(now, window, limit);
        let admits = |t: u64| { let mut c = w; c.attempt(t, window, limit) };
        prop_assert!(admits(now + ra), "admits after retry_after");
        if ra > 0 {
            prop_assert!(!admits(now + ra - 1), "not earlier");
        }
    }

    #[test]
    fn month_period_contains_now(t in 0u64..(200 * 365 * DAY_MS)) {
        let (id, start, end) = Period::CalendarMonth.at(t);
        prop_assert!(start <= t && t < end);
        let (id2, _, _) = Period::CalendarMonth.at(end);
        prop_assert_eq!(id2, id + 1);
        let days = (end - start) / DAY_MS;
        prop_assert!((28..=31).contains(&days));
    }

    #[test]
    fn cost_is_monotonic(a in 0u64..10_000_000, b in 0u64..10_000_000, o in 0u64..1_000_000) {
        let p = Price { input: 3_000_000, cached_input: 300_000, output: 15_000_000 };
        let lo = Usage { input_tokens: a.min(b), cached_input_tokens: 0, output_tokens: o, ..Usage::default() };
        let hi = Usage { input_tokens: a.max(b), cached_input_tokens: 0, output_tokens: o, ..Usage::default() };
        prop_assert!(p.cost(&lo) <= p.cost(&hi));
    }
}

proptest! {
    /// Cache writes are charged at 1.25 and 2 times the input price: never less than the exact
    /// cost, at most two micro-units more (each of the two parts rounded up on its own), and
    /// writes beyond the fresh input are not charged.
    #[test]
    fn cache_writes_cost_their_multiple_of_the_input_price(
        input in 0u64..2_000_000, cached in 0u64..2_000_000, output in 0u64..100_000,
        w5 in 0u64..3_000_000, w1h in 0u64..3_000_000,
        pi in 0u64..30_000_000, pc in 0u64..30_000_000, po in 0u64..100_000_000,
    ) {
        let p = Price { input: pi, cached_input: pc, output: po };
        let u = Usage {
            input_tokens: input,
            cached_input_tokens: cached,
            output_tokens: output,
            cache_write_tokens: w5,
            cache_write_1h_tokens: w1h,
            tool_calls: 0,
            fees: 0,
        };
        let c = cached.min(input);
        let fresh = input - c;
        let (w5, w1h) = (w5.min(fresh), w1h.min(fresh - w5.min(fresh)));
        // In quarter micro-units per million tokens.
        let exact = 4 * (u128::from(fresh) * u128::from(pi) + u128::from(c) * u128::from(pc)
            + u128::from(output) * u128::from(po))
            + (u128::from(w5) + 4 * u128::from(w1h)) * u128::from(pi);
        let got = u128::from(p.cost(&u)) * 4_000_000;
        prop_assert!(got >= exact, "never under-charged");
        prop_assert!(got < exact + 2 * 4_000_000, "at most two micro-units over");
    }
}
