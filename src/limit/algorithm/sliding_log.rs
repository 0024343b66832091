//! Sliding log: every admitted request's timestamp and cost, for an exact limit at the price
//! of memory proportional to `count` per key.
//!
//! Bound: exactly at most `count` units in any half-open interval `[t, t + period)`. (A closed
//! interval can hold `2 × count`: a unit taken at `t` no longer counts at `t + period`.)

use std::collections::VecDeque;

use super::{Micros, Quota, Rejection, Snapshot};

/// Admitted requests, oldest first, with a running total so a decision only walks the
/// entries that have expired (or, on rejection, the ones that must expire).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct LogState {
    /// `(timestamp, cost)`, timestamps strictly increasing; an entry counts while
    /// `timestamp + period > now`.
    pub entries: VecDeque<(Micros, u64)>,
    /// Sum of the costs in `entries`, expired ones included until a commit drops them.
    pub sum: u64,
}

/// Sliding log: at most `count` units in any `period` microseconds, counted exactly from a log
/// of admissions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlidingLog {
    quota: Quota,
}

/// The log as seen at one instant, without dropping anything.
struct Live {
    /// Leading entries that have expired.
    expired: usize,
    /// Sum of the live entries' costs.
    used: u64,
}

impl SlidingLog {
    /// The sliding log for `quota` (`burst` is not used).
    pub fn new(quota: Quota) -> Self {
        Self { quota }
    }

    /// The quota this was built from.
    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// The state of a fresh key: an empty log.
    pub fn new_state(&self) -> LogState {
        LogState::default()
    }

    fn expires_at(&self, ts: Micros) -> Micros {
        ts.saturating_add(self.quota.period)
    }

    fn live(&self, state: &LogState, now: Micros) -> Live {
        let mut expired = 0;
        let mut gone = 0u64;
        for &(ts, cost) in &state.entries {
            if self.expires_at(ts) > now {
                break;
            }
            expired += 1;
            gone = gone.saturating_add(cost);
        }
        Live {
            expired,
            used: state.sum.saturating_sub(gone),
        }
    }

    /// Time until the newest live entry expires, i.e. until the log is empty.
    fn reset_after(&self, state: &LogState, now: Micros) -> Micros {
        match state.entries.back() {
            Some(&(ts, _)) => self.expires_at(ts).saturating_sub(now),
            None => 0,
        }
    }

    /// Admits when the live entries plus `cost` stay within `count`; a rejection waits until
    /// enough of the oldest entries have expired.
    /// See [`Algorithm::check`](super::Algorithm::check).
    pub fn check(&self, state: &LogState, now: Micros, cost: u64) -> Result<Snapshot, Rejection> {
        let live = self.live(state, now);
        let limit = self.quota.count;
        if let Some(after) = live.used.checked_add(cost).filter(|&after| after <= limit) {
            return Ok(Snapshot {
                remaining: limit - after,
                // The new entry expires last. A cost-0 request adds no entry (see commit).
                reset_after: if cost > 0 {
                    self.quota.period
                } else {
                    self.reset_after(state, now)
                },
            });
        }
        // The request fits once the oldest `need` units have expired.
        let need = live.used.saturating_add(cost) - limit;
        let mut freed = 0u64;
        let retry_after = state
            .entries
            .iter()
            .skip(live.expired)
            .find(|&&(_, c)| {
                freed = freed.saturating_add(c);
                freed >= need
            })
            .map(|&(ts, _)| self.expires_at(ts).saturating_sub(now))
            // Only for cost > count, which never fits: any positive answer is as good.
            .unwrap_or(self.quota.period.max(1));
        Err(Rejection {
            retry_after,
            remaining: limit.saturating_sub(live.used),
            reset_after: self.reset_after(state, now),
        })
    }

    /// Drops the entries expired at `now` and records `cost` at `now` (added to the newest entry
    /// when that is not older; a cost of 0 records nothing).
    pub fn commit(&self, state: &mut LogState, now: Micros, cost: u64) {
        while let Some(&(ts, c)) = state.entries.front() {
            if self.expires_at(ts) > now {
                break;
            }
            state.entries.pop_front();
            state.sum = state.sum.saturating_sub(c);
        }
        if cost == 0 {
            return;
        }
        match state.entries.back_mut() {
            // `>=` rather than `==`: should the clock step back, the units are recorded at
            // the later instant, which keeps timestamps ordered and errs towards limiting.
            Some((ts, c)) if *ts >= now => *c = c.saturating_add(cost),
            _ => state.entries.push_back((now, cost)),
        }
        state.sum = state.sum.saturating_add(cost);
    }

    /// Units left at `now`, and the time until the newest entry expires (the log empty).
    pub fn peek(&self, state: &LogState, now: Micros) -> Snapshot {
        Snapshot {
            remaining: self.quota.count.saturating_sub(self.live(state, now).used),
            reset_after: self.reset_after(state, now),
        }
    }

    /// When the newest entry expires (0 for an empty log).
    pub fn full_at(&self, state: &LogState) -> Micros {
        match state.entries.back() {
            Some(&(ts, _)) => self.expires_at(ts),
            None => 0,
        }
    }

    /// `count`: the log never holds more live units.
    pub fn max_cost(&self) -> u64 {
        self.quota.count
    }

    /// Always `false`: see [`SlidingLog::reserve`].
    pub fn can_reserve(&self) -> bool {
        false
    }

    /// No reservations: the log records when units were taken, and a reservation would
    /// have to record the future. Behaves as [`SlidingLog::check`] with no delay.
    pub fn reserve(
        &self,
        state: &LogState,
        now: Micros,
        cost: u64,
        _max_delay: Micros,
    ) -> Result<(Snapshot, Micros), Rejection> {
        self.check(state, now, cost).map(|snapshot| (snapshot, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{self, Event};
    use super::super::{Algorithm, Quota, Rejection, Snapshot};
    use super::*;
    use proptest::prelude::*;

    fn log(count: u64, period: Micros) -> SlidingLog {
        SlidingLog::new(Quota {
            count,
            period,
            burst: count,
        })
    }

    fn take(l: &SlidingLog, s: &mut LogState, now: Micros, cost: u64) -> Snapshot {
        let snapshot = l.check(s, now, cost).expect("admitted");
        l.commit(s, now, cost);
        snapshot
    }

    #[test]
    fn fresh_key_admits_count_at_once_then_rejects() {
        let l = log(3, 1000);
        let mut s = l.new_state();
        for i in 1..=3 {
            assert_eq!(
                take(&l, &mut s, 40, 1),
                Snapshot {
                    remaining: 3 - i,
                    reset_after: 1000,
                }
            );
        }
        // Same instant: merged into one entry.
        assert_eq!(s.entries, VecDeque::from([(40, 3)]));
        assert_eq!(
            l.check(&s, 40, 1),
            Err(Rejection {
                retry_after: 1000,
                remaining: 0,
                reset_after: 1000,
            })
        );
        assert!(l.check(&s, 1039, 3).is_err());
        assert_eq!(take(&l, &mut s, 1040, 3).remaining, 0);
        assert_eq!(s.entries, VecDeque::from([(1040, 3)]));
        assert_eq!(s.sum, 3);
    }

    #[test]
    fn retry_after_waits_for_the_oldest_units_needed() {
        let l = log(3, 1000);
        let mut s = l.new_state();
        for now in [0, 100, 200] {
            take(&l, &mut s, now, 1);
        }
        assert_eq!(
            l.check(&s, 300, 1),
            Err(Rejection {
                retry_after: 700,
                remaining: 0,
                reset_after: 900,
            })
        );
        // Cost 2 needs the two oldest gone: the one at 100 expires at 1100.
        assert_eq!(l.check(&s, 300, 2).unwrap_err().retry_after, 800);
        assert!(l.check(&s, 1099, 2).is_err());
        assert_eq!(
            l.check(&s, 1100, 2),
            Ok(Snapshot {
                remaining: 0,
                reset_after: 1000,
            })
        );
        // Above count: never fits, still a positive answer.
        assert_eq!(l.check(&s, 300, 4).unwrap_err().retry_after, 1000);
    }

    #[test]
    fn check_never_mutates_commit_drops_expired() {
        let l = log(3, 1000);
        let mut s = l.new_state();
        take(&l, &mut s, 0, 2);
        take(&l, &mut s, 500, 1);
        let before = s.clone();
        assert!(l.check(&s, 1000, 2).is_ok());
        assert_eq!(s, before);
        take(&l, &mut s, 1000, 2);
        assert_eq!(s.entries, VecDeque::from([(500, 1), (1000, 2)]));
        assert_eq!(s.sum, 3);
        // Cost 0 records nothing.
        l.commit(&mut s, 1200, 0);
        assert_eq!(s.entries.len(), 2);
    }

    #[test]
    fn peek_and_full_at() {
        let l = log(3, 1000);
        let mut s = l.new_state();
        take(&l, &mut s, 0, 2);
        take(&l, &mut s, 500, 1);
        assert_eq!(
            l.peek(&s, 700),
            Snapshot {
                remaining: 0,
                reset_after: 800,
            }
        );
        assert_eq!(
            l.peek(&s, 1000),
            Snapshot {
                remaining: 2,
                reset_after: 500,
            }
        );
        assert_eq!(l.full_at(&s), 1500);
        let fresh = l.new_state();
        assert_eq!(l.full_at(&fresh), 0);
        for now in [1500, 1501, 50_000] {
            assert_eq!(l.peek(&s, now), l.peek(&fresh, now));
            for cost in 0..=4 {
                assert_eq!(l.check(&s, now, cost), l.check(&fresh, now, cost));
            }
        }
        assert_ne!(l.peek(&s, 1499), l.peek(&fresh, 1499));
    }

    #[test]
    fn clock_stepping_back_keeps_the_log_ordered() {
        let l = log(5, 1000);
        let mut s = l.new_state();
        take(&l, &mut s, 900, 1);
        take(&l, &mut s, 800, 1);
        assert_eq!(s.entries, VecDeque::from([(900, 2)]));
        assert_eq!(l.full_at(&s), 1900);
        assert!(!l.can_reserve());
        assert_eq!(
            l.reserve(&s, 950, 1, 77),
            Ok((l.check(&s, 950, 1).unwrap(), 0))
        );
    }

    #[test]
    fn extreme_inputs_do_not_panic() {
        for (count, period) in [(u64::MAX, u64::MAX), (1, u64::MAX), (0, 0), (u64::MAX, 1)] {
            let l = log(count, period);
            let mut s = LogState {
                entries: VecDeque::from([(0, u64::MAX), (u64::MAX, u64::MAX)]),
                sum: 3,
            };
            for now in [0, 1, u64::MAX - 1, u64::MAX] {
                for cost in [0, 1, u64::MAX] {
                    let _ = l.check(&s, now, cost);
                    let _ = l.peek(&s, now);
                    let _ = l.full_at(&s);
                    l.commit(&mut s, now, cost);
                }
            }
        }
    }

    fn case() -> impl Strategy<Value = (Quota, Vec<Event>)> {
        testkit::quota().prop_flat_map(|q| (Just(q), testkit::timeline(q, q.count)))
    }

    proptest! {
        #[test]
        fn prop_bound_retry_after_and_eviction((q, events) in case()) {
            let admitted = testkit::simulate(&Algorithm::SlidingLog(SlidingLog::new(q)), &events);
            let most = testkit::max_in_interval(&admitted, q.period, false);
            prop_assert!(most <= q.count, "{most} in a half-open period, count {}", q.count);
        }
    }
}
