//! # tollgate-redis
//!
//! The [`Store`] over Redis or Valkey. Every admission is **one** atomic step in a Lua script, so
//! any number of stateless gateway instances sharing one Redis can never overshoot a budget or a
//! concurrency limit together: the check and the reservation happen together on the server.
//!
//! - Admissions and settlements that are waiting at the same moment travel in one script call
//!   (`batch_v2.lua`), each applied as its own atomic transition, in order. One caller alone gets
//!   a call of its own, made from its own task; under load the fixed cost of a call is shared,
//!   and a call reads and writes each scope key its items share once (see `docs/redis.md`).
//! - Scripts live in `src/lua/*_vN.lua` (versioned names), are embedded with `include_str!`,
//!   called by SHA, and reloaded by the client on `NOSCRIPT`.
//! - Time is Redis `TIME` (never the instance's clock), clamped so that it never goes back.
//!   Tests may pass a manual clock instead, so that the store conformance suite drives time.
//! - Integer arithmetic only; the ledger functions are line-for-line twins of
//!   `tollgate_core::ledger`.
//! - Every call has a timeout; a store that cannot be reached answers
//!   [`StoreError::Unavailable`] (the gateway fails closed on it unless told otherwise), and the
//!   connection reconnects by itself.
//!
//! - With `RedisConfig::shards` > 1, scopes spread over cluster slots and a request spanning
//!   several shards is admitted shard by shard, with roll-back (`docs/redis.md`).
//!
//! Key layout (prefix `P`, default `tollgate`), documented in `docs/redis.md`:
//! `P:r:<scope>` rate window, `P:l:<scope>` leases (sorted set by expiry), `P:b:<scope>`
//! budget periods, `P:ts:<request>` the ticket (a msgpack string) and, once the request has
//! ended, how it ended; `P:x` ticket expiry index, `P:kill` kill switch, `P:clock` the store's
//! last time.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tollgate_core::StoreError> {
//! use tollgate_redis::{RedisConfig, RedisStore};
//! let store = RedisStore::connect(RedisConfig::new("redis://127.0.0.1:6379/")).await?;
//! # let _ = store; Ok(()) }
//! ```

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};
use tollgate_core::pipeline::Plan;
use tollgate_core::policy::Unit;
use tollgate_core::{
    Admitted, Clock, Decision, Deny, Ending, Finish, Period, Quota, Reason, Renewal, ScopeUsage,
    Store, StoreError, Usage,
};

/// Connection settings.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// `redis://host:port/db`.
    pub url: String,
    /// Key prefix; several deployments may share one Redis under different prefixes.
    pub prefix: String,
    /// Longest wait for one call; then the call fails with `Unavailable`.
    pub call_timeout: Duration,
    /// How long finished request ids are remembered (late duplicates are no-ops).
    pub retention_ms: u64,
    /// Redis Cluster: the seed nodes (`url` is then unused). With one shard, every key of the
    /// prefix shares one hash tag, `{prefix}`, so each script runs atomically on one node.
    pub cluster: Option<Vec<String>>,
    /// Shards of the key space (default 1). With more, each scope's keys carry the tag
    /// `{prefix.N}` of the shard its id hashes to, so a cluster spreads the load over its nodes;
    /// a request whose scopes sit in several shards is admitted shard by shard in shard order,
    /// with roll-back when one refuses (see `docs/redis.md`). Every instance sharing the store
    /// must use the same number.
    pub shards: u16,
    /// Most admissions and settlements carried by one script call.
    pub max_batch: usize,
    /// Batch calls on their way at once; while they are, new work waits and joins the next one.
    pub batches_in_flight: usize,
}

impl RedisConfig {
    /// Defaults: prefix `tollgate`, 250 ms per call, one hour of retention, batches of at most
    /// 64, two batch calls in flight.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: "tollgate".into(),
            call_timeout: Duration::from_millis(250),
            retention_ms: 3_600_000,
            cluster: None,
            shards: 1,
            max_batch: 64,
            batches_in_flight: 2,
        }
    }
}

struct Scripts {
    batch: Script,
    renew: Script,
    usage: Script,
    sweep: Script,
}

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(
            include_str!("lua/common_v3.lua"),
            "\n",
            include_str!($file)
        ))
    };
}

fn scripts() -> &'static Scripts {
    static SCRIPTS: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        batch: script!("lua/batch_v2.lua"),
        renew: script!("lua/renew_v4.lua"),
        usage: script!("lua/usage_v2.lua"),
        sweep: script!("lua/sweep_v2.lua"),
    })
}

/// A single-node connection (reconnecting) or a cluster connection (routing by slot).
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }
    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }
    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Wraps a prefix in a hash tag (cluster mode): every key then lives in one slot.
fn tagged(prefix: &str) -> String {
    if prefix.starts_with('{') && prefix.ends_with('}') {
        prefix.to_owned()
    } else {
        format!("{{{prefix}}}")
    }
}

/// The key prefix of each shard: the prefix itself when there is one shard (tagged in a
/// cluster), else `{prefix.N}` for shard N.
fn shard_prefixes(prefix: &str, shards: u16) -> Arc<[String]> {
    if shards <= 1 {
        return Arc::from(vec![prefix.to_owned()]);
    }
    let inner = prefix.trim_start_matches('{').trim_end_matches('}');
    (0..shards).map(|i| format!("{{{inner}.{i}}}")).collect()
}

/// The shard of a scope (or request) id: FNV-1a, stable across versions and instances.
fn shard_of(id: &str, shards: usize) -> usize {
    let h = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    usize::try_from(h % shards.max(1) as u64).unwrap_or(0)
}

/// One shard's share of a request's plan, and where its checks sit in the whole plan.
struct Part {
    shard: usize,
    plan: Plan,
    rate: Vec<usize>,
    concurrency: Vec<usize>,
    budget: Vec<usize>,
}

impl Part {
    /// Where a refusal of this part ranks among all the request's: by control, then by the
    /// scope's place in the plan (the order a single-shard store reports in).
    fn rank(&self, d: &Deny) -> (Reason, usize) {
        let at =
            |ids: &[usize], pos: Option<usize>| pos.and_then(|p| ids.get(p).copied()).unwrap_or(0);
        let idx = match d.reason {
            Reason::RequestRateLimit => at(
                &self.rate,
                self.plan.rate.iter().position(|r| r.scope == d.scope),
            ),
            Reason::ConcurrencyLimit => at(
                &self.concurrency,
                self.plan
                    .concurrency
                    .iter()
                    .position(|c| c.scope == d.scope),
            ),
            Reason::BudgetLimit => at(
                &self.budget,
                self.plan.budget.iter().position(|b| b.scope == d.scope),
            ),
            _ => 0,
        };
        (d.reason, idx)
    }
}

/// What this instance remembers of a request it admitted on a sharded store: the shards
/// holding its parts, with the plan positions of each part's budgets (for the charges' order).
#[derive(Debug, Clone)]
struct Admission {
    expires_at: u64,
    parts: Vec<(usize, Vec<usize>)>,
}

/// Requests admitted here on a sharded store, by id, until they end. A request missing here
/// (admitted elsewhere, or forgotten) is looked for in every shard.
#[derive(Debug, Default)]
struct Admissions {
    map: std::collections::HashMap<String, Admission>,
    /// Size after the last pruning; the next one runs at twice that.
    pruned_at: usize,
}

/// The Redis [`Store`]. Cheap to clone: clones share one multiplexed connection and the batch
/// queues.
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    config: Arc<RedisConfig>,
    clock: Option<Arc<dyn Clock>>,
    /// The key prefix of each shard.
    shards: Arc<[String]>,
    /// One batch lane per shard, its queue started on first use, inside the caller's runtime.
    lanes: Arc<[Lane]>,
    admissions: Arc<std::sync::Mutex<Admissions>>,
    /// Per shard, whether this store has seen the shard's marker (see `batch_v2.lua`): once it
    /// has, the marker's absence means the store forgot.
    markers: Arc<[Arc<AtomicBool>]>,
}

/// Where one shard's admissions and settlements wait for a script call.
struct Lane {
    queue: OnceLock<mpsc::Sender<Job>>,
    /// Script calls in flight (`RedisConfig::batches_in_flight`), shared by the batch task and
    /// by callers that find the lane idle.
    slots: Arc<Semaphore>,
}

impl Lane {
    fn new(config: &RedisConfig) -> Self {
        Self {
            queue: OnceLock::new(),
            slots: Arc::new(Semaphore::new(config.batches_in_flight.max(1))),
        }
    }
}

fn lanes(config: &RedisConfig, shards: usize) -> Arc<[Lane]> {
    (0..shards).map(|_| Lane::new(config)).collect()
}

/// An admission (`a`) or a settlement (`f`) waiting for a batch call.
struct Job {
    op: &'static str,
    inv: Invocation,
    reply: oneshot::Sender<Result<Value, StoreError>>,
}

/// Collects waiting jobs into batch calls: takes the first, waits for a free call slot, then
/// takes whatever else has arrived meanwhile (up to `max_batch`).
async fn run_batches(
    mut rx: mpsc::Receiver<Job>,
    slots: Arc<Semaphore>,
    conn: Conn,
    config: Arc<RedisConfig>,
    marker: Arc<AtomicBool>,
    prefix: Arc<str>,
    clock: Option<Arc<dyn Clock>>,
) {
    while let Some(first) = rx.recv().await {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut jobs = vec![first];
        while jobs.len() < config.max_batch.max(1) {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        let (conn, config, prefix, marker) =
            (conn.clone(), config.clone(), prefix.clone(), marker.clone());
        let now = clock.as_ref().map_or(0, |c| c.now().max(1));
        tokio::spawn(async move {
            call_batch(conn, &config, &marker, &prefix, now, jobs).await;
            drop(permit);
        });
    }
}

/// The parts of a batch call that are not its items'.
struct BatchHead {
    keys: [String; 5],
    args: [String; 4],
}

impl BatchHead {
    fn new(prefix: &str, now: u64, retention_ms: u64, marker_seen: bool) -> Self {
        Self {
            keys: [
                format!("{prefix}:x"),
                format!("{prefix}:clock"),
                format!("{prefix}:kill"),
                format!("{prefix}:marker"),
                format!("{prefix}:lost"),
            ],
            args: [
                prefix.to_owned(),
                num(now),
                num(retention_ms),
                if marker_seen { "1" } else { "0" }.to_owned(),
            ],
        }
    }

    /// KEYS and ARGV of the call, borrowed from the head, the items and their argument counts.
    fn layout<'a>(
        &'a self,
        items: &[(&'a str, &'a Invocation)],
        counts: &'a [String],
    ) -> (Vec<&'a str>, Vec<&'a str>) {
        let mut keys: Vec<&str> = self.keys.iter().map(String::as_str).collect();
        let mut args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        for (&(op, inv), n) in items.iter().zip(counts) {
            keys.extend(inv.keys.iter().map(String::as_str));
            args.push(op);
            args.push(n);
            args.extend(inv.args.iter().map(String::as_str));
        }
        (keys, args)
    }
}

fn arg_counts(items: &[(&str, &Invocation)]) -> Vec<String> {
    items.iter().map(|(_, inv)| num(inv.args.len())).collect()
}

/// The KEYS and ARGV of one batch call: what `call_batch` sends.
pub fn batch_invocation<'a>(
    prefix: &str,
    now: u64,
    retention_ms: u64,
    marker_seen: bool,
    items: impl IntoIterator<Item = (&'a str, &'a Invocation)>,
) -> Invocation {
    let items: Vec<_> = items.into_iter().collect();
    let counts = arg_counts(&items);
    let head = BatchHead::new(prefix, now, retention_ms, marker_seen);
    let (keys, args) = head.layout(&items, &counts);
    Invocation {
        keys: keys.into_iter().map(str::to_owned).collect(),
        args: args.into_iter().map(str::to_owned).collect(),
    }
}

/// Calls `script` by its SHA with these KEYS and ARGV, written straight into one command buffer
/// (`ScriptInvocation` copies each argument into a vector of its own first); on `NOSCRIPT`
/// loads the script and calls again.
async fn evalsha<T: redis::FromRedisValue>(
    conn: &mut Conn,
    script: &Script,
    keys: &[&str],
    args: &[&str],
) -> redis::RedisResult<T> {
    // Made at its size: a batch call's command grew by doubling, copying itself each time.
    // The 64 bytes cover the command name, the SHA and the key count.
    let bytes = keys.iter().chain(args).map(|a| a.len()).sum::<usize>() + 64;
    let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + args.len(), bytes);
    cmd.arg("EVALSHA")
        .arg(script.get_hash())
        .arg(keys.len())
        .arg(keys)
        .arg(args);
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(conn).await?;
            cmd.query_async(conn).await
        }
        other => other,
    }
}

/// One batch call of these items: a reply per item, in order.
async fn call_items(
    mut conn: Conn,
    config: &RedisConfig,
    marker: &AtomicBool,
    prefix: &str,
    now: u64,
    parts: &[(&str, &Invocation)],
) -> Result<Vec<Value>, StoreError> {
    let counts = arg_counts(parts);
    let seen = marker.load(Ordering::Relaxed);
    let head = BatchHead::new(prefix, now, config.retention_ms, seen);
    let (keys, args) = head.layout(parts, &counts);
    // Callers stop waiting at their own timeout; this one only ends calls that never return.
    let replies = tokio::time::timeout(
        config.call_timeout.saturating_mul(4),
        evalsha::<Value>(&mut conn, &scripts().batch, &keys, &args),
    )
    .await
    .map_err(|_| no_answer(config.call_timeout))
    .and_then(|r| r.map_err(unavailable))
    .and_then(items)?;
    if replies.len() != parts.len() {
        return Err(StoreError::Protocol(format!(
            "{} replies to a batch of {}",
            replies.len(),
            parts.len()
        )));
    }
    if !seen && !replies.iter().any(is_lost) {
        // The call found the marker, or wrote it: from now on its absence is a loss.
        marker.store(true, Ordering::Relaxed);
    }
    Ok(replies)
}

/// Whether an item's reply is `{'lost'}`.
fn is_lost(v: &Value) -> bool {
    matches!(v, Value::Array(a) if a.len() == 1 && matches!(&a[0], Value::BulkString(b) if b == b"lost"))
}

async fn call_batch(
    conn: Conn,
    config: &RedisConfig,
    marker: &AtomicBool,
    prefix: &str,
    now: u64,
    jobs: Vec<Job>,
) {
    let parts: Vec<(&str, &Invocation)> = jobs.iter().map(|j| (j.op, &j.inv)).collect();
    match call_items(conn, config, marker, prefix, now, &parts).await {
        Ok(replies) => {
            for (job, reply) in jobs.into_iter().zip(replies) {
                let _ = job.reply.send(item_reply(reply));
            }
        }
        Err(e) => {
            for job in jobs {
                let _ = job.reply.send(Err(e.clone()));
            }
        }
    }
}

/// One item's reply; `{'error', message}` when its script step failed.
fn item_reply(v: Value) -> Result<Value, StoreError> {
    if let Value::Array(a) = &v {
        if a.len() == 2 && a.first().and_then(|k| text(k).ok()).as_deref() == Some("error") {
            let msg = a.get(1).and_then(|m| text(m).ok()).unwrap_or_default();
            return Err(StoreError::Protocol(msg));
        }
    }
    Ok(v)
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.config.prefix)
            .field("manual_clock", &self.clock.is_some())
            .finish()
    }
}

/// A call that did not answer within `limit`.
fn no_answer(limit: Duration) -> StoreError {
    StoreError::Unavailable(format!("no answer within {limit:?}"))
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

/// The keys and arguments of one script call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// KEYS.
    pub keys: Vec<String>,
    /// ARGV.
    pub args: Vec<String>,
}

fn usage_args(u: &Usage) -> [String; 3] {
    [
        num(u.input_tokens),
        num(u.cached_input_tokens),
        num(u.output_tokens),
    ]
}

fn period_arg(p: Period) -> (u64, String) {
    match p {
        Period::Fixed(len) => (len, p.label()),
        Period::CalendarMonth => (0, p.label()),
    }
}

/// A number as an argument, written by `itoa`. An admission has some twenty; with `to_string`
/// (the formatting machinery) and `format!` for the keys, `admit_invocation` counted 13,380
/// instructions per admission under load, 7,496 with these two helpers.
fn num(n: impl itoa::Integer) -> String {
    itoa::Buffer::new().format(n).to_owned()
}

/// `{prefix}:{kind}:{id}`, made in one allocation of the right size: every per-request and
/// per-scope key (`docs/redis.md` lists the kinds) is made here.
fn key(prefix: &str, kind: &str, id: &str) -> String {
    let mut k = String::with_capacity(prefix.len() + kind.len() + id.len() + 2);
    k.push_str(prefix);
    k.push(':');
    k.push_str(kind);
    k.push(':');
    k.push_str(id);
    k
}

/// The exact KEYS and ARGV of an admission, as one item of a batch call.
pub fn admit_invocation(prefix: &str, plan: &Plan, retention_ms: u64) -> Invocation {
    let mut keys =
        Vec::with_capacity(1 + plan.rate.len() + plan.concurrency.len() + plan.budget.len());
    keys.push(key(prefix, "ts", &plan.request_id));
    let price = plan
        .price
        .map_or([0, 0, 0], |p| [p.input, p.cached_input, p.output]);
    let mut args = Vec::with_capacity(
        14 + plan.kill_targets.len()
            + 3 * plan.rate.len()
            + 2 * plan.concurrency.len()
            + 6 * plan.budget.len(),
    );
    args.extend([
        plan.request_id.clone(),
        num(plan.ttl_ms),
        num(retention_ms),
        if plan.token_verdict.is_some() {
            "1"
        } else {
            "0"
        }
        .to_owned(),
        num(plan.rate.len()),
        num(plan.concurrency.len()),
        num(plan.budget.len()),
    ]);
    args.extend(price.map(num));
    args.extend(usage_args(&plan.expired_usage));
    args.push(num(plan.kill_targets.len()));
    args.extend(plan.kill_targets.iter().map(str::to_owned));
    for r in &plan.rate {
        let k = key(prefix, "r", r.scope.id());
        keys.push(k.clone());
        args.extend([k, num(r.limit), num(r.window_ms)]);
    }
    for c in &plan.concurrency {
        let k = key(prefix, "l", c.scope.id());
        keys.push(k.clone());
        args.extend([k, num(c.limit)]);
    }
    for b in &plan.budget {
        let k = key(prefix, "b", b.scope.id());
        keys.push(k.clone());
        let (len, label) = period_arg(b.period);
        let unit = match b.unit {
            Unit::Tokens => "t",
            Unit::MicroUsd => "m",
        };
        args.extend([
            k,
            num(b.limit),
            unit.to_owned(),
            num(len),
            label,
            num(b.amount),
        ]);
    }
    Invocation { keys, args }
}

/// The KEYS and ARGV of a settlement or release, as one item of a batch call.
fn finish_invocation(
    prefix: &str,
    id: &str,
    retention_ms: u64,
    usage: Option<Usage>,
    ending: &str,
) -> Invocation {
    let mut args = vec![
        id.to_owned(),
        num(retention_ms),
        ending.to_owned(),
        if usage.is_some() { "1" } else { "0" }.to_owned(),
    ];
    // Bounded before it is written: the script computes in doubles, and a number past 2^63
    // would be formatted negative there.
    let u = usage.unwrap_or_default().bounded();
    args.extend(usage_args(&u));
    args.extend([num(u.cache_write_tokens), num(u.cache_write_1h_tokens)]);
    Invocation {
        keys: vec![key(prefix, "ts", id)],
        args,
    }
}

fn int(v: &Value) -> Result<i64, StoreError> {
    match v {
        Value::Int(i) => Ok(*i),
        other => Err(StoreError::Protocol(format!(
            "expected an integer, got {other:?}"
        ))),
    }
}

fn text(v: &Value) -> Result<String, StoreError> {
    match v {
        Value::BulkString(b) => Ok(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Ok(s.clone()),
        other => Err(StoreError::Protocol(format!(
            "expected a string, got {other:?}"
        ))),
    }
}

fn items(v: Value) -> Result<Vec<Value>, StoreError> {
    match v {
        Value::Array(a) => Ok(a),
        other => Err(StoreError::Protocol(format!(
            "expected an array, got {other:?}"
        ))),
    }
}

fn opt_ms(v: i64) -> Option<u64> {
    u64::try_from(v).ok()
}

/// Turns the admit script's answer into a decision, with the plan's scopes and limits.
fn decision(plan: &Plan, reply: Vec<Value>) -> Result<Decision, StoreError> {
    let kind = reply.first().map(text).transpose()?.unwrap_or_default();
    let num = |i: usize| {
        reply
            .get(i)
            .ok_or_else(|| StoreError::Protocol(format!("short reply: {reply:?}")))
            .and_then(int)
    };
    match kind.as_str() {
        "admit" => {
            let expires_at = num(1)?.max(0) as u64;
            let mut quotas = Vec::new();
            let mut i = 2;
            for (check, r) in plan.rate.iter().enumerate() {
                quotas.push(Quota {
                    reason: Reason::RequestRateLimit,
                    check,
                    limit: r.limit,
                    remaining: num(i)?.max(0) as u64,
                    window_ms: Some(r.window_ms),
                    reset_after_ms: opt_ms(num(i + 1)?),
                });
                i += 2;
            }
            for (check, c) in plan.concurrency.iter().enumerate() {
                quotas.push(Quota {
                    reason: Reason::ConcurrencyLimit,
                    check,
                    limit: c.limit,
                    remaining: num(i)?.max(0) as u64,
                    window_ms: None,
                    reset_after_ms: None,
                });
                i += 1;
            }
            for (check, b) in plan.budget.iter().enumerate() {
                let reset = opt_ms(num(i + 1)?);
                quotas.push(Quota {
                    reason: Reason::BudgetLimit,
                    check,
                    limit: b.limit,
                    remaining: num(i)?.max(0) as u64,
                    window_ms: match b.period {
                        Period::Fixed(len) => Some(len),
                        Period::CalendarMonth => {
                            let (_, start, end) =
                                b.period.at(expires_at.saturating_sub(plan.ttl_ms));
                            Some(end - start)
                        }
                    },
                    reset_after_ms: reset,
                });
                i += 2;
            }
            Ok(Decision::Admit(Admitted {
                max_output_tokens: plan.max_output_tokens,
                expires_at,
                quotas,
                fail_open: false,
            }))
        }
        "deny" => {
            let reason = match num(1)? {
                0 => Reason::RequestRateLimit,
                4 => Reason::ConcurrencyLimit,
                5 => Reason::BudgetLimit,
                r => return Err(StoreError::Protocol(format!("unknown reason {r}"))),
            };
            let idx = usize::try_from(num(2)?)
                .map_err(|_| StoreError::Protocol("bad scope index".into()))?;
            let missing = || StoreError::Protocol(format!("scope index {idx} out of range"));
            let (scope, limit, requested) = match reason {
                Reason::RequestRateLimit => {
                    plan.rate.get(idx).map(|r| (r.scope.clone(), r.limit, 1))
                }
                Reason::ConcurrencyLimit => plan
                    .concurrency
                    .get(idx)
                    .map(|c| (c.scope.clone(), c.limit, 1)),
                _ => plan
                    .budget
                    .get(idx)
                    .map(|b| (b.scope.clone(), b.limit, b.amount)),
            }
            .ok_or_else(missing)?;
            Ok(Decision::Deny(Deny {
                reason,
                scope,
                limit,
                remaining: num(3)?.max(0) as u64,
                requested,
                retry_after_ms: opt_ms(num(4)?),
                reset_after_ms: opt_ms(num(5)?),
            }))
        }
        "token" => plan
            .token_verdict
            .clone()
            .map(Decision::Deny)
            .ok_or_else(|| StoreError::Protocol("token denial without a verdict".into())),
        "dup" => Err(StoreError::DuplicateRequestId(plan.request_id.clone())),
        "lost" => Err(StoreError::StateLost),
        "killed" => Ok(Decision::Killed(tollgate_core::decision::Killed {
            target: reply.get(1).map(text).transpose()?.unwrap_or_default(),
            reason: reply.get(2).map(text).transpose()?.unwrap_or_default(),
        })),
        other => Err(StoreError::Protocol(format!(
            "unknown admit reply {other:?}"
        ))),
    }
}

fn finish_reply(reply: Vec<Value>) -> Result<Finish, StoreError> {
    let kind = reply.first().map(text).transpose()?.unwrap_or_default();
    match kind.as_str() {
        "done" => Ok(Finish::Done {
            charged: reply[1..]
                .iter()
                .map(|v| int(v).map(|n| n.max(0) as u64))
                .collect::<Result<_, _>>()?,
        }),
        "ended" => {
            let how = reply.get(1).map(text).transpose()?.unwrap_or_default();
            Ok(Finish::AlreadyEnded(match how.as_str() {
                "settled" => Ending::Settled,
                "released" => Ending::Released,
                _ => Ending::Expired,
            }))
        }
        "unknown" => Ok(Finish::Unknown),
        other => Err(StoreError::Protocol(format!(
            "unknown finish reply {other:?}"
        ))),
    }
}

impl RedisStore {
    /// A store on `config.url`. The connection is made lazily and remade after failures, so a
    /// gateway can start while Redis is down (calls fail with `Unavailable` until it is back).
    pub async fn connect(mut config: RedisConfig) -> Result<Self, StoreError> {
        if let Some(nodes) = &config.cluster {
            let client = redis::cluster::ClusterClient::builder(nodes.clone())
                .connection_timeout(config.call_timeout)
                .response_timeout(config.call_timeout)
                .build()
                .map_err(unavailable)?;
            let conn = client.get_async_connection().await.map_err(unavailable)?;
            config.prefix = tagged(&config.prefix);
            return Ok(Self::over(Conn::Cluster(conn), config));
        }
        let client = redis::Client::open(config.url.as_str()).map_err(unavailable)?;
        let cm = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.call_timeout))
            .set_response_timeout(Some(config.call_timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, cm).map_err(unavailable)?;
        Ok(Self::over(Conn::Single(conn), config))
    }

    fn over(conn: Conn, config: RedisConfig) -> Self {
        let shards = shard_prefixes(&config.prefix, config.shards);
        Self {
            conn,
            lanes: lanes(&config, shards.len()),
            config: Arc::new(config),
            clock: None,
            markers: shards.iter().map(|_| Arc::default()).collect(),
            shards,
            admissions: Arc::default(),
        }
    }

    /// Uses `clock` instead of Redis `TIME` (tests and deterministic replay only: instances
    /// sharing a store must share its time).
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self.lanes = lanes(&self.config, self.shards.len());
        self
    }

    /// The same connection under another key prefix (an isolated store on the same Redis).
    #[must_use]
    pub fn with_prefix(self, prefix: impl Into<String>) -> Self {
        let mut c = (*self.config).clone();
        c.prefix = prefix.into();
        if c.cluster.is_some() {
            c.prefix = tagged(&c.prefix);
        }
        let mut store = Self::over(self.conn, c);
        store.clock = self.clock;
        store
    }

    /// Acknowledges that the store lost its state: the marker is written again and the loss
    /// forgotten, on every shard, so admissions resume from what the store holds now (spent
    /// budgets and kill switches it forgot are then gone for good).
    pub async fn acknowledge_loss(&self) -> Result<(), StoreError> {
        for p in self.shards.iter() {
            let mut conn = self.conn.clone();
            let mut pipe = redis::pipe();
            pipe.atomic()
                .cmd("DEL")
                .arg(format!("{p}:lost"))
                .ignore()
                .cmd("SET")
                .arg(format!("{p}:marker"))
                .arg("1")
                .ignore();
            tokio::time::timeout(self.config.call_timeout, pipe.query_async::<()>(&mut conn))
                .await
                .map_err(|_| no_answer(self.config.call_timeout))?
                .map_err(unavailable)?;
        }
        Ok(())
    }

    /// How the server keeps its keys: its `maxmemory-policy`, and whether it persists them
    /// (RDB snapshots or the append-only file). `None` where the server does not say (managed
    /// services often disable `CONFIG`).
    pub async fn keeping(&self) -> Result<Option<(String, bool)>, StoreError> {
        let mut conn = self.conn.clone();
        let get = |name: &'static str| {
            let mut cmd = redis::cmd("CONFIG");
            cmd.arg("GET").arg(name);
            cmd
        };
        let (policy, save, aof) = (get("maxmemory-policy"), get("save"), get("appendonly"));
        let mut read = async |cmd: redis::Cmd| -> Result<Option<String>, StoreError> {
            let r = tokio::time::timeout(
                self.config.call_timeout,
                cmd.query_async::<Vec<String>>(&mut conn),
            )
            .await
            .map_err(|_| no_answer(self.config.call_timeout))?;
            Ok(r.ok().and_then(|v| v.into_iter().nth(1)))
        };
        let (Some(policy), Some(save), Some(aof)) =
            (read(policy).await?, read(save).await?, read(aof).await?)
        else {
            return Ok(None);
        };
        Ok(Some((policy, !save.trim().is_empty() || aof == "yes")))
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.config.prefix
    }

    /// The key prefix of the shard holding a scope's keys (the prefix itself with one shard).
    pub fn shard_prefix(&self, scope_id: &str) -> &str {
        &self.shards[shard_of(scope_id, self.shards.len())]
    }

    fn now_arg(&self) -> u64 {
        // 0 tells the script to read Redis TIME.
        self.clock.as_ref().map_or(0, |c| c.now().max(1))
    }

    /// Queues an admission or a settlement for the next batch call on `shard` and waits for its
    /// reply.
    async fn batched(
        &self,
        shard: usize,
        op: &'static str,
        inv: Invocation,
    ) -> Result<Vec<Value>, StoreError> {
        let (Some(lane), Some(prefix), Some(marker)) = (
            self.lanes.get(shard),
            self.shards.get(shard),
            self.markers.get(shard),
        ) else {
            return Err(StoreError::Protocol(format!("no shard {shard}")));
        };
        let queue = lane.queue.get_or_init(|| {
            let (tx, rx) = mpsc::channel(4 * self.config.max_batch.max(1));
            let (conn, config, clock) =
                (self.conn.clone(), self.config.clone(), self.clock.clone());
            tokio::spawn(run_batches(
                rx,
                lane.slots.clone(),
                conn,
                config,
                marker.clone(),
                Arc::from(prefix.as_str()),
                clock,
            ));
            tx
        });
        // An idle lane (nothing queued, no call in flight) is called from here: a lone caller
        // skips two hand-offs between tasks, each a wake-up of another thread. Only when idle:
        // taking any free slot made one-item calls of work that would have waited to share a
        // call (a quarter fewer pairs per second at 8 callers on one thread).
        let idle = self.config.batches_in_flight.max(1);
        if queue.capacity() == queue.max_capacity() && lane.slots.available_permits() == idle {
            if let Ok(permit) = lane.slots.clone().try_acquire_owned() {
                let parts = [(op, &inv)];
                let call = call_items(
                    self.conn.clone(),
                    &self.config,
                    marker,
                    prefix,
                    self.now_arg(),
                    &parts,
                );
                let replies = tokio::time::timeout(self.config.call_timeout, call)
                    .await
                    .map_err(|_| no_answer(self.config.call_timeout))??;
                drop(permit);
                let reply = replies
                    .into_iter()
                    .next()
                    .ok_or_else(|| StoreError::Protocol("no reply to a call of one".into()))?;
                return items(item_reply(reply)?);
            }
        }
        let (reply, answer) = oneshot::channel();
        let wait = async {
            queue
                .send(Job { op, inv, reply })
                .await
                .map_err(|_| StoreError::Unavailable("the batch queue has stopped".into()))?;
            answer
                .await
                .map_err(|_| StoreError::Unavailable("the batch call was dropped".into()))?
        };
        let reply = tokio::time::timeout(self.config.call_timeout, wait)
            .await
            .map_err(|_| no_answer(self.config.call_timeout))??;
        items(reply)
    }

    async fn call(&self, script: &Script, inv: Invocation) -> Result<Vec<Value>, StoreError> {
        items(self.invoke(script, inv).await?)
    }

    /// One script call with the configured timeout.
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        inv: Invocation,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        let keys: Vec<&str> = inv.keys.iter().map(String::as_str).collect();
        let args: Vec<&str> = inv.args.iter().map(String::as_str).collect();
        tokio::time::timeout(
            self.config.call_timeout,
            evalsha::<T>(&mut conn, script, &keys, &args),
        )
        .await
        .map_err(|_| no_answer(self.config.call_timeout))?
        .map_err(unavailable)
    }

    /// Expires up to `max` tickets whose time has come, and says how many. Every call sweeps a
    /// few on its way; this is for maintenance and tests that need all of them gone now.
    pub async fn sweep_expired(&self, max: u64) -> Result<u64, StoreError> {
        let mut swept = 0;
        for p in self.shards.iter() {
            let inv = Invocation {
                keys: vec![format!("{p}:x"), format!("{p}:clock")],
                args: vec![
                    p.clone(),
                    self.now_arg().to_string(),
                    self.config.retention_ms.to_string(),
                    max.to_string(),
                ],
            };
            let n: i64 = self.invoke(&scripts().sweep, inv).await?;
            swept += n.max(0) as u64;
        }
        Ok(swept)
    }

    /// Keeps `value` under `name` for `ttl`, for every instance on this store (the gateway's
    /// note of what a Responses API follow-up carries). Key `P:n:<name>`; a plain `SET`.
    pub async fn put_note(&self, name: &str, value: u64, ttl: Duration) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        tokio::time::timeout(
            self.config.call_timeout,
            redis::cmd("SET")
                .arg(key(self.shard_prefix(name), "n", name))
                .arg(value)
                .arg("PX")
                .arg(ms)
                .query_async::<()>(&mut conn),
        )
        .await
        .map_err(|_| StoreError::Unavailable("SET timed out".into()))?
        .map_err(unavailable)
    }

    /// The value kept under `name` by [`Self::put_note`], if it has not expired.
    pub async fn note(&self, name: &str) -> Result<Option<u64>, StoreError> {
        let mut conn = self.conn.clone();
        tokio::time::timeout(
            self.config.call_timeout,
            redis::cmd("GET")
                .arg(key(self.shard_prefix(name), "n", name))
                .query_async::<Option<u64>>(&mut conn),
        )
        .await
        .map_err(|_| StoreError::Unavailable("GET timed out".into()))?
        .map_err(unavailable)
    }

    /// Whether the store answers (for readiness checks).
    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        tokio::time::timeout(
            self.config.call_timeout,
            redis::cmd("PING").query_async::<String>(&mut conn),
        )
        .await
        .map_err(|_| StoreError::Unavailable("ping timed out".into()))?
        .map(|_| ())
        .map_err(unavailable)
    }

    /// Renews a request's leases and reservations on one shard.
    async fn renew_on(&self, shard: usize, id: &str) -> Result<Renewal, StoreError> {
        let p = &self.shards[shard];
        let inv = Invocation {
            keys: vec![key(p, "ts", id), format!("{p}:x"), format!("{p}:clock")],
            args: vec![
                p.clone(),
                self.now_arg().to_string(),
                id.to_owned(),
                self.config.retention_ms.to_string(),
            ],
        };
        let reply = self.call(&scripts().renew, inv).await?;
        match reply.first().map(text).transpose()?.as_deref() {
            Some("renewed") => Ok(Renewal::Renewed {
                expires_at: reply.get(1).map(int).transpose()?.unwrap_or(0).max(0) as u64,
            }),
            Some("gone") => Ok(Renewal::NotInFlight),
            other => Err(StoreError::Protocol(format!(
                "unknown renew reply {other:?}"
            ))),
        }
    }

    async fn finish(
        &self,
        id: &str,
        usage: Option<Usage>,
        ending: &str,
    ) -> Result<Finish, StoreError> {
        if self.shards.len() > 1 {
            return self.finish_parts(id, usage, ending).await;
        }
        let inv = finish_invocation(&self.shards[0], id, self.config.retention_ms, usage, ending);
        finish_reply(self.batched(0, "f", inv).await?)
    }
}

impl Store for RedisStore {
    fn set_kill(
        &self,
        target: &str,
        reason: Option<&str>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let (target, reason) = (target.to_owned(), reason.map(str::to_owned));
        async move {
            // Every shard holds a copy, read inside its admissions.
            for p in self.shards.iter() {
                let mut conn = self.conn.clone();
                let mut cmd = redis::cmd(if reason.is_some() { "HSET" } else { "HDEL" });
                cmd.arg(format!("{p}:kill")).arg(&target);
                if let Some(r) = &reason {
                    cmd.arg(r);
                }
                tokio::time::timeout(self.config.call_timeout, cmd.query_async::<i64>(&mut conn))
                    .await
                    .map_err(|_| StoreError::Unavailable("kill switch call timed out".into()))?
                    .map_err(unavailable)?;
            }
            Ok(())
        }
    }

    fn kills(&self) -> impl Future<Output = Result<Vec<(String, String)>, StoreError>> + Send {
        let key = format!("{}:kill", self.shards[0]);
        async move {
            let mut conn = self.conn.clone();
            let mut cmd = redis::cmd("HGETALL");
            cmd.arg(&key);
            let fut = cmd.query_async::<Vec<(String, String)>>(&mut conn);
            let mut v = tokio::time::timeout(self.config.call_timeout, fut)
                .await
                .map_err(|_| StoreError::Unavailable("kill switch call timed out".into()))?
                .map_err(unavailable)?;
            v.sort();
            Ok(v)
        }
    }

    async fn admit(&self, plan: &Plan) -> Result<Decision, StoreError> {
        if self.shards.len() > 1 {
            return self.admit_parts(plan).await;
        }
        let inv = admit_invocation(&self.shards[0], plan, self.config.retention_ms);
        decision(plan, self.batched(0, "a", inv).await?)
    }

    fn settle(
        &self,
        id: &str,
        usage: Usage,
    ) -> impl Future<Output = Result<Finish, StoreError>> + Send {
        self.finish(id, Some(usage), "settled")
    }

    fn release(
        &self,
        id: &str,
        usage: Option<Usage>,
    ) -> impl Future<Output = Result<Finish, StoreError>> + Send {
        self.finish(id, usage, "released")
    }

    fn renew(&self, id: &str) -> impl Future<Output = Result<Renewal, StoreError>> + Send {
        let id = id.to_owned();
        async move {
            if self.shards.len() > 1 {
                return self.renew_parts(&id).await;
            }
            self.renew_on(0, &id).await
        }
    }

    fn usage(
        &self,
        scope_id: &str,
        period: Option<Period>,
    ) -> impl Future<Output = Result<ScopeUsage, StoreError>> + Send {
        let p = &self.shards[shard_of(scope_id, self.shards.len())];
        let (len, label) = period.map_or((-1i64, String::new()), |per| {
            let (len, label) = period_arg(per);
            (i64::try_from(len).unwrap_or(i64::MAX), label)
        });
        let inv = Invocation {
            keys: vec![
                key(p, "l", scope_id),
                key(p, "b", scope_id),
                format!("{p}:x"),
                format!("{p}:clock"),
            ],
            args: vec![
                p.clone(),
                self.now_arg().to_string(),
                len.to_string(),
                label,
                self.config.retention_ms.to_string(),
            ],
        };
        async move {
            let reply = self.call(&scripts().usage, inv).await?;
            let n = |i: usize| {
                reply
                    .get(i)
                    .map(int)
                    .transpose()
                    .map(|v| v.unwrap_or(0).max(0) as u64)
            };
            Ok(ScopeUsage {
                settled: n(0)?,
                reserved: n(1)?,
                leases: n(2)?,
            })
        }
    }
}

mod sharded;

#[cfg(test)]
mod tests;
