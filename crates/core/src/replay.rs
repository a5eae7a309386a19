//! Deterministic replay of a fixture of timed events through the real pipeline and a real store,
//! on a manual clock, on two paths: `unbounded` (no limits, same accounting) and
//! `layered_controls` (the fixture's policy). The fixture format is in `docs/replay.md`.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::clock::{ManualClock, Millis};
use crate::decision::{Decision, Reason};
use crate::ledger::Usage;
use crate::pipeline::{RequestFacts, plan};
use crate::policy::{Policy, PolicyError, RawPolicy, Unit};
use crate::scope::{Dimension, Identity};
use crate::store::{Finish, Store, StoreError};

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
    /// Declared input tokens of a request.
    pub input_tokens: Option<u64>,
    /// Declared output cap of a request.
    pub max_output_tokens: Option<u64>,
    /// Predicted outcome on the layered path: `admit` or a reason code.
    pub expect: Option<String>,
    /// Actual output tokens of a completion.
    pub output_tokens: Option<u64>,
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
        /// Its facts.
        facts: RequestFacts,
        /// The predicted layered outcome (`None`: admit expected? no prediction).
        expect: Option<Expect>,
    },
    /// A request completes with this usage.
    Complete {
        /// Request id.
        id: String,
        /// Actual output tokens.
        output_tokens: u64,
    },
}

/// A predicted outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Admitted.
    Admit,
    /// Denied for this reason.
    Deny(Reason),
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
                            Some("admit") => Some(Expect::Admit),
                            Some(code) => {
                                Some(Expect::Deny(Reason::from_code(code).ok_or_else(|| {
                                    err(
                                        format!("{epath}.expect"),
                                        format!("unknown outcome {code:?}"),
                                    )
                                })?))
                            }
                        };
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
                        ] {
                            if let Some(v) = v {
                                identity = identity.with(d, v);
                            }
                        }
                        EventKind::Request {
                            facts: RequestFacts {
                                request_id: id,
                                identity,
                                input_tokens: input,
                                max_output_tokens: e.max_output_tokens,
                                cache_write_tokens: 0,
                            },
                            expect,
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
                        EventKind::Complete { id, output_tokens }
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

/// The figures of one path.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PathReport {
    /// Request events.
    pub requests: u64,
    /// Admitted.
    pub accepted: u64,
    /// Refused.
    pub rejected: u64,
    /// Sum of input + granted max output over admitted requests.
    pub accepted_estimated_tokens: u64,
    /// Sum of input + actual output over settled requests.
    pub settled_tokens: u64,
    /// Estimates of admitted requests still unsettled at the end of their case.
    pub reserved_outstanding_tokens: u64,
    /// Most requests in flight at once in any case.
    pub max_concurrency: u64,
    /// Sum over cases and token budget scopes of the policy of the peak of
    /// `settled + reserved - budget` (0 when never over).
    pub budget_overrun_tokens: u64,
    /// Refusals per reason code.
    pub rejections_by_reason: BTreeMap<String, u64>,
    /// Per case.
    pub cases: BTreeMap<String, CaseReport>,
}

/// The figures of one case on one path.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CaseReport {
    /// Admitted.
    pub accepted: u64,
    /// Refused.
    pub rejected: u64,
    /// Whether every stated prediction held (on `unbounded`, every request must be admitted).
    pub predictions_matched: bool,
}

/// Both paths.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// `unbounded` and `layered_controls`.
    pub paths: BTreeMap<String, PathReport>,
}

/// A prediction that did not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Path.
    pub path: &'static str,
    /// Case.
    pub case: String,
    /// Request id.
    pub request: String,
    /// Predicted.
    pub expected: String,
    /// Observed.
    pub actual: String,
}

/// Replay failed to run (not a mismatch: the store or the fixture is broken).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The store failed.
    #[error("case {case:?}: {source}")]
    Store {
        /// Case.
        case: String,
        /// Error.
        source: StoreError,
    },
    /// A request could not be planned.
    #[error("case {case:?}: {message}")]
    Plan {
        /// Case.
        case: String,
        /// Error.
        message: String,
    },
}

/// Runs both paths. `new_store` makes a clean store on the given clock for each case of each
/// path; the store must take its time from that clock.
pub async fn replay<S, F>(
    fixture: &Fixture,
    mut new_store: F,
) -> Result<(Report, Vec<Mismatch>), ReplayError>
where
    S: Store,
    F: FnMut(&str, &str, ManualClock) -> S,
{
    let mut report = Report::default();
    let mut mismatches = Vec::new();
    let unbounded = Policy::unbounded();
    for (name, policy) in [
        ("unbounded", &unbounded),
        ("layered_controls", &fixture.policy),
    ] {
        let mut path = PathReport::default();
        for case in &fixture.cases {
            let clock = ManualClock::new(fixture.start_ms);
            let store = new_store(name, &case.name, clock.clone());
            let cr = run_case(
                name,
                policy,
                &fixture.policy,
                case,
                &store,
                &clock,
                &mut path,
                &mut mismatches,
            )
            .await?;
            path.cases.insert(case.name.clone(), cr);
        }
        report.paths.insert(name.to_owned(), path);
    }
    Ok((report, mismatches))
}

/// An admitted request the replay has not seen complete.
struct InFlight {
    estimate: u64,
    input: u64,
    /// Token-budget scopes of the fixture's policy, with their limits.
    scopes: Vec<(String, u64)>,
}

#[allow(clippy::too_many_arguments)]
async fn run_case<S: Store>(
    path_name: &'static str,
    policy: &Policy,
    accounting: &Policy,
    case: &Case,
    store: &S,
    clock: &ManualClock,
    path: &mut PathReport,
    mismatches: &mut Vec<Mismatch>,
) -> Result<CaseReport, ReplayError> {
    let serr = |source| ReplayError::Store {
        case: case.name.clone(),
        source,
    };
    let start = clock.now_ms();
    let mut cr = CaseReport {
        predictions_matched: true,
        ..CaseReport::default()
    };
    let mut in_flight: HashMap<String, InFlight> = HashMap::new();
    // Committed tokens per token-budget scope of the accounting policy, and its peak overrun.
    let mut committed: HashMap<String, (u64, u64, u64)> = HashMap::new();
    let mut peak = 0u64;
    for ev in &case.events {
        clock.set(start + ev.at_ms);
        match &ev.kind {
            EventKind::Request { facts, expect } => {
                path.requests += 1;
                let p = plan(policy, facts).map_err(|e| ReplayError::Plan {
                    case: case.name.clone(),
                    message: e.to_string(),
                })?;
                let decision = store.admit(&p).await.map_err(serr)?;
                let predicted = match path_name {
                    "unbounded" => Some(Expect::Admit),
                    _ => *expect,
                };
                let actual = match &decision {
                    Decision::Admit(_) => Expect::Admit,
                    Decision::Deny(d) => Expect::Deny(d.reason),
                    Decision::Killed(k) => {
                        return Err(ReplayError::Plan {
                            case: case.name.clone(),
                            message: format!("the kill switch is on for {}", k.target),
                        });
                    }
                };
                if let Some(exp) = predicted {
                    if exp != actual {
                        cr.predictions_matched = false;
                        mismatches.push(Mismatch {
                            path: path_name,
                            case: case.name.clone(),
                            request: facts.request_id.clone(),
                            expected: outcome(exp),
                            actual: outcome(actual),
                        });
                    }
                }
                match decision {
                    Decision::Admit(a) => {
                        path.accepted += 1;
                        cr.accepted += 1;
                        let estimate = facts.input_tokens + a.max_output_tokens;
                        path.accepted_estimated_tokens += estimate;
                        // Budget accounting against the fixture's policy, on both paths.
                        let scopes: Vec<(String, u64)> = plan(accounting, facts)
                            .map(|ap| {
                                ap.budget
                                    .iter()
                                    .filter(|b| b.unit == Unit::Tokens)
                                    .map(|b| (b.scope.id().to_owned(), b.limit))
                                    .collect()
                            })
                            .unwrap_or_default();
                        for (s, limit) in &scopes {
                            let c = committed.entry(s.clone()).or_insert((0, *limit, 0));
                            c.0 += estimate;
                            c.2 = c.2.max(c.0.saturating_sub(c.1));
                        }
                        in_flight.insert(
                            facts.request_id.clone(),
                            InFlight {
                                estimate,
                                input: facts.input_tokens,
                                scopes,
                            },
                        );
                        peak = peak.max(in_flight.len() as u64);
                    }
                    Decision::Killed(_) => {}
                    Decision::Deny(d) => {
                        path.rejected += 1;
                        cr.rejected += 1;
                        *path
                            .rejections_by_reason
                            .entry(d.reason.code().to_owned())
                            .or_default() += 1;
                    }
                }
            }
            EventKind::Complete { id, output_tokens } => {
                let Some(InFlight {
                    estimate,
                    input,
                    scopes,
                }) = in_flight.remove(id)
                else {
                    // Never admitted: the completion of a refused request changes nothing, and the
                    // store must agree.
                    let f = store
                        .settle(
                            id,
                            Usage {
                                input_tokens: 0,
                                cached_input_tokens: 0,
                                output_tokens: *output_tokens,
                                ..Usage::default()
                            },
                        )
                        .await
                        .map_err(serr)?;
                    if !matches!(f, Finish::Unknown) {
                        return Err(ReplayError::Plan {
                            case: case.name.clone(),
                            message: format!("store settled {id:?}, which was never admitted"),
                        });
                    }
                    continue;
                };
                let usage = Usage {
                    input_tokens: input,
                    cached_input_tokens: 0,
                    output_tokens: *output_tokens,
                    ..Usage::default()
                };
                if let Finish::Done { .. } = store.settle(id, usage).await.map_err(serr)? {
                    path.settled_tokens += usage.total();
                    for (s, _) in &scopes {
                        if let Some(c) = committed.get_mut(s) {
                            c.0 = c.0 - estimate + usage.total();
                            c.2 = c.2.max(c.0.saturating_sub(c.1));
                        }
                    }
                }
            }
        }
    }
    path.reserved_outstanding_tokens += in_flight.values().map(|v| v.estimate).sum::<u64>();
    path.max_concurrency = path.max_concurrency.max(peak);
    path.budget_overrun_tokens += committed.values().map(|c| c.2).sum::<u64>();
    Ok(cr)
}

fn outcome(e: Expect) -> String {
    match e {
        Expect::Admit => "admit".into(),
        Expect::Deny(r) => r.code().into(),
    }
}

impl ManualClock {
    fn now_ms(&self) -> Millis {
        crate::clock::Clock::now(self)
    }
}

/// The report as a table for people.
pub fn table(report: &Report) -> String {
    use std::fmt::Write;
    let empty = PathReport::default();
    let u = report.paths.get("unbounded").unwrap_or(&empty);
    let l = report.paths.get("layered_controls").unwrap_or(&empty);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<30} {:>12} {:>18}",
        "figure", "unbounded", "layered_controls"
    );
    let rows: [(&str, u64, u64); 8] = [
        ("requests", u.requests, l.requests),
        ("accepted", u.accepted, l.accepted),
        ("rejected", u.rejected, l.rejected),
        (
            "accepted_estimated_tokens",
            u.accepted_estimated_tokens,
            l.accepted_estimated_tokens,
        ),
        ("settled_tokens", u.settled_tokens, l.settled_tokens),
        (
            "reserved_outstanding_tokens",
            u.reserved_outstanding_tokens,
            l.reserved_outstanding_tokens,
        ),
        ("max_concurrency", u.max_concurrency, l.max_concurrency),
        (
            "budget_overrun_tokens",
            u.budget_overrun_tokens,
            l.budget_overrun_tokens,
        ),
    ];
    for (k, a, b) in rows {
        let _ = writeln!(s, "{k:<30} {a:>12} {b:>18}");
    }
    let _ = writeln!(s, "\nrejections by reason (layered_controls):");
    for r in Reason::ALL {
        let n = l.rejections_by_reason.get(r.code()).copied().unwrap_or(0);
        let _ = writeln!(s, "  {:<28} {n:>3}", r.code());
    }
    let _ = writeln!(
        s,
        "\n{:<20} {:>22} {:>22}",
        "case", "unbounded acc/rej", "layered acc/rej ok"
    );
    for (name, lc) in &l.cases {
        let uc = u.cases.get(name).cloned().unwrap_or_default();
        let _ = writeln!(
            s,
            "{name:<20} {:>22} {:>22}",
            format!("{}/{}", uc.accepted, uc.rejected),
            format!(
                "{}/{} {}",
                lc.accepted,
                lc.rejected,
                if lc.predictions_matched { "yes" } else { "NO" }
            )
        );
    }
    s
}
