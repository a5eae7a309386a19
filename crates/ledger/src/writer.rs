//! The one task that writes the buffer: a batch per transaction, put back and retried (with
//! backoff from 100 ms to 5 s) when PostgreSQL fails, so that nothing buffered is lost while the
//! process lives.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::Duration;

use std::pin::pin;

use tokio_postgres::Client;
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::{Entry, Ledger, LedgerError};

/// Called with the entries of a written batch that still have to reach the store
/// ([`Entry::apply_to_store`]), once they are in the ledger.
pub type AfterWrite =
    std::sync::Arc<dyn Fn(Vec<Entry>) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

impl Ledger {
    /// Starts the writer in the current runtime.
    pub fn spawn_writer(&self, after: Option<AfterWrite>) -> tokio::task::JoinHandle<()> {
        let ledger = self.clone();
        tokio::spawn(async move { ledger.write_forever(after).await })
    }

    async fn write_forever(self, after: Option<AfterWrite>) {
        let every = self.inner.settings.flush_every;
        let mut backoff = Duration::from_millis(100);
        // Failed writes since the last that succeeded: an outage is logged when it begins and
        // when it ends, not at every retry.
        let mut failures = 0u64;
        loop {
            let _ = tokio::time::timeout(every, self.inner.wake.notified()).await;
            loop {
                let batch = self.take();
                if batch.is_empty() {
                    break;
                }
                match self.write(&batch).await {
                    Ok(()) => {
                        backoff = Duration::from_millis(100);
                        if failures > 0 {
                            tracing::info!(
                                failed_writes = failures,
                                "ledger writes resumed; the endings buffered meanwhile are written"
                            );
                            failures = 0;
                        }
                        let n = batch.len();
                        self.inner.written.fetch_add(n as u64, Ordering::SeqCst);
                        metrics::counter!("tollgate_ledger_written_total").increment(n as u64);
                        let replay: Vec<Entry> =
                            batch.into_iter().filter(|e| e.apply_to_store).collect();
                        if let (Some(f), false) = (&after, replay.is_empty()) {
                            f(replay).await;
                        }
                        self.inner.buffered.fetch_sub(n, Ordering::Relaxed);
                    }
                    Err(e) => {
                        metrics::counter!("tollgate_ledger_write_failures_total").increment(1);
                        if failures == 0 {
                            tracing::error!(
                                cause = %e,
                                buffered = self.buffered(),
                                "ledger writes fail: endings are buffered and retried; \
                                 admissions are refused once the buffer is full"
                            );
                        }
                        failures += 1;
                        self.put_back(batch);
                        // The gauge stays live through the outage.
                        metrics::gauge!("tollgate_ledger_buffered").set(self.buffered() as f64);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                    }
                }
            }
            metrics::gauge!("tollgate_ledger_buffered").set(self.buffered() as f64);
        }
    }

    /// Writes `entries` now, in one transaction, past the buffer (what the caller must not lose
    /// until it is written, such as expiries it deletes from the store afterwards).
    pub async fn write_now(&self, entries: &[Entry]) -> Result<(), LedgerError> {
        self.write(entries).await?;
        let n = entries.len() as u64;
        self.inner.written.fetch_add(n, Ordering::SeqCst);
        metrics::counter!("tollgate_ledger_written_total").increment(n);
        Ok(())
    }

    /// Up to one batch from the front of the buffer, counted as being written.
    fn take(&self) -> Vec<Entry> {
        let Ok(mut q) = self.inner.queue.lock() else {
            return Vec::new();
        };
        let n = q.len().min(self.inner.settings.batch);
        q.drain(..n).collect()
    }

    /// A batch that failed goes back to the front, in its order (still counted as buffered).
    fn put_back(&self, batch: Vec<Entry>) {
        if let Ok(mut q) = self.inner.queue.lock() {
            for e in batch.into_iter().rev() {
                q.push_front(e);
            }
        }
    }

    async fn write(&self, batch: &[Entry]) -> Result<(), LedgerError> {
        // An id twice in one batch: its first ending stands, as it does across batches.
        let mut seen = std::collections::HashSet::with_capacity(batch.len());
        let firsts: Vec<&Entry> = batch
            .iter()
            .filter(|e| seen.insert(e.request_id.as_str()))
            .collect();
        let c = self.inner.writes.exclusive().await?;
        match copy(&c, &firsts).await {
            Ok(()) => Ok(()),
            // An id already in the ledger (an expiry two instances read, a batch whose commit
            // was not confirmed and is written again): the batch again, skipping those ids.
            Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => {
                metrics::counter!("tollgate_ledger_repeated_batches_total").increment(1);
                Ok(insert(&c, &firsts).await?)
            }
            Err(e) => Err(e.into()),
        }
    }
}

const COPY_ENDINGS: &str = "COPY tollgate_endings (request_id, ending, at_ms, tenant, key_id, \
     model, end_user, input_tokens, cached_tokens, output_tokens, tool_calls, cost_micro_usd) \
     FROM STDIN (FORMAT binary)";
const ENDING_TYPES: [Type; 12] = [
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::INT8,
    Type::INT8,
    Type::INT8,
    Type::INT8,
];
const COPY_CHARGES: &str = "COPY tollgate_charges (request_id, scope, label, period_ms, \
     period_id, period_start_ms, period_end_ms, unit, amount) FROM STDIN (FORMAT binary)";
const CHARGE_TYPES: [Type; 9] = [
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::INT8,
    Type::INT8,
    Type::INT8,
    Type::TEXT,
    Type::INT8,
];

/// The batch as binary `COPY` into both tables, in one transaction: the cheapest way in for
/// PostgreSQL (no arrays to unnest, no speculative insertion), and refused as a whole, by the
/// request id's key, when an id is already there.
async fn copy(c: &Client, batch: &[&Entry]) -> Result<(), tokio_postgres::Error> {
    c.batch_execute("BEGIN").await?;
    let endings = batch.iter().map(|e| ending_row(e));
    // Collected: an iterator of nested closures here makes the writer's future not `Send`
    // (closures' lifetimes are not inferred as general enough).
    let charges: Vec<_> = batch
        .iter()
        .flat_map(|e| e.charges.iter().map(move |ch| charge_row(e, ch)))
        .collect();
    let done = async {
        copy_rows(c, COPY_ENDINGS, &ENDING_TYPES, endings).await?;
        copy_rows(c, COPY_CHARGES, &CHARGE_TYPES, charges.into_iter()).await?;
        c.batch_execute("COMMIT").await
    }
    .await;
    if done.is_err() {
        // On a broken connection this fails too; the connection is made again on next use.
        let _ = c.batch_execute("ROLLBACK").await;
    }
    done
}

fn ending_row(e: &Entry) -> [&(dyn ToSql + Sync); 12] {
    [
        &e.request_id,
        &e.ending,
        &e.at_ms,
        &e.tenant,
        &e.key_id,
        &e.model,
        &e.end_user,
        &e.input_tokens,
        &e.cached_tokens,
        &e.output_tokens,
        &e.tool_calls,
        &e.cost_micro_usd,
    ]
}

fn charge_row<'a>(e: &'a Entry, ch: &'a crate::Charge) -> [&'a (dyn ToSql + Sync); 9] {
    [
        &e.request_id,
        &ch.scope,
        &ch.label,
        &ch.period_ms,
        &ch.period_id,
        &ch.period_start_ms,
        &ch.period_end_ms,
        &ch.unit,
        &ch.amount,
    ]
}

async fn copy_rows<'a, const N: usize>(
    c: &Client,
    statement: &str,
    types: &[Type; N],
    rows: impl Iterator<Item = [&'a (dyn ToSql + Sync); N]>,
) -> Result<(), tokio_postgres::Error> {
    let sink = c.copy_in(statement).await?;
    let mut writer = pin!(BinaryCopyInWriter::new(sink, types));
    for row in rows {
        writer.as_mut().write(&row).await?;
    }
    writer.as_mut().finish().await?;
    Ok(())
}

/// The whole batch in one statement (arrays unnested): the endings, then the charges of those
/// endings that were new. An id already in the ledger is left as it is, with its charges (the
/// stores end a request once; an expiry read by two instances is the same twice).
async fn insert(c: &Client, batch: &[&Entry]) -> Result<(), tokio_postgres::Error> {
    let col = |f: fn(&Entry) -> Option<&str>| batch.iter().map(|e| f(e)).collect::<Vec<_>>();
    let num = |f: fn(&Entry) -> i64| batch.iter().map(|e| f(e)).collect::<Vec<_>>();
    let ids: Vec<&str> = batch.iter().map(|e| e.request_id.as_str()).collect();
    let endings: Vec<&str> = batch.iter().map(|e| e.ending).collect();
    let costs: Vec<Option<i64>> = batch.iter().map(|e| e.cost_micro_usd).collect();
    let charges: Vec<(&str, &crate::Charge)> = batch
        .iter()
        .flat_map(|e| e.charges.iter().map(move |ch| (e.request_id.as_str(), ch)))
        .collect();
    let text =
        |f: fn(&crate::Charge) -> &str| charges.iter().map(|(_, c)| f(c)).collect::<Vec<_>>();
    let int = |f: fn(&crate::Charge) -> i64| charges.iter().map(|(_, c)| f(c)).collect::<Vec<_>>();
    let charge_ids: Vec<&str> = charges.iter().map(|(id, _)| *id).collect();
    c.execute(
        "WITH new AS (INSERT INTO tollgate_endings (request_id, ending, at_ms, tenant, key_id, \
             model, end_user, input_tokens, cached_tokens, output_tokens, tool_calls, \
             cost_micro_usd) \
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::int8[], $4::text[], $5::text[], \
             $6::text[], $7::text[], $8::int8[], $9::int8[], $10::int8[], $11::int8[], \
             $12::int8[]) ON CONFLICT (request_id) DO NOTHING RETURNING request_id) \
         INSERT INTO tollgate_charges (request_id, scope, label, period_ms, period_id, \
             period_start_ms, period_end_ms, unit, amount) \
             SELECT c.* FROM UNNEST($13::text[], $14::text[], $15::text[], $16::int8[], \
             $17::int8[], $18::int8[], $19::int8[], $20::text[], $21::int8[]) \
             AS c(request_id, scope, label, period_ms, period_id, period_start_ms, \
             period_end_ms, unit, amount) \
             WHERE c.request_id IN (SELECT request_id FROM new)",
        &[
            &ids,
            &endings,
            &num(|e| e.at_ms),
            &col(|e| e.tenant.as_deref()),
            &col(|e| e.key_id.as_deref()),
            &col(|e| e.model.as_deref()),
            &col(|e| e.end_user.as_deref()),
            &num(|e| e.input_tokens),
            &num(|e| e.cached_tokens),
            &num(|e| e.output_tokens),
            &num(|e| e.tool_calls),
            &costs,
            &charge_ids,
            &text(|c| &c.scope),
            &text(|c| &c.label),
            &int(|c| c.period_ms),
            &int(|c| c.period_id),
            &int(|c| c.period_start_ms),
            &int(|c| c.period_end_ms),
            &text(|c| c.unit),
            &int(|c| c.amount),
        ],
    )
    .await?;
    Ok(())
}
