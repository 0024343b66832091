//! The admin listener: token, running config, one key's state, and the logs an operator reads.

use crate::support;

use std::io::Read;

use crate::support::process::Proc;
use crate::support::upstream::Upstream;
use crate::support::{Gateway, client};
use serde_json::Value;

fn cfg(upstream: &str, extra_server: &str) -> String {
    format!(
        "server:
  listen: 127.0.0.1:0
  admin: 127.0.0.1:0
{extra_server}routes:
  - name: api
    upstream: {upstream}
    limits:
      - name: per-user
        key: [header:x-user]
        algorithm: fixed_window
        rate: 3/1h
"
    )
}

#[tokio::test]
async fn admin_token_guards_admin_paths_but_not_metrics_or_probes() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), "  admin_token: s3cret\n")).await;
    let c = client();
    let r = c.get(g.admin_url("/admin/config")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .get(g.admin_url("/admin/config"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        c.post(g.admin_url("/admin/reload"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    let r = c
        .get(g.admin_url("/admin/config"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let cfg: Value = r.json().await.unwrap();
    assert_eq!(cfg["routes"][0]["name"], "api");
    assert_ne!(
        cfg["server"]["admin_token"], "s3cret",
        "secrets are not echoed"
    );
    for open in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(
            c.get(g.admin_url(open)).send().await.unwrap().status(),
            200,
            "{open}"
        );
    }
}

#[tokio::test]
async fn limit_state_of_one_key() {
    let up = Upstream::start().await;
    let (g, _clock) = Gateway::start_manual(&cfg(&up.url(), "")).await;
    let c = client();
    c.get(g.url("/"))
        .header("x-user", "ann")
        .send()
        .await
        .unwrap();
    let s: Value = g.admin_json("/admin/limits/api/per-user?key=ann").await;
    assert_eq!(s["remaining"], 2, "{s}");
    assert_eq!(s["store"], "local");
    assert!(s["reset_after_ms"].as_u64().unwrap() > 0);
    let fresh: Value = g.admin_json("/admin/limits/api/per-user?key=nobody").await;
    assert_eq!(fresh["remaining"], 3);
    assert_eq!(fresh["reset_after_ms"], 0);
    let r = c
        .get(g.admin_url("/admin/limits/api/nope?key=x"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // No key, or an empty one (no request has an empty key: an empty value is a missing part).
    for path in [
        "/admin/limits/api/per-user",
        "/admin/limits/api/per-user?key=",
    ] {
        let r = c.get(g.admin_url(path)).send().await.unwrap();
        assert_eq!(r.status(), 400, "{path}");
    }
}

/// Runs the binary with JSON logs on `cfg(.., extra_server)`, sends four requests as `user`
/// (one over the limit of 3), stops it, and returns all of stderr and the rejection line.
async fn rejection_log(extra_server: &str, user: &str) -> (String, Value) {
    let up = Upstream::start().await;
    let yaml = cfg(&up.url(), extra_server).replace(
        "127.0.0.1:0\n  admin: 127.0.0.1:0",
        "127.0.0.1:PROXY_PORT\n  admin: 127.0.0.1:ADMIN_PORT",
    );
    let mut p = Proc::start(
        &yaml,
        &["--log-format", "json"],
        &[("RUST_LOG", "info")],
        true,
    )
    .await;
    let c = client();
    for _ in 0..4 {
        c.get(format!("{}/", p.proxy))
            .header("x-user", user)
            .header("x-request-id", "req-42")
            .send()
            .await
            .unwrap();
    }
    p.signal("TERM");
    let _ = p.child.wait();
    let mut err = String::new();
    p.child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let line = err
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|_| panic!("not JSON: {l}")))
        .find(|l| l["fields"]["message"] == "rate limited")
        .unwrap_or_else(|| panic!("no rejection logged:\n{err}"));
    (err, line)
}

#[tokio::test]
async fn json_logs_name_route_limit_and_status_of_a_rejection_but_never_the_key() {
    let (err, rejected) = rejection_log("", "very-secret-user").await;
    assert_eq!(rejected["level"], "INFO");
    assert_eq!(rejected["fields"]["route"], "api");
    assert_eq!(rejected["fields"]["limit"], "per-user");
    assert_eq!(rejected["fields"]["status"], 429);
    assert_eq!(rejected["fields"]["request_id"], "req-42");
    assert!(!err.contains("very-secret-user"), "the key is not logged");
}

#[tokio::test]
async fn log_keys_puts_the_key_in_rejection_lines_when_configured() {
    let (_, line) = rejection_log("  log_keys: true\n", "ann").await;
    assert_eq!(line["fields"]["key"], "ann");
}

/// The `Content-Type` of an answer.
fn content_type(r: &reqwest::Response) -> &str {
    r.headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

/// Reads `text` as a classic text-format parser does: a sample belongs to the family of the
/// last `# TYPE` line, and must bear its name (counter, gauge) or name and a histogram suffix;
/// every `#` line is a HELP or TYPE. Returns the number of samples.
fn assert_classic_families(text: &str) -> usize {
    let mut family: Option<(&str, &str)> = None;
    let mut samples = 0;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            family = rest.split_once(' ');
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or_default();
            let announced = text.contains(&format!("# TYPE {name} "));
            assert!(announced, "HELP of {name} with no TYPE of that name");
            continue;
        }
        assert!(!line.starts_with('#'), "not classic text: {line}");
        let name = line.split(['{', ' ']).next().unwrap_or_default();
        let (fam, kind) = family.unwrap_or_else(|| panic!("{line} before any # TYPE"));
        let belongs = match kind {
            "counter" | "gauge" => name == fam,
            "histogram" => ["_bucket", "_sum", "_count"]
                .iter()
                .any(|s| name.strip_prefix(fam) == Some(*s)),
            _ => false,
        };
        assert!(belongs, "{line} is not a sample of # TYPE {fam} {kind}");
        samples += 1;
    }
    samples
}

#[tokio::test]
async fn metrics_are_classic_text_unless_the_scraper_asks_for_openmetrics() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), "")).await;
    let c = client();
    for _ in 0..4 {
        c.get(g.url("/"))
            .header("x-user", "ann")
            .send()
            .await
            .unwrap();
    }

    // Default (reqwest sends `Accept: */*`, curl too): classic text, counters named `_total`.
    let r = c.get(g.admin_url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(content_type(&r), "text/plain; version=0.0.4; charset=utf-8");
    let text = r.text().await.unwrap();
    for line in [
        "# TYPE tollgate_requests_total counter\n",
        "# TYPE tollgate_limit_decisions_total counter\n",
        "# TYPE tollgate_request_duration_seconds histogram\n",
        "# TYPE tollgate_local_keys gauge\n",
    ] {
        assert!(text.contains(line), "lacks {line}{text}");
    }
    let series = "tollgate_requests_total{route=\"api\",status=\"429\"}";
    assert_eq!(support::metric(&text, series), Some(1.0), "{text}");
    assert!(!text.contains("# EOF"), "{text}");
    assert!(assert_classic_families(&text) > 20, "{text}");

    // Prometheus asks for OpenMetrics first: it gets what the crate writes.
    let r = c
        .get(g.admin_url("/metrics"))
        .header("accept", "application/openmetrics-text;version=1.0.0")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        content_type(&r),
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    let om = r.text().await.unwrap();
    assert!(om.contains("# TYPE tollgate_requests counter\n"), "{om}");
    assert_eq!(support::metric(&om, series), Some(1.0), "{om}");
    assert!(om.ends_with("# EOF\n"), "{om}");
}

/// `status` of `method path` on the admin listener with `token` (none: no `Authorization`),
/// and the JSON body.
async fn admin_call(
    g: &Gateway,
    method: reqwest::Method,
    path: &str,
    token: Option<&str>,
) -> (u16, Value) {
    let mut r = client().request(method, g.admin_url(path));
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The statuses of `n` requests as `user`.
async fn statuses(g: &Gateway, user: &str, n: usize) -> Vec<u16> {
    let c = client();
    let mut out = Vec::new();
    for _ in 0..n {
        let r = c
            .get(g.url("/"))
            .header("x-user", user)
            .send()
            .await
            .unwrap();
        out.push(r.status().as_u16());
    }
    out
}

/// A key over its local limit is admitted again after `DELETE`, which the token guards; the
/// other keys keep their state. 404 and 400 as for the state.
#[tokio::test]
async fn delete_forgets_a_local_key_so_it_is_admitted_again() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), "  admin_token: s3cret\n")).await;
    assert_eq!(statuses(&g, "ann", 4).await, [200, 200, 200, 429]);
    assert_eq!(statuses(&g, "bob", 4).await, [200, 200, 200, 429]);
    let path = "/admin/limits/api/per-user?key=ann";
    let (s, _) = admin_call(&g, reqwest::Method::DELETE, path, None).await;
    assert_eq!(s, 401, "behind the token");
    let (s, _) = admin_call(&g, reqwest::Method::DELETE, path, Some("wrong")).await;
    assert_eq!(s, 401);
    assert_eq!(statuses(&g, "ann", 1).await, [429], "nothing was reset");
    let (s, body) = admin_call(&g, reqwest::Method::DELETE, path, Some("s3cret")).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["result"], "reset");
    assert_eq!(body["key"], "ann");
    assert_eq!(body["scope"], "local");
    assert_eq!(body["in_process"]["local"], true, "{body}");
    assert_eq!(body["redis_keys_deleted"], Value::Null);
    let (_, state) = admin_call(&g, reqwest::Method::GET, path, Some("s3cret")).await;
    assert_eq!(state["remaining"], 3, "full again: {state}");
    assert_eq!(statuses(&g, "ann", 4).await, [200, 200, 200, 429]);
    assert_eq!(
        statuses(&g, "bob", 1).await,
        [429],
        "another key keeps its state"
    );
    // Resetting a key held by no one: 200, nothing was held.
    let (s, body) = admin_call(
        &g,
        reqwest::Method::DELETE,
        "/admin/limits/api/per-user?key=nobody",
        Some("s3cret"),
    )
    .await;
    assert_eq!(
        (s, &body["in_process"]["local"]),
        (200, &Value::Bool(false))
    );
    for (path, want) in [
        ("/admin/limits/nope/per-user?key=ann", 404),
        ("/admin/limits/api/nope?key=ann", 404),
        ("/admin/limits/api/per-user", 400),
        ("/admin/limits/api/per-user?key=", 400),
    ] {
        let (s, body) = admin_call(&g, reqwest::Method::DELETE, path, Some("s3cret")).await;
        assert_eq!(s, want, "{path}: {body}");
        assert!(body["error"].is_string(), "{path}: {body}");
    }
}

/// `top` lists the keys rejected in the last minute, most first, with their counts; `n`
/// bounds the list; the token guards it.
#[tokio::test]
async fn top_lists_the_rejected_keys_most_first() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), "  admin_token: s3cret\n")).await;
    // 3 admitted each, then carol 5 rejections, ann 2, bob 1; dave never rejected.
    for (user, n) in [("ann", 5), ("bob", 4), ("carol", 8), ("dave", 2)] {
        statuses(&g, user, n).await;
    }
    let path = "/admin/limits/api/per-user/top";
    let (s, _) = admin_call(&g, reqwest::Method::GET, path, None).await;
    assert_eq!(s, 401, "behind the token");
    let (s, top) = admin_call(&g, reqwest::Method::GET, path, Some("s3cret")).await;
    assert_eq!(s, 200, "{top}");
    let listed: Vec<(String, u64, u64)> = top["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| {
            (
                k["key"].as_str().unwrap().to_owned(),
                k["count"].as_u64().unwrap(),
                k["error"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("carol".to_owned(), 5, 0),
            ("ann".to_owned(), 2, 0),
            ("bob".to_owned(), 1, 0)
        ],
        "{top}"
    );
    assert_eq!(top["rejected"], 8);
    assert_eq!(top["n"], 10, "the default");
    assert!(top["window_ms"].as_u64().unwrap() >= 60_000, "{top}");
    let (_, top) = admin_call(
        &g,
        reqwest::Method::GET,
        &format!("{path}?n=1"),
        Some("s3cret"),
    )
    .await;
    assert_eq!(top["keys"].as_array().unwrap().len(), 1);
    assert_eq!(top["keys"][0]["key"], "carol");
    let (_, top) = admin_call(
        &g,
        reqwest::Method::GET,
        &format!("{path}?n=100000"),
        Some("s3cret"),
    )
    .await;
    assert_eq!(
        top["n"], top["capacity"],
        "n is capped at the capacity: {top}"
    );
    for (path, want) in [
        (format!("{path}?n=0"), 400),
        (format!("{path}?n=many"), 400),
        ("/admin/limits/api/nope/top".to_owned(), 404),
        ("/admin/limits/nope/per-user/top".to_owned(), 404),
    ] {
        let (s, body) = admin_call(&g, reqwest::Method::GET, &path, Some("s3cret")).await;
        assert_eq!(s, want, "{path}: {body}");
    }
}
