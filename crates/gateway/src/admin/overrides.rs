//! `/admin/limits`: limits set at run time for one value (see [`crate::overrides`]).

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::AdminScope;
use crate::gateway::Shared;
use crate::keys::KeyError;
use crate::overrides::{self, Control, Layer, Override};
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
    /// Whose layer: `operator` or `tenant`. A tenant's token sets and clears its own layer
    /// only; the admin token, the operator's unless it names the tenant's.
    layer: Option<String>,
}

/// The layer `t` names for the caller: a tenant's token has its own only.
fn layer_of(who: &AdminScope, t: &Target) -> Result<Layer, Response> {
    let asked = match t.layer.as_deref() {
        None => None,
        Some(l) => Some(
            Layer::parse(l).ok_or_else(|| bad(format!("layer {l:?}: one of operator, tenant")))?,
        ),
    };
    match (who.tenant(), asked) {
        (Some(_), None | Some(Layer::Tenant)) => Ok(Layer::Tenant),
        (Some(tenant), Some(Layer::Operator)) => Err(ApiError::new(
            Class::Client(Fault::Forbidden),
            "admin_scope_forbidden",
            format!("A token of tenant {tenant:?} sets its own layer of limits only."),
        )
        .into_response()),
        (None, asked) => Ok(asked.unwrap_or(Layer::Operator)),
    }
}

fn bad(message: String) -> Response {
    ApiError::invalid("invalid_limit_request", message).into_response()
}

/// A limit the store did not take (503: nothing changed), or took without saying it holds
/// (500 `limit_change_unknown`: made on the primary, no replica confirmed it).
fn failed(e: KeyError) -> Response {
    let (class, code) = match e {
        KeyError::Unknown(_) => (Class::Unknown, "limit_change_unknown"),
        _ => (Class::Books, "store_unavailable"),
    };
    ApiError::new(class, code, e.to_string()).into_response()
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
    let words = crate::words::amount;
    match (o.control, rule) {
        (Control::Budget, Some(r)) => r.budget.map_or(o.limit.to_string(), |b| {
            format!(
                "{} per {}",
                words(o.limit, b.unit),
                crate::words::period(b.period)
            )
        }),
        (Control::ToolCalls, Some(r)) => r.tool_calls.map_or(o.limit.to_string(), |b| {
            format!(
                "{} per {}",
                words(o.limit, b.unit),
                crate::words::period(b.period)
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
    if let Err(r) = key_open(&gw, &t.value).await {
        return r;
    }
    let text = match &t.limit {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Number(n)) => n.to_string(),
        _ => return bad("limit: give the limit, e.g. \"50USD\" or 120".into()),
    };
    let limit = match overrides::amount(rule, control, &text) {
        Ok(n) => n,
        Err(e) => return bad(format!("limit {e}")),
    };
    let layer = match layer_of(&who, &t) {
        Ok(l) => l,
        Err(r) => return r,
    };
    let default = control.default_of(rule).unwrap_or(0);
    let _ = crate::keys::refresh(&gw).await;
    if layer == Layer::Tenant {
        if let Err(r) = tightens(&gw, &cfg.policy, (&scope, control, default), limit) {
            return r;
        }
    }
    let revision = gw
        .overrides
        .get(&scope, control, layer)
        .map_or(1, |o| o.revision + 1);
    let o = Override {
        rule: rule_name,
        scope,
        control,
        limit,
        revision,
        set_at_ms: crate::keys::now_ms(),
        layer,
    };
    let Ok(json) = serde_json::to_string(&o) else {
        return bad("the limit cannot be written".into());
    };
    let changes = vec![(o.field(), Some(json))];
    if let Err(e) = crate::keys::write_limits(&gw, &changes).await {
        return failed(e);
    }
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
    let layer = match layer_of(&who, &t) {
        Ok(l) => l,
        Err(r) => return r,
    };
    let _ = crate::keys::refresh(&gw).await;
    if gw.overrides.get(&scope, control, layer).is_none() {
        return ApiError::new(
            Class::Client(Fault::NotFound),
            "limit_not_set",
            format!(
                "No limit is set at run time for {scope} ({}) in the {} layer.",
                t.control,
                layer_name(layer)
            ),
        )
        .into_response();
    }
    let changes = vec![(overrides::field(&scope, control, layer), None)];
    if let Err(e) = crate::keys::write_limits(&gw, &changes).await {
        return failed(e);
    }
    axum::Json(json!({"scope": scope, "control": t.control, "layer": layer, "cleared": true}))
        .into_response()
}

fn layer_name(l: Layer) -> &'static str {
    match l {
        Layer::Operator => "operator's",
        Layer::Tenant => "tenant's",
    }
}

/// A tenant's limit tightens the layers above it (the operator's, else the rule's), or 403.
pub(crate) fn tightens(
    gw: &crate::gateway::Gateway,
    policy: &tollgate_core::Policy,
    (scope, control, rule): (&str, Control, u64),
    limit: u64,
) -> Result<(), Response> {
    let above = gw.overrides.above_tenant(scope, control, rule);
    if limit <= above {
        return Ok(());
    }
    let shown_at = |limit: u64| {
        let o = Override {
            rule: scope.split('|').next().unwrap_or_default().to_owned(),
            scope: scope.to_owned(),
            control,
            limit,
            revision: 0,
            set_at_ms: 0,
            layer: Layer::Operator,
        };
        shown(policy, &o)
    };
    Err(ApiError::new(
        Class::Client(Fault::Forbidden),
        "admin_scope_forbidden",
        format!(
            "A tenant's token may tighten its limits, not raise them: the limit in force above \
             it is {}, asked {}.",
            shown_at(above),
            shown_at(limit)
        ),
    )
    .into_response())
}

/// A limit for a key issued at run time (`key:vk_…`) is a transition of the key
/// ([`crate::keys::set_limits`]): 404 when no key has the id, 409 `key_changed` once it is
/// revoked (for good, its limits with it) or when another change of it came first.
async fn key_open(gw: &crate::gateway::Gateway, value: &str) -> Result<(), Response> {
    let Some(id) = value
        .split('/')
        .find_map(|part| part.strip_prefix("key:"))
        .filter(|id| id.starts_with("vk_"))
    else {
        return Ok(());
    };
    crate::keys::set_limits(gw, id, None)
        .await
        .map(|_| ())
        .map_err(super::keys::refused)
}
