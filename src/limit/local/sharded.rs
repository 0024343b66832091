//! A concurrent map from key bytes to a value that expires: the storage under both the local
//! limit store and the in-process tier in front of Redis.
//!
//! [`SHARDS`] mutex-guarded hash tables, chosen by the key's hash, so concurrent requests for
//! different keys rarely meet and no lock is global. The hash is computed once per request and
//! used for both the shard and the table. Expired entries read as absent and are dropped by
//! [`Sharded::sweep`], so memory follows live keys only.

use std::hash::BuildHasher;

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
/// straddling two lines. `Option` costs nothing: it lives in the state's enum tag.
#[repr(align(64))]
struct Entry<V> {
    key: KeyBuf,
    value: V,
    expires_at: Micros,
}

/// Where a key sits in a shard's table, as found by [`Shard::find`]: its slot when present
/// (live or expired), nothing when absent. Valid until the table is changed.
pub type Found = Option<usize>;

/// An open-addressing table with linear probing over the entries themselves.
///
/// Why not a SwissTable (hashbrown): its control bytes live apart from the entries, so a
/// decision on a cold key missed the cache twice, once in each array. Here the first slot
/// probed is, most of the time, the entry itself: one miss. The table is kept at most half
/// full, so a probe rarely reads a second line, and that line is the adjacent one, which the
/// hardware prefetches. Expired entries stay in place (they keep probe chains intact) and are
/// reused by inserts; [`Shard::retain_live`] and growth drop them.
pub struct Shard<V> {
    slots: Vec<Option<Entry<V>>>,
    /// Occupied slots, live or expired.
    used: usize,
    /// The same seed as every other shard's: rebuilding needs it.
    hasher: foldhash::fast::RandomState,
}

const MIN_SLOTS: usize = 8;

impl<V> Shard<V> {
    fn new(hasher: foldhash::fast::RandomState) -> Self {
        Self {
            slots: Vec::new(),
            used: 0,
            hasher,
        }
    }

    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// The slot holding `key` (live or expired), or `None`.
    pub fn find(&self, hash: u64, key: &[u8]) -> Found {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = hash as usize & mask;
        loop {
            match &self.slots[i] {
                None => return None,
                Some(e) if *e.key == *key => return Some(i),
                Some(_) => i = (i + 1) & mask,
            }
        }
    }

    /// The value in a slot [`Shard::find`] returned, when live at `now`.
    pub fn live_at(&self, found: Found, now: Micros) -> Option<&V> {
        let e = self.slots[found?].as_ref()?;
        (e.expires_at > now).then_some(&e.value)
    }

    /// The live value of `key` at `now`.
    pub fn get(&self, hash: u64, key: &[u8], now: Micros) -> Option<&V> {
        self.live_at(self.find(hash, key), now)
    }

    /// Updates `key` in place: `f` gets the live value (or a fresh one from `init`, with
    /// `false`, when absent or expired) and returns the new expiry.
    pub fn update(
        &mut self,
        hash: u64,
        key: &[u8],
        now: Micros,
        init: impl FnOnce() -> V,
        f: impl FnOnce(&mut V, bool) -> Micros,
    ) {
        let found = self.find(hash, key);
        self.update_found(found, hash, key, now, init, f);
    }

    /// [`Shard::update`] for a key already looked up with [`Shard::find`] (and the table not
    /// changed since), so a decision probes the table once.
    pub fn update_found(
        &mut self,
        found: Found,
        hash: u64,
        key: &[u8],
        now: Micros,
        init: impl FnOnce() -> V,
        f: impl FnOnce(&mut V, bool) -> Micros,
    ) {
        if let Some(Some(e)) = found.map(|i| &mut self.slots[i]) {
            let live = e.expires_at > now;
            if !live {
                e.value = init();
            }
            e.expires_at = f(&mut e.value, live);
            return;
        }
        let mut value = init();
        let expires_at = f(&mut value, false);
        if (self.used + 1) * 2 > self.slots.len() {
            self.rebuild(now, 1);
        }
        let mask = self.mask();
        let mut i = hash as usize & mask;
        // The key is absent, so its probe chain ends at an empty slot; an expired entry on the
        // way is as good a home and shortens the chain.
        while let Some(e) = &self.slots[i] {
            if e.expires_at <= now {
                break;
            }
            i = (i + 1) & mask;
        }
        if self.slots[i].is_none() {
            self.used += 1;
        }
        self.slots[i] = Some(Entry {
            key: KeyBuf::from_slice(key),
            value,
            expires_at,
        });
    }

    /// Forgets `key`: its entry, if any, reads as absent from now on (expired, it stays in
    /// place to keep probe chains intact, as any expired entry does). Returns whether it was
    /// live at `now`.
    pub fn forget(&mut self, hash: u64, key: &[u8], now: Micros) -> bool {
        let Some(Some(e)) = self.find(hash, key).map(|i| &mut self.slots[i]) else {
            return false;
        };
        let live = e.expires_at > now;
        e.expires_at = 0;
        live
    }

    /// Moves the entries live at `now` into a table sized for them and `extra` more at most
    /// 3/8 full (growing, or shrinking once most keys are gone), dropping the expired ones.
    fn rebuild(&mut self, now: Micros, extra: usize) {
        let live = self.live(now);
        let mut want = ((live + extra) * 2).next_power_of_two().max(MIN_SLOTS);
        if (live + extra) * 8 > want * 3 {
            // Over 3/8 full: leave room, or a table whose live keys hover near half full would
            // be rebuilt on every other insert.
            want *= 2;
        }
        let old = std::mem::replace(&mut self.slots, Vec::with_capacity(want));
        self.slots.resize_with(want, || None);
        self.used = 0;
        let mask = want - 1;
        for e in old.into_iter().flatten().filter(|e| e.expires_at > now) {
            let mut i = self.hasher.hash_one(&e.key[..]) as usize & mask;
            while self.slots[i].is_some() {
                i = (i + 1) & mask;
            }
            self.slots[i] = Some(e);
            self.used += 1;
        }
    }

    /// Drops the entries expired at `now` when that is worth a rebuild — they fill a quarter of
    /// the table (long probe chains), or the live keys would fit in a quarter of it — and
    /// otherwise leaves them for inserts to reuse, so a sweep does not copy every busy table
    /// every time. Returns the number of live entries.
    fn retain_live(&mut self, now: Micros) -> usize {
        let live = self.live(now);
        if live == 0 {
            self.slots = Vec::new();
            self.used = 0;
        } else if (self.used - live) * 4 > self.slots.len() || live * 8 < self.slots.len() {
            self.rebuild(now, 0);
        }
        live
    }

    fn len(&self) -> usize {
        self.used
    }

    /// The entries live at `now`.
    fn live(&self, now: Micros) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|e| e.expires_at > now)
            .count()
    }

    fn iter_live_mut(&mut self, now: Micros) -> impl Iterator<Item = (&[u8], &mut V)> {
        self.slots
            .iter_mut()
            .flatten()
            .filter(move |e| e.expires_at > now)
            .map(|e| (&e.key[..], &mut e.value))
    }
}

/// Cache-line aligned so neighbouring shard locks do not false-share.
#[repr(align(64))]
struct Padded<V>(Mutex<Shard<V>>);

/// The map: [`SHARDS`] [`Shard`]s, each behind its own mutex, picked by the key's hash.
pub struct Sharded<V> {
    shards: Box<[Padded<V>]>,
    hasher: foldhash::fast::RandomState,
}

impl<V> Default for Sharded<V> {
    fn default() -> Self {
        let hasher = foldhash::fast::RandomState::default();
        Self {
            shards: (0..SHARDS)
                .map(|_| Padded(Mutex::new(Shard::new(hasher.clone()))))
                .collect(),
            hasher,
        }
    }
}

impl<V> Sharded<V> {
    /// The key's hash, computed once per request for both [`Sharded::lock`] and the shard's
    /// lookup.
    pub fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard holding `hash`. The table uses the hash's low bits; the shard its high ones.
    pub fn lock(&self, hash: u64) -> MutexGuard<'_, Shard<V>> {
        self.shards[(hash >> 58) as usize % SHARDS].0.lock()
    }

    /// Forgets `key` (see [`Shard::forget`]); whether it was live at `now`.
    pub fn forget(&self, key: &[u8], now: Micros) -> bool {
        let hash = self.hash(key);
        self.lock(hash).forget(hash, key, now)
    }

    /// Drops every entry expired at `now`; returns the number kept.
    pub fn sweep(&self, now: Micros) -> usize {
        let mut kept = 0;
        for s in self.shards.iter() {
            kept += s.0.lock().retain_live(now);
        }
        kept
    }

    /// Entries held in all shards, expired ones not yet swept included; locks each shard in turn.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().len()).sum()
    }

    /// Visits every live entry, one shard lock at a time (never all at once).
    pub fn for_each_live(&self, now: Micros, mut f: impl FnMut(&[u8], &mut V)) {
        for s in self.shards.iter() {
            let mut shard = s.0.lock();
            for (key, value) in shard.iter_live_mut(now) {
                f(key, value);
            }
        }
    }

    /// Whether no shard holds an entry, expired ones included.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algorithm::State;

    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone)]
    enum Op {
        /// Sets key `k` to `v`, expiring `ttl` after now.
        Put {
            k: u8,
            v: u64,
            ttl: u64,
        },
        Get {
            k: u8,
        },
        Advance(u64),
        Sweep,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (any::<u8>(), any::<u64>(), 1..50u64).prop_map(|(k, v, ttl)| Op::Put { k, v, ttl }),
            3 => any::<u8>().prop_map(|k| Op::Get { k }),
            2 => (0..20u64).prop_map(Op::Advance),
            1 => Just(Op::Sweep),
        ]
    }

    /// Keys 0..=255 as bytes of several lengths, inline and spilled, so collisions in the
    /// table's low bits and long probe chains both happen.
    fn key(k: u8) -> Vec<u8> {
        vec![k; 1 + (k as usize % 20)]
    }

    proptest! {
        /// One table answers as a plain map with expiry does, through growth, long probe
        /// chains, reuse of expired slots, sweeps and shrinking.
        #[test]
        fn the_table_agrees_with_a_map(ops in proptest::collection::vec(op(), 1..800)) {
            let hasher = foldhash::fast::RandomState::default();
            let mut shard: Shard<u64> = Shard::new(hasher.clone());
            let mut model: HashMap<u8, (u64, Micros)> = HashMap::new();
            let mut now: Micros = 1;
            for op in ops {
                match op {
                    Op::Put { k, v, ttl } => {
                        let kb = key(k);
                        let hash = hasher.hash_one(&kb[..]);
                        let live = model.get(&k).filter(|e| e.1 > now).map(|e| e.0);
                        shard.update(hash, &kb, now, || 0, |old, was_live| {
                            assert_eq!(was_live, live.is_some());
                            assert_eq!(*old, live.unwrap_or(0));
                            *old = v;
                            now + ttl
                        });
                        model.insert(k, (v, now + ttl));
                    }
                    Op::Get { k } => {
                        let kb = key(k);
                        let hash = hasher.hash_one(&kb[..]);
                        let want = model.get(&k).filter(|e| e.1 > now).map(|e| e.0);
                        prop_assert_eq!(shard.get(hash, &kb, now).copied(), want);
                    }
                    Op::Advance(d) => now += d,
                    Op::Sweep => {
                        model.retain(|_, e| e.1 > now);
                        prop_assert_eq!(shard.retain_live(now), model.len());
                        prop_assert!(shard.len() >= model.len());
                        // Expired entries kept fill under a quarter; live keys over an eighth.
                        prop_assert!((shard.len() - model.len()) * 4 <= shard.slots.len());
                        prop_assert!(model.len() * 8 >= shard.slots.len() || model.is_empty());
                    }
                }
            }
            let mut seen = 0;
            for (k, v) in shard.iter_live_mut(now) {
                seen += 1;
                let want = model.get(&k[0]).filter(|e| e.1 > now).map(|e| e.0);
                prop_assert_eq!(Some(*v), want);
            }
            prop_assert_eq!(seen, model.values().filter(|e| e.1 > now).count());
        }
    }

    #[test]
    fn a_forgotten_key_reads_as_absent_and_its_neighbours_stay() {
        let hasher = foldhash::fast::RandomState::default();
        let mut shard: Shard<u64> = Shard::new(hasher.clone());
        let keys: Vec<Vec<u8>> = (0..200u8).map(key).collect();
        for (v, k) in keys.iter().enumerate() {
            shard.update(
                hasher.hash_one(&k[..]),
                k,
                1,
                || 0,
                |x, _| {
                    *x = v as u64;
                    100
                },
            );
        }
        let h = |k: &[u8]| hasher.hash_one(k);
        assert!(shard.forget(h(&keys[7]), &keys[7], 1));
        assert!(!shard.forget(h(&keys[7]), &keys[7], 1), "already forgotten");
        assert!(!shard.forget(h(b"never"), b"never", 1));
        assert_eq!(shard.get(h(&keys[7]), &keys[7], 1), None);
        // Every other key is still found, probe chains through the forgotten slot included.
        for (v, k) in keys.iter().enumerate().filter(|(i, _)| *i != 7) {
            assert_eq!(shard.get(h(k), k, 1), Some(&(v as u64)));
        }
        // Written again, it starts fresh.
        shard.update(
            h(&keys[7]),
            &keys[7],
            1,
            || 0,
            |x, live| {
                assert!(!live);
                assert_eq!(*x, 0);
                100
            },
        );
    }

    #[test]
    fn a_swept_table_gives_its_memory_back() {
        let map: Sharded<u64> = Sharded::default();
        for i in 0..10_000u32 {
            let k = i.to_le_bytes();
            let hash = map.hash(&k);
            map.lock(hash).update(hash, &k, 1, || 0, |_, _| 10);
        }
        let slots = |m: &Sharded<u64>| {
            m.shards
                .iter()
                .map(|s| s.0.lock().slots.len())
                .sum::<usize>()
        };
        assert!(slots(&map) >= 20_000, "at most half full");
        assert_eq!(map.sweep(10), 0);
        assert_eq!(slots(&map), 0);
    }

    #[test]
    fn an_entry_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Entry<State>>(), 64);
        assert_eq!(std::mem::size_of::<Option<Entry<State>>>(), 64);
    }
}
