//! Settling a request's cost after its response: the difference between what it really cost
//! and the estimate charged at admission, charged or given back on the same state.
//!
//! A settlement is accounted **as if the true cost had been charged at admission** (`at`, on
//! the clock that decided it): gcra moves the TAT by the difference (from no earlier than the
//! admission's own TAT, `at + estimate × T`, so a key that expired meanwhile is charged as the
//! request would have been); the sliding log changes the request's own entry, at `at`. Either
//! may leave the key **in debt**, beyond what an admission could (gcra: a TAT past `now + tau`;
//! the log: more than `count` live units), and then the key's next requests are rejected with
//! the exact `Retry-After` the usual check computes, until the debt has drained: the consumer
//! pays, not the next one.
//!
//! The bound this keeps, tested below for any sequence: of requests made one after another,
//! each settled before the next is admitted, the true cost admitted in any window of `period`
//! is at most the algorithm's bound plus the window's largest single settlement (the last
//! request admitted in the window cannot have paid its own). With `k` requests in flight at
//! once, the `k` largest.
//!
//! The window algorithms are not settled: a fixed (or sliding) window forgets its count at the
//! window's end, so a debt would be forgiven there, and the bound above would not hold; config
//! validation refuses `settle` on them.

use super::{Algorithm, Gcra, GcraState, LogState, Micros, SlidingLog, State};

/// A settlement: the request charged `estimate` at `at`; its true cost is `estimate + delta`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settlement {
    /// When the request was charged (the decision's clock).
    pub at: Micros,
    /// What it was charged then.
    pub estimate: u64,
    /// True cost minus the estimate: > 0 charges more, < 0 gives back.
    pub delta: i64,
}

impl Algorithm {
    /// Whether a settlement can be accounted on this algorithm's state (see the module doc).
    pub fn can_settle(&self) -> bool {
        matches!(self, Algorithm::Gcra(_) | Algorithm::SlidingLog(_))
    }

    /// Applies `s` to `state` at `now`; returns the state's new `full_at` (when it may be
    /// dropped), or `None` when the algorithm cannot settle or the state is of another kind
    /// (nothing changed).
    pub fn settle(&self, state: &mut State, s: Settlement, now: Micros) -> Option<Micros> {
        match (self, state) {
            (Algorithm::Gcra(g), State::Gcra(st)) => {
                settle_gcra(g, st, s, now);
                Some(g.full_at(st))
            }
            (Algorithm::SlidingLog(l), State::SlidingLog(st)) => {
                settle_log(l, st, s, now);
                Some(l.full_at(st))
            }
            _ => None,
        }
    }
}

/// gcra: the TAT moves by `delta × T`. A charge starts from the admission's own TAT at least
/// (`at + estimate × T`), a TAT already past (a full bucket, dropped or not) counting as none;
/// a refund takes from the TAT as it is (one at or before `now` is a full bucket, and stays
/// one).
pub fn settle_gcra(g: &Gcra, state: &mut GcraState, s: Settlement, now: Micros) {
    let t = g.emission_interval();
    let units = s.delta.unsigned_abs();
    if s.delta > 0 {
        let live = if state.tat > now { state.tat } else { 0 };
        let base = live.max(s.at.saturating_add(t.saturating_mul(s.estimate)));
        state.tat = base.saturating_add(t.saturating_mul(units));
    } else if state.tat > 0 {
        state.tat = state.tat.saturating_sub(t.saturating_mul(units));
    }
}

/// Sliding log: the request's entry (the units recorded at `at`) grows or shrinks by `delta`.
/// An entry no longer in the log has expired (`at + period <= now`): what it would have held
/// no longer counts either way, so nothing changes. A charge for an entry that should be live
/// but is not there (the clock stepped back at the commit) is recorded at `at`.
pub fn settle_log(l: &SlidingLog, state: &mut LogState, s: Settlement, now: Micros) {
    let units = s.delta.unsigned_abs();
    if units == 0 || s.at.saturating_add(l.quota().period) <= now {
        return;
    }
    let found = state.entries.binary_search_by_key(&s.at, |&(ts, _)| ts);
    match found {
        Ok(i) => {
            let cost = &mut state.entries[i].1;
            if s.delta > 0 {
                *cost = cost.saturating_add(units);
                state.sum = state.sum.saturating_add(units);
            } else {
                let back = units.min(*cost);
                *cost -= back;
                state.sum = state.sum.saturating_sub(back);
                if *cost == 0 {
                    state.entries.remove(i);
                }
            }
        }
        Err(i) if s.delta > 0 => {
            state.entries.insert(i, (s.at, units));
            state.sum = state.sum.saturating_add(units);
        }
        Err(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algorithm::Quota;
    use proptest::prelude::*;

    fn quota() -> Quota {
        Quota {
            count: 10,
            period: 1_000_000,
            burst: 5,
        }
    }

    #[test]
    fn a_debt_is_paid_before_the_next_request_and_its_retry_after_is_exact() {
        let alg = Algorithm::Gcra(Gcra::new(quota()));
        let mut st = alg.new_state();
        // Admitted at 0 on an estimate of 1; it really cost 8: 3 units beyond the burst.
        alg.commit(&mut st, 0, 1);
        let s = Settlement {
            at: 0,
            estimate: 1,
            delta: 7,
        };
        assert_eq!(alg.settle(&mut st, s, 50_000), Some(800_000));
        // T = 100ms, tau = 500ms: the next unit fits when the TAT is 400ms ahead, at 400ms.
        let r = alg.check(&st, 50_000, 1).unwrap_err();
        assert_eq!(r.retry_after, 350_000);
        assert!(alg.check(&st, 400_000, 1).is_ok());
        // A refund of the whole charge gives a full bucket back (and nothing more).
        let mut st = alg.new_state();
        alg.commit(&mut st, 0, 3);
        let back = Settlement {
            at: 0,
            estimate: 3,
            delta: -3,
        };
        alg.settle(&mut st, back, 10);
        assert_eq!(alg.peek(&st, 10).remaining, 5);
    }

    #[test]
    fn the_log_settles_the_requests_own_entry() {
        let l = SlidingLog::new(quota());
        let alg = Algorithm::SlidingLog(l.clone());
        let mut st = alg.new_state();
        alg.commit(&mut st, 100, 2);
        alg.commit(&mut st, 200, 2);
        let s = |at, delta| Settlement {
            at,
            estimate: 2,
            delta,
        };
        alg.settle(&mut st, s(100, 9), 300);
        // 11 + 2 live: 3 over; the entry at 100 (11 units) must expire: at 1_000_100.
        let r = alg.check(&st, 300, 1).unwrap_err();
        assert_eq!(r.retry_after, 1_000_100 - 300);
        alg.settle(&mut st, s(200, -2), 300);
        let log = |st: &State| match st {
            State::SlidingLog(log) => (log.entries.len(), log.sum),
            _ => unreachable!(),
        };
        assert_eq!(log(&st), (1, 11), "an entry refunded whole is gone");
        // An entry that expired takes nothing either way.
        alg.settle(&mut st, s(100, 5), 2_000_000);
        assert_eq!(log(&st), (1, 11));
    }

    /// One request of the sequence: the wait before it, its estimate, its true cost, and when
    /// in the gap before the next it settles (a fraction in thousandths).
    type Step = (u64, u64, u64, u64);

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        proptest::collection::vec((0..400_000u64, 1..4u64, 0..12u64, 0..1000u64), 1..80)
    }

    /// Admits and settles the sequence (each request settled before the next is admitted);
    /// returns per admitted request `(at, true cost, delta)`.
    fn run(alg: &Algorithm, steps: &[Step]) -> Vec<(Micros, u64, i64)> {
        let mut st = alg.new_state();
        let mut now = 0;
        let mut admitted = Vec::new();
        for w in 0..steps.len() {
            let (gap, estimate, cost, when) = steps[w];
            now += gap;
            if alg.check(&st, now, estimate).is_ok() {
                alg.commit(&mut st, now, estimate);
                let delta = cost as i64 - estimate as i64;
                let next_gap = steps.get(w + 1).map_or(0, |s| s.0);
                let settled_at = now + next_gap * when / 1000;
                let s = Settlement {
                    at: now,
                    estimate,
                    delta,
                };
                alg.settle(&mut st, s, settled_at);
                admitted.push((now, cost, delta));
            }
        }
        admitted
    }

    /// The largest true cost of the requests admitted in any window `[t, t + span]` (`closed`)
    /// or `[t, t + span)`, minus the window's largest positive settlement, as the bound must
    /// hold it.
    fn worst(admitted: &[(Micros, u64, i64)], span: Micros, closed: bool) -> u64 {
        let mut worst = 0;
        for (i, &(t0, ..)) in admitted.iter().enumerate() {
            let inside = admitted[i..].iter().take_while(|&&(t, ..)| {
                if closed {
                    t <= t0 + span
                } else {
                    t < t0 + span
                }
            });
            let total: u64 = inside.clone().map(|&(_, c, _)| c).sum();
            let largest = inside.map(|&(.., d)| d.max(0) as u64).max().unwrap_or(0);
            worst = worst.max(total.saturating_sub(largest));
        }
        worst
    }

    proptest! {
        /// gcra: at most `burst + floor(period / T)` (its bound) plus the window's largest
        /// settlement, in any closed window of a period.
        #[test]
        fn gcra_admits_no_more_true_cost_than_its_bound_plus_one_settlement(steps in steps()) {
            let g = Gcra::new(quota());
            let bound = quota().burst + quota().period / g.emission_interval();
            let admitted = run(&Algorithm::Gcra(g), &steps);
            prop_assert!(worst(&admitted, quota().period, true) <= bound);
        }

        /// The sliding log: at most `count` plus the window's largest settlement in any
        /// half-open window of a period.
        #[test]
        fn the_log_admits_no_more_true_cost_than_its_count_plus_one_settlement(steps in steps()) {
            let admitted = run(&Algorithm::SlidingLog(SlidingLog::new(quota())), &steps);
            prop_assert!(worst(&admitted, quota().period, false) <= quota().count);
        }
    }
}
