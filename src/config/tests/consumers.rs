//! Plans, overrides, overrides files and shared limits: what loads, and every refusal at its
//! line and column.

use super::{assert_err, lines, ok, with_limit};
use crate::config::OverrideRate;

/// A config with two plans, then `rest` (routes and so on).
fn with_plans(rest: &[&str]) -> String {
    let mut all = vec![
        "plans:",
        "  pro: { rate: 600/1m, burst: 100 }",
        "  slow: { rate: 10/1h }",
    ];
    all.extend_from_slice(rest);
    lines(&all)
}

/// One route whose one limit (`l`, gcra 60/1m on an API key) has `overrides`, each line
/// indented under the limit (column 11), from line 12 on.
fn overrides(body: &[&str]) -> String {
    let mut all = vec![
        "routes:",
        "  - name: api",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - name: l",
        "        key: [header:x-api-key]",
        "        rate: 60/1m",
        "        overrides:",
    ];
    let body: Vec<String> = body.iter().map(|l| format!("          {l}")).collect();
    all.extend(body.iter().map(String::as_str));
    with_plans(&all)
}

#[test]
fn plans_and_overrides_load_as_written() {
    let cfg = ok(&overrides(&[
        "- when: { ip: [10.0.0.0/8, \"2001:db8::/32\"] }",
        "  exempt: true",
        "- when: { key: [acme] }",
        "  plan: pro",
        "- when: { key: [beta], ip: [192.0.2.0/24] }",
        "  rate: 5/1m",
    ]));
    assert_eq!(cfg.plans.len(), 2);
    let l = &cfg.routes[0].limits[0];
    assert_eq!(l.overrides.len(), 3);
    assert_eq!(l.overrides[0].then, OverrideRate::Exempt);
    assert_eq!(l.overrides[0].when.ip.len(), 2);
    match &l.overrides[1].then {
        OverrideRate::Rate { plan, rate, burst } => {
            assert_eq!(plan.as_deref(), Some("pro"));
            assert_eq!((rate.count, *burst), (600, 100));
        }
        other => panic!("{other:?}"),
    }
    // An inline rate without burst: gcra's default, the count.
    assert!(matches!(
        l.overrides[2].then,
        OverrideRate::Rate { burst: 5, .. }
    ));
    // /admin/config shows them as the YAML writes them.
    let json = serde_json::to_value(&cfg).unwrap();
    assert_eq!(json["plans"]["pro"]["burst"], 100);
    assert_eq!(
        json["routes"][0]["limits"][0]["overrides"][1]["plan"],
        "pro"
    );
    assert_eq!(
        json["routes"][0]["limits"][0]["overrides"][0]["exempt"],
        true
    );
}

#[test]
fn a_plan_needs_a_rate_and_a_name_that_is_not_exempt() {
    assert_err(
        &lines(&["plans:", "  pro: { burst: 5 }"]),
        2,
        8,
        "plan `pro` has no `rate`",
    );
    assert_err(
        &lines(&["plans:", "  exempt: { rate: 1/s }"]),
        2,
        11,
        "`exempt` cannot name a plan",
    );
    assert_err(
        &lines(&["plans:", "  pro: { rate: fast }"]),
        2,
        16,
        "has no `/`",
    );
    assert_err(
        &lines(&["plans:", "  pro: { rate: 1/s, burst: 0 }"]),
        2,
        28,
        "burst must be at least 1",
    );
}

#[test]
fn an_override_gives_exactly_one_thing() {
    assert_err(&overrides(&["- plan: pro"]), 12, 13, "has no `when`");
    assert_err(
        &overrides(&["- when: { key: [a] }", "  plan: pro", "  rate: 1/s"]),
        12,
        13,
        "gives plan and rate",
    );
    assert_err(
        &overrides(&["- when: { key: [a] }"]),
        12,
        13,
        "says nothing to do",
    );
    assert_err(
        &overrides(&["- when: { key: [a] }", "  plan: pro", "  burst: 3"]),
        14,
        20,
        "burst goes with an inline `rate:`",
    );
    assert_err(
        &overrides(&["- when: {}", "  exempt: true"]),
        12,
        19,
        "when needs",
    );
    assert_err(
        &overrides(&["- when: { ip: [10.0.0.300/8] }", "  exempt: true"]),
        12,
        26,
        "when.ip: `10.0.0.300/8` is not a CIDR",
    );
}

#[test]
fn an_unknown_plan_is_refused_where_it_is_named() {
    assert_err(
        &overrides(&["- when: { key: [a] }", "  plan: gold"]),
        13,
        19,
        "`gold` is not a plan (plans: pro, slow)",
    );
}

/// A window algorithm counts per window of its period: an override keeps the period.
#[test]
fn an_override_rate_the_algorithm_cannot_take_is_refused() {
    let yaml = with_plans(&[
        "routes:",
        "  - name: api",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - name: w",
        "        algorithm: fixed_window",
        "        rate: 60/1m",
        "        overrides:",
        "          - when: { key: [a] }",
        "            plan: slow",
    ]);
    assert_err(
        &yaml,
        13,
        19,
        "keeps a key's state for the limit's period (1m)",
    );
    // So does a log, which is kept (and expires) for one period.
    assert_err(
        &yaml.replace("fixed_window", "sliding_log"),
        13,
        19,
        "sliding_log keeps a key's state for the limit's period",
    );
    // A cost no override rate can admit.
    let yaml = with_plans(&[
        "routes:",
        "  - name: api",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - name: c",
        "        rate: 60/1m",
        "        cost: 20",
        "        overrides:",
        "          - when: { key: [a] }",
        "            plan: slow",
    ]);
    assert_err(&yaml, 13, 19, "its cost 20 would never be admitted");
}

/// An eventual limit syncs counts under its one rate: it may exempt, not re-rate.
#[test]
fn an_eventual_limit_takes_exemptions_only() {
    let head = [
        "redis:",
        "  url: redis://127.0.0.1:6379",
        "routes:",
        "  - name: api",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - name: e",
        "        rate: 60/1m",
        "        consistency: eventual",
        "        overrides:",
        "          - when: { key: [a] }",
    ];
    let mut rerated: Vec<&str> = head.to_vec();
    rerated.push("            rate: 5/1m");
    assert_err(&with_plans(&rerated), 15, 19, "consistency: eventual");
    let mut exempt: Vec<&str> = head.to_vec();
    exempt.push("            exempt: true");
    ok(&with_plans(&exempt));
}

#[test]
fn a_header_condition_without_trusted_proxies_loads_with_a_warning() {
    let cfg = ok(&overrides(&[
        "- when: { header: { x-plan: pro } }",
        "  plan: pro",
    ]));
    assert_eq!(cfg.warnings.len(), 1, "{:?}", cfg.warnings);
    let w = &cfg.warnings[0];
    assert_eq!((w.line, w.column), (12, 29));
    assert!(w.message.contains("never applies"), "{}", w.message);
}

#[test]
fn shared_limits_are_used_by_name_and_alone() {
    let cfg = ok(&lines(&[
        "limits:",
        "  - name: daily",
        "    key: [header:x-api-key]",
        "    rate: 1000/1d",
        "routes:",
        "  - name: a",
        "    upstream: http://127.0.0.1:9000",
        "    limits:",
        "      - use: daily",
        "      - name: own",
        "        rate: 10/1s",
    ]));
    assert_eq!(cfg.limits.len(), 1);
    assert!(!cfg.limits[0].shared);
    let used = &cfg.routes[0].limits[0];
    assert!(used.shared);
    assert_eq!((used.name.as_str(), used.rate.count), ("daily", 1000));
    let json = serde_json::to_value(&cfg).unwrap();
    assert_eq!(
        json["routes"][0]["limits"][0],
        serde_json::json!({"use": "daily"})
    );
    assert_eq!(json["limits"][0]["rate"], "1000/1d");
}

#[test]
fn use_of_an_unknown_limit_or_with_other_fields_is_refused() {
    let route = |entry: &[&str]| {
        let mut all = vec![
            "limits:",
            "  - name: daily",
            "    rate: 1000/1d",
            "routes:",
            "  - name: a",
            "    upstream: http://127.0.0.1:9000",
            "    limits:",
        ];
        all.extend_from_slice(entry);
        lines(&all)
    };
    assert_err(
        &route(&["      - use: weekly"]),
        8,
        14,
        "`weekly` is not a top-level limit (top-level limits: daily)",
    );
    assert_err(
        &route(&["      - use: daily", "        rate: 5/1s"]),
        8,
        9,
        "takes no other field (this entry also has `rate`)",
    );
    assert_err(
        &route(&[
            "      - use: daily",
            "      - name: daily",
            "        rate: 5/1s",
        ]),
        9,
        15,
        "duplicate limit name `daily` in route `a`",
    );
    // `use:` inside the top-level limits themselves.
    assert_err(
        &lines(&["limits:", "  - use: daily"]),
        2,
        10,
        "`use:` draws on a top-level limit",
    );
    // Shared limits have unique names among themselves.
    assert_err(
        &lines(&[
            "limits:",
            "  - {name: d, rate: 1/s}",
            "  - {name: d, rate: 2/s}",
        ]),
        3,
        12,
        "duplicate limit name `d` in the top-level `limits`",
    );
}

/// A file that cannot be read has no line to point at: the config's field is pointed at.
#[test]
fn an_overrides_file_that_cannot_be_read_is_refused_at_its_field() {
    let yaml = with_limit(&["rate: 1/s", "overrides_file: /nonexistent/consumers.yaml"]);
    assert_err(
        &yaml,
        7,
        25,
        "cannot read the overrides file /nonexistent/consumers.yaml",
    );
}

/// A file's key with another number of `|`-separated parts than the limit's key never
/// matches: the file loads, with a warning at the field.
#[test]
fn keys_that_can_never_match_load_with_a_warning() {
    let dir = std::env::temp_dir().join(format!("tollgate-misshapen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("consumers.yaml");
    std::fs::write(&file, "a: exempt\n\"b|c\": exempt\n").unwrap();
    let cfg = ok(&with_limit(&[
        "rate: 1/s",
        &format!("overrides_file: {}", file.display()),
        "overrides:",
        "  - when: { key: [\"x|y\"] }",
        "    exempt: true",
    ]));
    let _ = std::fs::remove_dir_all(&dir);
    let warnings: Vec<String> = cfg.warnings.iter().map(ToString::to_string).collect();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].contains("routes.yaml:7:25: warning: 1 keys of"),
        "{warnings:?}"
    );
    assert!(warnings[1].contains("when.key `x|y` has 2"), "{warnings:?}");
}
