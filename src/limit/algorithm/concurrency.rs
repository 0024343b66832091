//! Concurrency slots (`algorithm: concurrency`): at most `max_in_flight` requests of one key at
//! once. The state is not a rate but a count of slots held; a request takes one at admission
//! and gives it back when its exchange ends ([`Concurrency::release`]), whichever way it ends.
//!
//! It sits beside the rate algorithms so that a request's concurrency limits are decided in the
//! same all-or-nothing step as its rate limits (a request another limit rejects keeps no slot),
//! under the same shard lock. What a rate answers with time, a slot answers with a release: a
//! rejection's `retry_after` is the limit's configured `retry_after`, since no clock says when a
//! slot frees up.
//!
//! In Redis (global limits) the slots are leases, members of a sorted set scored by their
//! expiry; see `lib.lua`. The count here is the local store's, and the `on_error: allow`
//! fallback's.

use super::{Micros, Quota, Rejection, Snapshot};

/// Slots held by one key now. `0` is a fresh key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConcurrencyState {
    /// Requests of this key admitted and not yet ended.
    pub held: u64,
}

impl ConcurrencyState {
    /// Gives `cost` slots back (never below none); returns when the state may be dropped, as
    /// [`Concurrency::full_at`] does. Needs no parameter of the limit, so a slot is given back
    /// with nothing but its key.
    pub fn release(&mut self, cost: u64) -> Micros {
        self.held = self.held.saturating_sub(cost);
        if self.held == 0 { 0 } else { Micros::MAX }
    }
}

/// A concurrency limit's parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Concurrency {
    max_in_flight: u64,
    /// What a rejection answers as `Retry-After` (config `retry_after`).
    retry_after: Micros,
    /// Global limits: how long a lease lives without renewal (config `lease`).
    lease: Micros,
}

impl Concurrency {
    /// At most `max_in_flight` at once; rejections say `retry_after`; leases (global) last
    /// `lease`.
    pub fn new(max_in_flight: u64, retry_after: Micros, lease: Micros) -> Self {
        Self {
            max_in_flight,
            retry_after: retry_after.max(1),
            lease: lease.max(1),
        }
    }

    /// `max_in_flight` as a quota: `count` and `burst` are the slots, `period` the lease (what
    /// the Redis side reads as a lease's length).
    pub fn quota(&self) -> Quota {
        Quota {
            count: self.max_in_flight,
            period: self.lease,
            burst: self.max_in_flight,
        }
    }

    /// The configured `retry_after`, in microseconds.
    pub fn retry_after(&self) -> Micros {
        self.retry_after
    }

    /// The configured `lease`, in microseconds.
    pub fn lease(&self) -> Micros {
        self.lease
    }

    /// No slot held.
    pub fn new_state(&self) -> ConcurrencyState {
        ConcurrencyState::default()
    }

    /// Admits while fewer than `max_in_flight` slots (counting `cost` more) are held.
    pub fn check(
        &self,
        state: &ConcurrencyState,
        _now: Micros,
        cost: u64,
    ) -> Result<Snapshot, Rejection> {
        let after = state.held.saturating_add(cost);
        if after <= self.max_in_flight {
            Ok(Snapshot {
                remaining: self.max_in_flight - after,
                reset_after: 0,
            })
        } else {
            Err(Rejection {
                retry_after: self.retry_after,
                remaining: self.max_in_flight.saturating_sub(state.held),
                reset_after: 0,
            })
        }
    }

    /// Takes `cost` slots.
    pub fn commit(&self, state: &mut ConcurrencyState, _now: Micros, cost: u64) {
        state.held = state.held.saturating_add(cost);
    }

    /// Gives `cost` slots back (never below none: a key reset by the admin API meanwhile holds
    /// none of them any more).
    pub fn release(&self, state: &mut ConcurrencyState, cost: u64) {
        state.release(cost);
    }

    /// Slots free now.
    pub fn peek(&self, state: &ConcurrencyState, _now: Micros) -> Snapshot {
        Snapshot {
            remaining: self.max_in_flight.saturating_sub(state.held),
            reset_after: 0,
        }
    }

    /// A key holding no slot is a fresh key (0: drop it at once); one holding some is kept
    /// until they are given back, whatever the time.
    pub fn full_at(&self, state: &ConcurrencyState) -> Micros {
        if state.held == 0 { 0 } else { Micros::MAX }
    }

    /// One request takes one slot; `max_in_flight` at most.
    pub fn max_cost(&self) -> u64 {
        self.max_in_flight
    }

    /// A slot comes back when a request ends, not at a time: nothing to reserve.
    pub fn can_reserve(&self) -> bool {
        false
    }

    /// As [`Concurrency::check`], with no delay.
    pub fn reserve(
        &self,
        state: &ConcurrencyState,
        now: Micros,
        cost: u64,
        _max_delay: Micros,
    ) -> Result<(Snapshot, Micros), Rejection> {
        self.check(state, now, cost).map(|s| (s, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_taken_up_to_the_max_and_given_back() {
        let c = Concurrency::new(2, 1_000_000, 60_000_000);
        let mut s = c.new_state();
        assert_eq!(c.full_at(&s), 0);
        for left in [1, 0] {
            assert_eq!(c.check(&s, 5, 1).unwrap().remaining, left);
            c.commit(&mut s, 5, 1);
        }
        assert_eq!(c.full_at(&s), Micros::MAX);
        let r = c.check(&s, 5, 1).unwrap_err();
        assert_eq!((r.retry_after, r.remaining), (1_000_000, 0));
        c.release(&mut s, 1);
        assert_eq!(c.peek(&s, 9).remaining, 1);
        assert!(c.check(&s, 9, 1).is_ok());
        c.release(&mut s, 1);
        c.release(&mut s, 1);
        assert_eq!(s.held, 0, "never below none");
        assert!(!c.can_reserve());
        assert_eq!(c.reserve(&s, 0, 1, 10).unwrap().1, 0);
    }
}
