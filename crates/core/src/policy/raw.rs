//! The policy as written: every table deserialized, unknown fields refused, nothing checked.

use std::collections::BTreeMap;

use std::fmt;

use serde::de::{Error as _, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

pub use crate::controls::RawRules;
use crate::prices::RawPrice;

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

// ---------------------------------------------------------------------------------------------
// Validated.
