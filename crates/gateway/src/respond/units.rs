//! A budget's headers in its own unit: OpenAI's `x-ratelimit-*-tokens` for a budget in tokens
//! (what SDKs and dashboards read as tokens), and `x-tollgate-budget-*-usd` in dollars for a
//! budget in money, so that micro-dollars are never read as tokens.

use axum::http::{HeaderMap, HeaderName};
use tollgate_core::ledger::dollars;
use tollgate_core::{Quota, Reason, Unit};

use super::{openai_duration, put_built, put_number};

const LIMIT_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
const REMAINING_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
const RESET_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");
const LIMIT_USD: HeaderName = HeaderName::from_static("x-tollgate-budget-limit-usd");
const REMAINING_USD: HeaderName = HeaderName::from_static("x-tollgate-budget-remaining-usd");
const RESET_USD: HeaderName = HeaderName::from_static("x-tollgate-budget-reset");

/// The first budget in tokens, and the first in money, each in its own headers.
pub(super) fn budget_headers(
    h: &mut HeaderMap,
    quotas: &[Quota],
    unit: impl Fn(&Quota) -> Option<Unit>,
) {
    let budget = |want: Unit| {
        quotas
            .iter()
            .find(|q| q.reason == Reason::BudgetLimit && unit(q) == Some(want))
    };
    if let Some(q) = budget(Unit::Tokens) {
        put_number(h, LIMIT_TOKENS, q.limit);
        put_number(h, REMAINING_TOKENS, q.remaining);
        put_built(
            h,
            RESET_TOKENS,
            openai_duration(q.reset_after_ms.unwrap_or(0)),
        );
    }
    if let Some(q) = budget(Unit::MicroUsd) {
        put_built(h, LIMIT_USD, dollars(q.limit));
        put_built(h, REMAINING_USD, dollars(q.remaining));
        put_built(h, RESET_USD, openai_duration(q.reset_after_ms.unwrap_or(0)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(check: usize) -> Quota {
        Quota {
            reason: Reason::BudgetLimit,
            check,
            limit: 10_000,
            remaining: 2_500,
            window_ms: Some(86_400_000),
            reset_after_ms: Some(60_000),
        }
    }

    #[test]
    fn money_is_told_in_dollars_and_never_as_tokens() {
        let mut h = HeaderMap::new();
        budget_headers(&mut h, &[quota(0)], |_| Some(Unit::MicroUsd));
        let get =
            |h: &HeaderMap, n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
        assert_eq!(get(&h, "x-ratelimit-limit-tokens"), None);
        assert_eq!(
            get(&h, "x-tollgate-budget-limit-usd").as_deref(),
            Some("$0.01")
        );
        assert_eq!(
            get(&h, "x-tollgate-budget-remaining-usd").as_deref(),
            Some("$0.0025")
        );
        assert_eq!(get(&h, "x-tollgate-budget-reset").as_deref(), Some("1m0s"));
        // Both kinds of budget: each in its own headers.
        let mut h = HeaderMap::new();
        let unit = |q: &Quota| {
            Some(if q.check == 0 {
                Unit::Tokens
            } else {
                Unit::MicroUsd
            })
        };
        budget_headers(&mut h, &[quota(0), quota(1)], unit);
        assert_eq!(
            get(&h, "x-ratelimit-limit-tokens").as_deref(),
            Some("10000")
        );
        assert_eq!(
            get(&h, "x-tollgate-budget-limit-usd").as_deref(),
            Some("$0.01")
        );
    }
}
