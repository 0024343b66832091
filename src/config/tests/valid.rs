//! Valid files: defaults, the spec's and the shipped example, summary, JSON.

use std::time::Duration;

use http::{HeaderName, Method, Uri};

use super::super::rate::{parse_duration, parse_rate};
use super::super::{
    AlgorithmKind, Config, Consistency, KeyPart, LimitConfig, OnError, OnLimit, OnMissing,
    PathMatch, Rate, RedisConfig, RedisTarget, RouteConfig, RouteMatch, Scope, ServerConfig,
    summary,
};
use super::{lines, ok};

/// The `users` block of the contract, verbatim.
const SPEC_EXAMPLE: &str = r#"
server:
  listen: 0.0.0.0:8080          # proxy listener
  admin: 127.0.0.1:9090         # /metrics, /healthz, /readyz, /admin/*
  trusted_proxies: [10.0.0.0/8] # CIDRs whose X-Forwarded-For / Forwarded is believed; default none
redis:                          # optional: without it every limit is local to the instance
  url: redis://127.0.0.1:6379   # or `cluster: [redis://h1:7000, redis://h2:7001, ...]`
  timeout: 50ms                 # per command
  on_error: allow               # allow = fall back to the local limit; deny = reply 503
routes:                         # first match wins, in file order
  - name: users                 # unique; used in metrics labels and Redis keys
    match:
      path_prefix: /v1/users    # or `path: /exact` ; optional `host:`, `methods: [GET, POST]`
    upstream: http://127.0.0.1:9000      # or a list, balanced round-robin; https:// allowed
    timeout: 30s                # whole upstream exchange; past it: 504
    preserve_host: true         # forward the client's Host (false: the upstream's)
    headers: true               # RateLimit fields on admitted responses too
    limits:                     # all must admit a request; a rejected request consumes from none
      - name: per-user
        key: [header:x-user-id] # parts joined: ip | header:NAME | query:NAME | path | method | route | literal:TEXT
        on_missing: skip        # a key part is absent: skip (limit does not apply) | ip | reject
        algorithm: gcra         # gcra (= token_bucket = leaky_bucket) | sliding_window | fixed_window | sliding_log
        rate: 100/1m            # COUNT/PERIOD, PERIOD like 1s, 30s, 1m, 1h, 1d
        burst: 20               # gcra only; default = COUNT
        scope: global           # local (this instance) | global (Redis); default global when redis is set
        cost: 1                 # units one request takes; default 1
        on_limit: reject        # reject (429) | delay (wait up to max_delay, then forward)
        max_delay: 0s
        shadow: false           # true: count and report, never reject
        consistency: strict     # strict (every decision in Redis) | eventual (local decision, sync_interval)
        sync_interval: 100ms
"#;

const SHIPPED: &str = include_str!("../../../routes.yaml");

fn uri(s: &str) -> Uri {
    s.parse().unwrap()
}

fn spec_limit() -> LimitConfig {
    LimitConfig {
        name: "per-user".into(),
        key: vec![KeyPart::Header(HeaderName::from_static("x-user-id"))],
        on_missing: OnMissing::Skip,
        algorithm: AlgorithmKind::Gcra,
        rate: Rate {
            count: 100,
            period: Duration::from_secs(60),
        },
        burst: 20,
        scope: Scope::Global,
        cost: 1,
        on_limit: OnLimit::Reject,
        max_delay: Duration::ZERO,
        shadow: false,
        consistency: Consistency::Strict,
        sync_interval: Duration::from_millis(100),
        calendar: None,
        overrides: Vec::new(),
        overrides_file: None,
        shared: false,
        concurrency: None,
        settle: None,
        reserve_ahead: None,
    }
}

#[test]
fn spec_example_parses_to_what_it_says() {
    let cfg = ok(SPEC_EXAMPLE);
    let expected = Config {
        plans: Vec::new(),
        limits: Vec::new(),
        server: ServerConfig {
            trusted_proxies: vec!["10.0.0.0/8".parse().unwrap()],
            ..ServerConfig::default()
        },
        redis: Some(RedisConfig {
            target: RedisTarget::Single("redis://127.0.0.1:6379".into()),
            timeout: Duration::from_millis(50),
            on_error: OnError::Allow,
            pool_size: 2,
            batch_max: 64,
        }),
        // The spec's own example loads without a warning.
        warnings: Vec::new(),
        source_hash: None,
        routes: vec![RouteConfig {
            name: "users".into(),
            matcher: RouteMatch {
                path: PathMatch::Prefix("/v1/users".into()),
                host: None,
                methods: None,
            },
            upstreams: vec![uri("http://127.0.0.1:9000")],
            timeout: Duration::from_secs(30),
            preserve_host: true,
            headers: true,
            limits: vec![spec_limit()],
            rejection: None,
        }],
    };
    assert_eq!(cfg, expected);
}

#[test]
fn defaults_are_applied() {
    let yaml = lines(&[
        "server:",
        "  trusted_proxies: [192.168.1.10, '::1', 10.1.2.3/8]",
        "  grace_period: 5",
        "  max_waiters: 10",
        "  max_keys: 50000",
        "  admin_token: s3cret",
        "redis:",
        "  cluster: [redis://h1:7000, 'rediss://:pw@h2:7001']",
        "  on_error: deny",
        "  pool_size: 4",
        "  batch_max: 8",
        "routes:",
        "  - name: bare",
        "    upstream: [http://a:1, 'https://B.example/base']",
        "    limits:",
        "      - name: minimal",
        "        rate: 10/s",
        "  - name: exact",
        "    match:",
        "      path: /v1/search/",
        "      host: API.Example.com",
        "      methods: [get, Post]",
        "    upstream: http://a:1",
        "    timeout: 1500ms",
        "    preserve_host: false",
        "    headers: false",
        "    limits:",
        "      - name: local-delay",
        "        key: [ip, method]",
        "        on_missing: ip",
        "        algorithm: leaky_bucket",
        "        rate: 5/500ms",
        "        scope: local",
        "        cost: 2",
        "        on_limit: delay",
        "        max_delay: 1s",
        "        shadow: true",
        "  - name: prefix",
        "    match: {path_prefix: /static/}",
        "    upstream: http://a:1",
    ]);
    let cfg = ok(&yaml);
    assert_eq!(
        cfg.server,
        ServerConfig {
            listen: "0.0.0.0:8080".parse().unwrap(),
            admin: "127.0.0.1:9090".parse().unwrap(),
            trusted_proxies: vec![
                "192.168.1.10/32".parse().unwrap(),
                "::1/128".parse().unwrap(),
                "10.0.0.0/8".parse().unwrap(),
            ],
            grace_period: Duration::from_secs(5),
            max_waiters: 10,
            max_keys: 50_000,
            admin_token: Some("s3cret".into()),
            tls: None,
            upstream_ca: None,
            log_keys: false,
            fast_path: true,
        }
    );
    assert_eq!(
        cfg.redis,
        Some(RedisConfig {
            target: RedisTarget::Cluster(vec![
                "redis://h1:7000".into(),
                "rediss://:pw@h2:7001".into()
            ]),
            timeout: Duration::from_millis(50),
            on_error: OnError::Deny,
            pool_size: 4,
            batch_max: 8,
        })
    );
    let [bare, exact, prefix] = &cfg.routes[..] else {
        panic!("three routes expected: {:#?}", cfg.routes)
    };
    assert_eq!(
        bare,
        &RouteConfig {
            name: "bare".into(),
            matcher: RouteMatch {
                path: PathMatch::Prefix("/".into()),
                host: None,
                methods: None
            },
            upstreams: vec![uri("http://a:1"), uri("https://B.example/base")],
            timeout: Duration::from_secs(30),
            preserve_host: true,
            headers: true,
            limits: vec![LimitConfig {
                name: "minimal".into(),
                key: vec![KeyPart::Ip],
                on_missing: OnMissing::Skip,
                algorithm: AlgorithmKind::Gcra,
                rate: Rate {
                    count: 10,
                    period: Duration::from_secs(1)
                },
                burst: 10,
                // redis is set, so the default scope is global
                scope: Scope::Global,
                cost: 1,
                on_limit: OnLimit::Reject,
                max_delay: Duration::ZERO,
                shadow: false,
                consistency: Consistency::Strict,
                sync_interval: Duration::from_millis(100),
                calendar: None,
                overrides: Vec::new(),
                overrides_file: None,
                shared: false,
                concurrency: None,
                settle: None,
                reserve_ahead: None,
            }],
            rejection: None,
        }
    );
    assert_eq!(
        exact.matcher,
        RouteMatch {
            path: PathMatch::Exact("/v1/search/".into()),
            host: Some("api.example.com".into()),
            methods: Some(vec![Method::GET, Method::POST]),
        }
    );
    assert_eq!(exact.timeout, Duration::from_millis(1500));
    assert!(!exact.preserve_host && !exact.headers);
    assert_eq!(
        exact.limits[0],
        LimitConfig {
            name: "local-delay".into(),
            key: vec![KeyPart::Ip, KeyPart::Method],
            on_missing: OnMissing::Ip,
            algorithm: AlgorithmKind::Gcra,
            rate: Rate {
                count: 5,
                period: Duration::from_millis(500)
            },
            burst: 5,
            scope: Scope::Local,
            cost: 2,
            on_limit: OnLimit::Delay,
            max_delay: Duration::from_secs(1),
            shadow: true,
            consistency: Consistency::Strict,
            sync_interval: Duration::from_millis(100),
            calendar: None,
            overrides: Vec::new(),
            overrides_file: None,
            shared: false,
            concurrency: None,
            settle: None,
            reserve_ahead: None,
        }
    );
    assert_eq!(prefix.matcher.path, PathMatch::Prefix("/static".into()));
    assert!(prefix.limits.is_empty());
}

#[test]
fn scope_defaults_to_local_without_redis() {
    let yaml = lines(&[
        "routes:",
        "  - name: r",
        "    upstream: http://a",
        "    match: {host: example.com}",
        "    limits: [{name: l, rate: 1/s}]",
    ]);
    let cfg = ok(&yaml);
    assert_eq!(cfg.redis, None);
    assert_eq!(cfg.routes[0].limits[0].scope, Scope::Local);
    assert_eq!(cfg.routes[0].matcher.path, PathMatch::Prefix("/".into()));
}

/// A config with no routes runs (every request 404) but says so; an empty file, which is what
/// a watcher sees between an editor's truncate and write, is refused.
#[test]
fn no_routes_loads_with_a_warning_and_an_empty_file_is_refused() {
    for yaml in ["routes: []\n", "server:\nroutes:\n"] {
        let cfg = ok(yaml);
        assert_eq!(cfg, Config::default());
        let warnings: Vec<String> = cfg.warnings.iter().map(|w| w.to_string()).collect();
        assert_eq!(
            warnings,
            ["routes.yaml:1:1: warning: no routes: every request gets 404"]
        );
    }
    assert!(summary(&Config::default()).contains("routes   none: every request gets 404"));
    let keys = crate::limit::budget::default_max_keys().keys;
    let default = summary(&Config::default());
    assert!(default.contains("keys     at most "), "{default}");
    assert!(default.contains("(default: 1/16 of "), "{default}");
    let mut set = Config::default();
    set.server.max_keys = if keys == 1_234_567 {
        7_654_321
    } else {
        1_234_567
    };
    let set = summary(&set);
    assert!(
        set.contains("keys     at most 1,234,567 held in process (max_keys; about 301.4 MiB at 256 B per key)")
            || set.contains("at most 7,654,321"),
        "{set}"
    );
    for yaml in ["", "\n\n", "# nothing yet\n", "---\n", "\u{feff}  \n"] {
        let e = super::parse(yaml).unwrap_err();
        assert_eq!((e.line, e.column), (1, 1), "{yaml:?}");
        assert!(e.message.starts_with("the file is empty"), "{e}");
    }
}

#[test]
fn anchors_share_a_limit_between_routes() {
    let yaml = lines(&[
        "routes:",
        "  - name: a",
        "    upstream: http://u",
        "    limits:",
        "      - &per-ip {name: per-ip, rate: 10/1s}",
        "  - name: b",
        "    upstream: http://u",
        "    limits: [*per-ip]",
    ]);
    let cfg = ok(&yaml);
    assert_eq!(cfg.routes[0].limits, cfg.routes[1].limits);
}

#[test]
fn shipped_routes_yaml_is_valid_and_local() {
    let cfg = ok(SHIPPED);
    assert_eq!(cfg.redis, None);
    assert_eq!(cfg.server.listen, "127.0.0.1:8080".parse().unwrap());
    assert_eq!(cfg.server.admin, "127.0.0.1:9090".parse().unwrap());
    let names: Vec<&str> = cfg.routes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["users", "search", "default"]);
    let algorithms: Vec<AlgorithmKind> = cfg
        .routes
        .iter()
        .flat_map(|r| r.limits.iter().map(|l| l.algorithm))
        .collect();
    assert_eq!(
        algorithms,
        [
            AlgorithmKind::Gcra,
            AlgorithmKind::SlidingWindow,
            AlgorithmKind::SlidingLog,
            AlgorithmKind::FixedWindow,
        ]
    );
    for route in &cfg.routes {
        assert_eq!(route.upstreams, [uri("http://127.0.0.1:9000")]);
        assert!(route.limits.iter().all(|l| l.scope == Scope::Local));
    }
    let users = &cfg.routes[0].limits[0];
    assert_eq!((users.rate.count, users.burst), (10, 5));
}

#[test]
fn summary_mentions_every_route_and_limit() {
    for yaml in [SPEC_EXAMPLE, SHIPPED] {
        let cfg = ok(yaml);
        let text = summary(&cfg);
        for route in &cfg.routes {
            assert!(text.contains(&format!("route {}:", route.name)), "{text}");
            for limit in &route.limits {
                assert!(text.contains(&format!("limit {}:", limit.name)), "{text}");
            }
        }
    }
    let spec = summary(&ok(SPEC_EXAMPLE));
    assert!(
        spec.contains("redis    redis://127.0.0.1:6379; timeout 50ms, pool 2, batch_max 64, on_error allow: fall back to the local limit"),
        "{spec}"
    );
    assert!(
        spec.contains(
            "path_prefix /v1/users, any host, any method -> http://127.0.0.1:9000; timeout 30s"
        ),
        "{spec}"
    );
    assert!(spec.contains("limit per-user: key header:x-user-id (if missing: skip), gcra 100/1m burst 20, global, cost 1, reject, enforced, strict"), "{spec}");
    assert!(
        spec.contains("at most 120 per 1m (burst 20 + 100)"),
        "{spec}"
    );
    let shipped = summary(&ok(SHIPPED));
    assert!(
        shipped.contains("redis    none: all limits local"),
        "{shipped}"
    );
    assert!(shipped.contains("delay up to 500ms"), "{shipped}");
    assert!(
        shipped.contains("at most 15 per 1s (burst 5 + 10), on each instance"),
        "{shipped}"
    );
    assert!(
        shipped.contains("about 600 in any 1m (sliding-window approximation)"),
        "{shipped}"
    );
    assert!(
        shipped.contains("at most 30 in any 1m (exact log)"),
        "{shipped}"
    );
    assert!(
        shipped.contains("200 in any 1m across a window boundary (2 × 100)"),
        "{shipped}"
    );
    assert!(shipped.lines().count() < 25, "one screen:\n{shipped}");
}

#[test]
fn summary_words_cost_shadow_and_eventual() {
    let yaml = lines(&[
        "redis: {url: 'redis://user:pw@r:6379'}",
        "routes:",
        "  - name: r",
        "    upstream: http://u",
        "    limits:",
        "      - {name: a, rate: 10/1s, burst: 4, cost: 2, shadow: true}",
        "      - {name: b, algorithm: fixed_window, rate: 10/1s, consistency: eventual, sync_interval: 50ms}",
    ]);
    let text = summary(&ok(&yaml));
    assert!(text.contains("redis://<redacted>@r:6379"), "{text}");
    assert!(!text.contains("pw"), "{text}");
    assert!(text.contains("not enforced (shadow); would allow at most 14 units per 1s (burst 4 + 10), i.e. 7 requests of cost 2"), "{text}");
    assert!(text.contains("eventual (sync 50ms)"), "{text}");
    assert!(
        text.contains("plus what other instances admit within one sync_interval (50ms)"),
        "{text}"
    );
}

#[test]
fn json_uses_yaml_notation_and_hides_secrets() {
    let yaml = lines(&[
        "server: {admin_token: s3cret}",
        "redis: {url: 'redis://:pw@r:6379/0'}",
        "routes:",
        "  - name: r",
        "    upstream: http://u:1",
        "    match: {path: /x, methods: [GET]}",
        "    limits: [{name: l, key: [ip, 'header:X-A'], rate: 10/1m}]",
    ]);
    let json = serde_json::to_value(ok(&yaml)).unwrap();
    assert_eq!(json["server"]["admin_token"], "<redacted>");
    assert_eq!(json["server"]["grace_period"], "30s");
    assert_eq!(json["redis"]["url"], "redis://<redacted>@r:6379/0");
    assert_eq!(json["redis"]["timeout"], "50ms");
    let route = &json["routes"][0];
    assert_eq!(route["upstream"], "http://u:1");
    assert_eq!(route["match"]["path"], "/x");
    assert_eq!(route["match"]["methods"][0], "GET");
    let limit = &route["limits"][0];
    assert_eq!(limit["key"], serde_json::json!(["ip", "header:x-a"]));
    assert_eq!(limit["rate"], "10/1m");
    assert_eq!(limit["algorithm"], "gcra");
    assert_eq!(limit["scope"], "global");
    assert_eq!(limit["on_limit"], "reject");
    assert_eq!(limit["sync_interval"], "100ms");
    assert!(!json.to_string().contains("s3cret") && !json.to_string().contains("pw"));
}

#[test]
fn rates_and_durations() {
    let rate = |s: &str| parse_rate(s).unwrap();
    assert_eq!(
        rate("100/1m"),
        Rate {
            count: 100,
            period: Duration::from_secs(60)
        }
    );
    assert_eq!(
        rate("10/s"),
        Rate {
            count: 10,
            period: Duration::from_secs(1)
        }
    );
    assert_eq!(rate("5/500ms").period_micros(), 500_000);
    assert_eq!(rate("1/1d").period_micros(), 86_400_000_000);
    assert_eq!(rate("10/s").to_string(), "10/1s");
    assert_eq!(rate("100/60s").to_string(), "100/1m");
    assert_eq!(rate("7/1500ms").to_string(), "7/1500ms");
    assert!(
        parse_rate("1/99999999999999999d")
            .unwrap_err()
            .contains("too long")
    );
    let d = |s: &str| parse_duration(s).unwrap();
    assert_eq!(d("50ms"), Duration::from_millis(50));
    assert_eq!(d("30s"), Duration::from_secs(30));
    assert_eq!(d("1h"), Duration::from_secs(3600));
    assert_eq!(d("1d"), Duration::from_secs(86_400));
    assert_eq!(d("7"), Duration::from_secs(7));
    assert_eq!(d("1.5s"), Duration::from_millis(1_500));
    assert_eq!(d("1.5000000000000s"), Duration::from_millis(1_500));
    assert_eq!(d("2.0m"), Duration::from_secs(120));
    for bad in ["", "s", "-1s", "1 s", "1us", "1m30s", "1.0001s"] {
        assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
    }
}

/// `GET /admin/config` shows the running config in routes.yaml's own shape: saved as a file,
/// it loads back to the same config (secrets aside, which it redacts).
#[test]
fn the_config_as_json_is_a_routes_yaml_that_loads_back_to_itself() {
    let yaml = lines(&[
        "server:",
        "  listen: 127.0.0.1:8080",
        "  trusted_proxies: [10.0.0.0/8]",
        "redis:",
        "  url: redis://127.0.0.1:6379",
        "  on_error: deny",
        "routes:",
        "  - name: users",
        "    match:",
        "      path_prefix: /v1/users",
        "      host: api.example.com",
        "      methods: [GET, POST]",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - name: per-user",
        "        key: [header:x-user-id, ip]",
        "        rate: 100/1m",
        "        burst: 20",
        "        on_limit: delay",
        "        max_delay: 2s",
        "      - name: window",
        "        key: [route]",
        "        algorithm: sliding_window",
        "        rate: 1000/1h",
        "        consistency: eventual",
        "        sync_interval: 250ms",
        "  - name: rest",
        "    match:",
        "      path: /health",
        "    upstream: [http://127.0.0.1:9001, http://127.0.0.1:9002/base]",
        "    limits:",
        "      - name: log",
        "        key: [ip]",
        "        algorithm: sliding_log",
        "        rate: 5/1s",
        "        scope: local",
    ]);
    let cfg = super::parse(&yaml).unwrap();
    let json = serde_json::to_value(&cfg).unwrap();
    let r = &json["routes"][0];
    assert_eq!(r["match"]["path_prefix"], "/v1/users");
    assert_eq!(r["match"]["methods"], serde_json::json!(["GET", "POST"]));
    assert_eq!(r["upstream"], "http://127.0.0.1:9000");
    assert_eq!(r["limits"][0]["rate"], "100/1m");
    assert_eq!(json["redis"]["url"], "redis://127.0.0.1:6379");
    assert_eq!(
        json["routes"][1]["upstream"],
        serde_json::json!(["http://127.0.0.1:9001", "http://127.0.0.1:9002/base"])
    );
    let back = super::parse(&serde_json::to_string_pretty(&json).unwrap())
        .unwrap_or_else(|e| panic!("{e}\n{json:#}"));
    assert_eq!(back, cfg);
}

/// A file that loads with warnings is saved as what runs: loaded back, it is the same config
/// (burst on a window as its count, eventual-made-strict as strict, delay 0s as written).
#[test]
fn a_config_with_warnings_saved_as_json_loads_back_to_what_runs() {
    let yaml = lines(&[
        "redis:",
        "  url: redis://127.0.0.1:6379",
        "routes:",
        "  - name: a",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - {name: b, algorithm: fixed_window, rate: 10/1s, burst: 5}",
        "      - {name: m, rate: 10/1s, max_delay: 2s}",
        "      - {name: d, rate: 10/1s, on_limit: delay}",
        "      - {name: e, algorithm: sliding_log, rate: 10/1s, consistency: eventual}",
    ]);
    let cfg = super::parse(&yaml).unwrap();
    assert_eq!(cfg.warnings.len(), 4, "{:?}", cfg.warnings);
    let json = serde_json::to_string_pretty(&cfg).unwrap();
    let back = super::parse(&json).unwrap_or_else(|e| panic!("{e}\n{json}"));
    assert_eq!(back, cfg);
}

/// A file saved from `/admin/config` holds placeholders instead of secrets: loading it is
/// refused with the position, never run with a token everyone knows.
#[test]
fn a_redacted_secret_is_refused_not_taken_as_the_secret() {
    let yaml = lines(&[
        "server: {admin_token: s3cret}",
        "redis: {url: 'redis://:pw@r:6379/0'}",
        "routes: []",
    ]);
    let json = serde_json::to_value(ok(&yaml)).unwrap();
    let mut no_redis = json.clone();
    no_redis.as_object_mut().unwrap().remove("redis");
    let e = super::parse(&no_redis.to_string()).unwrap_err();
    assert!(e.message.contains("placeholder"), "{e}");
    let mut no_token = json;
    no_token["server"]
        .as_object_mut()
        .unwrap()
        .remove("admin_token");
    let e = super::parse(&no_token.to_string()).unwrap_err();
    assert!(e.message.contains("put the real one back"), "{e}");
}
