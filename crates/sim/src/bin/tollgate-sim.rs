//! `tollgate-sim [--listen 127.0.0.1:9000] [--latency-ms 5] [--token-delay-ms 1]
//! [--output-tokens 16] [--api-key KEY]`: the upstream simulator as a process, for demos and
//! load benchmarks. `GET /sim/stats` reports what it observed.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tollgate_sim::{Sim, SimConfig};

/// An OpenAI- and Anthropic-compatible upstream simulator, on loopback.
#[derive(Debug, Parser)]
#[command(name = "tollgate-sim", version)]
struct Args {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Wait before the first byte, in milliseconds (0: none).
    #[arg(long, default_value_t = 5)]
    latency_ms: u64,
    /// Wait per produced token, in milliseconds (0: none).
    #[arg(long, default_value_t = 1)]
    token_delay_ms: u64,
    /// Tokens produced when a request does not cap them lower.
    #[arg(long, default_value_t = 16)]
    output_tokens: u64,
    /// The API key to require (any when not given).
    #[arg(long)]
    api_key: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let a = Args::parse();
    let cfg = SimConfig {
        latency: Duration::from_millis(a.latency_ms),
        token_delay: Duration::from_millis(a.token_delay_ms),
        output_tokens: a.output_tokens,
        api_key: a.api_key,
        ..SimConfig::default()
    };
    let sim = match Sim::start_on(a.listen, cfg).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tollgate-sim: cannot listen on {}: {e}", a.listen);
            return ExitCode::FAILURE;
        }
    };
    println!("tollgate-sim listening on {}", sim.base_url());
    match tokio::signal::ctrl_c().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate-sim: {e}");
            ExitCode::FAILURE
        }
    }
}
