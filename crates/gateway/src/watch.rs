//! The store's marker, at start and while the instance is idle. A store found empty is new, or
//! it forgot; which of the two is decided from durable evidence (the spend ledger's rows) or by
//! an operator's initialisation, never by writing a marker over a loss. A store that forgets
//! while this instance runs is noticed within [`WATCH_EVERY`], requests or none, and the loss
//! is written down for every instance, including those that start later.

use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{Keeper, StoreError, StoreState};

use crate::faults::{STORE, STORE_LOST, STORE_UNINITIALISED};
use crate::gateway::Gateway;

/// How often an instance reads the store's marker.
pub const WATCH_EVERY: Duration = Duration::from_secs(1);

/// What an instance made of the store at start or at a watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// The marker is there.
    Kept,
    /// Empty, and the ledger holds no books: a new deployment, now initialised.
    New,
    /// Forgot: the loss is written down, and rebuilt from the ledger when there is one.
    Lost,
    /// Empty, and nothing says whether it is new: refused until an operator initialises it.
    Uninitialised,
    /// The store did not answer; asked again at the next watch.
    Unknown,
}

/// What the instance finds at start, before its first request. A memory store with a spend
/// ledger that holds books is rebuilt from it, and one that cannot be is an error: serving it
/// would reopen what the ledger says is spent.
pub async fn start(gw: &Gateway) -> std::io::Result<Found> {
    if !gw.store.is_shared() {
        return restore_memory(gw).await.map_err(std::io::Error::other);
    }
    prime_marks(gw).await;
    if let Err(e @ StoreError::OtherSchema { .. }) = gw.store.state().await {
        return Err(std::io::Error::other(e.to_string()));
    }
    Ok(look(gw).await)
}

/// What the instances before this one saw of the store's write sequence, from the ledger,
/// taken as seen: a store that went back in time while this instance was down is noticed.
async fn prime_marks(gw: &Gateway) {
    let (true, Some(books)) = (gw.store.is_shared(), &gw.books) else {
        return;
    };
    match books.ledger.store_marks().await {
        Ok(marks) => {
            let mut per_shard = vec![None; gw.store.high_marks().len()];
            for (shard, epoch, high) in marks {
                if let Some(m) = per_shard.get_mut(shard) {
                    *m = Some((epoch, high));
                }
            }
            gw.store.prime_marks(&per_shard);
        }
        Err(e) => tracing::warn!(cause = %e,
            "the store's write sequence seen before this start cannot be read from the ledger: \
             a store that went back in time meanwhile is noticed only by the other instances"),
    }
}

/// Writes what this instance has seen of the store's write sequence to the ledger, when it
/// moved since `last`.
async fn save_marks(gw: &Gateway, last: &mut Vec<Option<(String, u64)>>) {
    let (true, Some(books)) = (gw.store.is_shared(), &gw.books) else {
        return;
    };
    let now = gw.store.high_marks();
    if now == *last {
        return;
    }
    let marks: Vec<_> = now
        .iter()
        .enumerate()
        .filter_map(|(shard, m)| m.clone().map(|(e, h)| (shard, e, h)))
        .collect();
    if books.ledger.raise_store_marks(&marks).await.is_ok() {
        *last = now;
    }
}

/// Reads the marker once and acts on it.
pub async fn look(gw: &Gateway) -> Found {
    let state = match gw.store.state().await {
        Ok(s) => s,
        Err(e @ StoreError::OtherSchema { .. }) => {
            STORE.fail(&e, "another version wrote its marker under this prefix");
            return Found::Unknown;
        }
        // The admissions that meet the same fault log it.
        Err(_) => return Found::Unknown,
    };
    match state {
        StoreState::Kept => {
            STORE_LOST.ok();
            STORE_UNINITIALISED.ok();
            Found::Kept
        }
        StoreState::Lost => lost(gw),
        StoreState::Uninitialised => match &gw.books {
            None => {
                STORE_UNINITIALISED.fail(
                    &StoreError::Uninitialised,
                    "the store is empty and there is no spend ledger to tell a new store from \
                     one that forgot: admissions are refused (503 store_uninitialised) until an \
                     operator runs `tollgate admin init-store`",
                );
                Found::Uninitialised
            }
            Some(books) => match books.holds_books().await {
                Ok(true) => {
                    if let Err(e) = gw.store.mark_lost().await {
                        STORE.fail(&e, "the store's loss could not be written down");
                        return Found::Unknown;
                    }
                    lost(gw)
                }
                Ok(false) => match gw.store.initialise().await {
                    Ok(_) => {
                        tracing::info!(
                            "the store was empty and the spend ledger holds no books: a new \
                             deployment, initialised"
                        );
                        Found::New
                    }
                    Err(StoreError::StateLost) => lost(gw),
                    Err(_) => Found::Unknown,
                },
                Err(e) => {
                    tracing::warn!(cause = %e,
                        "the store is empty and the spend ledger cannot be read to tell whether \
                         it forgot: admissions are refused until it can");
                    Found::Unknown
                }
            },
        },
    }
}

/// The store forgot: logged and alerted once, and rebuilt from the ledger when there is one.
fn lost(gw: &Gateway) -> Found {
    gw.store.report_loss();
    gw.alerts.store_lost();
    if let Some(b) = &gw.books {
        b.store_lost(&gw.store);
    }
    Found::Lost
}

/// A memory store starts empty with its process: the ledger's books, when it holds any, are
/// restored into it before it serves.
async fn restore_memory(gw: &Gateway) -> Result<Found, String> {
    let Some(books) = &gw.books else {
        return Ok(Found::New);
    };
    let holds = books
        .holds_books()
        .await
        .map_err(|e| format!("the spend ledger cannot be read at start: {e}"))?;
    if !holds {
        return Ok(Found::New);
    }
    books
        .restore_at_start(&gw.store)
        .await
        .map_err(|e| format!("the memory store's books cannot be restored from the ledger: {e}"))?;
    tracing::info!("the memory store's books were restored from the spend ledger");
    Ok(Found::Kept)
}

/// Why a store was not initialised.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// The spend ledger holds books: an empty store forgot them, and is rebuilt, not declared new.
    #[error(
        "the spend ledger holds books for this deployment: an empty store forgot them and is \
         rebuilt from the ledger by the gateway, not initialised"
    )]
    LedgerHoldsBooks,
    /// The store or the ledger could not be opened or asked.
    #[error("{0}")]
    Failed(String),
    /// The store's loss is written down: it is acknowledged, not initialised over.
    #[error(
        "the store has lost its state, and the loss is written down: acknowledge it \
         (`tollgate admin acknowledge-loss`) instead"
    )]
    Lost,
}

/// Initialises the store `config` names, without a gateway (an operator's step before the first
/// start): refused when the ledger it names holds books. True when a marker was written.
pub async fn init_store(config: &crate::config::GatewayConfig) -> Result<bool, InitError> {
    let fail = |e: std::io::Error| InitError::Failed(e.to_string());
    let store = crate::store::start_store(config).await.map_err(fail)?;
    let books = crate::books::Books::open(config).await.map_err(fail)?;
    initialise(&store, books.as_deref()).await
}

/// Initialises `store` unless the ledger `books` holds books (or its loss is written down).
pub async fn initialise(
    store: &crate::store::AnyStore,
    books: Option<&crate::books::Books>,
) -> Result<bool, InitError> {
    if let Some(books) = books {
        if books.holds_books().await.map_err(InitError::Failed)? {
            return Err(InitError::LedgerHoldsBooks);
        }
    }
    match store.initialise().await {
        Ok(wrote) => Ok(wrote),
        Err(StoreError::StateLost) => Err(InitError::Lost),
        Err(e @ StoreError::OtherSchema { .. }) => Err(InitError::Failed(e.to_string())),
        Err(e) => Err(InitError::Failed(e.to_string())),
    }
}

/// Reads the marker every [`WATCH_EVERY`] while the gateway runs (a shared store only: the memory
/// store cannot forget while its process lives).
pub fn spawn(gw: Arc<Gateway>) {
    if !gw.store.is_shared() {
        return;
    }
    tokio::spawn(async move {
        let mut saved = Vec::new();
        loop {
            tokio::time::sleep(WATCH_EVERY).await;
            if gw.is_draining() {
                return;
            }
            let _ = look(&gw).await;
            save_marks(&gw, &mut saved).await;
        }
    });
}
