//! Refusals inside `limits:` (see `with_limit` for where positions come from).

use std::time::Duration;

use super::super::{AlgorithmKind, Consistency, KeyPart, OnLimit, OnMissing};
use super::{assert_err, ok, with_limit, with_redis_limit};

#[test]
fn rate_that_does_not_parse() {
    assert_err(&with_limit(&["rate: 100 per minute"]), 6, 15, "has no `/`");
    assert_err(
        &with_limit(&["rate: 100/1x"]),
        6,
        15,
        "`1x` is not a duration",
    );
    assert_err(
        &with_limit(&["rate: 100/60"]),
        6,
        15,
        "the period needs a unit",
    );
    assert_err(
        &with_limit(&["rate: ten/1s"]),
        6,
        15,
        "`ten` is not a count",
    );
    assert_err(&with_limit(&["rate: 100"]), 6, 15, "has no `/`");
}

#[test]
fn rate_count_zero() {
    assert_err(
        &with_limit(&["rate: 0/1s"]),
        6,
        15,
        "admits nothing: the count must be at least 1",
    );
}

#[test]
fn rate_period_zero() {
    assert_err(
        &with_limit(&["rate: 10/0s"]),
        6,
        15,
        "the period must be longer than 0",
    );
}

#[test]
fn limit_without_rate() {
    assert_err(&with_limit(&["key: ip"]), 5, 9, "limit `l` has no `rate`");
}

#[test]
fn cost_zero() {
    assert_err(
        &with_limit(&["rate: 10/1s", "cost: 0"]),
        7,
        15,
        "cost must be at least 1",
    );
}

#[test]
fn cost_above_gcra_burst() {
    let yaml = with_limit(&["rate: 100/1m", "burst: 20", "cost: 30"]);
    assert_err(
        &yaml,
        8,
        15,
        "cost 30 can never be admitted: the limit admits at most 20 at once",
    );
    // burst defaults to the count
    let yaml = with_limit(&["rate: 10/1s", "cost: 11"]);
    assert_err(
        &yaml,
        7,
        15,
        "cost 11 can never be admitted: the limit admits at most 10 at once",
    );
    let cfg = ok(&with_limit(&["rate: 100/1m", "burst: 20", "cost: 20"]));
    assert_eq!(cfg.routes[0].limits[0].cost, 20);
}

#[test]
fn cost_above_window_count() {
    for algorithm in ["fixed_window", "sliding_window", "sliding_log"] {
        let alg = format!("algorithm: {algorithm}");
        let yaml = with_limit(&[&alg, "rate: 20/1m", "cost: 30"]);
        assert_err(
            &yaml,
            8,
            15,
            "cost 30 can never be admitted: the limit admits at most 20 at once",
        );
        assert_eq!(
            ok(&with_limit(&[&alg, "rate: 20/1m", "cost: 20"])).routes[0].limits[0].cost,
            20
        );
    }
}

#[test]
fn burst_zero() {
    assert_err(
        &with_limit(&["rate: 10/1s", "burst: 0"]),
        7,
        16,
        "burst must be at least 1",
    );
}

/// The warnings a file loads with, as `LINE:COL: message`.
fn warnings(yaml: &str) -> Vec<String> {
    ok(yaml)
        .warnings
        .iter()
        .map(|w| format!("{}:{}: {}", w.line, w.column, w.message))
        .collect()
}

#[test]
fn burst_on_other_algorithms_loads_with_a_warning_and_is_ignored() {
    for alg in ["fixed_window", "sliding_window", "sliding_log"] {
        let yaml = with_limit(&[&format!("algorithm: {alg}"), "rate: 10/1s", "burst: 5"]);
        assert_eq!(ok(&yaml).routes[0].limits[0].burst, 10, "{alg}");
        let w = warnings(&yaml);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("8:16: warning: burst applies to gcra only and is ignored"),
            "{w:?}"
        );
    }
    // On gcra it is the bucket's size, and no warning.
    let yaml = with_limit(&["rate: 10/1s", "burst: 5"]);
    assert_eq!(ok(&yaml).routes[0].limits[0].burst, 5);
    assert!(warnings(&yaml).is_empty());
}

#[test]
fn delay_needs_gcra() {
    let yaml = with_limit(&[
        "algorithm: sliding_window",
        "rate: 10/1s",
        "on_limit: delay",
        "max_delay: 1s",
    ]);
    assert_err(
        &yaml,
        8,
        19,
        "delay needs an algorithm that can reserve: gcra",
    );
}

#[test]
fn delay_without_max_delay_loads_with_a_warning_and_never_waits() {
    for (extra, at) in [(&["max_delay: 0s"][..], "8:20"), (&[][..], "7:19")] {
        let mut lines = vec!["rate: 10/1s", "on_limit: delay"];
        lines.extend_from_slice(extra);
        let yaml = with_limit(&lines);
        let l = &ok(&yaml).routes[0].limits[0];
        assert_eq!((l.on_limit, l.max_delay), (OnLimit::Delay, Duration::ZERO));
        let w = warnings(&yaml);
        assert_eq!(
            w,
            [format!(
                "{at}: warning: on_limit: delay with max_delay 0 never waits: a request that would wait is rejected (set max_delay, e.g. 500ms)"
            )]
        );
    }
    let yaml = with_limit(&["rate: 10/1s", "on_limit: delay", "max_delay: 1s"]);
    assert!(warnings(&yaml).is_empty());
}

#[test]
fn max_delay_without_delay_loads_with_a_warning() {
    let yaml = with_limit(&["rate: 10/1s", "max_delay: 2s"]);
    assert_eq!(ok(&yaml).routes[0].limits[0].on_limit, OnLimit::Reject);
    assert_eq!(
        warnings(&yaml),
        [
            "7:20: warning: max_delay 2s has no effect with on_limit: reject (add on_limit: delay to wait)"
        ]
    );
    // 0s is what "no delay" looks like written out (the spec's example does it): no warning.
    let yaml = with_limit(&["rate: 10/1s", "on_limit: reject", "max_delay: 0s"]);
    assert_eq!(ok(&yaml).routes[0].limits[0].max_delay, Duration::ZERO);
    assert!(warnings(&yaml).is_empty());
}

#[test]
fn global_scope_needs_redis() {
    let yaml = with_limit(&["rate: 10/1s", "scope: global"]);
    assert_err(&yaml, 7, 16, "scope: global needs a `redis` section");
}

#[test]
fn eventual_the_log_and_a_delay_cannot_keep_loads_as_strict_with_a_warning() {
    // gcra is the default algorithm: an eventual limit that names none is valid.
    let yaml = with_redis_limit(&["rate: 10/1s", "consistency: eventual"]);
    let l = &ok(&yaml).routes[0].limits[0];
    assert_eq!(
        (l.algorithm, l.consistency),
        (AlgorithmKind::Gcra, Consistency::Eventual)
    );
    assert!(warnings(&yaml).is_empty());
    let yaml = with_redis_limit(&[
        "algorithm: sliding_log",
        "rate: 10/1s",
        "consistency: eventual",
    ]);
    assert_eq!(
        ok(&yaml).routes[0].limits[0].consistency,
        Consistency::Strict
    );
    assert_eq!(
        warnings(&yaml),
        [
            "10:22: warning: consistency: eventual is decided as strict for this limit (an exact log cannot be merged from counts): every decision goes to Redis"
        ]
    );
    let yaml = with_redis_limit(&[
        "rate: 10/1s",
        "on_limit: delay",
        "max_delay: 1s",
        "consistency: eventual",
    ]);
    let l = &ok(&yaml).routes[0].limits[0];
    assert_eq!(
        (l.consistency, l.on_limit, l.max_delay),
        (Consistency::Strict, OnLimit::Delay, Duration::from_secs(1))
    );
    let w = warnings(&yaml);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].starts_with("11:22: warning: consistency: eventual is decided as strict for this limit (a reserved slot"),
        "{w:?}"
    );
    // A delay that never waits reserves nothing: it stays eventual (warned for the delay).
    let yaml = with_redis_limit(&["rate: 10/1s", "on_limit: delay", "consistency: eventual"]);
    assert_eq!(
        ok(&yaml).routes[0].limits[0].consistency,
        Consistency::Eventual
    );
    let w = warnings(&yaml);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("max_delay 0 never waits"), "{w:?}");
}

#[test]
fn eventual_needs_a_shared_store() {
    let yaml = with_redis_limit(&[
        "algorithm: fixed_window",
        "rate: 10/1s",
        "scope: local",
        "consistency: eventual",
    ]);
    assert_err(&yaml, 11, 22, "eventual needs a shared store");
    let yaml = with_limit(&[
        "algorithm: fixed_window",
        "rate: 10/1s",
        "consistency: eventual",
    ]);
    assert_err(&yaml, 8, 22, "eventual needs a shared store");
}

#[test]
fn eventual_accepted_where_it_makes_sense() {
    let yaml = with_redis_limit(&[
        "algorithm: sliding_window",
        "rate: 10/1s",
        "consistency: eventual",
        "sync_interval: 250ms",
    ]);
    let l = &ok(&yaml).routes[0].limits[0];
    assert_eq!(l.sync_interval, Duration::from_millis(250));
}

#[test]
fn sync_interval_zero() {
    let yaml = with_limit(&["rate: 10/1s", "sync_interval: 0ms"]);
    assert_err(&yaml, 7, 24, "sync_interval must be longer than 0");
}

#[test]
fn rates_beyond_double_precision() {
    // COUNT × PERIOD beyond 2^53 is fine (the scripts multiply exactly)...
    let yaml = with_limit(&["algorithm: sliding_window", "rate: 1000000/1d"]);
    assert_eq!(ok(&yaml).routes[0].limits[0].rate.count, 1_000_000);
    // ...but a count above 2^50 is not.
    let yaml = with_limit(&["algorithm: sliding_window", "rate: 1125899906842625/1d"]);
    assert_err(&yaml, 7, 15, "compute with doubles");
}

#[test]
fn burst_beyond_double_precision() {
    assert_eq!(
        ok(&with_limit(&["rate: 1/1s", "burst: 1125899906842624"])).routes[0].limits[0].burst,
        1 << 50
    );
    assert_err(
        &with_limit(&["rate: 1/1s", "burst: 18446744073709551615"]),
        7,
        16,
        "burst 18446744073709551615 is too large",
    );
}

#[test]
fn gcra_finer_than_a_microsecond() {
    assert_err(
        &with_limit(&["rate: 2000001/2s"]),
        6,
        15,
        "finer than one per microsecond",
    );
    assert_eq!(
        ok(&with_limit(&["rate: 2000000/2s"])).routes[0].limits[0]
            .rate
            .count,
        2_000_000
    );
}

#[test]
fn key_parts() {
    let yaml = with_limit(&[
        "key: [ip, 'header:X-User-Id', query:q, path, method, route, 'literal:a b']",
        "rate: 1/s",
    ]);
    let key = &ok(&yaml).routes[0].limits[0].key;
    assert_eq!(
        key,
        &[
            KeyPart::Ip,
            KeyPart::Header(http::HeaderName::from_static("x-user-id")),
            KeyPart::Query("q".into()),
            KeyPart::Path,
            KeyPart::Method,
            KeyPart::Route,
            KeyPart::Literal("a b".into()),
        ]
    );
    let yaml = with_limit(&["key: header:x-api-key", "rate: 1/s"]);
    let key = &ok(&yaml).routes[0].limits[0].key;
    assert_eq!(
        key,
        &[KeyPart::Header(http::HeaderName::from_static("x-api-key"))]
    );
}

#[test]
fn key_part_errors() {
    assert_err(
        &with_limit(&["key: [ip, 'cookie:x']", "rate: 1/s"]),
        6,
        19,
        "`cookie:x` is not a key part: use ip | ip_prefix:V4,V6 | header:NAME",
    );
    assert_err(
        &with_limit(&["key: 'header:bad name'", "rate: 1/s"]),
        6,
        14,
        "is not a header name",
    );
    assert_err(
        &with_limit(&["key: []", "rate: 1/s"]),
        6,
        14,
        "key is empty",
    );
    assert_err(
        &with_limit(&["key: 'query:'", "rate: 1/s"]),
        6,
        14,
        "not a key part",
    );
}

#[test]
fn ip_prefix_lengths() {
    let yaml = with_limit(&["key: [\"ip_prefix:24,56\", route]", "rate: 1/s"]);
    assert_eq!(
        ok(&yaml).routes[0].limits[0].key,
        [KeyPart::IpPrefix { v4: 24, v6: 56 }, KeyPart::Route]
    );
    // `check`'s summary names it as written.
    let text = crate::config::summary(&ok(&yaml));
    assert!(text.contains("key ip_prefix:24,56+route"), "{text}");
    let yaml = with_limit(&["key: 'ip_prefix: 0 , 128'", "rate: 1/s"]);
    assert_eq!(
        ok(&yaml).routes[0].limits[0].key,
        [KeyPart::IpPrefix { v4: 0, v6: 128 }]
    );
    for (text, col, why) in [
        ("'ip_prefix:33,64'", 14, "`33` is not an IPv4 prefix length"),
        (
            "'ip_prefix:32,129'",
            14,
            "`129` is not an IPv6 prefix length",
        ),
        ("'ip_prefix:32'", 14, "give both prefix lengths"),
        ("'ip_prefix:'", 14, "give both prefix lengths"),
        ("'ip_prefix:-1,64'", 14, "`-1` is not an IPv4 prefix length"),
        ("'ip_prefix:24,'", 14, "`` is not an IPv6 prefix length"),
        (
            "[ip, 'ip_prefix:a,64']",
            19,
            "`a` is not an IPv4 prefix length",
        ),
    ] {
        assert_err(
            &with_limit(&[&format!("key: {text}"), "rate: 1/s"]),
            6,
            col,
            why,
        );
    }
}

#[test]
fn keywords_list_what_is_allowed() {
    assert_err(
        &with_limit(&["rate: 1/s", "algorithm: token-bucket"]),
        7,
        20,
        "use gcra | token_bucket | leaky_bucket | fixed_window | sliding_window | sliding_log",
    );
    assert_err(
        &with_limit(&["rate: 1/s", "on_missing: allow"]),
        7,
        21,
        "use skip | ip | reject",
    );
    assert_err(
        &with_limit(&["rate: 1/s", "scope: cluster"]),
        7,
        16,
        "use local | global",
    );
    assert_err(
        &with_limit(&["rate: 1/s", "on_limit: drop"]),
        7,
        19,
        "use reject | delay",
    );
    assert_err(
        &with_limit(&["rate: 1/s", "consistency: weak"]),
        7,
        22,
        "use strict | eventual",
    );
}

#[test]
fn algorithm_aliases() {
    for (word, kind) in [
        ("gcra", AlgorithmKind::Gcra),
        ("token_bucket", AlgorithmKind::Gcra),
        ("leaky_bucket", AlgorithmKind::Gcra),
        ("fixed_window", AlgorithmKind::FixedWindow),
        ("sliding_window", AlgorithmKind::SlidingWindow),
        ("sliding_log", AlgorithmKind::SlidingLog),
    ] {
        let alg = format!("algorithm: {word}");
        assert_eq!(
            ok(&with_limit(&[&alg, "rate: 1/s"])).routes[0].limits[0].algorithm,
            kind
        );
    }
    let yaml = with_limit(&["rate: 1/s", "on_missing: reject"]);
    assert_eq!(ok(&yaml).routes[0].limits[0].on_missing, OnMissing::Reject);
}
