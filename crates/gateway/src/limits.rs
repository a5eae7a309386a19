//! `GET /v1/limits`: what the caller's own key may still spend, so that an application can show
//! its users what is left. Every scope of the policy that applies to the key is listed with its
//! limit, what is used and reserved, what remains and when it resets, in the policy's units
//! (with a person's reading beside each amount), every instant by the store's clock. The call
//! counts in a bucket of its own per key ([`READS_PER_WINDOW`]), not in the request rate, whose
//! windows it reads without counting: a caller that is limited can still read when it resets.

use axum::body::Body;
use axum::extract::{ConnectInfo, Query, State};
use axum::http::Request;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tollgate_core::decision::Admitted;
use tollgate_core::policy::ScopeRule;
use tollgate_core::{Decision, Dimension, Identity, Reason, RequestFacts, ScopeKey, Store, Usage};

use crate::gateway::Shared;
use crate::path::admit::Controls;
use crate::respond::{self, ApiError};
use crate::words;

/// The optional query: values of dimensions a request would name itself.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsQuery {
    /// The model, for rules keyed on it.
    model: Option<String>,
    /// The end user, for a key that lets requests name one.
    user: Option<String>,
}

/// `GET /v1/limits`.
pub async fn limits(
    State(gw): State<Shared>,
    query: Result<Query<LimitsQuery>, axum::extract::rejection::QueryRejection>,
    req: Request<Body>,
) -> Response {
    match answer(&gw, query, req).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn answer(
    gw: &Shared,
    query: Result<Query<LimitsQuery>, axum::extract::rejection::QueryRejection>,
    req: Request<Body>,
) -> Result<Value, ApiError> {
    let cfg = gw.config();
    let key = crate::path::intake::authenticate(&cfg, &gw.keys, req.headers())?;
    let Query(q) = query.map_err(|e| ApiError::invalid("invalid_query", e.body_text()))?;
    let peer = req
        .extensions()
        .get::<ConnectInfo<std::net::SocketAddr>>()
        .map_or(std::net::IpAddr::from([127, 0, 0, 1]), |c| c.0.ip());
    let ip = crate::path::intake::client_ip(&cfg.trusted_proxies, peer, req.headers());
    let mut identity = Identity::default()
        .with(Dimension::Tenant, key.tenant.clone())
        .with(Dimension::Key, key.key_id.clone())
        .with(Dimension::Ip, ip.to_string());
    let user = match (&key.user, key.allow_user, &q.user) {
        (_, true, Some(u)) => Some(u.clone()),
        (Some(u), _, _) => Some(u.clone()),
        _ => None,
    };
    if let Some(u) = user {
        identity = identity.with(Dimension::User, u);
    }
    if let Some(m) = &q.model {
        identity = identity.with(Dimension::Model, m.clone());
    }
    let read = counted(gw, &cfg, &key, &identity).await?;
    let classes = &cfg.policy.classes;
    let class = classes.of(key.class.as_deref(), Some(&key.tenant));
    let mut out = Vec::new();
    for rule in cfg.policy.scopes.iter().filter(|r| !r.shadow) {
        let Some(scope) = rule.key_of(&identity) else {
            continue;
        };
        let at = Row {
            rule,
            scope: &scope,
            class: (class, classes.weight(class)),
        };
        out.extend(rows(gw, at, &read).await?);
    }
    let reads = read.reads.map(|q| {
        let reset = read.now.saturating_add(q.reset_after_ms.unwrap_or(0));
        json!({"limit": q.limit, "remaining": q.remaining, "window": "1m",
            "resets_at_ms": reset, "resets_at": words::instant_ms(reset)})
    });
    Ok(
        json!({"object": "limits", "key": key.key_id, "tenant": key.tenant, "class": class,
        "policy_version": &*cfg.policy.version, "now_ms": read.now, "reads": reads,
        "limits": out}),
    )
}

/// How many `/v1/limits` calls a key may make per [`READS_WINDOW_MS`]: a bucket of their own,
/// apart from the request rate, so that a caller whose requests are limited can still read
/// when they reset.
pub const READS_PER_WINDOW: u64 = 120;
/// The window of [`READS_PER_WINDOW`].
pub const READS_WINDOW_MS: u64 = 60_000;

/// What one admission found: the store's time, the reads bucket's quota, and the request-rate
/// windows read (not counted), by scope id.
struct Read {
    now: u64,
    reads: Option<tollgate_core::decision::Quota>,
    rates: Vec<(String, tollgate_core::decision::Quota)>,
}

/// Counts this call in the key's bucket of reads (its refusal is the answer), and reads the
/// request-rate windows that apply without counting in them; one admission.
async fn counted(
    gw: &Shared,
    cfg: &crate::config::GatewayConfig,
    key: &crate::config::KeyConfig,
    identity: &Identity,
) -> Result<Read, ApiError> {
    use tollgate_core::pipeline::{Check, Kind, RateCheck};
    let facts = RequestFacts {
        request_id: format!("{}~limits", gw.next_id()),
        identity: identity.clone(),
        ..RequestFacts::default()
    };
    let mut p = tollgate_core::rate_plan(&cfg.policy, &facts).peeking();
    gw.overrides.apply(&mut p);
    if key.exempt.contains(&Reason::RequestRateLimit) {
        p.checks.clear();
    }
    // `~` is in no rule's name: the bucket is no rule's scope.
    let scope = ScopeKey::derive("~limits", &[Dimension::Key], identity)
        .ok_or_else(|| ApiError::invalid("invalid_key", "the key has no id"))?;
    let reads = RateCheck {
        scope,
        limit: READS_PER_WINDOW,
        window_ms: READS_WINDOW_MS,
    };
    p.checks.insert(
        0,
        Check {
            reason: Reason::RequestRateLimit,
            kind: Kind::Count(reads),
        },
    );
    let lost = || gw.store_lost();
    let flow = crate::queue::Flow::of(&cfg.policy, &facts);
    // The key's exemptions were applied above: the reads bucket is no rule's, and counts.
    let controls = Controls::of(gw, cfg, (&[], flow), false, &lost);
    match controls.decide_alone(&mut p).await {
        // Read nothing: a reading the store did not give is no reading.
        Ok(Decision::Admit(a)) if a.fail_open => Err(respond::store_unavailable()),
        Ok(Decision::Admit(Admitted {
            quotas, expires_at, ..
        })) => {
            let _ = gw
                .store
                .release(&p.request_id, Some(Usage::default()))
                .await;
            let mut read = Read {
                now: expires_at.saturating_sub(p.ttl_ms),
                reads: None,
                rates: Vec::with_capacity(quotas.len()),
            };
            for q in quotas {
                if q.check == 0 {
                    read.reads = Some(q);
                } else if let Some(s) = p.scope_of(&q) {
                    read.rates.push((s.id().to_owned(), q));
                }
            }
            Ok(read)
        }
        Ok(refused) => Err(respond::refusal(&refused)),
        Err(e) => Err(e),
    }
}

/// A rule whose rows are asked for: its scope for the key, and the key's class and weight.
#[derive(Clone, Copy)]
struct Row<'a> {
    rule: &'a ScopeRule,
    scope: &'a ScopeKey,
    class: (&'a str, u32),
}

/// The rows of one rule's scope: one per control it holds.
async fn rows(
    gw: &Shared,
    Row { rule, scope, class }: Row<'_>,
    read: &Read,
) -> Result<Vec<Value>, ApiError> {
    use crate::overrides::Control;
    // The store's time, as admission decides by it.
    let now = read.now;
    let base =
        |control: &str| json!({"rule": &*rule.name, "scope": scope.key(), "control": control});
    // The limits set at run time for this scope, layered over the rule's.
    let own = |control: Control, default: u64| gw.overrides.in_force(scope.id(), control, default);
    let mut out = Vec::new();
    if let Some(r) = rule.requests {
        let mut row = base("requests");
        row["limit"] = json!(own(Control::Requests, r.limit.get()));
        row["window"] = json!(
            humantime::format_duration(std::time::Duration::from_millis(r.window_ms.get()))
                .to_string()
        );
        if let Some((_, q)) = read.rates.iter().find(|(id, _)| id == scope.id()) {
            let reset = now.saturating_add(q.reset_after_ms.unwrap_or(0));
            row["remaining"] = json!(q.remaining);
            row["resets_at_ms"] = json!(reset);
            row["resets_at"] = json!(words::instant_ms(reset));
        }
        out.push(row);
    }
    for (control, limit) in [
        ("input_tokens", rule.input_tokens.map(|n| n.get())),
        ("output_tokens", rule.output_tokens.map(|o| o.max.get())),
        ("total_tokens", rule.total_tokens.map(|n| n.get())),
    ] {
        if let Some(l) = limit {
            let mut row = base(control);
            row["limit"] = json!(l);
            row["per"] = json!("request");
            out.push(row);
        }
    }
    let budget = rule
        .budget
        .map(|b| (b, own(Control::Budget, b.limit.get())));
    let u = crate::usage::of(&gw.store, scope.id(), budget)
        .await
        .map_err(crate::path::admit::store_error)?;
    if let Some(c) = rule.concurrency {
        let mut row = base("concurrency");
        let mut limit = own(Control::Concurrency, c.limit.get());
        // The slots kept for classes above the key's are not the key's to use.
        if let Some(r) = &rule.reserve {
            let lease = tollgate_core::pipeline::ConcurrencyCheck {
                scope: scope.clone(),
                limit,
                kept_percent: 0,
            };
            let (_, open) = tollgate_core::controls::reserve::apply(r, class.0, class.1, lease);
            row["kept_for_higher_classes"] = json!(limit - open.limit);
            limit = open.limit;
        }
        row["limit"] = json!(limit);
        row["used"] = json!(u.leases);
        row["remaining"] = json!(limit.saturating_sub(u.leases));
        out.push(row);
    }
    if let Some(b) = rule.budget {
        let limit = own(Control::Budget, b.limit.get());
        out.push(amounts(base("budget"), (b, limit), &u, now));
    }
    if let Some(t) = rule.tool_calls {
        let id = format!("{}?tool_calls", scope.id());
        let limit = own(Control::ToolCalls, t.limit.get());
        let tu = crate::usage::of(&gw.store, &id, Some((t, limit)))
            .await
            .map_err(crate::path::admit::store_error)?;
        out.push(amounts(base("tool_calls"), (t, limit), &tu, now));
    }
    Ok(out)
}

/// A budget's row: its amounts in the policy's unit, each with a person's reading.
fn amounts(
    mut row: Value,
    (b, limit): (tollgate_core::policy::BudgetLimit, u64),
    u: &tollgate_core::ScopeUsage,
    now: u64,
) -> Value {
    let (_, _, end) = b.period.at(now);
    // What the period carries over from the one before is this period's to spend too.
    let remaining = limit
        .saturating_add(u.carried)
        .saturating_sub(u.settled.saturating_add(u.reserved));
    row["unit"] = json!(b.unit.as_str());
    for (k, n) in [
        ("limit", limit),
        ("carried_over", u.carried),
        ("used", u.settled),
        ("reserved", u.reserved),
        ("remaining", remaining),
    ] {
        row[k] = json!(n);
        row[format!("{k}_shown")] = json!(words::amount(n, b.unit));
    }
    row["period"] = json!(words::period(b.period));
    row["resets_at_ms"] = json!(end);
    row["resets_at"] = json!(words::instant_ms(end));
    row
}
