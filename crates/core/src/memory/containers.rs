//! The memory store's containers, generic and knowing nothing of admissions: a FIFO queue in
//! blocks, a vector in blocks, and a sharded hash map that takes its hash from the caller.

use std::borrow::Borrow;
use std::collections::VecDeque;
use std::hash::BuildHasher;

use hashbrown::HashTable;

/// Entries per block of a [`BlockQueue`].
const BLOCK: usize = 4096;

/// A first-in, first-out queue kept in blocks of at most [`BLOCK`] entries, so that growing
/// moves at most half a block: a `VecDeque` of a million remembered ids (24 MB) copied its
/// wrapped part when it doubled, under the store's lock. A block grows like any vector up to
/// [`BLOCK`], so a small store holds no more than it needs.
#[derive(Debug)]
pub(super) struct BlockQueue<T> {
    blocks: VecDeque<VecDeque<T>>,
    len: usize,
}

impl<T> Default for BlockQueue<T> {
    fn default() -> Self {
        Self {
            blocks: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> BlockQueue<T> {
    pub(super) fn push_back(&mut self, v: T) {
        match self.blocks.back_mut() {
            Some(b) if b.len() < BLOCK => b.push_back(v),
            _ => {
                let mut b = VecDeque::new();
                b.push_back(v);
                self.blocks.push_back(b);
            }
        }
        self.len += 1;
    }

    pub(super) fn front(&self) -> Option<&T> {
        self.blocks.front()?.front()
    }

    pub(super) fn pop_front(&mut self) -> Option<T> {
        let b = self.blocks.front_mut()?;
        let v = b.pop_front();
        if b.is_empty() {
            self.blocks.pop_front();
        }
        if v.is_some() {
            self.len -= 1;
        }
        v
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

/// A vector in blocks of at most [`BLOCK`], for the same reasons as [`BlockQueue`]: a vector
/// of a million scopes (about 140 MB) moved when it doubled.
#[derive(Debug)]
pub(super) struct Blocks<T> {
    blocks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Blocks<T> {
    fn default() -> Self {
        Self {
            blocks: Vec::new(),
            len: 0,
        }
    }
}

/// Every scope's state, by slot.
impl<T> Blocks<T> {
    pub(super) fn get(&self, i: usize) -> Option<&T> {
        self.blocks.get(i / BLOCK)?.get(i % BLOCK)
    }

    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.blocks.get_mut(i / BLOCK)?.get_mut(i % BLOCK)
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Appends a slot and returns its index.
    pub(super) fn push(&mut self, s: T) -> usize {
        match self.blocks.last_mut() {
            Some(b) if b.len() < BLOCK => b.push(s),
            _ => {
                self.blocks.push(vec![s]);
            }
        }
        self.len += 1;
        self.len - 1
    }
}

/// One shard of a [`ShardedMap`]: (id, value) entries.
pub(super) type Table<K, V> = HashTable<(K, V)>;

/// Maps of [`ShardedMap`].
pub(super) const SHARDS: usize = 128;

/// A hash map by string id, split into [`SHARDS`] tables by bits of the id's hash that the
/// tables themselves do not use. A hash table grows in one step, moving every entry, and the
/// store grows its maps under its lock: one map of a million remembered ids would stall every
/// waiting request while it moved them. Split, a growth moves a 128th of the entries (more
/// tables cut the pause further, but each table's header is one more cache line to find per
/// operation). Each operation hashes the id once.
#[derive(Debug)]
pub(super) struct ShardedMap<K, V> {
    hasher: foldhash::fast::RandomState,
    tables: Box<[Table<K, V>]>,
    len: usize,
}

impl<K, V> Default for ShardedMap<K, V> {
    fn default() -> Self {
        Self {
            hasher: foldhash::fast::RandomState::default(),
            tables: (0..SHARDS).map(|_| HashTable::new()).collect(),
            len: 0,
        }
    }
}

impl<K: Borrow<str>, V> ShardedMap<K, V> {
    pub(super) fn hash(&self, id: &str) -> u64 {
        self.hasher.hash_one(id)
    }

    /// Bits from 32 up: a table uses the low bits for the bucket and the top seven as the tag.
    pub(super) fn shard(hash: u64) -> usize {
        (hash >> 32) as usize % SHARDS
    }

    pub(super) fn get(&self, id: &str) -> Option<&V> {
        self.get_hashed(self.hash(id), id)
    }

    /// [`Self::get`] of an id whose hash `h` the caller has already computed.
    pub(super) fn get_hashed(&self, h: u64, id: &str) -> Option<&V> {
        let (_, v) = self
            .tables
            .get(Self::shard(h))?
            .find(h, |(k, _)| k.borrow() == id)?;
        Some(v)
    }

    /// The entry's own key (to share it) and its value.
    pub(super) fn get_entry_mut(&mut self, id: &str) -> Option<(&K, &mut V)> {
        let h = self.hash(id);
        let (k, v) = self
            .tables
            .get_mut(Self::shard(h))?
            .find_mut(h, |(k, _)| k.borrow() == id)?;
        Some((&*k, v))
    }

    pub(super) fn get_mut(&mut self, id: &str) -> Option<&mut V> {
        self.get_entry_mut(id).map(|(_, v)| v)
    }

    /// Whether the id, whose hash is `h` ([`Self::hash`]), has an entry.
    pub(super) fn contains_hashed(&self, h: u64, id: &str) -> bool {
        self.get_hashed(h, id).is_some()
    }

    /// Inserts an id that the caller has just found absent (under the same lock).
    pub(super) fn insert_new(&mut self, id: K, v: V) {
        let h = self.hash(id.borrow());
        self.insert_new_hashed(h, id, v);
    }

    /// [`Self::insert_new`] of an id whose hash `h` the caller has already computed.
    pub(super) fn insert_new_hashed(&mut self, h: u64, id: K, v: V) {
        let hasher = &self.hasher;
        if let Some(t) = self.tables.get_mut(Self::shard(h)) {
            t.insert_unique(h, (id, v), |(k, _)| hasher.hash_one::<&str>(k.borrow()));
            self.len += 1;
        }
    }

    /// Removes the id's entry if `pred` holds for its value.
    pub(super) fn remove_if(&mut self, id: &str, pred: impl FnOnce(&V) -> bool) -> Option<V> {
        let h = self.hash(id);
        let t = self.tables.get_mut(Self::shard(h))?;
        let entry = t.find_entry(h, |(k, _)| k.borrow() == id).ok()?;
        if !pred(&entry.get().1) {
            return None;
        }
        let ((_, v), _) = entry.remove();
        self.len -= 1;
        Some(v)
    }

    pub(super) fn remove(&mut self, id: &str) -> Option<V> {
        self.remove_if(id, |_| true)
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &V> {
        self.tables.iter().flat_map(|t| t.iter().map(|(_, v)| v))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Order is kept across block boundaries, with pushes and pops interleaved.
    #[test]
    fn block_queue_is_first_in_first_out_across_blocks() {
        let mut q = BlockQueue::default();
        let (mut next_in, mut next_out) = (0usize, 0usize);
        for round in 0..6 {
            for _ in 0..(BLOCK + 123 * round) {
                q.push_back(next_in);
                next_in += 1;
            }
            for _ in 0..(BLOCK / 2 + 7 * round) {
                assert_eq!(q.front(), Some(&next_out));
                assert_eq!(q.pop_front(), Some(next_out));
                next_out += 1;
            }
            assert_eq!(q.len(), next_in - next_out);
        }
        while let Some(v) = q.pop_front() {
            assert_eq!(v, next_out);
            next_out += 1;
        }
        assert_eq!((q.len(), next_out), (0, next_in));
        assert!(q.blocks.is_empty());
    }

    /// Slots past the first block are found where they were put.
    #[test]
    fn slots_span_blocks() {
        let mut s = Blocks::default();
        for i in 0..(3 * BLOCK + 5) {
            assert_eq!(s.push(i.to_string()), i);
        }
        assert_eq!(s.len(), 3 * BLOCK + 5);
        for i in [0, BLOCK - 1, BLOCK, 2 * BLOCK + 1, 3 * BLOCK + 4] {
            assert_eq!(s.get(i).map(String::as_str), Some(&*i.to_string()));
        }
        assert!(s.get(3 * BLOCK + 5).is_none());
    }

    /// Many ids over every shard: each found, counted and removed once; `remove_if` keeps what
    /// its predicate refuses.
    #[test]
    fn sharded_map_finds_counts_and_removes() {
        let mut m = ShardedMap::default();
        let n = 20 * SHARDS;
        for i in 0..n {
            m.insert_new(Arc::from(format!("req-{i}")), i);
        }
        assert_eq!(m.len(), n);
        assert!(
            m.tables.iter().all(|t| !t.is_empty()),
            "ids spread over every shard"
        );
        for i in 0..n {
            assert_eq!(m.get(&format!("req-{i}")), Some(&i));
        }
        assert!(!m.contains_hashed(m.hash("req-x"), "req-x"));
        assert!(m.contains_hashed(m.hash("req-3"), "req-3"));
        if let Some((k, v)) = m.get_entry_mut("req-7") {
            assert_eq!(&**k, "req-7");
            *v = 700;
        }
        assert_eq!(m.get("req-7"), Some(&700));
        assert_eq!(m.remove_if("req-8", |v| *v != 8), None);
        assert_eq!(m.remove_if("req-8", |v| *v == 8), Some(8));
        assert_eq!(m.remove("req-8"), None);
        assert_eq!(m.len(), n - 1);
        assert_eq!(m.values().count(), n - 1);
    }
}
