//! The store's marker through the admin API: initialising a new store, and acknowledging the
//! loss of one that forgot.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tollgate_core::{Clock, Keeper, StoreError, SystemClock};

use super::store_failed;
use crate::gateway::Shared;

/// `POST /admin/store/init`: the operator says the store is new, and its marker is written on
/// every shard. Refused when the spend ledger holds books (an empty store then forgot them, and
/// is rebuilt from the ledger) and when a loss is written down (that is acknowledged instead).
pub(super) async fn init_store(State(gw): State<Shared>) -> Response {
    use crate::watch::InitError;
    match crate::watch::initialise(&gw.store, gw.books.as_deref()).await {
        Ok(wrote) => {
            if wrote {
                tracing::info!("the store was initialised by an operator: admissions begin");
            }
            crate::faults::STORE_UNINITIALISED.ok();
            axum::Json(json!({"initialised": wrote, "store": "ok"})).into_response()
        }
        Err(InitError::LedgerHoldsBooks) => crate::respond::store_has_books().into_response(),
        Err(InitError::Lost) => crate::respond::init_over_loss().into_response(),
        Err(InitError::Failed(e)) => store_failed(StoreError::Unavailable(e)),
    }
}

/// `POST /admin/store/acknowledge-loss`: the operator accepts that the store forgot (budgets
/// spent and kill switches set before the loss are gone); admissions resume on every instance.
/// Recorded: the answer says when, and `tollgate_store_loss_acknowledged_total` counts it.
pub(super) async fn acknowledge_loss(State(gw): State<Shared>) -> Response {
    match gw.store.acknowledge_loss().await {
        Ok(()) => {
            crate::telemetry::store_loss_acknowledged();
            let at = SystemClock.now();
            axum::Json(json!({"acknowledged": true, "at_ms": at})).into_response()
        }
        Err(e) => store_failed(e),
    }
}
