//! `reserve_ahead` (config/reserve.rs): refused where it is written on every limit its bound's
//! argument does not cover, and when the burst it leaves would not admit one request; loaded,
//! and shown by `/admin/config` in a form that loads back, otherwise.

use std::time::Duration;

use super::{assert_err, ok, with_limit, with_redis_limit};

/// The column of a value after `reserve_ahead: ` in a limit's mapping.
const COL: u64 = 9 + "reserve_ahead: ".len() as u64;

/// A limit of `fields` then `reserve_ahead: AHEAD`, with a `redis:` section: the
/// `reserve_ahead` line is `8 + fields.len()`.
fn reserving(fields: &[&str], ahead: &str) -> (String, u64) {
    let line = format!("reserve_ahead: {ahead}");
    let mut all = fields.to_vec();
    all.push(&line);
    (with_redis_limit(&all), 8 + fields.len() as u64)
}

#[test]
fn reserve_ahead_is_refused_off_gcra() {
    for alg in ["fixed_window", "sliding_window", "sliding_log"] {
        let (yaml, line) = reserving(&[&format!("algorithm: {alg}"), "rate: 10/1s"], "100ms");
        assert_err(
            &yaml,
            line,
            COL,
            &format!(
                "reserve_ahead applies to gcra limits only ({alg} is decided in Redis on every request; its decisions are batched instead)"
            ),
        );
    }
    let (yaml, line) = reserving(&["algorithm: concurrency", "max_in_flight: 5"], "100ms");
    assert_err(
        &yaml,
        line,
        COL,
        "reserve_ahead applies to gcra limits only (a concurrency limit's slots are leases",
    );
    // token_bucket and leaky_bucket are gcra.
    for alg in ["token_bucket", "leaky_bucket"] {
        let (yaml, _) = reserving(&[&format!("algorithm: {alg}"), "rate: 10/1s"], "100ms");
        let cfg = ok(&yaml);
        assert_eq!(
            cfg.routes[0].limits[0].reserve_ahead,
            Some(Duration::from_millis(100))
        );
    }
}

#[test]
fn reserve_ahead_is_refused_on_a_local_limit() {
    let (yaml, line) = reserving(&["rate: 10/1s", "scope: local"], "100ms");
    let why = "reserve_ahead needs scope: global (a local limit is decided in process already)";
    assert_err(&yaml, line, COL, why);
    // Without a `redis:` section a limit is local by default.
    let yaml = with_limit(&["rate: 10/1s", "reserve_ahead: 100ms"]);
    assert_err(&yaml, 7, COL, why);
}

#[test]
fn reserve_ahead_is_refused_on_an_eventual_limit() {
    let (yaml, line) = reserving(&["rate: 10/1s", "consistency: eventual"], "100ms");
    assert_err(
        &yaml,
        line,
        COL,
        "reserve_ahead is for consistency: strict limits (an eventual limit is spent in process already)",
    );
}

#[test]
fn reserve_ahead_is_refused_with_on_limit_delay() {
    let (yaml, line) = reserving(
        &["rate: 10/1s", "on_limit: delay", "max_delay: 1s"],
        "100ms",
    );
    assert_err(
        &yaml,
        line,
        COL,
        "reserve_ahead cannot be used with on_limit: delay (a delayed request takes its own place in Redis's queue): use on_limit: reject",
    );
}

#[test]
fn reserve_ahead_is_refused_with_settle() {
    let (yaml, line) = reserving(&["rate: 10/1s", "settle: { refund_status: 503 }"], "100ms");
    assert_err(
        &yaml,
        line,
        COL,
        "reserve_ahead cannot be used with settle (a settlement moves the key's state in Redis after units were spent in process)",
    );
}

/// Durations are whole milliseconds, so anything above 0 is at least `MIN_RESERVE_AHEAD`.
#[test]
fn reserve_ahead_is_at_least_a_millisecond() {
    let (yaml, line) = reserving(&["rate: 1000/1s"], "0.5ms");
    assert_err(
        &yaml,
        line,
        COL,
        "reserve_ahead: duration `0.5ms` is finer than a millisecond",
    );
    let (yaml, line) = reserving(&["rate: 1000/1s"], "0s");
    assert_err(&yaml, line, COL, "reserve_ahead must be longer than 0");
    let (yaml, line) = reserving(&["rate: 1000/1s"], "soon");
    assert_err(&yaml, line, COL, "`soon` is not a duration");
    let (yaml, _) = reserving(&["rate: 1000/1s"], "1ms");
    assert_eq!(
        ok(&yaml).routes[0].limits[0].reserve_ahead,
        Some(Duration::from_millis(1))
    );
}

/// The burst given up is `ceil(reserve_ahead / T)`; what it leaves must admit one request.
#[test]
fn reserve_ahead_must_leave_the_burst_one_request() {
    // T = 100 ms: 500 ms gives up 5, all of a burst of 5.
    let (yaml, line) = reserving(&["rate: 10/1s", "burst: 5"], "500ms");
    assert_err(
        &yaml,
        line,
        COL,
        "reserve_ahead 500ms gives up 5 of the burst of 5 (the units of 500ms at 10/1s), leaving 0, less than the cost 1: shorten reserve_ahead or raise burst",
    );
    // Rounded up: 450 ms is 4.5 intervals, 5 units.
    let (yaml, line) = reserving(&["rate: 10/1s", "burst: 5"], "450ms");
    assert_err(&yaml, line, COL, "gives up 5 of the burst of 5");
    // The cost counts: 1 left is too few for a cost of 2.
    let (yaml, line) = reserving(&["rate: 10/1s", "burst: 6", "cost: 2"], "500ms");
    assert_err(&yaml, line, COL, "leaving 1, less than the cost 2");
    // gcra's default burst is the count.
    let (yaml, line) = reserving(&["rate: 10/1s"], "1s");
    assert_err(&yaml, line, COL, "gives up 10 of the burst of 10");
    // Just enough.
    for (fields, ahead) in [
        (&["rate: 10/1s", "burst: 6"][..], "500ms"),
        (&["rate: 10/1s", "burst: 7", "cost: 2"][..], "500ms"),
        (&["rate: 10/1s"][..], "900ms"),
    ] {
        let (yaml, _) = reserving(fields, ahead);
        assert!(ok(&yaml).routes[0].limits[0].reserve_ahead.is_some());
    }
}

/// What `/admin/config` shows (the config as JSON) loads back to the same config: the field
/// as written, and absent where it was not.
#[test]
fn reserve_ahead_as_json_loads_back_to_itself() {
    let yaml = super::lines(&[
        "redis:",
        "  url: redis://127.0.0.1:6379",
        "routes:",
        "  - name: a",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - {name: r, key: [header:x-key], rate: 1000/1s, burst: 1000, reserve_ahead: 100ms}",
        "      - {name: s, key: [ip], algorithm: token_bucket, rate: 100/1s, burst: 200, cost: 2, reserve_ahead: 1.5s}",
        "      - {name: p, key: [ip], rate: 1000/1s}",
    ]);
    let cfg = ok(&yaml);
    let limits = &cfg.routes[0].limits;
    assert_eq!(limits[0].reserve_ahead, Some(Duration::from_millis(100)));
    assert_eq!(limits[1].reserve_ahead, Some(Duration::from_millis(1500)));
    assert_eq!(limits[2].reserve_ahead, None);
    let json = serde_json::to_value(&cfg).unwrap();
    let shown = &json["routes"][0]["limits"];
    assert_eq!(shown[0]["reserve_ahead"], "100ms");
    assert_eq!(shown[1]["reserve_ahead"], "1500ms");
    assert!(shown[2].get("reserve_ahead").is_none(), "{:#}", shown[2]);
    let back = super::parse(&serde_json::to_string_pretty(&json).unwrap())
        .unwrap_or_else(|e| panic!("{e}\n{json:#}"));
    assert_eq!(back, cfg);
}
