//! End to end on real sockets: the gateway in process on port 0, real upstreams on loopback.
//! Time-dependent limit behaviour runs on a manual clock, so nothing here sleeps for a window.

use crate::support;

use std::time::Duration;

use crate::support::upstream::Upstream;
use crate::support::{Gateway, client, closed_addr, metric};
use bytes::Bytes;
use serde_json::Value;

fn yaml(upstream: &str, routes: &str) -> String {
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nroutes:\n{}",
        routes.replace("UPSTREAM", upstream)
    )
}

async fn echo(resp: reqwest::Response) -> Value {
    serde_json::from_str(&resp.text().await.unwrap()).unwrap()
}

#[tokio::test]
async fn unmatched_path_is_404_json_and_prefixes_match_whole_segments() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(
        &up.url(),
        "  - name: api\n    match: { path_prefix: /api }\n    upstream: UPSTREAM\n",
    ))
    .await;
    let c = client();
    let r = c.get(g.url("/apix")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.headers()["content-type"], "application/json");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "not_found");
    assert_eq!(c.get(g.url("/api")).send().await.unwrap().status(), 200);
    let r = c.get(g.url("/api/users?x=1")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let e = echo(r).await;
    assert_eq!(e["path"], "/api/users");
    assert_eq!(e["query"], "x=1");
}

#[tokio::test]
async fn exact_path_host_and_methods_first_match_wins() {
    let a = Upstream::named("a").await;
    let b = Upstream::named("b").await;
    let routes = format!(
        "  - name: login\n    match: {{ path: /login, methods: [POST] }}\n    upstream: {}\n  - name: vhost\n    match: {{ path_prefix: /, host: api.example.com }}\n    upstream: {}\n  - name: rest\n    match: {{ path_prefix: / }}\n    upstream: {}\n",
        a.url(),
        b.url(),
        a.url()
    );
    let g = Gateway::start(&yaml("", &routes)).await;
    let c = client();
    let who =
        |r: reqwest::Response| async { echo(r).await["upstream"].as_str().unwrap().to_owned() };
    assert_eq!(
        who(c.post(g.url("/login")).send().await.unwrap()).await,
        "a"
    );
    let r = c
        .get(g.url("/login"))
        .header("host", "API.example.com:8080")
        .send()
        .await
        .unwrap();
    assert_eq!(who(r).await, "b");
    assert_eq!(who(c.get(g.url("/login")).send().await.unwrap()).await, "a");
}

#[tokio::test]
async fn forwarding_sets_x_forwarded_and_strips_hop_by_hop_both_ways() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), "  - name: all\n    upstream: UPSTREAM\n")).await;
    let c = client();
    let r = c
        .get(g.url("/echo"))
        .header("connection", "keep-alive, x-drop-me")
        .header("x-drop-me", "1")
        .header("keep-alive", "timeout=5")
        .header("x-forwarded-for", "6.6.6.6")
        .header("x-custom", "kept")
        .send()
        .await
        .unwrap();
    let e = echo(r).await;
    let h = &e["headers"];
    assert!(h.get("x-drop-me").is_none(), "{h}");
    assert!(h.get("keep-alive").is_none(), "{h}");
    assert_eq!(h["x-custom"], "kept");
    assert_eq!(h["x-forwarded-for"], "6.6.6.6, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-forwarded-host"], g.addr.to_string());
    assert_eq!(
        h["host"],
        g.addr.to_string(),
        "preserve_host defaults to true"
    );

    let r = c.get(g.url("/hop")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let rh = r.headers();
    assert!(rh.get("x-internal").is_none());
    assert!(rh.get("keep-alive").is_none());
    assert!(rh.get("proxy-authenticate").is_none());
    assert_eq!(rh["x-end-to-end"], "kept");
}

#[tokio::test]
async fn preserve_host_false_sends_the_upstream_authority() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(
        &up.url(),
        "  - name: all\n    upstream: UPSTREAM\n    preserve_host: false\n",
    ))
    .await;
    let e = echo(client().get(g.url("/")).send().await.unwrap()).await;
    assert_eq!(e["headers"]["host"], up.addr.to_string());
}

#[tokio::test]
async fn upstream_down_is_502_and_slow_upstream_is_504() {
    let free = support::closed_addr();
    let up = Upstream::start().await;
    let routes = format!(
        "  - name: down\n    match: {{ path_prefix: /down }}\n    upstream: http://{free}\n  - name: slow\n    match: {{ path_prefix: /slow }}\n    upstream: {}\n    timeout: 200ms\n",
        up.url()
    );
    let g = Gateway::start(&yaml("", &routes)).await;
    let c = client();
    let r = c.get(g.url("/down")).send().await.unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(echo(r).await["error"], "bad_gateway");
    let t = std::time::Instant::now();
    let r = c.get(g.url("/slow?ms=3000")).send().await.unwrap();
    assert_eq!(r.status(), 504);
    assert!(t.elapsed() < Duration::from_secs(2));
    let r = c.get(g.url("/slow?ms=10")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn upstream_list_is_round_robin() {
    let a = Upstream::named("a").await;
    let b = Upstream::named("b").await;
    let routes = format!("  - name: all\n    upstream: [{}, {}]\n", a.url(), b.url());
    let g = Gateway::start(&yaml("", &routes)).await;
    let c = client();
    for _ in 0..10 {
        c.get(g.url("/"))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
    }
    assert_eq!(a.hits(), 5);
    assert_eq!(b.hits(), 5);
}

/// An upstream of a list that refuses connections costs no request a 502: the request goes on
/// to the next (nothing of it was sent), with a body too, and the refusing one is tried after
/// the others for a while (nginx's `proxy_next_upstream error`, `max_fails=1 fail_timeout=10s`).
/// On both HTTP paths.
#[tokio::test]
async fn a_request_goes_on_to_the_next_upstream_when_one_refuses_the_connection() {
    for fast_path in [true, false] {
        let live = Upstream::named("live").await;
        let routes = format!(
            "  - name: all\n    upstream: [http://{}, {}]\n    preserve_host: false\n",
            closed_addr(),
            live.url()
        );
        let mut config = yaml("", &routes);
        if !fast_path {
            config = config.replace(
                "  admin: 127.0.0.1:0\n",
                "  admin: 127.0.0.1:0\n  fast_path: false\n",
            );
        }
        let g = Gateway::start(&config).await;
        let c = client();
        // The first request meets the refusing upstream first (a POST: its body must go to
        // the next whole); the later ones find it marked down and go to the live one first.
        for i in 0..6 {
            let r = if i % 2 == 0 {
                c.post(g.url("/echo")).body("payload").send().await.unwrap()
            } else {
                c.get(g.url("/x")).send().await.unwrap()
            };
            assert_eq!(r.status(), 200, "fast_path {fast_path}, request {i}");
            if i % 2 == 0 {
                let e = echo(r).await;
                assert_eq!(e["body_len"], 7);
                // Aimed at the upstream it reached, not the one that refused.
                assert_eq!(
                    e["headers"]["host"],
                    live.url().trim_start_matches("http://")
                );
            }
        }
        assert_eq!(live.hits(), 6, "fast_path {fast_path}");
    }
}

#[tokio::test]
async fn request_body_streams_before_the_client_finishes() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), "  - name: all\n    upstream: UPSTREAM\n")).await;
    // The client sends one chunk and then waits for the response before sending the rest: a
    // gateway that buffered the body would never forward the first chunk and this would hang.
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    let body = reqwest::Body::wrap_stream(tokio_stream(rx));
    tx.send(Ok(Bytes::from(vec![b'a'; 1024]))).await.unwrap();
    let req = client().post(g.url("/first-chunk")).body(body).send();
    let r = tokio::time::timeout(Duration::from_secs(5), req)
        .await
        .expect("response before the body finished: the gateway streams")
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "first:1024");
    drop(tx);
}

fn tokio_stream(
    mut rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn eight_mib_upload_and_download_pass_in_chunks() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), "  - name: all\n    upstream: UPSTREAM\n")).await;
    let chunks = (0..128).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![7u8; 64 * 1024])));
    let body = reqwest::Body::wrap_stream(futures_util::stream::iter(chunks));
    let r = client()
        .post(g.url("/echo"))
        .body(body)
        .send()
        .await
        .unwrap();
    let e = echo(r).await;
    assert_eq!(e["body_len"], 8 * 1024 * 1024);
    assert!(
        e["body_chunks"].as_u64().unwrap() > 1,
        "arrived as a stream of chunks"
    );

    let mut r = client()
        .get(g.url("/stream?bytes=8388608"))
        .send()
        .await
        .unwrap();
    let mut total = 0;
    let mut n = 0;
    while let Some(chunk) = r.chunk().await.unwrap() {
        total += chunk.len();
        n += 1;
    }
    assert_eq!(total, 8 * 1024 * 1024);
    assert!(n > 1);
}

#[tokio::test]
async fn http2_prior_knowledge_clients_are_served() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), "  - name: all\n    upstream: UPSTREAM\n")).await;
    let c = reqwest::Client::builder()
        .http2_prior_knowledge()
        .no_proxy()
        .build()
        .unwrap();
    let r = c.get(g.url("/echo")).send().await.unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
    let e = echo(r).await;
    assert_eq!(e["headers"]["host"], g.addr.to_string());
    // HTTP/2 carries the host in `:authority`; X-Forwarded-Host is set from it all the same.
    assert_eq!(e["headers"]["x-forwarded-host"], g.addr.to_string());
    assert_eq!(e["headers"]["x-forwarded-proto"], "http");
}

/// HEAD answers tollgate writes itself (404, 429, 502…) carry no body on HTTP/2 either: a
/// DATA frame after a HEAD's headers is a protocol error to the client (curl: "stream 1 was
/// not closed cleanly: PROTOCOL_ERROR"), which then sees no status at all.
#[tokio::test]
async fn http2_head_gets_tollgates_own_answers_without_a_body() {
    let up = Upstream::start().await;
    let routes = format!(
        "{LIMITED}  - name: dead\n    match: {{ path_prefix: /dead }}\n    upstream: http://{}\n",
        closed_addr()
    );
    let g = Gateway::start(&yaml(&up.url(), &routes)).await;
    let c = reqwest::Client::builder()
        .http2_prior_knowledge()
        .no_proxy()
        .build()
        .unwrap();
    for (path, status) in [
        ("/nothing", 404),
        ("/dead", 502),
        ("/v1/a", 200),
        ("/v1/a", 200),
        ("/v1/a", 429),
    ] {
        let r = c.head(g.url(path)).send().await.unwrap();
        assert_eq!(r.version(), reqwest::Version::HTTP_2);
        assert_eq!(r.status(), status, "{path}");
        assert!(r.bytes().await.unwrap().is_empty(), "{path}");
    }
}

const LIMITED: &str = "  - name: users
    match: { path_prefix: /v1 }
    upstream: UPSTREAM
    limits:
      - name: per-ip
        key: [ip]
        algorithm: gcra
        rate: 2/10s
        burst: 2
";

#[tokio::test]
async fn rejection_is_429_with_retry_after_ratelimit_fields_and_json_then_admits_after_it() {
    let up = Upstream::start().await;
    let (g, clock) = Gateway::start_manual(&yaml(&up.url(), LIMITED)).await;
    let c = client();
    let r = c.get(g.url("/v1/a")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["ratelimit-policy"], "\"per-ip\";q=2;w=10");
    assert_eq!(r.headers()["ratelimit"], "\"per-ip\";r=1;t=5");
    assert_eq!(c.get(g.url("/v1/a")).send().await.unwrap().status(), 200);
    let r = c.get(g.url("/v1/a")).send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "5");
    assert_eq!(r.headers()["ratelimit-policy"], "\"per-ip\";q=2;w=10");
    assert_eq!(r.headers()["ratelimit"], "\"per-ip\";r=0;t=5");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "rate_limited");
    assert_eq!(body["route"], "users");
    assert_eq!(body["limit"], "per-ip");
    assert_eq!(body["retry_after_ms"], 5000);
    assert_eq!(
        up.hits(),
        2,
        "a rejected request never reaches the upstream"
    );
    // One microsecond short of Retry-After: still rejected; at Retry-After: admitted.
    clock.advance(4_999_999);
    assert_eq!(c.get(g.url("/v1/a")).send().await.unwrap().status(), 429);
    clock.advance(1);
    assert_eq!(c.get(g.url("/v1/a")).send().await.unwrap().status(), 200);
}

#[tokio::test]
async fn a_request_rejected_by_one_limit_consumes_from_none() {
    let up = Upstream::start().await;
    let routes = "  - name: r
    upstream: UPSTREAM
    limits:
      - name: wide
        key: [literal:all]
        algorithm: sliding_log
        rate: 3/1m
      - name: per-user
        key: [header:x-user]
        algorithm: fixed_window
        rate: 1/1m
";
    let (g, _clock) = Gateway::start_manual(&yaml(&up.url(), routes)).await;
    let c = client();
    let get = |u: &'static str| c.get(g.url("/")).header("x-user", u).send();
    assert_eq!(get("alice").await.unwrap().status(), 200);
    // alice is out of her own limit: these are rejected by per-user and must not eat `wide`.
    for _ in 0..5 {
        let r = get("alice").await.unwrap();
        assert_eq!(r.status(), 429);
        assert_eq!(r.json::<Value>().await.unwrap()["limit"], "per-user");
    }
    assert_eq!(get("bob").await.unwrap().status(), 200);
    assert_eq!(get("carol").await.unwrap().status(), 200);
    let r = get("dave").await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.json::<Value>().await.unwrap()["limit"], "wide");
}

#[tokio::test]
async fn shadow_limits_count_but_never_reject_and_missing_keys_follow_on_missing() {
    let up = Upstream::start().await;
    let routes = "  - name: r
    upstream: UPSTREAM
    limits:
      - name: shadowed
        key: [ip]
        algorithm: fixed_window
        rate: 1/1m
        shadow: true
      - name: by-user
        key: [header:x-user]
        rate: 1/1m
      - name: by-tenant
        key: [query:tenant]
        rate: 100/1m
        on_missing: reject
";
    let (g, _clock) = Gateway::start_manual(&yaml(&up.url(), routes)).await;
    let c = client();
    // No x-user: by-user does not apply (skip). No tenant: rejected (429, its own error, no
    // Retry-After: waiting does not help).
    let r = c.get(g.url("/")).send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().get("retry-after").is_none());
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"], "missing_key");
    assert_eq!(b["part"], "query:tenant");
    assert_eq!(
        metric(
            &g.metrics().await,
            "tollgate_limit_decisions_total{route=\"r\",limit=\"by-tenant\",decision=\"rejected\"}"
        ),
        Some(1.0)
    );
    for _ in 0..3 {
        let r = c.get(g.url("/?tenant=t1")).send().await.unwrap();
        assert_eq!(r.status(), 200, "shadow never rejects; by-user skipped");
    }
    let m = g.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tollgate_limit_decisions_total{route=\"r\",limit=\"shadowed\",decision=\"shadow_rejected\"}"
        ),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "tollgate_limit_decisions_total{route=\"r\",limit=\"shadowed\",decision=\"allowed\"}"
        ),
        Some(1.0)
    );
    // With a user: by-user applies.
    let r = c
        .get(g.url("/?tenant=t1"))
        .header("x-user", "u")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .get(g.url("/?tenant=t1"))
        .header("x-user", "u")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
}

/// `shadow: true` never changes what the client gets, whatever else the limit says: a missing
/// key with `on_missing: reject` is counted, not refused, and a reservation with
/// `on_limit: delay` is counted, not waited for (the clock here is manual, so a wait would
/// never end).
#[tokio::test]
async fn a_shadow_limit_neither_refuses_a_missing_key_nor_delays() {
    let up = Upstream::start().await;
    let routes = "  - name: r
    upstream: UPSTREAM
    limits:
      - name: shadow-tenant
        key: [query:tenant]
        on_missing: reject
        rate: 100/1m
        shadow: true
      - name: shadow-delay
        key: [ip]
        rate: 1/1m
        on_limit: delay
        max_delay: 5m
        shadow: true
";
    let (g, _clock) = Gateway::start_manual(&yaml(&up.url(), routes)).await;
    let c = client();
    for _ in 0..3 {
        let r = tokio::time::timeout(Duration::from_secs(10), c.get(g.url("/")).send())
            .await
            .expect("a shadow limit's reservation is not waited for")
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let m = g.metrics().await;
    let decisions = |limit: &str, decision: &str| {
        metric(
            &m,
            &format!(
                "tollgate_limit_decisions_total{{route=\"r\",limit=\"{limit}\",decision=\"{decision}\"}}"
            ),
        )
    };
    assert_eq!(
        decisions("shadow-tenant", "shadow_rejected"),
        Some(3.0),
        "{m}"
    );
    assert_eq!(decisions("shadow-tenant", "rejected"), Some(0.0), "{m}");
    assert_eq!(decisions("shadow-delay", "allowed"), Some(1.0), "{m}");
    assert_eq!(decisions("shadow-delay", "delayed"), Some(2.0), "{m}");
    // Counted as delayed, but no delay was given: none in the histogram of delays given.
    let given = metric(
        &m,
        "tollgate_delay_seconds_count{route=\"r\",limit=\"shadow-delay\"}",
    );
    assert!(given.is_none_or(|n| n == 0.0), "{m}");
}

#[tokio::test]
async fn on_missing_ip_falls_back_to_the_client_address() {
    let up = Upstream::start().await;
    let routes = "  - name: r
    upstream: UPSTREAM
    limits:
      - name: by-user
        key: [header:x-user]
        rate: 1/1m
        on_missing: ip
";
    let (g, _clock) = Gateway::start_manual(&yaml(&up.url(), routes)).await;
    let c = client();
    assert_eq!(c.get(g.url("/")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(g.url("/")).send().await.unwrap().status(), 429);
    // A user named like the address, or like the fallback key itself, is a different key.
    for user in ["127.0.0.1", "ip 127.0.0.1", "ip:127.0.0.1"] {
        let r = c
            .get(g.url("/"))
            .header("x-user", user)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{user}");
    }
    // The fallback key as the README spells it for the admin API.
    let s: serde_json::Value = g
        .admin_json("/admin/limits/r/by-user?key=ip+127.0.0.1")
        .await;
    assert_eq!(s["remaining"], 0, "{s}");
}

#[tokio::test]
async fn x_forwarded_for_is_believed_only_from_trusted_proxies() {
    let up = Upstream::start().await;
    let limits = "    limits:
      - name: per-ip
        key: [ip]
        rate: 1/1m
";
    let untrusted = format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nroutes:\n  - name: r\n    upstream: {}\n{limits}",
        up.url()
    );
    let (g, _c) = Gateway::start_manual(&untrusted).await;
    let c = client();
    let send = |ip: &'static str| c.get(g.url("/")).header("x-forwarded-for", ip).send();
    assert_eq!(send("1.1.1.1").await.unwrap().status(), 200);
    // The peer (127.0.0.1) is not trusted: a new XFF value does not buy a new budget.
    assert_eq!(send("2.2.2.2").await.unwrap().status(), 429);
    drop(g);

    let trusted = untrusted.replace(
        "admin: 127.0.0.1:0\n",
        "admin: 127.0.0.1:0\n  trusted_proxies: [127.0.0.0/8]\n",
    );
    let (g, _c) = Gateway::start_manual(&trusted).await;
    let send = |ip: &'static str| c.get(g.url("/")).header("x-forwarded-for", ip).send();
    assert_eq!(send("1.1.1.1").await.unwrap().status(), 200);
    assert_eq!(send("2.2.2.2").await.unwrap().status(), 200);
    assert_eq!(send("1.1.1.1").await.unwrap().status(), 429);
    // Spoofed entries left of a real client are ignored: the rightmost untrusted hop counts.
    assert_eq!(send("9.9.9.9, 2.2.2.2").await.unwrap().status(), 429);
}

#[tokio::test]
async fn metrics_healthz_readyz_on_admin_port_only() {
    let up = Upstream::start().await;
    let (g, _clock) = Gateway::start_manual(&yaml(&up.url(), LIMITED)).await;
    let c = client();
    for _ in 0..3 {
        c.get(g.url("/v1/x")).send().await.unwrap();
    }
    c.get(g.url("/nowhere")).send().await.unwrap();
    let m = g.metrics().await;
    for series in [
        "tollgate_requests_total{route=\"users\",status=\"200\"} 2",
        "tollgate_requests_total{route=\"users\",status=\"429\"} 1",
        "tollgate_limit_decisions_total{route=\"users\",limit=\"per-ip\",decision=\"allowed\"} 2",
        "tollgate_limit_decisions_total{route=\"users\",limit=\"per-ip\",decision=\"rejected\"} 1",
        "tollgate_request_duration_seconds_count{route=\"users\"} 3",
        "tollgate_upstream_duration_seconds_count{route=\"users\"} 2",
        "tollgate_limiter_duration_seconds_count{scope=\"local\"} 3",
    ] {
        assert!(m.contains(series), "missing {series} in\n{m}");
    }
    for name in [
        "tollgate_redis_errors_total",
        "tollgate_fallback_decisions_total",
        "tollgate_config_reloads_total",
    ] {
        assert!(m.contains(&format!("# TYPE {name} counter\n")), "{name}");
    }
    assert!(!m.contains("127.0.0.1"), "no client key in any label");
    assert_eq!(
        c.get(g.admin_url("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        c.get(g.admin_url("/readyz")).send().await.unwrap().status(),
        200
    );
    // Admin paths are not served on the proxy port (here: no route matches them → 404 from the
    // route table, never the admin handler).
    let r = c.get(g.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 404);
}

#[tokio::test]
async fn admin_paths_on_the_proxy_port_go_upstream_when_a_route_matches() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), "  - name: all\n    upstream: UPSTREAM\n")).await;
    let e = echo(client().get(g.url("/metrics")).send().await.unwrap()).await;
    assert_eq!(
        e["path"], "/metrics",
        "the proxy port forwards, it never answers admin paths"
    );
}

#[tokio::test]
async fn dot_segments_are_refused_with_400() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), "  - name: all\n    upstream: UPSTREAM\n")).await;
    // reqwest normalises paths, so speak HTTP/1.1 by hand.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(g.addr).await.unwrap();
    s.write_all(b"GET /api/../admin HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    assert_eq!(up.hits(), 0);
}

#[tokio::test]
async fn a_target_without_a_leading_slash_is_refused_with_400() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), "  - name: all\n    upstream: UPSTREAM\n")).await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for target in ["rr", "example.com:80"] {
        let mut s = tokio::net::TcpStream::connect(g.addr).await.unwrap();
        s.write_all(
            format!("GET {target} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 400"), "{target}: {out}");
    }
    assert_eq!(up.hits(), 0);
}

#[tokio::test]
async fn percent_encoded_letters_reach_the_same_route_limit_and_upstream_path() {
    let up = Upstream::start().await;
    let routes = "  - name: login\n    match: { path_prefix: /login }\n    upstream: UPSTREAM\n    limits:\n      - { name: once, key: ip, algorithm: fixed_window, rate: 1/1h, scope: local }\n  - name: rest\n    upstream: UPSTREAM\n";
    let g = Gateway::start(&yaml(&up.url(), routes)).await;
    let c = client();
    let r = c.get(g.url("/login?next=%2F")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let e = echo(r).await;
    assert_eq!(e["path"], "/login");
    // Other spellings of the same path are the same route, so the same limit.
    for spelled in ["/%6cogin", "/%6Cogin", "/l%6fgin/x"] {
        let r = c.get(g.url(spelled)).send().await.unwrap();
        assert_eq!(r.status(), 429, "{spelled}");
    }
    assert_eq!(up.hits(), 1);
    // An encoded reserved character is not decoded (it is not the same path).
    let r = c.get(g.url("/a%2fb")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(echo(r).await["path"], "/a%2Fb");
}

#[tokio::test]
async fn request_duration_covers_the_whole_response_body_and_unmatched_requests() {
    let up = Upstream::start().await;
    let routes = "  - name: api\n    match: { path_prefix: /late-body }\n    upstream: UPSTREAM\n";
    let g = Gateway::start(&yaml(&up.url(), routes)).await;
    let c = client();
    let r = c.get(g.url("/late-body?ms=400")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "late\n");
    assert_eq!(c.get(g.url("/nowhere")).send().await.unwrap().status(), 404);
    let m = g.metrics().await;
    let sum = metric(&m, "tollgate_request_duration_seconds_sum{route=\"api\"}").unwrap();
    assert!(sum >= 0.4, "request duration {sum} s stops before the body");
    let upstream = metric(&m, "tollgate_upstream_duration_seconds_sum{route=\"api\"}").unwrap();
    assert!(
        upstream < 0.4,
        "upstream duration {upstream} s is to the response head"
    );
    let unmatched = metric(
        &m,
        "tollgate_request_duration_seconds_count{route=\"_unmatched\"}",
    );
    assert_eq!(unmatched, Some(1.0));
}

#[tokio::test]
async fn upgrade_requests_pass_through_both_ways_after_the_limit_decision() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = Upstream::start().await;
    let routes = "  - name: ws
    upstream: UPSTREAM
    limits:
      - name: per-ip
        rate: 1/1m
";
    let (g, _clock) = Gateway::start_manual(&yaml(&up.url(), routes)).await;
    let mut s = tokio::net::TcpStream::connect(g.addr).await.unwrap();
    s.write_all(
        b"GET /upgrade HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: echo\r\n\r\n",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: echo"), "{head}");
    assert!(head.contains("ratelimit:"), "{head}");
    for msg in [&b"ping"[..], b"and pong"] {
        s.write_all(msg).await.unwrap();
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(got, msg);
    }
    // The upgrade request consumed the limit: the next one is rejected before any switch.
    let r = client().get(g.url("/upgrade")).send().await.unwrap();
    assert_eq!(r.status(), 429);
}

#[tokio::test]
async fn request_ids_are_kept_or_generated_and_sent_both_ways() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), "  - name: all\n    upstream: UPSTREAM\n")).await;
    let c = client();
    let r = c
        .get(g.url("/"))
        .header("x-request-id", "abc-1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "abc-1");
    assert_eq!(echo(r).await["headers"]["x-request-id"], "abc-1");
    let r = c.get(g.url("/")).send().await.unwrap();
    let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(id.len(), 32);
    assert_eq!(echo(r).await["headers"]["x-request-id"], id.as_str());
    let r = c.get(g.url("/nowhere-at-all")).send().await;
    assert!(r.unwrap().headers().contains_key("x-request-id"));
}

/// A request whose every limit is skipped (its key part missing, `on_missing: skip`) is not a
/// limiter decision: it is forwarded and counted in no decision or limiter-duration series
/// (it was counted as a local decision).
#[tokio::test]
async fn a_request_no_limit_applies_to_is_no_limiter_decision() {
    let up = Upstream::start().await;
    let routes = "  - name: r
    upstream: UPSTREAM
    limits:
      - name: per-user
        key: [header:x-user]
        rate: 1/1m
";
    let g = Gateway::start(&yaml(&up.url(), routes)).await;
    let c = client();
    for _ in 0..3 {
        assert_eq!(c.get(g.url("/")).send().await.unwrap().status(), 200);
    }
    let m = g.metrics().await;
    for series in [
        "tollgate_limiter_duration_seconds_count{scope=\"local\"}",
        "tollgate_limiter_tier_decisions_total{scope=\"local\",tier=\"local\"}",
        "tollgate_limit_decisions_total{route=\"r\",limit=\"per-user\",decision=\"allowed\"}",
    ] {
        assert!(metric(&m, series).is_none_or(|n| n == 0.0), "{series}\n{m}");
    }
    assert_eq!(
        metric(&m, "tollgate_requests_total{route=\"r\",status=\"200\"}"),
        Some(3.0)
    );
}
