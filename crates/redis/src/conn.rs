//! The connection (one node or a cluster), the library of scripts it calls, and what its
//! failures mean to a caller.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::Value;
use redis::aio::ConnectionManager;
use tollgate_core::StoreError;

/// The scripts' library as the build script assembled it (`build.rs`): the ledger's files and
/// every entry point's, loaded by Redis once (`FUNCTION LOAD`), so that a call runs only its
/// own work, not the making of every function it may use.
const LIBRARY: &str = include_str!(concat!(env!("OUT_DIR"), "/library.lua"));

/// One of the library's entry points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Function {
    /// Admissions, settlements, releases and slice orders (`batch.lua`).
    Batch,
    Renew,
    Usage,
    Sweep,
    /// The marker (`state.lua`).
    State,
    /// Idempotency keys (`keys.lua`).
    Keys,
    /// Issued keys' records (`records.lua`).
    Records,
}

impl Function {
    /// Its name in Redis, which ends with the library's version: instances of builds with other
    /// scripts sharing a Redis call their own.
    pub(crate) const fn name(self) -> &'static str {
        macro_rules! named {
            ($n:literal) => {
                concat!("tollgate_", $n, "_", env!("TOLLGATE_LUA_VERSION"))
            };
        }
        match self {
            Function::Batch => named!("batch"),
            Function::Renew => named!("renew"),
            Function::Usage => named!("usage"),
            Function::Sweep => named!("sweep"),
            Function::State => named!("state"),
            Function::Keys => named!("keys"),
            Function::Records => named!("records"),
        }
    }
}

/// A single-node connection (reconnecting) or a cluster connection (routing by slot).
#[derive(Clone)]
pub(crate) enum Conn {
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

/// Calls `function` with these KEYS and ARGV, written straight into one command buffer (see
/// [`query`]).
pub(crate) async fn fcall<T: redis::FromRedisValue>(
    conn: &mut Conn,
    function: Function,
    keys: &[&str],
    args: &[&str],
) -> redis::RedisResult<T> {
    // Made at its size: a batch call's command grew by doubling, copying itself each time.
    // The 64 bytes cover the command name, the function's name and the key count.
    let bytes = keys.iter().chain(args).map(|a| a.len()).sum::<usize>() + 64;
    let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + args.len(), bytes);
    cmd.arg("FCALL")
        .arg(function.name())
        .arg(keys.len())
        .arg(keys)
        .arg(args);
    query(conn, &cmd).await
}

/// Runs a call of one of the library's functions; when the server lacks the library (a restart
/// without persistence, `FUNCTION FLUSH`, a failover to a node that never had it), loads it
/// and runs the call again.
pub(crate) async fn query<T: redis::FromRedisValue>(
    conn: &mut Conn,
    cmd: &redis::Cmd,
) -> redis::RedisResult<T> {
    let seen = RELOADS.load(Ordering::Acquire);
    match cmd.query_async(conn).await {
        Err(e) if missing_function(&e) => {
            load_library(conn).await?;
            // Calls that met the same loss at once each load the library again; the first to
            // finish says so, once: a call sent before that reload finds the count moved.
            if RELOADS
                .compare_exchange(seen, seen + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                tracing::warn!(
                    fault = "store_functions",
                    cause = %e,
                    "Redis did not have the scripts' library (a restart without persistence, \
                     FUNCTION FLUSH, or a failover to a node without it): loaded the scripts' \
                     library again"
                );
            }
            cmd.query_async(conn).await
        }
        other => other,
    }
}

/// How many times this process loaded the library again after a call found it missing.
static RELOADS: AtomicU64 = AtomicU64::new(0);

/// Whether a call failed because the server does not have the function (Redis and Valkey
/// answer `ERR Function not found`).
fn missing_function(e: &redis::RedisError) -> bool {
    e.detail()
        .is_some_and(|d| d.starts_with("Function not found"))
}

/// Loads the library on the server (on every primary of a cluster). `REPLACE`: another
/// instance of this build may have loaded the same text a moment before.
pub(crate) async fn load_library(conn: &mut Conn) -> redis::RedisResult<()> {
    redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(LIBRARY)
        .query_async::<Value>(conn)
        .await
        .map(|_| ())
}

/// A call that did not answer within `limit`.
pub(crate) fn no_answer(limit: Duration) -> StoreError {
    StoreError::Unavailable(format!("no answer within {limit:?}"))
}

pub(crate) fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

/// The client of one node: the URL's user and password unless the configuration gives them,
/// and for `rediss://` the configured CA or Mozilla's roots.
pub(crate) fn single_client(
    config: &crate::config::RedisConfig,
) -> Result<redis::Client, StoreError> {
    use redis::IntoConnectionInfo;
    let mut info = config
        .url
        .as_str()
        .into_connection_info()
        .map_err(unavailable)?;
    let mut settings = info.redis_settings().clone();
    if let Some(u) = &config.username {
        settings = settings.set_username(u);
    }
    if let Some(p) = &config.password {
        settings = settings.set_password(p);
    }
    info = info.set_redis_settings(settings);
    match &config.ca_pem {
        Some(pem) => redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            },
        ),
        None => redis::Client::open(info),
    }
    .map_err(unavailable)
}
