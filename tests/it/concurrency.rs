//! Concurrency limits (`algorithm: concurrency`) on real sockets, with an upstream that holds
//! requests: at most `max_in_flight` of one key at once, the rest 429 with `Retry-After:
//! retry_after` and no `RateLimit` fields; a slot given back on every way an exchange ends, on
//! both codecs; global slots as leases in a real Redis shared by two instances, renewed while a
//! request outlives its lease, and given back by a SIGKILLed instance after `lease`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate::app::Shared;
use tollgate::metrics::Format;

use crate::support::process::Proc;
use crate::support::redis::{RedisServer, command_calls};
use crate::support::upstream::Upstream;
use crate::support::{Gateway, client, closed_addr, metric};

/// Both codecs: the fast HTTP/1.1 one (`fast_path: true`, the default) and hyper.
const CODECS: [bool; 2] = [true, false];

fn server(fast: bool) -> String {
    format!("server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\n  fast_path: {fast}\n")
}

/// A route `name` for paths under `prefix` to `upstream`, with the route `timeout`, whose one
/// limit, `slots`, is a concurrency limit keyed by `x-key` with `max_in_flight` slots; `extra`
/// lines are appended to the limit (or add limits).
fn slot_route(
    name: &str,
    prefix: &str,
    upstream: &str,
    (slots, timeout): (u64, &str),
    extra: &str,
) -> String {
    format!(
        "  - name: {name}\n    match: {{ path_prefix: {prefix} }}\n    upstream: {upstream}\n    timeout: {timeout}\n    limits:\n      - name: slots\n        key: [header:x-key]\n        algorithm: concurrency\n        max_in_flight: {slots}\n        retry_after: 2s\n{extra}"
    )
}

/// `tollgate_in_flight` of `route`'s `slots` limit.
fn in_flight(shared: &Shared, route: &str) -> f64 {
    let text = shared.gateway.metrics.encode(Format::Text);
    metric(
        &text,
        &format!("tollgate_in_flight{{route=\"{route}\",limit=\"slots\"}}"),
    )
    .unwrap_or(0.0)
}

/// Waits (at most 5 s) until `route` holds `n` slots.
async fn holds(shared: &Shared, route: &str, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight(shared, route) != n {
        assert!(
            Instant::now() < deadline,
            "route {route} holds {} slots, not {n}",
            in_flight(shared, route)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn get(url: String, key: &str) -> reqwest::Response {
    client().get(url).header("x-key", key).send().await.unwrap()
}

fn spawn_get(url: String, key: &'static str) -> tokio::task::JoinHandle<u16> {
    tokio::spawn(async move {
        let r = get(url, key).await;
        let status = r.status().as_u16();
        let _ = r.bytes().await;
        status
    })
}

#[tokio::test]
async fn local_slots_admit_max_in_flight_and_429_the_rest_without_ratelimit_fields() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let yaml = format!(
            "{}routes:\n{}",
            server(fast),
            slot_route("held", "/", &up.url(), (2, "5s"), "")
        );
        let g = Gateway::start(&yaml).await;
        let shared = g.shared.clone();
        let a = spawn_get(g.url("/slow?ms=700"), "k");
        let b = spawn_get(g.url("/slow?ms=700"), "k");
        holds(&shared, "held", 2.0).await;
        let r = get(g.url("/"), "k").await;
        assert_eq!(r.status(), 429, "fast codec: {fast}");
        assert_eq!(r.headers()["retry-after"], "2");
        assert!(r.headers().get("ratelimit").is_none());
        assert!(r.headers().get("ratelimit-policy").is_none());
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"], "rate_limited");
        assert_eq!(body["limit"], "slots");
        assert_eq!(body["retry_after_ms"], 2000);
        // Another key has slots of its own; an admitted response carries no RateLimit fields.
        let other = get(g.url("/"), "other").await;
        assert_eq!(other.status(), 200);
        assert!(other.headers().get("ratelimit").is_none());
        assert_eq!((a.await.unwrap(), b.await.unwrap()), (200, 200));
        holds(&shared, "held", 0.0).await;
        assert_eq!(get(g.url("/"), "k").await.status(), 200);
        let text = shared.gateway.metrics.encode(Format::Text);
        let decisions = |d: &str| {
            metric(
                &text,
                &format!(
                    "tollgate_limit_decisions_total{{route=\"held\",limit=\"slots\",decision=\"{d}\"}}"
                ),
            )
            .unwrap_or(0.0)
        };
        assert_eq!((decisions("allowed"), decisions("rejected")), (4.0, 1.0));
    }
}

/// One route per way an exchange can end, each with one slot (key `k`): after the exchange
/// the slot is free again, on both codecs.
#[tokio::test]
async fn a_slot_is_given_back_on_every_way_out() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let mut routes = String::new();
        let down = format!("http://{}", closed_addr());
        for (name, prefix, upstream, timeout) in [
            ("ok", "/ok", up.url(), "5s"),
            ("stream", "/stream", up.url(), "5s"),
            ("slow", "/slow", up.url(), "300ms"),
            ("late", "/late-body", up.url(), "300ms"),
            ("down", "/down", down, "5s"),
            // The upstream holds any path that starts with `/slow`.
            ("slowly", "/slowly", up.url(), "5s"),
        ] {
            routes.push_str(&slot_route(name, prefix, &upstream, (1, timeout), ""));
        }
        let g = Gateway::start(&format!("{}routes:\n{routes}", server(fast))).await;
        let shared = g.shared.clone();
        let free_again = |route: &'static str| {
            let shared = shared.clone();
            let url = g.url(&format!(
                "/{}",
                if route == "late" { "late-body" } else { route }
            ));
            async move {
                holds(&shared, route, 0.0).await;
                let r = get(url, "k").await;
                assert_ne!(r.status(), 429, "route {route}, fast codec {fast}");
            }
        };
        // Completed.
        let r = get(g.url("/ok"), "k").await;
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
        free_again("ok").await;
        // The client gone mid-body.
        let mut s = tokio::net::TcpStream::connect(g.addr).await.unwrap();
        s.write_all(b"GET /stream?bytes=104857600 HTTP/1.1\r\nhost: t\r\nx-key: k\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 4096];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(in_flight(&shared, "stream"), 1.0);
        drop(s);
        free_again("stream").await;
        // The upstream refused: 502.
        assert_eq!(get(g.url("/down"), "k").await.status(), 502);
        free_again("down").await;
        // No head within the route's timeout: 504.
        assert_eq!(get(g.url("/slow?ms=2000"), "k").await.status(), 504);
        free_again("slow").await;
        // The head in time, the body cut at the deadline.
        let r = get(g.url("/late-body?ms=2000"), "k").await;
        assert_eq!(r.status(), 200);
        assert!(r.bytes().await.is_err());
        free_again("late").await;
        // In flight when the listener drains: finished, then given back.
        let held = spawn_get(g.url("/slowly?ms=300"), "k");
        holds(&shared, "slowly", 1.0).await;
        g.stop().await;
        assert_eq!(held.await.unwrap(), 200);
        holds(&shared, "slowly", 0.0).await;
    }
}

/// A client that closes its connection while its request waits for the upstream's head gives
/// its slot back then, not when the upstream answers (nginx aborts such a request too): else
/// a client opening and dropping connections would hold every slot of its key for the route's
/// timeout. The fast codec; hyper's HTTP/1.1 server reads a closed client as a half-close and
/// notices it only when it writes the answer (docs/configuration.md).
#[tokio::test]
async fn a_client_gone_before_the_response_head_gives_its_slot_back_at_once() {
    let up = Upstream::start().await;
    let routes = slot_route("held", "/slow", &up.url(), (1, "10s"), "");
    let g = Gateway::start(&format!("{}routes:\n{routes}", server(true))).await;
    let shared = g.shared.clone();
    let mut s = tokio::net::TcpStream::connect(g.addr).await.unwrap();
    s.write_all(b"GET /slow?ms=5000 HTTP/1.1\r\nhost: t\r\nx-key: k\r\n\r\n")
        .await
        .unwrap();
    holds(&shared, "held", 1.0).await;
    assert_eq!(get(g.url("/slow?ms=1"), "k").await.status(), 429);
    let closed = Instant::now();
    drop(s);
    holds(&shared, "held", 0.0).await;
    assert!(
        closed.elapsed() < Duration::from_secs(2),
        "given back {:?} after the client left",
        closed.elapsed()
    );
    assert_eq!(get(g.url("/slow?ms=1"), "k").await.status(), 200);
}

/// An upgraded connection (general path) holds its slot while it stays open.
#[tokio::test]
async fn an_upgraded_connection_holds_its_slot_until_it_closes() {
    let up = Upstream::start().await;
    let g = Gateway::start(&format!(
        "{}routes:\n{}",
        server(true),
        slot_route("ws", "/", &up.url(), (1, "5s"), "")
    ))
    .await;
    let upgrade = b"GET /upgrade HTTP/1.1\r\nhost: t\r\nx-key: k\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n";
    let mut s = tokio::net::TcpStream::connect(g.addr).await.unwrap();
    s.write_all(upgrade).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s.write_all(b"ping").await.unwrap();
    let mut echo = [0u8; 4];
    s.read_exact(&mut echo).await.unwrap();
    assert_eq!(&echo, b"ping");
    assert_eq!(in_flight(&g.shared, "ws"), 1.0);
    assert_eq!(get(g.url("/"), "k").await.status(), 429);
    drop(s);
    holds(&g.shared, "ws", 0.0).await;
    assert_eq!(get(g.url("/"), "k").await.status(), 200);
}

/// A request another limit rejects takes no slot: all or nothing, locally and in Redis.
#[tokio::test]
async fn a_request_rejected_by_another_limit_keeps_no_slot() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    for scope in ["local", "global"] {
        let rate = "      - name: rate\n        key: [header:x-r]\n        rate: 1/1h\n";
        let yaml = format!(
            "{}redis:\n  url: {}\n  timeout: 2s\nroutes:\n{}",
            server(true),
            redis.url(),
            slot_route("both", "/", &up.url(), (2, "5s"), rate)
        )
        .replace(
            "algorithm: concurrency",
            &format!("algorithm: concurrency\n        scope: {scope}"),
        )
        .replace("rate: 1/1h", &format!("rate: 1/1h\n        scope: {scope}"));
        let g = Gateway::start(&yaml).await;
        let with = |r: &'static str, path: &str| {
            client()
                .get(g.url(path))
                .header("x-key", "k")
                .header("x-r", r)
                .send()
        };
        let first = tokio::spawn(with("1", "/slow?ms=800"));
        holds(&g.shared, "both", 1.0).await;
        // `rate` rejects it (its unit is gone): it must not keep the second slot.
        let r = with("1", "/").await.unwrap();
        assert_eq!(r.status(), 429, "scope {scope}");
        assert_eq!(
            r.json::<serde_json::Value>().await.unwrap()["limit"],
            "rate"
        );
        assert_eq!(in_flight(&g.shared, "both"), 1.0, "scope {scope}");
        let second = with("2", "/slow?ms=10").await.unwrap();
        assert_eq!(
            second.status(),
            200,
            "scope {scope}: the second slot was free"
        );
        assert_eq!(first.await.unwrap().unwrap().status(), 200);
        holds(&g.shared, "both", 0.0).await;
        redis.cli(&["FLUSHALL"]);
    }
}

fn global_yaml(redis: &str, upstream: &str, slots: u64, lease: &str) -> String {
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nredis:\n  url: {redis}\n  timeout: 2s\n  on_error: deny\nroutes:\n{}",
        slot_route(
            "g",
            "/",
            upstream,
            (slots, "40s"),
            &format!("        scope: global\n        lease: {lease}\n")
        )
    )
}

/// `cmdstat_fcall` calls so far.
fn fcalls(redis: &RedisServer) -> u64 {
    command_calls(&redis.cli(&["INFO", "commandstats"]), "fcall").0
}

/// Two instances share one global limit of 3 slots through Redis: of 10 requests held at
/// once, exactly 3 go through, whichever instance they reach; every lease is given back; and
/// it costs Redis at most one call per decision (concurrent ones share calls) plus one per
/// release.
#[tokio::test]
async fn two_instances_never_hold_more_than_max_in_flight_together() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let yaml = global_yaml(&redis.url(), &up.url(), 3, "10s");
    let gws = [Gateway::start(&yaml).await, Gateway::start(&yaml).await];
    // One request first, so that both instances have loaded the function library.
    for g in &gws {
        assert_eq!(get(g.url("/"), "warm").await.status(), 200);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = fcalls(&redis);
    let reqs: Vec<_> = (0..10)
        .map(|i| spawn_get(gws[i % 2].url("/slow?ms=1500"), "k"))
        .collect();
    let mut statuses = Vec::new();
    for r in reqs {
        statuses.push(r.await.unwrap());
    }
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((ok, limited), (3, 7), "{statuses:?}");
    for g in &gws {
        holds(&g.shared, "g", 0.0).await;
    }
    // Releases go out in the background: give them a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !redis.cli(&["KEYS", "*:slots"]).trim().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Decisions that arrive while one is in flight on their queue share the next call.
    let calls = fcalls(&redis) - before;
    assert!(
        (2 + 3..=10 + 3).contains(&calls),
        "{calls}: at most one call per decision, one per release"
    );
    assert_eq!(
        redis.cli(&["KEYS", "*:slots"]).trim(),
        "",
        "every lease given back"
    );
    for g in &gws {
        assert_eq!(get(g.url("/"), "k").await.status(), 200);
    }
}

/// A request that outlives its lease keeps its slot: the instance renews the lease.
#[tokio::test]
async fn a_lease_is_renewed_while_its_request_runs() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let g = Gateway::start(&global_yaml(&redis.url(), &up.url(), 1, "1s")).await;
    let long = spawn_get(g.url("/slow?ms=2500"), "k");
    holds(&g.shared, "g", 1.0).await;
    tokio::time::sleep(Duration::from_millis(1800)).await;
    // Past the first lease: still held in Redis, so still 429.
    assert_eq!(get(g.url("/"), "k").await.status(), 429);
    assert_eq!(long.await.unwrap(), 200);
    holds(&g.shared, "g", 0.0).await;
    let text = g.shared.gateway.metrics.encode(Format::Text);
    let series = |name: &str| {
        metric(&text, &format!("{name}{{route=\"g\",limit=\"slots\"}}")).unwrap_or(-1.0)
    };
    assert!(series("tollgate_lease_renewals_total") >= 2.0, "{text}");
    assert_eq!(series("tollgate_lease_expiries_total"), 0.0);
}

/// An instance killed with SIGKILL cannot give its slots back: they come back by themselves
/// once their lease has run out, and not before.
#[tokio::test]
async fn a_sigkilled_instance_gives_its_slots_back_after_the_lease() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let yaml = global_yaml(&redis.url(), &up.url(), 1, "2s");
    let doomed = Proc::start(
        &yaml
            .replace("127.0.0.1:0\n  admin", "127.0.0.1:PROXY_PORT\n  admin")
            .replace("admin: 127.0.0.1:0", "admin: 127.0.0.1:ADMIN_PORT"),
        &[],
        &[],
        false,
    )
    .await;
    let survivor = Gateway::start(&yaml).await;
    let url = format!("{}/slow?ms=30000", doomed.proxy);
    let held = tokio::spawn(async move { client().get(url).header("x-key", "k").send().await });
    let deadline = Instant::now() + Duration::from_secs(5);
    while up.hits() == 0 {
        assert!(Instant::now() < deadline, "the held request never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(get(survivor.url("/"), "k").await.status(), 429);
    // Let it renew at least once before it dies.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut doomed = doomed;
    doomed.signal("KILL");
    let killed = Instant::now();
    let _ = doomed.exit_code().await;
    assert!(
        held.await.unwrap().is_err(),
        "the client lost its connection"
    );
    assert_eq!(
        get(survivor.url("/"), "k").await.status(),
        429,
        "a lease does not run out at once"
    );
    loop {
        let status = get(survivor.url("/"), "k").await.status();
        if status == 200 {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(4),
            "the dead instance's slot did not come back within its lease"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        killed.elapsed() <= Duration::from_millis(2300),
        "{:?}",
        killed.elapsed()
    );
}

/// Redis down and `on_error: allow`: a global concurrency limit counts this instance's slots.
#[tokio::test]
async fn with_redis_down_allow_falls_back_to_local_slots() {
    let up = Upstream::start().await;
    let yaml = global_yaml(&format!("redis://{}", closed_addr()), &up.url(), 1, "10s").replace(
        "timeout: 2s\n  on_error: deny",
        "timeout: 50ms\n  on_error: allow",
    );
    let g = Gateway::start(&yaml).await;
    let shared: Arc<Shared> = g.shared.clone();
    let long = spawn_get(g.url("/slow?ms=600"), "k");
    holds(&shared, "g", 1.0).await;
    assert_eq!(get(g.url("/"), "k").await.status(), 429);
    assert_eq!(long.await.unwrap(), 200);
    holds(&shared, "g", 0.0).await;
    assert_eq!(get(g.url("/"), "k").await.status(), 200);
    let text = shared.gateway.metrics.encode(Format::Text);
    assert!(
        metric(
            &text,
            "tollgate_fallback_decisions_total{route=\"g\",limit=\"slots\"}"
        )
        .unwrap_or(0.0)
            >= 3.0,
        "{text}"
    );
}
