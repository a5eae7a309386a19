//! The store the gateway was configured with: memory, Redis, or Redis with leased slices; one
//! [`Store`] over them.

use std::sync::Arc;

use tollgate_core::pipeline::Plan;
use tollgate_core::{
    Decision, Expiry, Finish, MemoryStore, Period, Renewal, ScopeUsage, Sliced, Store, StoreError,
    StoreState, Usage,
};
use tollgate_redis::RedisStore;

pub use crate::path::settle::{Recording, Ticket, open_tickets};

/// Where an expiry is kept, to forget it once written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpiryTag {
    /// The memory store's sequence number.
    Memory(u64),
    /// A Redis shard's stream entry.
    Redis(tollgate_redis::ExpiryTag),
}

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

impl AnyStore {
    /// The Redis store, when there is one (with slices or without).
    pub fn redis(&self) -> Option<&RedisStore> {
        match self {
            AnyStore::Memory(_) => None,
            AnyStore::Redis(r) => Some(r),
            AnyStore::Sliced(s) => Some(s.inner()),
        }
    }

    /// Why the store was last found lost, for the operator (the memory store cannot be).
    pub fn loss_cause(&self) -> Option<String> {
        self.redis()
            .and_then(RedisStore::loss_cause)
            .map(|l| l.to_string())
    }

    /// The store's loss, logged once with its cause and counted by it.
    pub fn report_loss(&self) {
        let cause = self.redis().and_then(RedisStore::loss_cause);
        let why = cause
            .as_ref()
            .map_or_else(|| StoreError::StateLost.to_string(), ToString::to_string);
        let begins = crate::faults::STORE_LOST.fail(
            &why,
            "the store has lost its state: admissions are refused (503 store_state_lost) until \
             its books are rebuilt from the ledger or an operator acknowledges the loss",
        );
        if begins {
            let kind = match cause {
                Some(
                    tollgate_redis::Loss::Behind { .. } | tollgate_redis::Loss::CutShort { .. },
                ) => "behind",
                _ => "forgot",
            };
            crate::telemetry::store_loss(kind);
        }
    }

    /// Acknowledges that the store lost its state (a no-op for the memory store, which cannot
    /// forget while the process lives).
    pub async fn acknowledge_loss(&self) -> Result<(), StoreError> {
        match self.redis() {
            None => Ok(()),
            Some(r) => r.acknowledge_loss().await,
        }
    }

    /// Adds to a budget scope's settled amount in one period (see
    /// [`RedisStore::add_settled`]); the memory store, which never forgets, has nothing to add.
    pub async fn add_settled(
        &self,
        scope_id: &str,
        field: &str,
        expire_at_ms: u64,
        amount: u64,
    ) -> Result<(), StoreError> {
        match self.redis() {
            None => Ok(()),
            Some(r) => r.add_settled(scope_id, field, expire_at_ms, amount).await,
        }
    }

    /// Adds a spend ledger's settled total to a budget period of a store that forgot it (a
    /// rebuild): one period (`period`, `period_id`, ending at `end_ms`, named `field` in Redis).
    pub async fn restore_settled(
        &self,
        scope_id: &str,
        (period, period_id, field): (Period, u64, &str),
        end_ms: u64,
        amount: u64,
    ) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(m) => m.add_settled(scope_id, period, period_id, end_ms, amount),
            AnyStore::Redis(r) => r.add_settled(scope_id, field, end_ms, amount).await,
            AnyStore::Sliced(s) => s.inner().add_settled(scope_id, field, end_ms, amount).await,
        }
    }

    /// What the store's marker says: the memory store, which lives and dies with the process,
    /// is always as it was given.
    pub async fn state(&self) -> Result<StoreState, StoreError> {
        match self.redis() {
            None => Ok(StoreState::Kept),
            Some(r) => r.state().await,
        }
    }

    /// Initialises a new store (see [`RedisStore::initialise`]); the memory store needs none.
    pub async fn initialise(&self) -> Result<bool, StoreError> {
        match self.redis() {
            None => Ok(false),
            Some(r) => r.initialise().await,
        }
    }

    /// Writes a loss down (see [`RedisStore::mark_lost`]).
    pub async fn mark_lost(&self) -> Result<(), StoreError> {
        match self.redis() {
            None => Ok(()),
            Some(r) => r.mark_lost().await,
        }
    }

    /// Asks the store to keep its expiries for [`AnyStore::expiries`] (a spend ledger's).
    pub async fn keep_expiries(&self) -> Result<(), StoreError> {
        match self.redis() {
            None => Ok(()),
            Some(r) => r.keep_expiries().await,
        }
    }

    /// Expiries kept and not yet acknowledged, oldest first, with their tags.
    pub async fn expiries(&self, max: usize) -> Result<Vec<(ExpiryTag, Expiry)>, StoreError> {
        match self {
            AnyStore::Memory(m) => Ok(m
                .expiries(max)?
                .into_iter()
                .map(|(t, e)| (ExpiryTag::Memory(t), e))
                .collect()),
            AnyStore::Redis(r) => Ok(r
                .expiries(max)
                .await?
                .into_iter()
                .map(|(t, e)| (ExpiryTag::Redis(t), e))
                .collect()),
            // Requests admitted here expire here; the slices' own expiries are the store's.
            AnyStore::Sliced(s) => {
                let mut out: Vec<(ExpiryTag, Expiry)> = s
                    .local_expiries(max)?
                    .into_iter()
                    .map(|(t, e)| (ExpiryTag::Memory(t), e))
                    .collect();
                let left = max.saturating_sub(out.len());
                out.extend(
                    s.inner()
                        .expiries(left)
                        .await?
                        .into_iter()
                        .map(|(t, e)| (ExpiryTag::Redis(t), e)),
                );
                Ok(out)
            }
        }
    }

    /// Forgets expiries written to the ledger.
    pub async fn ack_expiries(&self, tags: Vec<ExpiryTag>) -> Result<(), StoreError> {
        let last = tags
            .iter()
            .filter_map(|t| match t {
                ExpiryTag::Memory(n) => Some(*n),
                ExpiryTag::Redis(_) => None,
            })
            .max();
        let redis: Vec<_> = tags
            .into_iter()
            .filter_map(|t| match t {
                ExpiryTag::Redis(t) => Some(t),
                ExpiryTag::Memory(_) => None,
            })
            .collect();
        match self {
            AnyStore::Memory(m) => last.map_or(Ok(()), |n| m.ack_expiries(n)),
            AnyStore::Redis(r) => r.ack_expiries(&redis).await,
            AnyStore::Sliced(s) => {
                if let Some(n) = last {
                    s.ack_local_expiries(n)?;
                }
                s.inner().ack_expiries(&redis).await
            }
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
            let mut last = tollgate_core::SliceStats::default();
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

    /// Whether the store answers (`/readyz`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self.redis() {
            None => Ok(()),
            Some(r) => r.ping().await,
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
