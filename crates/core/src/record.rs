//! Decision records: one JSON line per request. They hold ids, scopes, numbers and reason codes
//! only; the type has no field that could carry prompt or completion text.

use serde::{Deserialize, Serialize};

use crate::clock::Millis;
use crate::decision::Decision;
use crate::ledger::Usage;
use crate::pipeline::{Plan, RequestFacts};
use crate::scope::Identity;

/// One request's decision and accounting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DecisionRecord {
    /// When the decision was made (ms since the epoch).
    pub ts_ms: Millis,
    /// The request id.
    pub request_id: String,
    /// The policy version that decided.
    pub policy_version: String,
    /// `admit` or `deny`.
    pub decision: &'static str,
    /// The reason code of a denial.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
    /// The scope of a denial.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// Input tokens counted.
    pub input_tokens: u64,
    /// Output cap granted.
    pub max_output_tokens: u64,
    /// Input + granted output.
    pub estimated_tokens: u64,
    /// Reserved per budget scope, in each scope's unit.
    pub reserved: Vec<u64>,
    /// Settled per budget scope, once known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub settled: Option<Vec<u64>>,
    /// Upstream HTTP status, once known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_status: Option<u16>,
    /// Time spent deciding, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision_us: Option<u64>,
    /// Time until the upstream finished, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_ms: Option<u64>,
    /// How an admitted request ended: `settled`, `released`, or `abandoned` (no settlement
    /// reached the store from this instance; the lease expires).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ending: Option<&'static str>,
    /// Admitted without the store (fail open).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub fail_open: bool,
    /// The upstream reported more tokens than were reserved (charged all the same, each number
    /// bounded by [`crate::ledger::MAX_USAGE_TOKENS`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub over_reservation: bool,
    /// A usage number the upstream reported was not a count (negative, fractional, a string):
    /// the reservation was charged instead.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub usage_invalid: bool,
    /// The output the upstream reported, when it was less than the output the gateway counted
    /// passing through it (the count was charged).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reported_output_tokens: Option<u64>,
    /// Store calls it took to end the request, when more than one (a failed settlement or
    /// release is retried until it lands or the ticket expires).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end_attempts: Option<u32>,
    /// How many of the request's oldest turns the gateway dropped to fit an input limit in
    /// `trim` mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trimmed_turns: Option<u64>,
    /// The model the request asked for, when a rule's `degrade` sent it to a cheaper one (the
    /// facts name the model it went to).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub degraded_from: Option<String>,
    /// Counting stopped once the input passed every input limit that could apply: `input_tokens`
    /// is a lower bound (the limit plus one), not the whole count.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub input_lower_bound: bool,
    /// The client went away before the answer's end: the gateway read the upstream on to its
    /// usage (or charged the reservation when none came).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub client_left: bool,
    /// The refusal a shadow rule would have made (the request was decided without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowRefusal>,
    /// What the request asked, so that `tollgate whatif` can plan it again under another
    /// policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub facts: Option<RecordedFacts>,
    /// The usage it ended with, as reported (bounded), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A request's facts as a record keeps them: no text, and nothing a client chose in clear. The
/// tenant, key id and model are the operator's names; the end user, the operation and the
/// client's network are digests (equal values give equal digests, which is all a scope needs;
/// a policy that `match`es one of them by value cannot be tried on them).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedFacts {
    /// Tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Key id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Digest of the end user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Digest of the client's network (an IPv4 address, an IPv6 /64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
    /// Digest of the agent operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<String>,
    /// The output cap the request asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    /// Input tokens it may write to a prompt cache.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_write_tokens: u64,
    /// Its loop fingerprint, in hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// Repeats of its history's most repeated tool call.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tool_call_repeats: u64,
    /// Output billed beyond the cap that it asked for (predicted output).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub extra_output_tokens: u64,
    /// The service tier it asked for, when not the standard one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_tier: Option<String>,
    /// The priority class its key names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl RecordedFacts {
    /// The record of `facts`; `digest` turns a client-chosen value (user, operation, network)
    /// into the text kept.
    pub fn of(facts: &RequestFacts, digest: impl Fn(&str) -> String) -> Self {
        let id = &facts.identity;
        Self {
            tenant: id.tenant.clone(),
            key: id.key.clone(),
            model: id.model.clone(),
            user: id.user.as_deref().map(&digest),
            // The network the default `ip` scopes group by, so that addresses rotated inside
            // one IPv6 /64 stay one value.
            ip: id
                .ip
                .as_deref()
                .map(|v| match v.parse::<std::net::IpAddr>() {
                    Ok(a) => digest(&crate::scope::IpPrefix::default().network(a)),
                    Err(_) => digest(v),
                }),
            operation: id.operation.as_deref().map(&digest),
            max_output_tokens: facts.max_output_tokens,
            cache_write_tokens: facts.cache_write_tokens,
            fingerprint: facts.fingerprint.map(|f| format!("{f:016x}")),
            tool_call_repeats: facts.tool_call_repeats,
            extra_output_tokens: facts.extra_output_tokens,
            price_tier: facts.price_tier.clone(),
            class: facts.class.clone(),
        }
    }

    /// The facts of request `request_id` with `input_tokens`, to plan again.
    pub fn to_facts(&self, request_id: &str, input_tokens: u64) -> RequestFacts {
        RequestFacts {
            request_id: request_id.to_owned(),
            identity: Identity {
                tenant: self.tenant.clone(),
                key: self.key.clone(),
                user: self.user.clone(),
                ip: self.ip.clone(),
                model: self.model.clone(),
                operation: self.operation.clone(),
            },
            input_tokens,
            max_output_tokens: self.max_output_tokens,
            cache_write_tokens: self.cache_write_tokens,
            // A record keeps no tool or audio counts: a replay reserves tokens' prices only.
            metered: crate::ledger::Metered::default(),
            fingerprint: self
                .fingerprint
                .as_deref()
                .and_then(|f| u64::from_str_radix(f, 16).ok()),
            tool_call_repeats: self.tool_call_repeats,
            extra_output_tokens: self.extra_output_tokens,
            price_tier: self.price_tier.clone(),
            class: self.class.clone(),
        }
    }
}

/// A scope id (`tenant:acme/user:alice`) or kill target (`user:alice`) with the values of the
/// dimensions a client chooses (`user`, `operation`, `ip`) replaced by `digest` of them; the
/// operator's (tenant, key, model, global) are kept.
pub fn digest_scope(scope: &str, digest: impl Fn(&str) -> String) -> String {
    const DIMS: [&str; 6] = ["tenant", "key", "user", "ip", "model", "operation"];
    // A part starts at a dimension's name and its colon; a `/` inside a value (an address's
    // prefix length, `/64`) belongs to the value.
    let mut parts: Vec<String> = Vec::new();
    for piece in scope.split('/') {
        let starts = piece
            .split_once(':')
            .is_some_and(|(d, _)| DIMS.contains(&d));
        match parts.last_mut() {
            Some(last) if !starts => {
                last.push('/');
                last.push_str(piece);
            }
            _ => parts.push(piece.to_owned()),
        }
    }
    parts
        .into_iter()
        .map(|part| match part.split_once(':') {
            Some((dim @ ("user" | "operation" | "ip"), value)) => {
                format!("{dim}:{}", digest(value))
            }
            _ => part,
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// A would-be refusal of a shadow rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShadowRefusal {
    /// The reason code it would have refused with.
    pub reason: &'static str,
    /// The shadow rule.
    pub rule: String,
    /// The scope.
    pub scope: String,
}

impl DecisionRecord {
    /// The record of a decision, before the upstream is called.
    pub fn new(ts_ms: Millis, plan: &Plan, decision: &Decision) -> Self {
        let deny = decision.deny();
        Self {
            ts_ms,
            request_id: plan.request_id.clone(),
            policy_version: plan.policy_version.to_string(),
            decision: match decision {
                Decision::Admit(_) => "admit",
                Decision::Deny(_) => "deny",
                Decision::Killed(_) => "killed",
            },
            reason: deny.map(|d| d.reason.code()),
            scope: match decision {
                Decision::Deny(d) => Some(d.scope.key().to_owned()),
                Decision::Killed(k) => Some(k.target.clone()),
                Decision::Admit(_) => None,
            },
            input_tokens: plan.input_tokens,
            max_output_tokens: plan.max_output_tokens,
            estimated_tokens: plan.estimate_tokens(),
            reserved: match decision {
                Decision::Admit(_) => plan.reserves().map(|(_, b)| b.amount).collect(),
                _ => Vec::new(),
            },
            settled: None,
            upstream_status: None,
            decision_us: None,
            upstream_ms: None,
            ending: None,
            fail_open: matches!(decision, Decision::Admit(a) if a.fail_open),
            over_reservation: false,
            usage_invalid: false,
            reported_output_tokens: None,
            end_attempts: None,
            trimmed_turns: None,
            degraded_from: None,
            input_lower_bound: false,
            client_left: false,
            shadow: None,
            facts: None,
            usage: None,
        }
    }

    /// The record with every value a client chose in its scope ids (the end user, the
    /// operation, the address) replaced by `digest` of it, the way [`RecordedFacts::of`] keeps
    /// them: its refusal's scope, a kill switch's target, a shadow rule's would-be refusal.
    #[must_use]
    pub fn digested(mut self, digest: impl Fn(&str) -> String) -> Self {
        self.scope = self.scope.map(|s| digest_scope(&s, &digest));
        if let Some(s) = self.shadow.as_mut() {
            s.scope = digest_scope(&s.scope, &digest);
        }
        self
    }

    /// The record as one JSON line (no trailing newline).
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| String::from("{}"))
    }
}

#[cfg(test)]
mod tests {
    use super::digest_scope;

    #[test]
    fn client_chosen_values_are_digested_in_scope_ids() {
        let d = |v: &str| format!("<{}>", v.len());
        assert_eq!(
            digest_scope("tenant:acme/user:alice", d),
            "tenant:acme/user:<5>"
        );
        // An address's prefix length belongs to the address.
        assert_eq!(digest_scope("ip:2001:db8:1:2::/64", d), "ip:<17>");
        assert_eq!(
            digest_scope("tenant:acme/operation:run-7/model:gpt-4o", d),
            "tenant:acme/operation:<5>/model:gpt-4o"
        );
        assert_eq!(digest_scope("user:bob", d), "user:<3>");
        assert_eq!(digest_scope("global", d), "global");
    }
}
