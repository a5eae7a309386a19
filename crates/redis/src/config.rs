//! Connection settings.

use std::time::Duration;

/// Connection settings.
#[derive(Clone)]
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
    /// For `rediss://` URLs: the CA certificates (PEM) the server's certificate must chain to,
    /// instead of Mozilla's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// The ACL user, over the URL's.
    pub username: Option<String>,
    /// The password, over the URL's. Never shown by `Debug`.
    pub password: Option<String>,
    /// The prefix is new by the caller's word (a scratch prefix: a test, a replay, a load run):
    /// the first admission that finds it empty writes its marker. Off by default: an empty
    /// prefix may be one that forgot, and a marker written over a loss hides it; a gateway
    /// decides from its ledger or an operator's initialisation (`RedisStore::initialise`) instead.
    pub initialise_on_first_use: bool,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redacted(&self.url))
            .field("prefix", &self.prefix)
            .field(
                "cluster",
                &self
                    .cluster
                    .as_ref()
                    .map(|n| n.iter().map(|u| redacted(u)).collect::<Vec<_>>()),
            )
            .field("shards", &self.shards)
            .field("ca_pem", &self.ca_pem.is_some())
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "…"))
            .field("initialise_on_first_use", &self.initialise_on_first_use)
            .finish_non_exhaustive()
    }
}

pub use tollgate_core::store::redacted;

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
            ca_pem: None,
            username: None,
            password: None,
            initialise_on_first_use: false,
        }
    }
}
