//! Virtual keys issued at run time: created, listed, rotated and revoked through the admin API,
//! each one record by id whose every change is a compare-and-set on its version (see
//! [`life`] for the transitions, [`truth`] for where they are kept), read by every instance
//! within [`REFRESH_EVERY`]. The secret is shown once and kept only as its SHA-256 digest.
//! Keys of the configuration file keep working beside them.

mod truth;

use std::sync::Arc;
use std::time::Duration;

pub(crate) use crate::key_copy::copy_all;
pub use crate::keyring::{
    Found, Issued, KeyRecord, NewKey, Refusal, Registry, Rotation, Secret, life, record, registry,
};
use tollgate_core::Keeper;
use tollgate_core::keeper::{KeyWrite, RecordSet};
use tollgate_ledger::Kept;
pub(crate) use truth::write_limits;

use crate::config::{hash_key, hex};
use crate::gateway::Gateway;
use crate::store::AnyStore;

/// How often an instance reads the store's issued keys: the bound within which a key created,
/// rotated or revoked on one instance takes effect on every other. An expiry takes effect at
/// its instant on every instance.
pub const REFRESH_EVERY: Duration = Duration::from_secs(1);

/// How many times a revocation meets another change before it answers 409: a revocation takes
/// the changes made meanwhile with it, so it reads the key again and revokes what it finds.
const REVOKE_TRIES: usize = 8;

/// Why an operation on issued keys failed.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The request is wrong (the message names the field).
    #[error("{0}")]
    Invalid(String),
    /// No issued key has this id.
    #[error("no issued key has the id {0:?}")]
    NotFound(String),
    /// The caller may not do this (a tenant's token raising a limit).
    #[error("{0}")]
    Forbidden(String),
    /// Another change, or the key's end (revoked, expired), came first: nothing was changed.
    #[error("{0}")]
    Changed(String),
    /// The store or the ledger did not take it: nothing was changed.
    #[error("{0}")]
    Unavailable(String),
    /// The store or the ledger did not say whether the change was made.
    #[error("{0}")]
    Unknown(String),
}

/// Reads the store's issued keys and limit overrides when they changed (Redis; the memory
/// store's are this process's own), after writing again the copies it did not take.
pub async fn refresh(gw: &Gateway) -> Result<(), KeyError> {
    if !gw.store.is_shared() {
        return Ok(());
    }
    let shared = &gw.store;
    let began = now_ms();
    truth::copy_held(gw).await;
    let unavailable = |e: tollgate_core::StoreError| KeyError::Unavailable(e.to_string());
    truth::sync_limits(gw).await;
    // A set the store no longer holds (version 0) was forgotten: with a ledger, the rebuild
    // writes it back, and until then this instance keeps what it knew.
    let forgotten = |version: u64| version == 0 && gw.books.is_some();
    let (generation, limits) = (gw.keys.generation(), gw.overrides.generation());
    let mut whole = true;
    if let Some((version, entries)) = shared
        .records(RecordSet::IssuedKeys, gw.keys.version())
        .await
        .map_err(unavailable)?
    {
        if forgotten(version) {
            whole = false;
        } else {
            gw.keys.replace(generation, version, &entries);
        }
    }
    if let Some((version, entries)) = shared
        .records(RecordSet::Limits, gw.overrides.version())
        .await
        .map_err(unavailable)?
    {
        if forgotten(version) {
            whole = false;
        } else {
            gw.overrides.replace(limits, version, &entries);
        }
    }
    // What this instance knows is the store's as of the read, unless the store had forgotten
    // and the instance kept its own.
    if whole {
        gw.keys.read_as_of(began);
    }
    Ok(())
}

/// At start: a memory store's issued keys and limit overrides from the spend ledger; a Redis
/// store given what the ledger holds and it does not, and its keys kept by digest before
/// carried over.
pub async fn load(gw: &Gateway) -> Result<(), KeyError> {
    if gw.store.is_shared() {
        let shared = &gw.store;
        carry_over(gw, shared).await?;
        let behind = match &gw.books {
            Some(books) => copy_all(&books.ledger, shared, false).await.map_err(|e| {
                KeyError::Unavailable(format!("the keys' copy into the store: {e}"))
            })?,
            None => 0,
        };
        if behind > 0 {
            tracing::warn!(
                behind,
                "the store was behind the spend ledger on issued keys: written"
            );
        }
        return refresh(gw).await;
    }
    let Some(books) = &gw.books else {
        return Ok(());
    };
    let read =
        |e: tollgate_ledger::LedgerError| KeyError::Unavailable(format!("the spend ledger: {e}"));
    let keys = books.ledger.key_records().await.map_err(read)?;
    let entries: Vec<(String, String)> = keys
        .into_iter()
        .map(|(id, v, json)| (id, format!("{v} {json}")))
        .collect();
    gw.keys.replace(gw.keys.generation(), 0, &entries);
    let limits = books.ledger.records(Kept::Limits).await.map_err(read)?;
    gw.overrides.replace(gw.overrides.generation(), 0, &limits);
    Ok(())
}

/// Keys a Redis store kept by digest: carried over into records by id (without a ledger; a
/// ledger carried its own over), then forgotten.
async fn carry_over(gw: &Gateway, shared: &AnyStore) -> Result<(), KeyError> {
    let unavailable = |e: tollgate_core::StoreError| KeyError::Unavailable(e.to_string());
    let old = shared.legacy_keys().await.map_err(unavailable)?;
    if old.is_empty() {
        return Ok(());
    }
    if gw.books.is_none() {
        for r in life::carried_over(&old) {
            let json = serde_json::to_string(&r).map_err(|e| KeyError::Invalid(e.to_string()))?;
            shared
                .put_key(&r.key.id, (r.version, &json), KeyWrite::Copy, step()?)
                .await
                .map_err(unavailable)?;
        }
    }
    shared.drop_legacy_keys().await.map_err(unavailable)?;
    tracing::warn!(
        secrets = old.len(),
        "issued keys kept by digest were carried over into records by id"
    );
    Ok(())
}

/// Reads the store's issued keys and overrides every [`REFRESH_EVERY`] (Redis only).
pub fn spawn_refresh(gw: Arc<Gateway>) {
    if !gw.store.is_shared() {
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

/// Creates a key: its record and its secret (shown once, kept only as a digest).
/// Its own limits are set in `layer` (a tenant's token: the tenant's, each at most the limit
/// in force above it).
pub async fn create(
    gw: &Gateway,
    mut new: NewKey,
    layer: crate::overrides::Layer,
) -> Result<(KeyRecord, String), KeyError> {
    let now = now_ms();
    let limits = std::mem::take(&mut new.limits);
    let issued = validate(gw, new, now)?;
    let own = own_limits(gw, (&issued.id, layer), &limits, now)?;
    let secret = secret()?;
    let record = KeyRecord::new(issued, digest(&secret), change()?);
    let (_, deadline) = truth::read(gw, &record.key.id).await?;
    // Its own limits first: a key is never issued without the limits it was asked with.
    if !own.is_empty() {
        truth::write_limits(gw, &own).await?;
    }
    match truth::commit(gw, 0, &record, deadline).await? {
        truth::Swap::Done => Ok((record, secret)),
        truth::Swap::Changed(_) => Err(KeyError::Changed(format!(
            "a key with the id {:?} exists: nothing was changed",
            record.key.id
        ))),
    }
}

/// The overrides a new key asks for (control → limit), each on the rule keyed on `key` that
/// holds the control, checked as `/admin/limits` checks them.
fn own_limits(
    gw: &Gateway,
    (id, layer): (&str, crate::overrides::Layer),
    limits: &std::collections::BTreeMap<String, serde_json::Value>,
    now: u64,
) -> Result<Vec<(String, Option<String>)>, KeyError> {
    use crate::overrides::{self, Control, Layer, Override};
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
            layer,
        };
        let above = gw
            .overrides
            .above_tenant(&o.scope, c, c.default_of(rule).unwrap_or(0));
        if layer == Layer::Tenant && o.limit > above {
            return Err(KeyError::Forbidden(format!(
                "limits.{control}: a tenant's token may tighten its limits, not raise them: the \
                 limit in force above it is {above}, asked {}",
                o.limit
            )));
        }
        let json = serde_json::to_string(&o).map_err(|e| bad(e.to_string()))?;
        out.push((o.field(), Some(json)));
    }
    Ok(out)
}

/// Rotates key `id` (of tenant `only`, when given): a new secret; the old ones work for the
/// grace period (ending then, or sooner if they already were to). 409 when another change came
/// first, or the key was revoked or expired.
pub async fn rotate(
    gw: &Gateway,
    id: &str,
    only: Option<&str>,
    r: Rotation,
) -> Result<(KeyRecord, String), KeyError> {
    let grace = match &r.grace {
        None => Duration::from_secs(3600),
        Some(g) => humantime::parse_duration(g)
            .map_err(|e| KeyError::Invalid(format!("grace {g:?}: {e}")))?,
    };
    let (held, deadline) = truth::read(gw, id).await?;
    let held = owned(held, id, only)?;
    if let Some(v) = r.version.filter(|v| *v != held.version) {
        return Err(changed(id, v, held.version));
    }
    let secret = secret()?;
    let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
    let next = held
        .rotate(now_ms(), grace_ms, digest(&secret), change()?)
        .map_err(|e| ended(id, &e))?;
    match truth::commit(gw, held.version, &next, deadline).await? {
        truth::Swap::Done => Ok((next, secret)),
        truth::Swap::Changed(v) => Err(changed(id, held.version, v)),
    }
}

/// Revokes key `id` (of tenant `only`, when given), for good: every secret of it stops working
/// (on every instance within [`REFRESH_EVERY`]), with the rotations made meanwhile. Revoking a
/// revoked key changes nothing and answers its record.
pub async fn revoke(gw: &Gateway, id: &str, only: Option<&str>) -> Result<KeyRecord, KeyError> {
    for _ in 0..REVOKE_TRIES {
        let (held, deadline) = truth::read(gw, id).await?;
        let held = owned(held, id, only)?;
        let Some(next) = held.revoke(now_ms(), change()?) else {
            return Ok(held);
        };
        match truth::commit(gw, held.version, &next, deadline).await? {
            truth::Swap::Done => {
                drop_limits(gw, id).await?;
                return Ok(next);
            }
            truth::Swap::Changed(_) => continue,
        }
    }
    Err(KeyError::Changed(format!(
        "key {id:?} changed {REVOKE_TRIES} times while it was revoked: nothing was changed"
    )))
}

/// Key `id`'s own limits are about to change: a transition of the key, from the version the
/// truth holds, so that it races a rotation or a revocation as they race each other (409 for
/// the loser). 404 when no key has the id; 409 once it is revoked or expired.
pub async fn set_limits(gw: &Gateway, id: &str, only: Option<&str>) -> Result<KeyRecord, KeyError> {
    let (held, deadline) = truth::read(gw, id).await?;
    let held = owned(held, id, only)?;
    let next = held
        .limits_set(now_ms(), change()?)
        .map_err(|e| ended(id, &e))?;
    match truth::commit(gw, held.version, &next, deadline).await? {
        truth::Swap::Done => Ok(next),
        truth::Swap::Changed(v) => Err(changed(id, held.version, v)),
    }
}

/// A revoked key's own limits go with it.
async fn drop_limits(gw: &Gateway, id: &str) -> Result<(), KeyError> {
    let own = format!("key:{id}");
    let limits: Vec<(String, Option<String>)> = gw
        .overrides
        .list()
        .into_iter()
        .filter(|o| o.scope.split_once('|').is_some_and(|(_, k)| k == own))
        .map(|o| (o.field(), None))
        .collect();
    if !limits.is_empty() {
        truth::write_limits(gw, &limits).await?;
    }
    Ok(())
}

/// The record, if it is of tenant `only` (when given): another tenant's key is not found.
fn owned(held: Option<KeyRecord>, id: &str, only: Option<&str>) -> Result<KeyRecord, KeyError> {
    held.filter(|r| only.is_none_or(|t| r.key.tenant == t))
        .ok_or_else(|| KeyError::NotFound(id.to_owned()))
}

fn ended(id: &str, r: &Refusal) -> KeyError {
    let (what, at) = match r {
        Refusal::Revoked(at) => ("revoked", at),
        Refusal::Expired(at) => ("expired", at),
    };
    KeyError::Changed(format!(
        "key {id:?} was {what} at {}: nothing was changed",
        crate::words::instant_ms(*at)
    ))
}

fn changed(id: &str, from: u64, now: u64) -> KeyError {
    KeyError::Changed(format!(
        "key {id:?} changed while this change was made (from version {from}, now {now}): \
         nothing was changed; read the key and try again"
    ))
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
        uses: new.uses,
        created_at_ms: now,
        expires_at_ms,
        metadata: new.metadata,
    })
}

/// A random step for the store's version of its issued keys (the books' own, in `copy`).
pub fn step() -> Result<u32, KeyError> {
    crate::key_copy::step().map_err(KeyError::Unavailable)
}

fn random<const N: usize>() -> Result<[u8; N], KeyError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b)
        .map_err(|e| KeyError::Unavailable(format!("no randomness for a secret: {e}")))?;
    Ok(b)
}

/// A change's id: how a caller whose answer was lost finds its own change.
fn change() -> Result<String, KeyError> {
    Ok(hex(&random::<8>()?))
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
