//! `align: calendar` and `timezone:`: quotas whose windows are the days, weeks or months of a
//! time zone (a daily budget that resets at local midnight, a monthly one on the 1st).
//!
//! Refused, each where it is written, because each would run but not do what it says: `align:
//! calendar` on an algorithm without windows; a period calendar windows cannot take (`7h`, or
//! a multiple such as `2d`, which has no first day to count from); `1w` or `1mo` without `align:
//! calendar` (a week from when?); a `timezone` without `align: calendar` (the windows would be
//! UTC's whatever it says); a zone the time zone database does not know.

use std::fmt;
use std::time::Duration;

use jiff::tz::TimeZone;

use super::Invalid;
use super::rate::{parse_calendar_rate, parse_rate};
use super::raw::Text;
use super::types::{AlgorithmKind, Rate};
use super::validate::{Checked, at, keyword};

/// The length of a calendar window: one civil day, week or month.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    /// `1d`: from local midnight to the next.
    Day,
    /// `1w`: from Monday 00:00 to the next Monday (ISO weeks).
    Week,
    /// `1mo`: from the 1st at 00:00 to the 1st of the next month.
    Month,
}

impl CalendarUnit {
    /// The length `Rate::period` holds and `RateLimit-Policy`'s `w` reports: 1 day, 7 days, or
    /// 30 days for a month (one constant per limit; the windows themselves follow the
    /// calendar and the zone's clock changes).
    pub fn nominal(self) -> Duration {
        const DAY: u64 = 86_400;
        Duration::from_secs(match self {
            CalendarUnit::Day => DAY,
            CalendarUnit::Week => 7 * DAY,
            CalendarUnit::Month => 30 * DAY,
        })
    }

    /// As a limit's window is described: "day", "week" or "month".
    pub fn noun(self) -> &'static str {
        match self {
            CalendarUnit::Day => "day",
            CalendarUnit::Week => "week",
            CalendarUnit::Month => "month",
        }
    }
}

/// As the rate writes it: `1d`, `1w`, `1mo`.
impl fmt::Display for CalendarUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CalendarUnit::Day => "1d",
            CalendarUnit::Week => "1w",
            CalendarUnit::Month => "1mo",
        })
    }
}

/// `align: calendar` with its unit (from the rate's period) and zone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CalendarWindows {
    /// Day, week or month.
    pub unit: CalendarUnit,
    /// The zone whose civil time the windows follow (`timezone`, default UTC), resolved when
    /// the config is loaded.
    pub timezone: TimeZone,
}

impl CalendarWindows {
    /// The zone's IANA name as the database spells it (`europe/berlin` is `Europe/Berlin`).
    pub fn zone_name(&self) -> &str {
        self.timezone.iana_name().unwrap_or("UTC")
    }
}

/// A limit's rate and windows: `align` and `timezone` checked against the rate's period and
/// the algorithm. `None`: windows aligned to the epoch (the default, `align: epoch`).
pub(super) fn rate_and_windows(
    rate: &Text,
    align: Option<&Text>,
    timezone: Option<&Text>,
    algorithm: AlgorithmKind,
) -> Checked<(Rate, Option<CalendarWindows>)> {
    let calendar = match align {
        Some(t) => keyword(t, "align", &[("epoch", false), ("calendar", true)])?,
        None => false,
    };
    if !calendar {
        if let Some(tz) = timezone {
            return Err(Invalid::new(
                at(tz),
                "timezone applies to calendar windows: add `align: calendar` (without it, windows are counted from 1970-01-01 UTC whatever the zone)",
            ));
        }
        let rate = parse_rate(&rate.value).map_err(|e| Invalid::new(at(rate), e))?;
        return Ok((rate, None));
    }
    if algorithm != AlgorithmKind::FixedWindow {
        return Err(Invalid::new(
            at(align.unwrap_or(rate)),
            format!(
                "align: calendar is for fixed_window only ({algorithm} has no windows to align): add `algorithm: fixed_window`"
            ),
        ));
    }
    let (count, unit) = parse_calendar_rate(&rate.value).map_err(|e| Invalid::new(at(rate), e))?;
    let timezone = match timezone {
        Some(t) => zone(t)?,
        None => TimeZone::UTC,
    };
    Ok((
        Rate {
            count,
            period: unit.nominal(),
        },
        Some(CalendarWindows { unit, timezone }),
    ))
}

/// A zone of the time zone database, by its IANA name (any case).
fn zone(t: &Text) -> Checked<TimeZone> {
    let name = t.value.trim();
    if let Ok(tz) = TimeZone::get(name)
        && tz.iana_name().is_some()
    {
        return Ok(tz);
    }
    let hint = match suggestions(name).as_slice() {
        [] => "an IANA name such as Europe/Berlin, America/New_York or UTC".to_owned(),
        names => format!("did you mean {}?", names.join(" or ")),
    };
    Err(Invalid::new(
        at(t),
        format!("unknown time zone `{name}`: use {hint}"),
    ))
}

/// Zones whose last part is `name`'s, whatever the case: `Berlin` is `Europe/Berlin`.
fn suggestions(name: &str) -> Vec<String> {
    let last = name.rsplit('/').next().unwrap_or(name).replace(' ', "_");
    if last.is_empty() {
        return Vec::new();
    }
    let mut found: Vec<String> = jiff::tz::db()
        .available()
        .map(|n| n.as_str().to_owned())
        .filter(|n| {
            n.rsplit('/')
                .next()
                .is_some_and(|l| l.eq_ignore_ascii_case(&last))
        })
        .collect();
    found.sort();
    found.truncate(3);
    found
}
