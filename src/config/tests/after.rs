//! Limits that end after the response: concurrency slots, their fields and what they refuse.

use std::time::Duration;

use super::super::types::{AlgorithmKind, OnLimit, Scope};
use super::{assert_err, ok, with_limit, with_redis_limit};

const SLOTS: &str = "algorithm: concurrency";

#[test]
fn a_concurrency_limit_and_its_defaults() {
    let cfg = ok(&with_limit(&[SLOTS, "max_in_flight: 4"]));
    let l = &cfg.routes[0].limits[0];
    assert_eq!(l.algorithm, AlgorithmKind::Concurrency);
    assert_eq!(l.scope, Scope::Local);
    let slots = l.concurrency.expect("slots");
    assert_eq!(slots.max_in_flight, 4);
    assert_eq!(slots.lease, Duration::from_secs(60));
    assert_eq!(slots.retry_after, Duration::from_secs(1));
    let cfg = ok(&with_redis_limit(&[
        SLOTS,
        "max_in_flight: 2",
        "lease: 90s",
        "retry_after: 500ms",
    ]));
    let l = &cfg.routes[0].limits[0];
    assert_eq!(l.scope, Scope::Global);
    let slots = l.concurrency.expect("slots");
    assert_eq!(
        (slots.lease, slots.retry_after),
        (Duration::from_secs(90), Duration::from_millis(500))
    );
}

#[test]
fn a_concurrency_limit_needs_max_in_flight() {
    assert_err(&with_limit(&[SLOTS]), 5, 9, "has no `max_in_flight`");
    assert_err(
        &with_limit(&[SLOTS, "max_in_flight: 0"]),
        7,
        24,
        "max_in_flight must be between 1 and",
    );
}

#[test]
fn rate_fields_are_refused_on_a_concurrency_limit() {
    for (field, fragment) in [
        ("rate: 1/s", "rate does not apply to a concurrency limit"),
        ("burst: 2", "burst does not apply"),
        ("cost: 2", "cost does not apply"),
        ("sync_interval: 1s", "sync_interval does not apply"),
        ("overrides_file: f.yaml", "overrides_file does not apply"),
    ] {
        let col = 9 + field.find(':').unwrap() as u64 + 2;
        assert_err(
            &with_limit(&[SLOTS, "max_in_flight: 1", field]),
            8,
            col,
            fragment,
        );
    }
    assert_err(
        &with_limit(&[
            SLOTS,
            "max_in_flight: 1",
            "overrides:",
            "  - { when: { key: [a] }, exempt: true }",
        ]),
        9,
        13,
        "overrides does not apply",
    );
}

#[test]
fn slot_fields_are_refused_on_a_rate_limit() {
    for field in ["max_in_flight: 3", "lease: 10s", "retry_after: 1s"] {
        let col = 9 + field.find(':').unwrap() as u64 + 2;
        assert_err(
            &with_limit(&["rate: 1/s", field]),
            7,
            col,
            "applies to algorithm: concurrency only",
        );
    }
}

#[test]
fn a_lease_is_at_least_a_second() {
    assert_err(
        &with_redis_limit(&[SLOTS, "max_in_flight: 1", "lease: 500ms"]),
        10,
        16,
        "at least 1s",
    );
    assert_err(
        &with_redis_limit(&[SLOTS, "max_in_flight: 1", "retry_after: 0s"]),
        10,
        22,
        "retry_after must be longer than 0",
    );
}

#[test]
fn slots_queue_with_delay_and_are_not_eventual() {
    for yaml in [
        with_limit(&[
            SLOTS,
            "max_in_flight: 1",
            "on_limit: delay",
            "max_delay: 1s",
        ]),
        with_redis_limit(&[
            SLOTS,
            "max_in_flight: 1",
            "on_limit: delay",
            "max_delay: 1s",
        ]),
    ] {
        let cfg = ok(&yaml);
        let l = &cfg.routes[0].limits[0];
        assert_eq!(
            (l.on_limit, l.max_delay),
            (OnLimit::Delay, Duration::from_secs(1))
        );
        let summary = crate::config::summary(&cfg);
        assert!(
            summary.contains(
                "max_in_flight 1, SCOPE, waits for a slot up to 1s (first come, first served), then 429 with Retry-After 1s"
                    .replace("SCOPE", &l.scope.to_string())
                    .as_str()
            ),
            "{summary}"
        );
        assert_eq!(
            summary.contains("other instances' within 50ms"),
            l.scope == Scope::Global,
            "{summary}"
        );
    }
    assert_err(
        &with_redis_limit(&[SLOTS, "max_in_flight: 1", "consistency: eventual"]),
        10,
        22,
        "consistency: eventual cannot count slots",
    );
}

/// A route's limits: a gcra limit `paced` (its `on_limit` as given), then a concurrency limit
/// `slots` (its `on_limit` as given, on line 14, column 19).
fn paced_and_slots(paced: &str, slots: &str) -> String {
    format!(
        "routes:
  - name: api
    upstream: http://127.0.0.1:9000
    limits:
      - name: paced
        rate: 10/1s
        on_limit: {paced}
        max_delay: 1s
      - name: slots
        key: [header:x-key]
        algorithm: concurrency
        max_in_flight: 1
        max_delay: 1s
        on_limit: {slots}
"
    )
}

#[test]
fn a_slot_queue_shares_no_route_with_another_delay_limit() {
    // One delay limit beside a rejecting one loads, whichever it is.
    ok(&paced_and_slots("reject", "delay"));
    ok(&paced_and_slots("delay", "reject"));
    assert_err(
        &paced_and_slots("delay", "delay"),
        14,
        19,
        "on_limit: delay on concurrency limit `slots` cannot share a route with another delay limit (`paced`)",
    );
    // A shared one is refused where the route uses it.
    let shared = "limits:
  - name: slots
    key: [header:x-key]
    algorithm: concurrency
    max_in_flight: 1
    on_limit: delay
    max_delay: 1s
routes:
  - name: api
    upstream: http://127.0.0.1:9000
    limits:
      - name: paced
        rate: 10/1s
        on_limit: delay
        max_delay: 1s
      - use: slots
";
    assert_err(
        shared,
        16,
        14,
        "concurrency limit `slots` cannot share a route",
    );
    // Two gcra delay limits still load, as before.
    let two = paced_and_slots("delay", "reject").replace(
        "        algorithm: concurrency\n        max_in_flight: 1\n",
        "        rate: 5/1s\n",
    );
    let two = two.replace("on_limit: reject", "on_limit: delay");
    ok(&two);
}

#[test]
fn a_concurrency_limit_reads_back_from_admin_config() {
    let cfg = ok(&with_redis_limit(&[
        SLOTS,
        "key: [header:x-api-key]",
        "max_in_flight: 4",
        "lease: 30s",
        "retry_after: 2s",
    ]));
    let json = serde_json::to_value(&cfg.routes[0].limits[0]).unwrap();
    assert_eq!(json["algorithm"], "concurrency");
    assert_eq!(json["max_in_flight"], 4);
    assert_eq!(json["lease"], "30s");
    assert_eq!(json["retry_after"], "2s");
    assert!(json.get("rate").is_none() && json.get("cost").is_none());
    let summary = crate::config::summary(&cfg);
    assert!(
        summary.contains("concurrency, max_in_flight 4, global, 429 with Retry-After 2s"),
        "{summary}"
    );
    assert!(
        summary.contains("gives its slots back after 30s"),
        "{summary}"
    );
}

#[test]
fn settle_and_its_fields() {
    let cfg = ok(&with_limit(&[
        "rate: 100000/1h",
        "cost: 500",
        "settle:",
        "  cost_header: X-Usage-Tokens",
        "  refund_status: [500-599, 429]",
    ]));
    let s = cfg.routes[0].limits[0].settle.clone().expect("settle");
    assert_eq!(
        s.cost_header.as_ref().map(|h| h.as_str()),
        Some("x-usage-tokens")
    );
    assert_eq!(s.refund_status, [(500, 599), (429, 429)]);
    assert!(s.refunds(503) && s.refunds(429) && !s.refunds(200) && !s.refunds(404));
    let one = ok(&with_limit(&[
        "rate: 1/s",
        "settle: { refund_status: 503 }",
    ]));
    assert_eq!(
        one.routes[0].limits[0]
            .settle
            .as_ref()
            .unwrap()
            .refund_status,
        [(503, 503)]
    );
    let json = serde_json::to_value(&cfg.routes[0].limits[0]).unwrap();
    assert_eq!(
        json["settle"],
        serde_json::json!({"cost_header": "x-usage-tokens", "refund_status": ["500-599", "429"]})
    );
    let summary = crate::config::summary(&cfg);
    assert!(
        summary.contains("settles after the response: charges the true cost from response header or trailer x-usage-tokens"),
        "{summary}"
    );
    assert!(
        summary.contains("gives the charge back on status 500-599, 429"),
        "{summary}"
    );
}

/// Every rate algorithm settles, strict or local: the window algorithms too (a daily token
/// quota on calendar days is the common case), global and local.
#[test]
fn settle_on_every_rate_algorithm() {
    let quota = ok(&with_redis_limit(&[
        "algorithm: fixed_window",
        "rate: 1000000/1d",
        "align: calendar",
        "timezone: Europe/Berlin",
        "cost: 500",
        "settle: { cost_header: x-usage-tokens }",
    ]));
    let l = &quota.routes[0].limits[0];
    assert_eq!(l.algorithm, AlgorithmKind::FixedWindow);
    assert_eq!(l.scope, Scope::Global);
    assert_eq!(
        l.settle
            .as_ref()
            .and_then(|s| s.cost_header.as_ref())
            .map(|h| h.as_str()),
        Some("x-usage-tokens")
    );
    for algorithm in ["gcra", "fixed_window", "sliding_window", "sliding_log"] {
        let alg = format!("algorithm: {algorithm}");
        for file in [
            with_limit(&[&alg, "rate: 10/s", "settle: { refund_status: 503 }"]),
            with_redis_limit(&[&alg, "rate: 10/s", "settle: { refund_status: 503 }"]),
        ] {
            let cfg = ok(&file);
            assert!(cfg.routes[0].limits[0].settle.is_some(), "{algorithm}");
        }
    }
}

#[test]
fn settle_refusals() {
    assert_err(
        &with_limit(&["rate: 1/s", "settle: {}"]),
        7,
        17,
        "settle needs cost_header",
    );
    assert_err(
        &with_limit(&[SLOTS, "max_in_flight: 1", "settle: { refund_status: 503 }"]),
        8,
        17,
        "there is no cost to settle",
    );
    assert_err(
        &with_redis_limit(&[
            "rate: 1/s",
            "consistency: eventual",
            "settle: { refund_status: 503 }",
        ]),
        10,
        17,
        "consistency: eventual exchanges counts",
    );
    // Eventual on the window algorithms too (sliding_log and calendar windows are decided as
    // strict anyway, with a warning, and settle there).
    for algorithm in ["fixed_window", "sliding_window"] {
        let alg = format!("algorithm: {algorithm}");
        assert_err(
            &with_redis_limit(&[
                &alg,
                "rate: 1/s",
                "consistency: eventual",
                "settle: { refund_status: 503 }",
            ]),
            11,
            17,
            "consistency: eventual exchanges counts",
        );
    }
    assert_err(
        &with_limit(&["rate: 1/s", "settle: { refund_status: [500-99] }"]),
        7,
        35,
        "`500-99` is not a status",
    );
    assert_err(
        &with_limit(&["rate: 1/s", "settle: { refund_status: [700] }"]),
        7,
        35,
        "`700` is not a status",
    );
    assert_err(
        &with_limit(&["rate: 1/s", "settle: { cost_header: \"bad header\" }"]),
        7,
        32,
        "is not a header name",
    );
}
