//! The cost cap of one request: `request_cost = "$0.50"` refuses a request whose estimate
//! (input + the granted output cap, at its model's and tier's price) costs more, before any
//! state is touched. It is the money form of `total_tokens`: a budget stops a caller who spends
//! too much over a period, this stops one request that would spend too much at once, on any
//! model, so one long prompt to an expensive model cannot take a large part of a budget.
//!
//! It needs no state: the pipeline decides it when it makes the plan, as a verdict after the
//! token limits, and a request over it is refused whatever its budget holds. A model without a
//! price cannot be checked, so it is refused as a money budget refuses it.

use std::num::NonZeroU64;

use super::budget::PlanError;
use super::budget::Pricing;
use crate::decision::{Deny, Reason};
use crate::ledger::micro_usd;
use crate::prices::Prices;
use crate::rule::PolicyError;
use crate::scope::ScopeKey;

/// The reason a request over its cost cap is refused with.
pub const REASON: Reason = Reason::RequestCostLimit;

/// The cost cap of rule `path` as written, in micro-USD: `request_cost = "$0.50"` (or
/// `"0.5USD"`), more than zero, with a `[prices]` table to price requests by.
pub fn rule(
    raw: Option<String>,
    path: &str,
    prices: &Prices,
) -> Result<Option<NonZeroU64>, PolicyError> {
    let Some(text) = raw else { return Ok(None) };
    let path = format!("{path}.request_cost");
    let cap = micro_usd(&text).and_then(NonZeroU64::new).ok_or_else(|| {
        PolicyError::new(
            &path,
            format!("{text:?}: expected dollars above zero, e.g. \"$0.50\" or \"2USD\""),
        )
    })?;
    if prices.is_empty() {
        return Err(PolicyError::new(path, "a cost cap needs a [prices] table"));
    }
    Ok(Some(cap))
}

/// The first cost cap among `rules` (in policy order) that the request's estimate exceeds.
pub fn verdict<'a>(
    mut rules: impl Iterator<Item = (Option<NonZeroU64>, &'a ScopeKey)>,
    p: Pricing<'_>,
) -> Result<Option<Deny>, PlanError> {
    rules.try_fold(None, |found, (r, k)| {
        let Some(cap) = r.filter(|_| found.is_none()) else {
            return Ok(found);
        };
        let cost = p.cost(k)?;
        Ok((cost > cap.get()).then(|| Deny {
            reason: REASON,
            scope: k.clone(),
            limit: cap.get(),
            remaining: cap.get(),
            requested: cost,
            retry_after_ms: None,
            reset_after_ms: None,
        }))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prices() -> Prices {
        let text =
            "price_catalog = \"none\"\n[prices.\"gpt-4o\"]\ninput = 2500000\noutput = 10000000\n";
        crate::Policy::from_toml(text)
            .map(|p| p.prices.clone())
            .unwrap_or_default()
    }

    #[test]
    fn a_cap_is_written_in_dollars() {
        let cap = |t: &str| rule(Some(t.to_owned()), "policy.scopes[0]", &prices());
        assert_eq!(
            cap("$0.50").ok().flatten().map(NonZeroU64::get),
            Some(500_000)
        );
        assert_eq!(
            cap("2USD").ok().flatten().map(NonZeroU64::get),
            Some(2_000_000)
        );
        for bad in ["0.5", "$0", "$-1", "fifty cents", "$0.0000001"] {
            let e = cap(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(
                e.contains("policy.scopes[0].request_cost") && e.contains("expected dollars"),
                "{bad}: {e}"
            );
        }
        let unpriced = rule(Some("$1".into()), "policy.scopes[0]", &Default::default());
        assert!(
            unpriced
                .err()
                .is_some_and(|e| e.to_string().contains("needs a [prices] table"))
        );
    }
}
