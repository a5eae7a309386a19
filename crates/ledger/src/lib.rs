//! Tollgate's durable spend ledger in PostgreSQL.
//!
//! Every request's ending (settled, released, expired) is appended once, keyed by its request
//! id, with what it charged to each budget scope and period. Endings wait in a bounded buffer and
//! are written in batches by one task, off the request path; a batch that fails is put back and
//! retried. The ledger answers what a store that forgot needs to rebuild its books (the settled
//! totals of every current period, and the kill switches) and what finance asks (spend by
//! tenant, key, model, user or day).

mod conn;
mod keys;
mod marks;
mod report;
mod schema;
pub mod spool;
mod writer;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::time::Duration;

pub use keys::Swap;
pub use marks::Mark as StoreMark;
pub use report::{By, SpendRow};
pub use writer::AfterWrite;

use conn::Conn;

/// The ledger failed: PostgreSQL could not be reached, or refused a statement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ledger: {0}")]
pub struct LedgerError(pub String);

impl From<tokio_postgres::Error> for LedgerError {
    fn from(e: tokio_postgres::Error) -> Self {
        // `Display` of a database error is its severity and code only; the message says what.
        match e.as_db_error() {
            Some(db) => LedgerError(format!("{}: {}", db.code().code(), db.message())),
            None => LedgerError(e.to_string()),
        }
    }
}

/// What one request charged to one budget scope in one period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    /// The scope's storage id (`rule|key`, or its tool-call child).
    pub scope: String,
    /// The period's label (`day`, `1h`, `month`…).
    pub label: String,
    /// The period's length in ms; 0 for calendar months.
    pub period_ms: i64,
    /// The period's number (as the stores count it).
    pub period_id: i64,
    /// When the period started and ends (ms since the epoch).
    pub period_start_ms: i64,
    /// When the period ends.
    pub period_end_ms: i64,
    /// `tokens`, `micro_usd` or `tool_calls`.
    pub unit: &'static str,
    /// The amount charged, in the unit.
    pub amount: i64,
}

/// A request's ending.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Entry {
    /// The request id (the ledger's key: a second ending of one id is ignored).
    pub request_id: String,
    /// `settled`, `released`, `expired`, or `unrecorded` (the store had forgotten the request:
    /// the charges were worked out by the gateway and written to the store after the ledger).
    pub ending: &'static str,
    /// When it ended (ms since the epoch).
    pub at_ms: i64,
    /// The tenant, when the request had one.
    pub tenant: Option<String>,
    /// The virtual key's id.
    pub key_id: Option<String>,
    /// The model asked for.
    pub model: Option<String>,
    /// The end user, as a digest (never the value a client sent).
    pub end_user: Option<String>,
    /// Input tokens charged.
    pub input_tokens: i64,
    /// Of which cached.
    pub cached_tokens: i64,
    /// Output tokens charged.
    pub output_tokens: i64,
    /// Tool calls charged.
    pub tool_calls: i64,
    /// The cost in micro-USD, when the model has a price.
    pub cost_micro_usd: Option<i64>,
    /// What it charged, per budget scope.
    pub charges: Vec<Charge>,
    /// Whether the charges still have to be applied to the store once written (`unrecorded`).
    pub apply_to_store: bool,
}

/// The settled total of one scope's period, as the ledger holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Total {
    /// The scope's storage id.
    pub scope: String,
    /// The period's label.
    pub label: String,
    /// Its length in ms (0: calendar month).
    pub period_ms: i64,
    /// Its number.
    pub period_id: i64,
    /// When it ends.
    pub period_end_ms: i64,
    /// The unit.
    pub unit: String,
    /// The sum charged.
    pub amount: i64,
}

/// What happens to an ending that finds the buffer full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnFull {
    /// New admissions are refused while the buffer is full, so that no ending is lost; the
    /// endings of requests already admitted are still buffered (at most one each).
    #[default]
    Refuse,
    /// The ending is dropped and counted (`tollgate_ledger_dropped_total`); admissions go on.
    Drop,
}

/// How the ledger buffers and writes.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `postgres://…`.
    pub url: String,
    /// Endings buffered at most (see [`OnFull`]).
    pub buffer: usize,
    /// Endings per transaction at most.
    pub batch: usize,
    /// How often the buffer is written.
    pub flush_every: Duration,
    /// What a full buffer does.
    pub on_full: OnFull,
}

/// Whether `url` is a PostgreSQL URL the ledger can connect with (a host, or a Unix socket's
/// directory percent-encoded as the host, as libpq writes it); the parser's words when not.
pub fn check_url(url: &str) -> Result<(), String> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err("expected postgres://…".into());
    }
    url.parse::<tokio_postgres::Config>()
        .map(|_| ())
        .map_err(|e| e.to_string())
}

impl Settings {
    /// Defaults: 100,000 buffered, batches of 1,000, every 200 ms, refuse when full.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            buffer: 100_000,
            batch: 1000,
            flush_every: Duration::from_millis(200),
            on_full: OnFull::Refuse,
        }
    }
}

/// Records the gateway sets at run time, kept here so that they outlive a store that forgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Limits set for one value, by scope and control (`tollgate_limits`).
    Limits,
}

impl Kept {
    /// Its table and key column (fixed names, never from outside).
    fn table(self) -> (&'static str, &'static str) {
        match self {
            Kept::Limits => ("tollgate_limits", "field"),
        }
    }
}

/// The ledger: cheap to clone, one buffer and two connections shared (one for the writes'
/// transactions, one for everything else).
#[derive(Clone)]
pub struct Ledger {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("buffered", &self.buffered())
            .finish_non_exhaustive()
    }
}

struct Inner {
    /// Reads and kill switches: statements of their own, shared by any number of callers.
    conn: Conn,
    /// Batches of endings: a transaction each, one at a time ([`Conn::exclusive`]).
    writes: Conn,
    settings: Settings,
    queue: std::sync::Mutex<VecDeque<Entry>>,
    /// Entries appended and not yet written (queued, or in a batch on its way): read on every
    /// admission (`accepting`), so without the queue's lock.
    buffered: AtomicUsize,
    wake: tokio::sync::Notify,
    written: AtomicU64,
}

impl Ledger {
    /// Connects and brings the schema up to date (each migration once, under an advisory lock,
    /// so instances starting together do not race).
    pub async fn open(settings: Settings) -> Result<Self, LedgerError> {
        let conn = Conn::new(settings.url.clone());
        schema::migrate(&*conn.get().await?).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                conn,
                writes: Conn::new(settings.url.clone()),
                settings,
                queue: std::sync::Mutex::default(),
                buffered: AtomicUsize::new(0),
                wake: tokio::sync::Notify::new(),
                written: AtomicU64::new(0),
            }),
        })
    }

    /// Endings waiting to be written (buffered or in a batch on its way).
    pub fn buffered(&self) -> usize {
        self.inner
            .buffered
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Endings written since start-up by this process.
    pub fn written(&self) -> u64 {
        self.inner.written.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether new admissions may go on: false while the buffer is full under
    /// [`OnFull::Refuse`].
    pub fn accepting(&self) -> bool {
        self.inner.settings.on_full == OnFull::Drop || self.buffered() < self.inner.settings.buffer
    }

    /// Buffers an ending; false when it was dropped (full buffer under [`OnFull::Drop`]).
    pub fn append(&self, entry: Entry) -> bool {
        let s = &self.inner.settings;
        let len = {
            let Ok(mut q) = self.inner.queue.lock() else {
                return false;
            };
            if s.on_full == OnFull::Drop && q.len() >= s.buffer {
                drop(q);
                metrics::counter!("tollgate_ledger_dropped_total").increment(1);
                return false;
            }
            q.push_back(entry);
            self.inner
                .buffered
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            q.len()
        };
        // The gauge is set by the writer, once per flush, not by every request.
        if len >= s.batch {
            self.inner.wake.notify_one();
        }
        true
    }

    /// Every ending waiting in the buffer, taken out of it (a batch being written is not).
    fn take_all(&self) -> Vec<Entry> {
        let Ok(mut q) = self.inner.queue.lock() else {
            return Vec::new();
        };
        let taken: Vec<Entry> = q.drain(..).collect();
        self.inner
            .buffered
            .fetch_sub(taken.len(), std::sync::atomic::Ordering::Relaxed);
        taken
    }

    /// Buffers an ending whatever the buffer holds (a spool's, which must not be dropped).
    fn append_always(&self, entry: Entry) {
        if let Ok(mut q) = self.inner.queue.lock() {
            q.push_back(entry);
            self.inner
                .buffered
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.inner.wake.notify_one();
    }

    /// Writes what is buffered now and waits until it is written, for at most `within`; false
    /// when something is still waiting then.
    pub async fn flush(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if self.buffered() == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            self.inner.wake.notify_one();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The settled totals of every period that has not ended at `now_ms`, per scope.
    pub async fn current_totals(&self, now_ms: i64) -> Result<Vec<Total>, LedgerError> {
        let c = self.inner.conn.get().await?;
        let rows = c
            .query(
                "SELECT scope, label, period_ms, period_id, max(period_end_ms), unit, \
                 sum(amount)::int8 FROM tollgate_charges WHERE period_end_ms > $1 \
                 GROUP BY scope, label, period_ms, period_id, unit ORDER BY scope, label",
                &[&now_ms],
            )
            .await
            .map_err(|e| self.inner.conn.failed(e))?;
        rows.iter()
            .map(|r| {
                Ok(Total {
                    scope: r.try_get(0)?,
                    label: r.try_get(1)?,
                    period_ms: r.try_get(2)?,
                    period_id: r.try_get(3)?,
                    period_end_ms: r.try_get(4)?,
                    unit: r.try_get(5)?,
                    amount: r.try_get(6)?,
                })
            })
            .collect()
    }

    /// The settled total of one scope's period (`label`, `period_id`), 0 when nothing was.
    pub async fn total(
        &self,
        scope: &str,
        label: &str,
        period_id: i64,
    ) -> Result<i64, LedgerError> {
        let c = self.inner.conn.get().await?;
        let row = c
            .query_one(
                "SELECT coalesce(sum(amount), 0)::int8 FROM tollgate_charges \
                 WHERE scope = $1 AND label = $2 AND period_id = $3",
                &[&scope, &label, &period_id],
            )
            .await
            .map_err(|e| self.inner.conn.failed(e))?;
        Ok(row.try_get(0)?)
    }

    /// Records a kill switch set (`Some(reason)`) or lifted (`None`).
    pub async fn set_kill(
        &self,
        target: &str,
        reason: Option<&str>,
        at_ms: i64,
    ) -> Result<(), LedgerError> {
        let c = self.inner.conn.get().await?;
        let done = match reason {
            Some(r) => {
                c.execute(
                    "INSERT INTO tollgate_kills (target, reason, at_ms) VALUES ($1, $2, $3) \
                     ON CONFLICT (target) DO UPDATE SET reason = $2, at_ms = $3",
                    &[&target, &r, &at_ms],
                )
                .await
            }
            None => {
                c.execute("DELETE FROM tollgate_kills WHERE target = $1", &[&target])
                    .await
            }
        };
        done.map(|_| ()).map_err(|e| self.inner.conn.failed(e))
    }

    /// The kill switches set, with their reasons.
    pub async fn kills(&self) -> Result<Vec<(String, String)>, LedgerError> {
        let c = self.inner.conn.get().await?;
        let rows = c
            .query(
                "SELECT target, reason FROM tollgate_kills ORDER BY target",
                &[],
            )
            .await
            .map_err(|e| self.inner.conn.failed(e))?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect()
    }

    /// Writes (`Some(record)`) or deletes (`None`) records of `set` by field (an issued key's
    /// digest, a limit's scope and control); several at once, atomically.
    pub async fn put_records(
        &self,
        set: Kept,
        changes: &[(String, Option<String>)],
        at_ms: i64,
    ) -> Result<(), LedgerError> {
        let gone: Vec<&str> = changes
            .iter()
            .filter(|(_, r)| r.is_none())
            .map(|(d, _)| d.as_str())
            .collect();
        let (fields, records): (Vec<&str>, Vec<&str>) = changes
            .iter()
            .filter_map(|(d, r)| r.as_deref().map(|r| (d.as_str(), r)))
            .unzip();
        let (table, field) = set.table();
        let c = self.inner.conn.get().await?;
        // One statement: the changes land together or not at all.
        c.execute(
            &format!(
                "WITH gone AS (DELETE FROM {table} WHERE {field} = ANY($1::text[])) \
                 INSERT INTO {table} ({field}, record, at_ms) \
                 SELECT d, r, $4 FROM unnest($2::text[], $3::text[]) AS t(d, r) \
                 ON CONFLICT ({field}) DO UPDATE SET record = EXCLUDED.record, at_ms = EXCLUDED.at_ms"
            ),
            &[&gone, &fields, &records, &at_ms],
        )
        .await
        .map(|_| ())
        .map_err(|e| self.inner.conn.failed(e))
    }

    /// Every record of `set`: (field, record).
    pub async fn records(&self, set: Kept) -> Result<Vec<(String, String)>, LedgerError> {
        let (table, field) = set.table();
        let c = self.inner.conn.get().await?;
        let rows = c
            .query(
                &format!("SELECT {field}, record FROM {table} ORDER BY {field}"),
                &[],
            )
            .await
            .map_err(|e| self.inner.conn.failed(e))?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect()
    }

    /// How many endings and charges the ledger holds (tests and operators' checks).
    pub async fn counts(&self) -> Result<(i64, i64), LedgerError> {
        let c = self.inner.conn.get().await?;
        let row = c
            .query_one(
                "SELECT (SELECT count(*) FROM tollgate_endings), \
                 (SELECT count(*) FROM tollgate_charges)",
                &[],
            )
            .await
            .map_err(|e| self.inner.conn.failed(e))?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }
}
