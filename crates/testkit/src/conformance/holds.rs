//! The conformance case of a provider's hold: a kill switch with an end, set for a length and
//! kept by the store as an instant of its own clock. It refuses its model's requests until
//! then, on every instance, and nothing after.

use tollgate_core::decision::Killed;
use tollgate_core::{Decision, Store};

use super::{admit, setup};
use crate::{Harness, facts, policy};

const POLICY: &str = r#"
[[scopes]]
key = "user"
requests = { limit = 100, window = "1m" }
"#;

/// Held for two seconds: refused with the hold's end until then (and counting nothing), then
/// admitted.
pub async fn a_provider_hold_refuses_its_model_until_it_ends<H: Harness>(h: &H) {
    let p = policy(POLICY);
    let (s, clock) = setup(h).await;
    let start = tollgate_core::Clock::now(&clock);
    s.set_kill(
        "provider:gpt-4o",
        Some(&Killed::hold_for(2_000, None, "no requests left")),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    match admit(&s, &p, facts("a", "u", 1, 1)).await {
        Decision::Killed(k) => assert_eq!(
            (k.target.as_str(), k.reason.as_str(), k.until),
            ("provider:gpt-4o", "no requests left", Some(start + 2_000))
        ),
        other => panic!("expected the hold, got {other:?}"),
    }
    clock.advance(1_999);
    assert!(matches!(
        admit(&s, &p, facts("b", "u", 1, 1)).await,
        Decision::Killed(_)
    ));
    clock.advance(1);
    assert!(matches!(
        admit(&s, &p, facts("c", "u", 1, 1)).await,
        Decision::Admit(_)
    ));
}

/// A hold of large requests only (the provider said 500 tokens are left): a request of more
/// than 500 tokens (input and output cap) is refused with the hold's reason and end, one of
/// 500 is admitted, and after the end every size is.
pub async fn a_providers_token_hold_refuses_only_larger_requests<H: Harness>(h: &H) {
    let p = policy(POLICY);
    let (s, clock) = setup(h).await;
    let start = tollgate_core::Clock::now(&clock);
    let hold = Killed::hold_for(3_000, Some(500), "only 500 tokens are left");
    s.set_kill("provider:gpt-4o", Some(&hold))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    match admit(&s, &p, facts("big", "u", 101, 400)).await {
        Decision::Killed(k) => assert_eq!(
            (k.reason.as_str(), k.until),
            ("only 500 tokens are left", Some(start + 3_000))
        ),
        other => panic!("expected the hold, got {other:?}"),
    }
    assert!(matches!(
        admit(&s, &p, facts("fits", "u", 100, 400)).await,
        Decision::Admit(_)
    ));
    clock.advance(3_000);
    assert!(matches!(
        admit(&s, &p, facts("after", "u", 5_000, 5_000)).await,
        Decision::Admit(_)
    ));
}
