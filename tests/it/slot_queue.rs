//! `on_limit: delay` on concurrency limits, on real sockets: a request refused only for lack of
//! a slot waits in its key's line, first come first served, and is forwarded as soon as a slot
//! comes back; past `max_delay` it gets the usual 429; the route's `max_waiters` bounds the
//! line; a waiter whose client leaves takes no slot. Globally, through a real Redis shared by
//! two instances: a waiter on one is admitted after the other's request ends, and the two never
//! hold more than `max_in_flight` together.

use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tollgate::app::Shared;
use tollgate::metrics::Format;

use crate::support::redis::{RedisServer, command_calls};
use crate::support::upstream::Upstream;
use crate::support::{Gateway, client, metric};

/// Both codecs: the fast HTTP/1.1 one (`fast_path: true`, the default) and hyper.
const CODECS: [bool; 2] = [true, false];

/// One route `q` to `upstream` whose limit `slots` (key `x-key`) holds one slot and queues up
/// to `max_delay`; `max_waiters` for the route; `limit_extra` lines appended to the limit,
/// `top` lines before `routes:`.
fn yaml(fast: bool, upstream: &str, max_delay: &str, max_waiters: usize, top: &str) -> String {
    format!(
        "server:
  listen: 127.0.0.1:0
  admin: 127.0.0.1:0
  fast_path: {fast}
  max_waiters: {max_waiters}
{top}routes:
  - name: q
    upstream: {upstream}
    timeout: 10s
    limits:
      - name: slots
        key: [header:x-key]
        algorithm: concurrency
        max_in_flight: 1
        retry_after: 2s
        on_limit: delay
        max_delay: {max_delay}
"
    )
}

fn series(text: &str, name: &str, extra: &str) -> f64 {
    metric(
        text,
        &format!("{name}{{route=\"q\",limit=\"slots\"{extra}}}"),
    )
    .unwrap_or(0.0)
}

fn decisions(shared: &Shared, d: &str) -> f64 {
    let text = shared.gateway.metrics.encode(Format::Text);
    series(
        &text,
        "tollgate_limit_decisions_total",
        &format!(",decision=\"{d}\""),
    )
}

fn in_flight(shared: &Shared) -> f64 {
    let text = shared.gateway.metrics.encode(Format::Text);
    series(&text, "tollgate_in_flight", "")
}

/// Waits (at most 5 s) until the route holds `n` slots.
async fn holds(shared: &Shared, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight(shared) != n {
        assert!(
            Instant::now() < deadline,
            "holds {} slots, not {n}",
            in_flight(shared)
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// `GET url` with `x-key: k`, read to its end: the status, and when the response ended.
fn spawn_get(url: String) -> tokio::task::JoinHandle<(u16, Instant, reqwest::header::HeaderMap)> {
    tokio::spawn(async move {
        let r = client().get(url).header("x-key", "k").send().await.unwrap();
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let _ = r.bytes().await;
        (status, Instant::now(), headers)
    })
}

#[tokio::test]
async fn a_waiter_is_forwarded_as_soon_as_the_slot_comes_back() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let g = Gateway::start(&yaml(fast, &up.url(), "5s", 100, "")).await;
        let first = spawn_get(g.url("/slow?ms=500"));
        holds(&g.shared, 1.0).await;
        let asked = Instant::now();
        let waiter = spawn_get(g.url("/"));
        let (s1, first_end, _) = first.await.unwrap();
        let (s2, waiter_end, _) = waiter.await.unwrap();
        assert_eq!((s1, s2), (200, 200), "fast codec: {fast}");
        let waited = waiter_end - asked;
        // It waited for the first request (about 500 ms), and far less than max_delay.
        assert!(
            waited >= Duration::from_millis(400) && waited < Duration::from_millis(1500),
            "fast codec {fast}: waited {waited:?}"
        );
        // The waiter's own exchange follows the first's end at once: a release wakes it.
        let wake = waiter_end.saturating_duration_since(first_end);
        eprintln!("fast codec {fast}: waiter answered {wake:?} after the first response ended");
        assert!(wake < Duration::from_millis(150), "{wake:?}");
        holds(&g.shared, 0.0).await;
        let text = g.shared.gateway.metrics.encode(Format::Text);
        assert_eq!(
            (
                decisions(&g.shared, "allowed"),
                decisions(&g.shared, "delayed"),
                decisions(&g.shared, "rejected"),
            ),
            (1.0, 1.0, 0.0),
            "one admitted at once, one after a wait, each counted once"
        );
        assert_eq!(series(&text, "tollgate_delay_seconds_count", ""), 1.0);
        assert!(
            series(&text, "tollgate_delay_seconds_sum", "") >= 0.4,
            "{text}"
        );
    }
}

#[tokio::test]
async fn past_max_delay_a_waiter_gets_429_with_retry_after() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let g = Gateway::start(&yaml(fast, &up.url(), "300ms", 100, "")).await;
        let first = spawn_get(g.url("/slow?ms=1500"));
        holds(&g.shared, 1.0).await;
        let asked = Instant::now();
        let (status, end, headers) = spawn_get(g.url("/")).await.unwrap();
        let waited = end - asked;
        assert_eq!(status, 429, "fast codec: {fast}");
        assert_eq!(headers["retry-after"], "2");
        assert!(headers.get("ratelimit").is_none());
        assert!(
            waited >= Duration::from_millis(280) && waited < Duration::from_millis(1000),
            "{waited:?}"
        );
        assert_eq!(
            (
                decisions(&g.shared, "rejected"),
                decisions(&g.shared, "delayed")
            ),
            (1.0, 0.0)
        );
        assert_eq!(first.await.unwrap().0, 200);
    }
}

#[tokio::test]
async fn waiters_get_the_slot_first_come_first_served() {
    let up = Upstream::start().await;
    for fast in CODECS {
        let g = Gateway::start(&yaml(fast, &up.url(), "8s", 100, "")).await;
        let first = spawn_get(g.url("/slow?ms=400"));
        holds(&g.shared, 1.0).await;
        let mut waiters = Vec::new();
        for _ in 0..3 {
            waiters.push(spawn_get(g.url("/slow?ms=150")));
            // Each is in line before the next comes.
            tokio::time::sleep(Duration::from_millis(80)).await;
        }
        assert_eq!(first.await.unwrap().0, 200);
        let mut ends = Vec::new();
        for w in waiters {
            let (status, end, _) = w.await.unwrap();
            assert_eq!(status, 200, "fast codec: {fast}");
            ends.push(end);
        }
        assert!(
            ends.windows(2)
                .all(|w| w[0] + Duration::from_millis(100) <= w[1]),
            "fast codec {fast}: served out of order, or overlapping: {:?}",
            ends.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
        );
        assert_eq!(decisions(&g.shared, "delayed"), 3.0);
        assert_eq!(up.hits() % 4, 0);
    }
}

#[tokio::test]
async fn max_waiters_bounds_the_line_and_the_excess_gets_429_at_once() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(true, &up.url(), "5s", 2, "")).await;
    let first = spawn_get(g.url("/slow?ms=600"));
    holds(&g.shared, 1.0).await;
    let w1 = spawn_get(g.url("/"));
    let w2 = spawn_get(g.url("/"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let asked = Instant::now();
    let (status, end, headers) = spawn_get(g.url("/")).await.unwrap();
    assert_eq!(status, 429);
    assert_eq!(headers["retry-after"], "2");
    assert!(
        end - asked < Duration::from_millis(200),
        "{:?}",
        end - asked
    );
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!((w1.await.unwrap().0, w2.await.unwrap().0), (200, 200));
    assert_eq!(up.hits(), 3);
}

#[tokio::test]
async fn a_waiter_whose_client_leaves_takes_no_slot_and_the_next_gets_it() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(true, &up.url(), "5s", 100, "")).await;
    let first = spawn_get(g.url("/slow?ms=500"));
    holds(&g.shared, 1.0).await;
    // First in line: a raw client that sends its request and closes.
    let mut gone = tokio::net::TcpStream::connect(g.addr).await.unwrap();
    gone.write_all(b"GET /gone HTTP/1.1\r\nhost: x\r\nx-key: k\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(80)).await;
    let next = spawn_get(g.url("/"));
    tokio::time::sleep(Duration::from_millis(80)).await;
    drop(gone);
    let (_, first_end, _) = first.await.unwrap();
    let (status, next_end, _) = next.await.unwrap();
    assert_eq!(status, 200);
    assert!(
        next_end.saturating_duration_since(first_end) < Duration::from_millis(150),
        "the next waiter got the slot at once: {:?}",
        next_end.saturating_duration_since(first_end)
    );
    assert_eq!(
        up.hits(),
        2,
        "the gone client's request was never forwarded"
    );
    holds(&g.shared, 0.0).await;
    let text = g.shared.gateway.metrics.encode(Format::Text);
    assert_eq!(
        series(&text, "tollgate_delayed_abandoned_total", ""),
        1.0,
        "{text}"
    );
    assert_eq!(
        decisions(&g.shared, "delayed"),
        2.0,
        "the gone one and the next"
    );
}

/// Two instances share one global slot through Redis: a waiter on B is admitted once A's
/// request ends (A's release is not heard on B: B's first waiter asks again every 50 ms),
/// the two never hold more than one slot together, and the waiter costs Redis a bounded
/// number of script calls.
#[tokio::test]
async fn a_global_waiter_on_another_instance_gets_the_slot_when_it_comes_back() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let top = format!(
        "redis:\n  url: {}\n  timeout: 2s\n  on_error: deny\n",
        redis.url()
    );
    let cfg = yaml(true, &up.url(), "5s", 100, &top).replace(
        "        on_limit: delay",
        "        scope: global\n        lease: 10s\n        on_limit: delay",
    );
    let (a, b) = (Gateway::start(&cfg).await, Gateway::start(&cfg).await);
    // Warm both (the function library loaded), with another key.
    for g in [&a, &b] {
        let r = client()
            .get(g.url("/"))
            .header("x-key", "warm")
            .send()
            .await;
        assert_eq!(r.unwrap().status(), 200);
    }
    let calls = || command_calls(&redis.cli(&["INFO", "commandstats"]), "fcall").0;
    let (sa, sb) = (a.shared.clone(), b.shared.clone());
    let watch = tokio::spawn(async move {
        let mut most: f64 = 0.0;
        let until = Instant::now() + Duration::from_millis(1500);
        while Instant::now() < until {
            most = most.max(in_flight(&sa) + in_flight(&sb));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        most
    });
    let before = calls();
    let first = spawn_get(a.url("/slow?ms=600"));
    holds(&a.shared, 1.0).await;
    let asked = Instant::now();
    let waiter = spawn_get(b.url("/"));
    let (s1, first_end, _) = first.await.unwrap();
    let (s2, waiter_end, _) = waiter.await.unwrap();
    assert_eq!((s1, s2), (200, 200));
    let after = waiter_end.saturating_duration_since(first_end);
    eprintln!(
        "global: waiter on B answered {after:?} after A's response ended (waited {:?})",
        waiter_end - asked
    );
    assert!(after < Duration::from_millis(300), "{after:?}");
    assert_eq!(
        watch.await.unwrap(),
        1.0,
        "never more than max_in_flight at once"
    );
    // A's decision and release, B's first decision, then at most one call per 50 ms of the
    // ~600 ms wait (plus one for the decision that admits and one for its release).
    let used = calls() - before;
    assert!(used <= 2 + 1 + 600 / 50 + 4, "{used} script calls");
    assert_eq!(decisions(&b.shared, "delayed"), 1.0);
}
