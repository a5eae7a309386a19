//! `tollgate stress-store`: many concurrent tasks admitting, settling, releasing and abandoning
//! requests on a Redis store, writing every call with its start and end time (wall clock, ns)
//! as JSON lines. Tests run several of these processes at once and check the histories.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use serde_json::json;
use tollgate_core::{
    Decision, Dimension, Finish, Identity, Policy, RequestFacts, Store, Usage, plan,
};
use tollgate_redis::{RedisConfig, RedisStore};

/// Arguments of `stress-store`.
#[derive(Debug, clap::Args)]
pub struct StressArgs {
    /// Redis URL (unused with `--cluster`).
    #[arg(long)]
    pub redis: String,
    /// Redis Cluster seed URLs, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub cluster: Vec<String>,
    /// Shards of the key space (see `RedisConfig::shards`).
    #[arg(long, default_value_t = 1)]
    pub shards: u16,
    /// Key prefix shared by all workers of one run.
    #[arg(long)]
    pub prefix: String,
    /// Policy file.
    #[arg(long)]
    pub policy: PathBuf,
    /// This worker's name (request ids start with it).
    #[arg(long)]
    pub worker: String,
    /// Where to write the history (JSON lines).
    #[arg(long)]
    pub history: PathBuf,
    /// Concurrent tasks.
    #[arg(long, default_value_t = 200)]
    pub tasks: u64,
    /// Requests per task.
    #[arg(long, default_value_t = 10)]
    pub requests: u64,
    /// Longest time an admitted request is held before it ends.
    #[arg(long, default_value_t = 20)]
    pub hold_ms: u64,
    /// Abandon one admitted request in n, at random (never settle it: it must expire); 0 = never.
    #[arg(long, default_value_t = 0)]
    pub abandon_every: u64,
    /// Admit, then hold everything (print `holding` and wait up to 60 s) to be killed.
    #[arg(long)]
    pub hang: bool,
    /// Users to spread requests over.
    #[arg(long, default_value_t = 4)]
    pub users: u64,
    /// Model name (priced in the policy for money budgets).
    #[arg(long, default_value = "gpt-4o")]
    pub model: String,
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// A small deterministic generator per task (xorshift).
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

pub async fn run(args: StressArgs) -> anyhow::Result<std::process::ExitCode> {
    let text = std::fs::read_to_string(&args.policy).context("reading the policy")?;
    let policy = Arc::new(Policy::from_toml(&text)?);
    let mut cfg = RedisConfig::new(args.redis.as_str());
    cfg.prefix = args.prefix.clone();
    cfg.call_timeout = Duration::from_secs(2);
    if !args.cluster.is_empty() {
        cfg.cluster = Some(args.cluster.clone());
    }
    cfg.shards = args.shards;
    // A load run's prefix is its own: new by its word.
    cfg.initialise_on_first_use = true;
    let store = RedisStore::connect(cfg).await?;
    let args = Arc::new(args);
    let mut handles = Vec::new();
    for task in 0..args.tasks {
        let (store, policy, args) = (store.clone(), policy.clone(), args.clone());
        handles.push(tokio::spawn(async move {
            task_loop(task, &store, &policy, &args).await
        }));
    }
    let mut lines = Vec::new();
    for h in handles {
        lines.extend(h.await.context("a task panicked")?);
    }
    std::fs::write(&args.history, lines.join("\n") + "\n").context("writing the history")?;
    if args.hang {
        let mut out = std::io::stdout();
        std::io::Write::write_all(&mut out, b"holding\n")?;
        std::io::Write::flush(&mut out)?;
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    Ok(std::process::ExitCode::SUCCESS)
}

async fn task_loop(
    task: u64,
    store: &RedisStore,
    policy: &Policy,
    args: &StressArgs,
) -> Vec<String> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (task + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
    let mut lines = Vec::new();
    for i in 0..args.requests {
        let id = format!("{}-{task}-{i}", args.worker);
        let input = 10 + rng.below(50);
        let max = 20 + rng.below(60);
        let facts = RequestFacts {
            request_id: id.clone(),
            identity: Identity::default()
                .with(Dimension::User, format!("u{}", rng.below(args.users)))
                .with(Dimension::Model, args.model.clone()),
            input_tokens: input,
            max_output_tokens: Some(max),
            ..RequestFacts::default()
        };
        let Ok(p) = plan(policy, &facts) else {
            lines.push(json!({"op": "plan_error", "id": id}).to_string());
            continue;
        };
        let t0 = now_ns();
        let d = store.admit(&p).await;
        let t1 = now_ns();
        let amounts: Vec<u64> = p.reserves().map(|(_, b)| b.amount).collect();
        match d {
            Ok(Decision::Admit(_)) => {
                lines.push(json!({"op": "admit", "id": id, "t0": t0, "t1": t1, "result": "admit", "amounts": amounts}).to_string());
            }
            Ok(Decision::Deny(deny)) => {
                lines.push(json!({"op": "admit", "id": id, "t0": t0, "t1": t1, "result": "deny", "reason": deny.reason.code()}).to_string());
                continue;
            }
            Ok(Decision::Killed(k)) => {
                lines.push(json!({"op": "admit", "id": id, "t0": t0, "t1": t1, "result": "killed", "target": k.target}).to_string());
                continue;
            }
            Err(e) => {
                lines.push(json!({"op": "admit", "id": id, "t0": t0, "t1": t1, "result": "error", "error": e.to_string()}).to_string());
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        }
        if args.hang {
            continue;
        }
        tokio::time::sleep(Duration::from_millis(rng.below(args.hold_ms + 1))).await;
        if args.abandon_every > 0 && rng.below(args.abandon_every) == 0 {
            lines.push(json!({"op": "abandon", "id": id}).to_string());
            continue;
        }
        let usage = Usage {
            input_tokens: input,
            cached_input_tokens: 0,
            output_tokens: rng.below(max + 1),
            ..Usage::default()
        };
        let (op, t0) = (if i % 3 == 0 { "release" } else { "settle" }, now_ns());
        let f = if op == "release" {
            store.release(&id, Some(usage)).await
        } else {
            store.settle(&id, usage).await
        };
        let t1 = now_ns();
        let line = match f {
            Ok(Finish::Done { charged }) => {
                json!({"op": op, "id": id, "t0": t0, "t1": t1, "result": "done", "charged": charged})
            }
            Ok(Finish::AlreadyEnded(e)) => {
                json!({"op": op, "id": id, "t0": t0, "t1": t1, "result": "ended", "ending": format!("{e:?}")})
            }
            Ok(Finish::Unknown) => {
                json!({"op": op, "id": id, "t0": t0, "t1": t1, "result": "unknown"})
            }
            Err(e) => {
                json!({"op": op, "id": id, "t0": t0, "t1": t1, "result": "error", "error": e.to_string()})
            }
        };
        lines.push(line.to_string());
    }
    lines
}
