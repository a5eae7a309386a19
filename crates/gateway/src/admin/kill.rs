//! Kill switches through the admin API: set, lifted and listed, with their origin (the
//! store's, or the configuration's, which only the file lifts). A change is confirmed by a
//! replica when the store has one (`docs/store-loss.md`).

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use tollgate_core::Store;

use super::store_failed;
use crate::gateway::Shared;

/// A kill switch in force: its target, its reason, and where it was set (`store`: by the admin
/// API, the CLI or the status page, on every instance at once; `configuration`: a `[[kill]]`
/// of the file, lifted only there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kill {
    pub target: String,
    pub reason: String,
    pub origin: &'static str,
}

/// Every kill switch in force: the store's `stored` and the configuration's, each with its
/// origin.
pub(crate) fn all_kills(gw: &Shared, stored: Vec<(String, String)>) -> Vec<Kill> {
    let of = |origin| {
        move |(target, reason): (String, String)| Kill {
            target,
            reason,
            origin,
        }
    };
    let configured = gw.config().kills.clone();
    stored
        .into_iter()
        .map(of("store"))
        .chain(configured.into_iter().map(of("configuration")))
        .collect()
}

pub(super) fn kills_json(gw: &Shared, kills: &[Kill]) -> Vec<serde_json::Value> {
    let file = gw.config_path().map(|p| p.display().to_string());
    kills
        .iter()
        .map(|k| match k.origin {
            "configuration" => json!({"target": k.target, "reason": k.reason,
                "origin": k.origin, "file": file}),
            _ => json!({"target": k.target, "reason": k.reason, "origin": k.origin}),
        })
        .collect()
}

/// Whether `target` may be lifted: not when the configuration switches it off (409, naming the
/// file), nor when nothing switches it off (404); no alert either way.
pub(crate) async fn liftable(gw: &Shared, target: &str) -> Result<(), crate::respond::ApiError> {
    if gw.config().kills.iter().any(|(t, _)| t == target) {
        let file = gw
            .config_path()
            .map_or("the configuration".to_owned(), |p| p.display().to_string());
        return Err(crate::respond::kill_in_configuration(target, &file));
    }
    let stored = gw
        .store
        .kills()
        .await
        .map_err(|e| crate::respond::store_failed(&e))?;
    if !stored.iter().any(|(t, _)| t == target) {
        return Err(crate::respond::kill_not_set(target));
    }
    Ok(())
}

pub(super) async fn list_kills(State(gw): State<Shared>) -> Response {
    match gw.store.kills().await {
        Ok(k) => {
            let kills = all_kills(&gw, k);
            axum::Json(json!({"kills": kills_json(&gw, &kills)})).into_response()
        }
        Err(e) => store_failed(e),
    }
}

/// A kill switch set (with its reason) or lifted, told to the alerts by the instance that did
/// it.
pub(crate) fn kill_alert(gw: &Shared, target: &str, reason: Option<&str>) {
    if let Some(b) = &gw.books {
        b.kill_changed(target, reason);
    }
    gw.alerts.emit(match reason {
        Some(r) => json!({"event": "kill_switch_set", "target": target, "reason": r}),
        None => json!({"event": "kill_switch_lifted", "target": target}),
    });
}

#[derive(Deserialize)]
pub(super) struct KillRequest {
    target: String,
    reason: String,
}

pub(crate) fn valid_target(t: &str) -> bool {
    t == "all"
        || ["tenant:", "key:", "model:", "user:"]
            .iter()
            .any(|p| t.strip_prefix(p).is_some_and(|v| !v.is_empty()))
}

pub(super) async fn set_kill(
    State(gw): State<Shared>,
    axum::Json(k): axum::Json<KillRequest>,
) -> Response {
    if !valid_target(&k.target) {
        return crate::respond::invalid_kill_target().into_response();
    }
    if let Some(e) = evicting(&gw) {
        return e.into_response();
    }
    match gw.store.set_kill(&k.target, Some(&k.reason)).await {
        Ok(()) => {
            kill_alert(&gw, &k.target, Some(&k.reason));
            axum::Json(json!({"target": k.target, "reason": k.reason, "killed": true}))
                .into_response()
        }
        Err(e) => made_anyway(&gw, &k.target, Some(&k.reason), e),
    }
}

/// A kill switch is not set in a store that may evict it (`[store] allow_eviction`): an
/// evicted switch would let its target through again without a word.
pub(crate) fn evicting(gw: &Shared) -> Option<crate::respond::ApiError> {
    let cfg = gw.config();
    matches!(
        cfg.store,
        crate::config::StoreConfig::Redis {
            allow_eviction: true,
            ..
        }
    )
    .then(crate::respond::kill_on_evicting_store)
}

pub(super) async fn clear_kill(State(gw): State<Shared>, Path(target): Path<String>) -> Response {
    if let Err(e) = liftable(&gw, &target).await {
        return e.into_response();
    }
    match gw.store.set_kill(&target, None).await {
        Ok(()) => {
            kill_alert(&gw, &target, None);
            axum::Json(json!({"target": target, "killed": false})).into_response()
        }
        Err(e) => made_anyway(&gw, &target, None, e),
    }
}

/// A kill switch's change the store did not confirm: one that no replica confirmed was made
/// all the same, and is told (and written to the ledger) as made.
pub(crate) fn made_anyway(
    gw: &Shared,
    target: &str,
    reason: Option<&str>,
    e: tollgate_core::StoreError,
) -> Response {
    if let tollgate_core::StoreError::NotReplicated(_) = e {
        kill_alert(gw, target, reason);
    }
    store_failed(e)
}
