//! Calendar quotas (`fixed_window` with `align: calendar`) through the gateway: a budget used up
//! answers 429 until the next local midnight (or Monday, or the 1st), exact to the second; a
//! 23-hour day admits its count like any other; global limits share one budget per calendar
//! window on a real redis-server, whose keys expire at the window's end; `check` shows the
//! windows and refuses what cannot work. Expectations are computed here with jiff, from the
//! zone's rules, independently of the gateway's window code.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};
use serde_json::Value;

use crate::support::redis::RedisServer;
use crate::support::upstream::Upstream;
use crate::support::{Gateway, TempDir, client};
use tollgate::limit::clock::ManualClock;

fn config(redis: Option<&str>, upstream: &str, limit: &str) -> String {
    let redis = redis.map_or(String::new(), |url| {
        format!("redis:\n  url: {url}\n  timeout: 2s\n  on_error: deny\n")
    });
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\n{redis}routes:\n  - name: cal\n    upstream: {upstream}\n    limits:\n      - name: quota\n        key: [header:x-api-key]\n        algorithm: fixed_window\n        align: calendar\n{limit}"
    )
}

/// Seconds from `now` to the start of the next calendar `unit` ("day", "week", "month") in
/// `zone`, from jiff's civil arithmetic: the next date's midnight, as the zone resolves it.
fn seconds_to_next(zone: &str, unit: &str, now: Timestamp) -> f64 {
    let tz = TimeZone::get(zone).unwrap();
    let today = now.to_zoned_datetime(tz.clone()).date();
    let next = match unit {
        "day" => today.tomorrow().unwrap(),
        "week" => {
            let mut d = today.tomorrow().unwrap();
            while d.weekday() != jiff::civil::Weekday::Monday {
                d = d.tomorrow().unwrap();
            }
            d
        }
        _ => today.first_of_month().checked_add(1.month()).unwrap(),
    };
    let start = next.to_zoned_datetime(tz).unwrap().timestamp();
    (start.as_microsecond() - now.as_microsecond()) as f64 / 1e6
}

/// Waits while the next window of `unit` in `zone` starts within `margin` seconds, so the
/// requests of a test land in one window.
async fn away_from_a_boundary(zone: &str, unit: &str, margin: f64) {
    let left = seconds_to_next(zone, unit, Timestamp::now());
    if left < margin {
        tokio::time::sleep(Duration::from_secs_f64(left + 1.0)).await;
    }
}

async fn get(g: &Gateway, key: &str) -> reqwest::Response {
    client()
        .get(g.url("/"))
        .header("x-api-key", key)
        .send()
        .await
        .unwrap()
}

/// The `t` of a `RateLimit` field: `"quota";r=0;t=123`.
fn field_t(r: &reqwest::Response) -> u64 {
    let v = r.headers()["ratelimit"].to_str().unwrap();
    v.rsplit("t=").next().unwrap().parse().unwrap()
}

/// `Retry-After` is the seconds to the next window start, rounded up: it is in
/// `[expected, expected + 1]` for an expectation computed around the request.
#[track_caller]
fn assert_about(got: u64, before: f64, after: f64, what: &str) {
    assert!(
        (got as f64) >= after.floor() && (got as f64) <= before.ceil() + 1.0,
        "{what} {got}, expected between {after} and {before}"
    );
}

#[tokio::test]
async fn a_local_daily_quota_answers_429_until_the_next_local_midnight() {
    // Kiritimati is UTC+14: its midnight is never UTC's, so an epoch window could not pass.
    let zone = "Pacific/Kiritimati";
    away_from_a_boundary(zone, "day", 30.0).await;
    let up = Upstream::start().await;
    let yaml = config(
        None,
        &up.url(),
        &format!("        rate: 3/1d\n        timezone: {zone}\n"),
    );
    let g = Gateway::start(&yaml).await;
    for left in [2, 1, 0] {
        let r = get(&g, "ann").await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["ratelimit-policy"], "\"quota\";q=3;w=86400");
        assert!(
            r.headers()["ratelimit"]
                .to_str()
                .unwrap()
                .starts_with(&format!("\"quota\";r={left};t=")),
            "{:?}",
            r.headers()["ratelimit"]
        );
    }
    let before = seconds_to_next(zone, "day", Timestamp::now());
    let r = get(&g, "ann").await;
    let after = seconds_to_next(zone, "day", Timestamp::now());
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_about(retry, before, after, "Retry-After");
    assert_about(field_t(&r), before, after, "RateLimit t");
    let body: Value = r.json().await.unwrap();
    let ms = body["retry_after_ms"].as_f64().unwrap() / 1000.0;
    // Rounded up to the millisecond, on the gateway's clock (the wall clock at its start).
    assert!(
        ms <= before + 1.0 && ms >= after - 1.0,
        "{ms} vs {after}..{before}"
    );
    // Another key has its own budget; the admin API tells when ann's is full again.
    assert_eq!(get(&g, "bob").await.status(), 200);
    let s: Value = g.admin_json("/admin/limits/cal/quota?key=ann").await;
    assert_eq!(s["remaining"], 0, "{s}");
    let reset = s["reset_after_ms"].as_f64().unwrap() / 1000.0;
    let now_left = seconds_to_next(zone, "day", Timestamp::now());
    assert!((reset - now_left).abs() < 1.0, "{reset} vs {now_left}");
    g.stop().await;
}

/// On Berlin's 23-hour day (2024-03-31, clocks from 02:00 to 03:00), on the gateway's clock
/// moved by the test: the day admits its 3, the 4th request at noon (11 hours after midnight,
/// by the clock 12) waits the 12 hours to midnight, and at midnight the budget is whole again.
#[tokio::test]
async fn a_23_hour_day_admits_its_count_and_reopens_at_local_midnight() {
    let midnight: Timestamp = "2024-03-30T23:00:00Z".parse().unwrap(); // 00:00 CET
    let micros = |t: Timestamp| u64::try_from(t.as_microsecond()).unwrap();
    let noon = midnight.checked_add(11.hours()).unwrap(); // 12:00 CEST
    let next_midnight: Timestamp = "2024-03-31T22:00:00Z".parse().unwrap(); // 00:00 CEST
    let clock = Arc::new(ManualClock::new(micros(midnight)));
    let up = Upstream::start().await;
    let yaml = config(
        None,
        &up.url(),
        "        rate: 3/1d\n        timezone: Europe/Berlin\n",
    );
    let g = Gateway::start_with_clock(&yaml, clock.clone()).await;
    assert_eq!(get(&g, "ann").await.status(), 200);
    clock.set(micros(noon));
    for _ in 0..2 {
        assert_eq!(get(&g, "ann").await.status(), 200);
    }
    let r = get(&g, "ann").await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "43200");
    assert_eq!(r.headers()["ratelimit"], "\"quota\";r=0;t=43200");
    // The day is 23 hours: the window began 11 hours before noon and ends 12 hours after.
    assert_eq!(
        next_midnight.as_second() - midnight.as_second(),
        23 * 3600,
        "the test's own arithmetic"
    );
    clock.set(micros(next_midnight) - 1);
    assert_eq!(get(&g, "ann").await.status(), 429);
    assert_eq!(get(&g, "ann").await.headers()["retry-after"], "1");
    clock.set(micros(next_midnight));
    let r = get(&g, "ann").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["ratelimit"], "\"quota\";r=2;t=86400");
    g.stop().await;
}

/// An override gives a key another count in the same calendar windows: the key's 429 also
/// waits for local midnight, and its policy shows the count that applied.
#[tokio::test]
async fn an_override_counts_in_the_same_calendar_day() {
    let midnight: Timestamp = "2024-03-30T23:00:00Z".parse().unwrap(); // 00:00 CET, Berlin
    let micros = |t: Timestamp| u64::try_from(t.as_microsecond()).unwrap();
    let clock = Arc::new(ManualClock::new(micros(midnight) + 11 * 3_600_000_000));
    let up = Upstream::start().await;
    let yaml = config(
        None,
        &up.url(),
        "        rate: 1/1d
        timezone: Europe/Berlin
        overrides:
          - when: { key: [vip] }
            rate: 3/1d
",
    );
    let g = Gateway::start_with_clock(&yaml, clock.clone()).await;
    for _ in 0..3 {
        let r = get(&g, "vip").await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["ratelimit-policy"], "\"quota\";q=3;w=86400");
    }
    assert_eq!(get(&g, "ann").await.status(), 200);
    for key in ["vip", "ann"] {
        let r = get(&g, key).await;
        assert_eq!(r.status(), 429, "{key}");
        // Noon CEST on the 23-hour day: 12 hours to midnight, for both rates.
        assert_eq!(r.headers()["retry-after"], "43200", "{key}");
    }
    g.stop().await;
}

/// A weekly quota (from Monday 00:00) in New York, on a local limit.
#[tokio::test]
async fn a_weekly_quota_reopens_on_monday() {
    let zone = "America/New_York";
    away_from_a_boundary(zone, "week", 30.0).await;
    let up = Upstream::start().await;
    let yaml = config(
        None,
        &up.url(),
        &format!("        rate: 1/1w\n        timezone: {zone}\n"),
    );
    let g = Gateway::start(&yaml).await;
    let r = get(&g, "ann").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["ratelimit-policy"], "\"quota\";q=1;w=604800");
    let before = seconds_to_next(zone, "week", Timestamp::now());
    let r = get(&g, "ann").await;
    let after = seconds_to_next(zone, "week", Timestamp::now());
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_about(retry, before, after, "Retry-After");
    g.stop().await;
}

/// A global monthly quota: two gateways draw on one budget per calendar month on Redis's clock;
/// the one that finds it used up answers until the 1st, and the Redis key expires then.
#[tokio::test]
async fn a_global_monthly_quota_is_shared_and_its_key_expires_on_the_first() {
    let zone = "America/New_York";
    away_from_a_boundary(zone, "month", 30.0).await;
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let yaml = config(
        Some(&redis.url()),
        &up.url(),
        &format!("        rate: 4/1mo\n        timezone: {zone}\n        scope: global\n"),
    );
    let a = Gateway::start(&yaml).await;
    let b = Gateway::start(&yaml).await;
    for g in [&a, &b, &a, &b] {
        let r = get(g, "acme").await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["ratelimit-policy"], "\"quota\";q=4;w=2592000");
    }
    for g in [&a, &b] {
        let before = seconds_to_next(zone, "month", Timestamp::now());
        let r = get(g, "acme").await;
        let after = seconds_to_next(zone, "month", Timestamp::now());
        assert_eq!(r.status(), 429);
        let retry: u64 = r.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert_about(retry, before, after, "Retry-After");
        assert_about(field_t(&r), before, after, "RateLimit t");
    }
    // One hash per key: the window's start and its count, expiring at the window's end.
    let keys = redis.cli(&["KEYS", "tg:{cal/quota/*"]);
    let key = keys.trim();
    assert!(key.ends_with(":fw"), "{keys:?}");
    let start: u64 = redis.cli(&["HGET", key, "s"]).trim().parse().unwrap();
    let count: u64 = redis.cli(&["HGET", key, "c"]).trim().parse().unwrap();
    assert_eq!(count, 4);
    let tz = TimeZone::get(zone).unwrap();
    let first = Timestamp::now()
        .to_zoned_datetime(tz.clone())
        .date()
        .first_of_month()
        .to_zoned_datetime(tz)
        .unwrap()
        .timestamp();
    assert_eq!(start, u64::try_from(first.as_microsecond()).unwrap());
    let ttl_ms: f64 = redis.cli(&["PTTL", key]).trim().parse().unwrap();
    let left = seconds_to_next(zone, "month", Timestamp::now());
    assert!(
        (ttl_ms / 1000.0 - left).abs() < 2.0,
        "{ttl_ms} ms vs {left} s"
    );
    // The admin API reads the key on Redis's clock too.
    let s: Value = a.admin_json("/admin/limits/cal/quota?key=acme").await;
    assert_eq!(s["remaining"], 0, "{s}");
    a.stop().await;
    b.stop().await;
}

fn tollgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
}

/// `check` shows the calendar windows, and refuses each thing that cannot work with its
/// line and column.
#[test]
fn check_shows_calendar_windows_and_refuses_what_cannot_work() {
    let dir = TempDir::new();
    let file = |name: &str, limit: &str| {
        let path = dir.path.join(name);
        std::fs::write(
            &path,
            format!(
                "routes:\n  - name: a\n    upstream: http://127.0.0.1:1\n    limits:\n      - name: l\n{limit}"
            ),
        )
        .unwrap();
        path
    };
    let good = file(
        "good.yaml",
        "        algorithm: fixed_window\n        rate: 10000/1d\n        align: calendar\n        timezone: Europe/Berlin\n",
    );
    let out = tollgate()
        .args(["check", "--config", good.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("fixed_window 10000/1d, calendar days in Europe/Berlin"),
        "{stdout}"
    );
    assert!(stdout.contains("    current window "), "{stdout}");
    assert!(
        stdout.contains("the next starts at local midnight"),
        "{stdout}"
    );
    let cases = [
        (
            "        rate: 10/1d\n        align: calendar\n",
            "7:16",
            "align: calendar is for fixed_window only (gcra has no windows to align)",
        ),
        (
            "        algorithm: fixed_window\n        rate: 10/1d\n        align: calendar\n        timezone: Mars/Olympus\n",
            "9:19",
            "unknown time zone `Mars/Olympus`",
        ),
        (
            "        algorithm: fixed_window\n        rate: 10/1mo\n",
            "7:15",
            "weeks and months are calendar periods: add `align: calendar`",
        ),
        (
            "        algorithm: fixed_window\n        rate: 10/7h\n        align: calendar\n",
            "7:15",
            "align: calendar takes a period of 1d, 1w or 1mo",
        ),
        (
            "        algorithm: fixed_window\n        rate: 10/1d\n        timezone: Europe/Berlin\n",
            "8:19",
            "timezone applies to calendar windows",
        ),
    ];
    for (i, (limit, at, message)) in cases.into_iter().enumerate() {
        let path = file(&format!("bad{i}.yaml"), limit);
        let out = tollgate()
            .args(["check", "--config", path.to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{limit}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with(&format!("{}:{at}: ", path.display())) && stderr.contains(message),
            "{stderr}"
        );
    }
}
