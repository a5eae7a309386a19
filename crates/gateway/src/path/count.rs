//! The count step: the body parsed and its input counted (no further than the limits that may
//! apply), the model resolved, what the body does not hold added as input (context the upstream
//! keeps, what its tools fetch, files named by URL or id), and the request's facts made.

use serde_json::Value;
use tollgate_core::{Dimension, Identity, Reason, RequestFacts};

use super::intake::{Intake, end_user, operation};
use crate::config::{GatewayConfig, KeyConfig};
use crate::contexts::{carried, hidden_input};
use crate::dialect::{Dialect, fields};
use crate::gateway::Gateway;
use crate::respond::{self, ApiError};

/// The most choices (`n`, `best_of`) one request may ask for.
const MAX_CHOICES: u64 = 128;

/// A request counted.
#[derive(Debug)]
pub(crate) struct Counted {
    /// The body, parsed.
    pub json: Value,
    /// The model asked for.
    pub model: String,
    /// Index of the upstream that serves it.
    pub upstream: usize,
    /// How many whole answers share the output cap: choices, times prompts.
    pub choices: u64,
    /// Output tokens granted beyond the cap, for a prediction the model may reject.
    pub predicted: u64,
    /// What the admission decides on.
    pub facts: RequestFacts,
    /// Input the body does not hold, in order: the earlier context the upstream keeps, what the
    /// tools it runs may fetch, the files and documents named by URL or id.
    pub allowances: [u64; 3],
    /// How many of its oldest turns were dropped to fit a rule's input limit (`trim` mode).
    pub trimmed: Option<u64>,
    /// Counting stopped past every input limit that could apply: the input is a lower bound.
    pub input_bounded: bool,
    /// The model asked for, when the degrade step sent the request to another.
    pub degraded_from: Option<String>,
}

/// The input admitted for what the body names but does not hold: files and documents by URL or
/// id, and earlier audio answers by id (refused when no allowance is configured for them).
fn remote_allowance(
    cfg: &GatewayConfig,
    count: &tollgate_tokens::RequestCount,
) -> Result<u64, ApiError> {
    let files = u64::from(count.remote_items).saturating_mul(cfg.remote_tokens_per_item);
    if count.audio_references == 0 {
        return Ok(files);
    }
    let Some(per) = cfg.remote_audio_tokens else {
        return Err(respond::audio_reference_unpriced());
    };
    Ok(files.saturating_add(u64::from(count.audio_references).saturating_mul(per)))
}

/// What the request may use that token prices do not cover: the fee-carrying calls of the
/// tools the upstream runs (`tools`), and its audio, held in the body or named by id (at
/// `[remote_content] audio_tokens_per_reference` each).
fn metered(
    cfg: &GatewayConfig,
    count: &tollgate_tokens::RequestCount,
    tools: tollgate_core::Metered,
) -> tollgate_core::Metered {
    let by_reference =
        u64::from(count.audio_references).saturating_mul(cfg.remote_audio_tokens.unwrap_or(0));
    tollgate_core::Metered {
        audio_input_tokens: count.audio_tokens.saturating_add(by_reference),
        ..tools
    }
}

/// Counts the request of `intake`, whose id is `id`.
pub(crate) async fn count(
    gw: &Gateway,
    cfg: &GatewayConfig,
    dialect: &dyn Dialect,
    intake: &Intake<'_>,
    id: &str,
) -> Result<Counted, ApiError> {
    let key: &KeyConfig = &intake.key;
    let limit = count_limit(&cfg.policy, key, &intake.ip);
    let count = count_body(gw, &cfg.counter, dialect, intake, limit).await?;
    let Some(&upstream) = cfg.models.get(&count.model) else {
        return Err(respond::model_not_found(&respond::shown(&count.model)));
    };
    if key
        .models
        .as_ref()
        .is_some_and(|m| !m.contains(&count.model))
    {
        return Err(respond::model_not_allowed(&count.model));
    }
    if let Some(m) = count
        .max_output_tokens
        .filter(|m| *m > cfg.max_output_tokens)
    {
        return Err(respond::output_cap_too_large(
            dialect.cap_field(),
            m,
            cfg.max_output_tokens,
        ));
    }
    let mut json: Value = serde_json::from_slice(&intake.body).map_err(respond::invalid_json)?;
    dialect.check_body(&json)?;
    let free = &cfg.upstreams[upstream].free_fields;
    fields::check(dialect.fields(), &json, free)?;
    let price_tier = fields::price_tier(dialect.fields(), &json, dialect.standard_tiers())?;
    let predicted = match dialect.predicted_text(&json)? {
        Some(text) => cfg.counter.count_text(&count.model, &text, None).0,
        None => 0,
    };
    let kept_context = if dialect.keeps_context() {
        kept_context(gw, cfg, &json).await
    } else {
        0
    };
    // What tools the upstream runs will fetch is input too; their calls are bounded in the body.
    let tools = dialect.upstream_tools(&mut json, cfg.upstream_tools);
    let tool_input = tools.tokens;
    // So is the content of files and documents named by URL or id.
    let mut remote_input = remote_allowance(cfg, &count)?;
    let mut input = count
        .input_tokens
        .saturating_add(kept_context)
        .saturating_add(tool_input)
        .saturating_add(remote_input);
    let user = end_user(key, &json, &intake.headers)?;
    let mut identity = identity(key, &intake.ip, &count.model, user);
    if let Some(op) = operation(cfg, &intake.headers)? {
        identity = identity.with(Dimension::Operation, op);
    }
    let mut trimmed = None;
    if let Some(target) = trim_target(&cfg.policy, key, &identity).filter(|t| input > *t) {
        let extra = kept_context.saturating_add(tool_input);
        let per_item = cfg.remote_tokens_per_item;
        if let Some(t) = super::trim::fit(gw, dialect, &json, target, extra, per_item, limit) {
            remote_input = u64::from(t.count.remote_items).saturating_mul(per_item);
            input = t
                .count
                .input_tokens
                .saturating_add(extra)
                .saturating_add(remote_input);
            json = t.json;
            trimmed = Some(t.dropped);
        }
    }
    // Several choices multiply the output: the cap and the estimate are for the whole request,
    // and each choice gets its share.
    let choices = dialect.choices(&json)?;
    if choices > MAX_CHOICES {
        return Err(respond::too_many_choices(choices, MAX_CHOICES));
    }
    // Each prompt of a list gets its own choices, each a whole answer up to the cap.
    let choices = choices.saturating_mul(dialect.prompts(&json));
    let (fingerprint, tool_call_repeats) = if cfg.policy.scopes.iter().any(|r| r.loops.is_some()) {
        let (fp, repeats) = super::loops::facts(dialect, &json);
        (Some(fp), repeats)
    } else {
        (None, 0)
    };
    let facts = RequestFacts {
        request_id: id.to_owned(),
        identity,
        input_tokens: input,
        max_output_tokens: if dialect.has_output() {
            count.max_output_tokens.map(|m| m.saturating_mul(choices))
        } else {
            Some(0)
        },
        cache_write_tokens: dialect.cache_write_tokens(&json, input),
        fingerprint,
        tool_call_repeats,
        extra_output_tokens: if dialect.has_output() { predicted } else { 0 },
        price_tier,
        class: key.class.clone(),
        metered: metered(cfg, &count, tools.metered),
    };
    Ok(Counted {
        json,
        model: count.model,
        upstream,
        choices,
        predicted,
        facts,
        allowances: [kept_context, tool_input, remote_input],
        input_bounded: count.over_limit && trimmed.is_none(),
        trimmed,
        degraded_from: None,
    })
}

/// The body of `intake` counted up to `limit`; a large one off the async workers, within its
/// tenant's share of the pool.
async fn count_body(
    gw: &Gateway,
    counter: &tollgate_tokens::TokenCounter,
    dialect: &dyn Dialect,
    intake: &Intake<'_>,
    limit: Option<u64>,
) -> Result<tollgate_tokens::RequestCount, ApiError> {
    // Long texts counted for this tenant before are not counted again.
    let counter = counter.with_memo(gw.memos.for_tenant(&intake.key.tenant));
    let counted = if intake.body.len() > super::early::EARLY_RATE_BYTES {
        let (body, format) = (intake.body.clone(), dialect.format());
        gw.counting
            .run(&intake.key.tenant, move || {
                counter.count(format, &body, limit)
            })
            .await
            .ok_or_else(|| respond::internal("internal", "the count did not run"))?
    } else {
        counter.count(dialect.format(), &intake.body, limit)
    };
    counted.map_err(|e| match e.field() {
        Some(f) => respond::invalid_field(f, e.to_string()),
        None => respond::invalid_json(e),
    })
}

/// The most input tokens a caller may state for a request it does not send.
pub(crate) const MAX_STATED_INPUT: u64 = 100_000_000;

/// A request its caller states rather than sends (a reservation for a body it cannot send):
/// its model, input tokens and output cap, checked as a body's would be. Fields, tools and
/// files are not known: what they cost is the caller's to include in `input_tokens`.
pub(crate) fn stated(
    cfg: &GatewayConfig,
    intake: &Intake<'_>,
    id: &str,
    (model, input_tokens, max_output_tokens): (String, u64, u64),
) -> Result<Counted, ApiError> {
    let key: &KeyConfig = &intake.key;
    let Some(&upstream) = cfg.models.get(&model) else {
        return Err(respond::model_not_found(&respond::shown(&model)));
    };
    if key.models.as_ref().is_some_and(|m| !m.contains(&model)) {
        return Err(respond::model_not_allowed(&model));
    }
    if input_tokens > MAX_STATED_INPUT {
        return Err(respond::invalid_field(
            "input_tokens",
            format!("at most {MAX_STATED_INPUT} input tokens may be stated"),
        ));
    }
    if max_output_tokens > cfg.max_output_tokens {
        let largest = cfg.max_output_tokens;
        let e = respond::output_cap_too_large("max_output_tokens", max_output_tokens, largest);
        return Err(e);
    }
    let json = Value::Object(serde_json::Map::new());
    let user = end_user(key, &json, &intake.headers)?;
    let mut identity = identity(key, &intake.ip, &model, user);
    if let Some(op) = operation(cfg, &intake.headers)? {
        identity = identity.with(Dimension::Operation, op);
    }
    let facts = RequestFacts {
        request_id: id.to_owned(),
        identity,
        input_tokens,
        max_output_tokens: Some(max_output_tokens),
        cache_write_tokens: 0,
        fingerprint: None,
        tool_call_repeats: 0,
        extra_output_tokens: 0,
        price_tier: None,
        class: key.class.clone(),
        metered: tollgate_core::Metered::default(),
    };
    Ok(Counted {
        json,
        model,
        upstream,
        choices: 1,
        predicted: 0,
        facts,
        allowances: [0; 3],
        input_bounded: false,
        trimmed: None,
        degraded_from: None,
    })
}

/// The smallest input limit of the `trim`-mode rules the request falls under (none for a key
/// exempt from input limits).
fn trim_target(
    policy: &tollgate_core::Policy,
    key: &KeyConfig,
    identity: &Identity,
) -> Option<u64> {
    if key.exempt.contains(&Reason::InputTokenLimit) {
        return None;
    }
    policy
        .scopes
        .iter()
        .filter(|r| r.trim_input)
        .filter(|r| r.dims.iter().all(|d| identity.get(*d).is_some()))
        .filter(|r| {
            r.matches
                .iter()
                .all(|(d, v)| identity.get(*d) == Some(v.as_str()))
        })
        .filter_map(|r| r.input_tokens.map(|m| m.get()))
        .min()
}

/// The identity admission sees: the key's tenant and id, the client's address, the model, and
/// the end user when there is one.
fn identity(key: &KeyConfig, ip: &str, model: &str, user: Option<String>) -> Identity {
    let identity = Identity::default()
        .with(Dimension::Tenant, key.tenant.clone())
        .with(Dimension::Key, key.key_id.clone())
        .with(Dimension::Ip, ip.to_owned())
        .with(Dimension::Model, model.to_owned());
    match user {
        Some(u) => identity.with(Dimension::User, u),
        None => identity,
    }
}

/// Responses API: the earlier context a follow-up carries, which the upstream keeps (see
/// [`crate::contexts`]).
async fn kept_context(gw: &Gateway, cfg: &GatewayConfig, json: &Value) -> u64 {
    let (ids, references) = carried(json);
    let mut known = Vec::with_capacity(ids.len());
    for id in ids {
        let k = gw.context_of(id).await;
        crate::telemetry::followup_context(k.is_some());
        known.push(k);
    }
    hidden_input(known, references, cfg.unknown_context_tokens)
}

/// How far counting must go. It may stop once past the largest input or total limit among the
/// rules this request may fall under (past it, each of those is exceeded and the first in order
/// is reported), but not when one of them has a budget, which reserves the whole count. Rules
/// another tenant, key or address is matched by do not count; a rule whose match depends on
/// what the request says (model, end user, operation) is taken as applying.
fn count_limit(policy: &tollgate_core::Policy, key: &KeyConfig, ip: &str) -> Option<u64> {
    let known = |d: Dimension| match d {
        Dimension::Tenant => Some(key.tenant.as_str()),
        Dimension::Key => Some(key.key_id.as_str()),
        Dimension::Ip => Some(ip),
        Dimension::User if !key.allow_user => key.user.as_deref().or(Some("")),
        Dimension::User | Dimension::Model | Dimension::Operation => None,
    };
    let mut limit = None;
    for rule in &policy.scopes {
        let may_apply = rule
            .matches
            .iter()
            .all(|(d, v)| known(*d).is_none_or(|k| k == v));
        if !may_apply {
            continue;
        }
        if rule.budget.is_some() {
            return None;
        }
        if let Some(l) = rule.input_tokens.or(rule.total_tokens) {
            limit = Some(limit.unwrap_or(0).max(l.get()));
        }
    }
    limit
}
