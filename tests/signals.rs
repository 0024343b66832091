//! The binary under real signals: SIGHUP reloads; SIGTERM / SIGINT stop accepting, let
//! in-flight requests finish, and exit 0.

mod support;

use std::time::{Duration, Instant};

use support::client;
use support::process::Proc;
use support::upstream::Upstream;

fn routes(upstream: &str, rate: &str) -> String {
    format!(
        "server:
  listen: 127.0.0.1:PROXY_PORT
  admin: 127.0.0.1:ADMIN_PORT
  grace_period: 5s
routes:
  - name: api
    upstream: {upstream}
    limits:
      - name: per-ip
        rate: {rate}
"
    )
}

async fn start(upstream: &str, rate: &str) -> Proc {
    Proc::start(&routes(upstream, rate), &[], &[], false).await
}

/// The status of `GET /` on the gateway at `proxy`.
async fn status(c: &reqwest::Client, proxy: &str) -> reqwest::StatusCode {
    c.get(format!("{proxy}/")).send().await.unwrap().status()
}

#[tokio::test]
async fn sighup_reloads_the_file() {
    let up = Upstream::start().await;
    let p = start(&up.url(), "1/1h").await;
    let c = client();
    assert_eq!(status(&c, &p.proxy).await, 200);
    assert_eq!(status(&c, &p.proxy).await, 429);
    let text = std::fs::read_to_string(&p.path)
        .unwrap()
        .replace("1/1h", "1/1s");
    // Written in place without a rename: the watcher may see it too; either way it reloads.
    std::fs::write(&p.path, text).unwrap();
    p.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let cfg: serde_json::Value = c
            .get(format!("{}/admin/config", p.admin))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if cfg["routes"][0]["limits"][0]["rate"] == "1/1s" {
            break;
        }
        assert!(Instant::now() < deadline, "not reloaded: {cfg}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn drains_on(sig: &str) {
    let up = Upstream::start().await;
    let mut p = start(&up.url(), "1000/1s").await;
    let c = client();
    let slow = tokio::spawn({
        let url = format!("{}/slow?ms=700", p.proxy);
        let c = c.clone();
        async move { c.get(url).send().await.map(|r| r.status().as_u16()) }
    });
    // Let the slow request reach the upstream, then ask the gateway to stop.
    let deadline = Instant::now() + Duration::from_secs(5);
    while up.hits() == 0 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    p.signal(sig);
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Not accepting any more.
    let fresh = reqwest::Client::builder().no_proxy().build().unwrap();
    assert!(fresh.get(format!("{}/", p.proxy)).send().await.is_err());
    // The in-flight request still completes.
    assert_eq!(slow.await.unwrap().unwrap(), 200);
    assert!(p.exited_ok().await);
}

#[tokio::test]
async fn sigterm_finishes_in_flight_requests_and_exits_0() {
    drains_on("TERM").await;
}

#[tokio::test]
async fn sigint_finishes_in_flight_requests_and_exits_0() {
    drains_on("INT").await;
}

#[tokio::test]
async fn sigterm_lets_a_delayed_request_wait_for_its_slot_and_finish() {
    let up = Upstream::start().await;
    let yaml = format!(
        "server:
  listen: 127.0.0.1:PROXY_PORT
  admin: 127.0.0.1:ADMIN_PORT
  grace_period: 5s
routes:
  - name: api
    upstream: {}
    limits:
      - name: paced
        key: [literal:all]
        rate: 2/1s
        burst: 1
        on_limit: delay
        max_delay: 2s
",
        up.url()
    );
    let mut p = Proc::start(&yaml, &[], &[], false).await;
    let c = client();
    assert_eq!(status(&c, &p.proxy).await, 200);
    // The next slot is 500 ms away: this request waits for it.
    let waiting = tokio::spawn({
        let (c, url) = (c.clone(), format!("{}/", p.proxy));
        async move { c.get(url).send().await.map(|r| r.status().as_u16()) }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    p.signal("TERM");
    assert_eq!(
        waiting.await.unwrap().unwrap(),
        200,
        "the delayed request was forwarded"
    );
    assert_eq!(up.hits(), 2);
    assert!(p.exited_ok().await);
}
