//! The in-process store of local limits: per-key algorithm state, sharded, self-evicting.
//!
//! Each limit owns one [`LocalStore`] (a [`sharded::Sharded`] map, no global lock). An entry is
//! dropped once its state is back to "full" (`full_at`): lazily when touched, and by
//! [`LocalStore::sweep`] on a timer, so memory follows the keys that are active now, not every
//! key ever seen.
//!
//! The store holds at most its share of `server.max_keys` ([`LocalStore::set_budget`]); a new
//! key in a full shard evicts the key closest to full, which is the key with the most units
//! left (see [`sharded`]).
//!
//! [`decide`] evaluates all of a request's local limits under their shard locks, taken in one
//! order for every request (by store address, so two requests cannot deadlock, even across a
//! reload that reorders a route's limits), checks every limit and commits only if all admitted. That is what makes
//! "a rejected request consumes from none" exact, which governor cannot do (it consumes on check).

mod after;
pub mod deny;
pub mod sharded;

use smallvec::SmallVec;

use super::algorithm::{Algorithm, Micros, Rejection, Snapshot, State};
use sharded::{Found, Rank, Shard, Sharded};

/// The state of one local limit's keys. An entry expires at its `full_at`: from then on it is
/// indistinguishable from a fresh key, so dropping it loses nothing.
#[derive(Default)]
pub struct LocalStore {
    map: Sharded<State>,
    /// A concurrency limit's requests waiting for a slot (`on_limit: delay`), per key: beside
    /// the slots, so a release wakes them and a reload carries them over with the slots.
    pub queue: super::queue::SlotQueue,
}

impl std::fmt::Debug for LocalStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalStore")
            .field("len", &self.len())
            .finish()
    }
}

impl LocalStore {
    /// An empty store.
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

    /// The hash `key` is stored under: what names its line in [`LocalStore::queue`].
    pub fn key_hash(&self, key: &[u8]) -> u64 {
        self.map.hash(key)
    }

    /// Forgets `key`'s state (the admin API's reset): its next request finds it full.
    /// Returns whether the store held it at `now` (a key back to full is held by no one).
    pub fn forget(&self, key: &[u8], now: Micros) -> bool {
        self.map.forget(key, now)
    }

    /// Drops every key whose state is back to full; returns the number of keys kept.
    pub fn sweep(&self, now: Micros) -> usize {
        self.map.sweep(now)
    }

    /// Keys held, including those back to full that no sweep has dropped yet.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Caps the store at `keys` keys (its share of `server.max_keys`), evicting at once the
    /// keys closest to full under `algorithm` when it holds more.
    pub fn set_budget(&self, keys: usize, algorithm: &Algorithm, now: Micros) {
        self.map.set_budget(keys, now, rank(algorithm, now), drop);
    }

    /// The budget last set (`usize::MAX`: none).
    pub fn budget(&self) -> usize {
        self.map.budget()
    }

    /// Keys evicted to keep within the budget since the last call.
    pub fn take_evicted(&self) -> u64 {
        self.map.take_evicted()
    }
}

/// How close a key's state is to full: the units its limit has left now. A key that took one
/// unit of a flood stands just under full and goes before a client deep in its budget.
fn rank(algorithm: &Algorithm, now: Micros) -> impl Fn(&State) -> Rank + '_ {
    move |state| algorithm.peek(state, now).remaining
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
        rank(c.algorithm, now),
    );
}

/// One local limit of a request, ready to decide.
pub struct LocalCheck<'a> {
    /// The limit's store.
    pub store: &'a LocalStore,
    /// The limit's algorithm.
    pub algorithm: &'a Algorithm,
    /// The request's key for this limit.
    pub key: &'a [u8],
    /// Units the request takes.
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

/// A check's shard guard, where its key sits and its hash.
type Held<'a> = (parking_lot::MutexGuard<'a, Shard<State>>, Found, u64);

#[inline(always)]
fn lock<'a>(c: &LocalCheck<'a>) -> Held<'a> {
    let hash = c.store.map.hash(c.key);
    let guard = c.store.map.lock(hash);
    let found = guard.find(hash, c.key);
    (guard, found, hash)
}

/// Locks several checks' shards in address order, pushing the guards in the checks' order.
#[inline(never)]
fn lock_in_order<'a>(checks: &[LocalCheck<'a>], held: &mut SmallVec<[Held<'a>; 4]>) {
    let mut order: SmallVec<[(usize, &LocalCheck<'a>); 4]> = checks.iter().enumerate().collect();
    order.sort_unstable_by_key(|(_, c)| std::ptr::from_ref(c.store) as usize);
    let mut locked: SmallVec<[(usize, Held<'a>); 4]> =
        order.into_iter().map(|(i, c)| (i, lock(c))).collect();
    locked.sort_unstable_by_key(|l| l.0);
    held.extend(locked.into_iter().map(|l| l.1));
}

/// What `c` answers at `now` for its key's live state (`None`: absent or expired, so full).
#[inline(always)]
fn verdict(c: &LocalCheck<'_>, state: Option<&State>, now: Micros) -> LocalVerdict {
    let fresh;
    let state = match state {
        Some(state) => state,
        None => {
            fresh = c.algorithm.new_state();
            &fresh
        }
    };
    if c.max_delay > 0 {
        c.algorithm.reserve(state, now, c.cost, c.max_delay)
    } else {
        c.algorithm.check(state, now, c.cost).map(|s| (s, 0))
    }
}

fn decide_inner(
    checks: &[LocalCheck<'_>],
    now: Micros,
    charge: bool,
) -> (bool, SmallVec<[LocalVerdict; 4]>) {
    // Each check's shard guard, with where its key sits and its hash, for the commit, in the
    // checks' order. The locks are taken in one order for every request, the stores'
    // addresses, not the route's limit order: a reload carries a limit's store over even when
    // the new config lists the route's limits in another order, and a request still on the old
    // config must not hold the lock a new one waits for while it waits for that one's.
    if let [c] = checks {
        // One limit, the common route: one guard, nothing to order or collect.
        let (mut guard, found, hash) = lock(c);
        let v = verdict(c, guard.live_at(found, now), now);
        let all = v.is_ok() || c.shadow;
        if all && charge && v.is_ok() {
            commit(&mut guard, found, hash, c, now);
        }
        drop(guard);
        let mut verdicts = SmallVec::new();
        verdicts.push(v);
        return (all, verdicts);
    }
    let mut held: SmallVec<[Held<'_>; 4]> = SmallVec::new();
    lock_in_order(checks, &mut held);
    let mut verdicts: SmallVec<[LocalVerdict; 4]> = SmallVec::new();
    let mut all = true;
    for (c, (guard, found, _)) in checks.iter().zip(&held) {
        let v = verdict(c, guard.live_at(*found, now), now);
        all &= v.is_ok() || c.shadow;
        verdicts.push(v);
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

    /// A reload carries a limit's store over even when the route now lists its limits in
    /// another order, so a request of the old config and one of the new can decide on the same
    /// two stores in opposite orders at once. Taking the route's order as the lock order, they
    /// could each hold the lock the other waits for, and both threads would hang forever.
    #[test]
    fn opposite_limit_orders_on_the_same_stores_do_not_deadlock() {
        let (a, b) = (LocalStore::new(), LocalStore::new());
        let alg = Algorithm::Gcra(Gcra::new(q(1_000_000)));
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            for reversed in [false, true] {
                let (a, b, alg, done) = (&a, &b, &alg, done.clone());
                s.spawn(move || {
                    let (first, second) = if reversed { (b, a) } else { (a, b) };
                    let checks = [
                        check(first, alg, b"k", false),
                        check(second, alg, b"k", false),
                    ];
                    for n in 0..200_000 {
                        decide(&checks, n);
                    }
                    done.send(()).unwrap();
                });
            }
            for _ in 0..2 {
                if finished
                    .recv_timeout(std::time::Duration::from_secs(30))
                    .is_err()
                {
                    // The threads cannot be unstuck; end the test process with the verdict.
                    eprintln!("two decisions on the same stores in opposite orders deadlocked");
                    std::process::exit(1);
                }
            }
        });
    }

    proptest::proptest! {
        /// A lone check is decided on its own path (one guard, no list); it must answer and
        /// charge exactly as the same check does on the general path, beside a second limit
        /// that always admits.
        #[test]
        fn one_limit_alone_decides_as_it_does_beside_another(
            alg in 0..4usize,
            shadow in proptest::bool::ANY,
            delay in proptest::bool::ANY,
            steps in proptest::collection::vec((0..400_000u64, 1..4u64, proptest::bool::ANY), 1..60),
        ) {
            let quota = Quota { count: 5, period: 1_000_000, burst: 3 };
            let alg = match alg {
                0 => Algorithm::Gcra(Gcra::new(quota)),
                1 => Algorithm::FixedWindow(FixedWindow::new(quota)),
                2 => Algorithm::SlidingWindow(crate::limit::algorithm::SlidingWindow::new(quota)),
                _ => Algorithm::SlidingLog(crate::limit::algorithm::SlidingLog::new(quota)),
            };
            let wide = Algorithm::Gcra(Gcra::new(q(1_000_000)));
            let (alone, paired, other) = (LocalStore::new(), LocalStore::new(), LocalStore::new());
            let max_delay = if delay && matches!(alg, Algorithm::Gcra(_)) { 2_000_000 } else { 0 };
            let mut now = 0;
            for (step, cost, charge) in steps {
                now += step;
                let c = |store| LocalCheck { store, algorithm: &alg, key: b"k", cost, max_delay, shadow };
                let one = [c(&alone)];
                let two = [c(&paired), check(&other, &wide, b"k", false)];
                let (a, b) = if charge {
                    (decide(&one, now), decide(&two, now))
                } else {
                    (super::check(&one, now), super::check(&two, now))
                };
                proptest::prop_assert_eq!(a.0, b.0);
                proptest::prop_assert_eq!(&a.1[0], &b.1[0]);
                proptest::prop_assert_eq!(alone.peek(&alg, b"k", now), paired.peek(&alg, b"k", now));
            }
        }
    }

    /// The overflow policy: a flood of fresh keys far beyond the budget, each taking one unit,
    /// never resets a client deep in its budget; the store never holds more than its budget;
    /// every key not held was counted as evicted.
    #[test]
    fn an_honest_key_deep_in_its_budget_survives_a_flood_of_fresh_keys() {
        let store = LocalStore::new();
        // An hour's budget: nothing comes back to full during the test.
        let alg = Algorithm::Gcra(Gcra::new(Quota {
            count: 100,
            period: 3_600_000_000,
            burst: 100,
        }));
        let budget = 1_024;
        store.set_budget(budget, &alg, 1);
        let honest: Vec<Vec<u8>> = (0..48)
            .map(|i| format!("honest-{i}").into_bytes())
            .collect();
        let take = |key: &[u8], n: usize, now: Micros| {
            for _ in 0..n {
                assert!(decide(&[check(&store, &alg, key, false)], now).0);
            }
        };
        for k in &honest {
            take(k, 90, 10);
        }
        let flood = 200_000u64;
        for i in 0..flood {
            take(format!("flood-{i}").as_bytes(), 1, 20 + i);
            if i % 1_000 == 0 {
                assert!(store.len() <= budget, "{} held over {budget}", store.len());
            }
        }
        let now = 20 + flood;
        for k in &honest {
            assert_eq!(
                store.peek(&alg, k, now).remaining,
                10,
                "{} was reset by the flood",
                String::from_utf8_lossy(k)
            );
        }
        let held = store.len();
        assert!(held <= budget && held > budget / 2, "{held}");
        assert_eq!(
            store.take_evicted(),
            honest.len() as u64 + flood - held as u64
        );
        assert_eq!(store.take_evicted(), 0, "taken");
    }

    /// A budget lowered (a reload, or another store's flood) trims at once, the keys closest to
    /// full first.
    #[test]
    fn a_lowered_budget_trims_the_keys_closest_to_full() {
        let store = LocalStore::new();
        let alg = Algorithm::FixedWindow(FixedWindow::new(Quota {
            count: 100,
            period: 3_600_000_000,
            burst: 100,
        }));
        let take = |key: &[u8], n: usize| {
            for _ in 0..n {
                assert!(decide(&[check(&store, &alg, key, false)], 5).0);
            }
        };
        for i in 0..64 * 16 {
            take(format!("light-{i}").as_bytes(), 1);
        }
        // 16 heavy keys over 64 shards of 8 keys each: no shard has more heavy keys than room.
        for i in 0..16 {
            take(format!("heavy-{i}").as_bytes(), 50);
        }
        assert_eq!(store.len(), 64 * 16 + 16);
        store.set_budget(64 * 8, &alg, 5);
        assert!(store.len() <= 64 * 8);
        for i in 0..16 {
            let k = format!("heavy-{i}");
            assert_eq!(store.peek(&alg, k.as_bytes(), 5).remaining, 50, "{k}");
        }
        assert_eq!(store.take_evicted(), (64 * 16 + 16 - store.len()) as u64);
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
