//! What slices keep: the store's own keeping, but for the expiries of requests admitted here,
//! which expire here (the slices' own expiries are the store's).

use super::{SliceSource, Sliced};
use tollgate_core::clock::Clock;
use tollgate_core::keeper::{ExpiryTag, Keeper};
use tollgate_core::store::{Expiry, StoreError};

/// A [`Keeper`] call on the store the slices are leased from.
macro_rules! inner {
    (now $s:ident, $m:ident($($a:expr),*)) => {
        Keeper::$m($s.inner() $(, $a)*)
    };
    (await $s:ident, $m:ident($($a:expr),*)) => {
        Keeper::$m($s.inner() $(, $a)*).await
    };
}

impl<S: SliceSource + Keeper, C: Clock + Clone + 'static> Keeper for Sliced<S, C> {
    tollgate_core::forward_keeper!(inner);

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
}
