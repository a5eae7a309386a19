//! The store the gateway was configured with (memory, Redis, or Redis with leased slices),
//! built here and seen everywhere else through the two traits every store implements:
//! [`Store`] to admit and [`Keeper`] for what a shared store keeps besides. This is the one
//! file that names a store's implementation.

use std::sync::Arc;

use tollgate_core::pipeline::Plan;
use tollgate_core::{
    Decision, Expiry, ExpiryTag, Finish, Keeper, Loss, MemoryStore, Period, Renewal, ScopeUsage,
    Store, StoreError, Usage,
};
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_slices::Sliced;

use crate::config::{GatewayConfig, StoreConfig};

/// Memory, Redis, or Redis with slices.
#[derive(Debug, Clone)]
pub enum AnyStore {
    /// In this process.
    Memory(Arc<MemoryStore>),
    /// Shared through Redis, one call per admission.
    Redis(RedisStore),
    /// Shared through Redis, busy scopes admitted against slices leased from it.
    Sliced(Arc<Sliced<RedisStore>>),
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            AnyStore::Memory($s) => $e.await,
            AnyStore::Redis($s) => $e.await,
            AnyStore::Sliced($s) => $e.await,
        }
    };
}

/// One [`Keeper`] call on the store it holds (by the trait: the memory store has inherent
/// methods of the same names).
macro_rules! keep_now {
    ($self:ident, $k:ident => $e:expr) => {
        match $self {
            AnyStore::Memory(m) => {
                let $k: &MemoryStore = m;
                $e
            }
            AnyStore::Redis(r) => {
                let $k: &RedisStore = r;
                $e
            }
            AnyStore::Sliced(s) => {
                let $k: &Sliced<RedisStore> = s;
                $e
            }
        }
    };
}

macro_rules! keep {
    ($self:ident, $k:ident => $e:expr) => {
        keep_now!($self, $k => $e.await)
    };
}

/// Opens the configured store.
pub async fn start_store(config: &GatewayConfig) -> std::io::Result<AnyStore> {
    Ok(start_store_with_warnings(config).await?.0)
}

/// Opens the configured store, with what an operator should be warned of about it (a Redis
/// that keeps nothing on disk, or one whose settings could not be read). A Redis that may
/// evict keys is refused unless `[store] allow_eviction` says otherwise.
pub async fn start_store_with_warnings(
    config: &GatewayConfig,
) -> std::io::Result<(AnyStore, Vec<String>)> {
    let mut warnings = Vec::new();
    let store = match &config.store {
        StoreConfig::Memory { retention } => AnyStore::Memory(Arc::new(
            MemoryStore::new()
                .retention_ms(u64::try_from(retention.as_millis()).unwrap_or(u64::MAX))
                // A spend ledger writes them (and forgets them here) as they come.
                .keep_expiries(if config.ledger.is_some() { 100_000 } else { 0 }),
        )),
        StoreConfig::Redis {
            url,
            prefix,
            call_timeout,
            cluster,
            shards,
            retention,
            allow_eviction,
            access,
            slices,
        } => {
            let mut c = RedisConfig::new(url.as_str());
            c.ca_pem = access.ca_pem.clone();
            c.username = access.username.clone();
            c.password = access.password.clone();
            c.prefix = prefix.clone();
            c.call_timeout = *call_timeout;
            c.cluster = cluster.clone();
            c.shards = *shards;
            c.retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
            let store = RedisStore::connect(c)
                .await
                .map_err(std::io::Error::other)?;
            warnings.extend(check_keeping(&store, *allow_eviction).await?);
            match slices {
                Some(cfg) => {
                    let mut cfg = **cfg;
                    // A spend ledger writes the expiries of requests admitted here too.
                    cfg.keep_expiries = if config.ledger.is_some() { 100_000 } else { 0 };
                    AnyStore::Sliced(Arc::new(Sliced::new(store, cfg)))
                }
                None => AnyStore::Redis(store),
            }
        }
    };
    Ok((store, warnings))
}

/// Refuses a Redis that may evict keys (unless allowed), and warns of one that keeps nothing
/// on disk: either can forget spent budgets. A server that cannot be asked (down, or `CONFIG`
/// disabled) is let through with a warning; the store's marker still detects a loss.
async fn check_keeping(store: &RedisStore, allow_eviction: bool) -> std::io::Result<Vec<String>> {
    let mut warnings = Vec::new();
    match store.keeping().await {
        Ok(Some((policy, persists))) => {
            if policy != "noeviction" && !allow_eviction {
                return Err(std::io::Error::other(format!(
                    "Redis has maxmemory-policy {policy}: it may evict budgets and windows, \
                     which would reopen what they held. Set it to noeviction, or [store] \
                     allow_eviction = true to accept that (docs/store-loss.md)"
                )));
            }
            if !persists {
                warnings.push(
                    "Redis keeps nothing on disk (no RDB snapshots, no AOF): a restart forgets \
                     every budget; admissions are then refused until the loss is acknowledged"
                        .to_owned(),
                );
            }
        }
        Ok(None) => warnings.push(
            "could not read Redis's maxmemory-policy and persistence (CONFIG is not allowed): \
             make sure it neither evicts nor forgets (docs/store-loss.md)"
                .to_owned(),
        ),
        // The cause first: a TLS or connection fault is what the operator has to mend.
        Err(e) => warnings.push(format!(
            "Redis cannot be reached: {e}; until it can, admissions are refused (503 \
             store_unavailable), and its maxmemory-policy and persistence could not be checked \
             (docs/redis.md)"
        )),
    }
    Ok(warnings)
}

impl AnyStore {
    /// The store's loss, logged once with its cause and counted by it.
    pub fn report_loss(&self) {
        let cause = self.loss_cause();
        let why = cause
            .as_ref()
            .map_or_else(|| StoreError::StateLost.to_string(), ToString::to_string);
        let begins = crate::faults::STORE_LOST.fail(
            &why,
            "the store has lost its state: admissions are refused (503 store_state_lost) until \
             its books are rebuilt from the ledger or an operator acknowledges the loss",
        );
        if begins {
            crate::telemetry::store_loss(cause.as_ref().map_or("forgot", Loss::kind));
        }
    }

    /// Runs the slices' maintenance every tick, for as long as the store lives or until the
    /// handle is aborted (a server does at shutdown); nothing without slices.
    pub fn spawn_slice_maintenance(&self) -> Option<tokio::task::JoinHandle<()>> {
        let AnyStore::Sliced(s) = self else {
            return None;
        };
        let weak = Arc::downgrade(s);
        let tick = std::time::Duration::from_millis(s.config().tick_ms.max(1));
        Some(tokio::spawn(async move {
            let mut every = tokio::time::interval(tick);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last = tollgate_slices::SliceStats::default();
            loop {
                every.tick().await;
                let Some(s) = weak.upgrade() else { return };
                match s.maintain().await {
                    // The store's own state: logged once as the store's fault, not again here.
                    Err(StoreError::StateLost | StoreError::Uninitialised) => {}
                    Err(e) => {
                        crate::faults::SLICES.fail(
                            &e,
                            "slices cannot be reported, renewed or given back; retried every \
                             tick (admissions against them go on until they expire)",
                        );
                    }
                    Ok(_) => crate::faults::SLICES.ok(),
                }
                last = crate::telemetry::slices(s.stats(), last);
            }
        }))
    }

    /// Gives back every slice held beyond the requests in flight (shutdown).
    pub async fn return_slices(&self) {
        if let AnyStore::Sliced(s) = self {
            if let Err(e) = s.return_all().await {
                tracing::warn!(error = %e, "slices not given back at shutdown: they expire in the store");
            }
        }
    }
}

impl Store for AnyStore {
    async fn admit(&self, plan: &Plan) -> Result<Decision, StoreError> {
        both!(self, s => s.admit(plan))
    }
    async fn admit_shadowed(
        &self,
        plan: &Plan,
        shadow: &Plan,
    ) -> Result<(Decision, tollgate_core::ShadowOutcome), StoreError> {
        both!(self, s => s.admit_shadowed(plan, shadow))
    }
    async fn settle(&self, id: &str, usage: Usage) -> Result<Finish, StoreError> {
        both!(self, s => s.settle(id, usage))
    }
    async fn release(&self, id: &str, usage: Option<Usage>) -> Result<Finish, StoreError> {
        both!(self, s => s.release(id, usage))
    }
    async fn renew(&self, id: &str) -> Result<Renewal, StoreError> {
        both!(self, s => s.renew(id))
    }
    async fn usage(&self, scope: &str, period: Option<Period>) -> Result<ScopeUsage, StoreError> {
        both!(self, s => s.usage(scope, period))
    }
    async fn usage_carrying(
        &self,
        scope: &str,
        period: Period,
        carry: (u64, u64),
    ) -> Result<ScopeUsage, StoreError> {
        both!(self, s => s.usage_carrying(scope, period, carry))
    }
    async fn set_kill(&self, target: &str, reason: Option<&str>) -> Result<(), StoreError> {
        both!(self, s => s.set_kill(target, reason))
    }
    async fn kills(&self) -> Result<Vec<(String, String)>, StoreError> {
        both!(self, s => s.kills())
    }
    async fn claim_key(
        &self,
        key: tollgate_core::KeyUse<'_>,
    ) -> Result<tollgate_core::KeyClaim, StoreError> {
        both!(self, s => s.claim_key(key))
    }
    async fn end_claim(
        &self,
        key: &str,
        request_id: &str,
        response: Option<&[u8]>,
        keep_ms: u64,
    ) -> Result<(), StoreError> {
        both!(self, s => s.end_claim(key, request_id, response, keep_ms))
    }
}

/// A [`Keeper`] call on the store it holds.
macro_rules! held {
    (now $s:ident, $m:ident($($a:expr),*)) => {
        keep_now!($s, k => Keeper::$m(k $(, $a)*))
    };
    (await $s:ident, $m:ident($($a:expr),*)) => {
        keep!($s, k => Keeper::$m(k $(, $a)*))
    };
}

impl Keeper for AnyStore {
    tollgate_core::forward_keeper!(held);

    async fn expiries(&self, max: usize) -> Result<Vec<(ExpiryTag, Expiry)>, StoreError> {
        keep!(self, k => Keeper::expiries(k, max))
    }
    async fn ack_expiries(&self, tags: Vec<ExpiryTag>) -> Result<(), StoreError> {
        keep!(self, k => Keeper::ack_expiries(k, tags))
    }
}
