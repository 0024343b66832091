//! The in-process store of local limits: per-key algorithm state, sharded, self-evicting.
//!
//! Each limit owns one [`LocalStore`]. A key's entry lives in one of [`SHARDS`] mutex-guarded
//! hash tables chosen by the key's hash, so concurrent requests for different keys rarely meet
//! and no lock is global. An entry is dropped once its state is back to "full" (`full_at`):
//! lazily when touched, and by [`LocalStore::sweep`] on a timer, so memory follows the keys that
//! are active now, not every key ever seen.
//!
//! [`decide`] evaluates all of a request's local limits under their shard locks, taken in the
//! route's limit order (every request of a route takes them in the same order, so two requests
//! cannot deadlock), checks every limit and commits only if all admitted. That is what makes
//! "a rejected request consumes from none" exact, which governor cannot do (it consumes on check).

use std::hash::BuildHasher;

use hashbrown::HashTable;
use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;

use super::algorithm::{Algorithm, Micros, Rejection, Snapshot, State};

/// Power of two; enough that two cores (or twenty) rarely contend on one shard.
pub const SHARDS: usize = 64;

struct Entry {
    hash: u64,
    key: Box<[u8]>,
    state: State,
    full_at: Micros,
}

#[derive(Default)]
pub struct Shard {
    table: HashTable<Entry>,
}

impl Shard {
    fn find(&self, hash: u64, key: &[u8]) -> Option<&Entry> {
        self.table.find(hash, |e| e.hash == hash && *e.key == *key)
    }

    /// Applies an admitted decision in place (no clone of the state, which for sliding_log is
    /// a whole log).
    fn commit(&mut self, hash: u64, key: &[u8], algorithm: &Algorithm, now: Micros, cost: u64) {
        match self
            .table
            .find_mut(hash, |e| e.hash == hash && *e.key == *key)
        {
            Some(e) => {
                if e.full_at <= now {
                    e.state = algorithm.new_state();
                }
                algorithm.commit(&mut e.state, now, cost);
                e.full_at = algorithm.full_at(&e.state);
            }
            None => {
                let mut state = algorithm.new_state();
                algorithm.commit(&mut state, now, cost);
                let full_at = algorithm.full_at(&state);
                self.table.insert_unique(
                    hash,
                    Entry {
                        hash,
                        key: key.into(),
                        state,
                        full_at,
                    },
                    |e| e.hash,
                );
            }
        }
    }
}

/// Cache-line aligned so neighbouring shard locks do not false-share.
#[repr(align(64))]
#[derive(Default)]
struct Padded(Mutex<Shard>);

pub struct LocalStore {
    shards: Box<[Padded]>,
    hasher: foldhash::fast::RandomState,
}

impl std::fmt::Debug for LocalStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalStore")
            .field("len", &self.len())
            .finish()
    }
}

impl Default for LocalStore {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalStore {
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Padded::default()).collect(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        // The table uses the low bits; pick the shard from the high ones.
        &self.shards[(hash >> 58) as usize % SHARDS].0
    }

    /// The key's state as of `now`, without consuming anything (for the admin API).
    pub fn peek(&self, algorithm: &Algorithm, key: &[u8], now: Micros) -> Snapshot {
        let hash = self.hash(key);
        let shard = self.shard(hash).lock();
        match shard.find(hash, key) {
            Some(e) if e.full_at > now => algorithm.peek(&e.state, now),
            _ => algorithm.peek(&algorithm.new_state(), now),
        }
    }

    /// Drops every entry whose state is back to full; returns the number of keys kept.
    pub fn sweep(&self, now: Micros) -> usize {
        let mut kept = 0;
        for s in self.shards.iter() {
            let mut shard = s.0.lock();
            shard.table.retain(|e| e.full_at > now);
            kept += shard.table.len();
        }
        kept
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().table.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One local limit of a request, ready to decide.
pub struct LocalCheck<'a> {
    pub store: &'a LocalStore,
    pub algorithm: &'a Algorithm,
    pub key: &'a [u8],
    pub cost: u64,
    /// 0: admit now or reject. > 0: gcra may reserve a slot this far ahead.
    pub max_delay: Micros,
    /// A shadow limit's rejection does not stop the others from committing (and it commits
    /// nothing itself).
    pub shadow: bool,
}

/// Per-limit outcome: admitted (with the delay to wait, 0 when none) or rejected.
pub type LocalVerdict = Result<(Snapshot, Micros), Rejection>;

/// Decides every check at once: every non-shadow check admits and every admitted check
/// commits, or nothing is committed.
///
/// Returns whether the request is admitted and one verdict per check, in order. Every limit is
/// evaluated even after one rejects, so the caller can report the most restrictive one.
pub fn decide(checks: &[LocalCheck<'_>], now: Micros) -> (bool, SmallVec<[LocalVerdict; 4]>) {
    let hashes: SmallVec<[u64; 4]> = checks.iter().map(|c| c.store.hash(c.key)).collect();
    let mut guards: SmallVec<[MutexGuard<'_, Shard>; 4]> = SmallVec::new();
    let mut verdicts: SmallVec<[LocalVerdict; 4]> = SmallVec::new();
    let mut all = true;
    for (c, &hash) in checks.iter().zip(&hashes) {
        let guard = c.store.shard(hash).lock();
        let fresh;
        let state = match guard.find(hash, c.key) {
            Some(e) if e.full_at > now => &e.state,
            _ => {
                fresh = c.algorithm.new_state();
                &fresh
            }
        };
        let v = if c.max_delay > 0 {
            c.algorithm.reserve(state, now, c.cost, c.max_delay)
        } else {
            c.algorithm.check(state, now, c.cost).map(|s| (s, 0))
        };
        all &= v.is_ok() || c.shadow;
        verdicts.push(v);
        guards.push(guard);
    }
    if all {
        for (((c, &hash), guard), v) in checks
            .iter()
            .zip(&hashes)
            .zip(guards.iter_mut())
            .zip(&verdicts)
        {
            if v.is_ok() {
                guard.commit(hash, c.key, c.algorithm, now, c.cost);
            }
        }
    }
    (all, verdicts)
}
