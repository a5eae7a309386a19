//! `/admin/limits`: limits set at run time for one value (see [`crate::overrides`]).

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use tollgate_ledger::Kept;
use tollgate_redis::RecordSet;

use super::AdminScope;
use crate::gateway::Shared;
use crate::keys::KeyError;
use crate::overrides::{self, Control, Override};
use crate::respond::{ApiError, Class, Fault};

/// `PUT /admin/limits` and the query of `DELETE /admin/limits`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Target {
    /// `tenant:acme`, `key:vk_…`, `tenant:acme/user:alice`.
    value: String,
    /// `requests`, `concurrency`, `budget` or `tool_calls`.
    control: String,
    /// The rule, when several are keyed on the value with the control.
    rule: Option<String>,
    /// The limit, in the rule's unit (`50USD`, `$12.50`, `200000`, `120`); `PUT` only.
    limit: Option<serde_json::Value>,
}

fn bad(message: String) -> Response {
    ApiError::invalid("invalid_limit_request", message).into_response()
}

fn failed(e: KeyError) -> Response {
    ApiError::new(
        Class::Books,
        "service_unavailable",
        "store_unavailable",
        e.to_string(),
    )
    .into_response()
}

/// `GET /admin/limits`: every limit set at run time (a tenant's token: its own).
pub(super) async fn list(
    State(gw): State<Shared>,
    axum::Extension(who): axum::Extension<AdminScope>,
) -> Response {
    let _ = crate::keys::refresh(&gw).await;
    let cfg = gw.config();
    let all: Vec<serde_json::Value> = gw
        .overrides
        .list()
        .into_iter()
        .filter(|o| who.owns_scope(&o.scope))
        .map(|o| {
            let shown = shown(&cfg.policy, &o);
            let mut v = json!(o);
            v["limit_shown"] = json!(shown);
            v
        })
        .collect();
    axum::Json(json!({"limits": all})).into_response()
}

/// An override's limit for a person: in dollars, tokens or tool calls per period, requests per
/// window, or requests at once.
fn shown(policy: &tollgate_core::Policy, o: &Override) -> String {
    let rule = policy.scopes.iter().find(|r| *r.name == *o.rule);
    let words = super::words::amount;
    match (o.control, rule) {
        (Control::Budget, Some(r)) => r.budget.map_or(o.limit.to_string(), |b| {
            format!(
                "{} per {}",
                words(o.limit, b.unit),
                super::words::period(b.period)
            )
        }),
        (Control::ToolCalls, Some(r)) => r.tool_calls.map_or(o.limit.to_string(), |b| {
            format!(
                "{} per {}",
                words(o.limit, b.unit),
                super::words::period(b.period)
            )
        }),
        (Control::Requests, Some(r)) => r.requests.map_or(o.limit.to_string(), |q| {
            format!(
                "{} requests per {}",
                o.limit,
                humantime::format_duration(std::time::Duration::from_millis(q.window_ms.get()))
            )
        }),
        (Control::Concurrency, _) => format!("{} at once", o.limit),
        (_, None) => o.limit.to_string(),
    }
}

/// The rule and scope `t` names, checked against the policy and the caller's scope.
fn resolve(
    gw: &Shared,
    who: &AdminScope,
    t: &Target,
) -> Result<
    (
        std::sync::Arc<crate::config::GatewayConfig>,
        String,
        String,
        Control,
    ),
    Response,
> {
    let control = Control::parse(&t.control).ok_or_else(|| {
        bad(format!(
            "control {:?}: one of requests, concurrency, budget, tool_calls",
            t.control
        ))
    })?;
    let cfg = gw.config();
    let (rule, key) =
        overrides::resolve(&cfg.policy, &t.value, control, t.rule.as_deref()).map_err(bad)?;
    let (rule, scope) = (rule.name.to_string(), key.id().to_owned());
    if !who.owns_scope(&scope) {
        return Err(
            crate::respond::admin_scope_forbidden(who.tenant().unwrap_or_default()).into_response(),
        );
    }
    Ok((cfg, rule, scope, control))
}

/// `PUT /admin/limits`: sets, raises or lowers one rule's limit for one value. A tenant's token
/// may only tighten its rules (a limit at most the rule's own).
pub(super) async fn set(
    State(gw): State<Shared>,
    axum::Extension(who): axum::Extension<AdminScope>,
    b: Bytes,
) -> Response {
    let t: Target = match serde_json::from_slice(&b) {
        Ok(t) => t,
        Err(e) => return bad(format!("the request body: {e}")),
    };
    let (cfg, rule_name, scope, control) = match resolve(&gw, &who, &t) {
        Ok(r) => r,
        Err(r) => return r,
    };
    let Some(rule) = cfg.policy.scopes.iter().find(|r| *r.name == *rule_name) else {
        return bad(format!("no rule {rule_name:?}"));
    };
    let text = match &t.limit {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Number(n)) => n.to_string(),
        _ => return bad("limit: give the limit, e.g. \"50USD\" or 120".into()),
    };
    let limit = match overrides::amount(rule, control, &text) {
        Ok(n) => n,
        Err(e) => return bad(format!("limit {e}")),
    };
    let default = control.default_of(rule).unwrap_or(0);
    if let (Some(tenant), true) = (who.tenant(), limit > default) {
        return ApiError::new(
            Class::Client(Fault::Forbidden),
            "invalid_request_error",
            "admin_scope_forbidden",
            format!(
                "A token of tenant {tenant:?} may tighten its limits, not raise them: the rule's \
                 limit is {default}, asked {limit}."
            ),
        )
        .into_response();
    }
    let _ = crate::keys::refresh(&gw).await;
    let revision = gw
        .overrides
        .get(&scope, control)
        .map_or(1, |o| o.revision + 1);
    let o = Override {
        rule: rule_name,
        scope,
        control,
        limit,
        revision,
        set_at_ms: crate::keys::now_ms(),
    };
    let Ok(json) = serde_json::to_string(&o) else {
        return bad("the limit cannot be written".into());
    };
    let changes = vec![(o.field(), Some(json))];
    if let Err(e) = crate::keys::write_set(&gw, (Kept::Limits, RecordSet::Limits), &changes).await {
        return failed(e);
    }
    gw.overrides.apply_locally(&changes);
    tracing::info!(scope = %o.scope, control = ?o.control, limit = o.limit, revision = o.revision,
        "a limit was set for one value");
    let own = shown(
        &cfg.policy,
        &Override {
            limit: default,
            ..o.clone()
        },
    );
    let shown = shown(&cfg.policy, &o);
    axum::Json(json!({"limit": o, "limit_shown": shown, "default": default, "default_shown": own}))
        .into_response()
}

/// `DELETE /admin/limits?value=…&control=…[&rule=…]`: the rule's own limit applies again.
pub(super) async fn clear(
    State(gw): State<Shared>,
    axum::Extension(who): axum::Extension<AdminScope>,
    query: Result<Query<Target>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let t = match query {
        Ok(Query(t)) => t,
        Err(e) => return bad(format!("the query: {}", e.body_text())),
    };
    let (_, _, scope, control) = match resolve(&gw, &who, &t) {
        Ok(r) => r,
        Err(r) => return r,
    };
    let _ = crate::keys::refresh(&gw).await;
    if gw.overrides.get(&scope, control).is_none() {
        return ApiError::new(
            Class::Client(Fault::NotFound),
            "invalid_request_error",
            "limit_not_set",
            format!("No limit is set at run time for {scope} ({}).", t.control),
        )
        .into_response();
    }
    let changes = vec![(overrides::field(&scope, control), None)];
    if let Err(e) = crate::keys::write_set(&gw, (Kept::Limits, RecordSet::Limits), &changes).await {
        return failed(e);
    }
    gw.overrides.apply_locally(&changes);
    axum::Json(json!({"scope": scope, "control": t.control, "cleared": true})).into_response()
}
