//! The probes every listener answers without a token: `/healthz` (the process answers) and
//! `/readyz` (the store answers and no shutdown has begun).

use axum::response::{IntoResponse, Response};
use tollgate_core::Keeper;

use crate::gateway::Shared;

/// `GET /healthz`: the process answers.
pub(crate) async fn healthz() -> &'static str {
    "ok"
}

/// `GET /readyz`: 200 while the store answers and no shutdown has begun, 503 otherwise.
pub(crate) async fn readyz(axum::extract::State(gw): axum::extract::State<Shared>) -> Response {
    if gw.is_draining() {
        return crate::respond::draining();
    }
    match gw.store.ping().await {
        Ok(()) => crate::respond::ready(),
        Err(e) => crate::respond::store_unavailable()
            .param(e.to_string())
            .into_response(),
    }
}
