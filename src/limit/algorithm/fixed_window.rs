//! Fixed window: one counter per key for the window holding `now`: by default the aligned
//! `[now - now % period, + period)`, with `align: calendar` a civil day, week or month of a
//! time zone ([`Calendar`]). The cheapest algorithm, and the one whose reset instant is the
//! same for every key.
//!
//! Bound: at most `count` units inside one window, hence at most `2 × count` in any interval
//! of one window's length (the end of one window and the start of the next). A calendar day
//! of 23 hours admits the same `count` as one of 25.

use std::sync::Arc;

use super::calendar::Calendar;
use super::{Micros, Quota, Rejection, Snapshot};

/// The window the counter belongs to travels with it, so a stale counter is recognised (and
/// read as 0) without a timer to reset it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WindowState {
    /// Start of the window `count` was taken in.
    pub start: Micros,
    /// Units admitted in that window.
    pub count: u64,
}

/// Where windows start and end: the window function the algorithm is built with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Windows {
    /// Multiples of `period` since the clock's epoch (1970 UTC): a `1m` window at every whole
    /// minute, a `1d` one at midnight UTC. Integer arithmetic only.
    Epoch {
        /// The period in microseconds, kept > 0 so `now % period` cannot panic on a bad value.
        period: Micros,
    },
    /// Civil days, weeks or months of a time zone (shared: clones of one limit's algorithm
    /// share its cache of the current window).
    Calendar(Arc<Calendar>),
}

/// Fixed window: at most `count` units in each window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FixedWindow {
    quota: Quota,
    windows: Windows,
}

impl FixedWindow {
    /// The fixed window for `quota` (`burst` is not used), on windows aligned to the epoch.
    pub fn new(quota: Quota) -> Self {
        Self {
            quota,
            windows: Windows::Epoch {
                period: quota.period.max(1),
            },
        }
    }

    /// The fixed window for `quota` on `calendar`'s windows; `quota.period` is their nominal
    /// length (see [`super::calendar::Unit::nominal`]), which nothing here computes with.
    pub fn calendar(quota: Quota, calendar: Calendar) -> Self {
        Self {
            quota,
            windows: Windows::Calendar(Arc::new(calendar)),
        }
    }

    /// The calendar the windows follow, if they are calendar windows.
    pub fn calendar_windows(&self) -> Option<&Calendar> {
        match &self.windows {
            Windows::Epoch { .. } => None,
            Windows::Calendar(c) => Some(c),
        }
    }

    /// The quota this was built from.
    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// The state of a fresh key: nothing counted.
    pub fn new_state(&self) -> WindowState {
        WindowState::default()
    }

    /// `(window start, time left in the window)`; for epoch windows the latter is
    /// `ws + P - now` written so that it cannot overflow. Also what a settlement finds the
    /// current window with (`settle.rs`).
    #[inline]
    pub(super) fn window(&self, now: Micros) -> (Micros, Micros) {
        match &self.windows {
            Windows::Epoch { period } => {
                let into = now % period;
                (now - into, period - into)
            }
            Windows::Calendar(c) => {
                let (start, end) = c.window_at(now);
                (start, end.saturating_sub(now))
            }
        }
    }

    /// Units counted in the window that contains `now`.
    fn counted(&self, state: &WindowState, now: Micros) -> u64 {
        if state.start == self.window(now).0 {
            state.count
        } else {
            0
        }
    }

    /// Admits while the current window's count plus `cost` stays within `count`; a rejection
    /// waits for the window's end. See [`Algorithm::check`](super::Algorithm::check).
    #[inline]
    pub fn check(
        &self,
        state: &WindowState,
        now: Micros,
        cost: u64,
    ) -> Result<Snapshot, Rejection> {
        let (_, to_end) = self.window(now);
        let c = self.counted(state, now);
        let limit = self.quota.count;
        match c.checked_add(cost) {
            Some(after) if after <= limit => Ok(Snapshot {
                remaining: limit - after,
                // Equal to peek() after the commit: a cost-0 request on an empty window
                // leaves nothing to reset.
                reset_after: if after > 0 { to_end } else { 0 },
            }),
            _ => Err(Rejection {
                retry_after: to_end,
                remaining: limit.saturating_sub(c),
                reset_after: to_end,
            }),
        }
    }

    /// Adds `cost` to the window containing `now`, starting a new count when the window has
    /// moved on.
    #[inline]
    pub fn commit(&self, state: &mut WindowState, now: Micros, cost: u64) {
        let (ws, _) = self.window(now);
        if state.start != ws {
            *state = WindowState {
                start: ws,
                count: 0,
            };
        }
        state.count = state.count.saturating_add(cost);
    }

    /// Units left in the window containing `now`, and the time to its end (0 when it counts
    /// nothing).
    pub fn peek(&self, state: &WindowState, now: Micros) -> Snapshot {
        let c = self.counted(state, now);
        Snapshot {
            remaining: self.quota.count.saturating_sub(c),
            reset_after: if c > 0 { self.window(now).1 } else { 0 },
        }
    }

    /// The end of the counted window (0 when nothing is counted).
    #[inline]
    pub fn full_at(&self, state: &WindowState) -> Micros {
        if state.count == 0 {
            return 0;
        }
        match &self.windows {
            Windows::Epoch { period } => state.start.saturating_add(*period),
            Windows::Calendar(c) => c.end_of(state.start),
        }
    }

    /// `count`: a window never admits more.
    pub fn max_cost(&self) -> u64 {
        self.quota.count
    }

    /// Always `false`: see [`FixedWindow::reserve`].
    pub fn can_reserve(&self) -> bool {
        false
    }

    /// No reservations: a window's capacity is not ordered in time, so there is no slot to
    /// hold. Behaves as [`FixedWindow::check`] with no delay.
    pub fn reserve(
        &self,
        state: &WindowState,
        now: Micros,
        cost: u64,
        _max_delay: Micros,
    ) -> Result<(Snapshot, Micros), Rejection> {
        self.check(state, now, cost).map(|snapshot| (snapshot, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::super::calendar::Unit;
    use super::super::testkit::{self, Event};
    use super::super::{Algorithm, Quota, Rejection, Snapshot};
    use super::*;
    use proptest::prelude::*;

    /// 3 per 1000µs.
    fn three_per_ms() -> FixedWindow {
        FixedWindow::new(Quota {
            count: 3,
            period: 1000,
            burst: 3,
        })
    }

    fn take(f: &FixedWindow, s: &mut WindowState, now: Micros, cost: u64) -> Snapshot {
        let snapshot = f.check(s, now, cost).expect("admitted");
        f.commit(s, now, cost);
        snapshot
    }

    #[test]
    fn fresh_key_admits_count_then_rejects_until_the_boundary() {
        let f = three_per_ms();
        let mut s = f.new_state();
        for i in 1..=3 {
            assert_eq!(
                take(&f, &mut s, 2500, 1),
                Snapshot {
                    remaining: 3 - i,
                    reset_after: 500,
                }
            );
        }
        assert_eq!(
            f.check(&s, 2500, 1),
            Err(Rejection {
                retry_after: 500,
                remaining: 0,
                reset_after: 500,
            })
        );
        assert_eq!(f.check(&s, 2999, 1).unwrap_err().retry_after, 1);
        assert_eq!(
            take(&f, &mut s, 3000, 1),
            Snapshot {
                remaining: 2,
                reset_after: 1000,
            }
        );
        assert_eq!(
            s,
            WindowState {
                start: 3000,
                count: 1,
            }
        );
    }

    #[test]
    fn cost_above_one_and_boundary_burst() {
        let f = three_per_ms();
        let mut s = f.new_state();
        take(&f, &mut s, 1999, 2);
        assert_eq!(
            f.check(&s, 1999, 2),
            Err(Rejection {
                retry_after: 1,
                remaining: 1,
                reset_after: 1,
            })
        );
        // The next window is empty: 2 + 3 units within 2µs, the 2 × count boundary case.
        assert_eq!(take(&f, &mut s, 2000, 3).remaining, 0);
        assert!(f.check(&f.new_state(), 0, 4).is_err());
    }

    #[test]
    fn check_never_mutates_peek_and_full_at() {
        let f = three_per_ms();
        let s = WindowState {
            start: 4000,
            count: 2,
        };
        let before = s;
        assert!(f.check(&s, 4100, 1).is_ok());
        assert_eq!(s, before);
        assert_eq!(
            f.peek(&s, 4100),
            Snapshot {
                remaining: 1,
                reset_after: 900,
            }
        );
        assert_eq!(f.full_at(&s), 5000);
        let fresh = f.new_state();
        assert_eq!(
            f.peek(&fresh, 4100),
            Snapshot {
                remaining: 3,
                reset_after: 0
            }
        );
        for now in [5000, 5001, 99_999] {
            assert_eq!(f.peek(&s, now), f.peek(&fresh, now));
            for cost in 0..=4 {
                assert_eq!(f.check(&s, now, cost), f.check(&fresh, now, cost));
            }
        }
        assert_ne!(f.peek(&s, 4999), f.peek(&fresh, 4999));
        assert_eq!(
            f.full_at(&WindowState {
                start: 4000,
                count: 0
            }),
            0
        );
    }

    #[test]
    fn reserve_is_check_without_delay() {
        let f = three_per_ms();
        let s = WindowState { start: 0, count: 3 };
        assert!(!f.can_reserve());
        assert_eq!(
            f.reserve(&s, 10, 1, u64::MAX),
            Err(f.check(&s, 10, 1).unwrap_err())
        );
        assert_eq!(
            f.reserve(&s, 1000, 1, 0),
            Ok((f.check(&s, 1000, 1).unwrap(), 0))
        );
    }

    #[test]
    fn extreme_inputs_do_not_panic() {
        for (count, period) in [(u64::MAX, u64::MAX), (1, u64::MAX), (0, 0), (u64::MAX, 1)] {
            let f = FixedWindow::new(Quota {
                count,
                period,
                burst: 1,
            });
            let mut s = WindowState {
                start: u64::MAX,
                count: u64::MAX,
            };
            for now in [0, 1, u64::MAX - 1, u64::MAX] {
                for cost in [0, 1, u64::MAX] {
                    let _ = f.check(&s, now, cost);
                    let _ = f.peek(&s, now);
                    let _ = f.full_at(&s);
                    f.commit(&mut s, now, cost);
                }
            }
        }
    }

    fn case() -> impl Strategy<Value = (Quota, Vec<Event>)> {
        testkit::quota().prop_flat_map(|q| (Just(q), testkit::timeline(q, q.count)))
    }

    fn calendar(unit: Unit, tz: &str, count: u64) -> FixedWindow {
        FixedWindow::calendar(
            Quota {
                count,
                period: unit.nominal(),
                burst: count,
            },
            Calendar::new(unit, jiff::tz::TimeZone::get(tz).unwrap()),
        )
    }

    /// 2024-03-31 00:00 Europe/Berlin (22:00 UTC the day before), a 23-hour day.
    const BERLIN_SPRING: Micros = 1_711_839_600_000_000;
    const HOUR: Micros = 3_600_000_000;

    #[test]
    fn a_calendar_day_admits_count_and_retry_after_is_the_next_local_midnight() {
        let f = calendar(Unit::Day, "Europe/Berlin", 2);
        let mut s = f.new_state();
        let noon = BERLIN_SPRING + 11 * HOUR; // 12:00 CEST: 11 hours since midnight CET
        assert_eq!(take(&f, &mut s, noon, 2).reset_after, 12 * HOUR);
        assert_eq!(
            f.check(&s, noon, 1),
            Err(Rejection {
                retry_after: 12 * HOUR,
                remaining: 0,
                reset_after: 12 * HOUR,
            })
        );
        assert_eq!(s.start, BERLIN_SPRING);
        // The window of 23 hours ends at the next midnight, where the key is full again.
        assert_eq!(f.full_at(&s), BERLIN_SPRING + 23 * HOUR);
        assert_eq!(take(&f, &mut s, BERLIN_SPRING + 23 * HOUR, 1).remaining, 1);
        assert_eq!(f.full_at(&s), BERLIN_SPRING + 47 * HOUR);
    }

    fn zones() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "Europe/Berlin",
            "America/New_York",
            "Australia/Lord_Howe",
        ])
    }

    /// Timelines of hours to days around 2024's clock changes (spring and autumn both
    /// hemispheres), in days or months of the zone.
    fn calendar_case() -> impl Strategy<Value = (Unit, &'static str, u64, Vec<Event>)> {
        let unit = prop::sample::select(vec![Unit::Day, Unit::Month]);
        (unit, zones(), 1u64..=6).prop_flat_map(|(unit, tz, count)| {
            let start = prop_oneof![
                // 2024-03-01 .. 2024-04-15 and 2024-09-25 .. 2024-11-15 (UTC)
                1_709_251_200_000_000u64..=1_713_139_200_000_000,
                1_727_222_400_000_000u64..=1_731_628_800_000_000,
            ];
            let span = unit.nominal();
            let gap = prop_oneof![4 => 0..=HOUR, 3 => 0..=span / 4, 1 => 0..=span];
            let cost = prop_oneof![3 => Just(1u64), 1 => 1..=count];
            (
                Just(unit),
                Just(tz),
                Just(count),
                start,
                prop::collection::vec((gap, cost), 1..=80),
            )
                .prop_map(|(unit, tz, count, start, steps)| {
                    let mut now = start;
                    let events = steps
                        .into_iter()
                        .map(|(gap, cost)| {
                            now += gap;
                            (now, cost)
                        })
                        .collect();
                    (unit, tz, count, events)
                })
        })
    }

    proptest! {
        /// On calendar windows too: the per-decision contract (exact Retry-After and
        /// `full_at`), at most `count` per window, and `2 × count` in any interval no longer
        /// than the shortest window the timeline crossed.
        #[test]
        fn prop_calendar_bound_retry_after_and_eviction((unit, tz, count, events) in calendar_case()) {
            let f = calendar(unit, tz, count);
            let cal = f.calendar_windows().unwrap();
            let admitted = testkit::simulate(&Algorithm::FixedWindow(f.clone()), &events);
            let mut per_window = std::collections::BTreeMap::new();
            let mut shortest = Micros::MAX;
            for &(t, cost) in &admitted {
                let (s, e) = cal.window_at(t);
                shortest = shortest.min(e - s);
                *per_window.entry(s).or_insert(0) += cost;
            }
            for (s, n) in per_window {
                prop_assert!(n <= count, "{n} in the window from {s}, count {count}");
            }
            let most = testkit::max_in_interval(&admitted, shortest, false);
            prop_assert!(most <= 2 * count, "{most} in {shortest} µs, count {count}");
        }

        #[test]
        fn prop_bound_retry_after_and_eviction((q, events) in case()) {
            let admitted = testkit::simulate(&Algorithm::FixedWindow(FixedWindow::new(q)), &events);
            let per_window = testkit::max_per_window(&admitted, q.period);
            prop_assert!(per_window <= q.count, "{per_window} in one window, count {}", q.count);
            let most = testkit::max_in_interval(&admitted, q.period, true);
            prop_assert!(most <= 2 * q.count, "{most} in a closed period, count {}", q.count);
        }
    }
}
