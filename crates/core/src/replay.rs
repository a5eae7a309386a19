//! Deterministic replay of a fixture of timed events through the real pipeline and a real store,
//! on a manual clock, on two paths: `unbounded` (no limits, same accounting) and
//! `layered_controls` (the fixture's policy). The fixture format is in `docs/replay.md`.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::clock::{ManualClock, Millis};
use crate::decision::{Decision, Reason};
use crate::ledger::Usage;
use crate::pipeline::{RequestFacts, plan};
use crate::policy::{Policy, Unit};
use crate::store::{Finish, Store, StoreError};

mod fixture;
pub use fixture::*;

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
    /// Sum of tool calls over settled requests.
    pub settled_tool_calls: u64,
    /// Retries answered with their first request's kept answer (idempotency keys).
    pub replayed: u64,
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
    let start = clock.now_ms();
    let mut run = CaseRun {
        path_name,
        policy,
        accounting,
        case,
        store,
        path,
        mismatches,
        report: CaseReport {
            predictions_matched: true,
            ..CaseReport::default()
        },
        in_flight: HashMap::new(),
        committed: HashMap::new(),
        peak: 0,
        claims: HashMap::new(),
    };
    for ev in &case.events {
        clock.set(start + ev.at_ms);
        match &ev.kind {
            EventKind::Request {
                facts,
                expect,
                idempotency,
            } => run.request(facts, *expect, idempotency.as_ref()).await?,
            EventKind::Complete {
                id,
                output_tokens,
                tool_calls,
            } => run.complete(id, *output_tokens, *tool_calls).await?,
        }
    }
    let CaseRun {
        path,
        report,
        in_flight,
        committed,
        peak,
        ..
    } = run;
    path.reserved_outstanding_tokens += in_flight.values().map(|v| v.estimate).sum::<u64>();
    path.max_concurrency = path.max_concurrency.max(peak);
    path.budget_overrun_tokens += committed.values().map(|c| c.2).sum::<u64>();
    Ok(report)
}

/// One case on its way through one path.
struct CaseRun<'a, S> {
    path_name: &'static str,
    policy: &'a Policy,
    accounting: &'a Policy,
    case: &'a Case,
    store: &'a S,
    path: &'a mut PathReport,
    mismatches: &'a mut Vec<Mismatch>,
    report: CaseReport,
    in_flight: HashMap<String, InFlight>,
    /// Committed tokens per token-budget scope of the accounting policy: (committed, limit,
    /// peak overrun).
    committed: HashMap<String, (u64, u64, u64)>,
    peak: u64,
    /// The idempotency key each request claimed, by request id.
    claims: HashMap<String, String>,
}

/// How long a replay's idempotency claims and answers are held: longer than any case.
const KEY_HOLD_MS: u64 = 400 * 86_400_000;

impl<S: Store> CaseRun<'_, S> {
    fn store_error(&self, source: crate::store::StoreError) -> ReplayError {
        ReplayError::Store {
            case: self.case.name.clone(),
            source,
        }
    }

    fn plan_error(&self, message: String) -> ReplayError {
        ReplayError::Plan {
            case: self.case.name.clone(),
            message,
        }
    }

    /// A request: admitted or refused (or, with an idempotency key on the layered path,
    /// replayed), its outcome compared with the prediction.
    async fn request(
        &mut self,
        facts: &RequestFacts,
        expect: Option<Expect>,
        idempotency: Option<&(String, String)>,
    ) -> Result<(), ReplayError> {
        self.path.requests += 1;
        // Unbounded is the path without the gateway: every request is admitted, retries too.
        if let Some((key, digest)) = idempotency.filter(|_| self.path_name != "unbounded") {
            if let Some(settled) = self.claim(facts, key, digest, expect).await? {
                return Ok(settled);
            }
        }
        let p = plan(self.policy, facts).map_err(|e| self.plan_error(e.to_string()))?;
        let decision = self
            .store
            .admit(&p)
            .await
            .map_err(|e| self.store_error(e))?;
        let predicted = match self.path_name {
            "unbounded" => Some(Expect::Admit),
            _ => expect,
        };
        let actual = match &decision {
            Decision::Admit(_) => Expect::Admit,
            Decision::Deny(d) => Expect::Deny(d.reason),
            Decision::Killed(k) => {
                return Err(self.plan_error(format!("the kill switch is on for {}", k.target)));
            }
        };
        self.compare(facts, predicted, actual);
        match decision {
            Decision::Admit(a) => self.admitted(facts, a.max_output_tokens),
            Decision::Killed(_) => {}
            Decision::Deny(d) => {
                self.rejected(d.reason.code());
                // A refused request lets go of its key.
                if let Some(key) = self.claims.remove(&facts.request_id) {
                    self.store
                        .end_claim(&key, &facts.request_id, None, KEY_HOLD_MS)
                        .await
                        .map_err(|e| self.store_error(e))?;
                }
            }
        }
        Ok(())
    }

    /// Claims a request's idempotency key: `Some` when the key says it is not a new request
    /// (replayed, or refused for its key), counted and compared here.
    async fn claim(
        &mut self,
        facts: &RequestFacts,
        key: &str,
        digest: &str,
        expect: Option<Expect>,
    ) -> Result<Option<()>, ReplayError> {
        let claim = crate::store::KeyUse {
            key,
            digest,
            request_id: &facts.request_id,
            in_flight_ms: KEY_HOLD_MS,
        };
        let actual = match self.store.claim_key(claim).await {
            Ok(crate::store::KeyClaim::Claimed) => {
                self.claims.insert(facts.request_id.clone(), key.to_owned());
                return Ok(None);
            }
            Ok(crate::store::KeyClaim::Answered(_)) => Expect::Replayed,
            Ok(crate::store::KeyClaim::InFlight) => Expect::KeyInFlight,
            Ok(crate::store::KeyClaim::Conflict) => Expect::KeyReused,
            Ok(crate::store::KeyClaim::NoRoom) => {
                return Err(self.plan_error("the store has no room for keys".into()));
            }
            Err(e) => return Err(self.store_error(e)),
        };
        self.compare(facts, expect, actual);
        if actual == Expect::Replayed {
            self.path.replayed += 1;
        } else {
            self.rejected(actual.code());
        }
        Ok(Some(()))
    }

    /// Records a mismatch when the outcome is not the one predicted.
    fn compare(&mut self, facts: &RequestFacts, predicted: Option<Expect>, actual: Expect) {
        if let Some(exp) = predicted.filter(|exp| *exp != actual) {
            self.report.predictions_matched = false;
            self.mismatches.push(Mismatch {
                path: self.path_name,
                case: self.case.name.clone(),
                request: facts.request_id.clone(),
                expected: exp.code().to_owned(),
                actual: actual.code().to_owned(),
            });
        }
    }

    fn rejected(&mut self, code: &str) {
        self.path.rejected += 1;
        self.report.rejected += 1;
        *self
            .path
            .rejections_by_reason
            .entry(code.to_owned())
            .or_default() += 1;
    }

    /// An admitted request: its estimate committed in the accounting policy's token budgets.
    fn admitted(&mut self, facts: &RequestFacts, granted: u64) {
        self.path.accepted += 1;
        self.report.accepted += 1;
        let estimate = facts.input_tokens + granted;
        self.path.accepted_estimated_tokens += estimate;
        // Budget accounting against the fixture's policy, on both paths.
        let scopes: Vec<(String, u64)> = plan(self.accounting, facts)
            .map(|ap| {
                ap.reserves()
                    .map(|(_, b)| b)
                    .filter(|b| b.unit == Unit::Tokens)
                    .map(|b| (b.scope.id().to_owned(), b.limit))
                    .collect()
            })
            .unwrap_or_default();
        for (s, limit) in &scopes {
            let c = self.committed.entry(s.clone()).or_insert((0, *limit, 0));
            c.0 += estimate;
            c.2 = c.2.max(c.0.saturating_sub(c.1));
        }
        self.in_flight.insert(
            facts.request_id.clone(),
            InFlight {
                estimate,
                input: facts.input_tokens,
                scopes,
            },
        );
        self.peak = self.peak.max(self.in_flight.len() as u64);
    }

    /// A completion: settled with its output, or, for a request never admitted, a settlement
    /// the store must not know.
    async fn complete(
        &mut self,
        id: &str,
        output_tokens: u64,
        tool_calls: u64,
    ) -> Result<(), ReplayError> {
        // Answered: its key now gives this answer to a retry.
        if let Some(key) = self.claims.remove(id) {
            self.store
                .end_claim(&key, id, Some(b"answered"), KEY_HOLD_MS)
                .await
                .map_err(|e| self.store_error(e))?;
        }
        let Some(InFlight {
            estimate,
            input,
            scopes,
        }) = self.in_flight.remove(id)
        else {
            let usage = Usage {
                output_tokens,
                tool_calls,
                ..Usage::default()
            };
            let f = self
                .store
                .settle(id, usage)
                .await
                .map_err(|e| self.store_error(e))?;
            if !matches!(f, Finish::Unknown) {
                return Err(
                    self.plan_error(format!("store settled {id:?}, which was never admitted"))
                );
            }
            return Ok(());
        };
        let usage = Usage {
            input_tokens: input,
            cached_input_tokens: 0,
            output_tokens,
            tool_calls,
            ..Usage::default()
        };
        let finish = self
            .store
            .settle(id, usage)
            .await
            .map_err(|e| self.store_error(e))?;
        if let Finish::Done { .. } = finish {
            self.path.settled_tokens += usage.total();
            self.path.settled_tool_calls += usage.tool_calls;
            for (s, _) in &scopes {
                if let Some(c) = self.committed.get_mut(s) {
                    c.0 = c.0 - estimate + usage.total();
                    c.2 = c.2.max(c.0.saturating_sub(c.1));
                }
            }
        }
        Ok(())
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
    let rows: [(&str, u64, u64); 10] = [
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
            "settled_tool_calls",
            u.settled_tool_calls,
            l.settled_tool_calls,
        ),
        ("replayed", u.replayed, l.replayed),
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
    // Refusals for a request's idempotency key, which no control makes.
    for (code, n) in &l.rejections_by_reason {
        if Reason::from_code(code).is_none() {
            let _ = writeln!(s, "  {code:<28} {n:>3}");
        }
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
