//! Budget periods on a calendar in a time zone: days, ISO weeks, months, quarters and years,
//! each starting at a chosen day and time of day (`{ every = "month", zone = "Europe/Berlin",
//! starts = "1 09:00" }`), quarters and years from a fiscal month.
//!
//! A period starts at its day's time in its zone. A start that falls in a daylight-saving gap
//! is the first instant after the gap (02:30 on a spring-forward night is 03:30), and one that
//! falls in a fold is its first occurrence: each period is a real span of time, however many
//! hours its days have. A period's id is its start in ms since the epoch.
//!
//! The zone database is compiled in. Periods are found here by the memory store at its own
//! instant; the Redis scripts, which have no zone database, are given the starts around the
//! gateway's instant ([`Calendar::around`]) and take the period among them that contains the
//! store's.

use std::sync::Mutex;

use jiff::Timestamp;
use jiff::tz::TimeZone;

use super::{civil_from_days, days_from_civil};
use crate::clock::Millis;

const DAY_MS: u64 = 86_400_000;

/// How long a calendar period is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Every {
    /// A day.
    Day,
    /// A week (ISO: from Monday, unless it starts on another day).
    Week,
    /// A month.
    Month,
    /// Three months.
    Quarter,
    /// Twelve months.
    Year,
}

impl Every {
    /// Its name as written.
    pub fn name(self) -> &'static str {
        match self {
            Every::Day => "day",
            Every::Week => "week",
            Every::Month => "month",
            Every::Quarter => "quarter",
            Every::Year => "year",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [
            Every::Day,
            Every::Week,
            Every::Month,
            Every::Quarter,
            Every::Year,
        ]
        .into_iter()
        .find(|e| e.name() == s)
    }

    /// Months in one period (0 for days and weeks).
    fn months(self) -> u64 {
        match self {
            Every::Day | Every::Week => 0,
            Every::Month => 1,
            Every::Quarter => 3,
            Every::Year => 12,
        }
    }
}

/// A time zone of the compiled-in database, by its place in the table of zones in use (so that
/// a period stays a small value that can be copied and compared).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Zone(u16);

/// The zones named so far: at most the database's few hundred.
static ZONES: Mutex<Vec<(String, TimeZone)>> = Mutex::new(Vec::new());

impl Zone {
    /// The zone named `name` (`UTC`, `Europe/Berlin`).
    pub fn named(name: &str) -> Result<Self, String> {
        let mut zones = ZONES
            .lock()
            .map_err(|_| "the zone table is unusable".to_owned())?;
        if let Some(i) = zones.iter().position(|(n, _)| n == name) {
            return Ok(Zone(u16::try_from(i).unwrap_or(u16::MAX)));
        }
        let tz = TimeZone::get(name).map_err(|_| {
            format!("unknown time zone {name:?}; expected an IANA name such as \"Europe/Berlin\"")
        })?;
        let i = u16::try_from(zones.len()).map_err(|_| "too many time zones".to_owned())?;
        zones.push((name.to_owned(), tz));
        Ok(Zone(i))
    }

    /// Its IANA name.
    pub fn name(self) -> String {
        ZONES
            .lock()
            .ok()
            .and_then(|z| z.get(usize::from(self.0)).map(|(n, _)| n.clone()))
            .unwrap_or_else(|| "UTC".to_owned())
    }

    fn tz(self) -> TimeZone {
        ZONES
            .lock()
            .ok()
            .and_then(|z| z.get(usize::from(self.0)).map(|(_, tz)| tz.clone()))
            .unwrap_or(TimeZone::UTC)
    }
}

/// A calendar period: how long, in which zone, and where each starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Calendar {
    /// How long.
    pub every: Every,
    /// The zone its days are in.
    pub zone: Zone,
    /// The month a quarter or year starts in (1 to 12; the fiscal year's first month).
    pub month: u8,
    /// The day it starts on: of the month (1 to 28) for months, quarters and years; of the
    /// week (1 = Monday to 7) for weeks.
    pub day: u8,
    /// The time of day it starts at, in minutes after midnight.
    pub minute: u16,
}

const WEEKDAYS: [&str; 7] = [
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
    "sunday",
];
const MONTHS: [&str; 12] = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
];

/// The place (1-based) of `word` among `names`, by its whole name or its first three letters.
fn named(word: &str, names: &[&str]) -> Option<u8> {
    let w = word.to_ascii_lowercase();
    let i = names
        .iter()
        .position(|n| *n == w || (w.len() == 3 && n.starts_with(&w)))?;
    u8::try_from(i + 1).ok()
}

fn title(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
        .unwrap_or_default()
}

impl Calendar {
    /// A period `every` (`day`, `week`, `month`, `quarter`, `year`) in `zone` (default UTC),
    /// starting as `starts` says: `"09:00"` for days, `"Monday 09:00"` for weeks, `"1 09:00"`
    /// for months (a day from 1 to 28), `"April 1 00:00"` for quarters and years (the month a
    /// fiscal year starts); by default at the unit's start, midnight.
    pub fn parse(every: &str, zone: Option<&str>, starts: Option<&str>) -> Result<Self, String> {
        let every = Every::parse(every.trim()).ok_or_else(|| {
            format!(
                "unknown calendar period {every:?}; expected \"day\", \"week\", \"month\", \"quarter\" or \"year\""
            )
        })?;
        let zone = Zone::named(zone.unwrap_or("UTC").trim())?;
        let mut c = Calendar {
            every,
            zone,
            month: 1,
            day: 1,
            minute: 0,
        };
        let words: Vec<&str> = starts.unwrap_or("").split_whitespace().collect();
        let (date, time) = match words.last() {
            Some(w) if w.contains(':') => (&words[..words.len() - 1], Some(*w)),
            _ => (&words[..], None),
        };
        if let Some(t) = time {
            c.minute = parse_time(t)?;
        }
        let expected = match every {
            Every::Day => "\"HH:MM\"",
            Every::Week => "\"<weekday> HH:MM\", e.g. \"Monday 09:00\"",
            Every::Month => "\"<day 1-28> HH:MM\", e.g. \"1 09:00\"",
            Every::Quarter | Every::Year => "\"<month> <day 1-28> HH:MM\", e.g. \"April 1 00:00\"",
        };
        let bad = || format!("{:?}: expected {expected}", starts.unwrap_or(""));
        let day = |w: &str| w.parse::<u8>().ok().filter(|d| (1..=28).contains(d));
        match (every, date) {
            (_, []) => {}
            (Every::Week, [w]) => c.day = named(w, &WEEKDAYS).ok_or_else(bad)?,
            (Every::Month, [d]) => c.day = day(d).ok_or_else(bad)?,
            (Every::Quarter | Every::Year, [m, d]) => {
                c.month = named(m, &MONTHS).ok_or_else(bad)?;
                c.day = day(d).ok_or_else(bad)?;
            }
            (Every::Quarter | Every::Year, [m]) => c.month = named(m, &MONTHS).ok_or_else(bad)?,
            _ => return Err(bad()),
        }
        Ok(c)
    }

    /// Its name in records and keys, from which [`Calendar::from_label`] reads it back: how
    /// long, the zone, where it starts (`month Europe/Berlin 1 09:00`).
    pub fn label(&self) -> String {
        format!(
            "{} {} {}",
            self.every.name(),
            self.zone.name(),
            self.starts()
        )
    }

    /// Where each period starts, in the words `starts` takes.
    pub fn starts(&self) -> String {
        let time = format!("{:02}:{:02}", self.minute / 60, self.minute % 60);
        let month = MONTHS
            .get(usize::from(self.month.saturating_sub(1)))
            .map(|m| title(m))
            .unwrap_or_default();
        let weekday = WEEKDAYS
            .get(usize::from(self.day.saturating_sub(1)))
            .map(|d| title(d))
            .unwrap_or_default();
        match self.every {
            Every::Day => time,
            Every::Week => format!("{weekday} {time}"),
            Every::Month => format!("{} {time}", self.day),
            Every::Quarter | Every::Year => format!("{month} {} {time}", self.day),
        }
    }

    /// The calendar a [`Calendar::label`] names.
    pub fn from_label(label: &str) -> Option<Self> {
        let mut words = label.splitn(3, ' ');
        let (every, zone, starts) = (words.next()?, words.next()?, words.next()?);
        Self::parse(every, Some(zone), Some(starts)).ok()
    }

    /// The period containing `now`: its start and end.
    pub fn at(&self, now: Millis) -> (Millis, Millis) {
        let tz = self.zone.tz();
        let local = Timestamp::from_millisecond(i64::try_from(now).unwrap_or(i64::MAX))
            .map(|t| tz.to_datetime(t).date())
            .ok()
            .and_then(|d| {
                let y = u64::try_from(d.year()).ok()?;
                let m = u64::try_from(d.month()).ok()?;
                Some(days_from_civil(y, m, u64::try_from(d.day()).ok()?))
            })
            .unwrap_or(now / DAY_MS);
        let mut first = self.first_day(local);
        let mut start = self.start_on(&tz, first);
        // The time of day may put now before its day's start (or, across a zone's change of
        // offset, after the next one): step to the period that holds it.
        for _ in 0..3 {
            if start > now {
                first = self.step(first, false);
                start = self.start_on(&tz, first);
                continue;
            }
            let end = self.start_on(&tz, self.step(first, true));
            if now < end {
                return (start, end);
            }
            first = self.step(first, true);
            start = end;
        }
        (start, start.saturating_add(DAY_MS))
    }

    /// The starts around `now`: of the period before the one containing it, of that one, of
    /// the next and the end of the next. A store whose clock is near `now` finds its period
    /// among them (see the Lua `period_of`).
    pub fn around(&self, now: Millis) -> [Millis; 4] {
        let (start, end) = self.at(now);
        let (before, _) = self.at(start.saturating_sub(1));
        let (_, after) = self.at(end);
        [before, start, end, after]
    }

    /// The first day (days since the epoch) of the period containing local day `days`.
    fn first_day(&self, days: u64) -> u64 {
        match self.every {
            Every::Day => days,
            Every::Week => {
                // 1970-01-01 was a Thursday: Monday-based, day 0 is 3.
                let weekday = (days + 3) % 7;
                let back = (weekday + 7 - u64::from(self.day.saturating_sub(1))) % 7;
                days.saturating_sub(back)
            }
            Every::Month | Every::Quarter | Every::Year => {
                let (y, m, d) = civil_from_days(days);
                let mut month = y * 12 + (m - 1);
                if d < u64::from(self.day) {
                    month = month.saturating_sub(1);
                }
                let n = self.every.months();
                let fiscal = u64::from(self.month.saturating_sub(1));
                let month = month.saturating_sub((month + 12 - fiscal % 12) % n);
                days_from_civil(month / 12, month % 12 + 1, u64::from(self.day))
            }
        }
    }

    /// The first day of the next period (`forward`) or the previous one.
    fn step(&self, first: u64, forward: bool) -> u64 {
        let days = match self.every {
            Every::Day => 1,
            Every::Week => 7,
            Every::Month | Every::Quarter | Every::Year => {
                let (y, m, _) = civil_from_days(first);
                let n = self.every.months();
                let month = y * 12 + (m - 1);
                let month = if forward {
                    month + n
                } else {
                    month.saturating_sub(n)
                };
                return days_from_civil(month / 12, month % 12 + 1, u64::from(self.day));
            }
        };
        if forward {
            first + days
        } else {
            first.saturating_sub(days)
        }
    }

    /// The instant a period starting on local day `days` starts: its time of day in the zone,
    /// after a gap when it falls in one, the first when it falls twice.
    fn start_on(&self, tz: &TimeZone, days: u64) -> Millis {
        let (y, m, d) = civil_from_days(days);
        let (h, mi) = (self.minute / 60, self.minute % 60);
        let at = (|| {
            let date = jiff::civil::Date::new(
                i16::try_from(y).ok()?,
                i8::try_from(m).ok()?,
                i8::try_from(d).ok()?,
            )
            .ok()?;
            let dt = date.at(i8::try_from(h).ok()?, i8::try_from(mi).ok()?, 0, 0);
            u64::try_from(tz.to_timestamp(dt).ok()?.as_millisecond()).ok()
        })();
        at.unwrap_or(days * DAY_MS + u64::from(self.minute) * 60_000)
    }
}

/// `HH:MM`, 00:00 to 23:59: minutes after midnight.
fn parse_time(t: &str) -> Result<u16, String> {
    let (h, m) = t
        .split_once(':')
        .and_then(|(h, m)| Some((h.parse::<u16>().ok()?, m.parse::<u16>().ok()?)))
        .filter(|(h, m)| *h < 24 && *m < 60)
        .ok_or_else(|| format!("{t:?}: expected a time of day HH:MM"))?;
    Ok(h * 60 + m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cal(every: &str, zone: &str, starts: &str) -> Calendar {
        Calendar::parse(every, Some(zone), Some(starts)).unwrap_or_else(|e| unreachable!("{e}"))
    }

    /// Expected instants computed apart, with Python's `zoneinfo`.
    #[test]
    fn periods_start_at_their_local_time() {
        let cases = [
            // A month from the 1st, 09:00 Berlin: CET at its start, CEST at its end.
            (
                ("month", "Europe/Berlin", "1 09:00"),
                1_774_785_600_000,
                (1_772_352_000_000, 1_775_026_800_000),
            ),
            // A minute before 09:00 on the 1st is still February's.
            (
                ("month", "Europe/Berlin", "1 09:00"),
                1_772_351_940_000,
                (1_769_932_800_000, 1_772_352_000_000),
            ),
            // An ISO week: Monday 00:00 UTC.
            (
                ("week", "UTC", "Monday 00:00"),
                1_796_489_460_000,
                (1_795_996_800_000, 1_796_601_600_000),
            ),
            // Fiscal quarters from April: February is in the one from January 1st.
            (
                ("quarter", "UTC", "April 1 00:00"),
                1_770_681_600_000,
                (1_767_225_600_000, 1_775_001_600_000),
            ),
            // A fiscal year from April 1st, New York.
            (
                ("year", "America/New_York", "Apr 1 00:00"),
                1_770_681_600_000,
                (1_743_480_000_000, 1_775_016_000_000),
            ),
            // 02:30 does not exist on 2026-03-08 in New York: that day starts at 03:30 EDT.
            (
                ("day", "America/New_York", "02:30"),
                1_772_971_200_000,
                (1_772_955_000_000, 1_773_037_800_000),
            ),
            // 01:30 happens twice on 2026-11-01: the day starts at the first.
            (
                ("day", "America/New_York", "01:30"),
                1_793_534_400_000,
                (1_793_511_000_000, 1_793_601_000_000),
            ),
        ];
        for ((every, zone, starts), now, want) in cases {
            let c = cal(every, zone, starts);
            assert_eq!(c.at(now), want, "{} at {now}", c.label());
        }
    }

    #[test]
    fn labels_name_their_calendar() {
        for (every, zone, starts, label) in [
            (
                "month",
                "Europe/Berlin",
                "1 09:00",
                "month Europe/Berlin 1 09:00",
            ),
            ("week", "UTC", "sun", "week UTC Sunday 00:00"),
            (
                "quarter",
                "Asia/Tokyo",
                "april 1",
                "quarter Asia/Tokyo April 1 00:00",
            ),
            ("day", "UTC", "23:59", "day UTC 23:59"),
        ] {
            let c = cal(every, zone, starts);
            assert_eq!(c.label(), label);
            assert_eq!(Calendar::from_label(label), Some(c));
        }
    }

    #[test]
    fn bad_calendars_are_named() {
        let e = |every: &str, zone: &str, starts: &str| {
            Calendar::parse(every, Some(zone), Some(starts))
                .err()
                .unwrap_or_default()
        };
        assert!(e("fortnight", "UTC", "").contains("unknown calendar period"));
        assert!(e("month", "Mars/Olympus", "").contains("unknown time zone"));
        assert!(e("month", "UTC", "31 00:00").contains("expected \"<day 1-28> HH:MM\""));
        assert!(e("week", "UTC", "Funday").contains("expected \"<weekday> HH:MM\""));
        assert!(e("day", "UTC", "24:00").contains("expected a time of day"));
        assert!(e("year", "UTC", "Smarch 1").contains("expected \"<month>"));
    }

    proptest! {
        /// Every instant falls in one period, and periods follow one another without a gap.
        #[test]
        fn periods_hold_their_instant_and_follow_each_other(
            every in prop::sample::select(vec!["day", "week", "month", "quarter", "year"]),
            zone in prop::sample::select(vec!["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Pacific/Chatham"]),
            day in 1u8..=28,
            minute in 0u16..1440,
            now in 978_307_200_000u64..2_871_763_200_000,
        ) {
            let time = format!("{:02}:{:02}", minute / 60, minute % 60);
            let starts = match every {
                "day" => time,
                "week" => format!("Wed {time}"),
                "month" => format!("{day} {time}"),
                _ => format!("Oct {day} {time}"),
            };
            let c = cal(every, zone, &starts);
            let (start, end) = c.at(now);
            prop_assert!(start <= now && now < end, "{} at {now}: {start}..{end}", c.label());
            prop_assert_eq!(c.at(end).0, end);
            prop_assert_eq!(c.at(start.saturating_sub(1)).1, start);
        }
    }
}
