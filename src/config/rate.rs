//! `COUNT/PERIOD` rates and `30s`-style durations.
//!
//! Both are kept to whole milliseconds and to a microsecond count that fits a
//! `u64`, so limiters can do integer arithmetic on `period_micros()` without
//! checking for overflow themselves.

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use super::calendar::CalendarUnit;
use super::types::AlgorithmKind;

/// Global limits are computed in Lua, whose numbers are doubles (exact integers below 2^53);
/// the scripts keep every parameter at most 2^50 so their sums stay exact (products beyond
/// 2^53, as sliding_window's COUNT × PERIOD, go through an exact helper).
pub(super) const LUA_PARAM_MAX: u64 = super::redis::MAX_PARAM;

/// `count` units per `period`: what one limit lets through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    /// At least 1.
    pub count: u64,
    /// Longer than zero, in whole milliseconds.
    pub period: Duration,
}

/// As written in the YAML: `100/1m`.
impl Serialize for Rate {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl Rate {
    /// The period in whole microseconds, saturating: every validated rate fits.
    pub fn period_micros(&self) -> u64 {
        u64::try_from(self.period.as_micros()).unwrap_or(u64::MAX)
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, DurationText(self.period))
    }
}

const UNITS: [(&str, u64); 5] = [
    ("d", 86_400_000_000),
    ("h", 3_600_000_000),
    ("m", 60_000_000),
    ("s", 1_000_000),
    ("ms", 1_000),
];

const DURATION_HELP: &str = "write a number with a unit ms, s, m, h or d (50ms, 30s, 1.5s, 1m, 1h, 1d); a bare number means seconds";

/// `50ms`, `30s`, `1.5s`, `1m`, `1h`, `1d`, or a bare number of seconds.
pub(super) fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let digits = t.len() - t.trim_start_matches(is_number).len();
    let (number, unit) = t.split_at(digits);
    if number.is_empty() {
        return Err(format!("`{text}` is not a duration: {DURATION_HELP}"));
    }
    let unit = if unit.is_empty() { "s" } else { unit };
    to_duration(number, unit, text)
}

/// `COUNT/PERIOD` where PERIOD is an optional number and a unit: `100/1m`,
/// `10/s`, `5/500ms`, `3/1.5s`.
pub(super) fn parse_rate(text: &str) -> Result<Rate, String> {
    let help = "write COUNT/PERIOD, e.g. 100/1m, 10/s or 5/500ms (units ms, s, m, h, d)";
    let (count, number, unit) = split_rate(text, help)?;
    if matches!(unit, "w" | "mo") {
        return Err(format!(
            "rate `{text}`: weeks and months are calendar periods: add `align: calendar` (fixed_window) for windows from Monday or from the 1st, or write the period in days (7d, 30d) for windows of a fixed length"
        ));
    }
    let number = if number.is_empty() { "1" } else { number };
    let period = period_text(text);
    let period = to_duration(number, unit, period).map_err(|e| format!("rate `{text}`: {e}"))?;
    if period.is_zero() {
        return Err(format!("rate `{text}`: the period must be longer than 0"));
    }
    Ok(Rate { count, period })
}

/// A plan's or an override's rate: [`parse_rate`]'s, and `COUNT/1w` or `COUNT/1mo` too, as their
/// nominal 7 and 30 days, so that a plan can give a calendar limit of weeks or months another
/// count (applied to any other limit they are those lengths).
pub(super) fn parse_plan_rate(text: &str) -> Result<Rate, String> {
    match parse_calendar_rate(text) {
        Ok((count, unit @ (CalendarUnit::Week | CalendarUnit::Month))) => Ok(Rate {
            count,
            period: unit.nominal(),
        }),
        _ => parse_rate(text),
    }
}

/// A rate under `align: calendar`: `COUNT/1d`, `COUNT/1w` or `COUNT/1mo` (the `1` may be left
/// out, as in `10/s`), with the window's unit.
pub(super) fn parse_calendar_rate(text: &str) -> Result<(u64, CalendarUnit), String> {
    let help = "write COUNT/1d, COUNT/1w or COUNT/1mo";
    let (count, number, unit) = split_rate(text, help)?;
    let period = period_text(text);
    let unit = match (number, calendar_unit(unit)) {
        ("" | "1", Some(unit)) => unit,
        _ => {
            return Err(format!(
                "rate `{text}`: align: calendar takes a period of 1d, 1w or 1mo (a day from local midnight, a week from Monday, a month from the 1st); `{period}` is none of them{}",
                if number.is_empty() || number == "1" {
                    ""
                } else {
                    ": a multiple has no calendar day to start from"
                }
            ));
        }
    };
    Ok((count, unit))
}

/// The calendar unit a period's unit names: `d`, `w` or `mo`.
fn calendar_unit(unit: &str) -> Option<CalendarUnit> {
    match unit {
        "d" => Some(CalendarUnit::Day),
        "w" => Some(CalendarUnit::Week),
        "mo" => Some(CalendarUnit::Month),
        _ => None,
    }
}

/// The PERIOD of a rate's text, trimmed (empty when there is no `/`).
fn period_text(text: &str) -> &str {
    text.split_once('/').map_or("", |(_, p)| p.trim())
}

/// `COUNT/PERIOD` split into the count (checked: a whole number, at least 1) and the period's
/// number (possibly empty) and unit (not empty). `help` says what to write instead.
fn split_rate<'t>(text: &'t str, help: &str) -> Result<(u64, &'t str, &'t str), String> {
    let Some((count, period)) = text.trim().split_once('/') else {
        return Err(format!("rate `{text}` has no `/`: {help}"));
    };
    let (count, period) = (count.trim(), period.trim());
    if count.is_empty() || !count.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("rate `{text}`: `{count}` is not a count: {help}"));
    }
    let count: u64 = count
        .parse()
        .map_err(|_| format!("rate `{text}`: the count {count} is too large"))?;
    if count == 0 {
        return Err(format!(
            "rate `{text}` admits nothing: the count must be at least 1"
        ));
    }
    let digits = period.len() - period.trim_start_matches(is_number).len();
    let (number, unit) = period.split_at(digits);
    if unit.is_empty() {
        return Err(format!("rate `{text}`: the period needs a unit: {help}"));
    }
    Ok((count, number, unit))
}

/// The characters of a duration's number: digits and one decimal point.
fn is_number(c: char) -> bool {
    c.is_ascii_digit() || c == '.'
}

/// `number` (`30`, `1.5`) of `unit`, in whole milliseconds: a decimal that falls between two
/// milliseconds (`1.0005s`) is refused rather than rounded.
fn to_duration(number: &str, unit: &str, text: &str) -> Result<Duration, String> {
    let Some(&(_, micros_per_unit)) = UNITS.iter().find(|(name, _)| *name == unit) else {
        return Err(format!("`{text}` is not a duration: {DURATION_HELP}"));
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let fraction = if fraction.is_empty() {
        fraction
    } else {
        // `1.500s` is `1.5s`; an all-zero fraction keeps one digit (`1.0s`).
        let trimmed = fraction.trim_end_matches('0');
        if trimmed.is_empty() { "0" } else { trimmed }
    };
    let digits_only = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits_only(fraction) || (number.contains('.') && fraction.is_empty()) {
        return Err(format!("`{text}` is not a duration: {DURATION_HELP}"));
    }
    let too_long = || format!("duration `{text}` is too long");
    let whole = whole
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(micros_per_unit))
        .ok_or_else(too_long)?;
    // A millisecond is at least 1e-8 of any unit: more decimals than 12 say nothing useful.
    if fraction.len() > 12 {
        return Err(format!("duration `{text}` has too many decimals"));
    }
    let part: u128 = fraction.parse().unwrap_or(0);
    let scale = 10u128.pow(fraction.len() as u32);
    let frac_micros = part * u128::from(micros_per_unit);
    if !frac_micros.is_multiple_of(scale) || !(frac_micros / scale).is_multiple_of(1_000) {
        return Err(format!("duration `{text}` is finer than a millisecond"));
    }
    let frac = u64::try_from(frac_micros / scale).map_err(|_| too_long())?;
    whole
        .checked_add(frac)
        .map(Duration::from_micros)
        .ok_or_else(too_long)
}

/// Formats a duration in the largest unit that divides it, the way a person
/// would write it in the YAML (`1m`, `90s`, `1500ms`).
pub(super) struct DurationText(pub Duration);

impl fmt::Display for DurationText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nanos = self.0.as_nanos();
        if nanos == 0 {
            return f.write_str("0s");
        }
        if !nanos.is_multiple_of(1_000) {
            return write!(f, "{nanos}ns");
        }
        let micros = nanos / 1_000;
        for (name, per) in UNITS {
            if micros.is_multiple_of(u128::from(per)) {
                return write!(f, "{}{name}", micros / u128::from(per));
            }
        }
        write!(f, "{micros}us")
    }
}

/// Why `algorithm` cannot run `rate` exactly, if it cannot.
pub(super) fn precision_problem(algorithm: AlgorithmKind, rate: Rate) -> Option<String> {
    let micros = rate.period_micros();
    let beyond_doubles = rate.count > LUA_PARAM_MAX || micros > LUA_PARAM_MAX;
    match algorithm {
        _ if beyond_doubles => Some(format!(
            "rate {rate} is too large: COUNT and PERIOD in microseconds must stay at most 2^50 because the Redis scripts compute with doubles"
        )),
        // The emission interval period/count is kept in whole microseconds.
        AlgorithmKind::Gcra if rate.count > micros => Some(format!(
            "rate {rate} is finer than one per microsecond, which gcra cannot represent; use a longer period for the same ratio, or another algorithm"
        )),
        _ => None,
    }
}
