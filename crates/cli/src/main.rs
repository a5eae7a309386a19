//! The `tollgate` binary: a thin shell over the library crates.

mod cli;
mod count;

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use tollgate_core::replay::{self, Fixture};
use tollgate_core::{ManualClock, MemoryStore, Policy};

use crate::cli::{Cli, Command, Format};

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    match cli.command {
        Command::Replay { fixture, format } => {
            let text = std::fs::read_to_string(&fixture)
                .with_context(|| format!("reading {}", fixture.display()))?;
            let fx =
                Fixture::from_toml(&text).with_context(|| format!("in {}", fixture.display()))?;
            let fut = replay::replay(&fx, |_, _, clock: ManualClock| {
                MemoryStore::with_clock(clock)
            });
            let (report, mismatches) = block_on_ready(fut)??;
            match format {
                Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?,
                Format::Table => write!(out, "{}", replay::table(&report))?,
            }
            if mismatches.is_empty() {
                Ok(ExitCode::SUCCESS)
            } else {
                let mut err = std::io::stderr().lock();
                for m in &mismatches {
                    writeln!(
                        err,
                        "mismatch: path {} case {} request {}: expected {}, got {}",
                        m.path, m.case, m.request, m.expected, m.actual
                    )?;
                }
                Ok(ExitCode::from(1))
            }
        }
        Command::Count {
            model,
            request,
            format,
        } => {
            let body = match request {
                Some(p) => std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?,
                None => {
                    let mut b = Vec::new();
                    std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)?;
                    b
                }
            };
            let count = count::count(&body, model.as_deref(), format)?;
            writeln!(out, "{}", serde_json::to_string(&count)?)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { config } => {
            let text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            let policy =
                Policy::from_toml(&text).with_context(|| format!("in {}", config.display()))?;
            writeln!(
                out,
                "ok: policy {} with {} scopes",
                policy.version,
                policy.scopes.len()
            )?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Drives a future whose store answers at once (the memory store); a store that would block
/// belongs on a runtime.
fn block_on_ready<F: std::future::Future>(fut: F) -> anyhow::Result<F::Output> {
    use std::task::{Context as TaskContext, Poll, Waker};
    let mut fut = std::pin::pin!(fut);
    let mut cx = TaskContext::from_waker(Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(v) => Ok(v),
        Poll::Pending => anyhow::bail!("the store did not answer synchronously"),
    }
}
