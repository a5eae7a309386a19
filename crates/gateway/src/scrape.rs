//! The metrics listener's side of the gateway: the scrape, and the budget gauges kept fresh
//! for it from the store, so that a scrape never calls the store.

/// Keeps the budget gauges of the operator's fixed scopes (global rules and fully matched ones)
/// fresh: every `[metrics] refresh`, all of them read from the store at once (concurrent calls,
/// which the Redis store's one connection sends together), so a scrape never calls the store
/// and a scrape storm costs it nothing. Stops with the gateway.
pub fn spawn_budget_refresh(gw: crate::gateway::Shared) {
    let weak = std::sync::Arc::downgrade(&gw);
    drop(gw);
    tokio::spawn(async move {
        loop {
            let Some(gw) = weak.upgrade() else { return };
            let cfg = gw.config();
            refresh_budgets(&gw, &cfg).await;
            drop(gw);
            tokio::time::sleep(cfg.metrics.refresh).await;
        }
    });
}

async fn refresh_budgets(gw: &crate::gateway::Gateway, cfg: &crate::config::GatewayConfig) {
    use tollgate_core::Store;
    let scopes: Vec<_> = crate::telemetry::fixed_scopes(&cfg.policy)
        .into_iter()
        .filter_map(|(rule, scope)| Some((scope, rule.budget?)))
        .collect();
    let reads = scopes
        .iter()
        .map(|(scope, b)| gw.store.usage(scope.id(), Some(b.period)));
    let usages = futures_util::future::join_all(reads).await;
    for ((scope, b), u) in scopes.iter().zip(usages) {
        if let Ok(u) = u {
            crate::telemetry::budget_remaining(
                scope.id(),
                b.unit.as_str(),
                b.limit.get(),
                b.limit
                    .get()
                    .saturating_sub(u.settled.saturating_add(u.reserved)),
            );
        }
    }
}

/// `GET /metrics`: Prometheus text format. Budget figures are the last refresh's (see
/// [`spawn_budget_refresh`]): a scrape never calls the store.
pub async fn metrics(
    axum::extract::State(gw): axum::extract::State<crate::gateway::Shared>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    crate::telemetry::scrape_gauges(
        gw.records
            .as_ref()
            .map_or(0, crate::records::RecordSink::dropped),
        &gw.memos,
    );
    match crate::telemetry::handle() {
        Some(h) => ([("content-type", "text/plain; version=0.0.4")], h.render()).into_response(),
        None => {
            crate::respond::internal("metrics_unavailable", "No metrics recorder.").into_response()
        }
    }
}
