//! Where the keys' one truth is kept, and a change committed to it as one compare-and-set: the
//! spend ledger when there is one (the store holds a copy, written after, never ahead, so that a
//! rebuild from the ledger cannot bring back what was changed); otherwise Redis; otherwise this
//! process's own table (the memory store). A change whose outcome the truth did not tell is
//! read back before it is answered: an answer of 503 means that nothing changed.

use std::time::Duration;

use tollgate_core::Keeper;
use tollgate_core::keeper::{KeyPut, KeyWrite, RecordSet};

use crate::store::AnyStore;

use super::{KeyError, now_ms, step};
use crate::gateway::Gateway;
use crate::keyring::life::KeyRecord;
pub(super) use crate::keyring::registry::Swap;

/// Key `id`'s record in the truth, and the instant after which a write from it is refused
/// (the store's, where Redis is the truth).
pub(super) async fn read(gw: &Gateway, id: &str) -> Result<(Option<KeyRecord>, u64), KeyError> {
    let parse = |json: Option<String>| -> Result<Option<KeyRecord>, KeyError> {
        json.map(|j| serde_json::from_str::<KeyRecord>(&j))
            .transpose()
            .map_err(|e| KeyError::Unavailable(format!("key {id:?}'s record cannot be read: {e}")))
    };
    if let Some(books) = &gw.books {
        let held = books
            .ledger
            .key_record(id)
            .await
            .map_err(|e| KeyError::Unavailable(format!("the spend ledger: {e}")))?;
        return Ok((parse(held.map(|(_, r)| r))?, 0));
    }
    if gw.store.is_shared() {
        let shared = &gw.store;
        let (_, record, at) = shared.key_record(id).await.map_err(unavailable)?;
        let deadline = at.saturating_add(millis(shared.call_timeout()));
        return Ok((parse(record)?, deadline));
    }
    Ok((gw.keys.record(id).map(|r| (*r).clone()), 0))
}

/// Writes `next` if the truth holds `expected` (0: no record), then the store's copy; applies
/// it to this instance's table. `deadline`: from [`read`].
pub(super) async fn commit(
    gw: &Gateway,
    expected: u64,
    next: &KeyRecord,
    deadline: u64,
) -> Result<Swap, KeyError> {
    let json = serde_json::to_string(next).map_err(|e| KeyError::Invalid(e.to_string()))?;
    let id = next.key.id.as_str();
    let swap = if let Some(books) = &gw.books {
        // The store first: while it is unreachable or rebuilding, nothing is changed.
        if gw.store.is_shared() {
            let shared = &gw.store;
            usable(shared).await?;
        }
        let at = i64::try_from(now_ms()).unwrap_or(i64::MAX);
        match books
            .ledger
            .swap_key(id, expected, (next.version, &json), at)
            .await
        {
            Ok(tollgate_ledger::Swap::Done) => Swap::Done,
            Ok(tollgate_ledger::Swap::Changed(v)) => Swap::Changed(v),
            Err(e) => ledger_outcome(gw, next, e).await?,
        }
    } else if gw.store.is_shared() {
        let shared = &gw.store;
        let how = KeyWrite::Swap { expected, deadline };
        match shared
            .put_key(id, (next.version, &json), how, step()?)
            .await
        {
            Ok(KeyPut::Done) => Swap::Done,
            Ok(KeyPut::Changed(v)) => Swap::Changed(v),
            Ok(KeyPut::Late) => return Err(late()),
            Ok(KeyPut::Lost) => return Err(rebuilding()),
            Err(e @ tollgate_core::StoreError::NotReplicated(_)) => {
                gw.keys.put(next.clone());
                return Err(KeyError::Unknown(format!(
                    "{e}: read the key before changing it again"
                )));
            }
            Err(e) => store_outcome(shared, next, deadline, e).await?,
        }
    } else {
        gw.keys.swap_local(expected, next)
    };
    if let Swap::Done = swap {
        if gw.books.is_some() {
            copy(gw, next, &json).await;
        }
        gw.keys.put(next.clone());
    }
    Ok(swap)
}

/// Writes the ledger's record into the store, which holds a copy; a copy the store did not take
/// is written again by the refresh, and by the rebuild of a store that forgot.
async fn copy(gw: &Gateway, next: &KeyRecord, json: &str) {
    if !gw.store.is_shared() {
        return;
    }
    let shared = &gw.store;
    let Ok(step) = step() else { return };
    match shared
        .put_key(&next.key.id, (next.version, json), KeyWrite::Copy, step)
        .await
    {
        Ok(KeyPut::Done | KeyPut::Changed(_) | KeyPut::Lost) => {}
        Ok(KeyPut::Late) | Err(_) => {
            tracing::warn!(id = %next.key.id, version = next.version,
                "a key's change is in the spend ledger, not yet in the store: written again \
                 within a second of the store answering");
            gw.keys.hold(next.clone());
        }
    }
}

/// The copies the store did not take, written again (by the refresh).
pub(super) async fn copy_held(gw: &Gateway) {
    for record in gw.keys.held() {
        let Ok(json) = serde_json::to_string(&record) else {
            continue;
        };
        if !gw.store.is_shared() {
            return;
        }
        let shared = &gw.store;
        let Ok(step) = step() else { return };
        if let Ok(KeyPut::Done | KeyPut::Changed(_) | KeyPut::Lost) = shared
            .put_key(
                &record.key.id,
                (record.version, &json),
                KeyWrite::Copy,
                step,
            )
            .await
        {
            gw.keys.release(&record);
        }
    }
}

/// Writes `changes` (field, record or deletion) of the limits set at run time, once the store
/// answers and is not rebuilding: where a ledger is the truth, to the ledger, then to the store
/// (which, missing it, is written again from the ledger by the refresh); otherwise to the
/// store. Applies them to this instance's table.
pub(crate) async fn write_limits(
    gw: &Gateway,
    changes: &[(String, Option<String>)],
) -> Result<(), KeyError> {
    use tollgate_ledger::Kept;
    if let Some(books) = &gw.books {
        if gw.store.is_shared() {
            let shared = &gw.store;
            usable(shared).await?;
        }
        let at = i64::try_from(now_ms()).unwrap_or(i64::MAX);
        books
            .ledger
            .put_records(Kept::Limits, changes, at)
            .await
            .map_err(|e| KeyError::Unavailable(format!("the spend ledger: {e}")))?;
        if gw.store.is_shared() {
            let shared = &gw.store;
            // A copy no replica confirmed is in the store all the same, and the ledger is the
            // truth a rebuild restores: nothing to write again.
            if let Err(e) = shared
                .write_records(RecordSet::Limits, changes, step()?)
                .await
                .or_else(|e| match e {
                    tollgate_core::StoreError::NotReplicated(_) => Ok(0),
                    e => Err(e),
                })
            {
                tracing::warn!(cause = %e, "a limit set is in the spend ledger, not yet in the \
                    store: written again within a second of the store answering");
                gw.overrides
                    .behind
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
    } else if gw.store.is_shared() {
        let shared = &gw.store;
        usable(shared).await?;
        match shared
            .write_records(RecordSet::Limits, changes, step()?)
            .await
        {
            Ok(_) => {}
            Err(e @ tollgate_core::StoreError::NotReplicated(_)) => {
                gw.overrides.apply_locally(changes);
                return Err(KeyError::Unknown(format!(
                    "{e}: read the limits before changing them again"
                )));
            }
            Err(e) => return Err(unavailable(e)),
        }
    }
    gw.overrides.apply_locally(changes);
    Ok(())
}

/// The store's limits made the ledger's again, when it missed a change (by the refresh).
pub(super) async fn sync_limits(gw: &Gateway) {
    use std::sync::atomic::Ordering;
    use tollgate_ledger::Kept;
    let (Some(books), true) = (&gw.books, gw.store.is_shared()) else {
        return;
    };
    let shared = &gw.store;
    if !gw.overrides.behind.load(Ordering::Relaxed) {
        return;
    }
    let (Ok(truth), Ok(Some((_, held)))) = (
        books.ledger.records(Kept::Limits).await,
        shared.records(RecordSet::Limits, u64::MAX).await,
    ) else {
        return;
    };
    let mut changes: Vec<(String, Option<String>)> = held
        .into_iter()
        .filter(|(f, _)| !truth.iter().any(|(t, _)| t == f))
        .map(|(f, _)| (f, None))
        .collect();
    changes.extend(truth.into_iter().map(|(f, r)| (f, Some(r))));
    let Ok(step) = step() else { return };
    if shared
        .write_records(RecordSet::Limits, &changes, step)
        .await
        .is_ok()
    {
        gw.overrides.behind.store(false, Ordering::Relaxed);
    }
}

/// The store answers and is not rebuilding.
async fn usable(shared: &AnyStore) -> Result<(), KeyError> {
    match shared.state().await.map_err(unavailable)? {
        tollgate_core::StoreState::Lost => Err(rebuilding()),
        _ => Ok(()),
    }
}

/// The ledger failed to answer a change: read back whether it was made.
async fn ledger_outcome(
    gw: &Gateway,
    next: &KeyRecord,
    e: tollgate_ledger::LedgerError,
) -> Result<Swap, KeyError> {
    let Some(books) = &gw.books else {
        return Err(KeyError::Unavailable(e.to_string()));
    };
    match books.ledger.key_record(&next.key.id).await {
        Ok(Some((_, json))) if ours(&json, next) => Ok(Swap::Done),
        Ok(_) => Err(KeyError::Unavailable(format!(
            "the spend ledger: {e}; nothing was changed"
        ))),
        Err(again) => Err(KeyError::Unknown(format!(
            "the spend ledger did not answer the change ({e}), nor whether it was made \
             ({again}): read the key before changing it again"
        ))),
    }
}

/// Redis failed to answer a change: once its deadline has passed on the store's clock (a write
/// that arrives later is refused), read back whether it was made.
async fn store_outcome(
    shared: &AnyStore,
    next: &KeyRecord,
    deadline: u64,
    e: tollgate_core::StoreError,
) -> Result<Swap, KeyError> {
    for _ in 0..4 {
        match shared.key_record(&next.key.id).await {
            Ok((_, json, at)) if at > deadline => {
                return match json {
                    Some(j) if ours(&j, next) => Ok(Swap::Done),
                    _ => Err(KeyError::Unavailable(format!(
                        "the store did not answer in time ({e}); nothing was changed"
                    ))),
                };
            }
            Ok((_, _, at)) => {
                tokio::time::sleep(Duration::from_millis(deadline - at + 1)).await;
            }
            Err(_) => tokio::time::sleep(shared.call_timeout()).await,
        }
    }
    Err(KeyError::Unknown(format!(
        "the store did not answer the change ({e}), nor whether it was made: read the key \
         before changing it again"
    )))
}

fn ours(json: &str, next: &KeyRecord) -> bool {
    serde_json::from_str::<KeyRecord>(json).is_ok_and(|r| r.change == next.change)
}

fn unavailable(e: tollgate_core::StoreError) -> KeyError {
    KeyError::Unavailable(format!("{e}; nothing was changed"))
}

fn rebuilding() -> KeyError {
    KeyError::Unavailable(
        "the store forgot its books and is being rebuilt from the spend ledger; nothing was \
         changed: try again in a few seconds"
            .into(),
    )
}

fn late() -> KeyError {
    KeyError::Unavailable(
        "the store took the change too late to make it; nothing was changed".into(),
    )
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
