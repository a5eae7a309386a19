//! A Rust service that embeds the controls with `AdmissionLayer` instead of running the proxy.
//!
//! `cargo run -p tollgate-gateway --example embedded`, then
//! `curl -s localhost:3000/generate -H 'x-user: alice' -d 'tell me a story'` a few times:
//! the third call within a minute gets a 429 with `Retry-After`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::result_large_err
)]

use std::sync::Arc;

use axum::Router;
use axum::extract::Extension;
use axum::routing::post;
use tollgate_core::{Dimension, Identity, MemoryStore, Policy, RequestFacts, Usage};
use tollgate_gateway::admission::{AdmissionHandle, AdmissionLayer};
use tollgate_gateway::store::AnyStore;
use tollgate_tokens::TokenCounter;

async fn generate(Extension(admission): Extension<AdmissionHandle>, prompt: String) -> String {
    // The expensive work would run here, capped at the granted output.
    let answer = format!(
        "(up to {} tokens about: {prompt})",
        admission.max_output_tokens
    );
    let (input, _) = TokenCounter::default().count_text("gpt-4o", &prompt, None);
    admission
        .settle(Usage {
            input_tokens: input,
            cached_input_tokens: 0,
            output_tokens: 12,
            ..Usage::default()
        })
        .await;
    answer
}

#[tokio::main]
async fn main() {
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 2, window = "1m" }
        output_tokens = { max = 256, mode = "clamp" }
        budget = { tokens = 5000, period = "day" }
        "#,
    )
    .unwrap();
    let store = AnyStore::Memory(Arc::new(MemoryStore::new()));
    let seq = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let layer = AdmissionLayer::new(policy, store, move |parts, body| {
        let user = parts
            .headers
            .get("x-user")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("anonymous");
        let text = String::from_utf8_lossy(body);
        Ok(RequestFacts {
            request_id: format!(
                "req-{}",
                seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
            identity: Identity::default().with(Dimension::User, user),
            input_tokens: TokenCounter::default()
                .count_text("gpt-4o", &text, Some(100_000))
                .0,
            max_output_tokens: None,
            ..RequestFacts::default()
        })
    });
    let app = Router::new()
        .route("/generate", post(generate))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000")
        .await
        .unwrap();
    println!("listening on http://127.0.0.1:3000");
    axum::serve(listener, app).await.unwrap();
}
