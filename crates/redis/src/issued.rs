//! Records the gateway sets at run time and every instance reads: virtual keys issued at run time
//! (`P:vk`, the digest of each key's secret to its record) and limits set for one value
//! (`P:lim`). Each set is one hash on the first shard's prefix, with a version field that every
//! change raises, so that an instance reads the whole hash again only when something changed.

use redis::Value;
use tollgate_core::StoreError;

use crate::RedisStore;
use crate::conn::{no_answer, unavailable};

/// The hash field that holds the version (a digest is hex, never this).
const VERSION: &str = "~version";

/// A set of records kept at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordSet {
    /// Virtual keys issued at run time, by the digest of their secret.
    IssuedKeys,
    /// Limits set for one value, by scope and control.
    Limits,
}

impl RedisStore {
    fn record_hash(&self, set: RecordSet) -> String {
        let name = match set {
            RecordSet::IssuedKeys => "vk",
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
        let mut conn = self.conn.clone();
        let (version,): (u64,) =
            tokio::time::timeout(self.config.call_timeout, pipe.query_async(&mut conn))
                .await
                .map_err(|_| no_answer(self.config.call_timeout))?
                .map_err(unavailable)?;
        Ok(version)
    }
}
