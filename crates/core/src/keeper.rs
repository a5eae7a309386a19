//! What a store keeps beyond admission: the second of the two traits a store implements.
//!
//! [`crate::Store`] admits, settles and renews. [`Keeper`] covers what a store that instances
//! share must keep besides: its marker and its state (so that a store that forgot is noticed),
//! its write sequence's high-water marks, the expiries a spend ledger writes down, settled
//! totals added back, notes, and the records set at run time (issued keys and limits).
//!
//! Every method has the answer of a store that lives and dies with the process: it cannot
//! forget while anyone reads it, and it keeps no records for other instances. The memory store
//! takes those answers; a shared store overrides them all. A gateway sees a store only through
//! the two traits.

use std::future::Future;
use std::time::Duration;

use crate::ledger::Period;
use crate::store::{Expiry, StoreError, StoreState};

/// Where an expiry is kept, to forget it once written down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpiryTag {
    /// This process's sequence number.
    Local(u64),
    /// A shared store's entry: the shard and the entry's id there.
    Shared(usize, String),
}

/// The highest write a store was seen to make: its epoch and its sequence, by shard.
pub type Mark = Option<(String, u64)>;

/// Why a shared store is lost, as its loss flag says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Loss {
    /// The marker is gone: the store forgot everything (a restart without persistence,
    /// FLUSHALL, eviction), or the flag was written before causes were.
    Forgot,
    /// The store's write sequence is behind what an instance had seen: it went back in time (a
    /// failover to a replica that lagged).
    Behind {
        /// The store's epoch.
        epoch: String,
        /// The store's sequence.
        store: u64,
        /// The sequence an instance had seen.
        seen: u64,
    },
    /// The store's primary was promoted from a replica whose copy of the history ended before
    /// what an instance had seen of it.
    CutShort {
        /// The history's id.
        history: String,
        /// Where the promoted replica's copy of it ended.
        ended: u64,
        /// How far an instance had seen it go.
        seen: u64,
    },
}

impl Loss {
    /// `forgot` for a store that forgot everything, `behind` for one that went back in time.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Forgot => "forgot",
            Self::Behind { .. } | Self::CutShort { .. } => "behind",
        }
    }
}

impl std::fmt::Display for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Forgot => f.write_str("the store's marker is gone: it forgot its state"),
            Self::Behind { epoch, store, seen } => write!(
                f,
                "the store's write sequence is {store}, behind the {seen} an instance had seen \
                 (epoch {epoch}): it went back in time, as after a failover to a replica that \
                 lagged"
            ),
            Self::CutShort {
                history,
                ended,
                seen,
            } => write!(
                f,
                "the store's primary was promoted from a replica whose copy of replication \
                 history {history} ended at offset {ended}, behind the {seen} an instance had \
                 seen: the writes between were lost"
            ),
        }
    }
}

/// A set of records kept at run time, which every instance reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordSet {
    /// Virtual keys issued at run time, by id.
    IssuedKeys,
    /// Limits set for one value, by scope and control.
    Limits,
}

/// How a key's record is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyWrite {
    /// The store is the keys' truth: written if the held version is `expected` (0: none), and
    /// only until the store's clock reads `deadline` (ms).
    Swap {
        /// The version the change was made from.
        expected: u64,
        /// The store's instant after which the write is refused.
        deadline: u64,
    },
    /// A copy of the ledger's record (the truth): written if the held version is lower.
    Copy,
    /// A copy by the rebuild of a store that forgot, written while its loss is not yet lifted.
    Rebuild,
}

/// What a write of a key's record found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyPut {
    /// Written.
    Done,
    /// Not written: the store holds this version (0: none).
    Changed(u64),
    /// Not written: it arrived after its deadline.
    Late,
    /// Not written: the store forgot, and its books are not yet rebuilt.
    Lost,
}

/// The records of a set and their version.
pub type Records = (u64, Vec<(String, String)>);

/// A budget period to add a settled amount to: its kind, its number, and its name in the store.
pub type PeriodRef<'a> = (Period, u64, &'a str);

fn done<T: Send>(value: T) -> impl Future<Output = Result<T, StoreError>> + Send {
    std::future::ready(Ok(value))
}

/// What a store keeps beyond admission. The defaults are a store that lives and dies with the
/// process (see the module's documentation).
pub trait Keeper: Send + Sync {
    /// Whether instances share the store: only then are its records, notes and marks kept in
    /// it (otherwise each process keeps its own).
    fn is_shared(&self) -> bool {
        false
    }

    /// How long one call may take before it is given up (a deadline is counted from it).
    fn call_timeout(&self) -> Duration {
        Duration::ZERO
    }

    /// What the store's marker says.
    fn state(&self) -> impl Future<Output = Result<StoreState, StoreError>> + Send {
        done(StoreState::Kept)
    }

    /// Initialises a new store: `true` if this call did.
    fn initialise(&self) -> impl Future<Output = Result<bool, StoreError>> + Send {
        done(false)
    }

    /// Writes a loss down, so that every instance refuses until it is rebuilt or acknowledged.
    fn mark_lost(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        done(())
    }

    /// Lifts a loss: admissions resume with what the store holds now.
    fn acknowledge_loss(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        done(())
    }

    /// Why the store was last found lost.
    fn loss_cause(&self) -> Option<Loss> {
        None
    }

    /// The highest write seen of each shard.
    fn high_marks(&self) -> Vec<Mark> {
        Vec::new()
    }

    /// Takes the marks an earlier run saw (kept in a spend ledger) as seen.
    fn prime_marks(&self, _marks: &[Mark]) {}

    /// Whether the store answers.
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        done(())
    }

    /// Asks the store to keep its expiries for [`Keeper::expiries`] (a spend ledger's).
    fn keep_expiries(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        done(())
    }

    /// Expiries kept and not yet acknowledged, oldest first, with their tags.
    fn expiries(
        &self,
        _max: usize,
    ) -> impl Future<Output = Result<Vec<(ExpiryTag, Expiry)>, StoreError>> + Send {
        done(Vec::new())
    }

    /// Forgets expiries written down.
    fn ack_expiries(
        &self,
        _tags: Vec<ExpiryTag>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        done(())
    }

    /// Adds the charge of a request the store forgot, once written down, to a budget period
    /// named `field`, which ends at `end_ms`. A store that cannot forget has nothing to add.
    fn charge_forgotten(
        &self,
        _scope_id: &str,
        _field: &str,
        _end_ms: u64,
        _amount: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        done(())
    }

    /// Adds a spend ledger's settled total to a budget period of a store that forgot it (a
    /// rebuild).
    fn restore_settled(
        &self,
        scope_id: &str,
        period: PeriodRef<'_>,
        end_ms: u64,
        amount: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Keeps a number under `name` for `ttl`, for every instance.
    fn put_note(
        &self,
        _name: &str,
        _value: u64,
        _ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        done(())
    }

    /// The number kept under `name`.
    fn note(&self, _name: &str) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        done(None)
    }

    /// Keeps a short text under `name` for `ttl`, for every instance. A store that lives and
    /// dies with its process keeps none: no other instance could read it.
    fn put_text(
        &self,
        _name: &str,
        _value: &str,
        _ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        done(())
    }

    /// The text kept under `name` by [`Keeper::put_text`], if it has not expired.
    fn text(&self, _name: &str) -> impl Future<Output = Result<Option<String>, StoreError>> + Send {
        done(None)
    }

    /// The records of `set` and their version, unless the version is still `known`.
    fn records(
        &self,
        _set: RecordSet,
        _known: u64,
    ) -> impl Future<Output = Result<Option<Records>, StoreError>> + Send {
        done(None)
    }

    /// Writes changes to `set` (`None`: removed), raising its version by `step`; answers the
    /// new version.
    fn write_records(
        &self,
        _set: RecordSet,
        _changes: &[(String, Option<String>)],
        _step: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        done(0)
    }

    /// Key `id`'s version (0: none) and record, and the store's time (ms).
    fn key_record(
        &self,
        _id: &str,
    ) -> impl Future<Output = Result<(u64, Option<String>, u64), StoreError>> + Send {
        done((0, None, 0))
    }

    /// Writes key `id`'s record at `version`, as `how` says.
    fn put_key(
        &self,
        _id: &str,
        _record: (u64, &str),
        _how: KeyWrite,
        _step: u32,
    ) -> impl Future<Output = Result<KeyPut, StoreError>> + Send {
        done(KeyPut::Done)
    }

    /// Issued keys kept in an earlier layout, to be carried over.
    fn legacy_keys(
        &self,
    ) -> impl Future<Output = Result<Vec<(String, String)>, StoreError>> + Send {
        done(Vec::new())
    }

    /// Removes the earlier layout once carried over.
    fn drop_legacy_keys(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        done(())
    }
}

/// The last of this process's tags among `tags` (expiries are acknowledged up to it).
pub fn last_local(tags: &[ExpiryTag]) -> Option<u64> {
    tags.iter()
        .filter_map(|t| match t {
            ExpiryTag::Local(n) => Some(*n),
            ExpiryTag::Shared(..) => None,
        })
        .max()
}

/// Writes every [`Keeper`] method but the expiries' pair as a call through `$via`, a macro the
/// forwarding store defines: `$via!(now self, method(args))` for a method that returns at once,
/// `$via!(await self, method(args))` for one that is awaited. A store that keeps through others
/// (the gateway's configured store, the slices over their store) forwards with this, so that a
/// method added to the trait is forwarded here, once. The expiries' pair is where such stores
/// differ, and each writes it.
#[macro_export]
macro_rules! forward_keeper {
    ($via:ident) => {
        fn is_shared(&self) -> bool {
            $via!(now self, is_shared())
        }
        fn call_timeout(&self) -> ::std::time::Duration {
            $via!(now self, call_timeout())
        }
        async fn state(&self) -> Result<$crate::StoreState, $crate::StoreError> {
            $via!(await self, state())
        }
        async fn initialise(&self) -> Result<bool, $crate::StoreError> {
            $via!(await self, initialise())
        }
        async fn mark_lost(&self) -> Result<(), $crate::StoreError> {
            $via!(await self, mark_lost())
        }
        async fn acknowledge_loss(&self) -> Result<(), $crate::StoreError> {
            $via!(await self, acknowledge_loss())
        }
        fn loss_cause(&self) -> Option<$crate::Loss> {
            $via!(now self, loss_cause())
        }
        fn high_marks(&self) -> Vec<$crate::keeper::Mark> {
            $via!(now self, high_marks())
        }
        fn prime_marks(&self, marks: &[$crate::keeper::Mark]) {
            $via!(now self, prime_marks(marks))
        }
        async fn ping(&self) -> Result<(), $crate::StoreError> {
            $via!(await self, ping())
        }
        async fn keep_expiries(&self) -> Result<(), $crate::StoreError> {
            $via!(await self, keep_expiries())
        }
        async fn charge_forgotten(
            &self,
            scope_id: &str,
            field: &str,
            end_ms: u64,
            amount: u64,
        ) -> Result<(), $crate::StoreError> {
            $via!(await self, charge_forgotten(scope_id, field, end_ms, amount))
        }
        async fn restore_settled(
            &self,
            scope_id: &str,
            period: $crate::keeper::PeriodRef<'_>,
            end_ms: u64,
            amount: u64,
        ) -> Result<(), $crate::StoreError> {
            $via!(await self, restore_settled(scope_id, period, end_ms, amount))
        }
        async fn put_note(
            &self,
            name: &str,
            value: u64,
            ttl: ::std::time::Duration,
        ) -> Result<(), $crate::StoreError> {
            $via!(await self, put_note(name, value, ttl))
        }
        async fn note(&self, name: &str) -> Result<Option<u64>, $crate::StoreError> {
            $via!(await self, note(name))
        }
        async fn put_text(
            &self,
            name: &str,
            value: &str,
            ttl: ::std::time::Duration,
        ) -> Result<(), $crate::StoreError> {
            $via!(await self, put_text(name, value, ttl))
        }
        async fn text(&self, name: &str) -> Result<Option<String>, $crate::StoreError> {
            $via!(await self, text(name))
        }
        async fn records(
            &self,
            set: $crate::keeper::RecordSet,
            known: u64,
        ) -> Result<Option<$crate::keeper::Records>, $crate::StoreError> {
            $via!(await self, records(set, known))
        }
        async fn write_records(
            &self,
            set: $crate::keeper::RecordSet,
            changes: &[(String, Option<String>)],
            step: u32,
        ) -> Result<u64, $crate::StoreError> {
            $via!(await self, write_records(set, changes, step))
        }
        async fn key_record(
            &self,
            id: &str,
        ) -> Result<(u64, Option<String>, u64), $crate::StoreError> {
            $via!(await self, key_record(id))
        }
        async fn put_key(
            &self,
            id: &str,
            record: (u64, &str),
            how: $crate::keeper::KeyWrite,
            step: u32,
        ) -> Result<$crate::keeper::KeyPut, $crate::StoreError> {
            $via!(await self, put_key(id, record, how, step))
        }
        async fn legacy_keys(&self) -> Result<Vec<(String, String)>, $crate::StoreError> {
            $via!(await self, legacy_keys())
        }
        async fn drop_legacy_keys(&self) -> Result<(), $crate::StoreError> {
            $via!(await self, drop_legacy_keys())
        }
    };
}
