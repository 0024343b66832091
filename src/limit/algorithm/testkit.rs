//! Property-test harness shared by the four algorithms: random quotas and timelines, a
//! driver that checks the per-decision contract on every step (check is read-only, a
//! rejection's Retry-After is exact and minimal, `full_at` is exact, an admission's snapshot
//! is the committed state's peek), and the interval counts each algorithm bounds.

use proptest::prelude::*;

use super::{Algorithm, Micros, Quota, Rejection, State};

/// `(now, cost)` of a request, or of an admission in a driver's result.
pub(super) type Event = (Micros, u64);

/// Retry-After values up to this are compared with a scan of every earlier instant.
const SCAN: Micros = 2_000;

/// A realistic epoch (µs since 1970) so large timestamps are exercised too.
const EPOCH: Micros = 1_700_000_000_000_000;

pub(super) fn quota() -> impl Strategy<Value = Quota> {
    (1u64..=20, prop_oneof![1u64..=50, 1u64..=10_000], 1u64..=20).prop_map(
        |(count, period, burst)| Quota {
            count,
            period,
            burst,
        },
    )
}

/// Sorted arrivals that mostly come faster than the limit allows, with the odd pause of up
/// to three periods, and several requests at the same instant.
pub(super) fn timeline(q: Quota, max_cost: u64) -> impl Strategy<Value = Vec<Event>> {
    let p = q.period;
    let slot = (p / q.count).max(1);
    let gap = prop_oneof![4 => 0..=slot, 3 => 0..=p, 1 => 0..=3 * p];
    let cost = prop_oneof![3 => Just(1u64), 1 => 1..=max_cost.max(1)];
    let start = prop_oneof![0..=3 * p, EPOCH..=EPOCH + 3 * p];
    (start, prop::collection::vec((gap, cost), 1..=120)).prop_map(|(start, steps)| {
        let mut now = start;
        steps
            .into_iter()
            .map(|(gap, cost)| {
                now += gap;
                (now, cost)
            })
            .collect()
    })
}

/// Checks and commits every event in order, asserting the per-decision contract, and
/// returns the admitted events.
pub(super) fn simulate(alg: &Algorithm, events: &[Event]) -> Vec<Event> {
    let mut state = alg.new_state();
    let mut admitted = Vec::new();
    for &(now, cost) in events {
        assert_full_at_is_exact(alg, &state, now, cost);
        let before = state.clone();
        let decision = alg.check(&state, now, cost);
        assert_eq!(state, before, "check mutated the state");
        assert!(alg.check(&state, now, alg.max_cost() + 1).is_err());
        if !alg.can_reserve() {
            assert_eq!(
                alg.reserve(&state, now, cost, Micros::MAX),
                decision.map(|snapshot| (snapshot, 0))
            );
        }
        match decision {
            Ok(snapshot) => {
                alg.commit(&mut state, now, cost);
                assert_eq!(alg.peek(&state, now), snapshot, "admitted at {now}");
                admitted.push((now, cost));
            }
            Err(rejection) => assert_rejection(alg, &state, now, cost, &rejection),
        }
    }
    admitted
}

/// Like [`simulate`] with `reserve`: returns each admitted event at the instant it is
/// released (`now + delay`).
pub(super) fn simulate_reserve(alg: &Algorithm, events: &[Event], max_delay: Micros) -> Vec<Event> {
    let mut state = alg.new_state();
    let mut released = Vec::new();
    for &(now, cost) in events {
        let checked = alg.check(&state, now, cost);
        let reserved = alg.reserve(&state, now, cost, max_delay);
        let (snapshot, delay) = match (checked, reserved) {
            (Ok(snapshot), reserved) => {
                assert_eq!(reserved, Ok((snapshot, 0)));
                (snapshot, 0)
            }
            (Err(rejection), Ok((snapshot, delay))) => {
                assert_eq!(delay, rejection.retry_after, "delay is check's Retry-After");
                assert!(delay <= max_delay);
                assert_eq!(snapshot.remaining, 0);
                (snapshot, delay)
            }
            (Err(rejection), Err(again)) => {
                assert!(rejection.retry_after > max_delay);
                if alg.can_reserve() && max_delay > 0 && cost <= alg.max_cost() {
                    // A delay limit's Retry-After: when the same request is admitted, with a
                    // wait of up to max_delay; exact to the µs.
                    let r = rejection.retry_after - max_delay;
                    assert_eq!(
                        again,
                        Rejection {
                            retry_after: r,
                            ..rejection
                        }
                    );
                    assert!(alg.reserve(&state, now + r, cost, max_delay).is_ok());
                    assert!(alg.reserve(&state, now + r - 1, cost, max_delay).is_err());
                } else {
                    assert_eq!(again, rejection);
                }
                assert_rejection(alg, &state, now, cost, &rejection);
                continue;
            }
        };
        alg.commit(&mut state, now, cost);
        assert_eq!(alg.peek(&state, now), snapshot, "reserved at {now}");
        released.push((now + delay, cost));
    }
    released
}

fn assert_rejection(alg: &Algorithm, state: &State, now: Micros, cost: u64, r: &Rejection) {
    let d = r.retry_after;
    assert!(d > 0, "Retry-After 0 at {now}");
    assert!(r.remaining < cost);
    let peek = alg.peek(state, now);
    assert_eq!(
        (r.remaining, r.reset_after),
        (peek.remaining, peek.reset_after)
    );
    assert!(
        alg.check(state, now + d, cost).is_ok(),
        "not admitted Retry-After ({d}) later: {state:?} at {now}, cost {cost}"
    );
    if d > 1 {
        assert!(
            alg.check(state, now + d - 1, cost).is_err(),
            "admitted before Retry-After ({d}): {state:?} at {now}, cost {cost}"
        );
    }
    if d <= SCAN {
        for k in 1..d {
            assert!(
                alg.check(state, now + k, cost).is_err(),
                "admitted {k} into Retry-After {d}: {state:?} at {now}, cost {cost}"
            );
        }
    }
}

/// From `full_at` on the state decides like a fresh one, and just before it (if that is not
/// in the past) it does not, so eviction is neither early nor needlessly late.
fn assert_full_at_is_exact(alg: &Algorithm, state: &State, now: Micros, cost: u64) {
    let fresh = alg.new_state();
    let full_at = alg.full_at(state);
    let from = full_at.max(now);
    for t in [from, from + 1, from + alg.quota().period] {
        assert_eq!(alg.peek(state, t), alg.peek(&fresh, t), "{state:?} at {t}");
        assert_eq!(alg.check(state, t, cost), alg.check(&fresh, t, cost));
        assert_eq!(
            alg.reserve(state, t, cost, Micros::MAX),
            alg.reserve(&fresh, t, cost, Micros::MAX)
        );
        let (mut a, mut b) = (state.clone(), fresh.clone());
        alg.commit(&mut a, t, cost);
        alg.commit(&mut b, t, cost);
        assert_eq!(a, b, "commit on an evictable state at {t}");
    }
    if full_at > now {
        assert_ne!(
            alg.peek(state, full_at - 1),
            alg.peek(&fresh, full_at - 1),
            "{state:?} already full before full_at"
        );
    }
}

/// The most units in one interval `[t, t + len]` (closed) or `[t, t + len)`; `events` must
/// be in time order, which the drivers' results are.
pub(super) fn max_in_interval(events: &[Event], len: Micros, closed: bool) -> u64 {
    assert!(
        events.windows(2).all(|w| w[0].0 <= w[1].0),
        "not in time order"
    );
    let (mut best, mut sum, mut end) = (0, 0, 0);
    for &(t, cost) in events {
        while end < events.len()
            && (events[end].0 < t + len || (closed && events[end].0 == t + len))
        {
            sum += events[end].1;
            end += 1;
        }
        best = best.max(sum);
        sum -= cost;
    }
    best
}

/// The most units in one aligned window `[k × period, (k + 1) × period)`.
pub(super) fn max_per_window(events: &[Event], period: Micros) -> u64 {
    let mut best = 0;
    let mut current = (Micros::MAX, 0);
    for &(t, cost) in events {
        let window = t / period;
        if window != current.0 {
            current = (window, 0);
        }
        current.1 += cost;
        best = best.max(current.1);
    }
    best
}

#[test]
fn interval_counts() {
    let events = [(0, 1), (5, 2), (10, 3), (15, 1)];
    assert_eq!(max_in_interval(&events, 10, true), 6);
    assert_eq!(max_in_interval(&events, 10, false), 5);
    assert_eq!(max_per_window(&events, 10), 4);
    assert_eq!(max_in_interval(&[], 10, true), 0);
}
