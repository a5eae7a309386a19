//! Spend reports: endings summed by one dimension over a time range.

use crate::{Ledger, LedgerError};

/// What a report groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// Tenant.
    Tenant,
    /// Virtual key.
    Key,
    /// Model.
    Model,
    /// End user (digests).
    User,
    /// UTC day (`YYYY-MM-DD`).
    Day,
}

impl By {
    /// The SQL expression of the group (fixed text, never from input).
    fn column(self) -> &'static str {
        match self {
            By::Tenant => "tenant",
            By::Key => "key_id",
            By::Model => "model",
            By::User => "end_user",
            By::Day => "to_char(to_timestamp(at_ms / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
        }
    }
}

/// One group's spend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpendRow {
    /// The group (`-` for requests without one).
    pub group: String,
    /// Requests ended.
    pub requests: i64,
    /// Input tokens.
    pub input_tokens: i64,
    /// Output tokens.
    pub output_tokens: i64,
    /// Tool calls.
    pub tool_calls: i64,
    /// Cost in micro-USD (of the requests whose model has a price).
    pub cost_micro_usd: i64,
}

impl Ledger {
    /// Spend by `by` of the endings in `[from_ms, to_ms)`, largest cost first, then by group.
    pub async fn spend(
        &self,
        by: By,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<Vec<SpendRow>, LedgerError> {
        let c = self.inner.conn.get().await?;
        let sql = format!(
            "SELECT coalesce({g}, '-') AS grp, count(*), coalesce(sum(input_tokens), 0)::int8, \
             coalesce(sum(output_tokens), 0)::int8, coalesce(sum(tool_calls), 0)::int8, \
             coalesce(sum(cost_micro_usd), 0)::int8 FROM tollgate_endings \
             WHERE at_ms >= $1 AND at_ms < $2 GROUP BY grp ORDER BY 6 DESC, grp",
            g = by.column()
        );
        let rows = c
            .query(&sql, &[&from_ms, &to_ms])
            .await
            .map_err(|e| self.inner.conn.failed(e))?;
        rows.iter()
            .map(|r| {
                Ok(SpendRow {
                    group: r.try_get(0)?,
                    requests: r.try_get(1)?,
                    input_tokens: r.try_get(2)?,
                    output_tokens: r.try_get(3)?,
                    tool_calls: r.try_get(4)?,
                    cost_micro_usd: r.try_get(5)?,
                })
            })
            .collect()
    }
}
