//! Packaging, checked without a Docker engine: the Dockerfile, docker-compose.yml and deploy/
//! (the stack's routes.yaml, Prometheus, Grafana) agree with each other and with the binary.
//!
//! - the compose file parses, has the six services, mounts only files that exist, and runs the
//!   image's entrypoint with the Dockerfile's config path;
//! - `promtool check config` accepts the Prometheus config, which scrapes exactly the tollgate
//!   services' admin listeners (promtool: Debian's `prometheus` package; missing = failure);
//! - the Grafana dashboard loads, queries only tollgate's metrics (PromQL checked by promtool),
//!   and names the provisioned datasource;
//! - the image's command, run directly on the repo's paths, serves /healthz, /readyz and
//!   /metrics with Redis unreachable (`on_error: allow`), passes the compose healthcheck, and
//!   exits 0 on SIGTERM (what `docker stop` sends);
//! - the Dockerfile is multi-stage, its runtime stage is not the Rust image, runs as a non-root
//!   user, and its COPY sources exist and are not excluded by .dockerignore.

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const PROMTOOL_MISSING: &str = "promtool not found: apt-get install -y prometheus";

// ---------------------------------------------------------------------------------------------
// Files

fn repo_path(rel: &str) -> PathBuf {
    Path::new(ROOT).join(rel.trim_start_matches("./"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo_path(rel)).unwrap_or_else(|e| panic!("cannot read {rel}: {e}"))
}

fn yaml(rel: &str) -> Value {
    serde_saphyr::from_str::<Value>(&read(rel))
        .unwrap_or_else(|e| panic!("{rel} does not parse: {e}"))
}

fn str_list(v: &Value, what: &str) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what} is not a list: {v}"))
        .iter()
        .map(|s| {
            s.as_str()
                .unwrap_or_else(|| panic!("{what} holds a non-string: {s}"))
                .to_string()
        })
        .collect()
}

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tollgate-packaging-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------------
// Dockerfile

struct Stage {
    image: String,
    name: Option<String>,
    /// (INSTRUCTION, arguments), continuation lines joined.
    instructions: Vec<(String, String)>,
}

impl Stage {
    fn all(&self, keyword: &str) -> Vec<&str> {
        self.instructions
            .iter()
            .filter(|(k, _)| k == keyword)
            .map(|(_, a)| a.as_str())
            .collect()
    }

    /// The last one wins, as in Docker.
    fn last(&self, keyword: &str) -> Option<&str> {
        self.all(keyword).last().copied()
    }
}

fn dockerfile() -> Vec<Stage> {
    let text = read("Dockerfile");
    let mut logical = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
        } else {
            current.push_str(trimmed);
            logical.push(std::mem::take(&mut current));
        }
    }
    assert!(
        current.is_empty(),
        "Dockerfile ends inside a continuation line"
    );
    let mut stages: Vec<Stage> = Vec::new();
    for line in logical.into_iter().filter(|l| !l.is_empty()) {
        let (keyword, args) = line.split_once(char::is_whitespace).unwrap_or((&line, ""));
        let keyword = keyword.to_ascii_uppercase();
        let args = args.trim().to_string();
        if keyword == "FROM" {
            let words: Vec<&str> = args
                .split_whitespace()
                .filter(|w| !w.starts_with("--"))
                .collect();
            let name = match words.as_slice() {
                [_, as_, name] if as_.eq_ignore_ascii_case("as") => Some(name.to_string()),
                [_] => None,
                _ => panic!("FROM {args}: cannot read"),
            };
            stages.push(Stage {
                image: words[0].to_string(),
                name,
                instructions: Vec::new(),
            });
        } else {
            stages
                .last_mut()
                .unwrap_or_else(|| panic!("Dockerfile: {keyword} before the first FROM"))
                .instructions
                .push((keyword, args));
        }
    }
    stages
}

/// An exec-form (JSON array) ENTRYPOINT or CMD; the shell form would run under /bin/sh and
/// swallow SIGTERM.
fn exec_form(keyword: &str, args: &str) -> Vec<String> {
    let v: Value = serde_json::from_str(args)
        .unwrap_or_else(|e| panic!("{keyword} {args}: not the exec (JSON array) form: {e}"));
    str_list(&v, keyword)
}

/// COPY's flags, sources and destination.
fn copy_parts(args: &str) -> (Vec<&str>, Vec<&str>, &str) {
    let (flags, rest): (Vec<&str>, Vec<&str>) =
        args.split_whitespace().partition(|w| w.starts_with("--"));
    let (dest, sources) = rest.split_last().unwrap_or_else(|| panic!("COPY {args}"));
    (flags, sources.to_vec(), dest)
}

/// `ENTRYPOINT` + `CMD` of the runtime stage, and the config path the CMD reads.
fn image_command() -> (Vec<String>, Vec<String>, String) {
    let stages = dockerfile();
    let runtime = stages.last().expect("Dockerfile has no FROM");
    let entrypoint = exec_form(
        "ENTRYPOINT",
        runtime
            .last("ENTRYPOINT")
            .expect("runtime stage has no ENTRYPOINT"),
    );
    let cmd = exec_form(
        "CMD",
        runtime.last("CMD").expect("runtime stage has no CMD"),
    );
    let config = flag_value(&cmd, "--config").expect("CMD passes no --config");
    (entrypoint, cmd, config)
}

fn flag_value(args: &[String], flag: &str) -> Option<String> {
    args.iter().position(|a| a == flag).map(|i| {
        args.get(i + 1)
            .unwrap_or_else(|| panic!("{flag} without a value"))
            .clone()
    })
}

// ---------------------------------------------------------------------------------------------
// docker-compose.yml

struct Compose {
    services: BTreeMap<String, Value>,
}

impl Compose {
    fn load() -> Self {
        let doc = yaml("docker-compose.yml");
        let services = doc["services"]
            .as_object()
            .expect("docker-compose.yml has no services map")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Self { services }
    }

    fn service(&self, name: &str) -> &Value {
        self.services
            .get(name)
            .unwrap_or_else(|| panic!("docker-compose.yml has no service {name}"))
    }

    /// Services built from this repository's Dockerfile.
    fn tollgates(&self) -> Vec<(&String, &Value)> {
        self.services
            .iter()
            .filter(|(_, s)| s["build"].is_string() || s["build"].is_object())
            .collect()
    }

    /// The one service whose image starts with `prefix`.
    fn by_image(&self, prefix: &str) -> (&String, &Value) {
        let found: Vec<_> = self
            .services
            .iter()
            .filter(|(_, s)| s["image"].as_str().is_some_and(|i| i.starts_with(prefix)))
            .collect();
        assert_eq!(found.len(), 1, "services with image {prefix}*: {found:?}");
        found[0]
    }

    /// (host source, container target) of a service's bind mounts (short syntax).
    fn mounts(&self, name: &str) -> Vec<(String, String)> {
        let service = self.service(name);
        let Some(volumes) = service.get("volumes") else {
            return Vec::new();
        };
        str_list(volumes, &format!("{name}.volumes"))
            .into_iter()
            .map(|v| {
                let parts: Vec<&str> = v.split(':').collect();
                assert!(
                    (2..=3).contains(&parts.len()),
                    "{name}: volume {v} is not SRC:DST[:MODE]"
                );
                assert!(
                    parts[0].starts_with("./"),
                    "{name}: volume {v} is not a bind mount of a repo path"
                );
                assert_eq!(parts.get(2), Some(&"ro"), "{name}: mount {v} read-only");
                (parts[0].to_string(), parts[1].to_string())
            })
            .collect()
    }

    fn mount_source(&self, name: &str, target: &str) -> String {
        self.mounts(name)
            .into_iter()
            .find(|(_, t)| t == target)
            .unwrap_or_else(|| panic!("{name} mounts nothing at {target}"))
            .0
    }

    fn command(&self, name: &str) -> Vec<String> {
        str_list(&self.service(name)["command"], &format!("{name}.command"))
    }
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("{addr}: no port"))
}

/// `http://HOST:PORT/...` → (HOST, PORT).
fn host_port(url: &str, default_port: u16) -> (String, u16) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap();
    match authority.rsplit_once(':') {
        Some((h, p)) => (h.to_string(), p.parse().unwrap()),
        None => (authority.to_string(), default_port),
    }
}

#[test]
fn compose_has_the_stack_and_mounts_only_files_that_exist() {
    let compose = Compose::load();
    for name in compose.services.keys() {
        for (source, _) in compose.mounts(name) {
            assert!(
                repo_path(&source).exists(),
                "{name} mounts {source}, which does not exist"
            );
        }
    }

    let tollgates = compose.tollgates();
    let names: Vec<&String> = tollgates.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names.len(),
        2,
        "two tollgate instances built from the Dockerfile: {names:?}"
    );
    let image = tollgates[0].1["image"].as_str().map(str::to_string);
    for (name, service) in &tollgates {
        assert_eq!(
            service["build"].as_str(),
            Some("."),
            "{name} builds ./Dockerfile"
        );
        assert_eq!(
            service["image"].as_str().map(str::to_string),
            image,
            "{name}: one image for both"
        );
        assert!(
            service.get("entrypoint").is_none(),
            "{name} must run the image's ENTRYPOINT"
        );
    }
    let (redis, _) = compose.by_image("redis:");
    compose.by_image("prom/prometheus:");
    compose.by_image("grafana/grafana:");
    let upstream = compose.service("upstream");
    assert!(upstream["image"].is_string(), "upstream needs an image");

    // The tollgate services run the Dockerfile's CMD on the mounted stack config, with both
    // listeners on 0.0.0.0 (the admin one so Prometheus can scrape it).
    let (_, cmd, config_path) = image_command();
    for name in &names {
        let command = compose.command(name);
        assert!(
            command.starts_with(&cmd),
            "{name}: command {command:?} should start with the Dockerfile's CMD {cmd:?}"
        );
        assert_eq!(
            compose.mount_source(name, &config_path),
            "./deploy/routes.yaml"
        );
        for flag in ["--listen", "--admin"] {
            let addr = flag_value(&command, flag).unwrap_or_else(|| panic!("{name}: no {flag}"));
            assert!(
                addr.starts_with("0.0.0.0:"),
                "{name}: {flag} {addr} is unreachable from other containers"
            );
        }
    }

    // The mounted config is valid and points at the compose services.
    let cfg = tollgate::config::load(&repo_path("deploy/routes.yaml"))
        .unwrap_or_else(|e| panic!("deploy/routes.yaml: {e}"));
    let cfg = serde_json::to_value(&cfg).unwrap();
    let redis_url = cfg["redis"]["url"]
        .as_str()
        .expect("deploy/routes.yaml shares limits through one Redis (redis.url)");
    assert_eq!(host_port(redis_url, 6379), (redis.clone(), 6379));
    let routes = cfg["routes"].as_array().unwrap();
    assert!(
        routes.len() >= 2,
        "the stack demonstrates at least two routes"
    );
    for route in routes {
        // One upstream is a string, several a list, as in the YAML.
        let upstream = &route["upstream"];
        let urls = match upstream.as_str() {
            Some(one) => vec![one.to_string()],
            None => str_list(upstream, "upstream"),
        };
        for url in urls {
            assert_eq!(
                host_port(&url, 80),
                ("upstream".to_string(), 80),
                "route {}",
                route["name"]
            );
        }
        for limit in route["limits"].as_array().unwrap() {
            assert_eq!(
                limit["scope"], "global",
                "route {} limit {}: shared by both instances",
                route["name"], limit["name"]
            );
        }
    }
}

#[test]
fn prometheus_scrapes_both_tollgate_admin_listeners() {
    let compose = Compose::load();
    let (prometheus, service) = compose.by_image("prom/prometheus:");
    // The image reads /etc/prometheus/prometheus.yml unless its command says otherwise.
    assert!(
        service.get("command").is_none(),
        "{prometheus}: keep the image's --config.file"
    );
    let source = compose.mount_source(prometheus, "/etc/prometheus/prometheus.yml");
    let config = yaml(&source);

    let expected: BTreeSet<String> = compose
        .tollgates()
        .into_iter()
        .map(|(name, _)| {
            let admin = flag_value(&compose.command(name), "--admin").unwrap();
            format!("{name}:{}", port_of(&admin))
        })
        .collect();
    let job = config["scrape_configs"]
        .as_array()
        .expect("scrape_configs")
        .iter()
        .find(|j| j["job_name"] == "tollgate")
        .expect("no scrape job `tollgate`");
    assert_eq!(
        job["metrics_path"].as_str().unwrap_or("/metrics"),
        "/metrics"
    );
    let interval = job["scrape_interval"]
        .as_str()
        .or(config["global"]["scrape_interval"].as_str());
    assert_eq!(interval, Some("5s"));
    let targets: BTreeSet<String> = job["static_configs"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| str_list(&c["targets"], "targets"))
        .collect();
    assert_eq!(targets, expected);
}

// ---------------------------------------------------------------------------------------------
// promtool

fn promtool(args: &[&str]) -> std::process::Output {
    match Command::new("promtool").args(args).output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{PROMTOOL_MISSING}"),
        Err(e) => panic!("promtool: {e}"),
    }
}

#[test]
fn promtool_accepts_the_prometheus_config() {
    let path = repo_path("deploy/prometheus/prometheus.yml");
    let out = promtool(&["check", "config", path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "promtool check config:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---------------------------------------------------------------------------------------------
// Grafana

/// Metric families the gateway exports (README "Metrics"; the names are stable), by type.
const COUNTERS: &[&str] = &[
    "tollgate_requests",
    "tollgate_limit_decisions",
    "tollgate_limiter_tier_decisions",
    "tollgate_redis_errors",
    "tollgate_fallback_decisions",
    "tollgate_config_reloads",
    "tollgate_delayed_abandoned",
    "tollgate_limit_keys_evicted",
    "tollgate_eventual_units_lost",
    "tollgate_panics",
    "tollgate_redis_decide_calls",
    "tollgate_redis_decide_decisions",
    "tollgate_redis_decide_queued",
];
const HISTOGRAMS: &[&str] = &[
    "tollgate_request_duration_seconds",
    "tollgate_upstream_duration_seconds",
    "tollgate_limiter_duration_seconds",
    "tollgate_delay_seconds",
];
const GAUGES: &[&str] = &[
    "tollgate_local_keys",
    "tollgate_limit_keys",
    "tollgate_limit_keys_max",
];

/// Every series name a query may use: counters with `_total`, histograms' `_bucket`, `_sum`,
/// `_count`, gauges as they are.
fn known_series() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for c in COUNTERS {
        names.insert(format!("{c}_total"));
    }
    for h in HISTOGRAMS {
        for suffix in ["_bucket", "_sum", "_count"] {
            names.insert(format!("{h}{suffix}"));
        }
    }
    names.extend(GAUGES.iter().map(|g| g.to_string()));
    names
}

/// Keywords, and the aggregation operators (which may be followed by `by (..)` before their
/// parenthesis, so they do not always look like function calls).
const PROMQL_WORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "inf",
    "nan",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];

/// The metric names a PromQL expression selects: identifiers that are not functions,
/// keywords, label names (inside `{}` or a grouping clause) or strings.
fn promql_metrics(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    let mut after_grouping_word = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                // Skip the matcher / range, strings inside included.
                i += 1;
                while i < chars.len() && chars[i] != close {
                    if chars[i] == '"' {
                        i += 1;
                        while i < chars.len() && chars[i] != '"' {
                            i += if chars[i] == '\\' { 2 } else { 1 };
                        }
                    }
                    i += 1;
                }
                i += 1;
            }
            '(' if after_grouping_word => {
                // by (...), without (...), on (...), ignoring (...), group_left (...): labels.
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                i += 1;
                after_grouping_word = false;
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let lower = word.to_ascii_lowercase();
                if PROMQL_WORDS.contains(&lower.as_str()) {
                    after_grouping_word = matches!(
                        lower.as_str(),
                        "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                    );
                } else if chars.get(j) == Some(&'(') {
                    // A function call.
                } else {
                    out.insert(word);
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                // A number (also 1e3, 0x1f): skip its alphanumerics.
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    out
}

#[test]
fn promql_metric_extraction_sees_through_functions_labels_and_grouping() {
    let got = promql_metrics(
        r#"histogram_quantile(0.99, sum by (le, scope) (rate(tollgate_limiter_duration_seconds_bucket{instance=~"$instance", x="a}b"}[$__rate_interval]))) / on (instance) group_left () up offset 5m"#,
    );
    let want: BTreeSet<String> = ["tollgate_limiter_duration_seconds_bucket", "up"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(got, want);
}

/// Grafana's variables → values PromQL accepts, so promtool can parse the query.
fn substitute_grafana_variables(expr: &str) -> String {
    let out = expr
        .replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
        .replace("$instance", ".*");
    assert!(
        !out.contains('$'),
        "a Grafana variable this test does not know: {expr}"
    );
    out
}

struct Dashboard {
    /// Every non-row panel, rows' nested panels included.
    panels: Vec<Value>,
    doc: Value,
}

fn dashboard(rel: &str) -> Dashboard {
    let doc: Value = serde_json::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    fn collect(list: &Value, out: &mut Vec<Value>) {
        for p in list.as_array().into_iter().flatten() {
            if p["type"] == "row" {
                collect(&p["panels"], out);
            } else {
                out.push(p.clone());
            }
        }
    }
    let mut panels = Vec::new();
    collect(&doc["panels"], &mut panels);
    Dashboard { panels, doc }
}

#[test]
fn dashboard_loads_queries_only_tollgate_metrics_and_uses_the_provisioned_datasource() {
    let compose = Compose::load();
    let (grafana, _) = compose.by_image("grafana/grafana:");
    let provisioning = compose.mount_source(grafana, "/etc/grafana/provisioning");

    // The datasource: Prometheus at the compose service, with a uid the dashboard can name.
    let datasources = yaml(&format!("{provisioning}/datasources/prometheus.yml"));
    let ds = &datasources["datasources"][0];
    assert_eq!(ds["type"], "prometheus");
    let uid = ds["uid"]
        .as_str()
        .expect("provisioned datasource has no uid")
        .to_string();
    let (prometheus, _) = compose.by_image("prom/prometheus:");
    assert_eq!(
        ds["url"].as_str(),
        Some(format!("http://{prometheus}:9090").as_str())
    );

    // The provider reads the folder compose mounts the dashboards into.
    let providers = yaml(&format!("{provisioning}/dashboards/dashboards.yml"));
    let provider = &providers["providers"][0];
    assert_eq!(provider["type"], "file");
    let folder = provider["options"]["path"]
        .as_str()
        .expect("provider options.path");
    let source = compose.mount_source(grafana, folder);
    let rel = format!("{source}/tollgate.json");
    let home = compose.service(grafana)["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
        .as_str();
    if let Some(home) = home {
        assert_eq!(
            home,
            format!("{folder}/tollgate.json"),
            "the home dashboard is the provisioned one"
        );
    }

    let board = dashboard(&rel);
    assert!(
        board.doc["uid"].as_str().is_some_and(|u| !u.is_empty()),
        "dashboard uid"
    );
    assert!(!board.panels.is_empty());
    let known = known_series();
    let mut exprs = Vec::new();
    let mut ids = BTreeSet::new();
    for panel in &board.panels {
        let title = panel["title"].as_str().unwrap_or("?").to_string();
        assert!(
            ids.insert(panel["id"].as_u64().expect("panel id")),
            "duplicate panel id in {title}"
        );
        assert_eq!(
            panel["datasource"]["uid"].as_str(),
            Some(uid.as_str()),
            "panel {title}: datasource"
        );
        let targets = panel["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("panel {title}: no targets"));
        assert!(!targets.is_empty(), "panel {title}: no targets");
        for target in targets {
            if let Some(t_uid) = target["datasource"]["uid"].as_str() {
                assert_eq!(t_uid, uid, "panel {title}: target datasource");
            }
            let expr = target["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title}: target without expr"));
            let metrics = promql_metrics(expr);
            assert!(
                !metrics.is_empty(),
                "panel {title}: {expr} selects no metric"
            );
            for m in &metrics {
                assert!(
                    known.contains(m),
                    "panel {title}: {m} is not a tollgate metric ({expr})"
                );
            }
            exprs.push((title.clone(), expr.to_string()));
        }
    }
    for var in board.doc["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if var["type"] != "query" {
            continue;
        }
        assert_eq!(
            var["datasource"]["uid"].as_str(),
            Some(uid.as_str()),
            "variable {}",
            var["name"]
        );
        let query = var["query"]["query"]
            .as_str()
            .or(var["query"].as_str())
            .unwrap_or_default();
        if let Some(inner) = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
        {
            let metric = inner.rsplit_once(',').map_or("", |(m, _)| m).trim();
            let metric = metric.split('{').next().unwrap();
            assert!(
                known.contains(metric),
                "variable {}: {metric} is not a tollgate metric",
                var["name"]
            );
        }
    }

    // The panels the issue asks for.
    let uses = |needle: &str| exprs.iter().any(|(_, e)| e.contains(needle));
    for (what, needle) in [
        ("requests by status", "by (status)"),
        ("decisions by limit", "tollgate_limit_decisions_total"),
        (
            "limiter latency",
            "tollgate_limiter_duration_seconds_bucket",
        ),
        ("Redis errors", "tollgate_redis_errors_total"),
        ("fallbacks", "tollgate_fallback_decisions_total"),
        ("config reloads", "tollgate_config_reloads_total"),
    ] {
        assert!(uses(needle), "no panel shows {what} ({needle})");
    }
    assert!(
        exprs.iter().any(|(_, e)| e.contains("histogram_quantile")
            && e.contains("tollgate_limiter_duration_seconds_bucket")
            && e.contains("scope")),
        "limiter latency is a quantile by scope"
    );

    // promtool parses every query (as recording rules, Grafana's variables substituted).
    let dir = TempDir::new("rules");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in exprs.iter().enumerate() {
        let expr = substitute_grafana_variables(expr);
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    let path = dir.0.join("rules.yml");
    std::fs::write(&path, &rules).unwrap();
    let out = promtool(&["check", "rules", path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "promtool rejects a dashboard query:\n{}{}\n{rules}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---------------------------------------------------------------------------------------------
// The image's command, run directly

/// Kills the child on drop, so a failing assertion leaves no gateway behind.
struct Running {
    child: Child,
    stderr: PathBuf,
}

impl Running {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The compose command with the container's paths and addresses mapped to this machine's.
fn local_args(command: &[String], config_path: &str, proxy: u16, admin: u16) -> Vec<String> {
    command
        .iter()
        .map(|a| {
            if a == config_path {
                repo_path("deploy/routes.yaml")
                    .to_string_lossy()
                    .into_owned()
            } else if let Some(port) = a.strip_prefix("0.0.0.0:") {
                match port {
                    "8080" => format!("127.0.0.1:{proxy}"),
                    "9090" => format!("127.0.0.1:{admin}"),
                    other => panic!("unexpected listener port {other}"),
                }
            } else {
                a.clone()
            }
        })
        .collect()
}

fn binary(entrypoint: &[String]) -> Command {
    assert_eq!(
        entrypoint,
        ["tollgate"],
        "the image's ENTRYPOINT is the tollgate binary"
    );
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
}

#[tokio::test]
async fn image_command_serves_health_and_metrics_without_redis_and_stops_on_sigterm() {
    let (entrypoint, cmd, config_path) = image_command();
    let compose = Compose::load();
    let name = compose.tollgates()[0].0.clone();
    let command = compose.command(&name);
    let healthcheck = str_list(
        &compose.service(&name)["healthcheck"]["test"],
        "healthcheck.test",
    );
    let dir = TempDir::new("run");

    // `check` on the same config the CMD names, as an operator would before starting.
    let mut check_args = local_args(&cmd, &config_path, 0, 0);
    check_args[0] = "check".into();
    let out = binary(&entrypoint).args(&check_args).output().unwrap();
    assert!(
        out.status.success(),
        "tollgate {check_args:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();

    // Start it; a port taken between free_port() and bind() gets another try.
    let mut attempt = 0;
    let (running, proxy, admin) = loop {
        attempt += 1;
        let (proxy, admin) = (free_port(), free_port());
        let args = local_args(&command, &config_path, proxy, admin);
        let stderr = dir.0.join(format!("stderr-{attempt}"));
        let child = binary(&entrypoint)
            .args(&args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        let mut running = Running { child, stderr };
        let deadline = Instant::now() + Duration::from_secs(5);
        let healthy = loop {
            if let Some(status) = running.child.try_wait().unwrap() {
                let log = running.log();
                if log.contains("cannot listen") && attempt < 3 {
                    break false;
                }
                panic!(
                    "tollgate {args:?} exited with {status} before /healthz answered (Redis is not running: on_error: allow must still start):\n{log}"
                );
            }
            if let Ok(r) = client
                .get(format!("http://127.0.0.1:{admin}/healthz"))
                .send()
                .await
                && r.status() == 200
            {
                break true;
            }
            assert!(
                Instant::now() < deadline,
                "no 200 from /healthz within 5 s:\n{}",
                running.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if healthy {
            break (running, proxy, admin);
        }
    };

    // Ready although Redis is unreachable: the stack's config says on_error: allow.
    let ready = client
        .get(format!("http://127.0.0.1:{admin}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        ready.status(),
        200,
        "/readyz with Redis down and on_error: allow:\n{}",
        running.log()
    );

    // The compose healthcheck (no curl in the image: bash's /dev/tcp) passes against it.
    assert_eq!(
        healthcheck.first().map(String::as_str),
        Some("CMD"),
        "exec-form healthcheck"
    );
    let script = healthcheck.last().unwrap();
    let container_addr = "127.0.0.1/9090";
    assert_eq!(
        script.matches(container_addr).count(),
        1,
        "healthcheck asks {container_addr}: {script}"
    );
    let script = script.replace(container_addr, &format!("127.0.0.1/{admin}"));
    let mut hc = healthcheck[1..].to_vec();
    *hc.last_mut().unwrap() = script;
    let out = Command::new(&hc[0]).args(&hc[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "healthcheck {hc:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // One request through the proxy (the stack's upstream does not resolve here: any answer
    // will do), then /metrics has what Prometheus and the dashboard read, with the types the
    // dashboard's queries assume.
    let answered = client
        .get(format!("http://127.0.0.1:{proxy}/api/ping"))
        .send()
        .await
        .unwrap();
    assert!(answered.status().as_u16() >= 200, "{answered:?}");
    let metrics = client
        .get(format!("http://127.0.0.1:{admin}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status(), 200);
    let text = metrics.text().await.unwrap();
    let types: BTreeMap<&str, &str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    // Classic text (served unless OpenMetrics is asked for) names a counter family as its
    // samples are named, with `_total`.
    for (family, kind) in &types {
        let counter = family
            .strip_suffix("_total")
            .is_some_and(|c| COUNTERS.contains(&c));
        let expected = if counter {
            "counter"
        } else if HISTOGRAMS.contains(family) {
            "histogram"
        } else if GAUGES.contains(family) {
            "gauge"
        } else {
            continue;
        };
        assert_eq!(
            *kind, expected,
            "{family}: the dashboard queries it as a {expected}"
        );
    }
    for family in [
        "tollgate_requests_total",
        "tollgate_limit_decisions_total",
        "tollgate_limiter_duration_seconds",
        "tollgate_redis_errors_total",
        "tollgate_fallback_decisions_total",
        "tollgate_config_reloads_total",
        "tollgate_panics_total",
    ] {
        assert!(
            types.contains_key(family),
            "/metrics lacks {family}:\n{text}"
        );
    }

    // `docker stop` sends SIGTERM: drain and exit 0.
    let mut running = running;
    let pid = running.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(status) = running.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "still running 5 s after SIGTERM:\n{}",
            running.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        status.success(),
        "exit after SIGTERM: {status}\n{}",
        running.log()
    );
}

// ---------------------------------------------------------------------------------------------
// Dockerfile

#[test]
fn dockerfile_builds_in_rust_and_runs_slim_as_non_root() {
    let stages = dockerfile();
    assert!(
        stages.len() >= 2,
        "multi-stage: a build stage and a runtime stage"
    );
    let builder = &stages[0];
    assert!(
        builder.image.starts_with("rust:"),
        "build stage: {}",
        builder.image
    );
    assert!(
        builder
            .all("RUN")
            .iter()
            .any(|r| r.contains("cargo build --release --locked")),
        "the build stage runs cargo build --release --locked"
    );

    let runtime = stages.last().unwrap();
    assert!(
        !runtime.image.starts_with("rust") && Some(&runtime.image) != builder.name.as_ref(),
        "the runtime stage must not be the Rust image: {}",
        runtime.image
    );
    assert!(
        runtime.image.starts_with("debian:") && runtime.image.ends_with("-slim")
            || runtime.image.starts_with("gcr.io/distroless/cc"),
        "runtime image: {}",
        runtime.image
    );

    let user = runtime.last("USER").expect("the runtime stage sets USER");
    let uid = user.split(':').next().unwrap();
    assert!(
        !matches!(uid, "root" | "0"),
        "USER {user}: must not be root"
    );

    // The ENTRYPOINT binary is copied from the build stage onto the PATH.
    let (entrypoint, cmd, config_path) = image_command();
    assert_eq!(entrypoint, ["tollgate"]);
    assert_eq!(cmd[0], "run", "CMD runs the gateway");
    assert!(
        config_path.starts_with('/'),
        "CMD --config {config_path}: absolute"
    );
    let builder_ref = builder.name.clone().unwrap_or_else(|| "0".into());
    let binary_copied = runtime.all("COPY").iter().any(|c| {
        let (flags, _, dest) = copy_parts(c);
        flags.contains(&format!("--from={builder_ref}").as_str())
            && [
                "/usr/local/bin/tollgate",
                "/usr/bin/tollgate",
                "/usr/local/bin/",
                "/usr/bin/",
            ]
            .contains(&dest)
    });
    assert!(
        binary_copied,
        "runtime stage: COPY --from={builder_ref} ... /usr/local/bin/tollgate"
    );

    let exposed: BTreeSet<&str> = runtime
        .all("EXPOSE")
        .iter()
        .flat_map(|e| e.split_whitespace())
        .collect();
    for port in ["8080", "9090"] {
        assert!(exposed.contains(port), "EXPOSE {port}");
    }

    // Every COPY from the build context exists and is not excluded by .dockerignore.
    let ignore: Vec<String> = read(".dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.trim_end_matches('/').trim_start_matches("./").to_string())
        .collect();
    assert!(
        ignore.iter().any(|p| p == "target"),
        ".dockerignore must exclude target/"
    );
    for stage in &stages {
        for copy in stage.all("COPY").into_iter().chain(stage.all("ADD")) {
            let (flags, sources, _) = copy_parts(copy);
            if flags.iter().any(|f| f.starts_with("--from")) {
                continue;
            }
            for source in sources {
                let source = source.trim_start_matches("./").trim_end_matches('/');
                assert!(
                    repo_path(source).exists(),
                    "COPY {source}: no such file in the repo"
                );
                for pattern in &ignore {
                    let excluded = source == pattern || source.starts_with(&format!("{pattern}/"));
                    assert!(!excluded, "COPY {source}, but .dockerignore has {pattern}");
                }
            }
        }
    }
}
