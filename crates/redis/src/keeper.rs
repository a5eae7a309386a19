//! The store's [`Keeper`]: what a shared store keeps beyond admission, each method one of the
//! store's own calls (marker.rs, books.rs, issued.rs and the notes in store.rs).

use std::time::Duration;

use tollgate_core::keeper::{KeyPut, KeyWrite, Mark, PeriodRef, RecordSet, Records};
use tollgate_core::{Expiry, ExpiryTag, Keeper, Loss, StoreError, StoreState};

use crate::store::RedisStore;

impl Keeper for RedisStore {
    fn is_shared(&self) -> bool {
        true
    }

    fn call_timeout(&self) -> Duration {
        RedisStore::call_timeout(self)
    }

    async fn state(&self) -> Result<StoreState, StoreError> {
        RedisStore::state(self).await
    }

    async fn initialise(&self) -> Result<bool, StoreError> {
        RedisStore::initialise(self).await
    }

    async fn mark_lost(&self) -> Result<(), StoreError> {
        RedisStore::mark_lost(self).await
    }

    async fn acknowledge_loss(&self) -> Result<(), StoreError> {
        RedisStore::acknowledge_loss(self).await
    }

    fn loss_cause(&self) -> Option<Loss> {
        RedisStore::loss_cause(self)
    }

    fn high_marks(&self) -> Vec<Mark> {
        RedisStore::high_marks(self)
    }

    fn prime_marks(&self, marks: &[Mark]) {
        RedisStore::prime_marks(self, marks);
    }

    async fn ping(&self) -> Result<(), StoreError> {
        RedisStore::ping(self).await
    }

    async fn keep_expiries(&self) -> Result<(), StoreError> {
        RedisStore::keep_expiries(self).await
    }

    async fn expiries(&self, max: usize) -> Result<Vec<(ExpiryTag, Expiry)>, StoreError> {
        Ok(RedisStore::expiries(self, max)
            .await?
            .into_iter()
            .map(|((shard, entry), e)| (ExpiryTag::Shared(shard, entry), e))
            .collect())
    }

    async fn ack_expiries(&self, tags: Vec<ExpiryTag>) -> Result<(), StoreError> {
        let ours: Vec<crate::books::ExpiryTag> = tags
            .into_iter()
            .filter_map(|t| match t {
                ExpiryTag::Shared(shard, entry) => Some((shard, entry)),
                ExpiryTag::Local(_) => None,
            })
            .collect();
        RedisStore::ack_expiries(self, &ours).await
    }

    async fn charge_forgotten(
        &self,
        scope_id: &str,
        field: &str,
        end_ms: u64,
        amount: u64,
    ) -> Result<(), StoreError> {
        self.add_settled(scope_id, field, end_ms, amount).await
    }

    async fn restore_settled(
        &self,
        scope_id: &str,
        (_, _, field): PeriodRef<'_>,
        end_ms: u64,
        amount: u64,
    ) -> Result<(), StoreError> {
        self.add_settled(scope_id, field, end_ms, amount).await
    }

    async fn put_note(&self, name: &str, value: u64, ttl: Duration) -> Result<(), StoreError> {
        RedisStore::put_note(self, name, value, ttl).await
    }

    async fn note(&self, name: &str) -> Result<Option<u64>, StoreError> {
        RedisStore::note(self, name).await
    }

    async fn put_text(&self, name: &str, value: &str, ttl: Duration) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut set = redis::cmd("SET");
        set.arg(crate::encode::key(self.shard_prefix(name), "t", name))
            .arg(value)
            .arg("PX")
            .arg(ms);
        tokio::time::timeout(self.config.call_timeout, set.query_async::<()>(&mut conn))
            .await
            .map_err(|_| StoreError::Unavailable("SET timed out".into()))?
            .map_err(crate::conn::unavailable)
    }

    async fn text(&self, name: &str) -> Result<Option<String>, StoreError> {
        let mut conn = self.conn.clone();
        let mut get = redis::cmd("GET");
        get.arg(crate::encode::key(self.shard_prefix(name), "t", name));
        let get = get.query_async::<Option<String>>(&mut conn);
        tokio::time::timeout(self.config.call_timeout, get)
            .await
            .map_err(|_| StoreError::Unavailable("GET timed out".into()))?
            .map_err(crate::conn::unavailable)
    }

    async fn records(&self, set: RecordSet, known: u64) -> Result<Option<Records>, StoreError> {
        RedisStore::records(self, set, known).await
    }

    async fn write_records(
        &self,
        set: RecordSet,
        changes: &[(String, Option<String>)],
        step: u32,
    ) -> Result<u64, StoreError> {
        RedisStore::write_records(self, set, changes, step).await
    }

    async fn key_record(&self, id: &str) -> Result<(u64, Option<String>, u64), StoreError> {
        RedisStore::key_record(self, id).await
    }

    async fn put_key(
        &self,
        id: &str,
        record: (u64, &str),
        how: KeyWrite,
        step: u32,
    ) -> Result<KeyPut, StoreError> {
        RedisStore::put_key(self, id, record, how, step).await
    }

    async fn legacy_keys(&self) -> Result<Vec<(String, String)>, StoreError> {
        RedisStore::legacy_keys(self).await
    }

    async fn drop_legacy_keys(&self) -> Result<(), StoreError> {
        RedisStore::drop_legacy_keys(self).await
    }
}
