//! The degrade step, between count and admit: a request for a model that a rule degrades
//! (`degrade = { at, models }`, `tollgate_core::controls::degrade`) goes to the cheaper model
//! once the rule's budget in its scope is used past the share. The budget's use is read, not
//! held: the admission that follows reserves atomically, at the model the request now asks
//! for. A budget that cannot be read degrades nothing; the admission meets the store's fault.

use serde_json::Value;
use tollgate_core::{Dimension, Store};

use super::count::Counted;
use crate::config::{GatewayConfig, KeyConfig};
use crate::gateway::Gateway;

/// Sends `counted` to the model its first degrading rule names, when that rule's budget is
/// used past its share; returns the model it asked for when it does.
pub(crate) async fn degrade(
    gw: &Gateway,
    cfg: &GatewayConfig,
    key: &KeyConfig,
    counted: &mut Counted,
) -> Option<String> {
    for rule in cfg.policy.scopes.iter().filter(|r| !r.shadow) {
        let (Some(d), Some(b)) = (&rule.degrade, rule.budget) else {
            continue;
        };
        if !d.models.contains_key(&counted.model) {
            continue;
        }
        let Some(scope) = rule.key_of(&counted.facts.identity) else {
            continue;
        };
        let Ok(u) = gw.store.usage(scope.id(), Some(b.period)).await else {
            continue;
        };
        let used = u.settled.saturating_add(u.reserved);
        let limit = b.limit.get().saturating_add(u.carried);
        let Some(to) = d.to(&counted.model, used, limit) else {
            continue;
        };
        // A key kept to some models is not sent to another one.
        let allowed = key
            .models
            .as_ref()
            .is_none_or(|m| m.iter().any(|k| k == to));
        let Some(&upstream) = cfg.models.get(to).filter(|_| allowed) else {
            continue;
        };
        let from = std::mem::replace(&mut counted.model, to.to_owned());
        counted.upstream = upstream;
        counted.json["model"] = Value::String(to.to_owned());
        let identity = std::mem::take(&mut counted.facts.identity);
        counted.facts.identity = identity.with(Dimension::Model, to);
        tracing::debug!(from, to, rule = %rule.name, "a request is degraded to a cheaper model");
        return Some(from);
    }
    None
}
