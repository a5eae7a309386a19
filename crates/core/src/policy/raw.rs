//! The policy as written: every table deserialized, unknown fields refused, nothing checked.

use std::collections::BTreeMap;

use std::fmt;

use serde::de::{Error as _, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

pub use crate::controls::RawRules;

/// The policy as written. Unknown fields are errors, so a typo never silently disables a limit.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    /// A version string that appears in every decision record.
    pub version: Option<String>,
    /// Output cap for requests that give none and meet no scope default (default 4096).
    pub default_max_output_tokens: Option<u64>,
    /// How long an admitted request may stay unfinished when none of its scopes sets a lease TTL.
    pub reservation_ttl: Option<String>,
    /// What an expired reservation costs: `full` (default), `input`, or `none`.
    pub expired_reservation_charge: Option<String>,
    /// Stateful controls allowed to fail open when the store cannot be reached
    /// (`request_rate_limit`, `concurrency_limit`, `budget_limit`); default: none (fail closed).
    #[serde(default)]
    pub fail_open: Vec<String>,
    /// Prices per model, in micro-units per million tokens: each overrides the catalog's
    /// figures for its model.
    #[serde(default)]
    pub prices: BTreeMap<String, RawPrice>,
    /// The price catalog under `prices`: `builtin` (default, the pinned public catalog) or
    /// `none` (only `prices`).
    pub price_catalog: Option<String>,
    /// Priority classes by name: their weights and the tenants in each.
    #[serde(default)]
    pub classes: BTreeMap<String, crate::controls::reserve::RawClass>,
    /// The scopes and their limits, checked in this order within each control.
    #[serde(default)]
    pub scopes: Vec<RawScope>,
}

/// A model's price, in micro-units (micro-USD by default) per million tokens.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrice {
    /// Input tokens.
    pub input: u64,
    /// Cached input tokens (defaults to the input price).
    pub cached_input: Option<u64>,
    /// Output tokens.
    pub output: u64,
    /// The prices of the model's service tiers, by the tier's name as the request states it
    /// (`priority`, `flex`; `inference_geo:us` for Anthropic's region): a request for a tier
    /// that has no price here is refused under a money budget.
    #[serde(default)]
    pub tiers: BTreeMap<String, RawPrice>,
    /// Audio input tokens, per million (the model's audio price, above its text price).
    pub audio_input: Option<u64>,
    /// One web search the upstream runs, in micro-units.
    pub web_search: Option<u64>,
    /// One file search the upstream runs, in micro-units.
    pub file_search: Option<u64>,
    /// One code-interpreter session (container) the upstream starts, in micro-units.
    pub code_session: Option<u64>,
    /// The price of a request whose input is above a number of tokens (the whole request is
    /// billed at it): `{ above = 200000, input = .., output = .. }`.
    pub long_context: Option<RawLongContext>,
}

/// A long-context price as written.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLongContext {
    /// Input tokens above which it applies.
    pub above: u64,
    /// Input tokens.
    pub input: u64,
    /// Cached input tokens (defaults to the input price).
    pub cached_input: Option<u64>,
    /// Output tokens.
    pub output: u64,
}

/// One scope rule as written: its own fields, and each control's under its key
/// ([`RawRules`]). Read field by field, so that an unknown key is refused with the fields a
/// rule takes.
#[derive(Debug, Clone, Default)]
pub struct RawScope {
    /// Unique name (letters, digits, `-`, `_`); defaults to the key.
    pub name: Option<String>,
    /// `global`, or dimensions joined by `/`: `tenant`, `key`, `user`, `ip`, `model`.
    pub key: String,
    /// Only requests whose dimensions equal these values fall in this scope.
    pub match_: BTreeMap<String, String>,
    /// The controls' parts: `requests`, `input_tokens`, `output_tokens`, `total_tokens`,
    /// `concurrency`, `budget`, `tool_calls`, `loops`.
    pub controls: RawRules,
    /// For a rule keyed on `ip`: how many leading bits of an address make one scope
    /// (default `{ v4 = 32, v6 = 64 }`).
    pub ip_prefix: Option<RawIpPrefix>,
    /// `enforce` (the default) or `shadow`: evaluated, its state kept, never refusing.
    pub mode: Option<String>,
}

/// A rule's own fields, besides its controls'.
const SCOPE_FIELDS: [&str; 5] = ["name", "key", "match", "ip_prefix", "mode"];

impl<'de> Deserialize<'de> for RawScope {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = RawScope;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a scope rule")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawScope, A::Error> {
                let mut s = RawScope::default();
                let mut key = None;
                while let Some(k) = map.next_key::<String>()? {
                    match k.as_str() {
                        "name" => s.name = Some(map.next_value()?),
                        "key" => key = Some(map.next_value()?),
                        "match" => s.match_ = map.next_value()?,
                        "ip_prefix" => s.ip_prefix = Some(map.next_value()?),
                        "mode" => s.mode = Some(map.next_value()?),
                        other => {
                            if !s.controls.read(other, &mut map)? {
                                let expected: Vec<String> = SCOPE_FIELDS
                                    .iter()
                                    .chain(&RawRules::KEYS)
                                    .map(|f| format!("`{f}`"))
                                    .collect();
                                return Err(A::Error::custom(format!(
                                    "unknown field `{other}`, expected one of {}",
                                    expected.join(", ")
                                )));
                            }
                        }
                    }
                }
                s.key = key.ok_or_else(|| A::Error::missing_field("key"))?;
                Ok(s)
            }
        }
        d.deserialize_map(Fields)
    }
}

/// `ip_prefix = { v4 = 24, v6 = 48 }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawIpPrefix {
    /// Prefix length of IPv4 networks, 1 to 32 (default 32: one address).
    pub v4: Option<u8>,
    /// Prefix length of IPv6 networks, 1 to 128 (default 64).
    pub v6: Option<u8>,
}

/// `requests = { limit = 60, window = "1m" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRequests {
    /// Attempts per window.
    pub limit: u64,
    /// Window length, e.g. `60s`, `1m`, `1h`.
    pub window: String,
}

/// `input_tokens = 8000` or `input_tokens = { max = 8000, mode = "trim" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RawInput {
    /// The limit; a request above it is refused.
    Max(u64),
    /// The limit and what happens above it.
    Rule(RawInputRule),
}

/// `{ max = 8000, mode = "trim" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawInputRule {
    /// The limit.
    pub max: u64,
    /// `reject` (default: a request above it is refused) or `trim` (its oldest turns are
    /// dropped until it fits, and it is refused only if it still does not).
    pub mode: Option<String>,
}

/// `output_tokens = { max = 1000, mode = "clamp", default = 512 }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOutput {
    /// The cap.
    pub max: u64,
    /// `reject` (a request over the cap is refused) or `clamp` (it is lowered to the cap).
    pub mode: Option<String>,
    /// The cap given to a request that states none (defaults to `max`).
    pub default: Option<u64>,
}

/// `concurrency = { limit = 2, lease_ttl = "5m" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConcurrency {
    /// Unfinished requests at once.
    pub limit: u64,
    /// How long a lease lives without renewal (default 5m).
    pub lease_ttl: Option<String>,
}

/// `budget = { tokens = 100000, period = "day" }` or `{ micro_usd = 5000000, period = "month" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    /// A budget in tokens (input + output).
    pub tokens: Option<u64>,
    /// A budget in money, integer micro-units.
    pub micro_usd: Option<u64>,
    /// `day`, `month` (UTC calendar), a fixed duration such as `1h`, `7d`, or a calendar in a
    /// zone (`{ every = "month", zone = "Europe/Berlin", starts = "1 09:00" }`).
    pub period: RawPeriod,
    /// Per cent of the limit at which an alert fires, once per scope and period.
    #[serde(default)]
    pub alert_at: Vec<u64>,
    /// What a period leaves unused is added to the next one's, up to this share of the limit
    /// (`"25%"`); off by default.
    pub carry_over: Option<String>,
}

/// `tool_calls = { limit = 50, period = "1h" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawToolCalls {
    /// Tool calls per period.
    pub limit: u64,
    /// As a budget's.
    pub period: RawPeriod,
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

/// `loops = { max_identical = 3, window = "10m" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLoops {
    /// How many identical requests may be sent within the window, and how often one tool call
    /// (name and arguments) may appear in one request's history.
    pub max_identical: u64,
    /// The window of request repeats, e.g. `10m`.
    pub window: String,
}

// ---------------------------------------------------------------------------------------------
// Validated.
