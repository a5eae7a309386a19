//! Issued keys, one record by id with a version (`tollgate_key_records`): where a ledger is
//! configured, it is the keys' one truth, and every change is a compare-and-set on the version.

use crate::{Ledger, LedgerError};

/// What a compare-and-set found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Swap {
    /// The record was written.
    Done,
    /// The record was not at the version expected: it holds this one (0: none).
    Changed(u64),
}

fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn unsigned(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

impl Ledger {
    /// The record of key `id` and its version, if it has one.
    pub async fn key_record(&self, id: &str) -> Result<Option<(u64, String)>, LedgerError> {
        let c = self.inner.conn.get().await?;
        let row = c
            .query_opt(
                "SELECT version, record FROM tollgate_key_records WHERE id = $1",
                &[&id],
            )
            .await
            .map_err(|e| self.inner.conn.failed(e))?;
        row.map(|r| Ok((unsigned(r.try_get(0)?), r.try_get(1)?)))
            .transpose()
    }

    /// Every key's record: (id, version, record).
    pub async fn key_records(&self) -> Result<Vec<(String, u64, String)>, LedgerError> {
        let c = self.inner.conn.get().await?;
        let rows = c
            .query(
                "SELECT id, version, record FROM tollgate_key_records ORDER BY id",
                &[],
            )
            .await
            .map_err(|e| self.inner.conn.failed(e))?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, unsigned(r.try_get(1)?), r.try_get(2)?)))
            .collect()
    }

    /// Writes key `id`'s record at `version` if it is at `expected` (0: it has none), in one
    /// statement.
    pub async fn swap_key(
        &self,
        id: &str,
        expected: u64,
        (version, record): (u64, &str),
        at_ms: i64,
    ) -> Result<Swap, LedgerError> {
        let c = self.inner.conn.get().await?;
        let (version, expected) = (signed(version), signed(expected));
        let written = if expected == 0 {
            c.execute(
                "INSERT INTO tollgate_key_records (id, version, record, at_ms) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT (id) DO NOTHING",
                &[&id, &version, &record, &at_ms],
            )
            .await
        } else {
            c.execute(
                "UPDATE tollgate_key_records SET version = $2, record = $3, at_ms = $4 \
                 WHERE id = $1 AND version = $5",
                &[&id, &version, &record, &at_ms, &expected],
            )
            .await
        }
        .map_err(|e| self.inner.conn.failed(e))?;
        if written == 1 {
            return Ok(Swap::Done);
        }
        let held = self.key_record(id).await?.map_or(0, |(v, _)| v);
        Ok(Swap::Changed(held))
    }
}
