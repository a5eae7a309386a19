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
        Some(&Killed::hold_for(2_000, "no requests left")),
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
