use super::*;
use tollgate_core::{Dimension, Identity, Policy, RequestFacts, plan};

/// The exact KEYS and ARGV of a typical admission: one scope with every control.
#[test]
fn admit_sends_exactly_these_arguments() {
    let policy = Policy::from_toml(
        r#"
        expired_reservation_charge = "input"
        [prices."gpt-4o"]
        input = 2500000
        output = 10000000
        [[scopes]]
        key = "user"
        requests = { limit = 5, window = "1m" }
        input_tokens = 100
        concurrency = { limit = 2, lease_ttl = "30s" }
        budget = { tokens = 300, period = "day" }
        [[scopes]]
        key = "tenant"
        budget = { micro_usd = 5000000, period = "month" }
        "#,
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    let facts = RequestFacts {
        request_id: "req-1".into(),
        identity: Identity::default()
            .with(Dimension::User, "alice")
            .with(Dimension::Tenant, "acme")
            .with(Dimension::Model, "gpt-4o"),
        input_tokens: 40,
        max_output_tokens: Some(60),
    };
    let p = plan(&policy, &facts).unwrap_or_else(|e| unreachable!("{e}"));
    let inv = admit_invocation("tg", &p, 0, 3_600_000);
    assert_eq!(
        inv.keys,
        [
            "tg:t:req-1",
            "tg:f:req-1",
            "tg:x",
            "tg:clock",
            "tg:kill",
            "tg:r:user|user:alice",
            "tg:l:user|user:alice",
            "tg:b:user|user:alice",
            "tg:b:tenant|tenant:acme"
        ]
    );
    assert_eq!(
        inv.args,
        [
            "tg",
            "0",
            "req-1",
            "30000",
            "3600000",
            "0",
            "1",
            "1",
            "2",
            "2500000,2500000,10000000",
            "40,0,0",
            "4",
            "all",
            "tenant:acme",
            "model:gpt-4o",
            "user:alice",
            "tg:r:user|user:alice",
            "5",
            "60000",
            "tg:l:user|user:alice",
            "2",
            "tg:b:user|user:alice",
            "300",
            "t",
            "86400000",
            "fixed:86400000",
            "100",
            // 40 x 2.5 + 60 x 10 = 700 micro-USD.
            "tg:b:tenant|tenant:acme",
            "5000000",
            "m",
            "0",
            "month",
            "700",
        ]
    );
}
