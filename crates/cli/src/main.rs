//! The `tollgate` binary: a thin shell over the library crates.

mod admin;
mod cli;
mod count;
mod demo;
mod keys;
mod prices;
mod spend;
mod stress;
mod whatif;

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use tollgate_core::replay::{self, Fixture};
use tollgate_core::{ManualClock, MemoryStore, Policy};
use tollgate_redis::{RedisConfig, RedisStore};

use crate::cli::{Cli, Command, Format};

// A gateway keeps every finished request id for the retention (up to a million): long-lived
// small allocations among the short-lived ones of each request, which fragment glibc's heap
// until the CPU per request grows with them. jemalloc does not degrade that way; mimalloc did
// not either, but stalled for hundreds of milliseconds.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    // One worker thread per core unless TOKIO_WORKER_THREADS says otherwise (tokio reads it).
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(Cli::parse())) {
        Ok(code) => code,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::StressStore(args) => stress::run(args).await,
        Command::HashKey { key } => {
            writeln!(std::io::stdout(), "{}", tollgate_gateway::hash_key(&key))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve {
            config: None,
            demo: false,
            ..
        } => anyhow::bail!(
            "give --config FILE, or --demo to try the gateway at once with a built-in \
             configuration and a simulated upstream"
        ),
        Command::Serve {
            config,
            demo: _,
            listen,
        } => serve(config, listen).await,
        Command::Replay {
            fixture,
            format,
            store,
        } => replay_fixture(&fixture, format, &store).await,
        Command::Count {
            model,
            request,
            format,
            tokenizer,
        } => {
            let body = match request {
                Some(p) => std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?,
                None => {
                    let mut b = Vec::new();
                    std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)?;
                    b
                }
            };
            let count = count::count(&body, model.as_deref(), format, tokenizer.as_deref())?;
            writeln!(std::io::stdout(), "{}", serde_json::to_string(&count)?)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Prices {
            model,
            policy,
            command,
        } => {
            let mut out = std::io::stdout().lock();
            match (command, model) {
                (Some(cli::PricesCommand::Diff { a, b }), _) => prices::diff(&a, &b, &mut out)?,
                (None, Some(m)) => prices::show(&m, policy.as_deref(), &mut out)?,
                (None, None) => anyhow::bail!("give a model: tollgate prices MODEL"),
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { file, config } => match file.or(config) {
            Some(f) => check(&f),
            None => anyhow::bail!("give the file to check: tollgate check FILE"),
        },
        Command::Admin(args) => admin::run(args).await,
        Command::Whatif {
            records,
            policy,
            format,
        } => whatif::run(&records, &policy, format).await,
        Command::Spend {
            ledger,
            ledger_env,
            by,
            from,
            to,
            format,
        } => spend::run(ledger, ledger_env, by, &from, &to, format).await,
    }
}

/// `tollgate serve`: the gateway of `config`, or the demo (a simulator upstream) without one.
async fn serve(
    config: Option<std::path::PathBuf>,
    listen: Option<std::net::SocketAddr>,
) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout();
    let (text, sim) = match &config {
        Some(path) => (
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
            None,
        ),
        None => {
            let sim = tollgate_sim::Sim::start(tollgate_sim::SimConfig::default()).await?;
            let (token, file) = demo::admin_token().context("writing the demo's admin token")?;
            (demo::config(&sim.base_url(), &file), Some((sim, token)))
        }
    };
    let mut cfg = tollgate_gateway::GatewayConfig::from_toml(&text)?;
    install_log(&cfg.log)?;
    if let Some(l) = listen {
        cfg.listen = l;
    }
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("listening on {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let bound = bind_side_listeners(&cfg).await?;
    let (store, warnings) = tollgate_gateway::start_store_with_warnings(&cfg).await?;
    for w in warnings {
        tracing::warn!("{w}");
    }
    let records = cfg.records.clone();
    let books = tollgate_gateway::open_books(&cfg)
        .await
        .context("opening the spend ledger ([ledger])")?;
    let mut gw = tollgate_gateway::Gateway::new(cfg, store).with_books(books);
    if let Some(path) = config {
        gw = gw.with_config_path(path);
    }
    if let Some(r) = records {
        gw = gw.with_records(tollgate_gateway::records::RecordSink::open(&r)?);
    }
    // Nothing is announced before it can be served: the store decided on, books restored.
    tollgate_gateway::prepare(&gw).await?;
    // Once the keys issued at run time are loaded, which rules may meet.
    for w in gw.config_warnings() {
        tracing::warn!("{w}");
    }
    let admin = bound.admin.as_ref().map(|l| l.local_addr()).transpose()?;
    match (&sim, admin) {
        (Some((sim, token)), Some(admin)) => write!(
            out,
            "{}",
            demo::banner(addr, &sim.base_url(), (admin, token))
        )?,
        _ => writeln!(out, "tollgate: serving on http://{addr}")?,
    }
    for (what, l) in [("admin", &bound.admin), ("metrics", &bound.metrics)] {
        if let Some(l) = l {
            writeln!(out, "tollgate: {what} on http://{}", l.local_addr()?)?;
        }
    }
    out.flush()?;
    tollgate_gateway::serve_bound(gw, listener, bound, shutdown_signal()).await?;
    Ok(ExitCode::SUCCESS)
}

/// Installs the run-time log on standard error: the configuration's format, and `RUST_LOG`'s
/// filter when it is set, else the configuration's.
fn install_log(cfg: &tollgate_gateway::config::LogConfig) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(f) if !f.trim().is_empty() => {
            EnvFilter::try_new(&f).with_context(|| format!("RUST_LOG {f:?}"))?
        }
        _ => EnvFilter::try_new(&cfg.filter)
            .with_context(|| format!("log.filter {:?}", cfg.filter))?,
    };
    let log = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second installation (the process serves once) is ignored.
    let _ = if cfg.json {
        log.json().with_current_span(false).try_init()
    } else {
        log.with_ansi(std::io::stderr().is_terminal()).try_init()
    };
    Ok(())
}

/// The admin and metrics listeners the configuration names, bound before serving so that their
/// addresses can be printed (a port 0 in the configuration takes a free one).
async fn bind_side_listeners(
    cfg: &tollgate_gateway::GatewayConfig,
) -> anyhow::Result<tollgate_gateway::Bound> {
    let bind = |addr: std::net::SocketAddr, what: &'static str| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("{what} listening on {addr}"))
    };
    let admin = match &cfg.admin {
        Some(a) => Some(bind(a.listen, "admin").await?),
        None => None,
    };
    let metrics = match cfg.metrics.listen {
        Some(m) => Some(bind(m, "metrics").await?),
        None => None,
    };
    Ok(tollgate_gateway::Bound { admin, metrics })
}

/// SIGINT or SIGTERM (what container runtimes and systemd send): the drain starts.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// `tollgate replay`: the fixture's cases on the memory store or a Redis; 1 on a mismatch.
async fn replay_fixture(
    fixture: &std::path::Path,
    format: Format,
    store: &str,
) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(fixture)
        .with_context(|| format!("reading {}", fixture.display()))?;
    let fx = Fixture::from_toml(&text).with_context(|| format!("in {}", fixture.display()))?;
    let (report, mismatches) = if store == "memory" {
        replay::replay(&fx, |_, _, clock: ManualClock| {
            MemoryStore::with_clock(clock)
        })
        .await?
    } else {
        // Each case runs on a fresh prefix of its own: new by its word.
        let mut cfg = RedisConfig::new(store);
        cfg.initialise_on_first_use = true;
        let base = RedisStore::connect(cfg)
            .await
            .with_context(|| format!("connecting to {store}"))?;
        base.ping()
            .await
            .with_context(|| format!("connecting to {store}"))?;
        // A fresh prefix per run and case: each case starts from a clean state.
        let run_id = format!(
            "tollgate-replay:{}:{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        );
        replay::replay(&fx, |path, case, clock: ManualClock| {
            base.clone()
                .with_prefix(format!("{run_id}:{path}:{case}"))
                .with_clock(Arc::new(clock))
        })
        .await?
    };
    let mut out = std::io::stdout();
    match format {
        Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?,
        Format::Table => write!(out, "{}", replay::table(&report))?,
    }
    if mismatches.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    let mut err = std::io::stderr();
    for m in &mismatches {
        writeln!(
            err,
            "mismatch: path {} case {} request {}: expected {}, got {}",
            m.path, m.case, m.request, m.expected, m.actual
        )?;
    }
    Ok(ExitCode::from(1))
}

/// `tollgate check`: validates a replay fixture, a policy or a gateway configuration.
fn check(config: &std::path::Path) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout();
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let context = || format!("in {}", config.display());
    // A replay fixture has cases; a gateway configuration has upstreams, or its policy under
    // [policy]; a policy file has none of these (its scopes are at the top).
    let table: toml::Table = toml::from_str(&text).with_context(context)?;
    let kind = file_kind(&table).with_context(context)?;
    if kind == "fixture" {
        let fixture = tollgate_core::replay::Fixture::from_toml(&text).with_context(context)?;
        writeln!(
            out,
            "ok: replay fixture with {} cases, policy {} with {} scopes",
            fixture.cases.len(),
            fixture.policy.version,
            fixture.policy.scopes.len()
        )?;
    } else if kind == "policy" {
        let policy = Policy::from_toml(&text).with_context(context)?;
        writeln!(
            out,
            "ok: policy {} with {} scopes",
            policy.version,
            policy.scopes.len()
        )?;
    } else {
        let cfg = tollgate_gateway::GatewayConfig::from_toml(&text).with_context(context)?;
        for w in cfg.warnings() {
            writeln!(std::io::stderr(), "warning: {w}")?;
        }
        writeln!(
            out,
            "ok: gateway configuration with {} upstreams, {} keys, policy {} with {} scopes",
            cfg.upstreams.len(),
            cfg.keys.len(),
            cfg.policy.version,
            cfg.policy.scopes.len()
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// What a TOML file is, by what it holds: a replay fixture (`cases`), a gateway configuration
/// (any of its sections), or a bare policy (only a policy's keys).
fn file_kind(table: &toml::Table) -> anyhow::Result<&'static str> {
    const GATEWAY: &[&str] = &[
        "server",
        "store",
        "upstreams",
        "keys",
        "policy",
        "queue",
        "records",
        "admin",
        "ledger",
        "responses",
        "upstream_tools",
        "tokenizers",
        "remote_content",
        "anthropic",
        "operations",
        "idempotency",
        "metrics",
        "log",
        "kill",
        "alerts",
    ];
    const POLICY: &[&str] = &[
        "version",
        "default_max_output_tokens",
        "reservation_ttl",
        "expired_reservation_charge",
        "fail_open",
        "prices",
        "scopes",
    ];
    if table.contains_key("cases") {
        return Ok("fixture");
    }
    if table.keys().any(|k| GATEWAY.contains(&k.as_str())) {
        return Ok("gateway");
    }
    match table.keys().find(|k| !POLICY.contains(&k.as_str())) {
        None => Ok("policy"),
        Some(k) => anyhow::bail!(
            "cannot tell what this file is: {k:?} is neither a gateway section ({}) nor a \
             policy key ({}), and there are no replay `cases`",
            GATEWAY.join(", "),
            POLICY.join(", ")
        ),
    }
}
