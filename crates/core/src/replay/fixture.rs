//! The fixture format: parsed raw, then validated into cases of timed events with the policy
//! they run under.

use std::collections::HashMap;

use serde::Deserialize;

use crate::clock::Millis;
use crate::decision::Reason;
use crate::pipeline::RequestFacts;
use crate::policy::{Policy, PolicyError, RawPolicy};
use crate::scope::{Dimension, Identity};

/// A fixture as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFixture {
    /// What the fixture is.
    pub description: Option<String>,
    /// Clock value at the start of every case, ms since the epoch (default 0).
    pub start_ms: Option<u64>,
    /// The policy of the `layered_controls` path.
    pub policy: RawPolicy,
    /// Independent cases, each from a clean state.
    pub cases: Vec<RawCase>,
}

/// One case as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCase {
    /// Unique name.
    pub name: String,
    /// Events in time order.
    pub events: Vec<RawEvent>,
}

/// One event: a request (`request = "id"`) or a completion (`complete = "id"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEvent {
    /// Time since the start of the case, e.g. `0s`, `1500ms`.
    pub at: String,
    /// A request with this id.
    pub request: Option<String>,
    /// The completion of this request id.
    pub complete: Option<String>,
    /// Identity of a request.
    pub tenant: Option<String>,
    /// Identity of a request.
    pub key: Option<String>,
    /// Identity of a request.
    pub user: Option<String>,
    /// Identity of a request.
    pub ip: Option<String>,
    /// Identity of a request.
    pub model: Option<String>,
    /// Identity of a request: the agent operation it belongs to.
    pub operation: Option<String>,
    /// Declared input tokens of a request.
    pub input_tokens: Option<u64>,
    /// Declared output cap of a request.
    pub max_output_tokens: Option<u64>,
    /// Predicted outcome on the layered path: `admit` or a reason code.
    pub expect: Option<String>,
    /// Actual output tokens of a completion.
    pub output_tokens: Option<u64>,
    /// Tool calls a completion's answer made (default 0).
    pub tool_calls: Option<u64>,
    /// A request's content, as a label: requests with the same label are identical for loop
    /// detection (a gateway computes it from the model, messages and tools).
    pub same_as: Option<String>,
    /// How often the most repeated tool call appears in a request's history (default 0).
    pub tool_call_repeats: Option<u64>,
    /// A request's `Idempotency-Key` (honoured on the layered path: a retry of an answered
    /// request is replayed, not admitted).
    pub idempotency_key: Option<String>,
}

/// A validated fixture.
#[derive(Debug, Clone)]
pub struct Fixture {
    /// The layered policy.
    pub policy: Policy,
    /// Clock start.
    pub start_ms: Millis,
    /// Cases.
    pub cases: Vec<Case>,
}

/// A validated case.
#[derive(Debug, Clone)]
pub struct Case {
    /// Name.
    pub name: String,
    /// Events, time-ordered.
    pub events: Vec<Event>,
}

/// A validated event.
#[derive(Debug, Clone)]
pub struct Event {
    /// Offset from the case start, ms.
    pub at_ms: u64,
    /// What happens.
    pub kind: EventKind,
}

/// What happens at an event.
#[derive(Debug, Clone)]
pub enum EventKind {
    /// A request arrives.
    Request {
        /// Its facts (boxed: a request is several times a completion's size).
        facts: Box<RequestFacts>,
        /// The predicted layered outcome (`None`: admit expected? no prediction).
        expect: Option<Expect>,
        /// Its idempotency key, and a digest of what it was sent with.
        idempotency: Option<(String, String)>,
    },
    /// A request completes with this usage.
    Complete {
        /// Request id.
        id: String,
        /// Actual output tokens.
        output_tokens: u64,
        /// Tool calls the answer made.
        tool_calls: u64,
    },
}

/// A predicted outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Admitted.
    Admit,
    /// Denied for this reason.
    Deny(Reason),
    /// A retry of an answered request, given its kept answer (`replayed`).
    Replayed,
    /// A retry while its first request is unanswered (`idempotency_key_in_flight`).
    KeyInFlight,
    /// Its key was used with another request (`idempotency_key_reused`).
    KeyReused,
}

impl Expect {
    /// Its code in fixtures and reports.
    pub fn code(self) -> &'static str {
        match self {
            Expect::Admit => "admit",
            Expect::Deny(r) => r.code(),
            Expect::Replayed => "replayed",
            Expect::KeyInFlight => "idempotency_key_in_flight",
            Expect::KeyReused => "idempotency_key_reused",
        }
    }

    fn parse(code: &str) -> Option<Self> {
        [
            Expect::Admit,
            Expect::Replayed,
            Expect::KeyInFlight,
            Expect::KeyReused,
        ]
        .into_iter()
        .find(|e| e.code() == code)
        .or_else(|| Reason::from_code(code).map(Expect::Deny))
    }
}

impl Fixture {
    /// Parses and validates a TOML fixture; errors name the field.
    pub fn from_toml(text: &str) -> Result<Self, PolicyError> {
        let raw: RawFixture = toml::from_str(text).map_err(|e| PolicyError {
            path: "fixture".into(),
            message: e.to_string(),
        })?;
        Self::validate(raw)
    }

    fn validate(raw: RawFixture) -> Result<Self, PolicyError> {
        let err = |path: String, message: String| PolicyError { path, message };
        let policy = Policy::validate(raw.policy, "policy")?;
        let mut cases = Vec::new();
        let mut names = std::collections::HashSet::new();
        for (ci, c) in raw.cases.into_iter().enumerate() {
            let cpath = format!("cases[{ci}]");
            if !names.insert(c.name.clone()) {
                return Err(err(
                    format!("{cpath}.name"),
                    format!("duplicate case {:?}", c.name),
                ));
            }
            let mut events = Vec::new();
            let mut last = 0u64;
            let mut known = HashMap::new();
            for (ei, e) in c.events.into_iter().enumerate() {
                let epath = format!("{cpath}.events[{ei}]");
                let at = humantime::parse_duration(e.at.trim())
                    .map_err(|x| err(format!("{epath}.at"), format!("invalid duration: {x}")))?;
                let at_ms = u64::try_from(at.as_millis()).unwrap_or(u64::MAX);
                if at_ms < last {
                    return Err(err(
                        format!("{epath}.at"),
                        "events must be in time order".into(),
                    ));
                }
                last = at_ms;
                let kind = match (e.request, e.complete) {
                    (Some(id), None) => {
                        let input = e.input_tokens.ok_or_else(|| {
                            err(
                                format!("{epath}.input_tokens"),
                                "a request needs input_tokens".into(),
                            )
                        })?;
                        let expect = match e.expect.as_deref() {
                            None => None,
                            Some(code) => Some(Expect::parse(code).ok_or_else(|| {
                                err(
                                    format!("{epath}.expect"),
                                    format!("unknown outcome {code:?}"),
                                )
                            })?),
                        };
                        // What a key's request was sent with: its declared tokens and content.
                        let digest = format!("{input}/{:?}/{:?}", e.max_output_tokens, e.same_as);
                        let idempotency = e.idempotency_key.map(|k| (k, digest));
                        if known.insert(id.clone(), ()).is_some() {
                            return Err(err(
                                format!("{epath}.request"),
                                format!("duplicate id {id:?}"),
                            ));
                        }
                        let mut identity = Identity::default();
                        for (d, v) in [
                            (Dimension::Tenant, e.tenant),
                            (Dimension::Key, e.key),
                            (Dimension::User, e.user),
                            (Dimension::Ip, e.ip),
                            (Dimension::Model, e.model),
                            (Dimension::Operation, e.operation),
                        ] {
                            if let Some(v) = v {
                                identity = identity.with(d, v);
                            }
                        }
                        EventKind::Request {
                            facts: Box::new(RequestFacts {
                                request_id: id,
                                identity,
                                input_tokens: input,
                                max_output_tokens: e.max_output_tokens,
                                fingerprint: e.same_as.as_deref().map(label_hash),
                                tool_call_repeats: e.tool_call_repeats.unwrap_or(0),
                                ..RequestFacts::default()
                            }),
                            expect,
                            idempotency,
                        }
                    }
                    (None, Some(id)) => {
                        if !known.contains_key(&id) {
                            return Err(err(
                                format!("{epath}.complete"),
                                format!("no earlier request {id:?}"),
                            ));
                        }
                        let output_tokens = e.output_tokens.ok_or_else(|| {
                            err(
                                format!("{epath}.output_tokens"),
                                "a completion needs output_tokens".into(),
                            )
                        })?;
                        EventKind::Complete {
                            id,
                            output_tokens,
                            tool_calls: e.tool_calls.unwrap_or(0),
                        }
                    }
                    _ => {
                        return Err(err(
                            epath,
                            "give exactly one of `request` or `complete`".into(),
                        ));
                    }
                };
                events.push(Event { at_ms, kind });
            }
            cases.push(Case {
                name: c.name,
                events,
            });
        }
        Ok(Fixture {
            policy,
            start_ms: raw.start_ms.unwrap_or(0),
            cases,
        })
    }
}

/// A fixture's content label as a fingerprint: FNV-1a, stable across builds and platforms.
fn label_hash(label: &str) -> u64 {
    label.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
