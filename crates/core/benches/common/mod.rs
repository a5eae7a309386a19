//! Policies and usage shared by the admit bench and the instruction-count bench.

use tollgate_core::{Dimension, Identity, Policy, RequestFacts, Usage};

pub const ONE_SCOPE: &str = r#"
    [[scopes]]
    key = "user"
    requests = { limit = 1000000000, window = "1s" }
    input_tokens = 100000
    concurrency = { limit = 1000000 }
    budget = { tokens = 1000000000000, period = "day" }
"#;

/// What every settled request in these benchmarks used.
pub const USAGE: Usage = Usage {
    input_tokens: 500,
    cached_input_tokens: 0,
    output_tokens: 100,
    cache_write_tokens: 0,
    cache_write_1h_tokens: 0,
    tool_calls: 0,
    fees: 0,
};

pub const FIVE_SCOPES: &str = r#"
    [[scopes]]
    name = "all"
    key = "global"
    requests = { limit = 1000000000, window = "1s" }
    concurrency = { limit = 1000000 }
    budget = { tokens = 1000000000000, period = "day" }
    [[scopes]]
    key = "tenant"
    requests = { limit = 1000000000, window = "1s" }
    budget = { tokens = 1000000000000, period = "month" }
    [[scopes]]
    key = "key"
    requests = { limit = 1000000000, window = "1m" }
    concurrency = { limit = 1000000 }
    [[scopes]]
    key = "user"
    requests = { limit = 1000000000, window = "1s" }
    input_tokens = 100000
    total_tokens = 1000000
    concurrency = { limit = 1000000 }
    budget = { tokens = 1000000000000, period = "day" }
    [[scopes]]
    key = "tenant/model"
    budget = { tokens = 1000000000000, period = "1h" }
"#;

/// A request of one of 64 users of tenant `acme`, key `k1`, model `gpt-4o`: 500 input tokens,
/// at most 200 output tokens.
pub fn facts(request_id: String, user: u64) -> RequestFacts {
    RequestFacts {
        request_id,
        identity: Identity::default()
            .with(Dimension::Tenant, "acme")
            .with(Dimension::Key, "k1")
            .with(Dimension::User, format!("user-{}", user % 64))
            .with(Dimension::Model, "gpt-4o"),
        input_tokens: 500,
        max_output_tokens: Some(200),
        ..RequestFacts::default()
    }
}

/// A shadow rule trying a stricter rate and budget on the users of [`ONE_SCOPE`].
pub const SHADOW_RULE: &str = r#"
    [[scopes]]
    name = "user-trial"
    key = "user"
    mode = "shadow"
    requests = { limit = 500000000, window = "1s" }
    budget = { tokens = 500000000000, period = "day" }
"#;

/// The one-scope policy, the five-scope one when `scopes` names five (`"5 scopes"`, `"plan5"`),
/// or the one-scope policy with a shadow rule when it names `shadow`.
pub fn policy(scopes: &str) -> Policy {
    let text = if scopes.contains('5') {
        FIVE_SCOPES.to_owned()
    } else if scopes.contains("shadow") {
        format!("{ONE_SCOPE}{SHADOW_RULE}")
    } else {
        ONE_SCOPE.to_owned()
    };
    Policy::from_toml(&text).unwrap()
}
