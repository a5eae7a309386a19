//! The marker of each shard's prefix, read and written outside admissions: what an instance
//! finds at start, what its watcher reads while it is idle, and an operator's initialisation of
//! a new store (see `state.lua`).

use tollgate_core::{Loss, StoreError, StoreState};

use crate::mark::SCHEMA;
use crate::store::RedisStore;

use crate::conn::{Function, fcall, no_answer, unavailable};

impl RedisStore {
    /// What the markers say, the worst over every shard. A marker this store had seen and finds
    /// gone is written down as a loss, for every instance to find, as an admission would.
    pub async fn state(&self) -> Result<StoreState, StoreError> {
        let mut worst = StoreState::Kept;
        for (shard, prefix) in self.shards.iter().enumerate() {
            let mark = self.markers.get(shard);
            let seen = mark.map_or_else(String::new, |m| m.arg(if m.seen() { "1" } else { "0" }));
            let (answer, found) = self.marker_call(shard, prefix, "watch", &seen).await?;
            let state = match answer.as_str() {
                "kept" if found != SCHEMA => {
                    return Err(StoreError::OtherSchema {
                        found,
                        ours: SCHEMA.to_owned(),
                    });
                }
                "kept" => {
                    if let Some(m) = self.markers.get(shard) {
                        m.set_seen();
                    }
                    StoreState::Kept
                }
                "lost" => StoreState::Lost,
                "uninitialised" => StoreState::Uninitialised,
                other => {
                    return Err(StoreError::Protocol(format!(
                        "unknown marker answer {other:?}"
                    )));
                }
            };
            worst = match (worst, state) {
                (StoreState::Lost, _) | (_, StoreState::Lost) => StoreState::Lost,
                (StoreState::Uninitialised, _) | (_, StoreState::Uninitialised) => {
                    StoreState::Uninitialised
                }
                _ => StoreState::Kept,
            };
        }
        // The replication history, in the epoch the markers' answers gave.
        let epoch = self.markers.first().and_then(|m| m.high()).map(|(e, _)| e);
        if worst == StoreState::Kept && self.check_history(epoch).await? {
            worst = StoreState::Lost;
        }
        Ok(worst)
    }

    /// Initialises a new store: writes the marker of every shard that has neither a marker nor
    /// a recorded loss. True when a marker was written, false when every shard had one already;
    /// [`StoreError::StateLost`] when a shard's loss is written down (that is acknowledged, not
    /// initialised over). The caller decides that the store is new, not forgetful.
    pub async fn initialise(&self) -> Result<bool, StoreError> {
        let mut wrote = false;
        for (shard, prefix) in self.shards.iter().enumerate() {
            let (answer, found) = self.marker_call(shard, prefix, "init", "0").await?;
            match answer.as_str() {
                "initialised" => wrote = true,
                "kept" if found != SCHEMA => {
                    return Err(StoreError::OtherSchema {
                        found,
                        ours: SCHEMA.to_owned(),
                    });
                }
                "kept" => {}
                "lost" => return Err(StoreError::StateLost),
                other => {
                    return Err(StoreError::Protocol(format!(
                        "unknown marker answer {other:?}"
                    )));
                }
            }
            if let Some(m) = self.markers.get(shard) {
                m.set_seen();
            }
        }
        Ok(wrote)
    }

    /// Writes a loss down on every shard: the store is empty, and durable evidence says it held
    /// books.
    pub async fn mark_lost(&self) -> Result<(), StoreError> {
        for prefix in self.shards.iter() {
            let mut conn = self.conn.clone();
            tokio::time::timeout(
                self.config.call_timeout,
                redis::cmd("SET")
                    .arg(format!("{prefix}:lost"))
                    .arg("1")
                    .query_async::<()>(&mut conn),
            )
            .await
            .map_err(|_| no_answer(self.config.call_timeout))?
            .map_err(unavailable)?;
        }
        Ok(())
    }

    /// One call of `state.lua`: its state and the marker's value. The store's sequence is
    /// taken as seen, and why a lost store is lost kept for [`RedisStore::loss_cause`].
    async fn marker_call(
        &self,
        shard: usize,
        prefix: &str,
        op: &str,
        seen: &str,
    ) -> Result<(String, String), StoreError> {
        let keys = ["marker", "lost", "seq"].map(|k| format!("{prefix}:{k}"));
        let keys = keys.each_ref().map(String::as_str);
        let mut conn = self.conn.clone();
        let (state, found, epoch, n, why) = tokio::time::timeout(
            self.config.call_timeout,
            fcall::<(String, String, String, u64, String)>(
                &mut conn,
                Function::State,
                &keys,
                &[op, seen, SCHEMA],
            ),
        )
        .await
        .map_err(|_| no_answer(self.config.call_timeout))?
        .map_err(unavailable)?;
        if let Some(m) = self.markers.get(shard) {
            if state != "lost" {
                m.saw(&epoch, n);
            }
            m.found(&why);
        }
        Ok((state, found))
    }

    /// The connection for a change a replica must confirm, and whether it must ([`Self::confirm`]):
    /// when the store has replicas (`ROLE` lists them), a connection of its own, since `WAIT`
    /// counts the writes of its connection and holds it while it waits; else the shared one. A
    /// Redis Cluster, whose nodes each have their own replicas, is not waited for.
    pub(crate) async fn writer(&self) -> Result<(crate::conn::Conn, bool), StoreError> {
        use crate::conn::Conn;
        let Conn::Single(shared) = &self.conn else {
            return Ok((self.conn.clone(), false));
        };
        let timeout = self.config.call_timeout;
        let mut shared = shared.clone();
        let role: redis::Value =
            tokio::time::timeout(timeout, redis::cmd("ROLE").query_async(&mut shared))
                .await
                .map_err(|_| no_answer(timeout))?
                .map_err(unavailable)?;
        let replicas = match crate::decode::items(role)?.get(2) {
            Some(redis::Value::Array(r)) => r.len(),
            _ => 0,
        };
        if replicas == 0 {
            return Ok((self.conn.clone(), false));
        }
        let client = crate::conn::single_client(&self.config)?;
        let settings = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout.saturating_mul(2)))
            .set_number_of_retries(1);
        let own = redis::aio::ConnectionManager::new_with_config(client, settings);
        let own = tokio::time::timeout(timeout, own)
            .await
            .map_err(|_| no_answer(timeout))?
            .map_err(unavailable)?;
        Ok((Conn::Single(own), true))
    }

    /// After a change on `conn` ([`Self::writer`]): when `wait`, waits within half the call
    /// timeout for a replica to hold it; [`StoreError::NotReplicated`] when none does (the change is
    /// made on the primary).
    pub(crate) async fn confirm(
        &self,
        conn: &mut crate::conn::Conn,
        wait: bool,
    ) -> Result<(), StoreError> {
        if !wait {
            return Ok(());
        }
        // Half the call timeout: the change and its confirmation fit in the caller's wait.
        let timeout = self.config.call_timeout / 2;
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let acked: i64 = tokio::time::timeout(
            timeout.saturating_mul(2),
            redis::cmd("WAIT").arg(1).arg(ms).query_async(conn),
        )
        .await
        .map_err(|_| StoreError::NotReplicated(ms))?
        .map_err(unavailable)?;
        if acked < 1 {
            return Err(StoreError::NotReplicated(ms));
        }
        Ok(())
    }

    /// Why the store was found lost at its last answer, if it was.
    pub fn loss_cause(&self) -> Option<Loss> {
        self.markers
            .iter()
            .find_map(|m| m.cause.lock().ok().and_then(|c| c.clone()))
    }

    /// The epoch and highest write sequence this store has seen, per shard (for the ledger,
    /// so that a restarted instance knows them).
    pub fn high_marks(&self) -> Vec<Option<(String, u64)>> {
        self.markers.iter().map(|m| m.high()).collect()
    }

    /// Takes `marks` (per shard, from the ledger) as seen.
    pub fn prime_marks(&self, marks: &[Option<(String, u64)>]) {
        for (m, mark) in self.markers.iter().zip(marks) {
            if let Some((epoch, n)) = mark {
                m.saw(epoch, *n);
            }
        }
    }
}
