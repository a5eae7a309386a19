//! What an abandoned request is charged, as the policy says.

use super::*;

/// What an abandoned request is charged, as the policy says.
pub(super) fn expired_usage(policy: &Policy, estimate: Usage) -> Usage {
    // Without cache writes: the Redis ticket keeps input, cached input and output only, and
    // what an abandoned request wrote to a cache is not known.
    let estimate = Usage {
        cache_write_1h_tokens: 0,
        ..estimate
    };
    match policy.expired_charge {
        // With the round's one reserved tool call, which it may have made.
        crate::policy::ExpiredCharge::Full => Usage {
            tool_calls: 1,
            ..estimate
        },
        crate::policy::ExpiredCharge::Input => Usage {
            output_tokens: 0,
            ..estimate
        },
        crate::policy::ExpiredCharge::None => Usage::default(),
    }
}

/// How `model`'s fees are reckoned, with the estimate's fees for using `most` set; and what the
/// model has no price for, if anything.
pub(super) fn fee_rule(
    policy: &Policy,
    model: &str,
    most: crate::ledger::Metered,
    estimate: &mut Usage,
) -> (Option<crate::policy::FeeRule>, Option<&'static str>) {
    let Some(price) = policy.prices.price(model, None) else {
        return (None, None);
    };
    let rule = crate::policy::FeeRule {
        price,
        charges: policy.prices.charges(model),
        most,
    };
    match rule.charges.fees(&price, estimate, &most) {
        Ok(f) => {
            estimate.fees = f;
            (Some(rule), None)
        }
        Err(what) => (Some(rule), Some(what)),
    }
}
