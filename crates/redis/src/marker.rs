//! The marker of each shard's prefix, read and written outside admissions: what an instance
//! finds at start, what its watcher reads while it is idle, and an operator's initialisation of
//! a new store (see `state_v1.lua`).

use std::sync::atomic::Ordering;

use tollgate_core::{StoreError, StoreState};

use crate::RedisStore;

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
            let seen = self
                .markers
                .get(shard)
                .is_some_and(|m| m.load(Ordering::Relaxed));
            let (answer, found) = self
                .marker_call(prefix, "watch", if seen { "1" } else { "0" })
                .await?;
            let state = match answer.as_str() {
                "kept" if found != crate::SCHEMA => {
                    return Err(StoreError::OtherSchema {
                        found,
                        ours: crate::SCHEMA.to_owned(),
                    });
                }
                "kept" => {
                    if let Some(m) = self.markers.get(shard) {
                        m.store(true, Ordering::Relaxed);
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
        Ok(worst)
    }

    /// Initialises a new store: writes the marker of every shard that has neither a marker nor
    /// a recorded loss. True when a marker was written, false when every shard had one already;
    /// [`StoreError::StateLost`] when a shard's loss is written down (that is acknowledged, not
    /// initialised over). The caller decides that the store is new, not forgetful.
    pub async fn initialise(&self) -> Result<bool, StoreError> {
        let mut wrote = false;
        for (shard, prefix) in self.shards.iter().enumerate() {
            let (answer, found) = self.marker_call(prefix, "init", "0").await?;
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
                m.store(true, Ordering::Relaxed);
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

    /// One call of `state_v1.lua`: its state and the marker's value.
    async fn marker_call(
        &self,
        prefix: &str,
        op: &str,
        seen: &str,
    ) -> Result<(String, String), StoreError> {
        let keys = [format!("{prefix}:marker"), format!("{prefix}:lost")];
        let keys = [keys[0].as_str(), keys[1].as_str()];
        let mut conn = self.conn.clone();
        tokio::time::timeout(
            self.config.call_timeout,
            fcall::<(String, String)>(
                &mut conn,
                Function::State,
                &keys,
                &[op, seen, crate::SCHEMA],
            ),
        )
        .await
        .map_err(|_| no_answer(self.config.call_timeout))?
        .map_err(unavailable)
    }
}
