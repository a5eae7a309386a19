//! The tower layer without sockets (`Router::oneshot`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::Extension;
use axum::routing::post;
use http::Request;
use http_body_util::BodyExt;
use tollgate_core::{Dimension, Identity, MemoryStore, Period, Policy, RequestFacts, Store, Usage};
use tollgate_gateway::admission::{AdmissionHandle, AdmissionLayer};
use tollgate_gateway::store::AnyStore;
use tower::ServiceExt;

fn app(store: AnyStore) -> Router {
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 2, window = "1m" }
        output_tokens = { max = 100, mode = "clamp" }
        budget = { tokens = 1000, period = "day" }
        "#,
    )
    .unwrap();
    let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let layer = AdmissionLayer::new(policy, store, move |parts, body| {
        Ok(RequestFacts {
            request_id: format!("r{}", n.fetch_add(1, std::sync::atomic::Ordering::SeqCst)),
            identity: Identity::default()
                .with(Dimension::User, parts.headers["x-user"].to_str().unwrap()),
            input_tokens: body.len() as u64,
            max_output_tokens: Some(500),
            ..RequestFacts::default()
        })
    })
    .max_body_bytes(64);
    Router::new()
        .route(
            "/settles",
            post(|Extension(h): Extension<AdmissionHandle>| async move {
                h.settle(Usage {
                    input_tokens: 5,
                    cached_input_tokens: 0,
                    output_tokens: 7,
                    ..Usage::default()
                })
                .await;
                h.max_output_tokens.to_string()
            }),
        )
        .route("/forgets", post(|| async { "no settlement" }))
        .layer(layer)
}

async fn call(app: &Router, path: &str, body: &'static str) -> (u16, String) {
    let req = Request::post(path)
        .header("x-user", "alice")
        .body(Body::from(body))
        .unwrap();
    let r = app.clone().oneshot(req).await.unwrap();
    let status = r.status().as_u16();
    (
        status,
        String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).into_owned(),
    )
}

#[tokio::test]
async fn the_layer_admits_settles_refuses_and_releases() {
    let store = AnyStore::Memory(Arc::new(MemoryStore::new()));
    let app = app(store.clone());
    // Admitted with the clamped cap; settled by the handler: 12 tokens.
    assert_eq!(
        call(&app, "/settles", "hello").await,
        (200, "100".to_owned())
    );
    // Not settled by the handler: released when the handle is dropped.
    assert_eq!(call(&app, "/forgets", "hello").await.0, 200);
    // Third attempt in the minute: refused with the gateway's 429.
    let (status, body) = call(&app, "/settles", "hello").await;
    assert_eq!(status, 429);
    assert!(body.contains("request_rate_limit"));
    // Too large: 413 before anything is counted.
    assert_eq!(
        call(
            &app,
            "/settles",
            "0123456789012345678901234567890123456789012345678901234567890123456789"
        )
        .await
        .0,
        413
    );
    let u = tollgate_testkit::wait::at_most(
        std::time::Duration::from_secs(2),
        async || {
            let day = Some(Period::Fixed(86_400_000));
            store.usage("user|user:alice", day).await.unwrap()
        },
        |u| u.reserved == 0,
    )
    .await;
    // 12 settled; the forgotten one released with the policy's charge (full: 5 + 100).
    assert_eq!((u.settled, u.reserved), (12 + 105, 0));
}
