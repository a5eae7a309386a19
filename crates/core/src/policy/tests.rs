use super::*;
use crate::ledger::Period;
use crate::scope::{Dimension, IpPrefix};

fn err(text: &str) -> PolicyError {
    match Policy::from_toml(text) {
        Err(e) => e,
        Ok(_) => unreachable!("policy should be rejected:\n{text}"),
    }
}

#[test]
fn errors_name_the_field_path() {
    let e = err(r#"
        [[scopes]]
        key = "user"
        [[scopes]]
        key = "tenant"
        [[scopes]]
        key = "model"
        budget = { tokens = 10, period = "fortnight" }
    "#);
    assert_eq!(e.path, "policy.scopes[2].budget.period");
    assert!(e.message.contains("fortnight"), "{e}");
}

#[test]
fn zero_limits_and_bad_values_are_refused() {
    let cases = [
        (
            r#"[[scopes]]
key = "user"
requests = { limit = 0, window = "1m" }"#,
            "policy.scopes[0].requests.limit",
        ),
        (
            r#"[[scopes]]
key = "user"
requests = { limit = 3, window = "soon" }"#,
            "policy.scopes[0].requests.window",
        ),
        (
            r#"[[scopes]]
key = "user/planet""#,
            "policy.scopes[0].key",
        ),
        (
            r#"[[scopes]]
key = "user"
output_tokens = { max = 10, default = 20 }"#,
            "policy.scopes[0].output_tokens.default",
        ),
        (
            r#"[[scopes]]
key = "user"
output_tokens = { max = 10, mode = "shrug" }"#,
            "policy.scopes[0].output_tokens.mode",
        ),
        (
            r#"[[scopes]]
key = "user"
budget = { tokens = 10, micro_usd = 5, period = "day" }"#,
            "policy.scopes[0].budget",
        ),
        (
            r#"price_catalog = "none"
[[scopes]]
key = "user"
budget = { micro_usd = 5, period = "day" }"#,
            "policy.scopes[0].budget.micro_usd",
        ),
        (r#"price_catalog = "somewhere""#, "policy.price_catalog"),
        (
            r#"[prices.m]
input = 1
output = 1
tiers.priority = { input = 2, output = 2, web_search = 5 }"#,
            "policy.prices.\"m\".tiers.\"priority\"",
        ),
        (
            r#"[[scopes]]
key = "user"
[[scopes]]
key = "user""#,
            "policy.scopes[1].name",
        ),
        (
            r#"expired_reservation_charge = "half""#,
            "policy.expired_reservation_charge",
        ),
        (
            r#"[[scopes]]
key = "user"
concurrency = { limit = 2, lease_ttl = "0s" }"#,
            "policy.scopes[0].concurrency.lease_ttl",
        ),
        (
            r#"[[scopes]]
key = "user"
input_tokens = 10000000000000"#,
            "policy.scopes[0].input_tokens",
        ),
    ];
    for (text, path) in cases {
        assert_eq!(err(text).path, path, "for:\n{text}");
    }
}

#[test]
fn unknown_fields_are_errors_not_silence() {
    let e = err(r#"
        [[scopes]]
        key = "user"
        input_tokenz = 100
    "#);
    assert!(e.message.contains("input_tokenz"), "{e}");
    // The error lists what a rule takes: its own fields and every control's key.
    assert!(
        e.message.contains("`key`") && e.message.contains("`tool_calls`"),
        "{e}"
    );
    // Inside a control's table too.
    let e = err(r#"
        [[scopes]]
        key = "user"
        requests = { limit = 5, window = "1m", burst = 3 }
    "#);
    assert!(e.message.contains("burst"), "{e}");
    // And a rule without its key says so.
    let e = err(r#"
        [[scopes]]
        requests = { limit = 5, window = "1m" }
    "#);
    assert!(e.message.contains("key"), "{e}");
}

#[test]
fn a_full_policy_validates() {
    let p = Policy::from_toml(
        r#"
        version = "v7"
        default_max_output_tokens = 1024
        expired_reservation_charge = "input"
        [prices."gpt-4o"]
        input = 2500000
        output = 10000000
        [[scopes]]
        name = "acme-4o"
        key = "tenant/model"
        match = { tenant = "acme" }
        requests = { limit = 60, window = "1m" }
        output_tokens = { max = 2000, mode = "clamp", default = 500 }
        budget = { micro_usd = 5000000, period = "month" }
    "#,
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!(&*p.version, "v7");
    assert_eq!(p.expired_charge, ExpiredCharge::Input);
    let s = &p.scopes[0];
    assert_eq!(s.dims, vec![Dimension::Tenant, Dimension::Model]);
    assert_eq!(s.requests.map(|r| r.window_ms.get()), Some(60_000));
    assert_eq!(s.budget.map(|b| b.period), Some(Period::CalendarMonth));
    assert_eq!(
        p.prices.price("gpt-4o", None).map(|p| p.cached_input),
        Some(2_500_000)
    );
}

#[test]
fn ip_prefixes_are_checked_and_default_to_a_v6_64() {
    let e = err("[[scopes]]\nkey = \"tenant\"\nip_prefix = { v4 = 24 }\n");
    assert_eq!(e.path, "policy.scopes[0].ip_prefix");
    let e = err("[[scopes]]\nkey = \"ip\"\nip_prefix = { v4 = 33 }\n");
    assert_eq!(e.path, "policy.scopes[0].ip_prefix.v4");
    let e = err("[[scopes]]\nkey = \"ip\"\nip_prefix = { v6 = 0 }\n");
    assert_eq!(e.path, "policy.scopes[0].ip_prefix.v6");
    let p = Policy::from_toml("[[scopes]]\nkey = \"ip\"\nip_prefix = { v4 = 24 }\n")
        .unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!(p.scopes[0].ip_prefix, IpPrefix { v4: 24, v6: 64 });
}

#[test]
fn agent_controls_are_validated_with_their_paths() {
    for (text, path) in [
        (
            "[[scopes]]\nkey = \"operation\"\ntool_calls = { limit = 0, period = \"1h\" }",
            "policy.scopes[0].tool_calls.limit",
        ),
        (
            "[[scopes]]\nkey = \"operation\"\ntool_calls = { limit = 3, period = \"fortnight\" }",
            "policy.scopes[0].tool_calls.period",
        ),
        (
            "[[scopes]]\nkey = \"operation\"\nloops = { max_identical = 0, window = \"1m\" }",
            "policy.scopes[0].loops.max_identical",
        ),
        (
            "[[scopes]]\nkey = \"operation\"\nloops = { max_identical = 2, window = \"0s\" }",
            "policy.scopes[0].loops.window",
        ),
    ] {
        assert_eq!(err(text).path, path, "{text}");
    }
    let p = Policy::from_toml(
        "fail_open = [\"tool_call_limit\", \"loop_detected\"]\n[[scopes]]\nkey = \"operation\"\n\
         tool_calls = { limit = 3, period = \"1h\" }\nloops = { max_identical = 2, window = \"1m\" }",
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    let rule = &p.scopes[0];
    assert_eq!(
        rule.tool_calls.map(|t| (t.limit.get(), t.unit)),
        Some((3, Unit::ToolCalls))
    );
    assert_eq!(
        rule.loops
            .map(|l| (l.max_identical.get(), l.window_ms.get())),
        Some((2, 60_000))
    );
}

#[test]
fn input_limits_take_a_mode() {
    let p = Policy::from_toml(
        "[[scopes]]\nkey = \"user\"\ninput_tokens = { max = 500, mode = \"trim\" }\n\
         [[scopes]]\nkey = \"tenant\"\ninput_tokens = 900\n",
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    let limits: Vec<_> = p
        .scopes
        .iter()
        .map(|r| (r.input_tokens.map(|m| m.get()), r.trim_input))
        .collect();
    assert_eq!(limits, [(Some(500), true), (Some(900), false)]);
    let e = err("[[scopes]]\nkey = \"user\"\ninput_tokens = { max = 500, mode = \"chop\" }");
    assert_eq!(e.path, "policy.scopes[0].input_tokens.mode");
    let e = err("[[scopes]]\nkey = \"user\"\ninput_tokens = { max = 0, mode = \"trim\" }");
    assert_eq!(e.path, "policy.scopes[0].input_tokens.max");
}

#[test]
fn rule_modes_are_enforce_or_shadow_and_a_shadow_rule_cannot_trim() {
    let e = err("[[scopes]]\nkey = \"user\"\nmode = \"audit\"\n");
    assert_eq!(e.path, "policy.scopes[0].mode");
    let e = err(
        "[[scopes]]\nkey = \"user\"\nmode = \"shadow\"\ninput_tokens = { max = 10, mode = \"trim\" }\n",
    );
    assert_eq!(e.path, "policy.scopes[0].input_tokens.mode");
    let p = Policy::from_toml("[[scopes]]\nkey = \"user\"\nmode = \"shadow\"\n[[scopes]]\nkey = \"tenant\"\nmode = \"enforce\"\n")
        .unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!(
        p.scopes.iter().map(|r| r.shadow).collect::<Vec<_>>(),
        [true, false]
    );
}

#[test]
fn alert_thresholds_are_per_cents_of_the_limit() {
    let e = err(
        "[[scopes]]\nkey = \"user\"\nbudget = { tokens = 10, period = \"day\", alert_at = [50, 101] }\n",
    );
    assert_eq!(e.path, "policy.scopes[0].budget.alert_at");
    let p = Policy::from_toml(
        "[[scopes]]\nkey = \"user\"\nbudget = { tokens = 1000, period = \"day\", alert_at = [80, 50, 100, 50] }\n",
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    let a = p.scopes[0].budget.map(|b| b.alert_at).unwrap_or_default();
    assert_eq!(a.iter().collect::<Vec<_>>(), [50, 80, 100]);
    assert_eq!(a.reached(799, 1000).collect::<Vec<_>>(), [50]);
    assert_eq!(a.reached(800, 1000).collect::<Vec<_>>(), [50, 80]);
    assert_eq!(a.reached(u64::MAX, u64::MAX).count(), 3, "no overflow");
    let edges = AlertAt::of(&[100, 1]).unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!(edges.iter().collect::<Vec<_>>(), [1, 100]);
    assert_eq!(AlertAt::default().iter().count(), 0);
}

#[test]
fn a_period_can_be_a_calendar_in_a_zone() {
    let p = Policy::from_toml(
        "[[scopes]]\nkey = \"tenant\"\nbudget = { tokens = 10, period = { every = \"quarter\", zone = \"Europe/Berlin\", starts = \"April 1 09:00\" } }\n\
         tool_calls = { limit = 5, period = { every = \"week\" } }\n",
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    let label = |p: Option<Period>| p.map(Period::label).unwrap_or_default();
    assert_eq!(
        label(p.scopes[0].budget.map(|b| b.period)),
        "quarter Europe/Berlin April 1 09:00"
    );
    assert_eq!(
        label(p.scopes[0].tool_calls.map(|b| b.period)),
        "week UTC Monday 00:00"
    );
    let e = err(
        "[[scopes]]\nkey = \"tenant\"\nbudget = { tokens = 10, period = { every = \"month\", zone = \"Europe/Berlinn\" } }\n",
    );
    assert_eq!(e.path, "policy.scopes[0].budget.period");
    assert!(
        e.message.contains("unknown time zone \"Europe/Berlinn\""),
        "{e}"
    );
    let e = err(
        "[[scopes]]\nkey = \"tenant\"\nbudget = { tokens = 10, period = { every = \"month\", start = \"1\" } }\n",
    );
    assert!(e.message.contains("unknown field `start`"), "{e}");
}
