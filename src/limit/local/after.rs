//! The local store's half of the limits that end after the response (see `limit::held`): a
//! concurrency slot given back when the request's exchange ends, and a request's cost settled
//! once its response says what it was.
//!
//! Their own file beside the store: neither is a decision (nothing is checked, and no other
//! limit takes part), just one key's state changed under its shard lock.

use super::LocalStore;
use crate::limit::algorithm::{Algorithm, ConcurrencyState, Micros, Settlement, State};

impl LocalStore {
    /// Gives back `cost` slots of `key` that a concurrency limit's decision took. A key no
    /// longer held (the admin API reset it), or holding another kind of state (its limit is no
    /// longer a concurrency limit), stays as it is. A key holding slots never expires (its
    /// `full_at` is the end of time), so no clock is needed: any instant reads it as live, and
    /// one that holds none, or was forgotten, as gone. The first request waiting for a slot of
    /// `key` ([`LocalStore::queue`]) is woken.
    pub fn release(&self, key: &[u8], cost: u64) {
        const ANY: Micros = 0;
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        let found = shard.find(hash, key);
        if !matches!(shard.live_at(found, ANY), Some(State::Concurrency(_))) {
            // Forgotten (reset): its slots are all free, and a waiter may take one.
            drop(shard);
            self.queue.wake(hash);
            return;
        }
        shard.update_found(
            found,
            hash,
            key,
            ANY,
            || State::Concurrency(ConcurrencyState::default()),
            |state, _| match state {
                State::Concurrency(s) => s.release(cost),
                _ => 0,
            },
            // The key is live (checked above): nothing is inserted, nothing ranked.
            |_| 0,
        );
        drop(shard);
        self.queue.wake(hash);
    }

    /// Applies `s` to `key`'s state under `algorithm` (the rate its decision applied) at `now`.
    /// A charge on a key no longer held (back to full and dropped) is charged on a fresh state
    /// as the algorithm settles one (gcra: as if from the request's own admission; a window:
    /// into the current window); a refund on one has nothing to give back.
    pub fn settle(&self, algorithm: &Algorithm, key: &[u8], s: Settlement, now: Micros) {
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        let found = shard.find(hash, key);
        if s.delta <= 0 && shard.live_at(found, now).is_none() {
            return;
        }
        shard.update_found(
            found,
            hash,
            key,
            now,
            || algorithm.new_state(),
            |state, _| {
                algorithm.settle(state, s, now);
                algorithm.full_at(state)
            },
            super::rank(algorithm, now),
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::limit::algorithm::{Algorithm, Concurrency};
    use crate::limit::local::{LocalCheck, LocalStore, decide};

    #[test]
    fn a_released_slot_admits_again_and_an_idle_key_is_dropped() {
        let store = LocalStore::new();
        let alg = Algorithm::Concurrency(Concurrency::new(1, 1_000_000, 60_000_000));
        let check = [LocalCheck {
            store: &store,
            algorithm: &alg,
            key: b"k",
            cost: 1,
            max_delay: 0,
            shadow: false,
        }];
        assert!(decide(&check, 10).0);
        assert!(!decide(&check, 10).0, "the one slot is taken");
        assert_eq!(store.sweep(u64::MAX - 1), 1, "a held slot never expires");
        store.release(b"k", 1);
        assert_eq!(store.sweep(20), 0, "a key holding none is gone");
        assert!(decide(&check, 30).0);
        // A key forgotten meanwhile (the admin API's reset) is not written by a release.
        assert!(store.forget(b"k", 30));
        store.release(b"k", 1);
        assert!(store.is_empty() || store.sweep(40) == 0);
    }
}
