//! The Redis store: its connection, shards, batch lanes and what it has seen of the marker and
//! the replication history, and the [`Store`] it implements. Its other parts are `impl` blocks
//! in the modules above it (the sharded admission, the books, keys, the keeper, the failover check).

use crate::batch::{Job, Lane, call_items, item_reply, lanes, run_batches};
use crate::config::RedisConfig;
use crate::conn::{Conn, Function, fcall, no_answer, unavailable};
use crate::decode::{decision, finish_reply, items, shadowed};
use crate::encode::{
    Invocation, admit_invocation, admit_shadowed_invocation, finish_invocation, key, num,
};
use crate::history;
use crate::shards::{Admissions, shard_of, shard_prefixes, tagged};
use redis::Value;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tollgate_core::pipeline::Plan;
use tollgate_core::{
    Clock, Decision, Finish, Period, Renewal, ScopeUsage, ShadowOutcome, Store, StoreError, Usage,
};

/// The Redis [`Store`]. Cheap to clone: clones share one multiplexed connection and the batch
/// queues.
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) conn: Conn,
    pub(crate) config: Arc<RedisConfig>,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    /// The key prefix of each shard.
    pub(crate) shards: Arc<[String]>,
    /// One batch lane per shard, its queue started on first use, inside the caller's runtime.
    pub(crate) lanes: Arc<[Lane]>,
    pub(crate) admissions: Arc<std::sync::Mutex<Admissions>>,
    /// Per shard, what this store has seen of the shard's marker and write sequence.
    pub(crate) markers: Arc<[Arc<crate::mark::Mark>]>,
    /// The replication history this store has seen ([`history`]).
    pub(crate) history: Arc<std::sync::Mutex<Option<history::Seen>>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.config.prefix)
            .field("manual_clock", &self.clock.is_some())
            .finish()
    }
}

impl RedisStore {
    /// A store on `config.url`. The connection is made lazily and remade after failures, so a
    /// gateway can start while Redis is down (calls fail with `Unavailable` until it is back).
    pub async fn connect(mut config: RedisConfig) -> Result<Self, StoreError> {
        // rustls picks the process's provider when the redis crate builds its TLS settings; a
        // process that also links another provider would have none chosen. Already chosen
        // (by the embedding application) is fine: the error is that one.
        let _ = rustls::crypto::ring::default_provider().install_default();
        if let Some(nodes) = &config.cluster {
            let mut b = redis::cluster::ClusterClient::builder(nodes.clone())
                .connection_timeout(config.call_timeout)
                .response_timeout(config.call_timeout);
            if let Some(pem) = &config.ca_pem {
                b = b.certs(redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                });
            }
            if let Some(u) = &config.username {
                b = b.username(u);
            }
            if let Some(p) = &config.password {
                b = b.password(p);
            }
            let client = b.build().map_err(unavailable)?;
            let conn = client.get_async_connection().await.map_err(unavailable)?;
            config.prefix = tagged(&config.prefix);
            return Ok(Self::over(Conn::Cluster(conn), config));
        }
        let client = crate::conn::single_client(&config)?;
        let cm = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.call_timeout))
            .set_response_timeout(Some(config.call_timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, cm).map_err(unavailable)?;
        Ok(Self::over(Conn::Single(conn), config))
    }

    pub(crate) fn over(conn: Conn, config: RedisConfig) -> Self {
        let shards = shard_prefixes(&config.prefix, config.shards);
        Self {
            conn,
            lanes: lanes(&config, &shards),
            config: Arc::new(config),
            clock: None,
            markers: shards.iter().map(|_| Arc::default()).collect(),
            history: Arc::default(),
            shards,
            admissions: Arc::default(),
        }
    }

    /// Uses `clock` instead of Redis `TIME` (tests and deterministic replay only: instances
    /// sharing a store must share its time).
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self.lanes = lanes(&self.config, &self.shards);
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

    /// How long a call waits for the store's answer.
    pub fn call_timeout(&self) -> std::time::Duration {
        self.config.call_timeout
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.config.prefix
    }

    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    pub(crate) fn prefix_of(&self, shard: usize) -> &str {
        self.shards
            .get(shard)
            .map_or(&self.config.prefix, String::as_str)
    }

    /// The key prefix of the shard holding a scope's keys (the prefix itself with one shard).
    pub fn shard_prefix(&self, scope_id: &str) -> &str {
        &self.shards[shard_of(scope_id, self.shards.len())]
    }

    pub(crate) fn now_arg(&self) -> u64 {
        // 0 tells the script to read Redis TIME.
        self.clock.as_ref().map_or(0, |c| c.now().max(1))
    }

    /// This instance's instant: near which a calendar period's starts are given to a script,
    /// which then takes the one containing its own clock's instant.
    pub(crate) fn wall_now(&self) -> u64 {
        self.clock.as_ref().map_or_else(
            || tollgate_core::Clock::now(&tollgate_core::SystemClock),
            |c| c.now(),
        )
    }

    /// Queues an admission or a settlement for the next batch call on `shard` and waits for its
    /// reply.
    pub(crate) async fn batched(
        &self,
        shard: usize,
        op: &'static str,
        inv: Invocation,
    ) -> Result<Vec<Value>, StoreError> {
        let (Some(lane), Some(marker)) = (self.lanes.get(shard), self.markers.get(shard)) else {
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
                lane.head.clone(),
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
                    &lane.head,
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

    pub(crate) async fn call(
        &self,
        function: Function,
        inv: Invocation,
    ) -> Result<Vec<Value>, StoreError> {
        items(self.invoke(function, inv).await?)
    }

    /// One script call with the configured timeout.
    pub(crate) async fn invoke<T: redis::FromRedisValue>(
        &self,
        function: Function,
        inv: Invocation,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        let (keys, args) = (inv.keys.to_vec(), inv.args.to_vec());
        tokio::time::timeout(
            self.config.call_timeout,
            fcall::<T>(&mut conn, function, &keys, &args),
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
            let inv = Invocation::of(
                &[&format!("{p}:x"), &format!("{p}:clock")],
                &[
                    p,
                    &num(self.now_arg()),
                    &num(self.config.retention_ms),
                    &num(max),
                ],
            );
            let n: i64 = self.invoke(Function::Sweep, inv).await?;
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
    pub(crate) async fn renew_on(&self, shard: usize, id: &str) -> Result<Renewal, StoreError> {
        let p = &self.shards[shard];
        let inv = Invocation::of(
            &[&key(p, "ts", id), &format!("{p}:x"), &format!("{p}:clock")],
            &[p, &num(self.now_arg()), id, &num(self.config.retention_ms)],
        );
        crate::decode::renewal(&self.call(Function::Renew, inv).await?)
    }

    pub(crate) async fn finish(
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
        // A hold's length becomes an instant of this instance's clock, which the scripts'
        // (Redis TIME) follows.
        let now = self.wall_now();
        let (target, reason) = (
            target.to_owned(),
            reason.map(|r| tollgate_core::decision::Killed::anchored(r, now)),
        );
        async move {
            // Every shard holds a copy, read inside its admissions; the write advances the
            // shard's sequence in the same transaction.
            let (mut conn, wait) = self.writer().await?;
            for (p, mark) in self.shards.iter().zip(self.markers.iter()) {
                let mut pipe = redis::pipe();
                pipe.atomic();
                let kill = format!("{p}:kill");
                match &reason {
                    Some(r) => pipe.cmd("HSET").arg(&kill).arg(&target).arg(r).ignore(),
                    None => pipe.cmd("HDEL").arg(&kill).arg(&target).ignore(),
                };
                let seq = format!("{p}:seq");
                pipe.cmd("HINCRBY").arg(&seq).arg("n").arg(1);
                pipe.cmd("HGET").arg(&seq).arg("e");
                let (n, epoch): (u64, Option<String>) =
                    tokio::time::timeout(self.config.call_timeout, pipe.query_async(&mut conn))
                        .await
                        .map_err(|_| StoreError::Unavailable("kill switch call timed out".into()))?
                        .map_err(unavailable)?;
                mark.saw(epoch.as_deref().unwrap_or_default(), n);
            }
            self.confirm(&mut conn, wait).await
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
        let inv = admit_invocation(
            &self.shards[0],
            plan,
            self.config.retention_ms,
            self.wall_now(),
        );
        decision(plan, self.batched(0, "a", inv).await?)
    }

    async fn admit_shadowed(
        &self,
        plan: &Plan,
        shadow: &Plan,
    ) -> Result<(Decision, ShadowOutcome), StoreError> {
        if self.shards.len() > 1 {
            return self.admit_shadow_apart(plan, shadow).await;
        }
        let inv = admit_shadowed_invocation(
            &self.shards[0],
            plan,
            shadow,
            self.config.retention_ms,
            self.wall_now(),
        );
        shadowed(plan, shadow, self.batched(0, "s", inv).await?)
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
        self.usage_of(scope_id, period, None)
    }

    fn usage_carrying(
        &self,
        scope_id: &str,
        period: Period,
        carry: (u64, u64),
    ) -> impl Future<Output = Result<ScopeUsage, StoreError>> + Send {
        self.usage_of(scope_id, Some(period), Some(carry))
    }

    fn claim_key(
        &self,
        key: tollgate_core::KeyUse<'_>,
    ) -> impl Future<Output = Result<tollgate_core::KeyClaim, StoreError>> + Send {
        self.claim_key_in(key)
    }

    fn end_claim(
        &self,
        key: &str,
        request_id: &str,
        response: Option<&[u8]>,
        keep_ms: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.end_claim_in(key, request_id, response, keep_ms)
    }
}
