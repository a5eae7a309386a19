//! The gateway's shared state: the configuration in force (swapped whole on reload), the store,
//! the token counter, request ids, the queue and the Responses API's kept contexts.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate_core::{Keeper, Usage};
use tollgate_tokens::TokenCounter;

use crate::config::GatewayConfig;
use crate::contexts::Contexts;
use crate::queue::Queue;
use crate::records::RecordSink;
use crate::store::AnyStore;

/// The gateway's shared state.
#[derive(Debug)]
pub struct Gateway {
    /// Configuration; replaced whole on reload (requests keep the snapshot they started with).
    config: std::sync::RwLock<Arc<GatewayConfig>>,
    /// Where the configuration was read from, for reloads.
    config_path: Option<std::path::PathBuf>,
    /// The store.
    pub store: AnyStore,
    /// Where large bodies are counted (see [`crate::counting`]).
    pub(crate) counting: crate::counting::CountPool,
    /// Counts of long texts kept per tenant (fixed at start-up, like the pool).
    pub(crate) memos: crate::memo::CountMemos,
    /// 48 random bits per gateway process: ids stay unique across the instances that share a
    /// store (see [`request_id`]).
    nonce: u64,
    seq: AtomicU64,
    /// The bounded queue of requests waiting for a concurrency slot.
    pub(crate) queue: Queue,
    pub(crate) records: Option<RecordSink>,
    /// Set when a shutdown begins (`/readyz` then answers 503).
    draining: std::sync::atomic::AtomicBool,
    /// Set when the drain has ended: answers still being read are cut off.
    cut: tokio::sync::watch::Sender<bool>,
    /// Responses API: the context of each response served, for its follow-ups.
    contexts: Contexts,
    /// Alerts and their webhooks (fixed at start-up, like the listeners).
    pub alerts: crate::alerts::Alerts,
    /// The spend ledger, when one is configured (fixed at start-up).
    pub books: Option<Arc<crate::books::Books>>,
    /// Virtual keys issued at run time (`/admin/keys`).
    pub keys: crate::keyring::Registry,
    /// Limits set at run time for one value (`/admin/limits`).
    pub overrides: crate::overrides::Overrides,
    /// Reservations made here for code that calls the provider itself.
    pub(crate) reservations: crate::reserved::Reservations,
    /// Set once the server's `prepare` has run.
    pub(crate) prepared: std::sync::atomic::AtomicBool,
}

impl Gateway {
    /// A gateway over `store`.
    pub fn new(config: GatewayConfig, store: AnyStore) -> Self {
        // Load the vocabularies now, off the request path: the first request would otherwise
        // wait for them.
        std::thread::spawn(TokenCounter::warm_up);
        crate::telemetry::register(&config.policy);
        crate::telemetry::policy_in_force(None, &config.policy.version);
        let nonce = {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one((std::process::id(), Instant::now())) & 0xffff_ffff_ffff
        };
        let alerts = crate::alerts::Alerts::new(&config.alerts);
        let memos = crate::memo::CountMemos::new(config.count_memo_entries);
        Self {
            books: None,
            alerts,
            config: std::sync::RwLock::new(Arc::new(config)),
            config_path: None,
            store,
            counting: crate::counting::CountPool::per_core(),
            memos,
            nonce,
            seq: AtomicU64::new(0),
            queue: Queue::default(),
            records: None,
            draining: std::sync::atomic::AtomicBool::new(false),
            cut: tokio::sync::watch::Sender::new(false),
            contexts: Contexts::default(),
            keys: crate::keyring::Registry::default(),
            prepared: std::sync::atomic::AtomicBool::new(false),
            overrides: crate::overrides::Overrides::default(),
            reservations: crate::reserved::Reservations::default(),
        }
    }

    /// Keeps the spend ledger `books` (opened by the server's `open_books`).
    #[must_use]
    pub fn with_books(mut self, books: Option<Arc<crate::books::Books>>) -> Self {
        self.books = books;
        self
    }

    /// Whether a shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Marks the gateway as shutting down.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Ends the reading of every answer still under way (the drain is over): each is released,
    /// charged its reservation.
    pub fn cut_off_answers(&self) {
        self.cut.send_replace(true);
    }

    /// Becomes true when [`Gateway::cut_off_answers`] is called.
    pub(crate) fn answers_cut(&self) -> tokio::sync::watch::Receiver<bool> {
        self.cut.subscribe()
    }

    /// Writes decision records to `sink`.
    #[must_use]
    pub fn with_records(mut self, sink: RecordSink) -> Self {
        self.records = Some(sink);
        self
    }

    /// The configuration's warnings ([`GatewayConfig::warnings_with`]), counting the keys
    /// issued at run time that this instance has loaded.
    pub fn config_warnings(&self) -> Vec<String> {
        let now = tollgate_core::Clock::now(&tollgate_core::SystemClock);
        let issued: Vec<(String, String, bool)> = self
            .keys
            .list(now)
            .into_iter()
            .map(|k| {
                (
                    k.key.tenant.clone(),
                    k.key.id.clone(),
                    k.key.allow_user || k.key.user.is_some(),
                )
            })
            .collect();
        self.config().warnings_with(&issued)
    }

    /// The configuration in force now.
    pub fn config(&self) -> Arc<GatewayConfig> {
        match self.config.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Remembers the file the configuration came from, for [`Gateway::reload`].
    #[must_use]
    pub fn with_config_path(mut self, path: std::path::PathBuf) -> Self {
        self.config_path = Some(path);
        self
    }

    /// The file the configuration came from, if any.
    pub fn config_path(&self) -> Option<&std::path::Path> {
        self.config_path.as_deref()
    }

    /// Reads the configuration file again and swaps it in atomically. A file that does not
    /// validate is refused with the field at fault, and the old configuration stays. The
    /// listener, store and record settings are fixed at start-up and are not changed. Each
    /// reload is logged and counted, a refused one with its cause.
    pub fn reload(&self) -> Result<Arc<GatewayConfig>, String> {
        let result = self.reload_file();
        match &result {
            Ok(c) => tracing::info!(policy_version = %c.policy.version, "configuration reloaded"),
            Err(cause) => tracing::warn!(
                %cause,
                "configuration reload refused; the running configuration stays"
            ),
        }
        crate::telemetry::reloaded(if result.is_ok() { "applied" } else { "refused" });
        result
    }

    fn reload_file(&self) -> Result<Arc<GatewayConfig>, String> {
        let path = self
            .config_path
            .as_ref()
            .ok_or("this gateway was not started from a file")?;
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        let new = Arc::new(GatewayConfig::from_toml(&text).map_err(|e| e.to_string())?);
        let old = match self.config.write() {
            Ok(mut c) => std::mem::replace(&mut *c, new.clone()),
            Err(poisoned) => std::mem::replace(&mut *poisoned.into_inner(), new.clone()),
        };
        crate::telemetry::register(&new.policy);
        crate::telemetry::policy_in_force(Some(&old.policy.version), &new.policy.version);
        Ok(new)
    }

    /// Remembers what a Responses API follow-up of this response (and of its conversation)
    /// carries as input: the response's input and output. In the Redis store, for every
    /// instance, for `ttl`; a failure to write it only makes a follow-up count as unknown
    /// context.
    pub(crate) async fn remember_context(
        &self,
        response: Option<&str>,
        conversation: Option<&str>,
        u: Usage,
        ttl: Duration,
    ) {
        let carried = u.input_tokens.saturating_add(u.output_tokens);
        let ids = [response, conversation].into_iter().flatten();
        for id in ids.filter(|id| crate::contexts::keepable(id)) {
            if self.store.is_shared() {
                let _ = self
                    .store
                    .put_note(&format!("ctx:{id}"), carried, ttl)
                    .await;
            } else {
                self.contexts.remember(id, carried);
            }
        }
    }

    /// What a follow-up of response or conversation `id` carries, if it is known here.
    pub(crate) async fn context_of(&self, id: &str) -> Option<u64> {
        if !crate::contexts::keepable(id) {
            // Not an id this gateway kept: unknown, and not looked up.
            return None;
        }
        if self.store.is_shared() {
            // An unreachable store makes it unknown: counted as the configured worst case.
            self.store.note(&format!("ctx:{id}")).await.ok().flatten()
        } else {
            self.contexts.get(id)
        }
    }

    /// The store's loss told (once), and its books rebuilt from the ledger when there is one.
    pub(crate) fn store_lost(&self) {
        self.store.report_loss();
        if let Some(b) = &self.books {
            b.store_lost(&self.store);
        }
    }

    pub(crate) fn next_id(&self) -> String {
        request_id(self.nonce, self.seq.fetch_add(1, Ordering::Relaxed))
    }
}

/// `tg-`, the process's nonce in 12 hex digits, `-`, the sequence number in at least 7: 23
/// bytes, what the memory store keeps inline (for 268 million requests per process; beyond,
/// an id is one allocation longer). The padding makes a process's ids ascend as text, so that
/// the spend ledger's key on them grows at its right edge instead of splitting pages across
/// the index.
fn request_id(nonce: u64, seq: u64) -> String {
    format!("tg-{nonce:012x}-{seq:07x}")
}

/// Shared gateway state for handlers.
pub type Shared = Arc<Gateway>;

#[cfg(test)]
mod tests {
    use super::request_id;

    #[test]
    fn a_process_ids_ascend_as_text_and_fit_inline() {
        let nonce = 0xa1b2_c3d4_e5f6;
        let seqs = (0..0x1_0000).chain([0x0fff_fffe, 0x0fff_ffff]);
        let ids: Vec<String> = seqs.map(|s| request_id(nonce, s)).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert!(ids.iter().all(|id| id.len() == 23), "{:?}", ids.last());
        assert_eq!(ids[0x1a], "tg-a1b2c3d4e5f6-000001a");
    }
}
