//! What instances have seen of the store's write sequence (`tollgate_store_marks`): per shard,
//! the store's epoch and the highest sequence seen in it. An instance that starts takes them as
//! seen, so a store that went back in time while it was down is noticed as it would have been.

use crate::{Ledger, LedgerError};

/// One shard's mark: (shard, epoch, highest sequence).
pub type Mark = (usize, String, u64);

impl Ledger {
    /// Every shard's mark.
    pub async fn store_marks(&self) -> Result<Vec<Mark>, LedgerError> {
        let c = self.inner.conn.get().await?;
        let rows = c
            .query(
                "SELECT shard, epoch, high FROM tollgate_store_marks ORDER BY shard",
                &[],
            )
            .await
            .map_err(|e| self.inner.conn.failed(e))?;
        rows.iter()
            .map(|r| {
                let (shard, epoch, high): (i32, String, i64) =
                    (r.try_get(0)?, r.try_get(1)?, r.try_get(2)?);
                Ok((
                    usize::try_from(shard).unwrap_or(0),
                    epoch,
                    u64::try_from(high).unwrap_or(0),
                ))
            })
            .collect()
    }

    /// Raises each shard's mark to `marks`: within an epoch a mark only rises; another epoch
    /// (the store initialised or its loss acknowledged since) replaces it.
    pub async fn raise_store_marks(&self, marks: &[Mark]) -> Result<(), LedgerError> {
        let c = self.inner.conn.get().await?;
        for (shard, epoch, high) in marks {
            let shard = i32::try_from(*shard).unwrap_or(i32::MAX);
            let high = i64::try_from(*high).unwrap_or(i64::MAX);
            c.execute(
                "INSERT INTO tollgate_store_marks (shard, epoch, high) VALUES ($1, $2, $3)
                 ON CONFLICT (shard) DO UPDATE SET epoch = EXCLUDED.epoch,
                     high = CASE WHEN tollgate_store_marks.epoch = EXCLUDED.epoch
                         THEN GREATEST(tollgate_store_marks.high, EXCLUDED.high)
                         ELSE EXCLUDED.high END",
                &[&shard, epoch, &high],
            )
            .await
            .map_err(|e| self.inner.conn.failed(e))?;
        }
        Ok(())
    }
}
