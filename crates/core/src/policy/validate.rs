//! A policy's rules checked one by one: each field's bounds, with the path of the field that is
//! wrong in the error.

#[allow(clippy::wildcard_imports)]
// the policy's types and raw forms, which this module checks
use super::*;

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

/// `output_tokens = { max, mode, default }`: the default at most the max.
pub(crate) fn validate_output(o: RawOutput, path: &str) -> Result<OutputLimit, PolicyError> {
    let max = positive(o.max, &format!("{path}.output_tokens.max"))?;
    let mode = match o.mode.as_deref() {
        None | Some("reject") => OutputMode::Reject,
        Some("clamp") => OutputMode::Clamp,
        Some(m) => {
            return Err(PolicyError::new(
                format!("{path}.output_tokens.mode"),
                format!("unknown mode {m:?}; expected \"reject\" or \"clamp\""),
            ));
        }
    };
    let default = match o.default {
        Some(d) => positive(d, &format!("{path}.output_tokens.default"))?,
        None => max,
    };
    if default > max {
        return Err(PolicyError::new(
            format!("{path}.output_tokens.default"),
            format!("{default} is above max {max}"),
        ));
    }
    Ok(OutputLimit { max, mode, default })
}

/// `budget = { tokens | micro_usd, period }`: money needs prices.
pub(crate) fn validate_budget(
    b: RawBudget,
    path: &str,
    prices: &crate::policy::Prices,
) -> Result<BudgetLimit, PolicyError> {
    let bpath = format!("{path}.budget");
    let (limit, unit) = match (b.tokens, b.micro_usd) {
        (Some(t), None) => (positive(t, &format!("{bpath}.tokens"))?, Unit::Tokens),
        (None, Some(m)) => {
            if prices.is_empty() {
                return Err(PolicyError::new(
                    format!("{bpath}.micro_usd"),
                    "a money budget needs a [prices] table",
                ));
            }
            (positive(m, &format!("{bpath}.micro_usd"))?, Unit::MicroUsd)
        }
        _ => {
            return Err(PolicyError::new(
                bpath,
                "give exactly one of `tokens` or `micro_usd`",
            ));
        }
    };
    let period =
        Period::of(&b.period).map_err(|m| PolicyError::new(format!("{bpath}.period"), m))?;
    let alert_at =
        AlertAt::of(&b.alert_at).map_err(|m| PolicyError::new(format!("{bpath}.alert_at"), m))?;
    let carry_cap = match b.carry_over.as_deref() {
        None => 0,
        Some(share) => {
            let pct = percent(share, &format!("{bpath}.carry_over"))?;
            limit.get().saturating_mul(pct) / 100
        }
    };
    Ok(BudgetLimit {
        limit,
        unit,
        period,
        alert_at,
        carry_cap,
    })
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
