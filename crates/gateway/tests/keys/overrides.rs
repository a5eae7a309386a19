//! Limits set at run time for one value (`/admin/limits`): a tenant's budget raised or lowered
//! without a reload, on every instance within a second; other tenants keep the rule's limit;
//! a tighter rule still refuses; records name the override; a tenant's own token may only
//! tighten; and the override outlives a restart through the ledger.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::instance::{Instance, redis_text, sim, until};
use serde_json::{Value, json};
use tollgate_testkit::pg_server::PgServer;
use tollgate_testkit::redis_server::RedisServer;

const SCOPES: &str = "[[policy.scopes]]\nname = \"tenant-day\"\nkey = \"tenant\"\n\
    budget = { tokens = 300, period = \"day\" }\n\
    [[policy.scopes]]\nname = \"everyone\"\nkey = \"global\"\n\
    budget = { tokens = 1500, period = \"day\" }\n";

/// Requests of tenant `t` on `on` until one is refused: how many were served, and the refusal.
async fn served_until_refused(on: &Instance, t: &str) -> (u32, (u16, String)) {
    let mut served = 0;
    loop {
        match on.ask(t).await {
            (200, _) => served += 1,
            other => return (served, other),
        }
        assert!(served < 100, "never refused");
    }
}

async fn set(on: &Instance, body: Value) -> (u16, Value) {
    on.admin("PUT", "/admin/limits", Some(body)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_set_for_one_tenant_holds_on_every_instance() {
    let (sim, redis) = (sim().await, RedisServer::start());
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records.jsonl");
    let text = format!(
        "{}[records]\npath = \"{}\"\n",
        redis_text(&redis),
        records.display()
    );
    let a = Instance::start_with(&sim, &text, SCOPES).await;
    assert_eq!(a.admin("POST", "/admin/store/init", None).await.0, 200);
    let b = Instance::start_with(&sim, &redis_text(&redis), SCOPES).await;

    // beta, by the rule alone: refused by its 300 tokens.
    let (beta_served, refusal) = served_until_refused(&b, "beta").await;
    assert_eq!(refusal, (429, "budget_limit".into()));

    // acme's budget raised to 1000 on one instance; the other follows within the bound.
    let (status, v) = set(
        &a,
        json!({"value": "tenant:acme", "control": "budget", "limit": 1000}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["limit"]["revision"].as_u64(), v["default"].as_u64()),
        (Some(1), Some(300))
    );
    until("the override on the other instance", async || {
        let r = common::get_with(
            b.addr,
            "/v1/limits",
            &[("authorization", "Bearer sk-acme".into())],
        )
        .await;
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        v["limits"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["rule"] == "tenant-day" && r["limit"] == 1000)
    })
    .await;
    let (acme_served, refusal) = served_until_refused(&b, "acme").await;
    assert_eq!(refusal, (429, "budget_limit".into()));
    assert!(
        acme_served > 2 * beta_served,
        "acme {acme_served}, beta {beta_served}"
    );

    // The global rule still applies: acme raised past it is refused by it.
    let (status, _) = set(
        &a,
        json!({"value": "tenant:acme", "control": "budget", "limit": "100000"}),
    )
    .await;
    assert_eq!(status, 200);
    until("the second override on the other instance", async || {
        let r = common::get_with(
            b.addr,
            "/v1/limits",
            &[("authorization", "Bearer sk-acme".into())],
        )
        .await;
        String::from_utf8_lossy(&r.body).contains("100000")
    })
    .await;
    let body = json!({"model": "gpt-4o", "max_tokens": 20,
        "messages": [{"role": "user", "content": "Hello there, how are you?"}]})
    .to_string();
    let refused = loop {
        let r = common::post(
            b.addr,
            "/v1/chat/completions",
            &[("authorization", "Bearer sk-acme".to_owned())],
            body.clone(),
        )
        .await;
        if r.status != 200 {
            break r;
        }
    };
    assert_eq!(refused.status, 429);
    assert!(
        String::from_utf8_lossy(&refused.body).contains("limit 1500 tokens"),
        "{:?}",
        refused.body
    );

    // The records of requests the override decided name it, with its revision.
    let (_, v) = set(
        &a,
        json!({"value": "tenant:gamma", "control": "budget", "limit": 100}),
    )
    .await;
    assert_eq!(v["limit"]["revision"], 1);
    let (_, refusal) = served_until_refused(&a, "gamma").await;
    assert_eq!(refusal.1, "budget_limit");
    // Records are written off the request's path: read once they are there.
    until("the record naming the override", async || {
        std::fs::read_to_string(&records)
            .unwrap_or_default()
            .contains("tenant-day|tenant:gamma#budget@1")
    })
    .await;

    // Cleared: the rule's limit again.
    let (status, _) = a
        .admin(
            "DELETE",
            "/admin/limits?value=tenant:gamma&control=budget",
            None,
        )
        .await;
    assert_eq!(status, 200);
    let (status, v) = a
        .admin(
            "DELETE",
            "/admin/limits?value=tenant:gamma&control=budget",
            None,
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("limit_not_set"))
    );
    let (_, listed) = b.admin("GET", "/admin/limits", None).await;
    assert_eq!(listed["limits"].as_array().unwrap().len(), 1, "{listed}");
}

/// Wrong requests name their fault; a tenant's token may tighten its own limits only; an
/// override outlives a restart of a memory store through the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_requests_are_checked_and_kept() {
    let (sim, pg) = (sim().await, PgServer::start());
    let dir = tempfile::tempdir().unwrap();
    let acme_token = "acme-admin-token-0123456789";
    std::fs::write(dir.path().join("acme"), acme_token).unwrap();
    let text = format!(
        "[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n\
         [[admin.tenants]]\ntenant = \"acme\"\ntoken_file = \"{}\"\n",
        pg.url(),
        dir.path().join("acme").display()
    );
    let scopes = format!(
        "{SCOPES}[[policy.scopes]]\nname = \"tenant-rate\"\nkey = \"tenant\"\n\
         requests = {{ limit = 50, window = \"1m\" }}\n"
    );
    let gw = Instance::start_with(&sim, &text, &scopes).await;
    let cases = [
        (
            json!({"value": "tenant:acme", "control": "speed", "limit": 1}),
            "control",
        ),
        (
            json!({"value": "acme", "control": "budget", "limit": 1}),
            "dimension:value",
        ),
        (
            json!({"value": "user:alice", "control": "budget", "limit": 1}),
            "no rule",
        ),
        (
            json!({"value": "tenant:acme", "control": "budget", "limit": "5USD"}),
            "whole number",
        ),
        (
            json!({"value": "tenant:acme", "control": "budget", "limit": "500/1h"}),
            "own window or period",
        ),
        (
            json!({"value": "tenant:acme", "control": "budget", "limit": 0}),
            "kill switch",
        ),
        (
            json!({"value": "tenant:acme", "control": "budget"}),
            "give the limit",
        ),
        (
            json!({"value": "tenant:acme", "control": "budget", "limit": 1, "rule": "everyone"}),
            "not keyed",
        ),
        (
            json!({"value": "tenant:acme", "control": "budget", "limit": 1, "extra": 1}),
            "extra",
        ),
    ];
    for (body, says) in cases {
        let (status, v) = set(&gw, body.clone()).await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (400, Some("invalid_limit_request")),
            "{body}: {v}"
        );
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    // acme's own token: tighten yes, raise no, another tenant no.
    let as_acme = |body: Value| gw.admin_as(acme_token, "PUT", "/admin/limits", Some(body));
    assert_eq!(
        as_acme(json!({"value": "tenant:acme", "control": "requests", "limit": 5}))
            .await
            .0,
        200
    );
    let (status, v) =
        as_acme(json!({"value": "tenant:acme", "control": "requests", "limit": 500})).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (403, Some("admin_scope_forbidden"))
    );
    let (status, _) =
        as_acme(json!({"value": "tenant:beta", "control": "requests", "limit": 5})).await;
    assert_eq!(status, 403);
    assert_eq!(
        set(
            &gw,
            json!({"value": "tenant:beta", "control": "budget", "limit": "120"})
        )
        .await
        .0,
        200
    );
    gw.stop().await;

    // Restarted on the ledger: the overrides hold from the first request.
    let again = Instance::start_with(&sim, &text, &scopes).await;
    let (_, listed) = again.admin("GET", "/admin/limits", None).await;
    assert_eq!(listed["limits"].as_array().unwrap().len(), 2, "{listed}");
    for _ in 0..5 {
        assert_eq!(again.ask("acme").await.0, 200);
    }
    assert_eq!(again.ask("acme").await, (429, "request_rate_limit".into()));
}
