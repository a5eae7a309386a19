//! Virtual keys issued at run time: created, listed, rotated and revoked through the admin API,
//! kept in the store (and in the spend ledger, when there is one, from which they are rebuilt
//! after a loss), read by every instance within [`REFRESH_EVERY`]. The secret is shown once and
//! kept only as its SHA-256 digest. Keys of the configuration file keep working beside them.

pub mod record;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub use record::{Issued, NewKey, Rotation};
use tollgate_ledger::Kept;
use tollgate_redis::RecordSet;

use crate::config::{KeyConfig, hash_key, hex};
use crate::gateway::Gateway;

/// How often an instance reads the store's issued keys: the bound within which a key created,
/// rotated or revoked on one instance takes effect on every other. An expiry takes effect at
/// its instant on every instance.
pub const REFRESH_EVERY: Duration = Duration::from_secs(1);

/// A key found by its secret's digest.
#[derive(Debug)]
pub struct Found {
    /// What was issued.
    pub issued: Issued,
    /// The key as the request path reads it.
    pub key: KeyConfig,
}

/// Why an operation on issued keys failed.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The request is wrong (the message names the field).
    #[error("{0}")]
    Invalid(String),
    /// No issued key has this id.
    #[error("no issued key has the id {0:?}")]
    NotFound(String),
    /// The store or the ledger did not take it.
    #[error("{0}")]
    Unavailable(String),
}

#[derive(Debug, Default)]
struct Table {
    version: u64,
    by_digest: HashMap<String, Arc<Found>>,
}

/// The issued keys this instance knows.
#[derive(Debug, Default)]
pub struct Registry {
    table: RwLock<Table>,
}

impl Registry {
    /// The key whose secret has this digest (hex), if it works at `now_ms`.
    pub fn lookup(&self, digest: &str, now_ms: u64) -> Option<Arc<Found>> {
        let table = self.table.read().ok()?;
        let found = table.by_digest.get(digest)?;
        found.issued.valid_at(now_ms).then(|| found.clone())
    }

    /// Every issued secret, by id (a rotated key lists its old secret too, while it works).
    pub fn list(&self, now_ms: u64) -> Vec<Issued> {
        let Ok(table) = self.table.read() else {
            return Vec::new();
        };
        let mut all: Vec<Issued> = table
            .by_digest
            .values()
            .filter(|f| f.issued.valid_at(now_ms))
            .map(|f| f.issued.clone())
            .collect();
        all.sort_by(|a, b| (&a.id, a.rotated).cmp(&(&b.id, b.rotated)));
        all
    }

    /// Replaces the table with `entries` (digest, record JSON) at `version`; a record that
    /// cannot be read is skipped and logged.
    fn replace(&self, version: u64, entries: &[(String, String)]) {
        let mut by_digest = HashMap::with_capacity(entries.len());
        for (digest, json) in entries {
            match serde_json::from_str::<Issued>(json) {
                Ok(issued) => {
                    let key = issued.key_config();
                    by_digest.insert(digest.clone(), Arc::new(Found { issued, key }));
                }
                Err(e) => {
                    tracing::warn!(cause = %e, "an issued key's record cannot be read: skipped")
                }
            }
        }
        if let Ok(mut t) = self.table.write() {
            *t = Table { version, by_digest };
        }
    }

    fn apply_locally(&self, changes: &[(String, Option<String>)]) {
        let Ok(mut t) = self.table.write() else {
            return;
        };
        t.version += 1;
        for (digest, json) in changes {
            match json.as_deref().map(serde_json::from_str::<Issued>) {
                Some(Ok(issued)) => {
                    let key = issued.key_config();
                    t.by_digest
                        .insert(digest.clone(), Arc::new(Found { issued, key }));
                }
                _ => {
                    t.by_digest.remove(digest);
                }
            }
        }
    }

    fn version(&self) -> u64 {
        self.table.read().map_or(0, |t| t.version)
    }

    /// The secrets of the key `id` (of tenant `only`, when given): (digest, record).
    fn secrets_of(&self, id: &str, only: Option<&str>) -> Vec<(String, Issued)> {
        self.table.read().map_or_else(
            |_| Vec::new(),
            |t| {
                t.by_digest
                    .iter()
                    .filter(|(_, f)| f.issued.id == id)
                    .filter(|(_, f)| only.is_none_or(|t| f.issued.tenant == t))
                    .map(|(d, f)| (d.clone(), f.issued.clone()))
                    .collect()
            },
        )
    }
}

/// Reads the store's issued keys and limit overrides when they changed (Redis; the memory
/// store's are this process's own).
pub async fn refresh(gw: &Gateway) -> Result<(), KeyError> {
    let Some(redis) = gw.store.redis() else {
        return Ok(());
    };
    let unavailable = |e: tollgate_core::StoreError| KeyError::Unavailable(e.to_string());
    if let Some((version, entries)) = redis
        .records(RecordSet::IssuedKeys, gw.keys.version())
        .await
        .map_err(unavailable)?
    {
        gw.keys.replace(version, &entries);
    }
    if let Some((version, entries)) = redis
        .records(RecordSet::Limits, gw.overrides.version())
        .await
        .map_err(unavailable)?
    {
        gw.overrides.replace(version, &entries);
    }
    Ok(())
}

/// At start: a memory store's issued keys and limit overrides from the spend ledger (Redis
/// keeps its own, and is rebuilt from the ledger after a loss).
pub async fn load(gw: &Gateway) -> Result<(), KeyError> {
    if gw.store.redis().is_some() {
        return refresh(gw).await;
    }
    let Some(books) = &gw.books else {
        return Ok(());
    };
    let read =
        |e: tollgate_ledger::LedgerError| KeyError::Unavailable(format!("the spend ledger: {e}"));
    let keys = books.ledger.records(Kept::IssuedKeys).await.map_err(read)?;
    gw.keys.replace(0, &keys);
    let limits = books.ledger.records(Kept::Limits).await.map_err(read)?;
    gw.overrides.replace(0, &limits);
    Ok(())
}

/// Reads the store's issued keys and overrides every [`REFRESH_EVERY`] (Redis only).
pub fn spawn_refresh(gw: Arc<Gateway>) {
    if gw.store.redis().is_none() {
        return;
    }
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(REFRESH_EVERY).await;
            if gw.is_draining() {
                return;
            }
            // The store's own faults are logged by the admissions that meet them.
            let _ = refresh(&gw).await;
        }
    });
}

/// Writes `changes` (field, record or deletion) of one set: to the ledger first when there is
/// one, then to the store. The caller applies them to its own table.
pub(crate) async fn write_set(
    gw: &Gateway,
    (kept, set): (Kept, RecordSet),
    changes: &[(String, Option<String>)],
) -> Result<(), KeyError> {
    if let Some(books) = &gw.books {
        let at = i64::try_from(now_ms()).unwrap_or(i64::MAX);
        books
            .ledger
            .put_records(kept, changes, at)
            .await
            .map_err(|e| KeyError::Unavailable(format!("the spend ledger: {e}")))?;
    }
    if let Some(redis) = gw.store.redis() {
        redis
            .write_records(set, changes, step()?)
            .await
            .map_err(|e| KeyError::Unavailable(e.to_string()))?;
    }
    Ok(())
}

async fn write(gw: &Gateway, changes: Vec<(String, Option<String>)>) -> Result<(), KeyError> {
    write_set(gw, (Kept::IssuedKeys, RecordSet::IssuedKeys), &changes).await?;
    gw.keys.apply_locally(&changes);
    Ok(())
}

/// Creates a key: its record and its secret (shown once, kept only as a digest).
pub async fn create(gw: &Gateway, mut new: NewKey) -> Result<(Issued, String), KeyError> {
    let now = now_ms();
    let limits = std::mem::take(&mut new.limits);
    let issued = validate(gw, new, now)?;
    // Its own limits first: a key is never issued without the limits it was asked with.
    let own = own_limits(gw, &issued.id, &limits, now)?;
    if !own.is_empty() {
        write_set(gw, (Kept::Limits, RecordSet::Limits), &own).await?;
        gw.overrides.apply_locally(&own);
    }
    let secret = secret()?;
    let json = serde_json::to_string(&issued).map_err(|e| KeyError::Invalid(e.to_string()))?;
    write(gw, vec![(digest(&secret), Some(json))]).await?;
    Ok((issued, secret))
}

/// The overrides a new key asks for (control → limit), each on the rule keyed on `key` that
/// holds the control, checked as `/admin/limits` checks them.
fn own_limits(
    gw: &Gateway,
    id: &str,
    limits: &std::collections::BTreeMap<String, serde_json::Value>,
    now: u64,
) -> Result<Vec<(String, Option<String>)>, KeyError> {
    use crate::overrides::{self, Control, Override};
    let cfg = gw.config();
    let mut out = Vec::with_capacity(limits.len());
    for (control, limit) in limits {
        let bad = |m: String| KeyError::Invalid(format!("limits.{control}: {m}"));
        let c = Control::parse(control)
            .ok_or_else(|| bad("one of requests, concurrency, budget, tool_calls".into()))?;
        let value = format!("key:{id}");
        let (rule, key) = overrides::resolve(&cfg.policy, &value, c, None).map_err(bad)?;
        let text = match limit {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => n.to_string(),
            other => return Err(bad(format!("{other} is not a limit"))),
        };
        let o = Override {
            rule: rule.name.to_string(),
            scope: key.id().to_owned(),
            control: c,
            limit: overrides::amount(rule, c, &text).map_err(bad)?,
            revision: 1,
            set_at_ms: now,
        };
        let json = serde_json::to_string(&o).map_err(|e| bad(e.to_string()))?;
        out.push((o.field(), Some(json)));
    }
    Ok(out)
}

/// Rotates key `id` (of tenant `only`, when given): a new secret, the old ones valid for the
/// grace period (expiring then, or sooner if they already were to).
pub async fn rotate(
    gw: &Gateway,
    id: &str,
    only: Option<&str>,
    r: Rotation,
) -> Result<(Issued, String), KeyError> {
    let _ = refresh(gw).await;
    let grace = match &r.grace {
        None => Duration::from_secs(3600),
        Some(g) => humantime::parse_duration(g)
            .map_err(|e| KeyError::Invalid(format!("grace {g:?}: {e}")))?,
    };
    let now = now_ms();
    let old = gw.keys.secrets_of(id, only);
    let Some((_, current)) = old.iter().find(|(_, i)| !i.rotated && i.valid_at(now)) else {
        return Err(KeyError::NotFound(id.to_owned()));
    };
    let fresh = Issued {
        created_at_ms: now,
        rotated: false,
        ..current.clone()
    };
    let until = now.saturating_add(u64::try_from(grace.as_millis()).unwrap_or(u64::MAX));
    let mut changes = Vec::with_capacity(old.len() + 1);
    for (digest, i) in &old {
        let ends = i.expires_at_ms.map_or(until, |e| e.min(until));
        let kept = Issued {
            rotated: true,
            expires_at_ms: Some(ends),
            ..i.clone()
        };
        let json = serde_json::to_string(&kept).map_err(|e| KeyError::Invalid(e.to_string()))?;
        changes.push((digest.clone(), (ends > now).then_some(json)));
    }
    let secret = secret()?;
    let json = serde_json::to_string(&fresh).map_err(|e| KeyError::Invalid(e.to_string()))?;
    changes.push((digest(&secret), Some(json)));
    write(gw, changes).await?;
    Ok((fresh, secret))
}

/// Revokes key `id` (of tenant `only`, when given): every secret of it stops working (on every
/// instance within [`REFRESH_EVERY`]).
pub async fn revoke(gw: &Gateway, id: &str, only: Option<&str>) -> Result<(), KeyError> {
    let _ = refresh(gw).await;
    let old = gw.keys.secrets_of(id, only);
    if old.is_empty() {
        return Err(KeyError::NotFound(id.to_owned()));
    }
    write(gw, old.into_iter().map(|(d, _)| (d, None)).collect()).await?;
    // Its own limits go with it.
    let own = format!("key:{id}");
    let limits: Vec<(String, Option<String>)> = gw
        .overrides
        .list()
        .into_iter()
        .filter(|o| o.scope.split_once('|').is_some_and(|(_, k)| k == own))
        .map(|o| (o.field(), None))
        .collect();
    if !limits.is_empty() {
        write_set(gw, (Kept::Limits, RecordSet::Limits), &limits).await?;
        gw.overrides.apply_locally(&limits);
    }
    Ok(())
}

/// The record of a new key, checked against the configuration (its models must be served).
fn validate(gw: &Gateway, new: NewKey, now: u64) -> Result<Issued, KeyError> {
    let bad = KeyError::Invalid;
    record::field("tenant", &new.tenant).map_err(bad)?;
    for (what, v) in [("name", &new.name), ("user", &new.user)] {
        if let Some(v) = v {
            record::field(what, v).map_err(bad)?;
        }
    }
    if new.metadata.len() > record::MAX_METADATA {
        return Err(bad(format!(
            "metadata has more than {} entries",
            record::MAX_METADATA
        )));
    }
    for (k, v) in &new.metadata {
        record::field("a metadata key", k).map_err(bad)?;
        record::field(&format!("metadata.{k}"), v).map_err(bad)?;
    }
    let cfg = gw.config();
    for m in new.models.iter().flatten() {
        if !cfg.models.contains_key(m) {
            return Err(bad(format!("models: no upstream serves {m:?}")));
        }
    }
    let expires_at_ms = match (&new.expires_in, &new.expires_at) {
        (Some(_), Some(_)) => return Err(bad("give expires_in or expires_at, not both".into())),
        (Some(d), None) => {
            let d =
                humantime::parse_duration(d).map_err(|e| bad(format!("expires_in {d:?}: {e}")))?;
            Some(now.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
        }
        (None, Some(at)) => {
            let t = humantime::parse_rfc3339_weak(at)
                .map_err(|e| bad(format!("expires_at {at:?}: {e} (RFC 3339, UTC)")))?;
            let ms = t
                .duration_since(std::time::UNIX_EPOCH)
                .map_err(|_| bad(format!("expires_at {at:?} is before 1970")))?
                .as_millis();
            Some(u64::try_from(ms).unwrap_or(u64::MAX))
        }
        (None, None) => None,
    };
    if expires_at_ms.is_some_and(|e| e <= now) {
        return Err(bad("the key would expire before it is created".into()));
    }
    let id = format!("vk_{}", hex(&random::<8>()?));
    Ok(Issued {
        name: new.name.unwrap_or_else(|| id.clone()),
        id,
        tenant: new.tenant,
        user: new.user,
        allow_user: new.allow_user,
        models: new.models,
        created_at_ms: now,
        expires_at_ms,
        metadata: new.metadata,
        rotated: false,
    })
}

/// A random step for the store's version of its issued keys (see
/// [`tollgate_redis::RedisStore::write_records`]).
pub fn step() -> Result<u32, KeyError> {
    Ok(u32::from_le_bytes(random::<4>()?))
}

fn random<const N: usize>() -> Result<[u8; N], KeyError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b)
        .map_err(|e| KeyError::Unavailable(format!("no randomness for a secret: {e}")))?;
    Ok(b)
}

/// A new secret: `tg-` and 192 random bits in hex.
fn secret() -> Result<String, KeyError> {
    Ok(format!("tg-{}", hex(&random::<24>()?)))
}

/// The digest a secret is kept and looked up by (the configuration's hex, without `sha256:`).
pub fn digest(secret: &str) -> String {
    hash_key(secret).trim_start_matches("sha256:").to_owned()
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
