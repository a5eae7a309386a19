//! Degrade before refusing: past a share of a rule's budget, a request for a listed model is
//! sent to a cheaper one instead, e.g. `degrade = { at = "80%", models = { "gpt-4o" =
//! "gpt-4o-mini" } }`. It refuses nothing and makes no check of a plan: the gateway reads the
//! budget's use before the plan is made (a read, not a hold: the budget itself is still
//! reserved atomically, at the cheaper model's price), swaps the model, and the decision record
//! and a response header say so. A request is degraded once: a model degraded to is never
//! degraded further.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::rule::PolicyError;

/// `degrade = { at, models }` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDegrade {
    /// The share of the rule's budget used (settled and reserved) from which models are
    /// degraded: `"80%"`.
    pub at: String,
    /// Each model degraded, and the model it goes to.
    pub models: BTreeMap<String, String>,
}

/// A rule's degrading, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Degrade {
    /// Per cent of the budget from which it applies (1 to 100).
    pub at_percent: u64,
    /// Each model degraded, and the model it goes to.
    pub models: BTreeMap<String, String>,
}

/// The degrade part of rule `path` as written: on a rule with a budget, at a share from 1% to
/// 100%, at least one model, none to itself and none to a model it degrades too.
pub fn rule(
    raw: Option<RawDegrade>,
    budget: bool,
    path: &str,
) -> Result<Option<Degrade>, PolicyError> {
    let Some(raw) = raw else { return Ok(None) };
    let path = format!("{path}.degrade");
    if !budget {
        return Err(PolicyError::new(
            path,
            "degrades past a share of the rule's budget: set `budget` too",
        ));
    }
    let at_percent = crate::rule::percent(&raw.at, &format!("{path}.at"))?;
    if raw.models.is_empty() {
        return Err(PolicyError::new(
            format!("{path}.models"),
            "name at least one model and the model it goes to",
        ));
    }
    for (from, to) in &raw.models {
        let at = format!("{path}.models.{from}");
        if from == to {
            return Err(PolicyError::new(at, "a model cannot be degraded to itself"));
        }
        if raw.models.contains_key(to) {
            return Err(PolicyError::new(
                at,
                format!("{to:?} is degraded too: a request is degraded once, so name the last"),
            ));
        }
    }
    Ok(Some(Degrade {
        at_percent,
        models: raw.models,
    }))
}

impl Degrade {
    /// The model a request for `model` goes to, when the budget has `used` (settled and
    /// reserved) of `limit`.
    pub fn to(&self, model: &str, used: u64, limit: u64) -> Option<&str> {
        let to = self.models.get(model)?;
        let past = u128::from(used) * 100 >= u128::from(limit) * u128::from(self.at_percent);
        past.then_some(to.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn degrade(at: &str, models: &[(&str, &str)], budget: bool) -> Result<Option<Degrade>, String> {
        let raw = RawDegrade {
            at: at.to_owned(),
            models: models
                .iter()
                .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
                .collect(),
        };
        rule(Some(raw), budget, "policy.scopes[0]").map_err(|e| e.to_string())
    }

    #[test]
    fn a_listed_model_goes_to_its_cheaper_one_past_the_share() {
        let d = degrade("80%", &[("gpt-4o", "gpt-4o-mini")], true)
            .unwrap_or_else(|e| unreachable!("{e}"))
            .unwrap_or_else(|| unreachable!());
        assert_eq!(d.to("gpt-4o", 799, 1000), None);
        assert_eq!(d.to("gpt-4o", 800, 1000), Some("gpt-4o-mini"));
        assert_eq!(d.to("gpt-4o", u64::MAX, u64::MAX), Some("gpt-4o-mini"));
        assert_eq!(d.to("claude-sonnet-4", 1000, 1000), None);
    }

    #[test]
    fn bad_degrades_are_named() {
        let e = |at: &str, models: &[(&str, &str)], budget: bool| {
            degrade(at, models, budget).err().unwrap_or_default()
        };
        let m = [("gpt-4o", "gpt-4o-mini")];
        assert!(e("80%", &m, false).contains("degrade: degrades past a share"));
        assert!(e("80", &m, true).contains("degrade.at: \"80\": expected a share"));
        assert!(e("80%", &[], true).contains("degrade.models: name at least one"));
        assert!(e("80%", &[("a", "a")], true).contains("models.a: a model cannot"));
        let chain = e("80%", &[("a", "b"), ("b", "c")], true);
        assert!(chain.contains("models.a: \"b\" is degraded too"), "{chain}");
    }
}
