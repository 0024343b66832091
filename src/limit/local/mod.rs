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
use sharded::{Found, Shard, Sharded};

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
fn commit(shard: &mut Shard<State>, found: Found, hash: u64, c: &LocalCheck<'_>, now: Micros) {
    shard.update_found(
        found,
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
    // Each check's shard guard, with where its key sits and its hash, for the commit.
    let mut held: SmallVec<[_; 4]> = SmallVec::new();
    let mut verdicts: SmallVec<[LocalVerdict; 4]> = SmallVec::new();
    let mut all = true;
    for c in checks {
        let hash = c.store.map.hash(c.key);
        let guard = c.store.map.lock(hash);
        let fresh;
        let found = guard.find(hash, c.key);
        let state = match guard.live_at(found, now) {
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
        held.push((guard, found, hash));
    }
    if all && charge {
        for ((guard, found, hash), (c, v)) in held.iter_mut().zip(checks.iter().zip(&verdicts)) {
            if v.is_ok() {
                commit(guard, *found, *hash, c, now);
            }
        }
    }
    (all, verdicts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algorithm::{FixedWindow, Gcra, Quota};

    fn q(count: u64) -> Quota {
        Quota {
            count,
            period: 1_000_000,
            burst: count,
        }
    }

    fn check<'a>(
        store: &'a LocalStore,
        alg: &'a Algorithm,
        key: &'a [u8],
        shadow: bool,
    ) -> LocalCheck<'a> {
        LocalCheck {
            store,
            algorithm: alg,
            key,
            cost: 1,
            max_delay: 0,
            shadow,
        }
    }

    #[test]
    fn a_rejection_by_one_limit_charges_none() {
        let (a, b) = (LocalStore::new(), LocalStore::new());
        let wide = Algorithm::FixedWindow(FixedWindow::new(q(10)));
        let narrow = Algorithm::FixedWindow(FixedWindow::new(q(1)));
        let checks = [
            check(&a, &wide, b"k", false),
            check(&b, &narrow, b"k", false),
        ];
        assert!(decide(&checks, 5).0);
        for _ in 0..3 {
            let (ok, v) = decide(&checks, 5);
            assert!(!ok);
            assert!(v[0].is_ok() && v[1].is_err());
        }
        assert_eq!(
            a.peek(&wide, b"k", 5).remaining,
            9,
            "only the admitted request counted"
        );
    }

    #[test]
    fn a_shadow_rejection_blocks_nothing_and_charges_nothing_itself() {
        let (a, b) = (LocalStore::new(), LocalStore::new());
        let enforced = Algorithm::Gcra(Gcra::new(q(10)));
        let shadow = Algorithm::FixedWindow(FixedWindow::new(q(1)));
        let checks = [
            check(&a, &enforced, b"k", false),
            check(&b, &shadow, b"k", true),
        ];
        for _ in 0..3 {
            assert!(decide(&checks, 7).0);
        }
        assert_eq!(a.peek(&enforced, b"k", 7).remaining, 7);
        assert_eq!(b.peek(&shadow, b"k", 7).remaining, 0);
    }

    #[test]
    fn check_charges_nothing_and_full_keys_are_swept() {
        let a = LocalStore::new();
        let alg = Algorithm::FixedWindow(FixedWindow::new(q(2)));
        let c = [check(&a, &alg, b"k", false)];
        assert!(super::check(&c, 10).0);
        assert!(a.is_empty());
        decide(&c, 10);
        assert_eq!(a.sweep(999_999), 1);
        // The window ends at 1_000_000: the state is full again and the key goes.
        assert_eq!(a.sweep(1_000_000), 0);
    }
}
