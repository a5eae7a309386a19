//! Sharded stores (`RedisConfig::shards` > 1): each scope's keys live in the shard its id hashes
//! to, so a Redis Cluster spreads them over its nodes. A request whose scopes sit in several
//! shards is admitted shard by shard, in shard order; when one refuses, the parts already taken
//! are undone, and the remaining shards are probed (their attempts counted, nothing taken) so
//! that the refusal reported is the one a single-shard store would report. No limit can be
//! exceeded: every part is its own atomic check-and-take. Under contention a request may be
//! refused because of another's part that is later undone (a spurious refusal, which the
//! single-shard store would not make).

use std::collections::BTreeMap;

use tollgate_core::pipeline::{Check, Kind, Plan};
use tollgate_core::{Admitted, Decision, Finish, Renewal, ShadowOutcome, Store, StoreError, Usage};

use crate::decode::{decision, finish_reply};
use crate::encode::{Invocation, admit_invocation, finish_invocation};
use crate::shards::{Admission, Part, shard_of};
use crate::store::RedisStore;

/// Beyond this many remembered admissions, forgotten ones are pruned (they are then looked for in
/// every shard at settlement).
const PRUNE_FLOOR: usize = 4096;

impl RedisStore {
    /// The plan cut into one part per shard, in shard order, each part's checks in the plan's
    /// order; a verdict goes into every part. A plan without stateful checks still gets one
    /// part (for its ticket): in the shard of its request id.
    fn split(&self, plan: &Plan) -> Vec<Part> {
        let n = self.shards.len();
        let shard = |c: &Check| c.scope().map(|s| shard_of(s.id(), n));
        let mut parts: BTreeMap<usize, Part> = plan
            .checks
            .iter()
            .filter_map(shard)
            .chain(
                plan.checks
                    .iter()
                    .all(|c| c.scope().is_none())
                    .then(|| shard_of(&plan.request_id, n)),
            )
            .map(|s| {
                let mut part = plan.clone();
                part.checks.clear();
                (
                    s,
                    Part {
                        shard: s,
                        plan: part,
                        places: Vec::new(),
                        reserves: Vec::new(),
                    },
                )
            })
            .collect();
        let mut reserve = 0;
        for (i, c) in plan.checks.iter().enumerate() {
            let is_reserve = matches!(c.kind, Kind::Reserve(_));
            for (s, p) in parts.iter_mut() {
                if shard(c).is_none_or(|at| at == *s) {
                    p.plan.checks.push(c.clone());
                    p.places.push(i);
                    if is_reserve {
                        p.reserves.push(reserve);
                    }
                }
            }
            reserve += usize::from(is_reserve);
        }
        parts.into_values().collect()
    }

    async fn admit_part(&self, part: &Part, op: &'static str) -> Result<Decision, StoreError> {
        let inv = admit_invocation(
            &self.shards[part.shard],
            &part.plan,
            self.config.retention_ms,
            self.wall_now(),
        );
        decision(&part.plan, self.batched(part.shard, op, inv).await?)
    }

    /// Gives back the leases and reservations of parts taken for a request that is then
    /// refused. Best effort: a part that cannot be undone now expires, and is charged, as the
    /// policy says for an abandoned request.
    async fn undo(&self, id: &str, shards: impl Iterator<Item = usize>) {
        let calls = shards.map(|shard| {
            let inv = Invocation::of(&[&crate::encode::key(&self.shards[shard], "ts", id)], &[id]);
            self.batched(shard, "u", inv)
        });
        futures_util::future::join_all(calls).await;
    }

    pub(crate) async fn admit_parts(&self, plan: &Plan) -> Result<Decision, StoreError> {
        let parts = self.split(plan);
        let mut taken: Vec<Admitted> = Vec::with_capacity(parts.len());
        for (k, part) in parts.iter().enumerate() {
            let refusal = match self.admit_part(part, "a").await {
                Ok(Decision::Admit(a)) => {
                    taken.push(a);
                    continue;
                }
                Ok(Decision::Deny(d)) => d,
                Ok(killed @ Decision::Killed(_)) => {
                    self.undo(&plan.request_id, parts[..k].iter().map(|p| p.shard))
                        .await;
                    return Ok(killed);
                }
                Err(e @ StoreError::DuplicateRequestId(_)) => {
                    self.undo(&plan.request_id, parts[..k].iter().map(|p| p.shard))
                        .await;
                    return Err(e);
                }
                Err(e) => {
                    // The failed part may have been applied before its answer was lost; it is
                    // not undone, since the ticket under this id might be another admission's
                    // (a reused id). If it was applied, it expires and is charged as abandoned.
                    self.undo(&plan.request_id, parts[..k].iter().map(|p| p.shard))
                        .await;
                    return Err(e);
                }
            };
            self.undo(&plan.request_id, parts[..k].iter().map(|p| p.shard))
                .await;
            // Every attempt counts in every rate scope, and the refusal reported is the first
            // control (then the first scope in the plan) that refuses anywhere.
            // The probes take nothing, so they go out at once.
            let probes = parts[k + 1..]
                .iter()
                .map(|later| self.admit_part(later, "p"));
            let answers = futures_util::future::join_all(probes).await;
            let mut first = (part.rank(&refusal), refusal);
            for (later, answer) in parts[k + 1..].iter().zip(answers) {
                if let Ok(Decision::Deny(d)) = answer {
                    let rank = later.rank(&d);
                    if rank < first.0 {
                        first = (rank, d);
                    }
                }
            }
            return Ok(Decision::Deny(first.1));
        }
        Ok(Decision::Admit(self.merge(plan, &parts, taken)))
    }

    /// One admission out of its parts': quotas in the plan's order, the earliest expiry.
    fn merge(&self, plan: &Plan, parts: &[Part], taken: Vec<Admitted>) -> Admitted {
        let mut quotas = Vec::new();
        let mut expires_at = u64::MAX;
        for (part, a) in parts.iter().zip(taken) {
            expires_at = expires_at.min(a.expires_at);
            // A part's quota indexes the part's plan; the whole plan's index is its place.
            quotas.extend(a.quotas.into_iter().map(|mut q| {
                q.check = part.places.get(q.check).copied().unwrap_or(q.check);
                q
            }));
        }
        quotas.sort_by_key(|q| q.check);
        let remembered = Admission {
            expires_at,
            parts: parts
                .iter()
                .map(|p| (p.shard, p.reserves.clone()))
                .collect(),
        };
        self.remember(&plan.request_id, remembered);
        Admitted {
            max_output_tokens: plan.max_output_tokens,
            expires_at,
            quotas,
            fail_open: false,
        }
    }

    pub(crate) fn remember(&self, id: &str, a: Admission) {
        let mut m = self
            .admissions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if m.map.len() >= PRUNE_FLOOR.max(2 * m.pruned_at) {
            // Forget requests long past their expiry (settling one later still works: every
            // shard is asked).
            let now = self.clock.as_ref().map_or_else(wall_ms, |c| c.now());
            let horizon = now.saturating_sub(self.config.retention_ms);
            m.map.retain(|_, a| a.expires_at >= horizon);
            m.pruned_at = m.map.len();
        }
        m.map.insert(id.to_owned(), a);
    }

    fn forget(&self, id: &str) -> Option<Admission> {
        self.admissions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map
            .remove(id)
    }

    /// The shards holding a request's parts (with their budgets' plan positions), or every
    /// shard when this instance did not admit it.
    fn parts_of(&self, known: Option<Admission>) -> Vec<(usize, Option<Vec<usize>>)> {
        match known {
            Some(a) => a.parts.into_iter().map(|(s, b)| (s, Some(b))).collect(),
            None => (0..self.shards.len()).map(|s| (s, None)).collect(),
        }
    }

    pub(crate) async fn finish_parts(
        &self,
        id: &str,
        usage: Option<Usage>,
        ending: &str,
    ) -> Result<Finish, StoreError> {
        // The parts end at once, each in its own shard; every part is ended even when one
        // fails, and a repeat ends what is left.
        let calls = self
            .parts_of(self.forget(id))
            .into_iter()
            .map(|(shard, places)| {
                let inv = finish_invocation(
                    &self.shards[shard],
                    id,
                    self.config.retention_ms,
                    usage,
                    ending,
                );
                async move {
                    let r = self.batched(shard, "f", inv).await.and_then(finish_reply);
                    (places, r)
                }
            });
        let mut charged: Vec<u64> = Vec::new();
        let (mut done, mut ended, mut error) = (false, None, None);
        for (places, result) in futures_util::future::join_all(calls).await {
            match result {
                Ok(Finish::Done { charged: c }) => {
                    done = true;
                    match places {
                        Some(places) => {
                            for (i, amount) in places.into_iter().zip(c) {
                                if charged.len() <= i {
                                    charged.resize(i + 1, 0);
                                }
                                charged[i] = amount;
                            }
                        }
                        None => charged.extend(c),
                    }
                }
                Ok(Finish::AlreadyEnded(how)) => ended = ended.or(Some(how)),
                Ok(Finish::Unknown) => {}
                Err(e) => error = error.or(Some(e)),
            }
        }
        if let Some(e) = error {
            return Err(e);
        }
        Ok(if done {
            Finish::Done { charged }
        } else if let Some(how) = ended {
            Finish::AlreadyEnded(how)
        } else {
            Finish::Unknown
        })
    }

    pub(crate) async fn renew_parts(&self, id: &str) -> Result<Renewal, StoreError> {
        let known = self
            .admissions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map
            .get(id)
            .cloned();
        let every_part = known.is_some();
        let calls = self
            .parts_of(known)
            .into_iter()
            .map(|(shard, _)| self.renew_on(shard, id));
        let mut soonest: Option<u64> = None;
        for renewal in futures_util::future::join_all(calls).await {
            match renewal? {
                Renewal::Renewed { expires_at } => {
                    soonest = Some(soonest.map_or(expires_at, |s| s.min(expires_at)));
                }
                // A part of a request admitted here has expired: the request has lost its hold.
                Renewal::NotInFlight if every_part => return Ok(Renewal::NotInFlight),
                Renewal::NotInFlight => {}
            }
        }
        Ok(
            soonest.map_or(Renewal::NotInFlight, |expires_at| Renewal::Renewed {
                expires_at,
            }),
        )
    }
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl RedisStore {
    /// A request and its shadow plan on a sharded store. Shard by shard, a request's parts are
    /// undone when one refuses; its shadow's would need the same across both plans, so the
    /// shadow is an admission of its own, made at the same time.
    pub(crate) async fn admit_shadow_apart(
        &self,
        plan: &Plan,
        shadow: &Plan,
    ) -> Result<(Decision, ShadowOutcome), StoreError> {
        let (d, s) =
            futures_util::future::join(self.admit_parts(plan), self.admit_parts(shadow)).await;
        let s = match s {
            Ok(Decision::Admit(_)) => ShadowOutcome::Apart(shadow.request_id.clone()),
            Ok(Decision::Deny(r)) => ShadowOutcome::Refused(r),
            _ => ShadowOutcome::Failed,
        };
        if let (Err(_), ShadowOutcome::Apart(id)) = (&d, &s) {
            // Nobody will end it: the request's admission failed.
            let _ = self.release(id, Some(Usage::default())).await;
        }
        Ok((d?, s))
    }
}
