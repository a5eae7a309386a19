//! Idempotency keys in Redis (`keys.lua`): one hash per key, in the shard its id hashes to,
//! claimed and ended each in one script call, so instances sharing the store agree on who
//! holds a key. Redis bounds their memory by their expiry: an unanswered claim lives its
//! in-flight time, an answer its keep time.

use redis::Value;
use tollgate_core::{KeyClaim, KeyUse, StoreError};

use crate::conn::{Function, query};
use crate::decode::{items, text};
use crate::encode::{key, num};
use crate::shards::shard_of;
use crate::store::RedisStore;

/// Every reply kind of `keys.lua`.
pub const KEY_REPLIES: [&str; 6] = [
    "claimed",
    "in_flight",
    "conflict",
    "answered",
    "ended",
    "not_owner",
];

impl RedisStore {
    fn key_of(&self, k: &str) -> String {
        key(&self.shards[shard_of(k, self.shards.len())], "ik", k)
    }

    /// One call of the library's `keys` function (`keys.lua`) on `k` (the response goes as
    /// bytes: an upstream's answer need not be UTF-8).
    async fn keys_call(
        &self,
        k: &str,
        args: &[&str],
        response: Option<&[u8]>,
    ) -> Result<Vec<Value>, StoreError> {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(Function::Keys.name())
            .arg(1)
            .arg(self.key_of(k))
            .arg(args);
        if let Some(r) = response {
            cmd.arg(r);
        }
        let mut conn = self.conn.clone();
        let reply: Value = tokio::time::timeout(self.config.call_timeout, query(&mut conn, &cmd))
            .await
            .map_err(|_| StoreError::Unavailable("idempotency key call timed out".into()))?
            .map_err(crate::conn::unavailable)?;
        items(reply)
    }

    pub(crate) async fn claim_key_in(&self, k: KeyUse<'_>) -> Result<KeyClaim, StoreError> {
        let ms = num(k.in_flight_ms.max(1));
        let reply = self
            .keys_call(k.key, &["claim", k.digest, k.request_id, &ms], None)
            .await?;
        match reply.first().map(text).transpose()?.as_deref() {
            Some("claimed") => Ok(KeyClaim::Claimed),
            Some("in_flight") => Ok(KeyClaim::InFlight),
            Some("conflict") => Ok(KeyClaim::Conflict),
            Some("answered") => match reply.get(1) {
                Some(Value::BulkString(b)) => Ok(KeyClaim::Answered(b.clone())),
                other => Err(StoreError::Protocol(format!(
                    "an answered key without its response: {other:?}"
                ))),
            },
            other => Err(StoreError::Protocol(format!(
                "unknown key claim reply {other:?}"
            ))),
        }
    }

    pub(crate) async fn end_claim_in(
        &self,
        k: &str,
        request_id: &str,
        response: Option<&[u8]>,
        keep_ms: u64,
    ) -> Result<(), StoreError> {
        let ms = num(keep_ms.max(1));
        let reply = self
            .keys_call(k, &["end", request_id, &ms], response)
            .await?;
        match reply.first().map(text).transpose()?.as_deref() {
            Some("ended" | "not_owner") => Ok(()),
            other => Err(StoreError::Protocol(format!(
                "unknown key end reply {other:?}"
            ))),
        }
    }
}
