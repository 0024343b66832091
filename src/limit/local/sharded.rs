//! A concurrent map from key bytes to a value that expires: the storage under the local limit
//! store, the in-process tier in front of Redis and the eventual counts.
//!
//! [`SHARDS`] mutex-guarded hash tables, chosen by the key's hash, so concurrent requests for
//! different keys rarely meet and no lock is global. The hash is computed once per request and
//! used for both the shard and the table. Expired entries read as absent and are dropped by
//! [`Sharded::sweep`], so memory follows live keys only.
//!
//! **Bounded.** Each shard holds at most its share of the store's key budget
//! ([`Sharded::set_budget`], split from `server.max_keys` by `limit::budget`). A new key that
//! finds its shard full makes room by evicting the entry *closest to full* among a few sampled
//! ones and itself (see [`Shard::update_found`]): an entry whose state would soon be forgotten
//! anyway, never one deep in its budget while a closer one is at hand. A flood of fresh keys,
//! each nearly full, so displaces its own kind first, and an honest client's state stays. The
//! cost is paid only by an insert into a full shard: [`SAMPLES`] short scans, no walk of the
//! table.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;

use crate::limit::algorithm::Micros;

/// Power of two; enough that two cores (or twenty) rarely contend on one shard.
pub const SHARDS: usize = 64;

/// Entries looked at when a full shard must make room for a new key (Redis samples 5 keys for
/// its approximated LRU by default, for the same reason: a handful of candidates finds a good
/// victim nearly as often as a full scan, at a fixed cost).
pub const SAMPLES: usize = 5;

/// Slots scanned from each sample's random starting slot for an entry (a table at its cap is
/// between 1/4 and 1/2 full, so nearly always a few slots suffice).
const SCAN: usize = 8;

/// Keys of up to 16 bytes (an IPv4 address, a short id) live inside the entry, so their lookup
/// touches the table and nothing behind a pointer.
pub type KeyBuf = SmallVec<[u8; 16]>;

/// One cache line per entry: key (24 bytes with smallvec's `union`), state (32) and expiry fill
/// 64 bytes for every algorithm (the log is boxed), and the alignment keeps an entry from
/// straddling two lines. `Option` costs nothing: it lives in the state's enum tag.
///
/// `expires_at == 0` marks a *tombstone*: an entry forgotten (the admin API's reset) or expired
/// at a sweep, kept in place (with its key) so probe chains through it stay intact, and counted
/// in no budget. Evictions leave none: they shift the entries after them back instead.
#[repr(align(64))]
struct Entry<V> {
    key: KeyBuf,
    value: V,
    expires_at: Micros,
}

/// Where a key sits in a shard's table, as found by [`Shard::find`]: its slot when present
/// (live, expired or a tombstone), nothing when absent. Valid until the table is changed.
pub type Found = Option<usize>;

/// A key whose state a full shard gave up to make room, with that state: the local store and
/// the in-process tier drop it; the eventual store pushes its units not yet synced.
#[derive(Debug)]
pub struct Evicted<V> {
    /// The key's bytes (moved out of the entry: no copy, no allocation for a short key).
    pub key: KeyBuf,
    /// Its state when evicted.
    pub value: V,
}

/// How closely an entry stands to "full" (nothing consumed): the higher, the sooner it goes
/// when a shard must make room. Each store ranks its own values (the local store by the units
/// its limit has left, the eventual store likewise but behind every key with units not yet
/// synced); equal ranks go by expiry, the sooner first.
pub type Rank = u64;

/// The expiry of an entry that never expires by itself: a key holding concurrency slots,
/// whose count goes down only when its requests end. Such an entry is never evicted
/// (forgetting it would let the key hold twice its slots), and a new one is always stored,
/// over the cap if every sampled entry is pinned too: what they hold is bounded by the
/// requests in flight.
pub const PINNED: Micros = Micros::MAX;

/// What [`Shard::make_room`] did.
enum Room<V> {
    /// A sampled entry had expired: dropped, no state lost.
    Expired,
    /// A live entry was evicted.
    Evicted(Evicted<V>),
    /// Every sampled entry is [`PINNED`], and so is the new key: it is stored over the cap.
    Over,
    /// The new key was itself the closest to full: it is not stored.
    Declined,
}

/// Whether `(rank, expiry)` `a` goes before `b`: closer to full, or as close and expiring sooner.
fn sooner(a: (Rank, Micros), b: (Rank, Micros)) -> bool {
    a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
}

/// A step of a 64-bit mixer (splitmix64's finaliser): the sample positions of an insert, drawn
/// from its key's hash (random per process, so a client cannot aim them).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// An open-addressing table with linear probing over the entries themselves.
///
/// Why not a SwissTable (hashbrown): its control bytes live apart from the entries, so a
/// decision on a cold key missed the cache twice, once in each array. Here the first slot
/// probed is, most of the time, the entry itself: one miss. The table is kept at most half
/// full, so a probe rarely reads a second line, and that line is the adjacent one, which the
/// hardware prefetches. Expired entries and tombstones stay in place (they keep probe chains
/// intact) and are reused by inserts; [`Shard::retain_live`] and growth drop them.
pub struct Shard<V> {
    slots: Vec<Option<Entry<V>>>,
    /// Occupied slots: live, expired or tombstones.
    used: usize,
    /// Entries that count against `cap`: live or expired, not tombstones.
    held: usize,
    /// The most entries this shard holds (its share of the store's budget).
    cap: usize,
    /// Entries evicted to make room since [`Sharded::take_evicted`] last asked.
    evicted: u64,
    /// The same seed as every other shard's: rebuilding needs it.
    hasher: foldhash::fast::RandomState,
}

const MIN_SLOTS: usize = 8;

impl<V> Shard<V> {
    fn new(hasher: foldhash::fast::RandomState) -> Self {
        Self {
            slots: Vec::new(),
            used: 0,
            held: 0,
            cap: usize::MAX,
            evicted: 0,
            hasher,
        }
    }

    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// The slot holding `key` (live, expired or a tombstone), or `None`.
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

    /// Forgets the entry in slot `i` (it becomes a tombstone), if it counted.
    fn tombstone(&mut self, i: usize) -> Option<&mut Entry<V>> {
        let e = self.slots[i].as_mut()?;
        if e.expires_at == 0 {
            return None;
        }
        e.expires_at = 0;
        self.held -= 1;
        Some(e)
    }
}

impl<V> Shard<V> {
    /// Updates `key` in place: `f` gets the live value (or a fresh one from `init`, with
    /// `false`, when absent or expired) and returns the new expiry. See
    /// [`Shard::update_found`] for `rank` and what is returned.
    pub fn update(
        &mut self,
        hash: u64,
        key: &[u8],
        now: Micros,
        init: impl FnOnce() -> V,
        f: impl FnOnce(&mut V, bool) -> Micros,
        rank: impl Fn(&V) -> Rank,
    ) -> Option<Evicted<V>> {
        let found = self.find(hash, key);
        self.update_found(found, hash, key, now, init, f, rank)
    }

    /// [`Shard::update`] for a key already looked up with [`Shard::find`] (and the table not
    /// changed since), so a decision probes the table once.
    ///
    /// A new key in a shard at its cap makes room first: an expired entry among the
    /// [`SAMPLES`] sampled goes at no cost; otherwise the sampled entry closest to full by
    /// `rank` is evicted and returned, or, when the new key is itself closer to full than every
    /// sampled one, it is not stored and is returned instead (its state reads as fresh next
    /// time, which it nearly is). Either way the shard never holds more than its cap.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn update_found(
        &mut self,
        found: Found,
        hash: u64,
        key: &[u8],
        now: Micros,
        init: impl FnOnce() -> V,
        f: impl FnOnce(&mut V, bool) -> Micros,
        rank: impl Fn(&V) -> Rank,
    ) -> Option<Evicted<V>> {
        if let Some(Some(e)) = found.map(|i| &mut self.slots[i])
            && e.expires_at != 0
        {
            let live = e.expires_at > now;
            if !live {
                e.value = init();
            }
            // Never 0, which marks a tombstone.
            e.expires_at = f(&mut e.value, live).max(1);
            return None;
        }
        let mut value = init();
        let expires_at = f(&mut value, false);
        if expires_at <= now {
            // It would read as absent the moment it is written.
            return None;
        }
        self.insert(hash, key, now, value, expires_at, rank)
    }

    /// Stores a key that is absent (or a tombstone), within the cap (see
    /// [`Shard::update_found`]).
    #[inline(never)]
    fn insert(
        &mut self,
        hash: u64,
        key: &[u8],
        now: Micros,
        value: V,
        expires_at: Micros,
        rank: impl Fn(&V) -> Rank,
    ) -> Option<Evicted<V>> {
        if (self.used + 1) * 2 > self.slots.len() {
            self.rebuild(now, 1);
        }
        let mut i = self.home_for(hash, now);
        let mut evicted = None;
        // Taking over an expired entry's place keeps the count; anything else adds one.
        if !self.counted(i) {
            if self.held >= self.cap {
                match self.make_room(hash, now, &value, expires_at, &rank) {
                    Room::Expired | Room::Over => {}
                    Room::Evicted(victim) => evicted = Some(victim),
                    Room::Declined => {
                        self.evicted += 1;
                        return Some(Evicted {
                            key: KeyBuf::from_slice(key),
                            value,
                        });
                    }
                }
                // The removal shifted entries back: the key's place may be earlier now.
                i = self.home_for(hash, now);
            }
            if !self.counted(i) {
                self.held += 1;
                if self.slots[i].is_none() {
                    self.used += 1;
                }
            }
        }
        self.slots[i] = Some(Entry {
            key: KeyBuf::from_slice(key),
            value,
            expires_at,
        });
        evicted
    }

    /// Where an absent key goes: its probe chain ends at an empty slot, and an expired entry or
    /// a tombstone on the way is as good a home and shortens the chain.
    fn home_for(&self, hash: u64, now: Micros) -> usize {
        let mask = self.mask();
        let mut i = hash as usize & mask;
        while let Some(e) = &self.slots[i] {
            if e.expires_at <= now {
                break;
            }
            i = (i + 1) & mask;
        }
        i
    }

    /// Whether slot `i` holds an entry counted in `held` (live or expired, not a tombstone).
    fn counted(&self, i: usize) -> bool {
        matches!(&self.slots[i], Some(e) if e.expires_at != 0)
    }

    /// Takes the entry in slot `i` out of the table, shifting the entries after it in its
    /// cluster back so every probe chain stays unbroken (linear probing's deletion without a
    /// tombstone: a table that evicts on every insert at its cap does not fill with them).
    fn remove(&mut self, mut i: usize) -> Option<Entry<V>> {
        let removed = self.slots[i].take()?;
        self.used -= 1;
        if removed.expires_at != 0 {
            self.held -= 1;
        }
        let mask = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let Some(e) = &self.slots[j] else {
                break;
            };
            let home = self.hasher.hash_one(&e.key[..]) as usize & mask;
            // The entry at `j` may fill the hole at `i` if its home is not in (i, j]: it was
            // placed past the hole, so the hole is on its chain.
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(i) & mask {
                self.slots[i] = self.slots[j].take();
                i = j;
            }
        }
        Some(removed)
    }

    /// Frees one place of the cap for a new key whose value is `value` (see
    /// [`Shard::update_found`]): removes an expired sampled entry, or the sampled one closest
    /// to full unless the new key is closer still (`Declined`).
    #[cold]
    fn make_room(
        &mut self,
        hash: u64,
        now: Micros,
        value: &V,
        expires_at: Micros,
        rank: &impl Fn(&V) -> Rank,
    ) -> Room<V> {
        let mask = self.mask();
        let mut best: Option<(Rank, Micros, usize)> = None;
        let mut x = hash;
        for _ in 0..SAMPLES {
            x = mix(x);
            let mut j = x as usize & mask;
            for _ in 0..SCAN.min(self.slots.len()) {
                if let Some(e) = &self.slots[j]
                    && e.expires_at != 0
                {
                    if e.expires_at <= now {
                        self.remove(j);
                        return Room::Expired;
                    }
                    if e.expires_at == PINNED {
                        j = (j + 1) & mask;
                        continue;
                    }
                    let r = (rank(&e.value), e.expires_at);
                    if best.is_none_or(|(br, be, _)| sooner(r, (br, be))) {
                        best = Some((r.0, r.1, j));
                    }
                    break;
                }
                j = (j + 1) & mask;
            }
        }
        match best {
            // The new key goes only if it is strictly the closest to full: on a tie it is
            // stored, so a newcomer can always settle in among keys like itself.
            Some((r, e, j))
                if expires_at == PINNED || !sooner((rank(value), expires_at), (r, e)) =>
            {
                match self.remove(j) {
                    Some(victim) => {
                        self.evicted += 1;
                        Room::Evicted(Evicted {
                            key: victim.key,
                            value: victim.value,
                        })
                    }
                    None => Room::Expired,
                }
            }
            None if expires_at == PINNED => Room::Over,
            _ => Room::Declined,
        }
    }

    /// Sets the shard's cap to `cap` (at least 1); when it holds more, evicts the entries
    /// closest to full by `rank` (after the expired ones, which go first at no cost) and
    /// hands each to `on_evict`. A scan and a partial sort of the shard: for the sweeper, not
    /// the request path.
    fn set_cap(
        &mut self,
        cap: usize,
        now: Micros,
        rank: &impl Fn(&V) -> Rank,
        on_evict: &mut impl FnMut(Evicted<V>),
    ) {
        self.cap = cap.max(1);
        if self.held <= self.cap {
            return;
        }
        self.rebuild(now, 0);
        if self.held <= self.cap {
            return;
        }
        let mut order: Vec<(std::cmp::Reverse<Rank>, Micros, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let e = e.as_ref()?;
                (e.expires_at > now && e.expires_at != PINNED)
                    .then(|| (std::cmp::Reverse(rank(&e.value)), e.expires_at, i))
            })
            .collect();
        // Pinned entries stay, even past the cap.
        let excess = (self.held - self.cap).min(order.len());
        if excess == 0 {
            return;
        }
        order.select_nth_unstable(excess - 1);
        // Taken out without mending the probe chains: the rebuild below places every entry
        // left afresh.
        for &(_, _, i) in &order[..excess] {
            if let Some(victim) = self.slots[i].take() {
                self.used -= 1;
                self.held -= 1;
                self.evicted += 1;
                on_evict(Evicted {
                    key: victim.key,
                    value: victim.value,
                });
            }
        }
        self.rebuild(now, 0);
    }
}

impl<V> Shard<V> {
    /// Forgets `key`: its entry, if any, reads as absent from now on (a tombstone, it stays in
    /// place to keep probe chains intact). Returns whether it was live at `now`.
    pub fn forget(&mut self, hash: u64, key: &[u8], now: Micros) -> bool {
        let Some(i) = self.find(hash, key) else {
            return false;
        };
        let live = self.slots[i].as_ref().is_some_and(|e| e.expires_at > now);
        self.tombstone(i);
        live
    }
}

impl<V> Shard<V> {
    /// Moves the entries live at `now` into a table sized for them and `extra` more at most
    /// 3/8 full (growing, or shrinking once most keys are gone), dropping the expired ones and
    /// the tombstones.
    fn rebuild(&mut self, now: Micros, extra: usize) {
        let live = self.live(now);
        // A shard never holds more than its cap, and one more while an insert makes room (but
        // every live entry must fit: a lowered cap trims after a rebuild).
        let n = (live + extra).min(self.cap.saturating_add(1)).max(live);
        let mut want = (n * 2).next_power_of_two().max(MIN_SLOTS);
        if n * 8 > want * 3 && want / 2 <= self.cap {
            // Over 3/8 full: leave room, or a table whose live keys hover near half full would
            // be rebuilt on every other insert. Not when the table already holds its cap at
            // most half full: at the cap an insert removes an entry (without a tombstone) for
            // each it adds, so the table does not fill up, and the room would be memory held
            // for keys that cannot come.
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
        self.held = self.used;
    }

    /// Turns the entries expired at `now` into tombstones (so the cap counts live keys only),
    /// and drops them when that is worth a rebuild — they fill a quarter of the table (long
    /// probe chains), or the live keys would fit in a quarter of it — otherwise leaving them
    /// for inserts to reuse, so a sweep does not copy every busy table every time. Returns the
    /// number of live entries.
    fn retain_live(&mut self, now: Micros) -> usize {
        for e in self.slots.iter_mut().flatten() {
            if e.expires_at != 0 && e.expires_at <= now {
                e.expires_at = 0;
                self.held -= 1;
            }
        }
        let live = self.held;
        if live == 0 {
            self.slots = Vec::new();
            self.used = 0;
        } else if (self.used - live) * 4 > self.slots.len() || live * 8 < self.slots.len() {
            self.rebuild(now, 0);
        }
        live
    }

    /// Entries held: live, or expired and not yet swept (tombstones are not).
    fn len(&self) -> usize {
        self.held
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
    /// The budget last set ([`Sharded::set_budget`]); `usize::MAX` until then (no cap).
    budget: AtomicUsize,
}

impl<V> Default for Sharded<V> {
    fn default() -> Self {
        let hasher = foldhash::fast::RandomState::default();
        Self {
            shards: (0..SHARDS)
                .map(|_| Padded(Mutex::new(Shard::new(hasher.clone()))))
                .collect(),
            hasher,
            budget: AtomicUsize::new(usize::MAX),
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

    /// The budget last set with [`Sharded::set_budget`] (`usize::MAX`: never set, no cap).
    pub fn budget(&self) -> usize {
        self.budget.load(Ordering::Relaxed)
    }

    /// The most keys one shard holds under a budget of `keys` for the whole map: an even
    /// share, and at least one.
    pub fn shard_cap(keys: usize) -> usize {
        (keys / SHARDS).max(1)
    }

    /// Entries evicted to make room (on insert or by [`Sharded::set_budget`]) since the last
    /// call; counting starts again from zero.
    pub fn take_evicted(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| std::mem::take(&mut s.0.lock().evicted))
            .sum()
    }
}

impl<V> Sharded<V> {
    /// Caps the map at `keys` entries, [`Sharded::shard_cap`] per shard. A shard holding more
    /// evicts down to its cap at once, the entries closest to full by `rank` first (each
    /// handed to `on_evict`); one lock at a time, never all at once.
    pub fn set_budget(
        &self,
        keys: usize,
        now: Micros,
        rank: impl Fn(&V) -> Rank,
        mut on_evict: impl FnMut(Evicted<V>),
    ) {
        self.budget.store(keys, Ordering::Relaxed);
        let cap = Self::shard_cap(keys);
        for s in self.shards.iter() {
            s.0.lock().set_cap(cap, now, &rank, &mut on_evict);
        }
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
                        }, |_| 0);
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
                |_| 0,
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
            |_| 0,
        );
    }

    #[test]
    fn a_swept_table_gives_its_memory_back() {
        let map: Sharded<u64> = Sharded::default();
        for i in 0..10_000u32 {
            let k = i.to_le_bytes();
            let hash = map.hash(&k);
            map.lock(hash).update(hash, &k, 1, || 0, |_, _| 10, |_| 0);
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

    #[derive(Debug, Clone)]
    enum CapOp {
        /// Sets key `k` to `v` (also its rank: the higher, the closer to full), expiring `ttl`
        /// after now.
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
        /// Lowers or raises the cap.
        Cap(usize),
    }

    fn cap_op() -> impl Strategy<Value = CapOp> {
        prop_oneof![
            8 => (any::<u8>(), 0..100u64, 1..50u64).prop_map(|(k, v, ttl)| CapOp::Put { k, v, ttl }),
            3 => any::<u8>().prop_map(|k| CapOp::Get { k }),
            2 => (0..20u64).prop_map(CapOp::Advance),
            1 => Just(CapOp::Sweep),
            1 => (1..40usize).prop_map(CapOp::Cap),
        ]
    }

    proptest! {
        /// A capped table never holds more than its cap, and answers as a map with expiry that
        /// forgets exactly the keys the table says it evicted (a declined new key included);
        /// every eviction is counted once.
        #[test]
        fn a_capped_table_agrees_with_a_map_that_forgets_what_it_evicts(
            cap in 1..40usize,
            ops in proptest::collection::vec(cap_op(), 1..800),
        ) {
            let hasher = foldhash::fast::RandomState::default();
            let mut shard: Shard<u64> = Shard::new(hasher.clone());
            let mut model: HashMap<u8, (u64, Micros)> = HashMap::new();
            let mut now: Micros = 1;
            let mut cap = cap;
            let mut evictions = 0u64;
            let rank = |v: &u64| *v;
            shard.set_cap(cap, now, &rank, &mut |_| unreachable!("empty"));
            for op in ops {
                match op {
                    CapOp::Put { k, v, ttl } => {
                        let kb = key(k);
                        let hash = hasher.hash_one(&kb[..]);
                        let gone = shard.update(hash, &kb, now, || 0, |old, _| {
                            *old = v;
                            now + ttl
                        }, rank);
                        model.insert(k, (v, now + ttl));
                        if let Some(e) = gone {
                            evictions += 1;
                            let victim = e.key[0];
                            let held = model.remove(&victim);
                            prop_assert_eq!(held.map(|h| h.0), Some(e.value));
                            prop_assert!(held.unwrap().1 > now, "an evicted entry was live");
                        }
                    }
                    CapOp::Get { k } => {
                        let kb = key(k);
                        let hash = hasher.hash_one(&kb[..]);
                        let want = model.get(&k).filter(|e| e.1 > now).map(|e| e.0);
                        prop_assert_eq!(shard.get(hash, &kb, now).copied(), want);
                    }
                    CapOp::Advance(d) => now += d,
                    CapOp::Sweep => {
                        model.retain(|_, e| e.1 > now);
                        prop_assert_eq!(shard.retain_live(now), model.len());
                    }
                    CapOp::Cap(c) => {
                        cap = c;
                        let mut gone = Vec::new();
                        shard.set_cap(c, now, &rank, &mut |e| gone.push(e));
                        model.retain(|_, e| e.1 > now);
                        for e in gone {
                            evictions += 1;
                            prop_assert!(model.remove(&e.key[0]).is_some());
                        }
                        prop_assert!(model.len() <= c);
                    }
                }
                prop_assert!(shard.len() <= cap, "{} held over a cap of {cap}", shard.len());
                prop_assert!(model.values().filter(|e| e.1 > now).count() <= cap);
            }
            prop_assert_eq!(std::mem::take(&mut shard.evicted), evictions);
        }
    }

    /// When a full table must make room, the newcomer and every sampled entry are weighed and
    /// the one closest to full goes: with every other entry far from full (rank 0), a
    /// newcomer closer to full is the one turned away, and one as far from full is stored at
    /// the expense of a sampled entry.
    #[test]
    fn a_full_table_evicts_the_candidate_closest_to_full() {
        let hasher = foldhash::fast::RandomState::default();
        let mut shard: Shard<u64> = Shard::new(hasher.clone());
        let rank = |v: &u64| *v;
        shard.set_cap(100, 1, &rank, &mut |_| {});
        let put = |shard: &mut Shard<u64>, k: &[u8], v: u64| {
            let hash = hasher.hash_one(k);
            shard.update(
                hash,
                k,
                1,
                || 0,
                |x, _| {
                    *x = v;
                    1_000
                },
                rank,
            )
        };
        for i in 0..100u32 {
            assert!(put(&mut shard, &i.to_le_bytes(), 0).is_none());
        }
        for i in 100..1_100u32 {
            let gone = put(&mut shard, &i.to_le_bytes(), 7).expect("full: one goes");
            assert_eq!(
                &gone.key[..],
                i.to_le_bytes(),
                "the newcomer is the closest to full"
            );
            assert_eq!(gone.value, 7);
        }
        for i in 0..100u32 {
            assert_eq!(
                shard.get(hasher.hash_one(i.to_le_bytes()), &i.to_le_bytes(), 1),
                Some(&0)
            );
        }
        // As far from full as the others: stored, and a sampled entry goes.
        let gone = put(&mut shard, b"new", 0).expect("full: one goes");
        assert_ne!(&gone.key[..], b"new");
        assert_eq!(shard.len(), 100);
        assert_eq!(shard.evicted, 1_001);
    }

    /// Keys holding concurrency slots ([`PINNED`]) are never evicted, not by a newcomer and
    /// not by a lowered cap, and a pinned newcomer is stored even over the cap: forgetting a
    /// key's slots would let it hold twice its `max_in_flight`.
    #[test]
    fn pinned_entries_are_never_evicted_and_always_stored() {
        let hasher = foldhash::fast::RandomState::default();
        let mut shard: Shard<u64> = Shard::new(hasher.clone());
        let rank = |v: &u64| *v;
        shard.set_cap(10, 1, &rank, &mut |_| {});
        let put = |shard: &mut Shard<u64>, k: &[u8], v: u64, expires_at: Micros| {
            let hash = hasher.hash_one(k);
            shard.update(
                hash,
                k,
                1,
                || 0,
                |x, _| {
                    *x = v;
                    expires_at
                },
                rank,
            )
        };
        // Pinned entries closest to full (rank 9) fill the table.
        for i in 0..10u32 {
            assert!(put(&mut shard, &i.to_le_bytes(), 9, PINNED).is_none());
        }
        // A flood of ordinary newcomers as far from full as can be: each is turned away.
        for i in 10..1_000u32 {
            let gone = put(&mut shard, &i.to_le_bytes(), 0, 1_000).expect("full");
            assert_eq!(&gone.key[..], i.to_le_bytes());
        }
        // A pinned newcomer is stored over the cap.
        assert!(put(&mut shard, b"slots", 9, PINNED).is_none());
        assert_eq!(shard.len(), 11);
        // A lowered cap evicts none of them either.
        let mut gone = 0;
        shard.set_cap(2, 1, &rank, &mut |_| gone += 1);
        assert_eq!(gone, 0);
        for i in 0..10u32 {
            let k = i.to_le_bytes();
            assert_eq!(shard.get(hasher.hash_one(k), &k, 1), Some(&9));
        }
    }

    #[test]
    fn an_entry_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Entry<State>>(), 64);
        assert_eq!(std::mem::size_of::<Option<Entry<State>>>(), 64);
    }
}
