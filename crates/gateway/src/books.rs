//! The books kept outside the store: every ending appended to the spend ledger
//! ([`tollgate_ledger`]), and the store's books rebuilt from it when the store forgets.
//!
//! A rebuild runs when an admission finds the store's lost-state marker tripped. One instance
//! claims it (the claim is an idempotency key in the store, so two never rebuild at once), waits
//! for every instance's buffered endings to be written (two flush intervals; each instance
//! writes its own buffer at once when it sees the loss), and then, per budget scope of a
//! current period, adds to the store what the ledger holds beyond what the store holds, then
//! sets the ledger's kill switches and writes the store's marker again: admissions resume.
//!
//! The store's total is read *before* the ledger's is summed, so an ending written to both in
//! between (a request the store had forgotten, charged to the ledger first and to the store
//! after: `unrecorded`) is counted once or, in the worst case, twice, never lost: a rebuild can
//! only make a budget refuse a little early.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tollgate_core::keeper::RecordSet;
use tollgate_core::ledger::Period;
use tollgate_core::policy::Price;
use tollgate_core::{
    Expiry, Finish, Keeper, KeyClaim, KeyUse, Plan, Store, StoreError, Unit, Usage,
};
use tollgate_ledger::{Charge, Entry, Ledger};

use crate::store::AnyStore;

/// The ledger and the state of a rebuild.
#[derive(Debug)]
pub struct Books {
    /// The ledger.
    pub ledger: Ledger,
    rebuilding: AtomicBool,
    flush_every: Duration,
    /// Where endings not written at shutdown are kept (`[ledger] spool`).
    spool: std::path::PathBuf,
}

/// Whose request it is, as the ledger keeps it (the end user as a digest).
#[derive(Debug, Default)]
pub struct Who {
    /// Tenant.
    pub tenant: Option<String>,
    /// Virtual key id.
    pub key: Option<String>,
    /// Model.
    pub model: Option<String>,
    /// Digest of the end user.
    pub user: Option<String>,
}

/// What a ticket needs to write its ending to the ledger.
#[derive(Debug)]
pub struct Booking {
    books: Arc<Books>,
    cells: Vec<(String, Period, Unit)>,
    facts: Who,
    price: Option<Price>,
    /// The store's time of the admission: the periods it reserved in.
    admitted_ms: u64,
}

impl Books {
    /// The ledger `config` names, opened without its spool: to read it, not to serve.
    pub(crate) async fn open(
        config: &crate::config::GatewayConfig,
    ) -> std::io::Result<Option<Arc<Self>>> {
        let Some(l) = &config.ledger else {
            return Ok(None);
        };
        let url = l
            .url
            .clone()
            .map_err(|var| std::io::Error::other(format!("ledger.url_env: {var} was not read")))?;
        let mut s = tollgate_ledger::Settings::new(url);
        s.buffer = l.buffer;
        s.batch = l.batch;
        s.flush_every = l.flush_every;
        s.on_full = l.on_full;
        let ledger = tollgate_ledger::Ledger::open(s)
            .await
            .map_err(std::io::Error::other)?;
        Ok(Some(Self::new(ledger, l.flush_every, l.spool.clone())))
    }

    /// Books over `ledger`, whose writer writes every `flush_every`.
    pub fn new(ledger: Ledger, flush_every: Duration, spool: std::path::PathBuf) -> Arc<Self> {
        Arc::new(Self {
            ledger,
            rebuilding: AtomicBool::new(false),
            flush_every,
            spool,
        })
    }

    /// At shutdown, the endings the ledger could not take kept in the spool file, and said so.
    pub fn spool(&self) {
        let file = self.spool.display();
        match self.ledger.spool(&self.spool) {
            Ok(0) => {}
            Ok(n) => tracing::error!(
                endings = n,
                spool = %file,
                "the ledger could not take every ending before shutdown: they are kept in the \
                 spool and written at the next start"
            ),
            Err(e) => tracing::error!(
                buffered = self.ledger.buffered(),
                spool = %file,
                cause = %e,
                "the ledger could not take every ending before shutdown, nor could the spool: \
                 they are lost"
            ),
        }
    }

    /// At start, the endings an earlier shutdown kept in the spool buffered again; the file
    /// goes once they are written.
    pub fn unspool(self: &Arc<Self>) {
        let file = self.spool.display().to_string();
        match self.ledger.unspool(&self.spool) {
            Ok((0, 0)) => {}
            Ok((n, bad)) => {
                tracing::info!(endings = n, unreadable = bad, spool = %file,
                    "endings kept at the last shutdown are written to the ledger");
                let books = self.clone();
                tokio::spawn(async move {
                    while !books.ledger.flush(Duration::from_secs(60)).await {}
                    let _ = std::fs::remove_file(tollgate_ledger::spool::replaying(&books.spool));
                });
            }
            Err(e) => tracing::error!(spool = %file, cause = %e,
                "the spool of endings kept at the last shutdown cannot be read"),
        }
    }

    /// Starts the ledger's writer: endings of requests the store had forgotten are charged to
    /// the store once they are in the ledger.
    pub fn spawn_writer(self: &Arc<Self>, store: AnyStore) {
        let store_for_expiries = store.clone();
        let after: tollgate_ledger::AfterWrite = Arc::new(move |entries| {
            let store = store.clone();
            Box::pin(async move {
                for e in entries {
                    for c in &e.charges {
                        let amount = u64::try_from(c.amount).unwrap_or(0);
                        if let Err(err) = store
                            .charge_forgotten(
                                &c.scope,
                                &field(&c.label, c.period_id),
                                end(c.period_end_ms),
                                amount,
                            )
                            .await
                        {
                            crate::telemetry::ledger_event("apply_failed");
                            tracing::warn!(error = %err, scope = %c.scope, "an unrecorded charge did not reach the store");
                        }
                    }
                }
            })
        });
        self.ledger.spawn_writer(Some(after));
        let books = self.clone();
        tokio::spawn(async move { books.drain_expiries(store_for_expiries).await });
    }

    /// Writes the store's expiries to the ledger, then forgets them there, every flush interval
    /// (200 ms at least). A failed write leaves them in the store for the next round.
    async fn drain_expiries(&self, store: AnyStore) {
        let mut asked = false;
        loop {
            tokio::time::sleep(self.flush_every.max(Duration::from_millis(200))).await;
            if !asked {
                asked = store.keep_expiries().await.is_ok();
            }
            let Ok(list) = store.expiries(500).await else {
                continue;
            };
            if list.is_empty() {
                continue;
            }
            let entries: Vec<Entry> = list.iter().map(|(_, e)| expired(e)).collect();
            match self.ledger.write_now(&entries).await {
                Ok(()) => {
                    let tags = list.into_iter().map(|(t, _)| t).collect();
                    if store.ack_expiries(tags).await.is_err() {
                        crate::telemetry::ledger_event("expiries_not_forgotten");
                    }
                }
                Err(e) => {
                    crate::telemetry::ledger_event("expiries_not_written");
                    tracing::warn!(error = %e, "expiries not written to the ledger; retrying");
                }
            }
        }
    }

    /// The booking of a request admitted on `p` at the store's time `admitted_ms`.
    pub fn booking(self: &Arc<Self>, p: &Plan, facts: Who, admitted_ms: u64) -> Booking {
        Booking {
            books: self.clone(),
            cells: p
                .reserves()
                .map(|(_, b)| (b.scope.id().to_owned(), b.period, b.unit))
                .collect(),
            facts,
            price: p.price,
            admitted_ms,
        }
    }

    /// The store said it lost its state: rebuild it, once, in the background.
    pub fn store_lost(self: &Arc<Self>, store: &AnyStore) {
        if self.rebuilding.swap(true, Ordering::SeqCst) {
            return;
        }
        let (books, store) = (self.clone(), store.clone());
        tokio::spawn(async move {
            match books.rebuild(&store).await {
                Ok(true) => crate::telemetry::ledger_event("rebuilt"),
                Ok(false) => {}
                Err(e) => {
                    crate::telemetry::ledger_event("rebuild_failed");
                    tracing::error!(error = %e, "rebuilding the store's books from the ledger failed; retried at the next admission");
                }
            }
            books.rebuilding.store(false, Ordering::SeqCst);
        });
    }

    /// Rebuilds the store's books if this instance wins the claim; true when it did.
    async fn rebuild(&self, store: &AnyStore) -> Result<bool, String> {
        // This instance's own endings first, whoever rebuilds.
        self.ledger.flush(Duration::from_secs(5)).await;
        let id = format!("rebuild-{}", std::process::id());
        let claim = store
            .claim_key(KeyUse {
                key: "tollgate:books-rebuild",
                digest: "-",
                request_id: &id,
                in_flight_ms: 60_000,
            })
            .await
            .map_err(|e| e.to_string())?;
        if claim != KeyClaim::Claimed {
            return Ok(false);
        }
        let done = self.restore(store, true).await;
        let _ = store
            .end_claim("tollgate:books-rebuild", &id, None, 0)
            .await;
        done.map(|()| true)
    }

    /// Whether the ledger holds books (an ending, a charge or a kill switch): durable evidence
    /// that an empty store forgot rather than is new.
    pub async fn holds_books(&self) -> Result<bool, String> {
        let (endings, charges) = self.ledger.counts().await.map_err(|e| e.to_string())?;
        if endings > 0 || charges > 0 {
            return Ok(true);
        }
        let kills = self.ledger.kills().await.map_err(|e| e.to_string())?;
        let mut kept = !kills.is_empty();
        kept |= !self
            .ledger
            .records(tollgate_ledger::Kept::Limits)
            .await
            .map_err(|e| e.to_string())?
            .is_empty();
        kept |= !self
            .ledger
            .key_records()
            .await
            .map_err(|e| e.to_string())?
            .is_empty();
        Ok(kept)
    }

    /// Restores the books of a store that starts empty in this process (the memory store)
    /// from the ledger, before it serves: no other instance shares it, so none is waited for.
    pub async fn restore_at_start(&self, store: &AnyStore) -> Result<(), String> {
        self.restore(store, false).await
    }

    async fn restore(&self, store: &AnyStore, others: bool) -> Result<(), String> {
        if others {
            // Every other instance's buffer is written within a flush interval of its seeing
            // the loss; two are waited for.
            tokio::time::sleep(self.flush_every * 2).await;
        }
        self.ledger.flush(Duration::from_secs(5)).await;
        let now = i64::try_from(now_ms()).unwrap_or(i64::MAX);
        let first = self
            .ledger
            .current_totals(now)
            .await
            .map_err(|e| e.to_string())?;
        let mut held = Vec::with_capacity(first.len());
        for t in &first {
            let period = period_of_total(&t.label, t.period_ms);
            let u = store
                .usage(&t.scope, Some(period))
                .await
                .map_err(|e| e.to_string())?;
            held.push(u.settled);
        }
        let second = self
            .ledger
            .current_totals(now)
            .await
            .map_err(|e| e.to_string())?;
        for (t, held) in first.iter().zip(held) {
            let period = period_of_total(&t.label, t.period_ms);
            let ledger = second
                .iter()
                .find(|s| s.scope == t.scope && s.label == t.label && s.period_id == t.period_id)
                .map_or(t.amount, |s| s.amount);
            let missing = u64::try_from(ledger).unwrap_or(0).saturating_sub(held);
            if missing > 0 {
                let pid = u64::try_from(t.period_id).unwrap_or(0);
                store
                    .restore_settled(
                        &t.scope,
                        (period, pid, &field(&t.label, t.period_id)),
                        end(t.period_end_ms),
                        missing,
                    )
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        for (target, reason) in self.ledger.kills().await.map_err(|e| e.to_string())? {
            store
                .set_kill(&target, Some(&reason))
                .await
                .map_err(|e| e.to_string())?;
        }
        let limits = self
            .ledger
            .records(tollgate_ledger::Kept::Limits)
            .await
            .map_err(|e| e.to_string())?;
        // Written even when there are none: the set's version then tells every instance that
        // the store holds the ledger's limits again (an instance keeps what it knew while the
        // set is missing, which an empty set would look like forever).
        if store.is_shared() {
            let changes: Vec<(String, Option<String>)> =
                limits.into_iter().map(|(d, r)| (d, Some(r))).collect();
            let step = crate::key_copy::step()?;
            store
                .write_records(RecordSet::Limits, &changes, step)
                .await
                .map_err(|e| e.to_string())?;
            crate::key_copy::copy_all(&self.ledger, store, true).await?;
        }
        store.keep_expiries().await.map_err(|e| e.to_string())?;
        store.acknowledge_loss().await.map_err(|e| e.to_string())?;
        tracing::warn!(
            scopes = first.len(),
            "the store's books were rebuilt from the ledger"
        );
        Ok(())
    }

    /// A kill switch set or lifted: written to the ledger too (retried three times), so that a
    /// rebuild restores it.
    pub fn kill_changed(self: &Arc<Self>, target: &str, reason: Option<&str>) {
        let (books, target, reason) = (self.clone(), target.to_owned(), reason.map(str::to_owned));
        tokio::spawn(async move {
            for wait in [0, 500, 2000] {
                tokio::time::sleep(Duration::from_millis(wait)).await;
                let at = i64::try_from(now_ms()).unwrap_or(i64::MAX);
                if books
                    .ledger
                    .set_kill(&target, reason.as_deref(), at)
                    .await
                    .is_ok()
                {
                    return;
                }
            }
            crate::telemetry::ledger_event("kill_not_written");
        });
    }
}

impl Booking {
    /// Appends the request's ending: what the store charged (`Done`), or, when the store had
    /// forgotten the request (`Unknown`), what the gateway works out it costs, to be charged to
    /// the store once in the ledger. An ending the store already had, or could not take, adds
    /// nothing.
    pub fn book(
        self,
        id: &str,
        ending: &'static str,
        finish: &Result<Finish, StoreError>,
        usage: Option<Usage>,
    ) {
        let (ending, amounts, apply) = match finish {
            Ok(Finish::Done { charged }) => (ending, charged.clone(), false),
            Ok(Finish::Unknown) => {
                let u = usage.unwrap_or_default();
                let amounts = self
                    .cells
                    .iter()
                    .map(|(_, _, unit)| tollgate_core::pipeline::charge(*unit, self.price, &u))
                    .collect();
                // Admitted without the store (fail open): written down, never charged to it.
                match ending {
                    "fail_open" => (ending, amounts, false),
                    _ => ("unrecorded", amounts, true),
                }
            }
            _ => return,
        };
        let charges = self
            .cells
            .iter()
            .zip(amounts)
            .map(|((scope, period, unit), amount)| {
                charge(scope, *period, period.at(self.admitted_ms).0, *unit, amount)
            })
            .collect();
        let u = usage.unwrap_or_default();
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let entry = Entry {
            request_id: id.to_owned(),
            ending,
            at_ms: n(now_ms()),
            tenant: self.facts.tenant,
            key_id: self.facts.key,
            model: self.facts.model,
            end_user: self.facts.user,
            input_tokens: n(u.input_tokens),
            cached_tokens: n(u.cached_input_tokens),
            output_tokens: n(u.output_tokens),
            tool_calls: n(u.tool_calls),
            cost_micro_usd: self
                .price
                .filter(|_| usage.is_some())
                .map(|p| n(p.cost(&u))),
            charges,
            apply_to_store: apply,
        };
        self.books.append(entry);
    }
}

impl Books {
    fn append(&self, entry: Entry) {
        if !self.ledger.append(entry) {
            crate::telemetry::ledger_event("dropped");
        }
    }
}

fn charge(scope: &str, period: Period, id: u64, unit: Unit, amount: u64) -> Charge {
    let (start, end) = period.span(id);
    let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    Charge {
        scope: scope.to_owned(),
        label: period.label(),
        // 0 for a UTC month, -1 for a calendar in a zone (its label says which).
        period_ms: match period {
            Period::Fixed(len) => n(len),
            Period::CalendarMonth => 0,
            Period::Calendar(_) => -1,
        },
        period_id: n(id),
        period_start_ms: n(start),
        period_end_ms: n(end),
        unit: unit.as_str(),
        amount: n(amount),
    }
}

/// The period of a ledger total: by its label, else by its length (older rows).
fn period_of_total(label: &str, period_ms: i64) -> Period {
    Period::from_label(label).unwrap_or(match u64::try_from(period_ms) {
        Ok(len) if len > 0 => Period::Fixed(len),
        _ => Period::CalendarMonth,
    })
}

/// The ledger's entry of a request the store expired.
fn expired(e: &Expiry) -> Entry {
    let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    Entry {
        request_id: e.request_id.clone(),
        ending: "expired",
        at_ms: n(e.at),
        charges: e
            .charges
            .iter()
            .map(|c| charge(&c.scope, c.period, c.period_id, c.unit, c.amount))
            .collect(),
        ..Entry::default()
    }
}

/// A budget cell's field in the store: `<label>@<period id>`.
fn field(label: &str, period_id: i64) -> String {
    format!("{label}@{period_id}")
}

fn end(ms: i64) -> u64 {
    u64::try_from(ms).unwrap_or(0)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
