//! The request path, in the order a request takes it:
//!
//! 1. [`intake`]: the key, the client's address, the body within its limits;
//! 2. [`early`]: a large body's rates decided before it is counted;
//! 3. [`count`]: the body parsed and counted, the model resolved, the request's facts (with
//!    [`idempotent`], [`trim`], [`loops`] and [`degrade`]);
//! 4. [`admit`]: the six controls in one atomic admission (shared with the embedded layer),
//!    waiting in the [`crate::queue`] when one is configured;
//! 5. [`forward`]: the granted cap written into the body, the upstream called;
//! 6. [`meter`]: the answer passed on and its usage read (streamed or whole);
//! 7. [`crate::ticket`]: the admission's ticket ended with that usage, exactly once.
//!
//! Each API format's own rules come from its [`crate::dialect`].

pub(crate) mod admit;
pub(crate) mod count;
pub(crate) mod degrade;
pub(crate) mod early;
pub(crate) mod forward;
pub(crate) mod idempotent;
pub(crate) mod intake;
mod loops;
pub(crate) mod meter;
mod trim;

use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, Request};
use axum::response::Response;
use tollgate_core::pipeline::Kind;
use tollgate_core::record::DecisionRecord;
use tollgate_core::{Admitted, Decision, Plan, PlanError, Unit};

use self::admit::Controls;
use self::count::Counted;
use crate::config::GatewayConfig;
use crate::dialect::Dialect;
use crate::gateway::{Gateway, Shared};
use crate::respond::{self, ApiError};
use crate::ticket::Ticket;

/// The property the `agents` fuzz target checks, shared with the test that replays its corpus:
/// any client body, in every format, gives loop facts and turns without panicking; the
/// fingerprint and repeat count do not change when the body is written again (key order,
/// spacing); and the turns are disjoint ranges in order, within the list.
#[doc(hidden)]
#[allow(clippy::panic)] // a failed check must crash the fuzzer
pub fn fuzz_agents(data: &[u8]) {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    for dialect in crate::dialect::ALL {
        let facts = loops::facts(dialect, &json);
        let again: serde_json::Value = serde_json::to_vec(&json)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(serde_json::Value::Null);
        assert_eq!(
            facts,
            loops::facts(dialect, &again),
            "written again, it changed"
        );
        trim::check_turns(dialect, &json);
    }
}

/// Serves one request of `dialect`'s API; errors take that API's format.
pub async fn handle(
    State(gw): State<Shared>,
    dialect: &'static dyn Dialect,
    req: Request<Body>,
) -> Response {
    let id = gw.next_id();
    let mut resp = match steps(&gw, dialect, &id, req).await {
        Ok(r) => r,
        Err(e) => dialect.error_response(e),
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// intake → count → admit → forward (which meters and settles in a task of its own).
async fn steps(
    gw: &Shared,
    dialect: &'static dyn Dialect,
    id: &str,
    req: Request<Body>,
) -> Result<Response, ApiError> {
    let cfg = gw.config();
    let intake = intake::intake(&cfg, &gw.keys, dialect, req).await?;
    // A large body's rates first: a refused client costs no count.
    let early = early::early_rate(gw, &cfg, &intake, id).await?;
    let mut counted = count::count(gw, &cfg, dialect, &intake, id).await?;
    counted.degraded_from = degrade::degrade(gw, &cfg, &intake.key, &mut counted).await;
    // Claimed before admission, so that a retry is never admitted again; let go of when the
    // request is refused or fails on its way (the claim is dropped).
    let path = dialect.path();
    let claim = match idempotent::claim(&gw.store, &cfg.idempotency, path, &intake, id).await? {
        idempotent::Keyed::Go(claim) => claim,
        idempotent::Keyed::Replay(r) => return Ok(r),
    };
    let admission = admit_counted(gw, &cfg, dialect, &intake.key, &counted, &early, false).await?;
    let (trimmed, degraded) = (counted.trimmed, counted.degraded_from.clone());
    let mut f = forward::prepare(gw, &cfg, dialect, &intake, counted, admission).await?;
    f.answer.claim = claim;
    if let Some(turns) = trimmed {
        respond::trimmed(&mut f.answer.headers, turns);
    }
    if let Some(v) = degraded.and_then(|m| HeaderValue::from_str(&m).ok()) {
        f.answer.headers.insert("x-tollgate-degraded-from", v);
    }
    // From here the request runs in a task of its own, so that a client who leaves does not
    // cut it off half way: a non-streamed request goes on until the upstream answers (within
    // `upstream_timeout`) and settles its true usage, its lease held while the upstream may
    // still be working. A stream is cancelled when its client leaves (the response body that
    // holds it is dropped), its lease held `cancel_grace` longer. Before this point (intake,
    // count, admission, the queue) a client that leaves ends the request at once. The task's
    // future is boxed: tokio keeps one of up to 16 KiB inline in its task and copies it whole
    // at spawn and again when the output is taken.
    match tokio::spawn(Box::pin(forward::forward_and_settle(f))).await {
        Ok(r) => r,
        Err(_) => Err(respond::internal(
            "internal",
            "The request's task ended unexpectedly.",
        )),
    }
}

/// An admitted request: its plan, what was granted, and its ticket.
pub(crate) struct Admission {
    pub plan: Plan,
    pub granted: Admitted,
    pub ticket: Ticket,
}

/// The admit step of the proxy and of reservations: the plan, the decision, its record, and for
/// an admitted request its ticket; a refusal becomes its error, in words that say what was
/// counted. `held_in_store`: the request is admitted by the shared store itself, so that any
/// instance may end it (see [`Plan::held_in_store`]).
pub(crate) async fn admit_counted(
    gw: &Gateway,
    cfg: &GatewayConfig,
    dialect: &dyn Dialect,
    key: &crate::config::KeyConfig,
    counted: &Counted,
    early: &[tollgate_core::ScopeKey],
    held_in_store: bool,
) -> Result<Admission, ApiError> {
    let (mut p, shadow) = plans(&cfg.policy, &counted.facts).map_err(|e| match e {
        PlanError::UnpricedTier { model, tier, .. } => {
            respond::unpriced_tier(tier_field(&tier), &tier, &model)
        }
        PlanError::UnpricedUse { model, what, .. } => respond::unpriced_use(what, &model),
        e => respond::unpriced_model(e),
    })?;
    p.held_in_store = held_in_store;
    // Limits set at run time for one value take their rules' place.
    gw.overrides.apply(&mut p);
    // The attempt was counted in these before its body was (see `early`).
    p.checks.retain(|c| {
        !(matches!(c.kind, Kind::Count(_)) && c.scope().is_some_and(|s| early.contains(s)))
    });
    if gw.books.as_ref().is_some_and(|b| !b.ledger.accepting()) {
        crate::telemetry::ledger_event("refused");
        return Err(respond::ledger_full());
    }
    // A store that lost its state is told, and rebuilt from the ledger when there is one.
    let lost = || gw.store_lost();
    let flow = crate::queue::Flow::of(&cfg.policy, &counted.facts);
    let controls = Controls::of(gw, cfg, (&key.exempt, flow), true, &lost);
    let decided = Instant::now();
    let (decision, shadowed) = controls.decide_shadowed(&mut p, shadow).await?;
    let decision_us = u64::try_from(decided.elapsed().as_micros()).unwrap_or(u64::MAX);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let digest = |v: &str| crate::records::digest(cfg.records_key.as_deref(), v);
    // Made once, for the record; the ledger's end user is the same digest.
    let facts = gw
        .records
        .as_ref()
        .map(|_| tollgate_core::record::RecordedFacts::of(&counted.facts, digest));
    let user = match (&gw.books, &facts) {
        (None, _) => None,
        (Some(_), Some(f)) => f.user.clone(),
        (Some(_), None) => counted.facts.identity.user.as_deref().map(digest),
    };
    let record = |d: &Decision, facts: Option<tollgate_core::record::RecordedFacts>| {
        let mut r = DecisionRecord::new(now_ms, &p, d);
        r.decision_us = Some(decision_us);
        r.trimmed_turns = counted.trimmed;
        r.degraded_from.clone_from(&counted.degraded_from);
        r.input_lower_bound = counted.input_bounded;
        r.shadow = shadowed.refusal();
        r.facts = facts;
        r.digested(digest)
    };
    let admitted = match decision {
        Decision::Admit(a) => a,
        refused => {
            if let Some(sink) = &gw.records {
                sink.emit(record(&refused, facts));
            }
            let tokens = p.estimate_tokens();
            crate::otel::refused(dialect.format(), &counted.model, refused.code(), tokens);
            return Err(refusal(counted, &p, &refused));
        }
    };
    let mut ticket = Ticket::admitted(gw.store.clone(), &p, &admitted);
    if let Some(sink) = &gw.records {
        ticket.record_to(
            record(&Decision::Admit(admitted.clone()), facts),
            sink.clone(),
        );
    }
    ticket.shadow(shadowed.admitted());
    ticket.trace(crate::otel::Operation::admitted(
        dialect.format(),
        &counted.model,
        admitted.max_output_tokens,
        p.estimate_tokens(),
    ));
    if let Some(b) = &gw.books {
        // The store's time of the admission, which its reservations' periods were taken at.
        let at = admitted.expires_at.saturating_sub(p.ttl_ms);
        let id = &counted.facts.identity;
        let who = crate::books::Who {
            tenant: id.tenant.clone(),
            key: id.key.clone(),
            model: id.model.clone(),
            user,
        };
        ticket.book_to(b.booking(&p, who, if admitted.fail_open { now_ms } else { at }));
    }
    Ok(Admission {
        plan: p,
        granted: admitted,
        ticket,
    })
}

/// The body field that asked for `tier`: `service_tier` unless it names another.
fn tier_field(tier: &str) -> &str {
    match tier.split_once(':') {
        Some((field, _)) if !tier.contains('+') => field,
        _ => "service_tier",
    }
}

/// The request's plan, and that of its shadow rules if any, living as long as the enforced
/// plan: the request's renewals, paced by its own lifetime, keep both, and the enforced plan's
/// lifetime stays what the enforced rules say. A shadow plan that cannot be priced is skipped.
pub(crate) fn plans(
    policy: &tollgate_core::Policy,
    facts: &tollgate_core::RequestFacts,
) -> Result<(Plan, Option<Plan>), PlanError> {
    let (p, shadow) = tollgate_core::plans(policy, facts)?;
    let shadow = shadow.ok().flatten().map(|mut s| {
        s.ttl_ms = p.ttl_ms;
        s
    });
    Ok((p, shadow))
}

/// The error of a refused request, with what its input count included and, for a money budget,
/// how marked input was priced (as data: the dialect renders it).
fn refusal(counted: &Counted, p: &Plan, refused: &Decision) -> ApiError {
    let unit = match refused {
        Decision::Deny(d) => p
            .reserves()
            .find(|(_, b)| b.scope == d.scope)
            .map(|(_, b)| b.unit),
        _ => None,
    };
    let mut e = respond::refusal_in(refused, unit);
    if let (Decision::Deny(d), respond::Words::Denied(w)) = (refused, &mut e.words) {
        w.allowances = counted.allowances;
        // A money budget reserved marked input at the dearest cache-write price.
        let money = p
            .reserves()
            .any(|(_, b)| b.unit == Unit::MicroUsd && b.scope == d.scope);
        if money {
            w.cache_writes = counted.facts.cache_write_tokens;
        }
    }
    e
}
