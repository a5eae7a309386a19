//! The conformance case of fees: what a money budget charges besides token prices (the calls of
//! tools the upstream runs, audio, a long context). Reserved with the estimate, charged as the
//! settlement states them, and charged in full when the request expires without one.

use tollgate_core::{Finish, Metered, Usage};

use super::{DAY, budget_of, plan_of, reason, settle, setup};
use crate::{Harness, facts, policy};

const POLICY: &str = r#"
reservation_ttl = "30s"
price_catalog = "none"
[prices."gpt-4o"]
input = 2500000
output = 10000000
web_search = 10000
[[scopes]]
key = "tenant"
budget = { micro_usd = 100000, period = "day" }
"#;

/// Two web searches at a cent each on top of 1,000 + 100 tokens (2,500 + 1,000 micro-dollars):
/// 23,500 reserved; settled with the one search made, 13,500 charged; an expired request is
/// charged both searches it was allowed.
pub async fn fees_are_reserved_settled_and_charged_on_expiry<H: Harness>(h: &H) {
    let p = policy(POLICY);
    let (s, clock) = setup(h).await;
    let mut f = facts("a", "u", 1000, 100);
    f.metered = Metered {
        web_searches: 2,
        ..Metered::default()
    };
    let plan = plan_of(&p, &f);
    assert_eq!(plan.expired_usage.fees, 20_000);
    assert_eq!(reason(&s, &p, f.clone()).await, None);
    assert_eq!(budget_of(&s, "tenant|tenant:acme", DAY).await, (0, 23_500));
    let rule = plan
        .fees
        .unwrap_or_else(|| panic!("a priced model has a fee rule"));
    let used = Usage {
        input_tokens: 1000,
        output_tokens: 100,
        ..Usage::default()
    };
    let one = Metered {
        web_searches: 1,
        ..Metered::default()
    };
    let charged = Usage {
        fees: rule.fees(&used, Some(&one)),
        ..used
    };
    assert_eq!(
        settle(&s, "a", charged).await,
        Finish::Done {
            charged: vec![13_500]
        }
    );
    assert_eq!(budget_of(&s, "tenant|tenant:acme", DAY).await, (13_500, 0));
    // Expired: the reservation, fees included.
    f.request_id = "b".into();
    assert_eq!(reason(&s, &p, f).await, None);
    clock.advance(30_000);
    assert_eq!(reason(&s, &p, facts("c", "v", 1, 1)).await, None);
    let (settled, _) = budget_of(&s, "tenant|tenant:acme", DAY).await;
    assert_eq!(settled, 13_500 + 23_500);
}

/// A tool the model has no price for cannot be reserved in money: refused when planned.
pub async fn an_unpriced_fee_is_refused_under_a_money_budget<H: Harness>(h: &H) {
    let p = policy(POLICY);
    let (_s, _) = setup(h).await;
    let mut f = facts("a", "u", 10, 10);
    f.metered.file_searches = 1;
    let e = tollgate_core::plan(&p, &f).err().map(|e| e.to_string());
    assert!(
        e.as_deref()
            .is_some_and(|e| e.contains("no price for file search")),
        "{e:?}"
    );
}
