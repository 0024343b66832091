//! The in-process store of local limits: per-key algorithm state, sharded, self-evicting.
//!
//! Each limit owns one [`LocalStore`] (a [`sharded::Sharded`] map, no global lock). An entry is
//! dropped once its state is back to "full" (`full_at`): lazily when touched, and by
//! [`LocalStore::sweep`] on a timer, so memory follows the keys that are active now, not every
//! key ever seen.
//!
//! [`decide`] evaluates all of a request's local limits under their shard locks, taken in the
//! route's limit order (every request of a route takes them in the same order, so two requests
//! cannot deadlock), checks every limit and commits only if all admitted. That is what makes
//! "a rejected request consumes from none" exact, which governor cannot do (it consumes on check).

pub mod deny;
pub mod sharded;

use smallvec::SmallVec;

use super::algorithm::{Algorithm, Micros, Rejection, Snapshot, State};
use sharded::{Shard, Sharded};

/// The state of one local limit's keys. An entry expires at its `full_at`: from then on it is
/// indistinguishable from a fresh key, so dropping it loses nothing.
#[derive(Default)]
pub struct LocalStore {
    map: Sharded<State>,
}

impl std::fmt::Debug for LocalStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalStore")
            .field("len", &self.len())
            .finish()
    }
}

impl LocalStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// The key's state as of `now`, without consuming anything (for the admin API).
    pub fn peek(&self, algorithm: &Algorithm, key: &[u8], now: Micros) -> Snapshot {
        let hash = self.map.hash(key);
        let shard = self.map.lock(hash);
        match shard.get(hash, key, now) {
            Some(state) => algorithm.peek(state, now),
            None => algorithm.peek(&algorithm.new_state(), now),
        }
    }

    /// Drops every key whose state is back to full; returns the number of keys kept.
    pub fn sweep(&self, now: Micros) -> usize {
        self.map.sweep(now)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Applies an admitted decision in place (no clone of the state, which for sliding_log is a
/// whole log).
fn commit(shard: &mut Shard<State>, hash: u64, c: &LocalCheck<'_>, now: Micros) {
    shard.update(
        hash,
        c.key,
        now,
        || c.algorithm.new_state(),
        |state, _| {
            c.algorithm.commit(state, now, c.cost);
            c.algorithm.full_at(state)
        },
    );
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
    decide_inner(checks, now, true)
}

/// [`decide`] without charging anything: what the checks would answer now.
pub fn check(checks: &[LocalCheck<'_>], now: Micros) -> (bool, SmallVec<[LocalVerdict; 4]>) {
    decide_inner(checks, now, false)
}

fn decide_inner(
    checks: &[LocalCheck<'_>],
    now: Micros,
    charge: bool,
) -> (bool, SmallVec<[LocalVerdict; 4]>) {
    let hashes: SmallVec<[u64; 4]> = checks.iter().map(|c| c.store.map.hash(c.key)).collect();
    let mut guards: SmallVec<[_; 4]> = SmallVec::new();
    let mut verdicts: SmallVec<[LocalVerdict; 4]> = SmallVec::new();
    let mut all = true;
    for (c, &hash) in checks.iter().zip(&hashes) {
        let guard = c.store.map.lock(hash);
        let fresh;
        let state = match guard.get(hash, c.key, now) {
            Some(state) => state,
            None => {
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
    if all && charge {
        for (((c, &hash), guard), v) in checks
            .iter()
            .zip(&hashes)
            .zip(guards.iter_mut())
            .zip(&verdicts)
        {
            if v.is_ok() {
                commit(guard, hash, c, now);
            }
        }
    }
    (all, verdicts)
}
