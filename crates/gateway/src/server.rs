//! The listeners and their routes; connections are bounded in `conn`.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::Request;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::net::TcpListener;

use crate::config::GatewayConfig;
use crate::gateway::{Gateway, Shared};
use crate::store::start_store;

/// Opens the spend ledger when one is configured: connects, brings its schema up to date, and
/// writes the endings spooled at the last shutdown.
pub async fn open_books(
    config: &GatewayConfig,
) -> std::io::Result<Option<Arc<crate::books::Books>>> {
    let books = crate::books::Books::open(config).await?;
    if let Some(b) = &books {
        b.unspool();
    }
    Ok(books)
}

/// The routes over a gateway.
pub fn router(gw: Shared) -> Router {
    // Install the recorder before the first request records anything.
    let _ = crate::telemetry::handle();
    let mut routes = Router::new();
    for d in crate::dialect::ALL {
        routes = routes.route(d.path(), post(move |s, r| crate::path::handle(s, d, r)));
    }
    routes
        .route("/v1/models", get(models))
        .route("/v1/limits", get(crate::limits::limits))
        .route("/v1/reservations", post(crate::reservations::reserve))
        .route(
            "/v1/reservations/{id}/settle",
            post(crate::reservations::settle),
        )
        .route(
            "/v1/reservations/{id}/renew",
            post(crate::reservations::renew),
        )
        .route(
            "/v1/reservations/{id}",
            axum::routing::delete(crate::reservations::release),
        )
        .route("/healthz", get(crate::probes::healthz))
        .fallback(|| async { crate::respond::unknown_url().into_response() })
        .with_state(gw)
}

/// The metrics listener's routes: `/metrics`, `/readyz` and `/healthz`, without a token.
pub fn metrics_router(gw: Shared) -> Router {
    let _ = crate::telemetry::handle();
    Router::new()
        .route("/metrics", get(crate::scrape::metrics))
        .route("/readyz", get(crate::probes::readyz))
        .route("/healthz", get(crate::probes::healthz))
        .with_state(gw)
}

/// `GET /v1/models`: the models this key may use.
pub async fn models(State(gw): State<Shared>, req: Request<Body>) -> Response {
    let cfg = gw.config();
    let key = match crate::path::intake::authenticate(&cfg, &gw.keys, req.headers()) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    let data: Vec<serde_json::Value> = cfg
        .models
        .iter()
        .filter(|(m, _)| key.models.as_ref().is_none_or(|ms| ms.contains(m)))
        .map(|(m, u)| serde_json::json!({"id": m, "object": "model", "owned_by": cfg.upstreams[*u].name}))
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

/// Serves `config` on `listener` until `shutdown` completes.
pub async fn serve(
    config: GatewayConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let store = start_store(&config).await?;
    let records = config
        .records
        .as_deref()
        .map(crate::records::RecordSink::open)
        .transpose()?;
    let mut gw = Gateway::new(config, store);
    if let Some(sink) = records {
        gw = gw.with_records(sink);
    }
    serve_with(gw, listener, shutdown).await
}

/// What a gateway does once before its first request (again only if it was not done): an
/// empty store decided on (new or lost), not served; a memory store's books and issued keys
/// restored from the spend ledger. [`serve_bound`] does it; a caller that prints where it
/// serves calls it first, so that nothing is announced before it can be served.
pub async fn prepare(gw: &Gateway) -> std::io::Result<()> {
    if gw.prepared.swap(true, std::sync::atomic::Ordering::AcqRel) {
        return Ok(());
    }
    crate::watch::start(gw).await?;
    if let Err(e) = crate::keys::load(gw).await {
        if !tollgate_core::Keeper::is_shared(&gw.store) {
            // The memory store's issued keys live only in the ledger: serving without them would
            // refuse keys that work, and forget them at the next write.
            return Err(std::io::Error::other(format!("the issued keys: {e}")));
        }
        tracing::warn!(cause = %e, "the issued keys could not be read at start: read again every second");
    }
    Ok(())
}

/// Listeners the caller has bound already, served in place of the configuration's
/// `[admin] listen` and `[metrics] listen`: for an embedder that picks its own ports, and for
/// tests, which would otherwise release a free port and bind it again, a moment in which
/// another process may take it.
#[derive(Debug, Default)]
pub struct Bound {
    /// The admin listener (served with `[admin]`'s token, so only with an `[admin]` section).
    pub admin: Option<TcpListener>,
    /// The metrics listener (`/metrics`, `/readyz`).
    pub metrics: Option<TcpListener>,
}

/// Serves a gateway built by the caller (e.g. with a config path for reloads): also starts the
/// admin listener when configured, and reloads the configuration on SIGHUP.
pub async fn serve_with(
    gw: Gateway,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    serve_bound(gw, listener, Bound::default(), shutdown).await
}

/// [`serve_with`], on the listeners in `bound` where it has them, binding the others the
/// configuration names.
pub async fn serve_bound(
    gw: impl Into<Shared>,
    listener: TcpListener,
    bound: Bound,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let gw: Shared = gw.into();
    // Before any listener answers, the admin API's included.
    prepare(&gw).await?;
    let cfg = gw.config();
    let admin = match (bound.admin, &cfg.admin) {
        (Some(l), Some(admin)) => Some((l, admin)),
        (Some(_), None) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "an admin listener needs an [admin] section (its token)",
            ));
        }
        (None, Some(admin)) => Some((TcpListener::bind(admin.listen).await?, admin)),
        (None, None) => None,
    };
    if let Some((l, admin)) = admin {
        let app = crate::admin::router(gw.clone(), admin.clone());
        tokio::spawn(crate::conn::accept(
            l,
            app,
            crate::conn::Limits::private(&cfg),
            std::future::pending(),
        ));
    }

    #[cfg(unix)]
    {
        let gw = gw.clone();
        if let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            tokio::spawn(async move {
                while hup.recv().await.is_some() {
                    // A bad file is refused and the old configuration stays.
                    let _ = gw.reload();
                }
            });
        }
    }
    serve_shared(gw, listener, bound.metrics, shutdown).await
}

/// Serves an existing gateway until `shutdown` completes, then drains: no new connection is
/// accepted, `/readyz` answers 503, every connection finishes the requests it is serving and
/// closes, and those still running after the configured drain timeout are cut off and released
/// (charged what they streamed). Returns once every request of this process has ended in the
/// store, or a few seconds after the cut-off if the store does not answer.
pub async fn serve_gateway(
    gw: Shared,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    serve_shared(gw, listener, None, shutdown).await
}

/// [`serve_gateway`], on `metrics` as the metrics listener when given.
async fn serve_shared(
    gw: Shared,
    listener: TcpListener,
    metrics: Option<TcpListener>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    prepare(&gw).await?;
    if let Some(otlp) = &gw.config().otlp {
        // A collector that is down is retried by the exporter; a configuration it cannot use
        // is logged once, and the gateway serves without the export.
        if let Err(e) = crate::otel::start(otlp) {
            tracing::error!(error = %e, "OpenTelemetry export not started");
        }
    }
    crate::keys::spawn_refresh(gw.clone());
    let app = router(gw.clone());
    crate::scrape::spawn_budget_refresh(gw.clone());
    gw.alerts.spawn();
    let maintenance = gw.store.spawn_slice_maintenance();
    crate::watch::spawn(gw.clone());
    if let Some(b) = &gw.books {
        b.spawn_writer(gw.store.clone());
    }
    let cfg = gw.config();
    let metrics = match (metrics, cfg.metrics.listen) {
        (Some(l), _) => Some(l),
        (None, Some(listen)) => Some(TcpListener::bind(listen).await?),
        (None, None) => None,
    };
    if let Some(l) = metrics {
        tokio::spawn(crate::conn::accept(
            l,
            metrics_router(gw.clone()),
            crate::conn::Limits::private(&cfg),
            std::future::pending(),
        ));
    }
    let limits = crate::conn::Limits::public(&cfg);
    let mut connections = crate::conn::accept(listener, app, limits, shutdown).await;
    gw.start_draining();
    connections.drain(cfg.drain_timeout).await;
    gw.cut_off_answers();
    // Open reservations stay in the store: another instance may end them, or their leases
    // expire and the policy charges them.
    gw.reservations.let_go_all();
    let deadline = tokio::time::Instant::now() + RELEASE_GRACE;
    while crate::ticket::open_tickets() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // The slices are tended no more (a process that goes on without this gateway must not keep
    // calling its store), and what this instance holds beyond its ended requests goes back.
    if let Some(m) = maintenance {
        m.abort();
        let _ = m.await;
    }
    gw.store.return_slices().await;
    crate::otel::shutdown().await;
    // The endings of the drained requests, written before the process ends.
    if let Some(b) = &gw.books {
        if !b.ledger.flush(RELEASE_GRACE).await {
            b.spool();
        }
    }
    Ok(())
}

/// How long a shutdown waits, after the drain, for the releases of cut-off requests to reach
/// the store; past it, their leases expire and the policy charges their reservations.
const RELEASE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
