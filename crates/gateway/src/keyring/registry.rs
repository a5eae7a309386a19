//! The issued keys this instance knows: their records by id, and by the digest of each secret
//! that works, as the request path looks them up.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use super::life::KeyRecord;
use super::record::Issued;
use crate::config::KeyConfig;

/// A key found by its secret's digest.
#[derive(Debug)]
pub struct Found {
    /// What was issued.
    pub issued: Issued,
    /// The key as the request path reads it.
    pub key: KeyConfig,
    /// When this secret's grace ends, if a rotation replaced it.
    pub until_ms: Option<u64>,
}

/// What a compare-and-set found.
#[derive(Debug)]
pub(crate) enum Swap {
    /// Written.
    Done,
    /// Another change came first: the truth holds this version now.
    Changed(u64),
}

#[derive(Debug, Default)]
struct Table {
    version: u64,
    /// Raised by every change this instance applies: a read of the store that began before
    /// one does not replace it.
    generation: u64,
    records: HashMap<String, Arc<KeyRecord>>,
    by_digest: HashMap<String, Arc<Found>>,
}

impl Table {
    fn index(&mut self) {
        self.by_digest = self
            .records
            .values()
            .filter(|r| r.revoked_at_ms.is_none())
            .flat_map(|r| {
                let key = r.key.key_config();
                r.secrets.iter().map(move |s| {
                    let found = Found {
                        issued: r.key.clone(),
                        key: key.clone(),
                        until_ms: s.until_ms,
                    };
                    (s.digest.clone(), Arc::new(found))
                })
            })
            .collect();
    }
}

/// The issued keys this instance knows.
#[derive(Debug, Default)]
pub struct Registry {
    table: RwLock<Table>,
    /// Changes the ledger took and the store did not (see [`truth`]): written again by the
    /// refresh, and kept over what the store shows until then.
    held: Mutex<Vec<KeyRecord>>,
    /// When the last complete read of the store's keys began, ms since the epoch (0: none); a
    /// read that found the store's sets forgotten (this instance keeping its own) is not one.
    as_of: std::sync::atomic::AtomicU64,
}

impl Registry {
    /// When the last complete read of the store's keys began: what this instance knows of
    /// the shared keys is the store's as of that instant (`None` before the first read).
    pub fn as_of_ms(&self) -> Option<u64> {
        Some(self.as_of.load(std::sync::atomic::Ordering::Acquire)).filter(|&ms| ms > 0)
    }

    /// A read of the store's keys that began at `began_ms` is complete.
    pub(crate) fn read_as_of(&self, began_ms: u64) {
        self.as_of
            .fetch_max(began_ms, std::sync::atomic::Ordering::AcqRel);
    }

    /// The key whose secret has this digest (hex), if it works at `now_ms`.
    pub fn lookup(&self, digest: &str, now_ms: u64) -> Option<Arc<Found>> {
        let table = self.table.read().ok()?;
        let found = table.by_digest.get(digest)?;
        (found.issued.valid_at(now_ms) && found.until_ms.is_none_or(|u| now_ms < u))
            .then(|| found.clone())
    }

    /// Every key that works at `now_ms`, by id.
    pub fn list(&self, now_ms: u64) -> Vec<Arc<KeyRecord>> {
        let Ok(table) = self.table.read() else {
            return Vec::new();
        };
        let mut all: Vec<Arc<KeyRecord>> = table
            .records
            .values()
            .filter(|r| r.live(now_ms).next().is_some())
            .cloned()
            .collect();
        all.sort_by(|a, b| a.key.id.cmp(&b.key.id));
        all
    }

    /// Key `id`'s record, as this instance knows it.
    pub fn record(&self, id: &str) -> Option<Arc<KeyRecord>> {
        self.table.read().ok()?.records.get(id).cloned()
    }

    /// What [`Registry::replace`] is given, read when the read of the store begins.
    pub(crate) fn generation(&self) -> u64 {
        self.table.read().map_or(0, |t| t.generation)
    }

    /// Replaces the table with the store's `entries` (id, `<version> <record>`) at `version`,
    /// under the changes it has not taken yet, unless this instance changed a key since
    /// `generation` (the next refresh reads again); a record that cannot be read is skipped and
    /// logged.
    pub(crate) fn replace(&self, generation: u64, version: u64, entries: &[(String, String)]) {
        let mut records = HashMap::with_capacity(entries.len());
        for (id, value) in entries {
            let json = value.split_once(' ').map_or(value.as_str(), |(_, j)| j);
            match serde_json::from_str::<KeyRecord>(json) {
                Ok(r) => {
                    records.insert(id.clone(), Arc::new(r));
                }
                Err(e) => {
                    tracing::warn!(id = %id, cause = %e, "an issued key's record cannot be read: skipped")
                }
            }
        }
        let held = self.held();
        if let Ok(mut t) = self.table.write() {
            if t.generation != generation {
                return;
            }
            // A record the store shows at a lower version than this instance knew is not news
            // (a store that went back, a replica that lagged): the newer one stays, so that a
            // revoked key is not brought back. A record the store no longer holds goes.
            for (id, r) in &mut records {
                if let Some(known) = t.records.get(id).filter(|k| k.version > r.version) {
                    *r = known.clone();
                }
            }
            *t = Table {
                version,
                generation,
                records,
                by_digest: HashMap::new(),
            };
            for r in held {
                newer(&mut t.records, r);
            }
            t.index();
        }
    }

    /// Puts a record that is newer than the one known.
    pub(crate) fn put(&self, record: KeyRecord) {
        if let Ok(mut t) = self.table.write() {
            t.generation += 1;
            newer(&mut t.records, record);
            t.index();
        }
    }

    /// The compare-and-set of a store that is this process's own.
    pub(crate) fn swap_local(&self, expected: u64, next: &KeyRecord) -> Swap {
        let Ok(mut t) = self.table.write() else {
            return Swap::Changed(0);
        };
        let held = t.records.get(&next.key.id).map_or(0, |r| r.version);
        if held != expected {
            return Swap::Changed(held);
        }
        t.generation += 1;
        t.records
            .insert(next.key.id.clone(), Arc::new(next.clone()));
        t.index();
        Swap::Done
    }

    pub(crate) fn hold(&self, record: KeyRecord) {
        if let Ok(mut h) = self.held.lock() {
            h.retain(|r| r.key.id != record.key.id);
            h.push(record);
        }
    }

    pub(crate) fn held(&self) -> Vec<KeyRecord> {
        self.held.lock().map(|h| h.clone()).unwrap_or_default()
    }

    pub(crate) fn release(&self, record: &KeyRecord) {
        if let Ok(mut h) = self.held.lock() {
            h.retain(|r| r.key.id != record.key.id || r.version > record.version);
        }
    }

    pub(crate) fn version(&self) -> u64 {
        self.table.read().map_or(0, |t| t.version)
    }
}

fn newer(records: &mut HashMap<String, Arc<KeyRecord>>, r: KeyRecord) {
    if records
        .get(&r.key.id)
        .is_none_or(|held| held.version < r.version)
    {
        records.insert(r.key.id.clone(), Arc::new(r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keyring::Issued;

    fn entry(r: &KeyRecord) -> (String, String) {
        let json = serde_json::to_string(r).unwrap_or_default();
        (r.key.id.clone(), format!("{} {json}", r.version))
    }

    /// A store that shows an older record (a lagged replica) does not bring a revoked secret
    /// back; a newer one is taken; a record the store no longer holds goes.
    #[test]
    fn a_lower_version_is_not_news() {
        let issued = Issued {
            expires_at_ms: None,
            ..crate::keyring::life::sample()
        };
        let live = KeyRecord::new(issued, "d1".into(), "c1".into());
        let revoked = live
            .revoke(5, "c2".into())
            .unwrap_or_else(|| unreachable!());
        let reg = Registry::default();
        reg.replace(reg.generation(), 1, &[entry(&revoked)]);
        assert!(reg.lookup("d1", 10).is_none());
        reg.replace(reg.generation(), 2, &[entry(&live)]);
        assert!(reg.lookup("d1", 10).is_none(), "the older record was taken");
        assert_eq!(reg.record("vk_1").map(|r| r.version), Some(2));
        reg.replace(reg.generation(), 3, &[]);
        assert!(reg.record("vk_1").is_none());
    }
}
