//! What every rule is checked with: the error that names a field by its path, the bounds that keep
//! the ledger arithmetic exact, and the parsers of counts, durations, shares and periods.

use std::fmt;
use std::num::NonZeroU64;
use std::time::Duration;

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::ledger::Period;

/// A policy that failed validation: the path of the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct PolicyError {
    /// Dotted path of the field, e.g. `policy.scopes[2].budget.period`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl PolicyError {
    pub(crate) fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Upper bounds that keep every product of the ledger arithmetic inside 2^53, so the Lua
/// implementation (doubles) computes exactly what Rust computes.
pub const MAX_LIMIT: u64 = 1_000_000_000_000;

/// Longest rate window or fixed period: 400 days.
pub const MAX_WINDOW_MS: u64 = 400 * 86_400_000;

impl Period {
    /// A period as written: a name or duration ([`Period::parse`]), or a calendar in a zone.
    pub fn of(raw: &RawPeriod) -> Result<Self, String> {
        match raw {
            RawPeriod::Named(s) => Self::parse(s),
            RawPeriod::Calendar(c) => {
                crate::ledger::Calendar::parse(&c.every, c.zone.as_deref(), c.starts.as_deref())
                    .map(Period::Calendar)
            }
        }
    }

    /// Parses `day`, `month` or a fixed duration (`1h`, `7d`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "day" | "calendar_day" => Ok(Period::Fixed(86_400_000)),
            "month" | "calendar_month" => Ok(Period::CalendarMonth),
            other => {
                let d = humantime::parse_duration(other).map_err(|e| {
                    format!("unknown period {other:?} ({e}); expected \"day\", \"month\" or a duration like \"1h\"")
                })?;
                let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
                if ms == 0 || ms > MAX_WINDOW_MS {
                    return Err("must be between 1ms and 400 days".into());
                }
                Ok(Period::Fixed(ms))
            }
        }
    }
}

pub(crate) fn positive(v: u64, path: &str) -> Result<NonZeroU64, PolicyError> {
    if v > MAX_LIMIT {
        return Err(PolicyError::new(
            path,
            format!("must be at most {MAX_LIMIT}"),
        ));
    }
    NonZeroU64::new(v).ok_or_else(|| PolicyError::new(path, "must be greater than 0"))
}

pub(crate) fn duration_ms(s: &str, path: &str) -> Result<NonZeroU64, PolicyError> {
    let d: Duration = humantime::parse_duration(s.trim())
        .map_err(|e| PolicyError::new(path, format!("invalid duration {s:?}: {e}")))?;
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms == 0 {
        return Err(PolicyError::new(path, "must be at least 1ms"));
    }
    if ms > MAX_WINDOW_MS {
        return Err(PolicyError::new(path, "must be at most 400 days"));
    }
    NonZeroU64::new(ms).ok_or_else(|| PolicyError::new(path, "must be at least 1ms"))
}

/// A share written as a per cent, `"20%"`, from 1% to 100%.
pub(crate) fn percent(share: &str, path: &str) -> Result<u64, PolicyError> {
    share
        .trim()
        .strip_suffix('%')
        .and_then(|n| n.trim().parse::<u64>().ok())
        .filter(|n| (1..=100).contains(n))
        .ok_or_else(|| {
            PolicyError::new(
                path,
                format!("{share:?}: expected a share such as \"20%\" (1% to 100%)"),
            )
        })
}

/// A period as written: `"day"`, `"month"`, a duration, or a calendar table.
#[derive(Debug, Clone)]
pub enum RawPeriod {
    /// `"day"`, `"month"` (UTC) or a fixed duration.
    Named(String),
    /// `{ every, zone, starts }`.
    Calendar(RawCalendar),
}

/// `{ every = "quarter", zone = "America/New_York", starts = "April 1 00:00" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCalendar {
    /// `day`, `week`, `month`, `quarter` or `year`.
    pub every: String,
    /// An IANA time zone (default `UTC`).
    pub zone: Option<String>,
    /// Where each period starts: `"09:00"`, `"Monday 09:00"`, `"1 09:00"`, `"April 1 00:00"`.
    pub starts: Option<String>,
}

impl<'de> Deserialize<'de> for RawPeriod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawPeriod;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a period: \"day\", \"month\", a duration, or { every, zone, starts }")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawPeriod, E> {
                Ok(RawPeriod::Named(v.to_owned()))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RawPeriod, A::Error> {
                RawCalendar::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(RawPeriod::Calendar)
            }
        }
        d.deserialize_any(V)
    }
}
