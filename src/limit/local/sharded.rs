//! A concurrent map from key bytes to a value that expires: the storage under both the local
//! limit store and the in-process tier in front of Redis.
//!
//! [`SHARDS`] mutex-guarded hash tables, chosen by the key's hash, so concurrent requests for
//! different keys rarely meet and no lock is global. The hash is computed once per request and
//! used for both the shard and the table. Expired entries read as absent and are dropped by
//! [`Sharded::sweep`], so memory follows live keys only.

use std::hash::BuildHasher;

use hashbrown::HashTable;
use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;

use crate::limit::algorithm::Micros;

/// Power of two; enough that two cores (or twenty) rarely contend on one shard.
pub const SHARDS: usize = 64;

/// Keys of up to 16 bytes (an IPv4 address, a short id) live inside the entry, so their lookup
/// touches the table and nothing behind a pointer.
type KeyBuf = SmallVec<[u8; 16]>;

/// One cache line per entry: key (24 bytes with smallvec's `union`), state (32) and expiry fill
/// 64 bytes for every algorithm (the log is boxed), and the alignment keeps an entry from
/// straddling two lines, so a decision on a cold key misses the cache once for it, not twice.
#[repr(align(64))]
struct Entry<V> {
    key: KeyBuf,
    value: V,
    expires_at: Micros,
}

pub struct Shard<V> {
    table: HashTable<Entry<V>>,
    /// The same seed as every other shard's: rehashing on growth needs it.
    hasher: foldhash::fast::RandomState,
}

impl<V> Shard<V> {
    /// The live value of `key` at `now`.
    pub fn get(&self, hash: u64, key: &[u8], now: Micros) -> Option<&V> {
        self.table
            .find(hash, |e| *e.key == *key)
            .filter(|e| e.expires_at > now)
            .map(|e| &e.value)
    }

    /// Updates `key` in place: `f` gets the live value (or `None` when absent or expired) and
    /// returns the new expiry; the entry is created from `init` when absent.
    pub fn update(
        &mut self,
        hash: u64,
        key: &[u8],
        now: Micros,
        init: impl FnOnce() -> V,
        f: impl FnOnce(&mut V, bool) -> Micros,
    ) {
        match self.table.find_mut(hash, |e| *e.key == *key) {
            Some(e) => {
                let live = e.expires_at > now;
                if !live {
                    e.value = init();
                }
                e.expires_at = f(&mut e.value, live);
            }
            None => {
                let mut value = init();
                let expires_at = f(&mut value, false);
                let hasher = &self.hasher;
                self.table.insert_unique(
                    hash,
                    Entry {
                        key: KeyBuf::from_slice(key),
                        value,
                        expires_at,
                    },
                    |e| hasher.hash_one(&e.key[..]),
                );
            }
        }
    }
}

/// Cache-line aligned so neighbouring shard locks do not false-share.
#[repr(align(64))]
struct Padded<V>(Mutex<Shard<V>>);

pub struct Sharded<V> {
    shards: Box<[Padded<V>]>,
    hasher: foldhash::fast::RandomState,
}

impl<V> Default for Sharded<V> {
    fn default() -> Self {
        let hasher = foldhash::fast::RandomState::default();
        Self {
            shards: (0..SHARDS)
                .map(|_| {
                    Padded(Mutex::new(Shard {
                        table: HashTable::new(),
                        hasher: hasher.clone(),
                    }))
                })
                .collect(),
            hasher,
        }
    }
}

impl<V> Sharded<V> {
    pub fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard holding `hash`. The table uses the hash's low bits; the shard its high ones.
    pub fn lock(&self, hash: u64) -> MutexGuard<'_, Shard<V>> {
        self.shards[(hash >> 58) as usize % SHARDS].0.lock()
    }

    /// Drops every entry expired at `now`; returns the number kept.
    pub fn sweep(&self, now: Micros) -> usize {
        let mut kept = 0;
        for s in self.shards.iter() {
            let mut shard = s.0.lock();
            shard.table.retain(|e| e.expires_at > now);
            kept += shard.table.len();
        }
        kept
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().table.len()).sum()
    }

    /// Visits every live entry, one shard lock at a time (never all at once).
    pub fn for_each_live(&self, now: Micros, mut f: impl FnMut(&[u8], &mut V)) {
        for s in self.shards.iter() {
            let mut shard = s.0.lock();
            for e in shard.table.iter_mut().filter(|e| e.expires_at > now) {
                f(&e.key, &mut e.value);
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algorithm::State;

    #[test]
    fn an_entry_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Entry<State>>(), 64);
    }
}
