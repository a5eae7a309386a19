//! The admission pipeline, pure: from a request's facts and the policy to a [`Plan`] that a
//! store carries out in one atomic step.
//!
//! A plan is an ordered list of [`Check`]s, one per control and scope, in the controls' fixed
//! order (request rate → input tokens → output-token cap → total tokens → concurrency →
//! budget → tool calls → loops; [`crate::controls::checks`]). The three token controls need no
//! state, so they are decided here, as verdicts at their place; the store counts every count
//! first and reports a rate denial ahead of them, as the order says.

pub use crate::controls::budget::PlanError;
use crate::decision::{Deny, Reason};
use crate::ledger::Usage;
use crate::policy::{OutputMode, Policy, Price, Unit};
use crate::scope::{Dimension, Identity, ScopeKey};

/// What the gateway knows about a request before admission.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestFacts {
    /// Unique id; settlement is idempotent by it.
    pub request_id: String,
    /// Who is asking (the model is one of the dimensions).
    pub identity: Identity,
    /// Input tokens (a lower bound when counting stopped early above every input limit).
    pub input_tokens: u64,
    /// The output cap the request asked for, if any.
    pub max_output_tokens: Option<u64>,
    /// Of the input, the tokens the request may write to the provider's prompt cache (an
    /// Anthropic request that marks blocks with `cache_control`): a money budget reserves them
    /// at the dearest write price, twice the input price, so that settlement stays within the
    /// reservation.
    pub cache_write_tokens: u64,
    /// What makes this request the same as another for loop detection (model, messages,
    /// tools; volatile fields left out), when a rule detects loops.
    pub fingerprint: Option<u64>,
    /// How often the most repeated tool call (name and arguments) appears in the request's
    /// history.
    pub tool_call_repeats: u64,
    /// Output the provider may bill beyond the output cap: predicted output that the model
    /// rejects is billed as output. Granted on top of the cap and checked with it.
    pub extra_output_tokens: u64,
    /// The service tier the request asks for when it is not the standard one: it is reserved and
    /// settled at that tier's price, and refused under a money budget when it has none.
    pub price_tier: Option<String>,
    /// The priority class its key names, if any (else its tenant's, else `standard`).
    pub class: Option<String>,
    /// The most it may use that token prices do not cover (tools the upstream runs, audio
    /// input): reserved at its model's charges under a money budget.
    pub metered: crate::ledger::Metered,
}

pub use crate::controls::{BudgetCheck, Check, ConcurrencyCheck, Kind, RateCheck};

/// Everything a store needs to decide one request atomically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Request id.
    pub request_id: String,
    /// Policy version, for records.
    pub policy_version: std::sync::Arc<str>,
    /// Input tokens.
    pub input_tokens: u64,
    /// The output cap granted (after defaults and clamping).
    pub max_output_tokens: u64,
    /// The checks, in the controls' order: a store counts every count, then walks them in
    /// this order to the first refusal, then takes the leases and reservations.
    pub checks: Vec<Check>,
    /// The attempt was counted in this plan's counts already (by an instance's slices): a
    /// store leaves them out, and they neither refuse nor report a quota.
    pub attempt_counted: bool,
    /// How long leases and reservation live without renewal.
    pub ttl_ms: u64,
    /// The model's price, when any budget is in money.
    pub price: Option<Price>,
    /// How the request's fees are reckoned at settlement, when its model has a price.
    pub fees: Option<crate::policy::FeeRule>,
    /// What expiry or an abandoned request costs, as usage to charge.
    pub expired_usage: Usage,
    /// Whether every stateful control this request is subject to may fail open.
    pub fail_open: bool,
    /// Kill-switch targets this request falls under: `all`, then `tenant:`, `key:`, `model:`,
    /// `user:` where known.
    pub kill_targets: KillTargets,
    /// Admitted and ended by the shared store itself, never against an instance's slices, so
    /// that any instance may end it (a reservation made for code that calls the provider).
    pub held_in_store: bool,
}

impl Plan {
    /// The request's tokens as a provider counts them against its rate when it arrives: its
    /// input and its output cap.
    pub fn size(&self) -> u64 {
        self.input_tokens.saturating_add(self.max_output_tokens)
    }
}

/// The kill-switch targets of a request, held in one string: one allocation per request
/// instead of one per target.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KillTargets {
    text: String,
    /// Where each target ends in `text`.
    ends: [usize; KillTargets::MAX],
    n: usize,
}

impl KillTargets {
    /// `all`, one per dimension a request may be stopped by, and its model's provider hold.
    const MAX: usize = 6;

    /// The targets of a request with `identity`.
    pub fn of(identity: &Identity) -> Self {
        const DIMS: [Dimension; 4] = [
            Dimension::Tenant,
            Dimension::Key,
            Dimension::Model,
            Dimension::User,
        ];
        let len = DIMS
            .iter()
            .filter_map(|d| identity.get(*d).map(|v| d.as_str().len() + 1 + v.len()))
            .sum::<usize>();
        let model = identity.get(Dimension::Model);
        let mut t = Self {
            text: String::with_capacity(3 + len + model.map_or(0, |m| 9 + m.len())),
            ..Self::default()
        };
        t.push(&["all"]);
        for d in DIMS {
            if let Some(v) = identity.get(d) {
                t.push(&[d.as_str(), ":", v]);
            }
        }
        // The provider's own limit for the model, held by the gateway until it resets.
        if let Some(m) = model {
            t.push(&["provider:", m]);
        }
        t
    }

    fn push(&mut self, parts: &[&str]) {
        if let Some(end) = self.ends.get_mut(self.n) {
            for p in parts {
                self.text.push_str(p);
            }
            *end = self.text.len();
            self.n += 1;
        }
    }

    /// The targets, in order.
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        let mut start = 0;
        self.ends.iter().take(self.n).map(move |&end| {
            let target = self.text.get(start..end).unwrap_or_default();
            start = end;
            target
        })
    }

    /// How many targets.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

impl Plan {
    /// Input + granted max output.
    pub fn estimate_tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.max_output_tokens)
    }

    /// The scope of a quota this plan's admission answered (`None` for a quota of another plan
    /// whose index is out of range here).
    pub fn scope_of(&self, q: &crate::decision::Quota) -> Option<&ScopeKey> {
        self.checks.get(q.check).and_then(Check::scope)
    }

    /// The counts, with their places in the plan and their reasons.
    pub fn counts(&self) -> impl Iterator<Item = (usize, Reason, &RateCheck)> + '_ {
        self.checks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match &c.kind {
                Kind::Count(r) => Some((i, c.reason, r)),
                _ => None,
            })
    }

    /// The leases, with their places in the plan.
    pub fn leases(&self) -> impl Iterator<Item = (usize, &ConcurrencyCheck)> + '_ {
        self.checks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match &c.kind {
                Kind::Lease(l) => Some((i, l)),
                _ => None,
            })
    }

    /// The reservations, with their places in the plan.
    pub fn reserves(&self) -> impl Iterator<Item = (usize, &BudgetCheck)> + '_ {
        self.checks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match &c.kind {
                Kind::Reserve(b) => Some((i, b)),
                _ => None,
            })
    }

    /// The counts, to change (limits set at run time).
    pub fn counts_mut(&mut self) -> impl Iterator<Item = &mut RateCheck> + '_ {
        self.checks.iter_mut().filter_map(|c| match &mut c.kind {
            Kind::Count(r) => Some(r),
            _ => None,
        })
    }

    /// The leases, to change.
    pub fn leases_mut(&mut self) -> impl Iterator<Item = &mut ConcurrencyCheck> + '_ {
        self.checks.iter_mut().filter_map(|c| match &mut c.kind {
            Kind::Lease(l) => Some(l),
            _ => None,
        })
    }

    /// The reservations, to change.
    pub fn reserves_mut(&mut self) -> impl Iterator<Item = &mut BudgetCheck> + '_ {
        self.checks.iter_mut().filter_map(|c| match &mut c.kind {
            Kind::Reserve(b) => Some(b),
            _ => None,
        })
    }

    /// The scopes of the plan's stateful checks, in order.
    pub fn scopes(&self) -> impl Iterator<Item = &ScopeKey> + '_ {
        self.checks.iter().filter_map(Check::scope)
    }

    /// The lease at place `i`, if that check is one.
    pub fn lease_at(&self, i: usize) -> Option<&ConcurrencyCheck> {
        match self.checks.get(i).map(|c| &c.kind) {
            Some(Kind::Lease(l)) => Some(l),
            _ => None,
        }
    }

    /// The reservation at place `i`, if that check is one.
    pub fn reserve_at(&self, i: usize) -> Option<&BudgetCheck> {
        match self.checks.get(i).map(|c| &c.kind) {
            Some(Kind::Reserve(b)) => Some(b),
            _ => None,
        }
    }

    /// How many leases and reservations an admission takes.
    pub fn holds(&self) -> usize {
        self.checks
            .iter()
            .filter(|c| matches!(c.kind, Kind::Lease(_) | Kind::Reserve(_)))
            .count()
    }

    /// The first verdict of the plan, when it has one a gateway may give without its store:
    /// a stateless control's always, a stateful one's only when the plan may fail open.
    pub fn verdict_without_store(&self) -> Option<&Deny> {
        self.checks.iter().find_map(|c| match &c.kind {
            Kind::Verdict(d) if !c.reason.is_stateful() || self.fail_open => Some(d),
            _ => None,
        })
    }

    /// Leaves out every check of control `reason` (a reserve's with concurrency's).
    pub fn exempt(&mut self, reason: Reason) {
        self.checks.retain(|c| c.reason.control() != reason);
    }

    /// The check that refused with `d`, found by its reason and scope.
    pub fn check_of(&self, d: &Deny) -> Option<&Check> {
        self.checks
            .iter()
            .find(|c| c.reason == d.reason && c.scope().is_none_or(|s| *s == d.scope))
    }

    /// Whether `d` refused a lease: a slot may free up while the request waits in a queue.
    pub fn refused_lease(&self, d: &Deny) -> bool {
        self.check_of(d)
            .is_some_and(|c| matches!(c.kind, Kind::Lease(_)))
    }
}

/// Builds the plan of one request under `policy`'s enforced rules.
pub fn plan(policy: &Policy, facts: &RequestFacts) -> Result<Plan, PlanError> {
    let mut scopes = matched_scopes(policy, facts);
    scopes.retain(|(i, _)| !policy.scopes[*i].shadow);
    enforced(policy, facts, &scopes)
}

/// The attempt-counting part of a request's plan, from what is known before its body is read
/// (the rules whose dimensions and matches `facts`' identity has): its enforced rules' rate
/// checks and its kill targets, nothing reserved. A gateway admits it before counting a large
/// body, so that a client its rate refuses costs no counting, and then leaves those rate
/// checks out of the request's plan: each attempt is counted once.
pub fn rate_plan(policy: &Policy, facts: &RequestFacts) -> Plan {
    let scopes = matched_scopes(policy, facts);
    let rules: Vec<_> = scopes
        .iter()
        .filter(|(i, _)| !policy.scopes[*i].shadow)
        .map(|(i, k)| (&policy.scopes[*i].controls, k))
        .collect();
    let checks = crate::controls::rate_checks(&rules);
    Plan {
        fail_open: fails_open(policy, &checks),
        kill_targets: KillTargets::of(&facts.identity),
        request_id: facts.request_id.clone(),
        policy_version: policy.version.clone(),
        input_tokens: 0,
        max_output_tokens: 0,
        checks,
        attempt_counted: false,
        ttl_ms: policy.reservation_ttl.get(),
        price: None,
        fees: None,
        expired_usage: Usage::default(),
        held_in_store: false,
    }
}

/// The suffix of a shadow plan's request id.
pub const SHADOW_ID_SUFFIX: &str = "~shadow";

/// The plan of the request's shadow rules, as if they were enforced alongside the others (the
/// output cap is granted under all of them), under its own request id (the request's with
/// [`SHADOW_ID_SUFFIX`]); `None` when no shadow rule applies. Kill switches are the enforced
/// plan's business: this one has none, and never fails open.
pub fn shadow_plan(policy: &Policy, facts: &RequestFacts) -> Result<Option<Plan>, PlanError> {
    // Called on every request: without shadow rules, no scope key is derived a second time.
    if !policy.has_shadow {
        return Ok(None);
    }
    let mut scopes = matched_scopes(policy, facts);
    let granted = granted_cap(policy, &scopes, facts);
    scopes.retain(|(i, _)| policy.scopes[*i].shadow);
    shadowed(policy, facts, &scopes, granted)
}

/// [`plan`] and [`shadow_plan`] of one request, its rules matched and its scope keys derived
/// once for both: a request under shadow rules would otherwise derive its enforced scopes'
/// keys twice. The shadow plan's error is its own, so that a caller can skip it.
pub fn plans(
    policy: &Policy,
    facts: &RequestFacts,
) -> Result<(Plan, Result<Option<Plan>, PlanError>), PlanError> {
    let mut all = matched_scopes(policy, facts);
    if !policy.has_shadow {
        return Ok((enforced(policy, facts, &all)?, Ok(None)));
    }
    let granted = granted_cap(policy, &all, facts);
    // Enforced rules first, each part still in policy order: split in place (a stable sort of a
    // policy's few rules allocates nothing), not copied into two new lists.
    let is_shadow = |(i, _): &Scoped| policy.scopes[*i].shadow;
    all.sort_by_key(is_shadow);
    let (kept, shadow) = all.split_at(all.partition_point(|s| !is_shadow(s)));
    let p = enforced(policy, facts, kept)?;
    Ok((p, shadowed(policy, facts, shadow, granted)))
}

/// The enforced plan under the (enforced) rules `scopes`.
fn enforced(policy: &Policy, facts: &RequestFacts, scopes: &[Scoped]) -> Result<Plan, PlanError> {
    let granted = granted_cap(policy, scopes, facts);
    let mut p = build(policy, facts, scopes, granted, "")?;
    p.kill_targets = KillTargets::of(&facts.identity);
    Ok(p)
}

/// The shadow plan under the shadow rules `shadow`, with the cap granted under all rules.
fn shadowed(
    policy: &Policy,
    facts: &RequestFacts,
    shadow: &[Scoped],
    granted: u64,
) -> Result<Option<Plan>, PlanError> {
    if shadow.is_empty() {
        return Ok(None);
    }
    let mut p = build(policy, facts, shadow, granted, SHADOW_ID_SUFFIX)?;
    p.fail_open = false;
    Ok(Some(p))
}

/// The plan of `facts` under the rules `scopes`, with output cap `granted`, its request id the
/// request's followed by `id_suffix`.
fn build(
    policy: &Policy,
    facts: &RequestFacts,
    scopes: &[Scoped],
    granted: u64,
    id_suffix: &str,
) -> Result<Plan, PlanError> {
    let rules: Vec<_> = scopes
        .iter()
        .map(|(i, k)| (&policy.scopes[*i].controls, k))
        .collect();
    let input = facts.input_tokens;
    let ttl_ms = rules
        .iter()
        .filter_map(|(r, _)| concurrency::lease_ttl_ms(r.concurrency))
        .min()
        .unwrap_or(policy.reservation_ttl.get());
    let model = facts.identity.model.as_deref().unwrap_or("");
    let tier = facts.price_tier.as_deref();
    let price = policy.prices.price(model, tier);
    let mut estimate = Usage {
        input_tokens: input,
        cached_input_tokens: 0,
        output_tokens: granted,
        cache_write_tokens: 0,
        cache_write_1h_tokens: facts.cache_write_tokens.min(input),
        tool_calls: 0,
        fees: 0,
    };
    let (fees, unpriced) = checks::fee_rule(policy, model, facts.metered, &mut estimate);
    let checks = crate::controls::checks(crate::controls::Inputs {
        rules: &rules,
        input,
        granted,
        pricing: budget::Pricing {
            model,
            tier,
            price,
            estimate: &estimate,
            unpriced,
        },
        fingerprint: facts.fingerprint,
        tool_call_repeats: facts.tool_call_repeats,
        class: {
            let c = policy
                .classes
                .of(facts.class.as_deref(), facts.identity.tenant.as_deref());
            (c, policy.classes.weight(c))
        },
    })?;
    // Made at its length: a suffix pushed onto a copy moved it once more.
    let request_id = match id_suffix {
        "" => facts.request_id.clone(),
        s => [facts.request_id.as_str(), s].concat(),
    };
    Ok(Plan {
        fail_open: fails_open(policy, &checks),
        kill_targets: KillTargets::default(),
        request_id,
        policy_version: policy.version.clone(),
        input_tokens: input,
        max_output_tokens: granted,
        checks,
        attempt_counted: false,
        ttl_ms,
        price,
        fees,
        expired_usage: expired_usage(policy, estimate),
        held_in_store: false,
    })
}

/// Whether every check the store decides may fail open, as the policy says (a stateless
/// verdict is given without the store).
fn fails_open(policy: &Policy, checks: &[Check]) -> bool {
    checks
        .iter()
        .filter(|c| c.reason.is_stateful())
        .all(|c| policy.fail_open.contains(&c.reason.control()))
}

/// A rule a request falls under, by index, with the scope it puts the request in.
type Scoped = (usize, ScopeKey);

/// The rules a request falls under, in policy order.
type Matched = Vec<Scoped>;

/// The rules whose matches the identity meets and whose dimensions it has.
fn matched_scopes(policy: &Policy, facts: &RequestFacts) -> Matched {
    // Sized for every rule: growing past four scopes moved the list once per request.
    let mut scopes: Matched = Vec::with_capacity(policy.scopes.len());
    for (i, rule) in policy.scopes.iter().enumerate() {
        let applies = rule
            .matches
            .iter()
            .all(|(d, v)| facts.identity.get(*d) == Some(v.as_str()));
        if !applies {
            continue;
        }
        // A rule over an earlier matched rule's dimensions takes its key renamed.
        let same = rule
            .same_key_as
            .and_then(|j| scopes.iter().find(|(m, _)| *m == j));
        let key = match (&rule.global_key, same) {
            (Some(k), _) => Some(k.clone()),
            (None, Some((_, k))) => Some(k.renamed(&rule.name)),
            (None, None) => {
                ScopeKey::derive_in(&rule.name, &rule.dims, &facts.identity, rule.ip_prefix)
            }
        };
        if let Some(key) = key {
            scopes.push((i, key));
        }
    }
    scopes
}

/// The granted output cap: the request's own, or the tightest default; clamped where a
/// clamping scope says so; then the output billed beyond any cap (rejected predictions) added.
/// Reject-mode caps are checked against the request's own value.
fn granted_cap(policy: &Policy, scopes: &[Scoped], facts: &RequestFacts) -> u64 {
    let requested = facts.max_output_tokens;
    let rule = |i: usize| &policy.scopes[i];
    let mut granted = match requested {
        Some(m) => m,
        None => scopes
            .iter()
            .filter_map(|(i, _)| rule(*i).output_tokens.map(|o| o.default.get()))
            .min()
            .unwrap_or(policy.default_max_output_tokens.get()),
    };
    for (i, _) in scopes {
        if let Some(o) = rule(*i).output_tokens {
            if o.mode == OutputMode::Clamp {
                granted = granted.min(o.max.get());
            }
        }
    }
    granted.saturating_add(facts.extra_output_tokens)
}

/// The amount one usage costs in a unit.
pub fn charge(unit: Unit, price: Option<Price>, usage: &Usage) -> u64 {
    match unit {
        Unit::Tokens => usage.total(),
        Unit::MicroUsd => price.map_or(0, |p| p.cost(usage)),
        Unit::ToolCalls => usage.tool_calls,
    }
}

mod checks;
mod peek;
use crate::controls::{budget, concurrency};
use checks::expired_usage;

#[cfg(test)]
mod tests;
