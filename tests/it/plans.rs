//! Limits by consumer on real sockets, local and in a real Redis: plans and inline overrides
//! (by key, by client network, by a header from a trusted proxy only), exemptions, an overrides
//! file reloaded when it changes (and refused, keeping the running table, when it is bad), a
//! key's state carried on under its new plan with the in-process tier never answering under
//! the old one, and shared budgets drawn on by several routes.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::support::redis::RedisServer;
use crate::support::upstream::Upstream;
use crate::support::{Gateway, TempDir, client, metric};

fn shared_redis() -> &'static RedisServer {
    static R: OnceLock<RedisServer> = OnceLock::new();
    R.get_or_init(RedisServer::start)
}

/// The two ways a limit is kept: in process, and in Redis (`scope`, and the `redis:` section).
fn scopes() -> [(&'static str, String); 2] {
    [
        ("local", String::new()),
        (
            "global",
            format!(
                "redis:\n  url: {}\n  timeout: 2s\n  on_error: deny\n",
                shared_redis().url()
            ),
        ),
    ]
}

/// A config with `trusted` as the trusted proxies, `redis`, plans `pro` (5/1h, burst 5) and
/// `big` (8/1h), and one route `name` with `limits`.
fn config(name: &str, up: &Upstream, trusted: &str, redis: &str, extra: &str) -> String {
    format!(
        "server:
  listen: 127.0.0.1:0
  admin: 127.0.0.1:0
  trusted_proxies: [{trusted}]
{redis}plans:
  pro: {{ rate: 5/1h, burst: 5 }}
  big: {{ rate: 8/1h }}
{extra}routes:
  - name: {name}
    upstream: {up}
    limits:
      - name: per-key
        key: [header:x-api-key]
        rate: 2/1h
        scope: SCOPE
        overrides:
          - when: {{ ip: [10.0.0.0/8] }}
            exempt: true
          - when: {{ key: [acme] }}
            plan: pro
          - when: {{ header: {{ x-plan: big }} }}
            plan: big
          - when: {{ key: [beta] }}
            rate: 3/1h
            burst: 3
",
        up = up.url()
    )
}

/// Sends `n` requests with `headers` and returns the statuses and the last response's
/// `RateLimit-Policy` and `RateLimit` fields.
async fn send(g: &Gateway, n: usize, headers: &[(&str, &str)]) -> (Vec<u16>, String, String) {
    let c = client();
    let mut statuses = Vec::new();
    let mut fields = (String::new(), String::new());
    for _ in 0..n {
        let mut req = c.get(g.url("/"));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let r = req.send().await.unwrap();
        statuses.push(r.status().as_u16());
        let field = |name: &str| {
            r.headers()
                .get(name)
                .map_or(String::new(), |v| v.to_str().unwrap().to_owned())
        };
        fields = (field("ratelimit-policy"), field("ratelimit"));
    }
    (statuses, fields.0, fields.1)
}

/// Each consumer gets its rate, shown in `RateLimit-Policy`; a network is exempt and counted
/// so; a plan named by a header is believed from a trusted proxy only. Both codecs, both
/// scopes.
#[tokio::test]
async fn overrides_give_each_consumer_its_rate() {
    let up = Upstream::start().await;
    for (scope, redis) in scopes() {
        for fast_path in [true, false] {
            let name = format!("plans-{scope}-{fast_path}");
            let yaml = config(&name, &up, "127.0.0.0/8", &redis, "")
                .replace("SCOPE", scope)
                .replace(
                    "  trusted_proxies",
                    &format!("  fast_path: {fast_path}\n  trusted_proxies"),
                );
            let g = Gateway::start(&yaml).await;
            let what = format!("{scope}, fast_path {fast_path}");
            // No override: the limit's own 2/1h.
            let (s, policy, _) = send(&g, 3, &[("x-api-key", "nobody")]).await;
            assert_eq!(s, [200, 200, 429], "{what}");
            assert_eq!(policy, "\"per-key\";q=2;w=3600", "{what}");
            // A plan by key: 5 at once.
            let (s, policy, field) = send(&g, 6, &[("x-api-key", "acme")]).await;
            assert_eq!(s, [200, 200, 200, 200, 200, 429], "{what}");
            assert_eq!(policy, "\"per-key\";q=5;w=3600", "{what}");
            assert!(field.starts_with("\"per-key\";r=0;t="), "{what}: {field}");
            // An inline rate by key.
            let (s, policy, _) = send(&g, 4, &[("x-api-key", "beta")]).await;
            assert_eq!(s, [200, 200, 200, 429], "{what}");
            assert_eq!(policy, "\"per-key\";q=3;w=3600", "{what}");
            // A plan by a header the trusted proxy (loopback) set.
            let (s, policy, _) = send(&g, 9, &[("x-api-key", "gamma"), ("x-plan", "big")]).await;
            assert_eq!(s[..8], [200; 8], "{what}");
            assert_eq!(s[8], 429, "{what}");
            assert_eq!(policy, "\"per-key\";q=8;w=3600", "{what}");
            // A client network (through the trusted proxy's X-Forwarded-For) is exempt: never
            // limited, never shown this limit's fields.
            let xff = [("x-api-key", "delta"), ("x-forwarded-for", "10.1.2.3")];
            let (s, policy, field) = send(&g, 5, &xff).await;
            assert_eq!(s, [200; 5], "{what}");
            assert_eq!((policy.as_str(), field.as_str()), ("", ""), "{what}");
            let m = g.metrics().await;
            let series = |d: &str| {
                format!(
                    "tollgate_limit_decisions_total{{route=\"{name}\",limit=\"per-key\",decision=\"{d}\"}}"
                )
            };
            assert_eq!(metric(&m, &series("exempt")), Some(5.0), "{what}");
            assert_eq!(metric(&m, &series("rejected")), Some(4.0), "{what}");
            // The admin API shows a key's plan.
            let st = g
                .admin_json(&format!("/admin/limits/{name}/per-key?key=acme"))
                .await;
            assert_eq!(st["plan"], "pro", "{what}: {st}");
            assert_eq!(st["limit_count"], 5, "{what}: {st}");
            assert_eq!(st["remaining"], 0, "{what}: {st}");
            g.stop().await;
        }
    }
}

/// A client that is not a trusted proxy cannot name its own plan: its `x-plan` header is
/// ignored (and so is its `X-Forwarded-For`, so it cannot claim an exempt network either).
#[tokio::test]
async fn an_untrusted_client_cannot_name_its_plan_or_network() {
    let up = Upstream::start().await;
    let yaml = config("untrusted", &up, "192.0.2.0/24", "", "").replace("SCOPE", "local");
    let g = Gateway::start(&yaml).await;
    let (s, policy, _) = send(&g, 3, &[("x-api-key", "gamma"), ("x-plan", "big")]).await;
    assert_eq!(s, [200, 200, 429]);
    assert_eq!(policy, "\"per-key\";q=2;w=3600");
    let xff = [("x-api-key", "delta"), ("x-forwarded-for", "10.1.2.3")];
    let (s, _, _) = send(&g, 3, &xff).await;
    assert_eq!(s, [200, 200, 429]);
    g.stop().await;
}

async fn wait_for_reloads(g: &Gateway, result: &str, at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = g.metrics().await;
        let n = metric(
            &m,
            &format!("tollgate_config_reloads_total{{result=\"{result}\"}}"),
        )
        .unwrap_or(0.0);
        if n >= at_least {
            return;
        }
        assert!(Instant::now() < deadline, "no {result} reload within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes like an editor: a temp file renamed over the old one.
fn save(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The overrides file: its plans and exemptions apply; a change is picked up by the watcher
/// (no reload command); a key moved to a bigger plan keeps its count (a fixed window's used
/// units stay used) and the in-process tier, which held the key rejected under the old rate,
/// never answers it under that rate again; a bad file is refused at its line and the running
/// table stays. Both scopes.
#[tokio::test]
async fn the_overrides_file_is_reloaded_and_a_key_keeps_its_state_under_its_new_plan() {
    let up = Upstream::start().await;
    for (scope, redis) in scopes() {
        let dir = TempDir::new();
        let file = dir.path.join("consumers.yaml");
        std::fs::write(&file, "vip: exempt\n").unwrap();
        let name = format!("file-{scope}");
        let yaml = format!(
            "server:
  listen: 127.0.0.1:0
  admin: 127.0.0.1:0
{redis}plans:
  pro: {{ rate: 6/1h }}
routes:
  - name: {name}
    upstream: {up}
    limits:
      - name: daily
        key: [header:x-api-key]
        algorithm: fixed_window
        rate: 3/1h
        scope: {scope}
        overrides_file: {file}
",
            up = up.url(),
            file = file.display()
        );
        let g = Gateway::start(&yaml).await;
        let (s, _, _) = send(&g, 5, &[("x-api-key", "vip")]).await;
        assert_eq!(s, [200; 5], "{scope}: exempt by the file");
        // `k` spends the limit's 3 and is rejected, twice: for a global limit the in-process
        // tier now holds "rejected until the window ends".
        let (s, _, _) = send(&g, 5, &[("x-api-key", "k")]).await;
        assert_eq!(s, [200, 200, 200, 429, 429], "{scope}");
        // The file gives `k` the plan `pro` (6 a window): its 3 used units stay used, 3 more.
        save(&file, "vip: exempt\nk: pro\n");
        wait_for_reloads(&g, "success", 1.0).await;
        let (s, policy, field) = send(&g, 4, &[("x-api-key", "k")]).await;
        assert_eq!(s, [200, 200, 200, 429], "{scope}: the count carried on");
        assert_eq!(policy, "\"daily\";q=6;w=3600", "{scope}");
        assert!(field.starts_with("\"daily\";r=0;"), "{scope}: {field}");
        // A bad file (an unknown plan) is refused; the running table stays.
        save(&file, "vip: exempt\nk: pro\nz: gold\n");
        wait_for_reloads(&g, "error", 1.0).await;
        let (s, _, _) = send(&g, 3, &[("x-api-key", "vip")]).await;
        assert_eq!(s, [200; 3], "{scope}: the running table stays");
        let r = client()
            .post(g.admin_url("/admin/reload"))
            .send()
            .await
            .unwrap();
        let body = r.text().await.unwrap();
        assert!(
            body.contains("consumers.yaml:3:4") && body.contains("`gold` is not a plan"),
            "{scope}: {body}"
        );
        // Moved back to the limit's rate: 6 used of 3, rejected until the window ends.
        save(&file, "vip: exempt\n");
        wait_for_reloads(&g, "success", 2.0).await;
        let (s, policy, _) = send(&g, 1, &[("x-api-key", "k")]).await;
        assert_eq!(s, [429], "{scope}");
        assert_eq!(policy, "\"daily\";q=3;w=3600", "{scope}");
        g.stop().await;
    }
}

/// A top-level limit used by two routes is one budget per key: units taken on one route are
/// gone on the other, local and in Redis (whose key holds no route); each route counts its own
/// decisions.
#[tokio::test]
async fn a_shared_limit_is_one_budget_across_routes() {
    let up = Upstream::start().await;
    for (scope, redis) in scopes() {
        let prefix = format!("shared-{scope}");
        let yaml = format!(
            "server:
  listen: 127.0.0.1:0
  admin: 127.0.0.1:0
{redis}limits:
  - name: {prefix}-budget
    key: [header:x-api-key]
    rate: 3/1h
    scope: {scope}
routes:
  - name: {prefix}-a
    match: {{ path_prefix: /a }}
    upstream: {up}
    limits:
      - use: {prefix}-budget
  - name: {prefix}-b
    match: {{ path_prefix: /b }}
    upstream: {up}
    limits:
      - use: {prefix}-budget
      - name: own
        key: [header:x-api-key]
        rate: 100/1h
        scope: {scope}
",
            up = up.url()
        );
        let g = Gateway::start(&yaml).await;
        let c = client();
        let get = |path: &'static str| {
            let req = c.get(g.url(path)).header("x-api-key", "k").send();
            async move { req.await.unwrap().status().as_u16() }
        };
        assert_eq!(
            [get("/a").await, get("/b").await, get("/a").await],
            [200; 3]
        );
        assert_eq!([get("/b").await, get("/a").await], [429, 429], "{scope}");
        // Another key has its own budget.
        let other = c
            .get(g.url("/b"))
            .header("x-api-key", "other")
            .send()
            .await
            .unwrap();
        assert_eq!(other.status(), 200, "{scope}");
        let m = g.metrics().await;
        let series = |route: &str, d: &str| {
            format!(
                "tollgate_limit_decisions_total{{route=\"{prefix}-{route}\",limit=\"{prefix}-budget\",decision=\"{d}\"}}"
            )
        };
        assert_eq!(metric(&m, &series("a", "allowed")), Some(2.0), "{scope}");
        assert_eq!(metric(&m, &series("b", "allowed")), Some(2.0), "{scope}");
        assert_eq!(metric(&m, &series("a", "rejected")), Some(1.0), "{scope}");
        assert_eq!(metric(&m, &series("b", "rejected")), Some(1.0), "{scope}");
        // The admin API sees the one state through either route.
        for route in ["a", "b"] {
            let st = g
                .admin_json(&format!(
                    "/admin/limits/{prefix}-{route}/{prefix}-budget?key=k"
                ))
                .await;
            assert_eq!(st["remaining"], 0, "{scope} via {route}: {st}");
            assert_eq!(st["shared"], true, "{scope}: {st}");
        }
        if scope == "global" {
            let keys =
                shared_redis().cli(&["--scan", "--pattern", &format!("tg:{{@{prefix}-budget/*")]);
            assert!(
                keys.contains("/k}"),
                "one Redis state without the route: {keys}"
            );
        }
        // A reset through one route frees the key for both.
        let r = c
            .delete(g.admin_url(&format!("/admin/limits/{prefix}-a/{prefix}-budget?key=k")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{scope}");
        assert_eq!(get("/b").await, 200, "{scope}");
        g.stop().await;
    }
}
