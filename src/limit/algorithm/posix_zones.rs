//! A proptest strategy for arbitrary time zones with daylight saving, shared by the calendar
//! windows' unit tests (`calendar.rs`) and the Lua mirror tests (`tests/it/lua_mirror.rs`,
//! which include this file by path): one generator, so both test the same zones.

use proptest::prelude::*;

/// An arbitrary zone with daylight saving, as a POSIX TZ rule: a standard offset east of
/// UTC (whole, half or three-quarter hours), a shift of 30 minutes to 2 hours, and the two
/// changes on any month, week and weekday at 00:00 to 03:00 local: at midnight too, where
/// spring skips the day's first instant, and at 00:30, where autumn sets the clock back
/// across midnight into the day before.
pub(crate) fn posix_zone() -> impl Strategy<Value = String> {
    let at = prop::sample::select(vec!["0", "0:30", "1", "2", "3"]);
    let change = (1u8..=12, 1u8..=5, 0u8..=6, at);
    (
        -12i32..=12,
        prop::sample::select(vec![0, 30, 45]),
        prop::sample::select(vec![30, 60, 120]),
        change.clone(),
        change,
    )
        .prop_map(
            |(hours, minutes, shift, (m1, w1, d1, t1), (m2, w2, d2, t2))| {
                let std = hours * 60 + if hours < 0 { -minutes } else { minutes };
                // POSIX offsets are west of UTC: UTC+1 is written -1.
                let posix = |east: i32| {
                    let west = -east;
                    let sign = if west < 0 { "-" } else { "" };
                    format!("{sign}{}:{:02}", west.abs() / 60, west.abs() % 60)
                };
                format!(
                    "AAA{}BBB{},M{m1}.{w1}.{d1}/{t1},M{m2}.{w2}.{d2}/{t2}",
                    posix(std),
                    posix(std + shift)
                )
            },
        )
}
