//! Cheapest first: a large body's attempt is counted against the rates that do not depend on
//! what the body says (the tenant's, the key's, the address's, the operation's, a key's fixed
//! user's) before the body is parsed and counted, so that a client its rate refuses costs one
//! store call, not a count of its body. The request's own admission then leaves those rate
//! checks out: each attempt is counted once.

use tollgate_core::record::{DecisionRecord, RecordedFacts};
use tollgate_core::{Decision, Dimension, Identity, Reason, RequestFacts, ScopeKey, Store, Usage};

use super::admit::Controls;
use super::intake::{Intake, operation};
use crate::config::GatewayConfig;
use crate::gateway::Gateway;
use crate::queue::Flow;
use crate::respond::{self, ApiError};

/// Bodies larger than this are decided by their rates before they are counted: below it,
/// counting costs less than the store call.
pub(crate) const EARLY_RATE_BYTES: usize = 64 * 1024;

/// The rate scopes the attempt of `intake` (request `id`) was counted in already; a refusal by
/// one of them as the request's error. Empty for a small body, a key exempt from rates, or a
/// store that did not answer (the admission then decides, as it does when the store fails).
pub(crate) async fn early_rate(
    gw: &Gateway,
    cfg: &GatewayConfig,
    intake: &Intake<'_>,
    id: &str,
) -> Result<Vec<ScopeKey>, ApiError> {
    let key: &crate::config::KeyConfig = &intake.key;
    let rates = cfg.policy.scopes.iter().any(|r| r.requests.is_some());
    if intake.body.len() <= EARLY_RATE_BYTES
        || !rates
        || key.exempt.contains(&Reason::RequestRateLimit)
    {
        return Ok(Vec::new());
    }
    let mut identity = Identity::default()
        .with(Dimension::Tenant, key.tenant.clone())
        .with(Dimension::Key, key.key_id.clone())
        .with(Dimension::Ip, intake.ip.clone());
    if let Some(op) = operation(cfg, &intake.headers)? {
        identity = identity.with(Dimension::Operation, op);
    }
    if let (false, Some(u)) = (key.allow_user, &key.user) {
        identity = identity.with(Dimension::User, u.clone());
    }
    let facts = RequestFacts {
        request_id: format!("{id}~rate"),
        identity,
        ..RequestFacts::default()
    };
    let mut p = tollgate_core::rate_plan(&cfg.policy, &facts);
    gw.overrides.apply(&mut p);
    if p.checks.is_empty() {
        return Ok(Vec::new());
    }
    let lost = || gw.store_lost();
    let flow = Flow::of(&cfg.policy, &facts);
    let controls = Controls::of(gw, cfg, (&key.exempt, flow), false, &lost);
    let refused = match controls.decide_alone(&mut p).await {
        // Failed open: the request's own admission decides.
        Ok(Decision::Admit(a)) if a.fail_open => return Ok(Vec::new()),
        Ok(Decision::Admit(_)) => {
            // Nothing was reserved: the admission ends at once.
            let _ = gw
                .store
                .release(&p.request_id, Some(Usage::default()))
                .await;
            return Ok(p.scopes().cloned().collect());
        }
        Ok(refused) => refused,
        // The request's own admission meets the store's fault and answers it.
        Err(_) => return Ok(Vec::new()),
    };
    super::admit::counted(&refused);
    if let Some(sink) = &gw.records {
        let digest = |v: &str| crate::records::digest(cfg.records_key.as_deref(), v);
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut r = DecisionRecord::new(now_ms, &p, &refused);
        r.facts = Some(RecordedFacts::of(&facts, digest));
        sink.emit(r.digested(digest));
    }
    Err(respond::refusal(&refused))
}
