//! Who is being limited: per limit, the keys this instance rejected most in the last minute,
//! for `GET /admin/limits/{route}/{limit}/top`.
//!
//! A flood of distinct keys (rotated header values, IPv6 addresses) must not grow the process,
//! so the counts live in a fixed-size summary, not a map of every key: the *space-saving*
//! algorithm (Metwally, Agrawal, El Abbadi, 2005) with [`CAPACITY`] entries per bucket. A key
//! already held counts up; a new one takes a free entry, or else replaces the entry with the
//! smallest count and inherits that count plus one (remembered as its `error`). Memory is
//! [`BUCKETS`] × [`CAPACITY`] entries per limit whatever the number of keys, each entry holding
//! at most [`MAX_KEY`] bytes of key text, allocated at the limit's first rejection.
//!
//! **Error bound**, per bucket of N rejections: a listed count is never below the key's true
//! count and over it by at most the entry's `error` ≤ N / [`CAPACITY`]; every key rejected more
//! than N / [`CAPACITY`] times is listed. So with up to 64 keys rejected in a bucket the counts
//! are exact, and under a skewed flood the heavy keys are found however many light ones pass.
//! Over the window the buckets' counts and errors add up; a key missing from a full bucket was
//! rejected there at most that bucket's smallest count times, which is not counted.
//!
//! **The window** is [`BUCKETS`] buckets of [`BUCKET`] µs (20 s) taken in turn by the clock: a
//! record goes to the current one (cleared when its turn comes round again), a query adds the
//! current one and the three before it. The answer covers at least the last minute and at most
//! 80 s.
//!
//! **Cost on the reject path** ([`TopKeys::record`]): one hash of the key, one uncontended
//! mutex, a scan of at most [`CAPACITY`] hashes (two when a new key must replace the smallest).
//! Nothing happens on an admitted request. Only the limit a 429 names records (the one the log
//! line and the `RateLimit` fields name), not the other limits that rejected too.

use std::hash::BuildHasher;

use parking_lot::Mutex;

use super::algorithm::Micros;

/// Entries per bucket: the keys a bucket can tell apart (see the error bound in the module doc).
pub const CAPACITY: usize = 64;

/// Buckets in turn; a query adds all of them.
pub const BUCKETS: usize = 4;

/// One bucket's span (20 s): [`BUCKETS`] − 1 of them make the minute a query must cover.
pub const BUCKET: Micros = 20_000_000;

/// Key text kept per entry, in bytes: a longer key is counted on its whole (by hash) and shown
/// cut to this length (`truncated` in the answer), so one entry's memory is bounded too.
pub const MAX_KEY: usize = 128;

/// One key's place in a bucket.
#[derive(Debug, Clone, Default)]
struct Entry {
    /// The key's text, at most [`MAX_KEY`] bytes of it; the buffer is reused when the entry
    /// changes hands.
    key: Vec<u8>,
    /// The key was longer than [`MAX_KEY`].
    truncated: bool,
    /// Rejections counted, including what it inherited (`error`).
    count: u64,
    /// What it inherited from the entry it replaced: the most `count` can be over the truth.
    error: u64,
}

/// One bucket's space-saving summary.
#[derive(Debug, Default)]
struct Bucket {
    /// The bucket's number (time / [`BUCKET`]) while it holds counts of that span.
    epoch: u64,
    /// Rejections recorded in the bucket (the N of the error bound).
    total: u64,
    /// The entries' key hashes, apart from them so a lookup scans one compact array.
    hashes: Vec<u64>,
    /// Same order as `hashes`.
    entries: Vec<Entry>,
}

impl Bucket {
    fn record(&mut self, hash: u64, key: &[u8]) {
        self.total += 1;
        if let Some(i) = self.hashes.iter().position(|&h| h == hash) {
            self.entries[i].count += 1;
            return;
        }
        if self.hashes.len() < CAPACITY {
            if self.hashes.capacity() == 0 {
                self.hashes.reserve_exact(CAPACITY);
                self.entries.reserve_exact(CAPACITY);
            }
            let mut e = Entry::default();
            set_key(&mut e, key);
            e.count = 1;
            self.hashes.push(hash);
            self.entries.push(e);
            return;
        }
        // Full: the smallest count hands its entry over (the first of equals: any would do).
        let mut min = 0;
        for (i, e) in self.entries.iter().enumerate().skip(1) {
            if e.count < self.entries[min].count {
                min = i;
            }
        }
        let e = &mut self.entries[min];
        e.error = e.count;
        e.count += 1;
        set_key(e, key);
        self.hashes[min] = hash;
    }

    /// Empties the bucket for `epoch`, keeping its buffers.
    fn restart(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.total = 0;
        self.hashes.clear();
        self.entries.clear();
    }
}

fn set_key(e: &mut Entry, key: &[u8]) {
    let kept = &key[..key.len().min(MAX_KEY)];
    e.key.clear();
    e.key.extend_from_slice(kept);
    e.truncated = key.len() > MAX_KEY;
}

/// One key's line in the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopKey {
    /// The key as the limit builds it (cut to [`MAX_KEY`] bytes when `truncated`).
    pub key: Vec<u8>,
    /// The key was longer than [`MAX_KEY`] bytes.
    pub truncated: bool,
    /// Rejections counted in the window: never below the truth (see the module doc).
    pub count: u64,
    /// The most `count` can be over the truth; 0 while few keys were rejected.
    pub error: u64,
}

/// The answer to "who is being limited": the top keys and what they are out of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Top {
    /// Most rejected first; equal counts in key order.
    pub keys: Vec<TopKey>,
    /// Rejections recorded in the window, all keys together.
    pub rejected: u64,
    /// The window's span, µs: from the oldest bucket's start to now.
    pub window: Micros,
}

/// The rejected keys of one limit over the last minute, in bounded memory (see the module).
pub struct TopKeys {
    buckets: Mutex<[Bucket; BUCKETS]>,
    hasher: foldhash::fast::RandomState,
}

impl Default for TopKeys {
    fn default() -> Self {
        Self {
            buckets: Mutex::new(Default::default()),
            hasher: foldhash::fast::RandomState::default(),
        }
    }
}

impl std::fmt::Debug for TopKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held: usize = self.buckets.lock().iter().map(|b| b.entries.len()).sum();
        f.debug_struct("TopKeys").field("held", &held).finish()
    }
}

impl TopKeys {
    /// Counts one rejection of `key` at `now` (local time, µs). On the reject path: cheap
    /// (see the module doc).
    pub fn record(&self, key: &[u8], now: Micros) {
        let hash = self.hasher.hash_one(key);
        let epoch = now / BUCKET;
        let mut buckets = self.buckets.lock();
        let b = &mut buckets[(epoch % BUCKETS as u64) as usize];
        if b.epoch != epoch {
            b.restart(epoch);
        }
        b.record(hash, key);
    }

    /// The `n` keys rejected most in the window ending at `now` (at most [`CAPACITY`]).
    pub fn top(&self, n: usize, now: Micros) -> Top {
        let epoch = now / BUCKET;
        let oldest = epoch.saturating_sub(BUCKETS as u64 - 1);
        let mut merged: Vec<(u64, TopKey)> = Vec::new();
        let mut rejected = 0;
        {
            let buckets = self.buckets.lock();
            for b in buckets
                .iter()
                .filter(|b| (oldest..=epoch).contains(&b.epoch))
            {
                rejected += b.total;
                for (&h, e) in b.hashes.iter().zip(&b.entries) {
                    match merged.iter_mut().find(|(mh, _)| *mh == h) {
                        Some((_, t)) => {
                            t.count += e.count;
                            t.error += e.error;
                        }
                        None => merged.push((
                            h,
                            TopKey {
                                key: e.key.clone(),
                                truncated: e.truncated,
                                count: e.count,
                                error: e.error,
                            },
                        )),
                    }
                }
            }
        }
        let mut keys: Vec<TopKey> = merged.into_iter().map(|(_, t)| t).collect();
        keys.sort_unstable_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
        keys.truncate(n.min(CAPACITY));
        Top {
            keys,
            rejected,
            window: now - oldest * BUCKET,
        }
    }

    /// Entries held in every bucket (at most [`BUCKETS`] × [`CAPACITY`]).
    pub fn held(&self) -> usize {
        self.buckets.lock().iter().map(|b| b.entries.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 20 s into a bucket, so steps of a few seconds stay in it.
    const T0: Micros = 1_000 * BUCKET;

    fn key(i: u64) -> Vec<u8> {
        format!("client-{i}").into_bytes()
    }

    #[test]
    fn few_keys_are_counted_exactly_in_order() {
        let top = TopKeys::default();
        for (k, times) in [(1, 5), (2, 9), (3, 1), (4, 5)] {
            for _ in 0..times {
                top.record(&key(k), T0);
            }
        }
        let t = top.top(10, T0 + 1);
        let got: Vec<(Vec<u8>, u64, u64)> = t
            .keys
            .iter()
            .map(|k| (k.key.clone(), k.count, k.error))
            .collect();
        assert_eq!(
            got,
            [
                (key(2), 9, 0),
                (key(1), 5, 0),
                (key(4), 5, 0),
                (key(3), 1, 0)
            ]
        );
        assert_eq!(t.rejected, 20);
        assert_eq!(top.top(2, T0).keys.len(), 2, "n is honoured");
        assert_eq!(top.top(1000, T0).keys.len(), 4, "n above what is held");
    }

    #[test]
    fn memory_stays_bounded_under_a_flood_of_distinct_keys() {
        let top = TopKeys::default();
        for i in 0..200_000 {
            top.record(&key(i), T0 + i % 1000);
        }
        assert_eq!(top.held(), CAPACITY);
        let t = top.top(usize::MAX, T0 + 1000);
        assert_eq!(t.keys.len(), CAPACITY, "n is capped at the capacity");
        assert_eq!(t.rejected, 200_000);
        // Every count is within the bound: over by at most N / CAPACITY.
        for k in &t.keys {
            assert!(k.error <= 200_000 / CAPACITY as u64, "{k:?}");
            assert!(k.count > k.error);
        }
        // A long key is kept cut, counted whole.
        let long = vec![b'x'; 10 * MAX_KEY];
        let top = TopKeys::default();
        top.record(&long, T0);
        top.record(&long, T0);
        let t = top.top(1, T0);
        assert_eq!(t.keys[0].key.len(), MAX_KEY);
        assert!(t.keys[0].truncated);
        assert_eq!(t.keys[0].count, 2);
    }

    /// A skewed stream (a few heavy clients among 50 000 light ones, interleaved): the heavy
    /// ones are found, in order, each count within the documented bound of the truth.
    #[test]
    fn the_heavy_keys_of_a_skewed_stream_are_found() {
        let top = TopKeys::default();
        let heavy = [
            (b"heavy-a".as_slice(), 3000u64),
            (b"heavy-b", 2000),
            (b"heavy-c", 1000),
        ];
        let mut n = 0u64;
        // A deterministic shuffle: one light key per step, the heavy ones as their share falls.
        let mut sent = [0u64; 3];
        for light in 0..50_000u64 {
            top.record(&key(light), T0);
            n += 1;
            for (h, (k, total)) in heavy.iter().enumerate() {
                if sent[h] * 50_000 < total * (light + 1) {
                    top.record(k, T0);
                    sent[h] += 1;
                    n += 1;
                }
            }
        }
        assert_eq!(sent, [3000, 2000, 1000]);
        let t = top.top(3, T0);
        assert_eq!(t.rejected, n);
        let bound = n / CAPACITY as u64;
        for (got, (k, total)) in t.keys.iter().zip(heavy) {
            assert_eq!(got.key, k);
            assert!(got.count >= total && got.count - total <= bound, "{got:?}");
            assert!(got.error <= bound);
        }
    }

    #[test]
    fn the_window_is_the_last_minute() {
        let top = TopKeys::default();
        top.record(b"old", T0);
        top.record(b"old", T0);
        // Three buckets later the first is still in the window (60 to 80 s back)...
        top.record(b"new", T0 + 3 * BUCKET);
        let t = top.top(10, T0 + 3 * BUCKET + 1);
        assert_eq!(t.rejected, 3);
        assert_eq!(t.keys[0].key, b"old");
        assert!(t.window >= 60_000_000 && t.window <= 80_000_000);
        // ...one more and it has left it, though nothing was recorded since.
        let t = top.top(10, T0 + 4 * BUCKET);
        assert_eq!(t.rejected, 1);
        assert_eq!(t.keys.len(), 1);
        assert_eq!(t.keys[0].key, b"new");
        // A bucket's turn coming round again starts it empty.
        top.record(b"newer", T0 + 4 * BUCKET);
        assert_eq!(top.held(), 2);
        assert!(top.top(10, T0 + 10 * BUCKET).keys.is_empty());
    }
}
