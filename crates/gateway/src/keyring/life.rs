//! A key's life as values: its one record (what it is, its version, the digests of its
//! secrets), and each transition a pure function of the record and the time. A revoked key
//! keeps its record, without secrets, so that nothing can bring one back; a rotated-out secret
//! ends with its grace, and the next change drops it from the record.

use serde::{Deserialize, Serialize};

use super::record::Issued;

/// One secret of a key, by its digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Secret {
    /// The SHA-256 of the secret, in hex (the secret itself is never kept).
    pub digest: String,
    /// When it was made (ms since the epoch).
    pub since_ms: u64,
    /// When a rotation's grace for it ends (ms since the epoch); `None`: it is the current one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<u64>,
}

/// An issued key's one record, as the ledger and the store keep it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// What the key is.
    #[serde(flatten)]
    pub key: Issued,
    /// Raised by every change: the compare-and-set's version.
    pub version: u64,
    /// The change that wrote it (random): a caller that lost its answer finds its own change.
    pub change: String,
    /// When it was revoked (ms since the epoch): a revoked key has no secret, for good.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at_ms: Option<u64>,
    /// Its secrets: the current one, and those a rotation left in their grace.
    #[serde(default)]
    pub secrets: Vec<Secret>,
}

/// Why a transition does not apply to a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The key was revoked (at this instant, ms).
    Revoked(u64),
    /// The key expired (at this instant, ms).
    Expired(u64),
}

impl KeyRecord {
    /// A new key with one secret, at version 1.
    pub fn new(key: Issued, digest: String, change: String) -> Self {
        let since_ms = key.created_at_ms;
        KeyRecord {
            key,
            version: 1,
            change,
            revoked_at_ms: None,
            secrets: vec![Secret {
                digest,
                since_ms,
                until_ms: None,
            }],
        }
    }

    /// Its secrets that work at `now_ms`: none once revoked or expired; a rotated-out one until
    /// its grace ends.
    pub fn live(&self, now_ms: u64) -> impl Iterator<Item = &Secret> {
        let works = self.revoked_at_ms.is_none() && self.key.valid_at(now_ms);
        self.secrets
            .iter()
            .filter(move |s| works && s.until_ms.is_none_or(|u| now_ms < u))
    }

    /// Whether a transition may start from it at `now_ms`.
    fn open(&self, now_ms: u64) -> Result<(), Refusal> {
        if let Some(at) = self.revoked_at_ms {
            return Err(Refusal::Revoked(at));
        }
        match self.key.expires_at_ms {
            Some(at) if at <= now_ms => Err(Refusal::Expired(at)),
            _ => Ok(()),
        }
    }

    fn next(&self, change: String) -> Self {
        KeyRecord {
            version: self.version.saturating_add(1),
            change,
            ..self.clone()
        }
    }

    /// A change of the key's own limits at `now_ms`: the record is the same, at the next
    /// version, so that a change made from an earlier version (a rotation given its version)
    /// finds it; refused once the key has ended.
    pub fn limits_set(&self, now_ms: u64, change: String) -> Result<Self, Refusal> {
        self.open(now_ms)?;
        Ok(self.next(change))
    }

    /// A rotation at `now_ms`: `digest` becomes the current secret; the others work until
    /// `grace_ms` from now (or their own earlier end), and are dropped once ended.
    pub fn rotate(
        &self,
        now_ms: u64,
        grace_ms: u64,
        digest: String,
        change: String,
    ) -> Result<Self, Refusal> {
        self.open(now_ms)?;
        let until = now_ms.saturating_add(grace_ms);
        let mut next = self.next(change);
        next.secrets = self
            .secrets
            .iter()
            .map(|s| Secret {
                until_ms: Some(s.until_ms.map_or(until, |u| u.min(until))),
                ..s.clone()
            })
            .filter(|s| s.until_ms.is_some_and(|u| now_ms < u))
            .collect();
        next.secrets.push(Secret {
            digest,
            since_ms: now_ms,
            until_ms: None,
        });
        Ok(next)
    }

    /// A revocation at `now_ms`: every secret goes, for good. `None` when it was revoked
    /// already (revoking again changes nothing).
    pub fn revoke(&self, now_ms: u64, change: String) -> Option<Self> {
        if self.revoked_at_ms.is_some() {
            return None;
        }
        let mut next = self.next(change);
        next.revoked_at_ms = Some(now_ms);
        next.secrets.clear();
        Some(next)
    }

    /// The record as the admin API shows it: no digest.
    pub fn shown(&self, now_ms: u64) -> serde_json::Value {
        let mut v = serde_json::to_value(&self.key).unwrap_or_default();
        v["version"] = self.version.into();
        if let Some(at) = self.revoked_at_ms {
            v["revoked_at_ms"] = at.into();
        }
        v["secrets"] = self
            .live(now_ms)
            .map(|s| serde_json::json!({"since_ms": s.since_ms, "until_ms": s.until_ms}))
            .collect();
        v
    }
}

/// Records carried over from the store's older keeping, one entry per secret by its digest
/// (`Issued` with `rotated`), grouped by key: the current secret's fields, every secret.
pub fn carried_over(entries: &[(String, String)]) -> Vec<KeyRecord> {
    #[derive(Deserialize)]
    struct Old {
        #[serde(flatten)]
        key: Issued,
        #[serde(default)]
        rotated: bool,
    }
    let mut by_id: std::collections::BTreeMap<String, Vec<(String, Old)>> = Default::default();
    for (digest, json) in entries {
        match serde_json::from_str::<Old>(json) {
            Ok(old) => by_id
                .entry(old.key.id.clone())
                .or_default()
                .push((digest.clone(), old)),
            Err(e) => {
                tracing::warn!(cause = %e, "an issued key's old record cannot be read: skipped")
            }
        }
    }
    let mut out = Vec::with_capacity(by_id.len());
    for (_, mut olds) in by_id {
        olds.sort_by_key(|(_, o)| (!o.rotated, o.key.created_at_ms));
        let Some((_, base)) = olds.last() else {
            continue;
        };
        let key = base.key.clone();
        let secrets = olds
            .iter()
            .map(|(digest, o)| Secret {
                digest: digest.clone(),
                since_ms: o.key.created_at_ms,
                until_ms: if o.rotated { o.key.expires_at_ms } else { None },
            })
            .collect();
        out.push(KeyRecord {
            key,
            version: 1,
            change: "carried-over".into(),
            revoked_at_ms: None,
            secrets,
        });
    }
    out
}

/// A key for tests: `vk_1` of acme, expiring at 50 s.
#[cfg(test)]
pub(crate) fn sample() -> Issued {
    Issued {
        id: "vk_1".into(),
        name: "k".into(),
        tenant: "acme".into(),
        user: None,
        allow_user: false,
        models: None,
        uses: crate::config::Uses::Proxy,
        created_at_ms: 0,
        expires_at_ms: Some(50_000),
        metadata: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn key() -> Issued {
        sample()
    }

    #[derive(Debug, Clone)]
    enum Step {
        Rotate { grace_ms: u64 },
        Revoke,
        Wait(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => (0u64..5_000).prop_map(|grace_ms| Step::Rotate { grace_ms }),
            1 => Just(Step::Revoke),
            2 => (0u64..4_000).prop_map(Step::Wait),
        ]
    }

    proptest! {
        /// Over any sequence of rotations, revocations and waits: every change raises the
        /// version; a revoked key has no secret that works, ever after, and refuses rotation; a
        /// rotation leaves one current secret, its new one, and the others only in their grace;
        /// nothing works past the key's expiry.
        #[test]
        fn a_keys_life_keeps_its_invariants(steps in proptest::collection::vec(step(), 1..40)) {
            let mut r = KeyRecord::new(key(), "d0".into(), "c0".into());
            let mut now = 0u64;
            let mut revoked = false;
            for (i, s) in steps.into_iter().enumerate() {
                match s {
                    Step::Rotate { grace_ms } => {
                        let digest = format!("d{}", i + 1);
                        match r.rotate(now, grace_ms, digest.clone(), format!("c{i}")) {
                            Ok(next) => {
                                prop_assert!(!revoked && now < 50_000);
                                prop_assert_eq!(next.version, r.version + 1);
                                let current: Vec<&Secret> =
                                    next.secrets.iter().filter(|s| s.until_ms.is_none()).collect();
                                prop_assert_eq!(current.len(), 1);
                                prop_assert_eq!(&current[0].digest, &digest);
                                for s in next.secrets.iter().filter(|s| s.until_ms.is_some()) {
                                    prop_assert!(s.until_ms.is_some_and(|u| now < u && u <= now + grace_ms));
                                }
                                r = next;
                            }
                            Err(Refusal::Revoked(_)) => prop_assert!(revoked),
                            Err(Refusal::Expired(_)) => prop_assert!(now >= 50_000),
                        }
                    }
                    Step::Revoke => match r.revoke(now, format!("c{i}")) {
                        Some(next) => {
                            prop_assert!(!revoked);
                            prop_assert_eq!(next.version, r.version + 1);
                            revoked = true;
                            r = next;
                        }
                        None => prop_assert!(revoked),
                    },
                    Step::Wait(ms) => now += ms,
                }
                if revoked || now >= 50_000 {
                    prop_assert_eq!(r.live(now).count(), 0);
                }
            }
        }
    }

    /// Secrets kept by digest become one record per key, the current secret's fields first.
    #[test]
    fn old_records_are_carried_over_by_key() {
        let old = |id: &str, at: u64, rotated: bool| {
            let mut v = serde_json::to_value(Issued {
                id: id.into(),
                created_at_ms: at,
                expires_at_ms: rotated.then_some(900),
                ..key()
            })
            .unwrap_or_default();
            v["rotated"] = rotated.into();
            v.to_string()
        };
        let records = carried_over(&[
            ("d1".into(), old("vk_a", 10, true)),
            ("d2".into(), old("vk_a", 20, false)),
            ("d3".into(), old("vk_b", 30, false)),
            ("d4".into(), "not json".into()),
        ]);
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].key.created_at_ms, 20);
        assert_eq!(records[0].key.expires_at_ms, None);
        assert_eq!(
            records[0].secrets,
            vec![
                Secret {
                    digest: "d1".into(),
                    since_ms: 10,
                    until_ms: Some(900)
                },
                Secret {
                    digest: "d2".into(),
                    since_ms: 20,
                    until_ms: None
                },
            ]
        );
        assert_eq!(records[1].secrets.len(), 1);
    }
}
