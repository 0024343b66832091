//! Calendar windows (`fixed_window` with `align: calendar`): a day from local midnight, a week
//! from Monday 00:00, a month from the 1st at 00:00, in one IANA time zone's civil time.
//!
//! Such windows have no fixed length: a day is 23 or 25 hours when the zone changes its clocks,
//! a month 28 to 31 days. So a window is not `now - now % period` but found with `jiff` from
//! the zone's rules: the civil date of `now`, the first date of its unit, and the instants
//! those dates start at. That costs a time zone lookup or three, so the bounds of the current
//! window (and of its neighbours, which a global limit sends Redis) are kept in a cache that
//! every request reads and only a request in another window replaces: once a day, week or
//! month, jiff is asked again.
//!
//! Windows tile time: each starts where the one before ends, and every instant is in exactly
//! one ([`Calendar::window_at`] always returns `start <= now < end`, tests check it across the
//! daylight-saving changes of several zones).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use jiff::civil::{Date, Time, Weekday};
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

use super::Micros;

/// Microseconds in a day of 24 hours.
const DAY: Micros = 86_400_000_000;

/// The calendar unit of a window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    /// From local midnight to the next (`1d`).
    Day,
    /// From Monday 00:00 to the next Monday 00:00 (`1w`, ISO 8601 weeks).
    Week,
    /// From the 1st at 00:00 to the 1st of the next month (`1mo`).
    Month,
}

impl Unit {
    /// The window's length in a zone without clock changes, and for a month 30 days: what
    /// `RateLimit-Policy`'s `w` says (one constant per limit, as the field is written once).
    pub fn nominal(self) -> Micros {
        match self {
            Unit::Day => DAY,
            Unit::Week => 7 * DAY,
            Unit::Month => 30 * DAY,
        }
    }

    /// The first date of the unit holding `d`.
    fn floor(self, d: Date) -> Option<Date> {
        match self {
            Unit::Day => Some(d),
            Unit::Week => {
                let back = Weekday::Monday.until(d.weekday());
                d.checked_sub(i64::from(back).days()).ok()
            }
            Unit::Month => Some(d.first_of_month()),
        }
    }

    /// The first date of the unit after the one that starts on `d` (a [`Unit::floor`]).
    fn next(self, d: Date) -> Option<Date> {
        match self {
            Unit::Day => d.tomorrow().ok(),
            Unit::Week => d.checked_add(7.days()).ok(),
            Unit::Month => d.checked_add(1.month()).ok(),
        }
    }

    /// The first date of the unit before the one that starts on `d` (a [`Unit::floor`]).
    fn prev(self, d: Date) -> Option<Date> {
        match self {
            Unit::Day => d.yesterday().ok(),
            Unit::Week => d.checked_sub(7.days()).ok(),
            Unit::Month => d.checked_sub(1.month()).ok(),
        }
    }
}

/// The window holding an instant and its neighbours: `prev` is the start of the window before,
/// `[start, end)` the window, `next` the end of the window after. A global limit sends all
/// four, so Redis can take whichever of the three windows holds its own clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Start of the window before.
    pub prev: Micros,
    /// Start of the window.
    pub start: Micros,
    /// End of the window (start of the next), exclusive.
    pub end: Micros,
    /// End of the window after.
    pub next: Micros,
}

impl Bounds {
    /// Whether `now` falls in the window `[start, end)`.
    #[inline]
    fn holds(&self, now: Micros) -> bool {
        self.start <= now && now < self.end
    }
}

/// Calendar windows of one unit in one time zone, with the current window cached.
pub struct Calendar {
    unit: Unit,
    tz: TimeZone,
    /// The bounds around the last instant asked about; starts empty (`start == end`).
    cache: ArcSwap<Bounds>,
    /// The same window as `cache.start..cache.end`, packed into one word for the request path
    /// (one plain load, where `cache` costs a few atomic operations): the start in whole
    /// seconds in the upper 40 bits, the length in seconds in the lower 24. 0: none (a window
    /// that does not fit, as none of a real zone's before the year 36 000, is not packed).
    current: AtomicU64,
}

/// Bits of [`Calendar::current`] holding the window's length in seconds (194 days at most).
const LEN_BITS: u32 = 24;
const SECOND: Micros = 1_000_000;

/// `[start, end)` packed as [`Calendar::current`] holds it, if it fits.
fn pack(start: Micros, end: Micros) -> Option<u64> {
    let (s, len) = (start / SECOND, end.checked_sub(start)? / SECOND);
    let exact = start.is_multiple_of(SECOND) && end.is_multiple_of(SECOND);
    (exact && len > 0 && len < 1 << LEN_BITS && s < 1 << (64 - LEN_BITS))
        .then_some(s << LEN_BITS | len)
}

/// The window a non-zero [`Calendar::current`] holds.
#[inline]
fn unpack(packed: u64) -> (Micros, Micros) {
    let start = (packed >> LEN_BITS) * SECOND;
    (start, start + (packed & ((1 << LEN_BITS) - 1)) * SECOND)
}

impl Calendar {
    /// Windows of `unit` in the civil time of `tz`.
    pub fn new(unit: Unit, tz: TimeZone) -> Self {
        Self {
            unit,
            tz,
            cache: ArcSwap::from_pointee(Bounds {
                prev: 0,
                start: 0,
                end: 0,
                next: 0,
            }),
            current: AtomicU64::new(0),
        }
    }

    /// The unit of the windows.
    pub fn unit(&self) -> Unit {
        self.unit
    }

    /// The time zone whose civil time the windows follow.
    pub fn time_zone(&self) -> &TimeZone {
        &self.tz
    }

    /// The window `[start, end)` holding `now`: from the cache, or computed (and cached) when
    /// `now` is in another window.
    #[inline]
    pub fn window_at(&self, now: Micros) -> (Micros, Micros) {
        let packed = self.current.load(Ordering::Relaxed);
        if packed != 0 {
            let (start, end) = unpack(packed);
            if start <= now && now < end {
                return (start, end);
            }
        }
        let b = self.bounds(now);
        (b.start, b.end)
    }

    /// The window holding `now` and its neighbours (see [`Bounds`]), cached as
    /// [`Calendar::window_at`].
    pub fn bounds(&self, now: Micros) -> Bounds {
        let cached = **self.cache.load();
        if cached.holds(now) {
            return cached;
        }
        let fresh = self.compute_bounds(now);
        self.cache.store(Arc::new(fresh));
        self.current
            .store(pack(fresh.start, fresh.end).unwrap_or(0), Ordering::Relaxed);
        fresh
    }

    /// The end of the window that starts at `start` (the end of the one holding `start`
    /// when it is no window's start, as a corrupt state's could be).
    pub fn end_of(&self, start: Micros) -> Micros {
        let packed = self.current.load(Ordering::Relaxed);
        if packed != 0 && unpack(packed).0 == start {
            return unpack(packed).1;
        }
        let b = **self.cache.load();
        if start == b.start && b.start < b.end {
            b.end
        } else if start == b.prev && b.prev < b.start {
            b.start
        } else if start == b.end && b.end < b.next {
            b.next
        } else {
            self.compute(start).1
        }
    }

    /// [`Calendar::bounds`] without the cache.
    pub fn compute_bounds(&self, now: Micros) -> Bounds {
        let (start, end) = self.compute(now);
        let prev = match start.checked_sub(1) {
            Some(before) => self.compute(before).0,
            None => 0,
        };
        Bounds {
            prev: prev.min(start),
            start,
            end,
            next: self.compute(end).1.max(end),
        }
    }

    /// The window holding `now`, from the zone's rules. Beyond what jiff represents (after
    /// the year 9999) there are no calendar dates: every instant there is its own window of the
    /// nominal length, which keeps `start <= now < end` without a panic.
    fn compute(&self, now: Micros) -> (Micros, Micros) {
        self.civil_window(now)
            .filter(|&(s, e)| s <= now && now < e)
            .unwrap_or((now, now.saturating_add(self.unit.nominal())))
    }

    fn civil_window(&self, now: Micros) -> Option<(Micros, Micros)> {
        let ts = Timestamp::from_microsecond(i64::try_from(now).ok()?).ok()?;
        let mut first = self.unit.floor(self.tz.to_datetime(ts).date())?;
        let mut start = self.start_of(first)?;
        // Only a clock change across midnight can put `now` outside the window of its own
        // date: set back from 00:30 to 23:30, the day after has begun at the first 00:00 while
        // the clock reads the day before again. The window is then the one after; a midnight
        // skipped forward starts the day late (the first instant that exists), never early.
        if start > now {
            first = self.unit.prev(first)?;
            start = self.start_of(first)?;
        }
        let mut end = self.start_of(self.unit.next(first)?)?;
        if end <= now {
            first = self.unit.next(first)?;
            start = end;
            end = self.start_of(self.unit.next(first)?)?;
        }
        Some((start, end))
    }

    /// The instant `d` begins at: its 00:00, or, when the clocks skip midnight, the first
    /// instant of the day (jiff's "compatible" choice: after a gap; before a fold, the earlier
    /// of two midnights). Before 1970 it is 0, the clock's first instant.
    fn start_of(&self, d: Date) -> Option<Micros> {
        let ts = self.tz.to_timestamp(d.to_datetime(Time::midnight())).ok()?;
        Some(u64::try_from(ts.as_microsecond()).unwrap_or(0))
    }
}

impl std::fmt::Debug for Calendar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Calendar")
            .field("unit", &self.unit)
            .field("tz", &self.tz.iana_name().unwrap_or("?"))
            .finish()
    }
}

/// The same windows: the cache is a memo, not part of what a calendar is.
impl PartialEq for Calendar {
    fn eq(&self, other: &Self) -> bool {
        self.unit == other.unit && self.tz == other.tz
    }
}

impl Eq for Calendar {}

#[cfg(test)]
mod tests {
    use super::*;
    use jiff::civil::date;
    use proptest::prelude::*;

    use super::super::posix_zones::posix_zone;

    fn zone(name: &str) -> TimeZone {
        TimeZone::get(name).expect("zone in the tz database")
    }

    /// Microseconds of a civil time in `tz` (compatible disambiguation).
    fn at(tz: &str, y: i16, mo: i8, d: i8, h: i8, mi: i8) -> Micros {
        let ts = zone(tz)
            .to_timestamp(date(y, mo, d).at(h, mi, 0, 0))
            .unwrap();
        u64::try_from(ts.as_microsecond()).unwrap()
    }

    const HOUR: Micros = 3_600_000_000;

    #[test]
    fn a_berlin_day_is_23_hours_in_spring_and_25_in_autumn() {
        let c = Calendar::new(Unit::Day, zone("Europe/Berlin"));
        // 2024-03-31: 02:00 CET becomes 03:00 CEST.
        let spring = at("Europe/Berlin", 2024, 3, 31, 12, 0);
        let (s, e) = c.window_at(spring);
        assert_eq!(s, at("Europe/Berlin", 2024, 3, 31, 0, 0));
        assert_eq!(e, at("Europe/Berlin", 2024, 4, 1, 0, 0));
        assert_eq!(e - s, 23 * HOUR);
        // 2024-10-27: 03:00 CEST becomes 02:00 CET.
        let autumn = at("Europe/Berlin", 2024, 10, 27, 2, 30);
        let (s, e) = c.window_at(autumn);
        assert_eq!(s, at("Europe/Berlin", 2024, 10, 27, 0, 0));
        assert_eq!(e - s, 25 * HOUR);
        // An ordinary day, and midnight itself starts a window.
        let (s, e) = c.window_at(at("Europe/Berlin", 2024, 6, 1, 0, 0));
        assert_eq!(
            (s, e - s),
            (at("Europe/Berlin", 2024, 6, 1, 0, 0), 24 * HOUR)
        );
        // Midnight Berlin is 22:00 or 23:00 UTC the day before.
        assert_eq!(s % DAY, 22 * HOUR);
    }

    #[test]
    fn new_york_days_follow_its_own_changes() {
        let c = Calendar::new(Unit::Day, zone("America/New_York"));
        // 2024-03-10 02:00 EST -> 03:00 EDT; 2024-11-03 02:00 EDT -> 01:00 EST.
        let (s, e) = c.window_at(at("America/New_York", 2024, 3, 10, 23, 59));
        assert_eq!(e - s, 23 * HOUR);
        let (s, e) = c.window_at(at("America/New_York", 2024, 11, 3, 1, 30));
        assert_eq!(e - s, 25 * HOUR);
        assert_eq!(s, at("America/New_York", 2024, 11, 3, 0, 0));
        // The Berlin spring day is an ordinary one in New York (its change was 3 weeks before).
        let (s, e) = c.window_at(at("Europe/Berlin", 2024, 3, 31, 12, 0));
        assert_eq!(e - s, 24 * HOUR);
    }

    #[test]
    fn a_week_starts_on_monday_at_local_midnight() {
        let c = Calendar::new(Unit::Week, zone("Europe/Berlin"));
        // Wednesday 2024-06-12 -> Monday 2024-06-10 .. Monday 2024-06-17.
        let (s, e) = c.window_at(at("Europe/Berlin", 2024, 6, 12, 15, 0));
        assert_eq!(s, at("Europe/Berlin", 2024, 6, 10, 0, 0));
        assert_eq!(e, at("Europe/Berlin", 2024, 6, 17, 0, 0));
        // Sunday 23:59 is still that week; Monday 00:00 the next.
        let sunday = at("Europe/Berlin", 2024, 6, 16, 23, 59);
        assert_eq!(c.window_at(sunday).0, s);
        assert_eq!(c.window_at(e).0, e);
        // The week holding the autumn change has 7 × 24 + 1 hours.
        let (s, e) = c.window_at(at("Europe/Berlin", 2024, 10, 27, 12, 0));
        assert_eq!(s, at("Europe/Berlin", 2024, 10, 21, 0, 0));
        assert_eq!(e - s, 169 * HOUR);
    }

    #[test]
    fn months_start_on_the_first_including_february_of_a_leap_year() {
        let c = Calendar::new(Unit::Month, zone("UTC"));
        let (s, e) = c.window_at(at("UTC", 2024, 2, 29, 23, 59));
        assert_eq!(s, at("UTC", 2024, 2, 1, 0, 0));
        assert_eq!(e, at("UTC", 2024, 3, 1, 0, 0));
        assert_eq!(e - s, 29 * DAY);
        let (s, e) = c.window_at(at("UTC", 2023, 2, 14, 0, 0));
        assert_eq!(e - s, 28 * DAY);
        // December runs into the next year.
        let (s, e) = c.window_at(at("UTC", 2024, 12, 31, 12, 0));
        assert_eq!(
            (s, e),
            (at("UTC", 2024, 12, 1, 0, 0), at("UTC", 2025, 1, 1, 0, 0))
        );
    }

    #[test]
    fn a_month_across_a_clock_change_is_an_hour_short_or_long() {
        let c = Calendar::new(Unit::Month, zone("Europe/Berlin"));
        // March 2024: 31 days less the hour of the spring change.
        let (s, e) = c.window_at(at("Europe/Berlin", 2024, 3, 20, 0, 0));
        assert_eq!(s, at("Europe/Berlin", 2024, 3, 1, 0, 0));
        assert_eq!(e - s, 31 * DAY - HOUR);
        // October: 31 days and the hour given back.
        let (s, e) = c.window_at(at("Europe/Berlin", 2024, 10, 31, 23, 0));
        assert_eq!(e - s, 31 * DAY + HOUR);
        // The month starts at local midnight in winter (23:00 UTC) and summer (22:00 UTC).
        assert_eq!(s % DAY, 22 * HOUR);
        assert_eq!(e % DAY, 23 * HOUR);
    }

    #[test]
    fn a_skipped_midnight_starts_the_day_at_its_first_instant() {
        // Havana moved its clocks from 00:00 to 01:00 on 2024-03-10: that day starts at 01:00.
        let c = Calendar::new(Unit::Day, zone("America/Havana"));
        let (s, e) = c.window_at(at("America/Havana", 2024, 3, 10, 12, 0));
        assert_eq!(s, at("America/Havana", 2024, 3, 10, 1, 0));
        assert_eq!(e - s, 23 * HOUR);
        // And the day before ends there.
        let (_, e) = c.window_at(at("America/Havana", 2024, 3, 9, 23, 59));
        assert_eq!(e, s);
    }

    #[test]
    fn a_clock_set_back_across_midnight_leaves_the_day_started() {
        // UTC+2 in summer, UTC+1 in winter, summer ending at 00:30 on Oct 27, 2024: the clock
        // shows Oct 27 00:29, then Oct 26 23:30 again. The 27th began at its first midnight,
        // and the half hour that reads the 26th again belongs to it.
        let c = Calendar::new(
            Unit::Day,
            TimeZone::posix("AAA-1BBB-2,M3.5.0/2,M10.5.0/0:30").unwrap(),
        );
        let utc = |s: &str| {
            let ts: Timestamp = s.parse().unwrap();
            u64::try_from(ts.as_microsecond()).unwrap()
        };
        let first_midnight = utc("2024-10-26T22:00:00Z");
        let next_midnight = utc("2024-10-27T23:00:00Z");
        assert_eq!(
            c.window_at(utc("2024-10-26T22:45:00Z")),
            (first_midnight, next_midnight)
        );
        assert_eq!(
            c.window_at(first_midnight - 1),
            (utc("2024-10-25T22:00:00Z"), first_midnight)
        );
        assert_eq!(next_midnight - first_midnight, 25 * HOUR);
    }

    #[test]
    fn the_cache_answers_as_the_rules_do_and_end_of_knows_the_neighbours() {
        let c = Calendar::new(Unit::Day, zone("Europe/Berlin"));
        let t = at("Europe/Berlin", 2024, 10, 27, 12, 0);
        let b = c.bounds(t);
        assert_eq!(b, c.compute_bounds(t));
        assert_eq!(b.prev, at("Europe/Berlin", 2024, 10, 26, 0, 0));
        assert_eq!(b.next, at("Europe/Berlin", 2024, 10, 29, 0, 0));
        assert_eq!(c.end_of(b.prev), b.start);
        assert_eq!(c.end_of(b.start), b.end);
        assert_eq!(c.end_of(b.end), b.next);
        assert_eq!(c.end_of(b.next), at("Europe/Berlin", 2024, 10, 30, 0, 0));
        // Another day replaces the cached one.
        let later = at("Europe/Berlin", 2024, 12, 24, 18, 0);
        assert_eq!(c.window_at(later), {
            let b = c.compute_bounds(later);
            (b.start, b.end)
        });
    }

    #[test]
    fn the_packed_window_round_trips_or_is_not_kept() {
        let day = (1_711_839_600 * SECOND, 1_711_922_400 * SECOND);
        assert_eq!(pack(day.0, day.1).map(unpack), Some(day));
        assert_eq!(pack(day.0 + 1, day.1), None, "not whole seconds");
        assert_eq!(pack(day.1, day.0), None);
        assert_eq!(pack(day.0, day.0), None, "empty");
        assert_eq!(pack(0, 200 * DAY), None, "too long");
        assert_eq!(
            pack(
                u64::MAX / 2 / SECOND * SECOND,
                u64::MAX / 2 / SECOND * SECOND + DAY
            ),
            None
        );
        assert_eq!(pack(0, DAY).map(unpack), Some((0, DAY)));
    }

    #[test]
    fn instants_beyond_the_calendar_do_not_panic() {
        for unit in [Unit::Day, Unit::Week, Unit::Month] {
            let c = Calendar::new(unit, zone("Pacific/Apia"));
            for now in [0, 1, DAY, u64::MAX / 2, u64::MAX - 1, u64::MAX] {
                let (s, e) = c.window_at(now);
                assert!(
                    s <= now && (now < e || now == u64::MAX),
                    "{unit:?} {now}: {s}..{e}"
                );
                let _ = c.end_of(now);
                let _ = c.compute_bounds(now);
            }
        }
        // The first window of a zone east of UTC began before 1970: it starts at 0.
        let c = Calendar::new(Unit::Day, zone("Asia/Tokyo"));
        assert_eq!(c.window_at(0), (0, 15 * HOUR));
    }

    fn zones() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "UTC",
            "Europe/Berlin",
            "America/New_York",
            "Australia/Lord_Howe",
            "America/Havana",
            "Pacific/Apia",
            "Asia/Kathmandu",
            "America/St_Johns",
            "Africa/Casablanca",
        ])
    }

    fn units() -> impl Strategy<Value = Unit> {
        prop::sample::select(vec![Unit::Day, Unit::Week, Unit::Month])
    }

    /// 1970 to 2100: past rule changes and the rules as they stand.
    const UNTIL_2100: Micros = 4_102_444_800_000_000;

    proptest! {
        /// Windows tile time: the window holding `now` contains it, the next one starts where
        /// it ends, the previous one ends where it starts, and its length is what a day, week
        /// or month can be (a day 23 to 25 hours, or 24 ± the zone's odd changes).
        #[test]
        fn windows_tile_time(tz in zones(), unit in units(), now in 0..UNTIL_2100) {
            let c = Calendar::new(unit, zone(tz));
            let b = c.compute_bounds(now);
            prop_assert!(b.start <= now && now < b.end, "{:?}", b);
            prop_assert_eq!(c.window_at(now), (b.start, b.end));
            prop_assert_eq!(c.compute(b.end).0, b.end);
            prop_assert_eq!(c.compute(b.end).1, b.next);
            prop_assert_eq!(c.compute(b.end - 1), (b.start, b.end));
            prop_assert_eq!(c.compute(b.start), (b.start, b.end));
            if b.start > 0 {
                prop_assert_eq!(c.compute(b.start - 1), (b.prev, b.start));
            }
            let len = b.end - b.start;
            let nominal = match unit {
                Unit::Day => DAY,
                Unit::Week => 7 * DAY,
                Unit::Month => 30 * DAY,
            };
            // A month 28 to 31 days; Samoa's skipped day and other rule changes stay within
            // a day of that (the first window, cut at 1970, excepted).
            if b.start > 0 {
                let (lo, hi) = match unit {
                    Unit::Month => (27 * DAY, 32 * DAY),
                    _ => (nominal - DAY, nominal + DAY),
                };
                prop_assert!(lo <= len && len <= hi, "{} {:?}: {} µs", tz, unit, len);
            }
        }

        /// Tiling holds for arbitrary rules too, clock changes at midnight included.
        #[test]
        fn windows_tile_time_in_arbitrary_zones(tz in posix_zone(), unit in units(), now in 0..UNTIL_2100) {
            let zone = TimeZone::posix(&tz).unwrap();
            let c = Calendar::new(unit, zone);
            let b = c.compute_bounds(now);
            prop_assert!(b.prev <= b.start && b.start <= now && now < b.end && b.end < b.next, "{tz}: {b:?}");
            prop_assert_eq!(c.compute(b.end), (b.end, b.next), "{}", tz);
            prop_assert_eq!(c.compute(b.end - 1), (b.start, b.end), "{}", tz);
            if b.start > 0 {
                prop_assert_eq!(c.compute(b.start - 1), (b.prev, b.start), "{}", tz);
                let len = b.end - b.start;
                let (lo, hi) = match unit {
                    Unit::Month => (28 * DAY - 3 * HOUR, 31 * DAY + 3 * HOUR),
                    u => (u.nominal() - 3 * HOUR, u.nominal() + 3 * HOUR),
                };
                prop_assert!(lo <= len && len <= hi, "{} {:?}: {} µs", tz, unit, len);
            }
        }

        /// The cache never changes an answer, whatever order instants come in.
        #[test]
        fn the_cache_is_invisible(tz in zones(), unit in units(), times in prop::collection::vec(0..UNTIL_2100, 1..40)) {
            let c = Calendar::new(unit, zone(tz));
            for now in times {
                prop_assert_eq!(c.window_at(now), c.compute(now));
                let (s, e) = c.compute(now);
                prop_assert_eq!(c.end_of(s), e);
            }
        }
    }
}
