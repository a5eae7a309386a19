//! The admin API, on its own listener, behind a bearer token: the kill switch, usage per scope,
//! and policy reload, and the operator's status page ([`page`]). Every instance sharing the
//! store sees a kill switch at once (it is checked inside the atomic admission).

mod door;
mod keys;
mod kill;
mod overrides;
mod page;
mod store;
use crate::words;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde::Deserialize;
use serde_json::json;
use tollgate_core::{Keeper, Store};

use crate::gateway::Shared;
pub(crate) use kill::{Kill, all_kills, evicting, kill_alert, liftable, valid_target};
use kill::{clear_kill, kills_json, list_kills, set_kill};

fn store_failed(e: tollgate_core::StoreError) -> Response {
    crate::respond::store_failed(&e).into_response()
}

/// Whether `given` is the admin token, in time that depends on neither its content nor its
/// length: the two SHA-256 digests are compared byte by byte without stopping early.
pub(crate) fn token_matches(given: &str, token: &str) -> bool {
    use sha2::Digest;
    let a = sha2::Sha256::digest(given.as_bytes());
    let b = sha2::Sha256::digest(token.as_bytes());
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// The admin routes; `token` is required as `Authorization: Bearer` (`/metrics` too: Prometheus
/// sends it as `authorization`), except by `/healthz` and `/readyz` (probes carry no token, and
/// the admin listener keeps answering through a shutdown's drain, when `/readyz` says 503).
pub fn router(gw: Shared, admin: crate::config::AdminConfig) -> Router {
    let form = page::FormToken::of(&admin.token);
    let admin = std::sync::Arc::new(admin);
    let reader = gw.clone();
    let busy = std::sync::Arc::new(door::InFlight::default());
    Router::new()
        .route("/admin/ui", get(page::page))
        .route("/admin/ui/kill", post(page::kill))
        .route("/admin/ui/lift", post(page::lift))
        .route("/admin/status", get(status))
        .route("/admin/kill", get(list_kills).post(set_kill))
        .route("/admin/kill/{target}", delete(clear_kill))
        .route("/admin/usage", get(usage))
        .route("/admin/reload", post(reload))
        .route(
            "/admin/limits",
            get(overrides::list)
                .put(overrides::set)
                .delete(overrides::clear),
        )
        .route("/admin/keys", get(keys::list).post(keys::create))
        .route("/admin/keys/{id}", delete(keys::revoke))
        .route("/admin/keys/{id}/rotate", post(keys::rotate))
        .route("/admin/store/init", post(store::init_store))
        .route(
            "/admin/store/acknowledge-loss",
            post(store::acknowledge_loss),
        )
        .route("/metrics", get(crate::scrape::metrics))
        .layer(middleware::from_fn(
            move |headers: HeaderMap, req: axum::extract::Request, next: Next| {
                let (admin, form, gw) = (admin.clone(), form.clone(), reader.clone());
                let busy = busy.clone();
                async move {
                    let peer = req
                        .extensions()
                        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                        .map(|c| c.0.ip());
                    let given = given_token(&headers);
                    let Some(scope) = given.as_ref().and_then(|g| scope_of(g, &admin)) else {
                        let principal = if given.is_some() { "unknown" } else { "none" };
                        door::failed_login(peer, req.uri().path(), principal);
                        let mut r = crate::respond::admin_unauthorized().into_response();
                        // A browser asks for it: any user name, the token as the password.
                        r.headers_mut().insert(
                            axum::http::header::WWW_AUTHENTICATE,
                            axum::http::HeaderValue::from_static(
                                "Basic realm=\"Tollgate admin\", charset=\"UTF-8\"",
                            ),
                        );
                        return r;
                    };
                    if let AdminScope::Tenant(t) = &scope {
                        if !tenant_may(req.uri().path()) {
                            door::failed_login(peer, req.uri().path(), "tenant");
                            return crate::respond::admin_scope_forbidden(t).into_response();
                        }
                    }
                    if let Some(r) = door::refusal(req.method(), req.uri().path(), &headers) {
                        return r;
                    }
                    // A tenant's calls in flight are few; the operator's are not counted.
                    let _turn = match &scope {
                        AdminScope::Tenant(t) => match busy.enter(t) {
                            Ok(turn) => Some(turn),
                            Err(r) => return r,
                        },
                        AdminScope::All => None,
                    };
                    let mut req = match door::read(&gw.config(), req).await {
                        Ok(r) => r,
                        Err(r) => return r,
                    };
                    req.extensions_mut().insert(scope);
                    req.extensions_mut().insert(form);
                    next.run(req).await
                }
            },
        ))
        .route("/healthz", get(crate::probes::healthz))
        .route("/readyz", get(crate::probes::readyz))
        .layer(middleware::map_response(|mut r: Response| async move {
            door::seal(&mut r);
            r
        }))
        .with_state(gw)
}

/// The token a request presents: `Authorization: Bearer TOKEN`, or `Basic` with the token as
/// the password (the user name is not looked at).
/// Whom an admin call speaks for: the operator (the admin token), or one tenant (a token of
/// `[[admin.tenants]]`), which manages that tenant's keys and reads its usage only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminScope {
    /// Everything.
    All,
    /// This tenant's keys and usage.
    Tenant(String),
}

impl AdminScope {
    /// The one tenant a call may touch, if it is limited to one.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            AdminScope::All => None,
            AdminScope::Tenant(t) => Some(t),
        }
    }

    /// Whether a call may read or change scope `id` (`rule|tenant:…/…`).
    pub fn owns_scope(&self, id: &str) -> bool {
        match self {
            AdminScope::All => true,
            // Read as the scope's dimensions: exactly one tenant, this one, and no dimension
            // named twice (`tenant:beta/tenant:acme` is no scope of acme's).
            AdminScope::Tenant(t) => id.split_once('|').is_some_and(|(_, key)| {
                let parts: Vec<(&str, &str)> =
                    key.split('/').filter_map(|p| p.split_once(':')).collect();
                let mut names: Vec<&str> = parts.iter().map(|(d, _)| *d).collect();
                names.sort_unstable();
                names.dedup();
                names.len() == parts.len()
                    && parts.len() == key.split('/').count()
                    && parts
                        .iter()
                        .any(|(d, v)| *d == "tenant" && *v == t.as_str())
            }),
        }
    }
}

/// The scope a presented token gives, each compared whole in constant time.
fn scope_of(given: &str, admin: &crate::config::AdminConfig) -> Option<AdminScope> {
    if token_matches(given, &admin.token) {
        return Some(AdminScope::All);
    }
    admin
        .tenants
        .iter()
        .find(|(_, t)| token_matches(given, t))
        .map(|(tenant, _)| AdminScope::Tenant(tenant.clone()))
}

/// What a tenant's token may call: its keys, its usage and its limits.
fn tenant_may(path: &str) -> bool {
    path == "/admin/keys"
        || path.starts_with("/admin/keys/")
        || path == "/admin/usage"
        || path == "/admin/limits"
}

fn given_token(headers: &HeaderMap) -> Option<String> {
    use base64::Engine;
    let v = headers.get("authorization")?.to_str().ok()?;
    // Schemes are case-insensitive (RFC 9110 11.1).
    let (scheme, rest) = v.split_once(' ')?;
    if scheme.eq_ignore_ascii_case("bearer") {
        return Some(rest.trim().to_owned());
    }
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let b = rest;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    text.split_once(':').map(|(_, pass)| pass.to_owned())
}

/// A rule as the status answers and the page list it.
#[derive(Debug, serde::Serialize)]
pub(crate) struct RuleRow {
    name: String,
    key: String,
    mode: &'static str,
    #[serde(skip)]
    controls: String,
    #[serde(rename = "controls")]
    control_list: Vec<&'static str>,
    /// The limits in words.
    limits: String,
}

pub(crate) fn rule_rows(policy: &tollgate_core::Policy) -> Vec<RuleRow> {
    policy
        .scopes
        .iter()
        .map(|r| {
            let control_list: Vec<&'static str> = r.controls().map(|(key, _)| key).collect();
            let dims: Vec<&str> = r.dims.iter().map(|d| d.as_str()).collect();
            RuleRow {
                name: r.name.to_string(),
                key: if dims.is_empty() {
                    "global".to_owned()
                } else {
                    dims.join("/")
                },
                mode: if r.shadow { "shadow" } else { "enforce" },
                controls: control_list.join(", "),
                control_list,
                limits: words::limits(r),
            }
        })
        .collect()
}

/// Whether the store answers (`ok`, `lost`, `uninitialised`, `unreachable`), and every kill switch in force (the
/// configuration's too, whatever the store says).
async fn store_state(gw: &Shared) -> (&'static str, Vec<Kill>) {
    use tollgate_core::{StoreError, StoreState};
    let (state, stored) = match (gw.store.state().await, gw.store.kills().await) {
        (Ok(StoreState::Kept), Ok(k)) => ("ok", k),
        (Ok(StoreState::Lost) | Err(StoreError::StateLost), _)
        | (_, Err(StoreError::StateLost)) => ("lost", Vec::new()),
        (Ok(StoreState::Uninitialised), _) => ("uninitialised", Vec::new()),
        _ => ("unreachable", Vec::new()),
    };
    (state, all_kills(gw, stored))
}

/// `GET /admin/status`: the policy in force (version, rules and their controls), whether the
/// store answers (and why it is lost), its kill switches, and this instance's requests in flight.
async fn status(State(gw): State<Shared>) -> Response {
    let cfg = gw.config();
    let rules = rule_rows(&cfg.policy);
    let (store, kills) = store_state(&gw).await;
    let kills = kills_json(&gw, &kills);
    let store_loss = (store == "lost")
        .then(|| gw.store.loss_cause().map(|l| l.to_string()))
        .flatten();
    axum::Json(json!({
        "policy_version": &*cfg.policy.version,
        "store": store,
        "store_loss": store_loss,
        "in_flight": crate::ticket::open_tickets(),
        "keys_as_of": gw.keys.as_of_ms().map(|ms| {
            humantime::format_rfc3339_millis(
                std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms),
            )
            .to_string()
        }),
        "kills": kills,
        "rules": rules,
    }))
    .into_response()
}

#[derive(Deserialize)]
struct UsageQuery {
    /// A scope's storage id, `rule|key`, e.g. `tenant|tenant:acme`.
    scope: String,
    /// A UTC day or time in an earlier period: answered from the spend ledger.
    at: Option<String>,
}

async fn usage(
    State(gw): State<Shared>,
    axum::Extension(who): axum::Extension<AdminScope>,
    Query(q): Query<UsageQuery>,
) -> Response {
    let cfg = gw.config();
    let rule_name = q.scope.split('|').next().unwrap_or("");
    let Some(rule) = cfg.policy.scopes.iter().find(|r| &*r.name == rule_name) else {
        let names: Vec<&str> = cfg.policy.scopes.iter().map(|r| &*r.name).collect();
        return crate::respond::unknown_scope(rule_name, &close_matches(rule_name, &names))
            .into_response();
    };
    // A rule's name alone names its one scope only when the rule has no dimensions.
    let scope = match (q.scope.contains('|'), &rule.global_key) {
        (true, _) => q.scope.clone(),
        (false, Some(k)) => k.id().to_owned(),
        (false, None) => {
            let dims: Vec<&str> = rule.dims.iter().map(|d| d.as_str()).collect();
            return crate::respond::scope_needs_key(rule_name, &dims.join("/")).into_response();
        }
    };
    if !who.owns_scope(&scope) {
        return crate::respond::admin_scope_forbidden(who.tenant().unwrap_or_default())
            .into_response();
    }
    let q = UsageQuery { scope, at: q.at };
    if let Some(at) = &q.at {
        return past_usage(&gw, &q.scope, at, rule.budget).await;
    }
    let in_force = |c, n| gw.overrides.in_force(&q.scope, c, n);
    let budget = rule.budget.map(|b| {
        (
            b,
            in_force(crate::overrides::Control::Budget, b.limit.get()),
        )
    });
    match crate::usage::of(&gw.store, &q.scope, budget).await {
        Ok(u) => {
            let mut body = json!({"scope": q.scope, "policy_version": &*cfg.policy.version, "settled": u.settled, "reserved": u.reserved, "leases": u.leases});
            // Instants by the store's clock, as admissions count; what the period carries
            // over from the one before is this period's to spend too.
            body["now_ms"] = json!(u.at_ms);
            body["carried_over"] = json!(u.carried);
            if let Some((b, limit)) = budget {
                let (_, _, end) = b.period.at(u.at_ms);
                let spent = u.settled.saturating_add(u.reserved);
                body["budget"] = json!({"limit": limit, "unit": b.unit.as_str(),
                    "carried_over": u.carried,
                    "remaining": limit.saturating_add(u.carried).saturating_sub(spent),
                    "resets_in_ms": end.saturating_sub(u.at_ms),
                    "resets_at_ms": end,
                    "resets_at": words::instant_ms(end)});
            }
            if let Some(c) = rule.concurrency {
                body["concurrency_limit"] = json!(c.limit.get());
            }
            // Tool calls are counted in a scope of their own, under the rule's.
            if let Some(t) = rule.tool_calls {
                let id = format!("{}?tool_calls", q.scope);
                let limit = in_force(crate::overrides::Control::ToolCalls, t.limit.get());
                if let Ok(tu) = crate::usage::of(&gw.store, &id, Some((t, limit))).await {
                    let (_, _, end) = t.period.at(tu.at_ms);
                    let spent = tu.settled.saturating_add(tu.reserved);
                    body["tool_calls"] = json!({"limit": limit, "settled": tu.settled,
                        "reserved": tu.reserved, "carried_over": tu.carried,
                        "remaining": limit.saturating_add(tu.carried).saturating_sub(spent),
                        "resets_in_ms": end.saturating_sub(tu.at_ms),
                        "resets_at_ms": end, "resets_at": words::instant_ms(end)});
                }
            }
            axum::Json(body).into_response()
        }
        Err(e) => store_failed(e),
    }
}

/// The names among `names` close to `asked`: those that contain it or that it contains, or
/// within a third of its length in edits; at most five.
pub(crate) fn close_matches<'a>(asked: &str, names: &[&'a str]) -> Vec<&'a str> {
    let a = asked.to_ascii_lowercase();
    let mut close: Vec<(usize, &str)> = names
        .iter()
        .map(|n| (edits(&a, &n.to_ascii_lowercase()), *n))
        .filter(|(d, n)| {
            let n = n.to_ascii_lowercase();
            n.contains(&a) || a.contains(&n) || *d <= a.len().max(3) / 3
        })
        .collect();
    close.sort();
    close.into_iter().take(5).map(|(_, n)| n).collect()
}

/// Levenshtein distance, by characters.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The settled total of a budget scope in the period containing `at`, from the spend ledger
/// (the current period too: what the ledger has written of it so far).
async fn past_usage(
    gw: &Shared,
    scope: &str,
    at: &str,
    budget: Option<tollgate_core::policy::BudgetLimit>,
) -> Response {
    let (Some(books), Some(b)) = (&gw.books, budget) else {
        return crate::respond::no_ledger().into_response();
    };
    let Some(at_ms) = utc_instant(at) else {
        return crate::respond::bad_instant(at).into_response();
    };
    let (id, start, end) = b.period.at(at_ms);
    let label = b.period.label();
    match books
        .ledger
        .total(scope, &label, i64::try_from(id).unwrap_or(i64::MAX))
        .await
    {
        Ok(settled) => axum::Json(json!({"scope": scope, "source": "ledger",
            "period": {"label": label, "start_ms": start, "end_ms": end},
            "settled": settled, "budget": {"limit": b.limit.get(), "unit": b.unit.as_str()}}))
        .into_response(),
        Err(e) => crate::respond::ledger_failed(&e.to_string()).into_response(),
    }
}

/// A UTC day (`2026-11-30`) or time (`2026-11-30T08:00:00Z`) in ms since the epoch.
fn utc_instant(text: &str) -> Option<u64> {
    let full = if text.len() == 10 {
        format!("{text}T00:00:00")
    } else {
        text.trim_end_matches('Z').to_owned()
    };
    let t = humantime::parse_rfc3339_weak(&full).ok()?;
    u64::try_from(t.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis()).ok()
}

async fn reload(State(gw): State<Shared>) -> Response {
    match gw.reload() {
        Ok(cfg) => axum::Json(json!({"reloaded": true, "policy_version": &*cfg.policy.version}))
            .into_response(),
        Err(e) => crate::respond::invalid_config(e).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::token_matches;

    #[test]
    fn the_token_is_compared_whole() {
        let t = "0123456789abcdef-secret";
        assert!(token_matches(t, t));
        assert!(!token_matches("0123456789abcdef-secreT", t));
        assert!(!token_matches("0123456789abcdef", t));
        assert!(!token_matches("", t));
        assert!(!token_matches(&format!("{t}x"), t));
    }
}
