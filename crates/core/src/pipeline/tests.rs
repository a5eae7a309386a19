use super::*;
use crate::scope::Dimension;

fn policy(text: &str) -> Policy {
    Policy::from_toml(text).unwrap_or_else(|e| unreachable!("{e}"))
}

fn facts(input: u64, max: Option<u64>) -> RequestFacts {
    RequestFacts {
        request_id: "r".into(),
        identity: Identity::default()
            .with(Dimension::User, "u")
            .with(Dimension::Tenant, "t")
            .with(Dimension::Model, "gpt-4o"),
        input_tokens: input,
        max_output_tokens: max,
        ..RequestFacts::default()
    }
}

fn verdict(p: &Policy, f: &RequestFacts) -> Option<Reason> {
    plan(p, f)
        .ok()
        .and_then(|pl| token_verdict(&pl).map(|d| d.reason))
}

#[test]
fn token_controls_report_the_first_failure_in_order() {
    let p = policy(
        r#"
        [[scopes]]
        key = "user"
        input_tokens = 100
        output_tokens = { max = 100 }
        total_tokens = 150
    "#,
    );
    // Over all three: input is reported.
    assert_eq!(
        verdict(&p, &facts(500, Some(500))),
        Some(Reason::InputTokenLimit)
    );
    assert_eq!(
        verdict(&p, &facts(10, Some(500))),
        Some(Reason::OutputTokenLimit)
    );
    assert_eq!(
        verdict(&p, &facts(80, Some(80))),
        Some(Reason::TotalTokenLimit)
    );
    assert_eq!(verdict(&p, &facts(70, Some(80))), None);
}

#[test]
fn the_upstream_never_gets_an_unbounded_cap() {
    let p = policy("default_max_output_tokens = 256");
    assert_eq!(
        plan(&p, &facts(1, None)).map(|p| p.max_output_tokens),
        Ok(256)
    );
    let p = policy(
        r#"
        [[scopes]]
        key = "tenant"
        output_tokens = { max = 1000, mode = "clamp", default = 300 }
        [[scopes]]
        key = "user"
        output_tokens = { max = 800, mode = "clamp", default = 200 }
    "#,
    );
    // The tightest default, and clamping to the tightest clamp.
    assert_eq!(
        plan(&p, &facts(1, None)).map(|p| p.max_output_tokens),
        Ok(200)
    );
    let pl = plan(&p, &facts(1, Some(5000))).unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!(pl.max_output_tokens, 800);
    assert_eq!(token_verdict(&pl), None);
    assert_eq!(pl.estimate_tokens(), 801);
}

#[test]
fn match_filters_and_missing_dimensions_skip_a_scope() {
    let p = policy(
        r#"
        [[scopes]]
        key = "tenant"
        match = { tenant = "other" }
        input_tokens = 1
        [[scopes]]
        key = "ip"
        input_tokens = 1
    "#,
    );
    assert_eq!(verdict(&p, &facts(50, Some(1))), None);
}

#[test]
fn money_budgets_reserve_the_estimated_cost() {
    let p = policy(
        r#"
        price_catalog = "none"
        [prices."gpt-4o"]
        input = 2500000
        output = 10000000
        [[scopes]]
        key = "tenant"
        budget = { micro_usd = 1000000, period = "day" }
    "#,
    );
    let pl = plan(&p, &facts(1000, Some(500))).unwrap_or_else(|e| unreachable!("{e}"));
    // 1000 x 2.5 + 500 x 10 micro-USD = 7500.
    assert_eq!(budgets(&pl)[0].amount, 7500);
    let mut f = facts(1, Some(1));
    f.identity.model = Some("unpriced".into());
    assert!(matches!(plan(&p, &f), Err(PlanError::UnpricedModel { .. })));
    // Input that may be written to a prompt cache is reserved at twice the input price (at
    // most all of the input); an expired request is still charged its plain estimate.
    let mut f = facts(1000, Some(500));
    f.cache_write_tokens = 600;
    let pl = plan(&p, &f).unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!(budgets(&pl)[0].amount, 7500 + 600 * 5 / 2);
    assert_eq!(pl.expired_usage.cache_write_1h_tokens, 0);
    assert_eq!(pl.expired_usage.total(), 1500);
    f.cache_write_tokens = 5000;
    let pl = plan(&p, &f).unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!(budgets(&pl)[0].amount, 7500 + 2500);
}

#[test]
fn kill_targets_are_all_then_each_known_dimension_in_order() {
    let id = Identity::default()
        .with(Dimension::User, "u\n1:x")
        .with(Dimension::Ip, "10.0.0.1")
        .with(Dimension::Model, "gpt-4o")
        .with(Dimension::Tenant, "acme");
    let t = KillTargets::of(&id);
    assert_eq!(
        t.iter().collect::<Vec<_>>(),
        [
            "all",
            "tenant:acme",
            "model:gpt-4o",
            "user:u\n1:x",
            "provider:gpt-4o"
        ]
    );
    assert_eq!(t.len(), 5);
    let none = KillTargets::of(&Identity::default());
    assert_eq!(none.iter().collect::<Vec<_>>(), ["all"]);
    assert!(!none.is_empty() && KillTargets::default().is_empty());
}

#[test]
fn agent_checks_come_last_in_their_lists() {
    let p = policy(
        "[[scopes]]\nname = \"ops\"\nkey = \"user\"\nbudget = { tokens = 1000, period = \"day\" }\n\
         tool_calls = { limit = 5, period = \"1h\" }\nloops = { max_identical = 2, window = \"1m\" }\n\
         [[scopes]]\nname = \"all\"\nkey = \"global\"\nbudget = { tokens = 9000, period = \"day\" }\n",
    );
    let f = RequestFacts {
        fingerprint: Some(0xab),
        tool_call_repeats: 3,
        ..facts(10, Some(10))
    };
    let plan = plan(&p, &f).unwrap_or_else(|e| unreachable!("{e}"));
    let units: Vec<_> = budgets(&plan)
        .iter()
        .map(|b| (b.scope.id(), b.unit, b.amount))
        .collect();
    assert_eq!(
        units,
        [
            ("ops|tenant:t/user:u", Unit::Tokens, 20),
            ("all|global", Unit::Tokens, 20),
            ("ops|tenant:t/user:u?tool_calls", Unit::ToolCalls, 1),
        ]
    );
    assert_eq!(repeats(&plan).len(), 1);
    assert_eq!(
        repeats(&plan)[0].scope.id(),
        "ops|tenant:t/user:u?repeat:00000000000000ab"
    );
    assert_eq!(repeats(&plan)[0].scope.key(), "tenant:t/user:u");
    let Some(verdict) = loop_verdict(&plan) else {
        unreachable!("a verdict")
    };
    assert_eq!(
        (verdict.reason, verdict.requested),
        (Reason::LoopDetected, 3)
    );
    // Without a fingerprint nothing is counted; within the limit no verdict.
    let quiet = super::plan(
        &p,
        &RequestFacts {
            tool_call_repeats: 2,
            ..facts(10, Some(10))
        },
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    assert!(repeats(&quiet).is_empty() && loop_verdict(&quiet).is_none());
}

#[test]
fn shadow_rules_are_planned_apart_and_never_enforced() {
    let p = policy(
        r#"
        [[scopes]]
        name = "enforced"
        key = "tenant"
        output_tokens = { max = 500, mode = "clamp" }
        budget = { tokens = 10000, period = "day" }
        [[scopes]]
        name = "watch"
        key = "user"
        mode = "shadow"
        output_tokens = { max = 100 }
        requests = { limit = 1, window = "1m" }
        budget = { tokens = 50, period = "day" }
        "#,
    );
    let f = facts(40, Some(800));
    let enforced = plan(&p, &f).unwrap_or_else(|e| unreachable!("{e}"));
    assert!(rates(&enforced).is_empty() && token_verdict(&enforced).is_none());
    assert_eq!(budgets(&enforced).len(), 1);
    assert_eq!(enforced.max_output_tokens, 500, "only enforced rules grant");
    assert_eq!(enforced.kill_targets.len(), 5);
    let shadow = shadow_plan(&p, &f)
        .unwrap_or_else(|e| unreachable!("{e}"))
        .unwrap_or_else(|| unreachable!("a shadow rule applies"));
    assert_eq!(shadow.request_id, "r~shadow");
    assert_eq!(rates(&shadow).len(), 1);
    assert_eq!(budgets(&shadow).len(), 1);
    assert_eq!(budgets(&shadow)[0].scope.rule(), "watch");
    assert_eq!(
        budgets(&shadow)[0].amount,
        540,
        "granted as under both rules"
    );
    assert_eq!(
        token_verdict(&shadow).as_ref().map(|d| d.reason),
        Some(Reason::OutputTokenLimit)
    );
    assert!(shadow.kill_targets.is_empty() && !shadow.fail_open);
    // A request no shadow rule applies to has no shadow plan.
    let mut anonymous = f.clone();
    anonymous.identity = Identity::default().with(Dimension::Tenant, "t");
    assert!(matches!(shadow_plan(&p, &anonymous), Ok(None)));
    // Both at once, the rules matched once: the same two plans.
    assert_eq!(plans(&p, &f), Ok((enforced, Ok(Some(shadow)))));
    assert_eq!(
        plans(&p, &anonymous),
        Ok((
            plan(&p, &anonymous).unwrap_or_else(|e| unreachable!("{e}")),
            Ok(None)
        ))
    );
}

#[test]
fn both_plans_at_once_are_the_two_plans() {
    // Without shadow rules; and a shadow rule that cannot be priced, whose error is its own.
    let plain = policy(
        r#"
        [[scopes]]
        name = "enforced"
        key = "user"
        requests = { limit = 5, window = "1m" }
        "#,
    );
    let f = facts(40, Some(800));
    let alone = plan(&plain, &f).unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!(plans(&plain, &f), Ok((alone, Ok(None))));
    let unpriced = policy(
        r#"
        price_catalog = "none"
        [prices."another-model"]
        input = 1
        output = 1
        [[scopes]]
        name = "enforced"
        key = "user"
        requests = { limit = 5, window = "1m" }
        [[scopes]]
        name = "watch"
        key = "user"
        mode = "shadow"
        budget = { micro_usd = 1000000, period = "day" }
        "#,
    );
    let (p, shadow) = plans(&unpriced, &f).unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!(
        p,
        plan(&unpriced, &f).unwrap_or_else(|e| unreachable!("{e}"))
    );
    assert_eq!(shadow, shadow_plan(&unpriced, &f));
    assert!(matches!(shadow, Err(PlanError::UnpricedModel { .. })));
}

#[test]
fn rules_over_the_same_dimensions_share_a_key_renamed() {
    let p = policy(
        r#"
        [[scopes]]
        name = "other-tenant"
        key = "ip"
        match = { tenant = "someone-else" }
        requests = { limit = 5, window = "1m" }
        [[scopes]]
        name = "per-ip"
        key = "ip"
        requests = { limit = 5, window = "1m" }
        [[scopes]]
        name = "per-ip-trial"
        key = "ip"
        mode = "shadow"
        requests = { limit = 1, window = "1m" }
        [[scopes]]
        name = "per-net"
        key = "ip"
        ip_prefix = { v4 = 24 }
        requests = { limit = 5, window = "1m" }
        [[scopes]]
        name = "per-user"
        key = "user"
        requests = { limit = 5, window = "1m" }
        "#,
    );
    let same: Vec<Option<usize>> = p.scopes.iter().map(|r| r.same_key_as).collect();
    // The first rule over `ip` (which this request does not meet), none for another grouping.
    assert_eq!(same, [None, Some(0), Some(0), None, None]);
    let mut f = facts(40, Some(800));
    f.identity = f.identity.with(Dimension::Ip, "203.0.113.7");
    let (enforced, shadow) = plans(&p, &f).unwrap_or_else(|e| unreachable!("{e}"));
    let shadow = shadow
        .unwrap_or_else(|e| unreachable!("{e}"))
        .unwrap_or_else(|| unreachable!("a shadow rule applies"));
    let derived = |i: usize| {
        let r = &p.scopes[i];
        ScopeKey::derive_in(&r.name, &r.dims, &f.identity, r.ip_prefix)
    };
    let ids: Vec<&str> = rates(&enforced).iter().map(|c| c.scope.id()).collect();
    assert_eq!(
        ids,
        [
            "per-ip|ip:203.0.113.7",
            "per-net|ip:203.0.113.0/24",
            "per-user|tenant:t/user:u"
        ]
    );
    for (check, i) in rates(&enforced).iter().zip([1, 3, 4]) {
        assert_eq!(Some(&check.scope), derived(i).as_ref());
    }
    assert_eq!(Some(&rates(&shadow)[0].scope), derived(2).as_ref());
    assert_eq!(rates(&shadow)[0].scope.id(), "per-ip-trial|ip:203.0.113.7");
}

fn budgets(p: &Plan) -> Vec<&BudgetCheck> {
    p.reserves().map(|(_, b)| b).collect()
}

fn counts_of(p: &Plan, reason: Reason) -> Vec<&RateCheck> {
    p.counts()
        .filter(|(_, r, _)| *r == reason)
        .map(|(_, _, c)| c)
        .collect()
}

fn rates(p: &Plan) -> Vec<&RateCheck> {
    counts_of(p, Reason::RequestRateLimit)
}

fn repeats(p: &Plan) -> Vec<&RateCheck> {
    counts_of(p, Reason::LoopDetected)
}

fn verdicts(p: &Plan) -> impl Iterator<Item = &Deny> + '_ {
    p.checks.iter().filter_map(|c| match &c.kind {
        Kind::Verdict(d) => Some(d),
        _ => None,
    })
}

fn token_verdict(p: &Plan) -> Option<Deny> {
    verdicts(p).find(|d| !d.reason.is_stateful()).cloned()
}

fn loop_verdict(p: &Plan) -> Option<Deny> {
    verdicts(p)
        .find(|d| d.reason == Reason::LoopDetected)
        .cloned()
}

/// The checks are in the controls' fixed order, each control's in policy order.
#[test]
fn a_plan_lists_its_checks_in_the_controls_order() {
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 5, window = "1m" }
        input_tokens = 10
        concurrency = { limit = 2 }
        budget = { tokens = 300, period = "day" }
        tool_calls = { limit = 9, period = "day" }
        loops = { max_identical = 1, window = "1m" }
        [[scopes]]
        key = "tenant"
        requests = { limit = 50, window = "1m" }
        concurrency = { limit = 20 }
        "#,
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    let facts = RequestFacts {
        request_id: "r".into(),
        identity: Identity::default()
            .with(Dimension::Tenant, "t")
            .with(Dimension::User, "u"),
        input_tokens: 11,
        fingerprint: Some(3),
        tool_call_repeats: 2,
        ..RequestFacts::default()
    };
    let p = plan(&policy, &facts).unwrap_or_else(|e| unreachable!("{e}"));
    let order: Vec<(Reason, &str)> = p
        .checks
        .iter()
        .map(|c| {
            let kind = match c.kind {
                Kind::Count(_) => "count",
                Kind::Peek(_) => "peek",
                Kind::Lease(_) => "lease",
                Kind::Reserve(_) => "reserve",
                Kind::Verdict(_) => "verdict",
            };
            (c.reason, kind)
        })
        .collect();
    assert_eq!(
        order,
        [
            (Reason::RequestRateLimit, "count"),
            (Reason::RequestRateLimit, "count"),
            (Reason::InputTokenLimit, "verdict"),
            (Reason::ConcurrencyLimit, "lease"),
            (Reason::ConcurrencyLimit, "lease"),
            (Reason::BudgetLimit, "reserve"),
            (Reason::ToolCallLimit, "reserve"),
            (Reason::LoopDetected, "count"),
            (Reason::LoopDetected, "verdict"),
        ]
    );
    // Each control's checks in policy order: the user rule's before the tenant's.
    let rate_rules: Vec<&str> = rates(&p).iter().map(|c| c.scope.rule()).collect();
    assert_eq!(rate_rules, ["user", "tenant"]);
}
