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
