//! The listener: a connection limit, header-read timeouts, and the routes.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tollgate_core::MemoryStore;
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_tokens::Format;
use tower::ServiceExt;

use crate::config::{GatewayConfig, StoreConfig};
use crate::proxy::{self, Gateway, Shared};
use crate::respond::ApiError;
use crate::store::AnyStore;

/// Opens the configured store.
pub async fn start_store(config: &GatewayConfig) -> std::io::Result<AnyStore> {
    Ok(match &config.store {
        StoreConfig::Memory { retention } => AnyStore::Memory(Arc::new(
            MemoryStore::new()
                .retention_ms(u64::try_from(retention.as_millis()).unwrap_or(u64::MAX)),
        )),
        StoreConfig::Redis {
            url,
            prefix,
            call_timeout,
            cluster,
            shards,
            retention,
        } => {
            let mut c = RedisConfig::new(url.as_str());
            c.prefix = prefix.clone();
            c.call_timeout = *call_timeout;
            c.cluster = cluster.clone();
            c.shards = *shards;
            c.retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
            AnyStore::Redis(
                RedisStore::connect(c)
                    .await
                    .map_err(std::io::Error::other)?,
            )
        }
    })
}

/// The routes over a gateway.
pub fn router(gw: Shared) -> Router {
    // Install the recorder before the first request records anything.
    let _ = crate::telemetry::handle();
    Router::new()
        .route(
            "/v1/chat/completions",
            post(|s, r| proxy::handle(s, Format::ChatCompletions, "/v1/chat/completions", r)),
        )
        .route(
            "/v1/completions",
            post(|s, r| proxy::handle(s, Format::Completions, "/v1/completions", r)),
        )
        .route(
            "/v1/embeddings",
            post(|s, r| proxy::handle(s, Format::Embeddings, "/v1/embeddings", r)),
        )
        .route(
            "/v1/responses",
            post(|s, r| proxy::handle(s, Format::Responses, "/v1/responses", r)),
        )
        .route(
            "/v1/messages",
            post(|s, r| proxy::handle(s, Format::AnthropicMessages, "/v1/messages", r)),
        )
        .route("/v1/models", get(proxy::models))
        .route("/healthz", get(healthz))
        .route("/metrics", get(proxy::metrics))
        .route("/readyz", get(readyz))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "unknown_url",
                "Unknown URL.",
            )
            .into_response()
        })
        .with_state(gw)
}

/// `GET /healthz`: the process answers.
pub(crate) async fn healthz() -> &'static str {
    "ok"
}

/// `GET /readyz`: 200 while the store answers and no shutdown has begun, 503 otherwise.
pub(crate) async fn readyz(axum::extract::State(gw): axum::extract::State<Shared>) -> Response {
    if gw.is_draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response();
    }
    match gw.store.ping().await {
        Ok(()) => (StatusCode::OK, "ready").into_response(),
        Err(e) => crate::respond::store_unavailable()
            .param(e.to_string())
            .into_response(),
    }
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

/// Serves a gateway built by the caller (e.g. with a config path for reloads): also starts the
/// admin listener when configured, and reloads the configuration on SIGHUP.
pub async fn serve_with(
    gw: Gateway,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let gw = Arc::new(gw);
    let cfg = gw.config();
    if let Some(admin) = &cfg.admin {
        let l = TcpListener::bind(admin.listen).await?;
        let app = crate::admin::router(gw.clone(), admin.token.clone());
        tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
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
    serve_gateway(gw, listener, shutdown).await
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
    let app = router(gw.clone());
    let limit = Arc::new(Semaphore::new(gw.config().max_connections));
    let header_timeout = gw.config().header_timeout;
    let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // Ended connections leave the set.
        while connections.try_join_next().is_some() {}
        let (stream, peer): (_, SocketAddr) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(_) => continue,
            },
            () = &mut shutdown => break,
        };
        // Over the connection limit: close at once rather than queue without bound.
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let mut drain = drain_rx.clone();
        connections.spawn(async move {
            let svc = hyper::service::service_fn(move |mut req: Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                app.clone().oneshot(req.map(Body::new))
            });
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let mut conn = std::pin::pin!(builder.serve_connection(TokioIo::new(stream), svc));
            let draining = tokio::select! {
                _ = conn.as_mut() => false,
                r = drain.wait_for(|d| *d) => r.is_ok(),
            };
            if draining {
                // Finish the request under way (a stream to its end), then close.
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
            drop(permit);
        });
    }
    drop(listener);
    gw.start_draining();
    let _ = drain_tx.send(true);
    let drained = tokio::time::timeout(gw.config().drain_timeout, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        // Cut off: each request's ticket is dropped with its connection, which releases it in
        // the store, charging the output streamed so far.
        connections.abort_all();
        while connections.join_next().await.is_some() {}
    }
    let deadline = tokio::time::Instant::now() + RELEASE_GRACE;
    while crate::store::open_tickets() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    Ok(())
}

/// How long a shutdown waits, after the drain, for the releases of cut-off requests to reach
/// the store; past it, their leases expire and the policy charges their reservations.
const RELEASE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
