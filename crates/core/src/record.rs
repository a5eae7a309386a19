//! Decision records: one JSON line per request. They hold ids, scopes, numbers and reason codes
//! only; the type has no field that could carry prompt or completion text.

use serde::Serialize;

use crate::clock::Millis;
use crate::decision::Decision;
use crate::pipeline::Plan;

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
    /// Store calls it took to end the request, when more than one (a failed settlement or
    /// release is retried until it lands or the ticket expires).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end_attempts: Option<u32>,
    /// How many of the request's oldest turns the gateway dropped to fit an input limit in
    /// `trim` mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trimmed_turns: Option<u64>,
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
                Decision::Admit(_) => plan.budget.iter().map(|b| b.amount).collect(),
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
            end_attempts: None,
            trimmed_turns: None,
        }
    }

    /// The record as one JSON line (no trailing newline).
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| String::from("{}"))
    }
}
