//! What the gateway's end-to-end tests share.

#![allow(clippy::unwrap_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;

use tollgate_gateway::config::GatewayConfig;
use tollgate_gateway::proxy::Gateway;
use tollgate_gateway::store::AnyStore;

/// Starts a gateway for the configuration `text` on a free loopback port, with its store and
/// its decision records if the configuration asks for them; its first upstream gets the API key
/// `upstream_key`. It serves until the test ends.
pub async fn spawn_gateway(text: &str, upstream_key: &str) -> (SocketAddr, AnyStore) {
    let mut config = GatewayConfig::from_toml(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    config.upstreams[0].api_key = Some(upstream_key.into());
    let store = tollgate_gateway::start_store(&config).await.unwrap();
    let records = config.records.clone();
    let mut gw = Gateway::new(config, store.clone());
    if let Some(path) = records {
        gw = gw.with_records(tollgate_gateway::records::RecordSink::open(&path).unwrap());
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tollgate_gateway::server::serve_gateway(
        Arc::new(gw),
        listener,
        std::future::pending(),
    ));
    (addr, store)
}
