//! Records the gateway sets at run time and every instance reads: virtual keys issued at run time
//! (`P:keys`, each key's id to its version and record, written by `records.lua`) and limits
//! set for one value (`P:lim`). Each set is one hash on the first shard's prefix, with a version field that every
//! change raises, so that an instance reads the whole hash again only when something changed.

use redis::Value;
use tollgate_core::StoreError;
pub use tollgate_core::keeper::{KeyPut, KeyWrite, RecordSet};

use crate::conn::{Function, fcall, no_answer, unavailable};
use crate::decode::{items, text};
use crate::store::RedisStore;

/// The hash field that holds the version (a digest is hex, never this).
const VERSION: &str = "~version";

impl RedisStore {
    fn record_hash(&self, set: RecordSet) -> String {
        let name = match set {
            RecordSet::IssuedKeys => "keys",
            RecordSet::Limits => "lim",
        };
        format!("{}:{name}", self.prefix_of(0))
    }

    /// The records of `set` and their version, unless the version is still `known`.
    pub async fn records(
        &self,
        set: RecordSet,
        known: u64,
    ) -> Result<Option<(u64, Vec<(String, String)>)>, StoreError> {
        let hash = self.record_hash(set);
        let mut conn = self.conn.clone();
        let call = async {
            let v: Option<u64> = redis::cmd("HGET")
                .arg(&hash)
                .arg(VERSION)
                .query_async(&mut conn)
                .await?;
            if v.unwrap_or(0) == known {
                return Ok(None);
            }
            let all: Value = redis::cmd("HGETALL")
                .arg(&hash)
                .query_async(&mut conn)
                .await?;
            Ok::<_, redis::RedisError>(Some(all))
        };
        let all = tokio::time::timeout(self.config.call_timeout, call)
            .await
            .map_err(|_| no_answer(self.config.call_timeout))?
            .map_err(unavailable)?;
        let Some(all) = all else { return Ok(None) };
        let pairs: Vec<(String, String)> = redis::from_redis_value(all)
            .map_err(|e| StoreError::Protocol(format!("records: {e}")))?;
        let mut version = 0;
        let mut keys = Vec::with_capacity(pairs.len());
        for (field, value) in pairs {
            if field == VERSION {
                version = value.parse().unwrap_or(0);
            } else {
                keys.push((field, value));
            }
        }
        Ok(Some((version, keys)))
    }

    /// Writes (`Some(record)`) or deletes (`None`) records of `set` by field, together, and raises
    /// the version by `step` (1 to 2^32, chosen at random by the caller: a hash the store
    /// forgot starts again from 0, and a random step keeps an instance that knew an old version
    /// from meeting the same number again); answers the new version.
    pub async fn write_records(
        &self,
        set: RecordSet,
        changes: &[(String, Option<String>)],
        step: u32,
    ) -> Result<u64, StoreError> {
        let hash = self.record_hash(set);
        let mut pipe = redis::pipe();
        pipe.atomic();
        for (digest, record) in changes {
            match record {
                Some(r) => pipe.cmd("HSET").arg(&hash).arg(digest).arg(r).ignore(),
                None => pipe.cmd("HDEL").arg(&hash).arg(digest).ignore(),
            };
        }
        pipe.cmd("HINCRBY")
            .arg(&hash)
            .arg(VERSION)
            .arg(u64::from(step.max(1)));
        let seq = format!("{}:seq", self.prefix_of(0));
        pipe.cmd("HINCRBY").arg(&seq).arg("n").arg(1);
        pipe.cmd("HGET").arg(&seq).arg("e");
        let (mut conn, wait) = self.writer().await?;
        let (version, n, epoch): (u64, u64, Option<String>) =
            tokio::time::timeout(self.config.call_timeout, pipe.query_async(&mut conn))
                .await
                .map_err(|_| no_answer(self.config.call_timeout))?
                .map_err(unavailable)?;
        if let Some(m) = self.markers.first() {
            m.saw(epoch.as_deref().unwrap_or_default(), n);
        }
        self.confirm(&mut conn, wait).await?;
        Ok(version)
    }
}

/// Every reply kind of `records.lua`'s writes.
pub const RECORD_REPLIES: [&str; 4] = ["done", "changed", "late", "lost"];

impl RedisStore {
    fn record_keys(&self) -> [String; 4] {
        let p = self.prefix_of(0);
        [
            self.record_hash(RecordSet::IssuedKeys),
            format!("{p}:marker"),
            format!("{p}:lost"),
            format!("{p}:seq"),
        ]
    }

    /// One write of `records.lua`; with `confirm`, confirmed by a replica when `done` says
    /// it wrote (a change, not a copy of the ledger's).
    async fn records_call(
        &self,
        args: &[&str],
        confirm: bool,
        done: impl Fn(&[Value]) -> bool,
    ) -> Result<Vec<Value>, StoreError> {
        let keys = self.record_keys();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let (mut conn, wait) = if confirm {
            self.writer().await?
        } else {
            (self.conn.clone(), false)
        };
        let reply: Value = tokio::time::timeout(
            self.config.call_timeout,
            fcall(&mut conn, Function::Records, &keys, args),
        )
        .await
        .map_err(|_| no_answer(self.config.call_timeout))?
        .map_err(unavailable)?;
        let reply = items(reply)?;
        self.confirm(&mut conn, wait && done(&reply)).await?;
        Ok(reply)
    }

    /// Key `id`'s version (0: none) and record, and the store's time (ms): read commands only,
    /// which a store that holds its writes (`CLIENT PAUSE WRITE`) still answers.
    pub async fn key_record(&self, id: &str) -> Result<(u64, Option<String>, u64), StoreError> {
        let hash = self.record_hash(RecordSet::IssuedKeys);
        let mut pipe = redis::pipe();
        pipe.cmd("HGET").arg(&hash).arg(id).cmd("TIME");
        let mut conn = self.conn.clone();
        let (held, (secs, micros)): (Option<String>, (u64, u64)) =
            tokio::time::timeout(self.config.call_timeout, pipe.query_async(&mut conn))
                .await
                .map_err(|_| no_answer(self.config.call_timeout))?
                .map_err(unavailable)?;
        let at = secs.saturating_mul(1000).saturating_add(micros / 1000);
        let Some(held) = held else {
            return Ok((0, None, at));
        };
        let (version, record) = held
            .split_once(' ')
            .ok_or_else(|| StoreError::Protocol(format!("key {id:?}: no version")))?;
        let version = version
            .parse()
            .map_err(|_| StoreError::Protocol(format!("key {id:?}: version {version:?}")))?;
        Ok((version, Some(record.to_owned()), at))
    }

    /// Writes key `id`'s record at `version`, as `how` says.
    pub async fn put_key(
        &self,
        id: &str,
        (version, record): (u64, &str),
        how: KeyWrite,
        step: u32,
    ) -> Result<KeyPut, StoreError> {
        let mark = self.markers.first();
        let seen = mark.is_some_and(|m| m.seen());
        let (expected, deadline) = match how {
            KeyWrite::Swap { expected, deadline } => (expected.to_string(), deadline.to_string()),
            KeyWrite::Copy | KeyWrite::Rebuild => (String::new(), String::new()),
        };
        let seen = match (how, seen) {
            (KeyWrite::Rebuild, _) => "r".to_owned(),
            (_, true) => mark.map_or_else(|| "1".to_owned(), |m| m.arg("1")),
            (_, false) => "0".to_owned(),
        };
        let (version, step) = (version.to_string(), u64::from(step.max(1)).to_string());
        let reply = self
            .records_call(
                &[
                    "put", id, &version, record, &expected, &deadline, &step, &seen,
                ],
                matches!(how, KeyWrite::Swap { .. }),
                |r| r.first().and_then(|w| text(w).ok()).as_deref() == Some("done"),
            )
            .await?;
        let word = reply.first().map(text).transpose()?;
        Ok(match word.as_deref() {
            Some("done") => {
                if let (Some(m), Some(epoch), Some(n)) = (mark, reply.get(1), reply.get(2)) {
                    m.saw(
                        &text(epoch)?,
                        u64::try_from(crate::decode::int(n)?).unwrap_or(0),
                    );
                }
                KeyPut::Done
            }
            Some("late") => KeyPut::Late,
            Some("lost") => KeyPut::Lost,
            Some("changed") => KeyPut::Changed(
                reply
                    .get(1)
                    .map(text)
                    .transpose()?
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
            ),
            other => {
                return Err(StoreError::Protocol(format!(
                    "records: unknown answer {other:?}"
                )));
            }
        })
    }

    /// The records of the hash issued keys were kept in by digest before they were kept by
    /// id (`P:vk`), to be carried over; `drop_legacy_keys` removes it once they are.
    pub async fn legacy_keys(&self) -> Result<Vec<(String, String)>, StoreError> {
        let hash = format!("{}:vk", self.prefix_of(0));
        let mut conn = self.conn.clone();
        let all: Vec<(String, String)> = tokio::time::timeout(
            self.config.call_timeout,
            redis::cmd("HGETALL").arg(&hash).query_async(&mut conn),
        )
        .await
        .map_err(|_| no_answer(self.config.call_timeout))?
        .map_err(unavailable)?;
        Ok(all.into_iter().filter(|(f, _)| f != VERSION).collect())
    }

    /// Removes the hash of issued keys by digest (see [`RedisStore::legacy_keys`]).
    pub async fn drop_legacy_keys(&self) -> Result<(), StoreError> {
        let hash = format!("{}:vk", self.prefix_of(0));
        let mut conn = self.conn.clone();
        let _: i64 = tokio::time::timeout(
            self.config.call_timeout,
            redis::cmd("DEL").arg(&hash).query_async(&mut conn),
        )
        .await
        .map_err(|_| no_answer(self.config.call_timeout))?
        .map_err(unavailable)?;
        Ok(())
    }
}
