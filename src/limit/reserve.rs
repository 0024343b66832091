//! `reserve_ahead`: how a rate's reservations are sized, and what their decisions are made
//! against. The units themselves are held in the in-process tier's entry for the key
//! (`local/deny.rs`), and taken in Redis by `reserve.lua`.
//!
//! Why it is strict: a reservation's units are spent no later than `ahead` after its call was
//! sent, and so after Redis took them and at most `ahead` after. Every decision on the key (a
//! reservation, or a per-request decision when a reservation could not be made) is made
//! against the rate's burst less `given_up = ceil(ahead / T)` units. In any interval `[s, t]`,
//! the units spent were taken within `[s - ahead, t]`, at most `burst - given_up +
//! (t - s + ahead) / T` of them, which is within the rate's own bound of `burst + (t - s) / T`.

use std::time::Duration;

use super::algorithm::{Algorithm, Gcra, Micros, Quota};

/// One rate's reservations.
#[derive(Debug)]
pub struct Reserve {
    /// The rate's gcra, its burst reduced by `given_up`: what every decision on a key of this
    /// rate is made against.
    pub algorithm: Algorithm,
    /// How long a reservation's units may be spent, counted from when its call was sent (µs).
    pub ahead: Micros,
    /// The most units one reservation takes: the burst given up (more would outlive
    /// `ahead` at the full rate), and at most half of what is left.
    pub max_units: u64,
}

/// What the last reservation of a key did: how it sizes the next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sizing {
    /// Units the last reservation granted (0: none yet, or forgotten).
    pub granted: u64,
    /// Units spent from it.
    pub spent: u64,
    /// Time since it was sent (µs).
    pub elapsed: Micros,
}

impl Reserve {
    /// Reservations for a gcra rate of `quota` whose requests cost `cost`: `None` when the
    /// burst left would not admit one request (config validation refuses that for the limit's
    /// own rate; an override's rate is then decided per request, against its full burst).
    pub fn new(quota: Quota, ahead: Duration, cost: u64) -> Option<Self> {
        let ahead = u64::try_from(ahead.as_micros()).unwrap_or(u64::MAX);
        let interval = Gcra::new(quota).emission_interval();
        let given_up = ahead.div_ceil(interval);
        let burst = quota
            .burst
            .checked_sub(given_up)
            .filter(|&b| b >= cost.max(1))?;
        Some(Self {
            algorithm: Algorithm::Gcra(Gcra::new(Quota { burst, ..quota })),
            ahead,
            max_units: given_up.min(burst / 2).max(cost),
        })
    }

    /// Units to ask for: the request's `cost` for a key with no reservation yet; then what the
    /// key spent at the rate it spent the last one, over half a reservation's life (the other
    /// half is margin before its units expire), at most twice the last (a key warms up as TCP's
    /// slow start does, so a key that is merely busy does not take units it will not spend),
    /// and at most `max_units`.
    pub fn want(&self, cost: u64, last: Sizing) -> u64 {
        if last.granted == 0 {
            return cost;
        }
        let per_half_life =
            u128::from(last.spent) * u128::from(self.ahead / 2) / u128::from(last.elapsed.max(1));
        let at_rate = u64::try_from(per_half_life).unwrap_or(u64::MAX);
        at_rate
            .min(last.granted.saturating_mul(2))
            .min(self.max_units)
            .max(cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Micros = 1_000_000;

    fn thousand_per_second(burst: u64) -> Quota {
        Quota {
            count: 1000,
            period: SECOND,
            burst,
        }
    }

    #[test]
    fn the_burst_given_up_is_the_units_of_one_reservation_life() {
        // T = 1 ms: 100 ms of reservation gives up 100 units of 1000.
        let r =
            Reserve::new(thousand_per_second(1000), Duration::from_millis(100), 1).expect("fits");
        let Algorithm::Gcra(g) = &r.algorithm else {
            panic!("gcra")
        };
        assert_eq!(g.quota().burst, 900);
        assert_eq!(r.max_units, 100);
        // Burst 100 less 100 leaves nothing: no reservations.
        assert!(Reserve::new(thousand_per_second(100), Duration::from_millis(100), 1).is_none());
        // 150 less 100 leaves 50: a cost of 50 fits, 51 does not.
        assert!(Reserve::new(thousand_per_second(150), Duration::from_millis(100), 50).is_some());
        assert!(Reserve::new(thousand_per_second(150), Duration::from_millis(100), 51).is_none());
    }

    #[test]
    fn a_reservation_starts_at_the_cost_doubles_while_spent_fast_and_follows_the_rate() {
        let r = Reserve::new(thousand_per_second(100_000), Duration::from_millis(100), 2)
            .expect("fits");
        assert_eq!(r.max_units, 100);
        assert_eq!(r.want(2, Sizing::default()), 2);
        let last = |granted, spent, elapsed| Sizing {
            granted,
            spent,
            elapsed,
        };
        // 4 spent in 10 µs: as fast as can be, but twice the last at most.
        assert_eq!(r.want(2, last(4, 4, 10)), 8);
        // 40 spent in 100 ms: 20 per half life.
        assert_eq!(r.want(2, last(40, 40, 100_000)), 20);
        // Never above max_units, never below the cost.
        assert_eq!(r.want(2, last(1000, 1000, 1)), 100);
        assert_eq!(r.want(2, last(40, 1, 10 * SECOND)), 2);
    }
}
