//! Numbers as a person reads them: amounts with their units (money in dollars), periods and
//! waits in words, reset times as instants, a rule's limits as a sentence.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tollgate_core::Unit;
use tollgate_core::ledger::Period;
use tollgate_core::policy::{OutputMode, ScopeRule};

/// `n` in `unit`: `$1.50`, `5,000 tokens`, `12 tool calls`.
pub fn amount(n: u64, unit: Unit) -> String {
    match unit {
        Unit::MicroUsd => crate::respond::dollars(n),
        Unit::Tokens => format!("{} tokens", grouped(n)),
        Unit::ToolCalls => format!("{} tool calls", grouped(n)),
    }
}

/// `1234567` as `1,234,567`.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A period in words: `day`, `month`, `1h`, `month in Europe/Berlin, from 1 09:00`.
pub fn period(p: Period) -> String {
    match p {
        Period::CalendarMonth => "month (UTC)".to_owned(),
        Period::Calendar(c) => format!(
            "{} in {}, from {}",
            c.every.name(),
            c.zone.name(),
            c.starts()
        ),
        Period::Fixed(86_400_000) => "day (UTC)".to_owned(),
        Period::Fixed(ms) => humantime::format_duration(Duration::from_millis(ms)).to_string(),
    }
}

/// A reset `ms` from now, in words and as an instant: `in 6h 46m (2026-12-05T00:00:00Z)`.
pub fn reset(ms: u64) -> String {
    let now = SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    reset_at(now.saturating_add(ms), now)
}

/// A reset at `end_ms`, read at `now_ms` (both of one clock: the store's), in words and as an
/// instant.
pub fn reset_at(end_ms: u64, now_ms: u64) -> String {
    let ms = end_ms.saturating_sub(now_ms);
    let secs = ms / 1000;
    let words = if secs >= 3600 {
        format!("{}h {:02}m", secs / 3600, secs / 60 % 60)
    } else if secs >= 60 {
        format!("{}m {:02}s", secs / 60, secs % 60)
    } else {
        format!("{secs}s")
    };
    format!("in {words} ({})", instant_ms(end_ms))
}

/// An instant, RFC 3339 to the second.
pub fn instant(at: SystemTime) -> String {
    humantime::format_rfc3339_seconds(at).to_string()
}

/// Milliseconds since the epoch as an instant.
pub fn instant_ms(ms: u64) -> String {
    instant(UNIX_EPOCH + Duration::from_millis(ms))
}

/// A rule's limits as a sentence: `60 requests per 1m; $5.00 per month (UTC)`.
pub fn limits(r: &ScopeRule) -> String {
    let window = |ms: u64| humantime::format_duration(Duration::from_millis(ms)).to_string();
    let mut parts = Vec::new();
    if let Some(q) = r.requests {
        parts.push(format!(
            "{} requests per {}",
            grouped(q.limit.get()),
            window(q.window_ms.get())
        ));
    }
    if let Some(i) = r.input_tokens {
        let trim = if r.trim_input {
            ", oldest turns dropped to fit"
        } else {
            ""
        };
        parts.push(format!("input at most {} tokens{trim}", grouped(i.get())));
    }
    if let Some(o) = r.output_tokens {
        let mode = match o.mode {
            OutputMode::Clamp => "clamped",
            OutputMode::Reject => "refused above",
        };
        parts.push(format!(
            "output at most {} tokens ({mode})",
            grouped(o.max.get())
        ));
    }
    if let Some(t) = r.total_tokens {
        parts.push(format!(
            "input and output at most {} tokens",
            grouped(t.get())
        ));
    }
    if let Some(c) = r.concurrency {
        parts.push(format!("{} at once", c.limit.get()));
    }
    if let Some(b) = r.budget {
        parts.push(format!(
            "{} per {}",
            amount(b.limit.get(), b.unit),
            period(b.period)
        ));
    }
    if let Some(t) = r.tool_calls {
        parts.push(format!(
            "{} per {}",
            amount(t.limit.get(), Unit::ToolCalls),
            period(t.period)
        ));
    }
    if let Some(l) = r.loops {
        parts.push(format!(
            "{} identical requests per {}",
            l.max_identical.get(),
            window(l.window_ms.get())
        ));
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_carry_their_units() {
        assert_eq!(amount(100_000_000, Unit::MicroUsd), "$100.00");
        assert_eq!(amount(20_023, Unit::MicroUsd), "$0.020023");
        assert_eq!(amount(1_234_567, Unit::Tokens), "1,234,567 tokens");
        assert_eq!(grouped(999), "999");
        assert_eq!(period(Period::Fixed(3_600_000)), "1h");
        assert!(reset(2_357_349_741).starts_with("in 654h 49m (20"));
    }
}
