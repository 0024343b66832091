//! `on_limit: delay` on local gcra limits: requests that do not fit now reserve the next slot
//! and are forwarded when it comes. Real time here, because when the forward happens is the
//! behaviour under test.

use std::time::{Duration, Instant};

use crate::support::upstream::Upstream;
use crate::support::{Gateway, client, metric};

fn cfg(upstream: &str, max_waiters: usize) -> String {
    format!(
        "server:
  listen: 127.0.0.1:0
  admin: 127.0.0.1:0
  max_waiters: {max_waiters}
routes:
  - name: vendor
    upstream: {upstream}
    limits:
      - name: paced
        key: [literal:vendor]
        algorithm: gcra
        rate: 10/1s
        burst: 1
        on_limit: delay
        max_delay: 450ms
"
    )
}

#[tokio::test]
async fn delayed_requests_are_forwarded_when_their_slot_comes() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), 100)).await;
    let c = client();
    let t0 = Instant::now();
    // Seven at once: slot 0 now, slots 1..4 at 100..400 ms (within max_delay), 5 and 6 would
    // wait 500 and 600 ms: rejected, reserving nothing.
    let reqs: Vec<_> = (0..7).map(|_| c.get(g.url("/")).send()).collect();
    let resps = futures_util::future::join_all(reqs).await;
    let statuses: Vec<u16> = resps
        .iter()
        .map(|r| r.as_ref().unwrap().status().as_u16())
        .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        5,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        2,
        "{statuses:?}"
    );
    up.assert_paced(
        t0,
        Duration::from_millis(100),
        Duration::from_millis(20),
        Duration::from_millis(150),
    );
    // The rejected ones reserved nothing: the next slot is 500 ms after t0, not 700, so a
    // request at 530 ms is admitted at once.
    tokio::time::sleep_until((t0 + Duration::from_millis(530)).into()).await;
    let sent = Instant::now();
    let r = c.get(g.url("/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        sent.elapsed() < Duration::from_millis(60),
        "{:?}",
        sent.elapsed()
    );

    let m = g.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tollgate_limit_decisions_total{route=\"vendor\",limit=\"paced\",decision=\"delayed\"}"
        ),
        Some(4.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "tollgate_delay_seconds_count{route=\"vendor\",limit=\"paced\"}"
        ),
        Some(4.0)
    );
}

#[tokio::test]
async fn the_waiter_cap_turns_excess_into_429_without_reserving() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), 2)).await;
    let c = client();
    let reqs: Vec<_> = (0..5).map(|_| c.get(g.url("/")).send()).collect();
    let resps = futures_util::future::join_all(reqs).await;
    let ok = resps
        .iter()
        .filter(|r| r.as_ref().unwrap().status() == 200)
        .count();
    // One immediate, two waiting (the cap), the rest rejected at once.
    assert_eq!(ok, 3);
    assert_eq!(up.hits(), 3);
}

#[tokio::test]
async fn a_client_that_leaves_while_waiting_is_counted_and_its_slot_stays_used() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), 100)).await;
    let c = client();
    c.get(g.url("/")).send().await.unwrap();
    // This one would wait ~100 ms; give up after 20.
    let r = tokio::time::timeout(Duration::from_millis(20), c.get(g.url("/")).send()).await;
    assert!(r.is_err());
    tokio::time::sleep(Duration::from_millis(150)).await;
    let m = g.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tollgate_delayed_abandoned_total{route=\"vendor\",limit=\"paced\"}"
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(up.hits(), 1, "the abandoned request was never forwarded");
}
