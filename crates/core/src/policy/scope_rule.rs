//! A policy's rules checked one by one: each field's bounds, with the path of the field that is
//! wrong in the error.

use std::sync::Arc;

use super::raw::{RawIpPrefix, RawScope};
use crate::rule::PolicyError;
use crate::scope::{Dimension, Identity, IpPrefix, ScopeKey};

/// A rule's `ip_prefix`: only on rules keyed on `ip`; each length within its family's.
pub(super) fn validate_ip_prefix(
    raw: Option<&RawIpPrefix>,
    dims: &[Dimension],
    path: &str,
) -> Result<IpPrefix, PolicyError> {
    let d = IpPrefix::default();
    let Some(p) = raw else { return Ok(d) };
    if !dims.contains(&Dimension::Ip) {
        return Err(PolicyError::new(
            format!("{path}.ip_prefix"),
            "applies only to a rule keyed on ip",
        ));
    }
    let (v4, v6) = (p.v4.unwrap_or(d.v4), p.v6.unwrap_or(d.v6));
    if !(1..=32).contains(&v4) {
        return Err(PolicyError::new(
            format!("{path}.ip_prefix.v4"),
            "must be from 1 to 32",
        ));
    }
    if !(1..=128).contains(&v6) {
        return Err(PolicyError::new(
            format!("{path}.ip_prefix.v6"),
            "must be from 1 to 128",
        ));
    }
    Ok(IpPrefix { v4, v6 })
}

pub(super) fn validate_scope(
    s: RawScope,
    path: &str,
    prices: &crate::policy::Prices,
    classes: &crate::controls::reserve::Classes,
) -> Result<ScopeRule, PolicyError> {
    let dims = validate_dims(&s.key, path)?;
    let ip_prefix = validate_ip_prefix(s.ip_prefix.as_ref(), &dims, path)?;
    let name: Arc<str> = s.name.unwrap_or_else(|| s.key.trim().to_owned()).into();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '/' | '.'))
    {
        return Err(PolicyError::new(
            format!("{path}.name"),
            "must be non-empty ASCII letters, digits, '-', '_', '.', '/'",
        ));
    }
    let mut matches = Vec::new();
    for (k, v) in s.match_ {
        let d = Dimension::parse(&k)
            .ok_or_else(|| PolicyError::new(format!("{path}.match.{k}"), "unknown dimension"))?;
        matches.push((d, v));
    }
    let controls = crate::controls::Rules::check(s.controls, path, prices, classes)?;
    let shadow = shadow_mode(s.mode.as_deref(), controls.trim_input, path)?;
    let global_key = dims
        .is_empty()
        .then(|| ScopeKey::derive(&name, &dims, &Identity::default()))
        .flatten();
    Ok(ScopeRule {
        global_key,
        same_key_as: None,
        ip_prefix,
        name,
        dims,
        matches,
        controls,
        shadow,
    })
}

/// `mode`: `enforce` (the default) or `shadow`; a shadow rule cannot trim.
pub(super) fn shadow_mode(
    mode: Option<&str>,
    trim_input: bool,
    path: &str,
) -> Result<bool, PolicyError> {
    let shadow = match mode {
        None | Some("enforce") => false,
        Some("shadow") => true,
        Some(m) => {
            return Err(PolicyError::new(
                format!("{path}.mode"),
                format!("unknown mode {m:?}; expected \"enforce\" or \"shadow\""),
            ));
        }
    };
    // Trimming changes the request itself, which a rule that must not change answers cannot.
    if shadow && trim_input {
        return Err(PolicyError::new(
            format!("{path}.input_tokens.mode"),
            "a shadow rule cannot trim: trimming would change the request; use \"reject\" to see which requests it would refuse",
        ));
    }
    Ok(shadow)
}

/// `key`: `global`, or dimensions joined by `/`, each once; sorted.
pub(super) fn validate_dims(key: &str, path: &str) -> Result<Vec<Dimension>, PolicyError> {
    let key_path = format!("{path}.key");
    let mut dims = Vec::new();
    if key.trim() != "global" {
        for part in key.split('/') {
            let d = Dimension::parse(part.trim()).ok_or_else(|| {
                PolicyError::new(
                    &key_path,
                    format!(
                        "unknown dimension {part:?}; expected \"global\" or tenant, key, user, ip, model, operation joined by '/'"
                    ),
                )
            })?;
            if dims.contains(&d) {
                return Err(PolicyError::new(&key_path, format!("dimension {d} twice")));
            }
            dims.push(d);
        }
    }
    dims.sort();
    Ok(dims)
}

/// One validated scope rule.
#[derive(Debug, Clone)]
pub struct ScopeRule {
    /// Unique rule name.
    pub name: Arc<str>,
    /// Dimensions in canonical order; empty for global.
    pub dims: Vec<Dimension>,
    /// Required dimension values.
    pub matches: Vec<(Dimension, String)>,
    /// Every control's part of the rule, read as the rule's own fields (`rule.budget`).
    pub controls: crate::controls::Rules,
    /// How client addresses are grouped into `ip` scopes.
    pub ip_prefix: IpPrefix,
    /// A shadow rule: its controls are evaluated and its counters, leases and reservations
    /// kept as if it were enforced, in a plan of its own ([`crate::shadow_plan`]), but it never
    /// refuses; a refusal it would have made is recorded and counted.
    pub shadow: bool,
    /// The one key of a rule with no dimensions (`name|global`), derived once here so that
    /// a plan shares it instead of building it per request.
    pub global_key: Option<ScopeKey>,
    /// The first earlier rule over the same dimensions and address grouping: where both apply,
    /// this rule's key is that rule's renamed ([`ScopeKey::renamed`]), not derived again (a
    /// shadow rule trying other limits on an enforced rule's scopes is the common case).
    pub same_key_as: Option<usize>,
}

impl ScopeRule {
    /// The key of this rule's scope for `identity`, when the rule applies to it: its matches
    /// met and its dimensions known.
    pub fn key_of(&self, identity: &crate::scope::Identity) -> Option<ScopeKey> {
        if self
            .matches
            .iter()
            .any(|(d, v)| identity.get(*d) != Some(v.as_str()))
        {
            return None;
        }
        ScopeKey::derive_in(&self.name, &self.dims, identity, self.ip_prefix)
    }
}

impl std::ops::Deref for ScopeRule {
    type Target = crate::controls::Rules;

    fn deref(&self) -> &Self::Target {
        &self.controls
    }
}

impl std::ops::DerefMut for ScopeRule {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.controls
    }
}
