//! Giving a concurrency slot back to the local store: the other half of a concurrency limit's
//! decision, made when the request's exchange ends (see `limit::held`).
//!
//! Its own file beside the store: a release is no decision (nothing is checked, and no other
//! limit takes part), just the key's count of held slots going down by one under its shard lock.

use super::LocalStore;
use crate::limit::algorithm::{Algorithm, Micros};

impl LocalStore {
    /// Gives back `cost` slots of `key` that a decision under `algorithm` (a concurrency limit)
    /// took. A key no longer held (the admin API reset it) stays as it is. `now` is any recent
    /// local time: slots do not expire, the table only uses it to drop other keys that have.
    pub fn release(&self, algorithm: &Algorithm, key: &[u8], cost: u64, now: Micros) {
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        let found = shard.find(hash, key);
        if shard.live_at(found, now).is_none() {
            return;
        }
        shard.update_found(
            found,
            hash,
            key,
            now,
            || algorithm.new_state(),
            |state, _| {
                algorithm.release(state, cost);
                algorithm.full_at(state)
            },
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
        store.release(&alg, b"k", 1, 20);
        assert_eq!(store.sweep(20), 0, "a key holding none is gone");
        assert!(decide(&check, 30).0);
        // A key forgotten meanwhile (the admin API's reset) is not written by a release.
        assert!(store.forget(b"k", 30));
        store.release(&alg, b"k", 1, 40);
        assert!(store.is_empty() || store.sweep(40) == 0);
    }
}
