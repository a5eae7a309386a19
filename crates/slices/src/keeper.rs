//! What slices keep: the store's own keeping, but for the expiries of requests admitted here,
//! which expire here (the slices' own expiries are the store's).

use std::time::Duration;

use super::{SliceSource, Sliced};
use tollgate_core::clock::Clock;
use tollgate_core::keeper::{
    ExpiryTag, Keeper, KeyPut, KeyWrite, Loss, Mark, PeriodRef, RecordSet, Records,
};
use tollgate_core::store::{Expiry, StoreError, StoreState};

impl<S: SliceSource + Keeper, C: Clock + Clone + 'static> Keeper for Sliced<S, C> {
    fn is_shared(&self) -> bool {
        self.inner().is_shared()
    }

    fn call_timeout(&self) -> Duration {
        self.inner().call_timeout()
    }

    async fn state(&self) -> Result<StoreState, StoreError> {
        self.inner().state().await
    }

    async fn initialise(&self) -> Result<bool, StoreError> {
        self.inner().initialise().await
    }

    async fn mark_lost(&self) -> Result<(), StoreError> {
        self.inner().mark_lost().await
    }

    async fn acknowledge_loss(&self) -> Result<(), StoreError> {
        self.inner().acknowledge_loss().await
    }

    fn loss_cause(&self) -> Option<Loss> {
        self.inner().loss_cause()
    }

    fn high_marks(&self) -> Vec<Mark> {
        self.inner().high_marks()
    }

    fn prime_marks(&self, marks: &[Mark]) {
        self.inner().prime_marks(marks);
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner().ping().await
    }

    async fn keep_expiries(&self) -> Result<(), StoreError> {
        self.inner().keep_expiries().await
    }

    async fn expiries(&self, max: usize) -> Result<Vec<(ExpiryTag, Expiry)>, StoreError> {
        let mut out: Vec<(ExpiryTag, Expiry)> = self
            .local_expiries(max)?
            .into_iter()
            .map(|(t, e)| (ExpiryTag::Local(t), e))
            .collect();
        let left = max.saturating_sub(out.len());
        out.extend(self.inner().expiries(left).await?);
        Ok(out)
    }

    async fn ack_expiries(&self, tags: Vec<ExpiryTag>) -> Result<(), StoreError> {
        if let Some(last) = tollgate_core::keeper::last_local(&tags) {
            self.ack_local_expiries(last)?;
        }
        self.inner().ack_expiries(tags).await
    }

    async fn charge_forgotten(
        &self,
        scope_id: &str,
        field: &str,
        end_ms: u64,
        amount: u64,
    ) -> Result<(), StoreError> {
        self.inner()
            .charge_forgotten(scope_id, field, end_ms, amount)
            .await
    }

    async fn restore_settled(
        &self,
        scope_id: &str,
        period: PeriodRef<'_>,
        end_ms: u64,
        amount: u64,
    ) -> Result<(), StoreError> {
        self.inner()
            .restore_settled(scope_id, period, end_ms, amount)
            .await
    }

    async fn put_note(&self, name: &str, value: u64, ttl: Duration) -> Result<(), StoreError> {
        self.inner().put_note(name, value, ttl).await
    }

    async fn note(&self, name: &str) -> Result<Option<u64>, StoreError> {
        self.inner().note(name).await
    }

    async fn put_text(&self, name: &str, value: &str, ttl: Duration) -> Result<(), StoreError> {
        self.inner().put_text(name, value, ttl).await
    }

    async fn text(&self, name: &str) -> Result<Option<String>, StoreError> {
        self.inner().text(name).await
    }

    async fn records(&self, set: RecordSet, known: u64) -> Result<Option<Records>, StoreError> {
        self.inner().records(set, known).await
    }

    async fn write_records(
        &self,
        set: RecordSet,
        changes: &[(String, Option<String>)],
        step: u32,
    ) -> Result<u64, StoreError> {
        self.inner().write_records(set, changes, step).await
    }

    async fn key_record(&self, id: &str) -> Result<(u64, Option<String>, u64), StoreError> {
        self.inner().key_record(id).await
    }

    async fn put_key(
        &self,
        id: &str,
        record: (u64, &str),
        how: KeyWrite,
        step: u32,
    ) -> Result<KeyPut, StoreError> {
        self.inner().put_key(id, record, how, step).await
    }

    async fn legacy_keys(&self) -> Result<Vec<(String, String)>, StoreError> {
        self.inner().legacy_keys().await
    }

    async fn drop_legacy_keys(&self) -> Result<(), StoreError> {
        self.inner().drop_legacy_keys().await
    }
}
