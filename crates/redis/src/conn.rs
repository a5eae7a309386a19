//! The connection (one node or a cluster), the scripts it runs by SHA, and what its failures
//! mean to a caller.

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{Script, Value};
use tollgate_core::StoreError;

pub(crate) struct Scripts {
    pub(crate) batch: Script,
    pub(crate) renew: Script,
    pub(crate) usage: Script,
    pub(crate) sweep: Script,
    pub(crate) keys: Script,
    pub(crate) state: Script,
}

/// A script assembled by the build script (`build.rs`): the ledger's files and its own.
macro_rules! script {
    ($file:literal) => {
        Script::new(include_str!(concat!(env!("OUT_DIR"), "/", $file)))
    };
}

pub(crate) fn scripts() -> &'static Scripts {
    static SCRIPTS: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        batch: script!("batch.lua"),
        renew: script!("renew.lua"),
        usage: script!("usage.lua"),
        sweep: script!("sweep.lua"),
        // Touches one key and nothing of the ledger's.
        keys: Script::new(include_str!("lua/keys_v1.lua")),
        state: Script::new(include_str!("lua/state_v1.lua")),
    })
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

/// Calls `script` by its SHA with these KEYS and ARGV, written straight into one command buffer
/// (`ScriptInvocation` copies each argument into a vector of its own first); on `NOSCRIPT`
/// loads the script and calls again.
pub(crate) async fn evalsha<T: redis::FromRedisValue>(
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

/// A call that did not answer within `limit`.
pub(crate) fn no_answer(limit: Duration) -> StoreError {
    StoreError::Unavailable(format!("no answer within {limit:?}"))
}

pub(crate) fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

/// The client of one node: the URL's user and password unless the configuration gives them,
/// and for `rediss://` the configured CA or Mozilla's roots.
pub(crate) fn single_client(config: &crate::RedisConfig) -> Result<redis::Client, StoreError> {
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
