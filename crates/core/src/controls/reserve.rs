//! Reserved capacity: a share of a scope's concurrency kept for a priority class, e.g. 20% of
//! a model's slots only for `critical`. A request of a class that has no claim on a reserve
//! may hold only the slots left without it, and is refused with this control's reason when
//! they are taken.
//!
//! Reserves nest by weight: the reserve of class `R` is open to requests of `R` and of every
//! class that weighs more than `R`. So `{ critical = "20%", high = "10%" }` on 10 slots lets
//! `standard` hold 7, `high` 8 and `critical` all 10, and every slot is counted once, in the
//! concurrency scope's own leases: the check is concurrency's lease with a smaller limit, so
//! every store and script decides it as it decides concurrency. The slots kept from a request
//! are the shares it has no claim on, together, of the limit, rounded up: a reserve is never
//! empty.
//!
//! A request's class is its key's, else the class that lists its tenant, else `standard`.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Deserialize;

use super::concurrency::ConcurrencyCheck;
use crate::decision::Reason;
use crate::rule::PolicyError;

/// The reason a request outside a reserve is refused with.
pub const REASON: Reason = Reason::CapacityReserved;

/// The class of a request that names none and whose tenant no class lists.
pub const DEFAULT_CLASS: &str = "standard";

/// `[classes.<name>] = { weight, tenants }` as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClass {
    /// Its share of a queue and its rank among reserves (default 1).
    pub weight: Option<u32>,
    /// Tenants whose requests are of this class unless their key names another.
    #[serde(default)]
    pub tenants: Vec<String>,
}

/// The priority classes, checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Classes {
    weights: BTreeMap<Arc<str>, u32>,
    tenants: BTreeMap<String, Arc<str>>,
}

impl Classes {
    /// `[classes]` as written, under `root`: weights from 1 to 1,000, a tenant in one class.
    pub fn check(raw: BTreeMap<String, RawClass>, root: &str) -> Result<Self, PolicyError> {
        let mut c = Classes::default();
        for (name, r) in raw {
            let path = format!("{root}.classes.{name}");
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(PolicyError::new(
                    path,
                    "a class name is ASCII letters, digits, '_'",
                ));
            }
            let weight = r.weight.unwrap_or(1);
            if !(1..=1000).contains(&weight) {
                return Err(PolicyError::new(
                    format!("{path}.weight"),
                    "must be from 1 to 1000",
                ));
            }
            let name: Arc<str> = name.into();
            for t in r.tenants {
                if let Some(other) = c.tenants.insert(t.clone(), name.clone()) {
                    return Err(PolicyError::new(
                        format!("{path}.tenants"),
                        format!("tenant {t:?} is already in class {other:?}"),
                    ));
                }
            }
            c.weights.insert(name, weight);
        }
        Ok(c)
    }

    /// Whether `name` is a class (`standard` always is).
    pub fn has(&self, name: &str) -> bool {
        name == DEFAULT_CLASS || self.weights.contains_key(name)
    }

    /// A class's weight (1 for `standard` unless declared; 1 for an unknown name).
    pub fn weight(&self, name: &str) -> u32 {
        self.weights.get(name).copied().unwrap_or(1)
    }

    /// The class of a request: its key's when it names one, else its tenant's, else
    /// `standard`.
    pub fn of<'a>(&'a self, key_class: Option<&'a str>, tenant: Option<&str>) -> &'a str {
        key_class
            .or_else(|| tenant.and_then(|t| self.tenants.get(t)).map(|c| &**c))
            .unwrap_or(DEFAULT_CLASS)
    }
}

/// A rule's reserves: each class's share of the rule's concurrency, with its weight.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reserve {
    /// (class, its weight, per cent kept for it).
    shares: Vec<(Arc<str>, u32, u64)>,
}

/// The reserve part of rule `path` as written: `reserve = { <class> = "<n>%" }`, each a
/// declared class, on a rule that limits concurrency, the shares at most 100% in all.
pub fn rule(
    raw: Option<BTreeMap<String, String>>,
    concurrency: bool,
    classes: &Classes,
    path: &str,
) -> Result<Option<Reserve>, PolicyError> {
    let Some(raw) = raw else { return Ok(None) };
    let path = format!("{path}.reserve");
    if !concurrency {
        return Err(PolicyError::new(
            path,
            "keeps a share of the rule's concurrency: set `concurrency` too",
        ));
    }
    let mut shares = Vec::new();
    let mut total = 0;
    for (class, share) in raw {
        let at = format!("{path}.{class}");
        if !classes.weights.contains_key(class.as_str()) {
            return Err(PolicyError::new(at, "not a class declared in [classes]"));
        }
        let pct = crate::rule::percent(&share, &at)?;
        total += pct;
        let weight = classes.weight(&class);
        shares.push((Arc::from(class), weight, pct));
    }
    if total > 100 {
        return Err(PolicyError::new(
            path,
            "the shares add up to more than 100%",
        ));
    }
    Ok(Some(Reserve { shares }))
}

/// The lease check a request of `class` (weighing `weight`) takes under `reserve`: the
/// concurrency check with the slots of the reserves it has no claim on taken off its limit,
/// and this control's reason; the concurrency check as it is when it may use every slot.
pub fn apply(
    reserve: &Reserve,
    class: &str,
    weight: u32,
    mut c: ConcurrencyCheck,
) -> (Reason, ConcurrencyCheck) {
    let kept: u64 = reserve
        .shares
        .iter()
        .filter(|(r, w, _)| **r != *class && *w >= weight)
        .map(|(_, _, pct)| pct)
        .sum();
    if kept == 0 {
        return (super::concurrency::REASON, c);
    }
    c.limit = open(c.limit, kept);
    c.kept_percent = kept;
    (REASON, c)
}

/// The leases of a scope of `limit` open to a request from which `kept_percent` is kept.
pub fn open(limit: u64, kept_percent: u64) -> u64 {
    let kept = limit.saturating_mul(kept_percent.min(100)).div_ceil(100);
    limit.saturating_sub(kept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::{Identity, ScopeKey};

    fn classes() -> Classes {
        let raw = [
            ("critical", 4, vec!["acme"]),
            ("high", 2, vec![]),
            ("batch", 1, vec!["bulk"]),
        ]
        .into_iter()
        .map(|(n, w, t)| {
            let r = RawClass {
                weight: Some(w),
                tenants: t.into_iter().map(str::to_owned).collect(),
            };
            (n.to_owned(), r)
        })
        .collect();
        Classes::check(raw, "policy").unwrap_or_else(|e| unreachable!("{e}"))
    }

    fn reserve(shares: &[(&str, &str)], limit: u64) -> Result<Option<Reserve>, PolicyError> {
        let raw = shares
            .iter()
            .map(|(c, s)| ((*c).to_owned(), (*s).to_owned()))
            .collect();
        rule(Some(raw), limit > 0, &classes(), "policy.scopes[0]")
    }

    fn limit_for(r: &Reserve, class: &str) -> (Reason, u64) {
        let c = ConcurrencyCheck {
            scope: ScopeKey::derive("m", &[], &Identity::default())
                .unwrap_or_else(|| unreachable!()),
            limit: 10,
            kept_percent: 0,
        };
        let (reason, c) = apply(r, class, classes().weight(class), c);
        (reason, c.limit)
    }

    #[test]
    fn reserves_nest_by_weight() {
        let r = reserve(&[("critical", "20%"), ("high", "10%")], 10)
            .unwrap_or_else(|e| unreachable!("{e}"))
            .unwrap_or_default();
        assert_eq!(limit_for(&r, "standard"), (REASON, 7));
        assert_eq!(limit_for(&r, "batch"), (REASON, 7));
        assert_eq!(limit_for(&r, "high"), (REASON, 8));
        assert_eq!(limit_for(&r, "critical"), (Reason::ConcurrencyLimit, 10));
    }

    #[test]
    fn a_share_is_whole_slots_rounded_up() {
        let r = reserve(&[("critical", "5%")], 3)
            .unwrap_or_else(|e| unreachable!("{e}"))
            .unwrap_or_default();
        let c = ConcurrencyCheck {
            scope: ScopeKey::derive("m", &[], &Identity::default())
                .unwrap_or_else(|| unreachable!()),
            limit: 3,
            kept_percent: 0,
        };
        assert_eq!(apply(&r, "standard", 1, c).1.limit, 2);
        assert_eq!((open(100, 20), open(7, 30), open(5, 100)), (80, 4, 0));
    }

    #[test]
    fn a_class_is_its_keys_else_its_tenants_else_standard() {
        let c = classes();
        assert_eq!(c.of(Some("high"), Some("acme")), "high");
        assert_eq!(c.of(None, Some("acme")), "critical");
        assert_eq!(c.of(None, Some("other")), DEFAULT_CLASS);
        assert_eq!(c.of(None, None), DEFAULT_CLASS);
    }

    #[test]
    fn bad_reserves_are_named() {
        let e = |shares: &[(&str, &str)]| {
            reserve(shares, 10)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert!(e(&[("vip", "20%")]).contains("reserve.vip: not a class"));
        assert!(e(&[("critical", "20")]).contains("reserve.critical: \"20\": expected a share"));
        assert!(e(&[("critical", "0%")]).contains("expected a share"));
        assert!(e(&[("critical", "60%"), ("high", "50%")]).contains("more than 100%"));
        let no_concurrency = rule(
            Some([("critical".to_owned(), "20%".to_owned())].into()),
            false,
            &classes(),
            "policy.scopes[0]",
        );
        assert!(
            no_concurrency
                .err()
                .is_some_and(|e| e.to_string().contains("set `concurrency` too"))
        );
        let twice = Classes::check(
            [
                (
                    "a".to_owned(),
                    RawClass {
                        weight: None,
                        tenants: vec!["t".into()],
                    },
                ),
                (
                    "b".to_owned(),
                    RawClass {
                        weight: None,
                        tenants: vec!["t".into()],
                    },
                ),
            ]
            .into(),
            "policy",
        );
        assert!(
            twice
                .err()
                .is_some_and(|e| e.to_string().contains("already in class"))
        );
    }
}
