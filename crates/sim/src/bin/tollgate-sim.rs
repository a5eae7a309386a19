//! `tollgate-sim [--listen 127.0.0.1:9000] [--latency-ms 5] [--token-delay-ms 1]
//! [--output-tokens 16] [--api-key KEY]`: the upstream simulator as a process, for demos and
//! load benchmarks. `GET /sim/stats` reports what it observed.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

use std::time::Duration;

use tollgate_sim::{Sim, SimConfig};

#[tokio::main]
async fn main() {
    let mut cfg = SimConfig::default();
    let mut listen = "127.0.0.1:9000".to_owned();
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let v = pair.get(1).cloned().unwrap_or_default();
        match pair[0].as_str() {
            "--listen" => listen = v,
            "--latency-ms" => cfg.latency = Duration::from_millis(v.parse().expect("milliseconds")),
            "--token-delay-ms" => {
                cfg.token_delay = Duration::from_millis(v.parse().expect("milliseconds"))
            }
            "--output-tokens" => cfg.output_tokens = v.parse().expect("a count"),
            "--api-key" => cfg.api_key = Some(v),
            other => panic!("unknown option {other}"),
        }
    }
    let sim = Sim::start_on(listen.parse().expect("an address"), cfg)
        .await
        .expect("listen");
    println!("tollgate-sim listening on {}", sim.base_url());
    tokio::signal::ctrl_c().await.expect("signal");
}
