//! The after-response guard (`proxy::exchange::ExchangeEnd`) on both codecs: however an
//! exchange ends — answered in full, the client gone mid-body, the upstream refused, the route
//! timeout before or during the body, an answer of tollgate's own, the listener draining — it
//! runs exactly once, seen as one observation in `tollgate_request_duration_seconds`. Each way
//! out is taken on plain TCP and on TLS (where HTTP/1.1 is the fast codec's too).

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate::app::Shared;
use tollgate::metrics::Format;

use crate::support::upstream::Upstream;
use crate::support::{Gateway, closed_addr, metric};

/// Both codecs — the fast HTTP/1.1 one (`fast_path: true`, the default) and hyper — each on
/// plain TCP (false) and on TLS (true).
const CODECS: [(bool, bool); 4] = [(true, false), (false, false), (true, true), (false, true)];

fn yaml(fast: bool, upstream: &str) -> String {
    let mut routes = String::new();
    // One route per upstream endpoint (named after it), so each test counts its own.
    for name in ["ok", "stream", "slow", "late-body"] {
        routes.push_str(&format!(
            "  - name: {name}\n    match: {{ path_prefix: /{name} }}\n    upstream: {upstream}\n    timeout: 300ms\n"
        ));
    }
    routes.push_str(&format!(
        "  - name: down\n    match: {{ path_prefix: /down }}\n    upstream: http://{}\n",
        closed_addr()
    ));
    routes.push_str(&format!(
        "  - name: lim\n    match: {{ path_prefix: /lim }}\n    upstream: {upstream}\n    limits:\n      - name: one\n        rate: 1/h\n        key: [ip]\n"
    ));
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\n  fast_path: {fast}\nroutes:\n{routes}"
    )
}

/// Observations of `route`'s request duration so far.
fn ended(shared: &Shared, route: &str) -> f64 {
    let text = shared.gateway.metrics.encode(Format::Text);
    metric(
        &text,
        &format!("tollgate_request_duration_seconds_count{{route=\"{route}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Waits for `route`'s one observation, then a moment more to see no second one.
async fn ends_once(shared: &Shared, route: &str, fast: (bool, bool)) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while ended(shared, route) < 1.0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        ended(shared, route),
        1.0,
        "route {route}, (fast codec, tls): {fast:?}"
    );
}

async fn gateway((fast, tls): (bool, bool), up: &Upstream) -> (Gateway, Arc<Shared>) {
    let g = Gateway::start_on(&yaml(fast, &up.url()), tls).await;
    let shared = g.shared.clone();
    (g, shared)
}

#[tokio::test]
async fn an_exchange_answered_in_full_ends_once() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let (g, shared) = gateway(fast, &up).await;
        let r = g.get("/ok").await;
        assert_eq!(r.status, 200);
        r.body.unwrap();
        ends_once(&shared, "ok", fast).await;
    }
}

#[tokio::test]
async fn an_exchange_whose_client_leaves_mid_body_ends_once() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let (g, shared) = gateway(fast, &up).await;
        let mut s = g.connect().await;
        s.write_all(b"GET /stream?bytes=104857600 HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 4096];
        s.read_exact(&mut buf).await.unwrap();
        drop(s);
        ends_once(&shared, "stream", fast).await;
    }
}

#[tokio::test]
async fn an_exchange_with_a_refused_upstream_ends_once() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let (g, shared) = gateway(fast, &up).await;
        assert_eq!(g.get("/down").await.status, 502);
        ends_once(&shared, "down", fast).await;
    }
}

#[tokio::test]
async fn an_exchange_timed_out_before_or_during_the_body_ends_once() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let (g, shared) = gateway(fast, &up).await;
        assert_eq!(g.get("/slow?ms=2000").await.status, 504);
        ends_once(&shared, "slow", fast).await;
        // The head in time, the body not: cut at the deadline.
        let r = g.get("/late-body?ms=2000").await;
        assert_eq!(r.status, 200);
        assert!(r.body.is_err(), "a cut body must not end as complete");
        ends_once(&shared, "late-body", fast).await;
    }
}

#[tokio::test]
async fn answers_of_tollgates_own_end_once() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let (g, shared) = gateway(fast, &up).await;
        assert_eq!(g.get("/nowhere").await.status, 404);
        ends_once(&shared, "_unmatched", fast).await;
        assert_eq!(g.get("/lim").await.status, 200);
        assert_eq!(g.get("/lim").await.status, 429);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(ended(&shared, "lim"), 2.0, "(fast codec, tls): {fast:?}");
    }
}

#[tokio::test]
async fn an_exchange_in_flight_at_the_drain_finishes_and_ends_once() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let (g, shared) = gateway(fast, &up).await;
        let fetcher = g.fetcher();
        let req = tokio::spawn(async move { fetcher.get("/slow?ms=200").await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        g.stop().await;
        let r = req.await.unwrap();
        assert_eq!(r.status, 200);
        r.body.unwrap();
        ends_once(&shared, "slow", fast).await;
    }
}
