//! GCRA (generic cell rate algorithm), the one core behind `gcra`, `token_bucket` and
//! `leaky_bucket`: a single timestamp per key, so a decision is O(1) and a Redis key is one
//! integer.
//!
//! Bound: in any closed interval of length `period`, at most `burst + floor(period / T)`
//! units are admitted (reserved requests counted at the instant they are released), where
//! `T = ceil(period / count)`; since `floor(period / T) <= count` this is within the
//! contract's `burst + count`.

use super::{Micros, Quota, Rejection, Snapshot};

/// The theoretical arrival time: the instant at which the bucket would be full again if
/// nothing else arrived. `0` (or anything in the past) means full, so a fresh key needs no
/// initialisation and an evicted key comes back exactly as it left.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GcraState {
    /// When the bucket is full again, in microseconds on the deciding clock; 0 for a fresh key.
    pub tat: Micros,
}

/// GCRA with its derived constants computed once, so each decision is a handful of
/// integer operations that the Lua script repeats verbatim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gcra {
    quota: Quota,
    /// `T = ceil(period / count)`: rounding up keeps the sustained rate at or below `count`
    /// per `period`, never above.
    interval: Micros,
    /// `tau = T * burst`: how far ahead of `now` the TAT may run before requests are refused.
    tau: Micros,
}

/// Everything one decision needs, so `check` and `reserve` cannot drift apart.
struct Decision {
    base: Micros,
    new_tat: Micros,
    allow_at: Micros,
}

impl Gcra {
    /// GCRA for `quota`, with `T` and `tau` derived from it.
    pub fn new(quota: Quota) -> Self {
        // count and period are > 0 by config; max(1) only keeps a bad value from panicking.
        let interval = quota.period.div_ceil(quota.count.max(1)).max(1);
        Self {
            quota,
            interval,
            tau: interval.saturating_mul(quota.burst),
        }
    }

    /// The quota this was built from.
    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// `T`, exposed so the Redis side can pass the same constant to its script.
    pub fn emission_interval(&self) -> Micros {
        self.interval
    }

    /// `tau`, exposed for the same reason as [`Gcra::emission_interval`].
    pub fn tau(&self) -> Micros {
        self.tau
    }

    /// The state of a fresh key: TAT 0, a full bucket.
    pub fn new_state(&self) -> GcraState {
        GcraState::default()
    }

    fn decide(&self, state: &GcraState, now: Micros, cost: u64) -> Decision {
        let base = state.tat.max(now);
        let new_tat = base.saturating_add(self.interval.saturating_mul(cost));
        Decision {
            base,
            new_tat,
            allow_at: new_tat.saturating_sub(self.tau),
        }
    }

    /// Whole units that fit in the slack left when the TAT runs `ahead` of now.
    fn takeable(&self, ahead: Micros) -> u64 {
        (self.tau - ahead.min(self.tau)) / self.interval
    }

    /// Admits when `cost` units move the TAT no further than `tau` ahead of `now`; a rejection's
    /// `retry_after` is the wait until they would.
    /// See [`Algorithm::check`](super::Algorithm::check).
    pub fn check(&self, state: &GcraState, now: Micros, cost: u64) -> Result<Snapshot, Rejection> {
        let d = self.decide(state, now, cost);
        if d.allow_at > now {
            Err(Rejection {
                retry_after: d.allow_at - now,
                remaining: self.takeable(d.base - now),
                reset_after: d.base - now,
            })
        } else {
            // Admitted means new_tat - now <= tau, so takeable() does not clamp here.
            Ok(Snapshot {
                remaining: self.takeable(d.new_tat - now),
                reset_after: d.new_tat - now,
            })
        }
    }

    /// Moves the TAT on from `max(TAT, now)` by `T` per unit of `cost`.
    pub fn commit(&self, state: &mut GcraState, now: Micros, cost: u64) {
        state.tat = self.decide(state, now, cost).new_tat;
    }

    /// Whole units takeable at `now`, and the time until the TAT (the bucket full).
    pub fn peek(&self, state: &GcraState, now: Micros) -> Snapshot {
        let ahead = state.tat.max(now) - now;
        Snapshot {
            remaining: self.takeable(ahead),
            reset_after: ahead,
        }
    }

    /// The TAT: from then on the bucket is full.
    pub fn full_at(&self, state: &GcraState) -> Micros {
        state.tat
    }

    /// `burst`: more never fits in the bucket, however long the wait.
    pub fn max_cost(&self) -> u64 {
        self.quota.burst
    }

    /// Always `true`: GCRA orders its capacity in time (see [`Gcra::reserve`]).
    pub fn can_reserve(&self) -> bool {
        true
    }

    /// A request that would be admitted within `max_delay` takes its slot now: the commit
    /// moves the TAT exactly as for an immediate admission, so whoever comes next queues
    /// behind it, and the caller releases the request after the returned delay.
    ///
    /// A cost above `burst` is never reserved: no amount of waiting makes it admissible.
    pub fn reserve(
        &self,
        state: &GcraState,
        now: Micros,
        cost: u64,
        max_delay: Micros,
    ) -> Result<(Snapshot, Micros), Rejection> {
        let d = self.decide(state, now, cost);
        match self.check(state, now, cost) {
            Ok(snapshot) => Ok((snapshot, 0)),
            Err(rejection) if rejection.retry_after <= max_delay && cost <= self.max_cost() => {
                let snapshot = Snapshot {
                    remaining: 0,
                    reset_after: d.new_tat - now,
                };
                Ok((snapshot, rejection.retry_after))
            }
            // Retry-After is when the same request is admitted, and with a wait of up to
            // `max_delay` allowed that comes `max_delay` before the slot itself.
            Err(rejection) if max_delay > 0 && cost <= self.max_cost() => Err(Rejection {
                retry_after: rejection.retry_after - max_delay,
                ..rejection
            }),
            Err(rejection) => Err(rejection),
        }
    }

    /// A reservation (`reserve_ahead`): at least `cost` units and up to `want`, taken at once
    /// for one instance to spend in process. As many as fit now are granted, so a key near its
    /// limit gets what it still has rather than nothing; fewer than `cost` is a rejection, the
    /// same a decision of `cost` gets. The state moves on by the units granted. `reserve.lua`
    /// repeats this step for step.
    ///
    /// Strict only when this gcra is the limit's with its burst reduced by the units of one
    /// reservation's life (see `LimitRate::reserve`), and every decision on the key uses it.
    pub fn grant(
        &self,
        state: &mut GcraState,
        now: Micros,
        cost: u64,
        want: u64,
    ) -> Result<(u64, Snapshot), Rejection> {
        let first = self.check(state, now, cost)?;
        let granted = cost + want.saturating_sub(cost).min(first.remaining);
        self.commit(state, now, granted);
        Ok((granted, self.peek(state, now)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{self, Event};
    use super::super::{Algorithm, Quota, Rejection, Snapshot};
    use super::*;
    use proptest::prelude::*;

    const SECOND: Micros = 1_000_000;

    /// 10 per second (T = 100ms), burst 5 (tau = 500ms).
    fn ten_per_second_burst_5() -> Gcra {
        Gcra::new(Quota {
            count: 10,
            period: SECOND,
            burst: 5,
        })
    }

    fn take(g: &Gcra, s: &mut GcraState, now: Micros, cost: u64) -> Snapshot {
        let snapshot = g.check(s, now, cost).expect("admitted");
        g.commit(s, now, cost);
        snapshot
    }

    #[test]
    fn a_grant_takes_what_fits_up_to_the_want_and_never_less_than_the_cost() {
        let g = ten_per_second_burst_5();
        let mut s = g.new_state();
        // A full bucket of 5 (plus the one the interval always admits): 4 of 4 wanted.
        let (granted, snap) = g.grant(&mut s, 0, 1, 4).expect("granted");
        assert_eq!((granted, snap.remaining), (4, 1));
        // 3 wanted, 1 fits.
        let (granted, snap) = g.grant(&mut s, 0, 1, 3).expect("granted");
        assert_eq!((granted, snap.remaining), (1, 0));
        // Nothing fits: the rejection of a decision of the same cost.
        let r = g.grant(&mut s, 0, 1, 3).unwrap_err();
        assert_eq!(r, g.check(&s, 0, 1).unwrap_err());
        // A cost of 2 after 200 ms: exactly 2 fit.
        assert_eq!(g.grant(&mut s, 200_000, 2, 10).map(|(n, _)| n), Ok(2));
    }

    proptest! {
        /// A grant is the largest decision of at most `want` that the bucket admits: one unit
        /// more would have been refused, and the state is that decision's commit.
        #[test]
        fn a_grant_is_the_largest_admissible_decision(
            tat in 0u64..3_000_000,
            now in 0u64..3_000_000,
            cost in 1u64..4,
            extra in 0u64..20,
        ) {
            let g = ten_per_second_burst_5();
            let state = GcraState { tat };
            let mut granted_state = state;
            match g.grant(&mut granted_state, now, cost, cost + extra) {
                Ok((n, snap)) => {
                    prop_assert!(n >= cost && n <= cost + extra);
                    prop_assert!(g.check(&state, now, n).is_ok());
                    if n < cost + extra {
                        prop_assert!(g.check(&state, now, n + 1).is_err());
                    }
                    let mut committed = state;
                    g.commit(&mut committed, now, n);
                    prop_assert_eq!(granted_state, committed);
                    prop_assert_eq!(snap, g.peek(&committed, now));
                }
                Err(r) => {
                    prop_assert_eq!(Err(r), g.check(&state, now, cost));
                    prop_assert_eq!(granted_state, state);
                }
            }
        }
    }

    #[test]
    fn constants_round_the_interval_up() {
        let g = ten_per_second_burst_5();
        assert_eq!((g.emission_interval(), g.tau()), (100_000, 500_000));
        let g = Gcra::new(Quota {
            count: 3,
            period: 1000,
            burst: 3,
        });
        assert_eq!((g.emission_interval(), g.tau()), (334, 1002));
        // period < count: one unit per microsecond at most, never zero.
        let g = Gcra::new(Quota {
            count: 10,
            period: 3,
            burst: 1,
        });
        assert_eq!(g.emission_interval(), 1);
    }

    #[test]
    fn fresh_key_admits_burst_then_rejects() {
        let g = ten_per_second_burst_5();
        let mut s = g.new_state();
        let now = 7 * SECOND;
        for i in 1..=5 {
            let snap = take(&g, &mut s, now, 1);
            assert_eq!(snap.remaining, 5 - i);
            assert_eq!(snap.reset_after, i * 100_000);
        }
        assert_eq!(
            g.check(&s, now, 1),
            Err(Rejection {
                retry_after: 100_000,
                remaining: 0,
                reset_after: 500_000,
            })
        );
        // One emission interval later exactly one unit is back.
        assert!(g.check(&s, now + 99_999, 1).is_err());
        assert_eq!(
            take(&g, &mut s, now + 100_000, 1),
            Snapshot {
                remaining: 0,
                reset_after: 500_000,
            }
        );
    }

    #[test]
    fn cost_above_one() {
        let g = ten_per_second_burst_5();
        let mut s = g.new_state();
        let now = SECOND;
        assert_eq!(
            take(&g, &mut s, now, 3),
            Snapshot {
                remaining: 2,
                reset_after: 300_000,
            }
        );
        // 2 units left, 3 asked: wait for one more interval.
        assert_eq!(
            g.check(&s, now, 3),
            Err(Rejection {
                retry_after: 100_000,
                remaining: 2,
                reset_after: 300_000,
            })
        );
        // Partial refill: 150ms later 3 units are back minus half an interval.
        assert_eq!(
            g.check(&s, now + 150_000, 4),
            Err(Rejection {
                retry_after: 50_000,
                remaining: 3,
                reset_after: 150_000,
            })
        );
        assert!(g.check(&s, now + 200_000, 4).is_ok());
        // Above burst: never admissible.
        assert!(g.check(&g.new_state(), now, 6).is_err());
    }

    #[test]
    fn check_never_mutates_and_commit_applies_it() {
        let g = ten_per_second_burst_5();
        let s = GcraState { tat: 1_250_000 };
        let before = s;
        let snap = g.check(&s, SECOND, 2).unwrap();
        assert_eq!(s, before);
        let mut s = s;
        g.commit(&mut s, SECOND, 2);
        assert_eq!(s.tat, 1_450_000);
        assert_eq!(g.peek(&s, SECOND), snap);
        // An idle key restarts from now, not from its stale TAT.
        g.commit(&mut s, 10 * SECOND, 1);
        assert_eq!(s.tat, 10 * SECOND + 100_000);
    }

    #[test]
    fn peek_and_full_at() {
        let g = ten_per_second_burst_5();
        let s = GcraState { tat: 2_250_000 };
        assert_eq!(
            g.peek(&s, 2 * SECOND),
            Snapshot {
                remaining: 2,
                reset_after: 250_000,
            }
        );
        assert_eq!(g.full_at(&s), 2_250_000);
        let fresh = g.new_state();
        for now in [2_250_000, 2_250_001, 9 * SECOND] {
            assert_eq!(g.peek(&s, now), g.peek(&fresh, now));
            for cost in 0..=6 {
                assert_eq!(g.check(&s, now, cost), g.check(&fresh, now, cost));
            }
        }
        assert_ne!(g.peek(&s, 2_249_999), g.peek(&fresh, 2_249_999));
    }

    #[test]
    fn reserve_queues_within_max_delay() {
        let g = ten_per_second_burst_5();
        let mut s = g.new_state();
        let now = SECOND;
        take(&g, &mut s, now, 5);
        // Admissible now: no delay, same snapshot as check.
        assert_eq!(
            g.reserve(&g.new_state(), now, 1, 0),
            Ok((g.check(&g.new_state(), now, 1).unwrap(), 0))
        );
        // Empty bucket: the next slot is one interval away.
        // One µs short: rejected, and the same request is admitted (with a wait of 99,999
        // µs) 1 µs later.
        assert_eq!(
            g.reserve(&s, now, 1, 99_999),
            Err(Rejection {
                retry_after: 1,
                ..g.check(&s, now, 1).unwrap_err()
            })
        );
        assert!(g.reserve(&s, now + 1, 1, 99_999).is_ok());
        assert_eq!(
            g.reserve(&s, now, 1, 100_000),
            Ok((
                Snapshot {
                    remaining: 0,
                    reset_after: 600_000,
                },
                100_000
            ))
        );
        g.commit(&mut s, now, 1);
        // The next one queues behind the reservation.
        assert_eq!(g.reserve(&s, now, 2, SECOND).map(|(_, d)| d), Ok(300_000));
        assert!(g.can_reserve());
        // Cost above burst: refused whatever the delay allowed.
        assert!(g.reserve(&g.new_state(), now, 6, u64::MAX).is_err());
    }

    #[test]
    fn extreme_inputs_do_not_panic() {
        for quota in [
            Quota {
                count: u64::MAX,
                period: u64::MAX,
                burst: u64::MAX,
            },
            Quota {
                count: 1,
                period: u64::MAX,
                burst: u64::MAX,
            },
            Quota {
                count: 0,
                period: 0,
                burst: 0,
            },
        ] {
            let g = Gcra::new(quota);
            let mut s = GcraState { tat: u64::MAX };
            for now in [0, 1, u64::MAX - 1, u64::MAX] {
                for cost in [0, 1, u64::MAX] {
                    let _ = g.check(&s, now, cost);
                    let _ = g.reserve(&s, now, cost, u64::MAX);
                    let _ = g.peek(&s, now);
                    g.commit(&mut s, now, cost);
                }
            }
        }
    }

    fn gcra_case() -> impl Strategy<Value = (Quota, Vec<Event>, Micros)> {
        testkit::quota().prop_flat_map(|q| {
            let tau = Gcra::new(q).tau();
            (
                Just(q),
                testkit::timeline(q, q.burst),
                prop_oneof![Just(0), 0..=tau, 0..=tau.saturating_mul(3)],
            )
        })
    }

    /// The tight form of the contract's `burst + count`: `floor(period / T) <= count`.
    fn bound(g: &Gcra) -> u64 {
        g.quota().burst + g.quota().period / g.emission_interval()
    }

    proptest! {
        #[test]
        fn prop_bound_retry_after_and_eviction((q, events, _) in gcra_case()) {
            let g = Gcra::new(q);
            let admitted = testkit::simulate(&Algorithm::Gcra(g.clone()), &events);
            let most = testkit::max_in_interval(&admitted, q.period, true);
            prop_assert!(most <= bound(&g), "{most} admitted in a closed period, bound {}", bound(&g));
            prop_assert!(bound(&g) <= q.burst + q.count);
        }

        #[test]
        fn prop_reserve_delay_is_retry_after_and_bound_holds((q, events, max_delay) in gcra_case()) {
            let g = Gcra::new(q);
            let released = testkit::simulate_reserve(&Algorithm::Gcra(g.clone()), &events, max_delay);
            let most = testkit::max_in_interval(&released, q.period, true);
            prop_assert!(most <= bound(&g), "{most} released in a closed period, bound {}", bound(&g));
        }
    }
}
