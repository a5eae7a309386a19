//! The marker of each shard's prefix, read and written outside admissions: what an instance
//! finds at start, what its watcher reads while it is idle, and an operator's initialisation of
//! a new store (see `state_v1.lua`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tollgate_core::{Loss, StoreError, StoreState};

use crate::RedisStore;

/// What this store has seen of one shard: its marker (once seen, its absence means the store
/// forgot), and the highest write sequence of the store's epoch (`seq_v1.lua`: a store behind
/// it went back in time).
#[derive(Debug, Default)]
pub struct Mark {
    seen: AtomicBool,
    /// The store's epoch and the highest `n` seen in it.
    high: Mutex<Option<(String, u64)>>,
    /// Why the store was found lost at its last answer (none when it was not).
    cause: Mutex<Option<Loss>>,
}

impl Mark {
    pub(crate) fn seen(&self) -> bool {
        self.seen.load(Ordering::Relaxed)
    }

    pub(crate) fn set_seen(&self) {
        self.seen.store(true, Ordering::Relaxed);
    }

    /// The scripts' `seen` argument: `flag`, and the sequence seen once there is one.
    pub(crate) fn arg(&self, flag: &str) -> String {
        match self.high().filter(|(e, _)| !e.is_empty()) {
            Some((epoch, n)) => format!("{flag}:{epoch}:{n}"),
            None => flag.to_owned(),
        }
    }

    /// A reply's sequence: the highest of an epoch is kept; another epoch (a store initialised
    /// or its loss acknowledged since) starts again from its own.
    pub(crate) fn saw(&self, epoch: &str, n: u64) {
        if epoch.is_empty() {
            return;
        }
        if let Ok(mut h) = self.high.lock() {
            match &mut *h {
                Some((e, high)) if e == epoch => *high = (*high).max(n),
                other => *other = Some((epoch.to_owned(), n)),
            }
        }
    }

    /// What the store's loss flag said at its last answer ('' when it was not lost).
    pub(crate) fn found(&self, why: &str) {
        if let Ok(mut c) = self.cause.lock() {
            *c = (!why.is_empty()).then(|| read_loss(why));
        }
    }

    /// The epoch and the highest sequence seen in it.
    pub(crate) fn high(&self) -> Option<(String, u64)> {
        self.high.lock().ok().and_then(|h| h.clone())
    }
}

/// The schema of what the scripts keep under a prefix, written as its marker's value (`SCHEMA`
/// in `common_v7.lua`): instances of another schema refuse to start on the prefix.
pub const SCHEMA: &str = "7.6";
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
                "kept" if found != crate::SCHEMA => {
                    return Err(StoreError::OtherSchema {
                        found,
                        ours: crate::SCHEMA.to_owned(),
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
                "kept" if found != crate::SCHEMA => {
                    return Err(StoreError::OtherSchema {
                        found,
                        ours: crate::SCHEMA.to_owned(),
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

    /// One call of `state_v1.lua`: its state and the marker's value. The store's sequence is
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
                &[op, seen, crate::SCHEMA],
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

/// The loss a flag's cause names.
fn read_loss(why: &str) -> Loss {
    let mut w = why.split(' ');
    match (w.next(), w.next(), w.next(), w.next()) {
        (Some("behind"), Some(epoch), Some(store), Some(seen)) => Loss::Behind {
            epoch: epoch.to_owned(),
            store: store.parse().unwrap_or(0),
            seen: seen.parse().unwrap_or(0),
        },
        (Some("history"), Some(id), Some(ended), Some(seen)) => Loss::CutShort {
            history: id.to_owned(),
            ended: ended.parse().unwrap_or(0),
            seen: seen.parse().unwrap_or(0),
        },
        _ => Loss::Forgot,
    }
}
