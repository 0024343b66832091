//! `align: calendar` and `timezone`: what loads, what is refused and where.

use std::time::Duration;

use super::super::{CalendarUnit, Consistency};
use super::{assert_err, lines, ok, with_limit, with_redis_limit};

fn calendar_of(yaml: &str) -> (u64, Duration, CalendarUnit, String) {
    let cfg = ok(yaml);
    let l = &cfg.routes[0].limits[0];
    let c = l.calendar.as_ref().expect("calendar windows");
    (
        l.rate.count,
        l.rate.period,
        c.unit,
        c.zone_name().to_owned(),
    )
}

const DAY: Duration = Duration::from_secs(86_400);

#[test]
fn calendar_rates_load_with_their_unit_zone_and_nominal_period() {
    let day = with_limit(&[
        "algorithm: fixed_window",
        "rate: 10000/1d",
        "align: calendar",
        "timezone: Europe/Berlin",
    ]);
    assert_eq!(
        calendar_of(&day),
        (10000, DAY, CalendarUnit::Day, "Europe/Berlin".to_owned())
    );
    // The zone's name in any case, spelt as the database does; UTC by default; `1` optional.
    let week = with_limit(&[
        "algorithm: fixed_window",
        "rate: 5/w",
        "align: calendar",
        "timezone: america/new_york",
    ]);
    assert_eq!(
        calendar_of(&week),
        (
            5,
            7 * DAY,
            CalendarUnit::Week,
            "America/New_York".to_owned()
        )
    );
    let month = with_limit(&["algorithm: fixed_window", "rate: 1/1mo", "align: calendar"]);
    assert_eq!(
        calendar_of(&month),
        (1, 30 * DAY, CalendarUnit::Month, "UTC".to_owned())
    );
    // `align: epoch` is the default, spelt out.
    let epoch = with_limit(&["algorithm: fixed_window", "rate: 10/1d", "align: epoch"]);
    assert_eq!(ok(&epoch).routes[0].limits[0].calendar, None);
}

#[test]
fn align_calendar_is_for_fixed_window_only() {
    for alg in ["gcra", "sliding_window", "sliding_log"] {
        let yaml = with_limit(&[
            &format!("algorithm: {alg}"),
            "rate: 10/1d",
            "align: calendar",
        ]);
        assert_err(
            &yaml,
            8,
            16,
            &format!("align: calendar is for fixed_window only ({alg} has no windows to align)"),
        );
    }
    // The default algorithm is gcra.
    let yaml = with_limit(&["rate: 10/1d", "align: calendar"]);
    assert_err(&yaml, 7, 16, "add `algorithm: fixed_window`");
    let yaml = with_limit(&["algorithm: fixed_window", "rate: 10/1d", "align: weekly"]);
    assert_err(
        &yaml,
        8,
        16,
        "`weekly` is not a valid align: use epoch | calendar",
    );
}

#[test]
fn an_unknown_time_zone_is_refused_where_it_is_written() {
    let yaml = with_limit(&[
        "algorithm: fixed_window",
        "rate: 10/1d",
        "align: calendar",
        "timezone: Europe/Berln",
    ]);
    assert_err(
        &yaml,
        9,
        19,
        "unknown time zone `Europe/Berln`: use an IANA name",
    );
    // A city alone names its zone in the hint.
    let yaml = with_limit(&[
        "algorithm: fixed_window",
        "rate: 10/1d",
        "align: calendar",
        "timezone: berlin",
    ]);
    assert_err(&yaml, 9, 19, "did you mean Europe/Berlin?");
    // An offset is not a zone: it has no clock changes to follow, and no name.
    let yaml = with_limit(&[
        "algorithm: fixed_window",
        "rate: 10/1d",
        "align: calendar",
        "timezone: \"+02:00\"",
    ]);
    assert_err(&yaml, 9, 19, "unknown time zone `+02:00`");
}

#[test]
fn calendar_windows_take_a_day_a_week_or_a_month() {
    for (rate, column) in [("10/7h", 15), ("10/24h", 15), ("10/2d", 15), ("10/3mo", 15)] {
        let yaml = with_limit(&[
            "algorithm: fixed_window",
            &format!("rate: {rate}"),
            "align: calendar",
        ]);
        assert_err(
            &yaml,
            7,
            column,
            "align: calendar takes a period of 1d, 1w or 1mo",
        );
    }
    let yaml = with_limit(&["algorithm: fixed_window", "rate: 10/2d", "align: calendar"]);
    assert_err(&yaml, 7, 15, "a multiple has no calendar day to start from");
}

#[test]
fn weeks_and_months_need_align_calendar() {
    for rate in ["100/1w", "100/1mo", "100/mo"] {
        let yaml = with_limit(&["algorithm: fixed_window", &format!("rate: {rate}")]);
        assert_err(
            &yaml,
            7,
            15,
            "weeks and months are calendar periods: add `align: calendar`",
        );
        // Whatever the algorithm: no rolling week has a first day either.
        let yaml = with_limit(&[&format!("rate: {rate}")]);
        assert_err(&yaml, 6, 15, "write the period in days (7d, 30d)");
    }
}

#[test]
fn a_timezone_without_align_calendar_is_refused() {
    let yaml = with_limit(&[
        "algorithm: fixed_window",
        "rate: 10/1d",
        "timezone: Europe/Berlin",
    ]);
    assert_err(
        &yaml,
        8,
        19,
        "timezone applies to calendar windows: add `align: calendar`",
    );
}

#[test]
fn eventual_calendar_limits_load_as_strict_with_a_warning() {
    let yaml = with_redis_limit(&[
        "algorithm: fixed_window",
        "rate: 100/1d",
        "align: calendar",
        "consistency: eventual",
    ]);
    let cfg = ok(&yaml);
    assert_eq!(cfg.routes[0].limits[0].consistency, Consistency::Strict);
    let w: Vec<String> = cfg
        .warnings
        .iter()
        .map(|w| format!("{}:{}: {}", w.line, w.column, w.message))
        .collect();
    assert_eq!(
        w,
        [
            "11:22: warning: consistency: eventual is decided as strict for this limit (calendar windows are decided in Redis on its clock): every decision goes to Redis"
        ]
    );
}

/// `/admin/config` writes the rate with its calendar unit and the zone by name: saved as a
/// file, it loads back to the same limits.
#[test]
fn calendar_limits_as_json_load_back_to_themselves() {
    let yaml = lines(&[
        "routes:",
        "  - name: a",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - {name: d, algorithm: fixed_window, rate: 10000/1d, align: calendar, timezone: europe/berlin}",
        "      - {name: m, algorithm: fixed_window, rate: 100/1mo, align: calendar}",
        "      - {name: e, algorithm: fixed_window, rate: 10/1d}",
    ]);
    let cfg = ok(&yaml);
    let json = serde_json::to_value(&cfg).unwrap();
    let limits = &json["routes"][0]["limits"];
    assert_eq!(limits[0]["rate"], "10000/1d");
    assert_eq!(limits[0]["align"], "calendar");
    assert_eq!(limits[0]["timezone"], "Europe/Berlin");
    assert_eq!(limits[1]["rate"], "100/1mo");
    assert_eq!(limits[1]["timezone"], "UTC");
    assert!(limits[2].get("align").is_none() && limits[2].get("timezone").is_none());
    let back = super::parse(&serde_json::to_string_pretty(&json).unwrap())
        .unwrap_or_else(|e| panic!("{e}\n{json:#}"));
    assert_eq!(back, cfg);
}

/// `check` names the windows and shows the one a moment falls in, in the zone's civil time.
#[test]
fn the_summary_shows_calendar_windows_and_the_current_one() {
    let yaml = lines(&[
        "routes:",
        "  - name: a",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - {name: daily, algorithm: fixed_window, rate: 10000/1d, align: calendar, timezone: Europe/Berlin}",
        "      - {name: weekly, algorithm: fixed_window, rate: 500/1w, align: calendar, timezone: Europe/Berlin}",
        "      - {name: monthly, algorithm: fixed_window, rate: 100000/1mo, align: calendar}",
    ]);
    // 2024-03-31 10:00 UTC: noon in Berlin on the day its clocks went forward.
    let now: jiff::Timestamp = "2024-03-31T10:00:00Z".parse().unwrap();
    let text = crate::config::summary::summary_at(&ok(&yaml), now);
    for line in [
        "  limit daily: key ip, fixed_window 10000/1d, calendar days in Europe/Berlin, local, cost 1, reject, enforced, strict",
        "    at most 10000 per calendar day (Europe/Berlin civil time: a day is 23 or 25 hours where the zone changes its clocks); 20000 across a window boundary (2 × 10000), on each instance",
        "    current window 2024-03-31 00:00 CET to 2024-04-01 00:00 CEST (23 h); the next starts at local midnight",
        "  limit weekly: key ip, fixed_window 500/1w, calendar weeks in Europe/Berlin, local, cost 1, reject, enforced, strict",
        "    current window 2024-03-25 00:00 CET to 2024-04-01 00:00 CEST (6 days 23 h); the next starts at Monday 00:00",
        "  limit monthly: key ip, fixed_window 100000/1mo, calendar months in UTC, local, cost 1, reject, enforced, strict",
        "    current window 2024-03-01 00:00 UTC to 2024-04-01 00:00 UTC (31 days); the next starts at 00:00 on the 1st",
    ] {
        assert!(text.contains(line), "{line:?} not in\n{text}");
    }
}

/// Plans and overrides give a calendar limit another count in the same windows: `1w` and
/// `1mo` are written as the limit is, and another period is refused naming the limit's.
#[test]
fn plans_and_overrides_of_calendar_limits_keep_the_calendar_period() {
    let file = |override_rate: &str| {
        lines(&[
            "plans:",
            "  pro: { rate: 100000/1mo }",
            "routes:",
            "  - name: api",
            "    upstream: http://127.0.0.1:9000",
            "    limits:",
            "      - name: monthly",
            "        key: [header:x-api-key]",
            "        algorithm: fixed_window",
            "        rate: 1000/1mo",
            "        align: calendar",
            "        timezone: Europe/Berlin",
            "        overrides:",
            "          - when: { key: [acme] }",
            "            plan: pro",
            "          - when: { key: [beta] }",
            &format!("            rate: {override_rate}"),
        ])
    };
    let cfg = ok(&file("5000/1mo"));
    let l = &cfg.routes[0].limits[0];
    let rates: Vec<(u64, Duration)> = l
        .overrides
        .iter()
        .map(|o| match &o.then {
            crate::config::OverrideRate::Rate { rate, .. } => (rate.count, rate.period),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(rates, [(100000, 30 * DAY), (5000, 30 * DAY)]);
    let text = crate::config::summary(&cfg);
    assert!(text.contains("plan pro (100000/1mo)"), "{text}");
    assert!(text.contains("rate 5000/1mo"), "{text}");
    assert_err(
        &file("5000/1d"),
        17,
        19,
        "fixed_window keeps a key's state for the limit's period (1mo), so an override keeps that period and changes the count (e.g. 5000/1mo)",
    );
}

/// The spec's shared daily budget: a top-level calendar limit that routes `use:`.
#[test]
fn a_shared_limit_can_be_a_calendar_quota() {
    let cfg = ok(&lines(&[
        "limits:",
        "  - name: per-key-daily",
        "    key: [header:x-api-key]",
        "    algorithm: fixed_window",
        "    rate: 10000/1d",
        "    align: calendar",
        "    timezone: Europe/Berlin",
        "routes:",
        "  - name: search",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - use: per-key-daily",
        "  - name: users",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - use: per-key-daily",
    ]));
    for route in &cfg.routes {
        let l = &route.limits[0];
        assert!(l.shared);
        let c = l.calendar.as_ref().expect("calendar windows");
        assert_eq!(
            (c.unit, c.zone_name()),
            (CalendarUnit::Day, "Europe/Berlin")
        );
    }
    let text = crate::config::summary(&cfg);
    assert!(
        text.contains("fixed_window 10000/1d, calendar days in Europe/Berlin"),
        "{text}"
    );
}
