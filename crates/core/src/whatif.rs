//! What-if: recorded decision records replayed through the real pipeline and a store (the
//! memory store, on a manual clock set to each record's time) under another policy, and what
//! it would have changed: requests refused that were served, requests served that were
//! refused, and the tokens and money that would not have been spent.
//!
//! Each record with facts (see [`crate::record::RecordedFacts`]) is one admission at its
//! decision time. A request admitted now ends at the time it ended then, with the usage it
//! reported then; one that was refused then has no usage on record, so it is charged its
//! reservation (input + the cap granted now) and ends at once (its lease is not held).
//! Records of a kill switch are left out: a kill switch is an operator's act, not the policy's.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::clock::ManualClock;
use crate::decision::Decision;
use crate::ledger::Usage;
use crate::pipeline::plan;
use crate::policy::Policy;
use crate::record::RecordedFacts;
use crate::store::{Store, StoreError};

/// The fields of a decision record what-if reads; others are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct RecordLine {
    /// Decision time, ms since the epoch.
    pub ts_ms: u64,
    /// Request id.
    pub request_id: String,
    /// The policy version that decided.
    pub policy_version: String,
    /// `admit`, `deny` or `killed`.
    pub decision: String,
    /// Reason code of a refusal.
    #[serde(default)]
    pub reason: Option<String>,
    /// Input tokens counted.
    pub input_tokens: u64,
    /// Whether `input_tokens` is a lower bound (counting stopped past the limits then).
    #[serde(default)]
    pub input_lower_bound: bool,
    /// Time from admission to the end, ms.
    #[serde(default)]
    pub upstream_ms: Option<u64>,
    /// The request's facts (records written before they were kept have none).
    #[serde(default)]
    pub facts: Option<RecordedFacts>,
    /// The usage it ended with.
    #[serde(default)]
    pub usage: Option<Usage>,
}

/// Requests whose answer would change, grouped.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Change {
    /// The rule that would refuse (newly refused), or empty.
    pub rule: String,
    /// Tenant, or empty.
    pub tenant: String,
    /// Key id, or empty.
    pub key: String,
    /// The reason it would be refused (newly refused), or was refused (newly served).
    pub reason: String,
    /// How many requests.
    pub requests: u64,
    /// Their tokens: settled then (newly refused), reserved now (newly served).
    pub tokens: u64,
}

/// What the new policy would have changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct WhatIfReport {
    /// The policy tried.
    pub policy_version: String,
    /// The policy versions that made the recorded decisions.
    pub recorded_versions: BTreeSet<String>,
    /// Records replayed.
    pub replayed: u64,
    /// Records without facts, left out.
    pub without_facts: u64,
    /// Records of a kill switch, left out.
    pub killed: u64,
    /// Records whose request id came before (an answer replayed for a retry), left out.
    pub repeated_ids: u64,
    /// Served then.
    pub served_then: u64,
    /// Served under the new policy.
    pub served_now: u64,
    /// Refused now that were served then, by rule, tenant, key and reason.
    pub newly_refused: Vec<Change>,
    /// Served now that were refused then, by tenant, key and the reason then.
    pub newly_served: Vec<Change>,
    /// Tokens the newly refused requests were settled with: not spent under the new policy.
    pub tokens_not_spent: u64,
    /// Their cost at the new policy's prices (micro-USD; models without a price count 0).
    pub micro_usd_not_spent: u64,
    /// Tokens the newly served requests would reserve (a lower bound when any of them is in
    /// `newly_served_bounded`).
    pub tokens_newly_reserved: u64,
    /// Records replayed whose input count was a lower bound (counting stopped past the limits
    /// then), planned at that bound.
    pub bounded_inputs: u64,
    /// Of the newly served, those planned at a lower bound of their input: the new policy
    /// serves them at least at that count, and may still refuse them at their whole count.
    pub newly_served_bounded: u64,
}

/// What-if failed to run.
#[derive(Debug, thiserror::Error)]
pub enum WhatIfError {
    /// The store failed.
    #[error("request {request:?}: {source}")]
    Store {
        /// Request id.
        request: String,
        /// Error.
        source: StoreError,
    },
    /// The new policy cannot plan a recorded request.
    #[error("request {request:?}: {message}")]
    Plan {
        /// Request id.
        request: String,
        /// Why.
        message: String,
    },
}

/// Admitted requests' ends, by (time due, order of admission).
type Due = BTreeMap<(u64, u64), (String, Usage)>;

/// Replays `records` under `policy` through `store`, whose time is `clock`; `progress` is
/// told how many records are done, now and then.
pub async fn whatif<S: Store>(
    mut records: Vec<RecordLine>,
    policy: &Policy,
    store: &S,
    clock: &ManualClock,
    mut progress: impl FnMut(u64),
) -> Result<WhatIfReport, WhatIfError> {
    // Records are written when requests end; decisions were made in time order.
    records.sort_by_key(|r| r.ts_ms);
    let mut r = Tally {
        report: WhatIfReport {
            policy_version: policy.version.to_string(),
            ..WhatIfReport::default()
        },
        ..Tally::default()
    };
    let mut due = Due::new();
    for (n, rec) in records.iter().enumerate() {
        if n % 1024 == 0 {
            progress(n as u64);
        }
        end_due(store, clock, &mut due, Some(rec.ts_ms)).await?;
        let Some(facts) = rec.facts.as_ref().filter(|_| rec.decision != "killed") else {
            match rec.decision.as_str() {
                "killed" => r.report.killed += 1,
                _ => r.report.without_facts += 1,
            }
            continue;
        };
        clock.set(rec.ts_ms);
        let f = facts.to_facts(&rec.request_id, rec.input_tokens);
        let p = plan(policy, &f).map_err(|e| WhatIfError::Plan {
            request: rec.request_id.clone(),
            message: e.to_string(),
        })?;
        let decision = match store.admit(&p).await {
            Ok(d) => d,
            Err(StoreError::DuplicateRequestId(_)) => {
                r.report.repeated_ids += 1;
                continue;
            }
            Err(e) => {
                return Err(WhatIfError::Store {
                    request: rec.request_id.clone(),
                    source: e,
                });
            }
        };
        let then = rec.decision == "admit";
        r.report.replayed += 1;
        r.report.bounded_inputs += u64::from(rec.input_lower_bound);
        r.report.served_then += u64::from(then);
        r.report
            .recorded_versions
            .insert(rec.policy_version.clone());
        match decision {
            Decision::Admit(a) => {
                r.report.served_now += 1;
                let (at, usage) = match (then, rec.usage) {
                    (true, Some(u)) => (rec.ts_ms + rec.upstream_ms.unwrap_or(0), u.bounded()),
                    _ => {
                        let u = Usage {
                            input_tokens: rec.input_tokens,
                            output_tokens: a.max_output_tokens,
                            ..Usage::default()
                        };
                        if !then {
                            r.newly_served(facts, rec, u.total());
                            r.report.newly_served_bounded += u64::from(rec.input_lower_bound);
                        }
                        (rec.ts_ms, u)
                    }
                };
                due.insert((at, n as u64), (rec.request_id.clone(), usage));
            }
            Decision::Deny(d) if then => {
                let usage = rec.usage.map(Usage::bounded).unwrap_or_default();
                let price = facts
                    .model
                    .as_ref()
                    .and_then(|m| policy.prices.price(m, None));
                r.report.tokens_not_spent += usage.total();
                r.report.micro_usd_not_spent += price.map_or(0, |p| p.cost(&usage));
                let key = (
                    d.scope.rule().to_owned(),
                    facts.tenant.clone().unwrap_or_default(),
                    facts.key.clone().unwrap_or_default(),
                    d.reason.code().to_owned(),
                );
                let c = r.refused.entry(key).or_default();
                c.0 += 1;
                c.1 += usage.total();
            }
            Decision::Deny(_) | Decision::Killed(_) => {}
        }
    }
    end_due(store, clock, &mut due, None).await?;
    progress(records.len() as u64);
    Ok(r.finish())
}

/// Ends every admitted request due by `until` (all of them when `None`), in time order.
async fn end_due<S: Store>(
    store: &S,
    clock: &ManualClock,
    due: &mut Due,
    until: Option<u64>,
) -> Result<(), WhatIfError> {
    while let Some(entry) = due.first_entry() {
        let at = entry.key().0;
        if until.is_some_and(|u| at > u) {
            break;
        }
        let (id, usage) = entry.remove();
        clock.set(at);
        store
            .settle(&id, usage)
            .await
            .map_err(|e| WhatIfError::Store {
                request: id,
                source: e,
            })?;
    }
    Ok(())
}

/// Counts kept while replaying.
#[derive(Default)]
struct Tally {
    report: WhatIfReport,
    /// (rule, tenant, key, reason) → (requests, tokens).
    refused: BTreeMap<(String, String, String, String), (u64, u64)>,
    /// ("", tenant, key, reason then) → (requests, tokens).
    served: BTreeMap<(String, String, String, String), (u64, u64)>,
}

impl Tally {
    fn newly_served(&mut self, facts: &RecordedFacts, rec: &RecordLine, tokens: u64) {
        let key = (
            String::new(),
            facts.tenant.clone().unwrap_or_default(),
            facts.key.clone().unwrap_or_default(),
            rec.reason.clone().unwrap_or_default(),
        );
        self.report.tokens_newly_reserved += tokens;
        let c = self.served.entry(key).or_default();
        c.0 += 1;
        c.1 += tokens;
    }

    fn finish(mut self) -> WhatIfReport {
        self.report.newly_refused = rows(self.refused);
        self.report.newly_served = rows(self.served);
        self.report
    }
}

/// Counts (requests, tokens) by (rule, tenant, key, reason), as rows.
fn rows(counts: BTreeMap<(String, String, String, String), (u64, u64)>) -> Vec<Change> {
    counts
        .into_iter()
        .map(|((rule, tenant, key, reason), (requests, tokens))| Change {
            rule,
            tenant,
            key,
            reason,
            requests,
            tokens,
        })
        .collect()
}

/// The report as tables, for people.
pub fn table(r: &WhatIfReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let versions: Vec<&str> = r.recorded_versions.iter().map(String::as_str).collect();
    let _ = writeln!(
        s,
        "policy {} against {} records decided under {}",
        r.policy_version,
        r.replayed,
        if versions.is_empty() {
            "no policy".to_owned()
        } else {
            versions.join(", ")
        }
    );
    if r.without_facts + r.killed + r.repeated_ids > 0 {
        let _ = writeln!(
            s,
            "left out: {} without facts, {} of a kill switch, {} repeated ids",
            r.without_facts, r.killed, r.repeated_ids
        );
    }
    let _ = writeln!(s, "served: {} then, {} now\n", r.served_then, r.served_now);
    let _ = writeln!(s, "refused now, served then:");
    changes(&mut s, &r.newly_refused, true);
    let _ = writeln!(s, "\nserved now, refused then:");
    changes(&mut s, &r.newly_served, false);
    let at_least = if r.newly_served_bounded > 0 {
        "at least "
    } else {
        ""
    };
    let _ = writeln!(
        s,
        "\nnot spent: {} tokens, ${}.{:06}; newly reserved: {at_least}{} tokens",
        r.tokens_not_spent,
        r.micro_usd_not_spent / 1_000_000,
        r.micro_usd_not_spent % 1_000_000,
        r.tokens_newly_reserved
    );
    if r.newly_served_bounded > 0 {
        let _ = writeln!(
            s,
            "{} of the newly served were counted only up to the input limits then: their input \
             is at least what is shown, and the new policy may still refuse them at their whole \
             count",
            r.newly_served_bounded
        );
    }
    s
}

fn changes(s: &mut String, rows: &[Change], with_rule: bool) {
    use std::fmt::Write;
    if rows.is_empty() {
        let _ = writeln!(s, "  none");
        return;
    }
    let _ = writeln!(
        s,
        "  {:<20} {:<16} {:<16} {:<20} {:>9} {:>12}",
        if with_rule { "rule" } else { "" },
        "tenant",
        "key",
        if with_rule { "reason" } else { "reason then" },
        "requests",
        "tokens"
    );
    for c in rows {
        let _ = writeln!(
            s,
            "  {:<20} {:<16} {:<16} {:<20} {:>9} {:>12}",
            c.rule, c.tenant, c.key, c.reason, c.requests, c.tokens
        );
    }
}
