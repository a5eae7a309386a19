//! Counts of long texts kept per tenant, so that an agent's history is counted once, not on
//! every turn (see [`tollgate_tokens::memo`]).
//!
//! - **Exact**: a count is kept only when the vocabulary gave it whole; the lookup is by a
//!   SHA-256 digest of the text, its vocabulary and the tenant's own key, so a text found is the
//!   text counted (a collision needs about 2^64 work, and the key is secret).
//! - **Per tenant**: each tenant's texts are kept apart, under a key derived from a secret made
//!   at start and the tenant's name. A tenant's lookups can only find what that tenant sent, so
//!   the time a count takes says nothing of another tenant's prompts; and each tenant has a
//!   bound of its own, so no tenant's traffic evicts another's texts.
//! - **Bounded**: at most `entries` counts in all: `entries / PER_TENANT` tenants of
//!   [`PER_TENANT`] counts each (fewer when `entries` is smaller), a tenant's in two generations (a full current one becomes the
//!   previous one, and the previous one is dropped); past the tenants' bound the least recently
//!   used tenant's counts are dropped. [`CountMemos::bytes`] says what they hold.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use tollgate_tokens::Memo;

/// Counts kept per tenant at most.
pub const PER_TENANT: usize = 4096;

/// Bytes one slot of a table takes: the digest and the count (aligned as the digest is) and the
/// table's control byte.
const BYTES_PER_SLOT: usize = std::mem::size_of::<(u128, u64)>() + 1;

/// Every tenant's memo.
#[derive(Debug)]
pub struct CountMemos {
    secret: [u8; 32],
    per_tenant: usize,
    tenants_max: usize,
    tenants: Mutex<HashMap<String, Arc<TenantMemo>>>,
    tick: AtomicU64,
}

impl CountMemos {
    /// Memos holding at most `entries` counts in all (0: none kept).
    pub fn new(entries: usize) -> Self {
        let mut secret = [0u8; 32];
        // Without the system's randomness the key is still the tenant's own, only guessable.
        let _ = getrandom::fill(&mut secret);
        let per_tenant = PER_TENANT.min(entries).max(1);
        Self {
            secret,
            per_tenant,
            tenants_max: entries / per_tenant,
            tenants: Mutex::new(HashMap::new()),
            tick: AtomicU64::new(0),
        }
    }

    /// `tenant`'s memo; `None` when none are kept.
    pub fn for_tenant(&self, tenant: &str) -> Option<Arc<dyn Memo>> {
        if self.tenants_max == 0 {
            return None;
        }
        let now = self.tick.fetch_add(1, Ordering::Relaxed);
        let mut t = self.tenants.lock().ok()?;
        if let Some(m) = t.get(tenant) {
            m.used.store(now, Ordering::Relaxed);
            return Some(m.clone());
        }
        if t.len() >= self.tenants_max {
            let oldest = t
                .iter()
                .min_by_key(|(_, m)| m.used.load(Ordering::Relaxed))
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                t.remove(&k);
            }
        }
        let key: [u8; 32] = Sha256::new()
            .chain_update(self.secret)
            .chain_update(tenant.as_bytes())
            .finalize()
            .into();
        let m = Arc::new(TenantMemo {
            key,
            cap: self.per_tenant,
            gens: Mutex::new(Generations::default()),
            used: AtomicU64::new(now),
        });
        t.insert(tenant.to_owned(), m.clone());
        Some(m)
    }

    /// Counts kept, in all.
    pub fn entries(&self) -> usize {
        self.each(|g| g.current.len() + g.previous.len())
    }

    /// Bytes the kept counts' tables take, in all (a table fills seven eighths of its slots).
    pub fn bytes(&self) -> usize {
        let slots = |n: usize| n.div_ceil(7) * 8;
        self.each(|g| (slots(g.current.capacity()) + slots(g.previous.capacity())) * BYTES_PER_SLOT)
    }

    fn each(&self, f: impl Fn(&Generations) -> usize) -> usize {
        let Ok(t) = self.tenants.lock() else { return 0 };
        t.values()
            .filter_map(|m| m.gens.lock().ok().map(|g| f(&g)))
            .sum()
    }
}

/// One tenant's counts.
#[derive(Debug)]
struct TenantMemo {
    key: [u8; 32],
    /// Counts kept at most.
    cap: usize,
    gens: Mutex<Generations>,
    /// When the tenant was last asked for, in [`CountMemos`]' ticks.
    used: AtomicU64,
}

#[derive(Debug, Default)]
struct Generations {
    current: HashMap<u128, u64>,
    previous: HashMap<u128, u64>,
}

impl TenantMemo {
    fn digest(&self, vocabulary: &str, text: &str) -> u128 {
        let d = Sha256::new()
            .chain_update(self.key)
            .chain_update(vocabulary.as_bytes())
            .chain_update([0u8])
            .chain_update(text.as_bytes())
            .finalize();
        let mut first = [0u8; 16];
        first.copy_from_slice(&d[..16]);
        u128::from_le_bytes(first)
    }
}

impl Memo for TenantMemo {
    fn get(&self, vocabulary: &'static str, text: &str) -> Option<u64> {
        let d = self.digest(vocabulary, text);
        let mut g = self.gens.lock().ok()?;
        if let Some(n) = g.current.get(&d) {
            return Some(*n);
        }
        // Found in the previous generation: kept on into the current one.
        let n = g.previous.remove(&d)?;
        g.insert(d, n, self.cap);
        Some(n)
    }

    fn put(&self, vocabulary: &'static str, text: &str, tokens: u64) {
        let d = self.digest(vocabulary, text);
        if let Ok(mut g) = self.gens.lock() {
            g.insert(d, tokens, self.cap);
        }
    }
}

impl Generations {
    fn insert(&mut self, d: u128, n: u64, cap: usize) {
        if self.current.len() >= (cap / 2).max(1) {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(d, n);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn text(i: usize) -> String {
        format!("{i:08} {}", "lorem ipsum dolor sit amet ".repeat(12))
    }

    /// Memory stays within its bound whatever is counted: a tenant keeps at most its share,
    /// and tenants past the bound drop the least recently used one's counts.
    #[test]
    fn the_memo_stays_within_its_bound() {
        let memos = CountMemos::new(4 * PER_TENANT);
        for tenant in 0..10 {
            let m = memos.for_tenant(&format!("t{tenant}")).unwrap();
            for i in 0..3 * PER_TENANT {
                m.put("o200k_base", &text(i), i as u64);
            }
        }
        assert!(memos.entries() <= 4 * PER_TENANT, "{}", memos.entries());
        assert_eq!(memos.tenants.lock().unwrap().len(), 4);
        // The tables' bytes follow the entries: a tenant's two tables, each for half its share,
        // of at most PER_TENANT slots (a power of two, seven eighths used).
        let bytes = memos.bytes();
        assert!(bytes <= 4 * 2 * PER_TENANT * BYTES_PER_SLOT, "{bytes}");
        assert!(bytes >= memos.entries() * BYTES_PER_SLOT, "{bytes}");
        // The latest texts are kept.
        let m = memos.for_tenant("t9").unwrap();
        let last = 3 * PER_TENANT - 1;
        assert_eq!(m.get("o200k_base", &text(last)), Some(last as u64));
    }

    /// A tenant finds only its own counts: the same text counted by another tenant is not
    /// found, nor the same text in another vocabulary.
    #[test]
    fn a_tenant_finds_only_its_own_counts() {
        let memos = CountMemos::new(16 * PER_TENANT);
        let (a, b) = (
            memos.for_tenant("a").unwrap(),
            memos.for_tenant("b").unwrap(),
        );
        a.put("o200k_base", &text(1), 41);
        assert_eq!(a.get("o200k_base", &text(1)), Some(41));
        assert_eq!(b.get("o200k_base", &text(1)), None);
        assert_eq!(a.get("cl100k_base", &text(1)), None);
        // And a tenant asked for again is the same memo.
        assert_eq!(
            memos.for_tenant("a").unwrap().get("o200k_base", &text(1)),
            Some(41)
        );
    }

    /// With no entries allowed, nothing is kept.
    #[test]
    fn none_kept_when_off() {
        assert!(CountMemos::new(0).for_tenant("a").is_none());
    }
}
