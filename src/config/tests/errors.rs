//! Refusals outside `limits:`: YAML, server, redis, routes, files.

use std::path::Path;

use super::super::load;
use super::{assert_err, lines, ok, with_limit};

// ---- what serde-saphyr refuses ----

#[test]
fn yaml_syntax_error() {
    assert_err("routes: [{name: a}\n", 1, 9, "unclosed");
}

#[test]
fn unknown_top_level_field() {
    assert_err("rotues: []\n", 1, 1, "unknown field `rotues`");
}

#[test]
fn unknown_limit_field() {
    let yaml = with_limit(&["rate: 1/s", "brust: 5"]);
    assert_err(&yaml, 7, 9, "unknown field `brust`");
}

#[test]
fn wrong_type() {
    let yaml = with_limit(&["rate: 1/s", "burst: many"]);
    assert_err(
        &yaml,
        7,
        16,
        "expected a whole number (digits only: no sign, no fraction)",
    );
    let yaml = lines(&[
        "routes:",
        "  - name: a",
        "    upstream: http://u",
        "    headers: maybe",
    ]);
    assert_err(&yaml, 4, 14, "expected true or false");
    assert_err("routes: 5\n", 1, 9, "expected a list");
    assert_err("server: [a]\n", 1, 9, "expected a mapping");
    let yaml = lines(&["routes:", "  - name: a", "    upstream: {url: x}"]);
    assert_err(&yaml, 3, 15, "expected a string or a list of strings");
}

#[test]
fn duplicate_key() {
    let yaml = with_limit(&["rate: 1/s", "rate: 2/s"]);
    assert_err(&yaml, 7, 9, "duplicate mapping key");
}

// ---- names ----

#[test]
fn duplicate_route_names() {
    let yaml = lines(&[
        "routes:",
        "  - name: api",
        "    upstream: http://u",
        "  - name: api",
        "    upstream: ftp://refused-but-the-name-comes-first",
    ]);
    assert_err(
        &yaml,
        4,
        11,
        "duplicate route name `api` (first used at line 2)",
    );
}

#[test]
fn duplicate_limit_names_within_a_route() {
    let yaml = lines(&[
        "routes:",
        "  - name: api",
        "    upstream: http://u",
        "    limits:",
        "      - name: l",
        "        rate: 1/s",
        "      - name: l",
        "        rate: 0/s",
    ]);
    assert_err(&yaml, 7, 15, "duplicate limit name `l` in route `api`");
}

#[test]
fn same_limit_name_in_two_routes_is_fine() {
    let yaml = lines(&[
        "routes:",
        "  - name: a",
        "    upstream: http://u",
        "    limits: [{name: l, rate: 1/s}]",
        "  - name: b",
        "    upstream: http://u",
        "    limits: [{name: l, rate: 1/s}]",
    ]);
    assert_eq!(super::ok(&yaml).routes.len(), 2);
}

#[test]
fn route_name_alphabet() {
    let yaml = lines(&["routes:", "  - name: my route", "    upstream: http://u"]);
    assert_err(
        &yaml,
        2,
        11,
        "may only contain letters, digits, `_`, `.` and `-`",
    );
}

#[test]
fn limit_name_alphabet() {
    let yaml = lines(&[
        "routes:",
        "  - name: api",
        "    upstream: http://u",
        "    limits:",
        "      - name: a/b",
        "        rate: 1/s",
    ]);
    assert_err(&yaml, 5, 15, "limit name `a/b` may only contain");
}

#[test]
fn route_without_name() {
    let yaml = lines(&["routes:", "  - upstream: http://u"]);
    assert_err(&yaml, 2, 5, "has no `name`");
}

// ---- server ----

#[test]
fn trusted_proxy_not_a_cidr() {
    let yaml = lines(&["server:", "  trusted_proxies: [10.0.0.0/8, 10.0.0.0/33]"]);
    assert_err(&yaml, 2, 33, "`10.0.0.0/33` is not a CIDR or an IP address");
}

#[test]
fn listen_not_a_listen_address() {
    let yaml = lines(&["server:", "  listen: example.com:8080"]);
    assert_err(&yaml, 2, 11, "`example.com:8080` is not a listen address");
}

#[test]
fn admin_not_a_listen_address() {
    let yaml = lines(&["server:", "  admin: 99999"]);
    assert_err(&yaml, 2, 10, "`99999` is not a listen address");
}

/// As nginx (`listen 8080`) and Go (`:8080`) spell them, and localhost.
#[test]
fn listen_addresses_as_operators_write_them() {
    let yaml = lines(&["server:", "  listen: ':8080'", "  admin: localhost:9191"]);
    let cfg = ok(&yaml);
    assert_eq!(cfg.server.listen.to_string(), "0.0.0.0:8080");
    assert_eq!(cfg.server.admin.to_string(), "127.0.0.1:9191");
    // A port alone: every interface for the proxy, loopback for the admin listener.
    let yaml = lines(&["server:", "  listen: 8081", "  admin: ':9192'"]);
    let cfg = ok(&yaml);
    assert_eq!(cfg.server.listen.to_string(), "0.0.0.0:8081");
    assert_eq!(cfg.server.admin.to_string(), "127.0.0.1:9192");
    assert_err(
        &lines(&["server:", "  listen: '+80'"]),
        2,
        11,
        "not a listen address",
    );
}

#[test]
fn admin_and_listen_on_the_same_port() {
    let yaml = lines(&[
        "server:",
        "  listen: 0.0.0.0:9000",
        "  admin: 127.0.0.1:9000",
    ]);
    assert_err(&yaml, 3, 10, "would bind the same port");
}

#[test]
fn ephemeral_ports_may_repeat() {
    let yaml = lines(&["server:", "  listen: 127.0.0.1:0", "  admin: 127.0.0.1:0"]);
    assert_eq!(super::ok(&yaml).server.admin.port(), 0);
}

#[test]
fn duration_not_understood() {
    for (bad, why) in [
        ("1.5.5s", "is not a duration"),
        ("1.s", "is not a duration"),
        (".5s", "is not a duration"),
        ("1m30s", "is not a duration"),
        ("1.0005s", "is finer than a millisecond"),
        ("0.0000000000001d", "has too many decimals"),
    ] {
        let yaml = lines(&["server:", &format!("  grace_period: {bad}")]);
        assert_err(&yaml, 2, 17, &format!("`{bad}` {why}"));
    }
}

#[test]
fn max_keys_must_be_a_whole_number_of_at_least_1024() {
    let yaml = lines(&["server:", "  max_keys: 1023"]);
    assert_err(
        &yaml,
        2,
        13,
        "max_keys 1023 is too small: give at least 1024",
    );
    for bad in ["-5", "1.5", "lots", "1m"] {
        let yaml = lines(&["server:", &format!("  max_keys: {bad}")]);
        assert_err(&yaml, 2, 13, "expected a whole number");
    }
    let cfg = ok(&lines(&["server:", "  max_keys: 1024"]));
    assert_eq!(cfg.server.max_keys, 1024);
    // Left out: the default for this machine's memory.
    let cfg = ok("routes: []\n");
    assert_eq!(
        cfg.server.max_keys,
        crate::limit::budget::default_max_keys().keys
    );
}

#[test]
fn decimal_durations_in_whole_milliseconds() {
    for (text, ms) in [
        ("1.5s", 1_500),
        ("0.5s", 500),
        ("0.25m", 15_000),
        ("1.5", 1_500),
        ("2.000ms", 2),
    ] {
        let yaml = lines(&["server:", &format!("  grace_period: {text}")]);
        let cfg = super::parse(&yaml).unwrap();
        assert_eq!(
            cfg.server.grace_period,
            std::time::Duration::from_millis(ms),
            "{text}"
        );
    }
    let yaml = lines(&[
        "routes:",
        "  - name: a",
        "    upstream: http://127.0.0.1:1",
        "    limits:",
        "      - {name: l, rate: 3/1.5s}",
    ]);
    let cfg = super::parse(&yaml).unwrap();
    assert_eq!(
        cfg.routes[0].limits[0].rate.period,
        std::time::Duration::from_millis(1_500)
    );
}

#[test]
fn empty_admin_token() {
    let yaml = lines(&["server:", "  admin_token: ''"]);
    assert_err(&yaml, 2, 16, "admin_token must be non-empty");
}

// ---- redis ----

#[test]
fn redis_url_and_cluster() {
    let yaml = lines(&[
        "redis:",
        "  url: redis://a:6379",
        "  cluster: [redis://b:7000]",
    ]);
    assert_err(&yaml, 3, 12, "not both");
}

#[test]
fn redis_without_target() {
    let yaml = lines(&["redis:", "  timeout: 50ms"]);
    assert_err(
        &yaml,
        2,
        3,
        "redis needs `url: redis://HOST:PORT` or `cluster:",
    );
}

#[test]
fn redis_url_scheme() {
    let yaml = lines(&["redis:", "  url: http://a:6379"]);
    assert_err(&yaml, 2, 8, "must start with redis:// or rediss://");
}

#[test]
fn redis_cluster_node_scheme() {
    let yaml = lines(&["redis:", "  cluster: [redis://a:1, b:2]"]);
    assert_err(&yaml, 2, 26, "`b:2` must start with redis://");
}

#[test]
fn redis_cluster_empty() {
    let yaml = lines(&["redis:", "  cluster: []"]);
    assert_err(&yaml, 2, 12, "cluster lists no node");
}

#[test]
fn redis_url_without_host() {
    let yaml = lines(&["redis:", "  url: redis://:6379"]);
    assert_err(&yaml, 2, 8, "has no host");
}

/// `check` reads a Redis URL as the client will: what it refuses, `check` refuses at the
/// URL's position (it used to pass them, and `run` then served as if Redis were down).
#[test]
fn redis_url_the_client_cannot_read() {
    for (url, why) in [
        ("redis://[bad", "InvalidIpv6Address"),
        ("redis://h:99999", "InvalidPort"),
        ("redis://h:6379/db", "does not parse"),
    ] {
        let yaml = lines(&["redis:", &format!("  url: \"{url}\"")]);
        assert_err(&yaml, 2, 8, why);
    }
    let yaml = lines(&[
        "redis:",
        "  cluster:",
        "    - redis://a:7000",
        "    - \"redis://b:70000\"",
    ]);
    assert_err(&yaml, 4, 7, "InvalidPort");
}

#[test]
fn redis_on_error_keyword() {
    let yaml = lines(&["redis:", "  url: redis://a", "  on_error: maybe"]);
    assert_err(
        &yaml,
        3,
        13,
        "`maybe` is not a valid on_error: use allow | deny",
    );
}

#[test]
fn redis_zero_timeout_and_pool() {
    let yaml = lines(&["redis:", "  url: redis://a", "  timeout: 0ms"]);
    assert_err(&yaml, 3, 12, "timeout must be longer than 0");
    let yaml = lines(&["redis:", "  url: redis://a", "  pool_size: 0"]);
    assert_err(&yaml, 3, 14, "pool_size must be at least 1");
    let yaml = lines(&["redis:", "  url: redis://a", "  batch_max: 0"]);
    assert_err(
        &yaml,
        3,
        14,
        "batch_max must be between 1 (no batching) and 1024, got 0",
    );
    let yaml = lines(&["redis:", "  url: redis://a", "  batch_max: 5000"]);
    assert_err(
        &yaml,
        3,
        14,
        "batch_max must be between 1 (no batching) and 1024, got 5000",
    );
}

// ---- routes: upstream ----

#[test]
fn route_without_upstream() {
    let yaml = lines(&["routes:", "  - name: api", "    timeout: 5s"]);
    assert_err(&yaml, 2, 5, "route `api` has no upstream");
}

#[test]
fn empty_upstream_list() {
    let yaml = lines(&["routes:", "  - name: api", "    upstream: []"]);
    assert_err(&yaml, 3, 15, "upstream list is empty");
}

#[track_caller]
fn assert_upstream_err(url: &str, fragment: &str) {
    let yaml = lines(&[
        "routes:",
        "  - name: api",
        "    upstream:",
        "      - http://ok:1",
        &format!("      - {url}"),
    ]);
    assert_err(&yaml, 5, 9, fragment);
}

#[test]
fn upstream_that_does_not_parse() {
    assert_upstream_err("http://exa mple", "is not a valid URL");
}

#[test]
fn upstream_scheme() {
    assert_upstream_err("ftp://files:21", "has scheme ftp: only http and https");
    assert_upstream_err("127.0.0.1:9000", "has no scheme");
}

#[test]
fn upstream_without_host() {
    assert_upstream_err("/just/a/path", "has no scheme");
    assert_upstream_err("http://:80", "has no host");
}

#[test]
fn upstream_query_port_credentials_fragment() {
    assert_upstream_err("http://u/x?a=1", "has a query");
    assert_upstream_err("http://u:99999", "invalid port `99999`");
    assert_upstream_err("http://u:0", "invalid port `0`");
    assert_upstream_err("http://me:pw@u", "credentials");
    assert_upstream_err("http://u/#top", "fragment");
}

#[test]
fn zero_route_timeout() {
    let yaml = lines(&[
        "routes:",
        "  - name: api",
        "    upstream: http://u",
        "    timeout: 0s",
    ]);
    assert_err(&yaml, 4, 14, "timeout must be longer than 0");
}

// ---- routes: match ----

fn with_match(match_lines: &[&str]) -> String {
    let mut all = vec![
        "routes:",
        "  - name: api",
        "    upstream: http://u",
        "    match:",
    ];
    all.extend_from_slice(match_lines);
    lines(&all)
}

#[test]
fn path_and_path_prefix() {
    let yaml = with_match(&["      path: /a", "      path_prefix: /b"]);
    assert_err(&yaml, 6, 20, "both `path` and `path_prefix`");
}

#[test]
fn path_must_start_with_slash() {
    assert_err(
        &with_match(&["      path: v1"]),
        5,
        13,
        "path `v1` must start with `/`",
    );
    assert_err(
        &with_match(&["      path_prefix: v1/"]),
        5,
        20,
        "must start with `/`",
    );
    assert_err(&with_match(&["      path: /a?b=c"]), 5, 13, "without query");
}

#[test]
fn host_with_port_or_wildcard() {
    assert_err(
        &with_match(&["      host: api.example.com:8080"]),
        5,
        13,
        "has a port",
    );
    assert_err(
        &with_match(&["      host: '*.example.com'"]),
        5,
        13,
        "wildcard",
    );
}

#[test]
fn methods_invalid_or_empty() {
    assert_err(
        &with_match(&["      methods: [GET, 'B AD']"]),
        5,
        22,
        "`B AD` is not an HTTP method",
    );
    assert_err(
        &with_match(&["      methods: []"]),
        5,
        16,
        "would match nothing",
    );
}

// ---- files and error text ----

#[test]
fn unreadable_file_has_no_position() {
    let path = Path::new("/nonexistent/tollgate/routes.yaml");
    let e = load(path).unwrap_err();
    assert_eq!((e.line, e.column), (0, 0));
    let text = e.to_string();
    assert!(
        text.starts_with("/nonexistent/tollgate/routes.yaml: cannot read the config file: "),
        "{text}"
    );
}

#[test]
fn invalid_utf8_points_at_the_byte() {
    let path = std::env::temp_dir().join(format!("tollgate-cfg-utf8-{}.yaml", std::process::id()));
    std::fs::write(&path, b"routes:\n  - name: a\xff\n").unwrap();
    let e = load(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(
        (e.line, e.column, e.message.as_str()),
        (2, 12, "the file is not valid UTF-8")
    );
}

#[test]
fn load_reads_the_file() {
    let path = std::env::temp_dir().join(format!("tollgate-cfg-load-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        "routes:\n  - name: a\n    upstream: http://u\n    bogus: 1\n",
    )
    .unwrap();
    let e = load(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(
        e.to_string(),
        format!(
            "{}:4:5: unknown field `bogus`, expected one of name, match, upstream, timeout, preserve_host, headers, limits, rejection",
            path.display()
        )
    );
}

// ---- rejection ----

/// One route with `rejection:` made of `lines` (from line 5 on, keys at column 7).
fn with_rejection(lines_: &[&str]) -> String {
    let mut all = vec![
        "routes:".to_owned(),
        "  - name: api".to_owned(),
        "    upstream: http://127.0.0.1:9000".to_owned(),
        "    rejection:".to_owned(),
    ];
    all.extend(lines_.iter().map(|l| format!("      {l}")));
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    lines(&refs)
}

#[test]
fn rejection_status_is_a_4xx_or_5xx() {
    for status in ["200", "399", "600", "99999"] {
        assert_err(
            &with_rejection(&[&format!("status: {status}")]),
            5,
            15,
            &format!("rejection status {status} is not a 4xx or 5xx"),
        );
    }
    for status in [400u16, 429, 503, 599] {
        let cfg = ok(&with_rejection(&[&format!("status: {status}")]));
        let r = cfg.routes[0].rejection.as_ref().unwrap();
        assert_eq!(r.status.as_u16(), status);
        // The rest defaults to tollgate's own 429's.
        assert_eq!(r.content_type, "application/json");
        assert!(r.body.json() && !r.legacy_headers);
    }
}

#[test]
fn rejection_body_placeholders_are_known_ones() {
    assert_err(
        &with_rejection(&[r#"body: '{"wait":{retry_in}}'"#]),
        5,
        13,
        "unknown placeholder `{retry_in}` in the body: use {route}, {limit}, {retry_after} or {retry_after_ms}",
    );
    assert_err(
        &with_rejection(&["content_type: text/plain", "body: 'slow down, {Route}'"]),
        6,
        13,
        "unknown placeholder `{Route}`",
    );
    let cfg = ok(&with_rejection(&[
        "content_type: text/plain; charset=utf-8",
        "body: 'slow down {{{route}}} for {retry_after}s'",
    ]));
    let r = cfg.routes[0].rejection.as_ref().unwrap();
    assert!(!r.body.json());
    assert_eq!(r.body.source(), "slow down {{{route}}} for {retry_after}s");
    let text = crate::config::summary(&cfg);
    assert!(
        text.contains(
            r#"  rejected with 429 text/plain; charset=utf-8, body "slow down {{{route}}} for {retry_after}s""#
        ),
        "{text}"
    );
}

#[test]
fn rejection_content_type_is_a_field_value() {
    assert_err(
        &with_rejection(&["content_type: ''"]),
        5,
        21,
        "content_type `` is not a field value",
    );
    assert_err(
        &with_rejection(&["content_type: \"text/plain\\nx: y\""]),
        5,
        21,
        "is not a field value",
    );
    assert_err(
        &with_rejection(&["stauts: 503"]),
        5,
        7,
        "unknown field `stauts`",
    );
}

/// A JSON body that is not JSON once filled in loads, with a warning at the body.
#[test]
fn rejection_json_body_that_is_not_json_warns() {
    let cfg = ok(&with_rejection(&[r#"body: '{"a":{"b":{retry_after}}}'"#]));
    assert_eq!(cfg.warnings.len(), 1, "{:?}", cfg.warnings);
    let w = &cfg.warnings[0];
    assert_eq!((w.line, w.column), (5, 13));
    assert!(
        w.message.starts_with("warning: content_type is JSON"),
        "{w}"
    );
    let cfg = ok(&with_rejection(&[
        r#"body: '{"a":{"b":{retry_after}}}}}'"#,
        "legacy_headers: true",
    ]));
    assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
    assert!(cfg.routes[0].rejection.as_ref().unwrap().legacy_headers);
}
