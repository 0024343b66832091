//! The binary under real signals: SIGHUP reloads; SIGTERM / SIGINT stop accepting, let
//! in-flight requests finish, and exit 0.

use std::time::{Duration, Instant};

use crate::support::client;
use crate::support::process::Proc;
use crate::support::upstream::Upstream;

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

/// Waits (at most 10 s) until the running config's first limit has `rate`.
async fn wait_for_rate(c: &reqwest::Client, admin: &str, rate: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let cfg: serde_json::Value = c
            .get(format!("{admin}/admin/config"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if cfg["routes"][0]["limits"][0]["rate"] == rate {
            return;
        }
        assert!(Instant::now() < deadline, "not applied: {cfg}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
    wait_for_rate(&c, &p.admin, "1/1s").await;
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

/// An upgraded connection (WebSocket) open at SIGTERM is an in-flight exchange too: it keeps
/// working through the drain, up to the grace period, and the process exits once it closes.
/// Meanwhile the admin listener still answers, `/readyz` with 503 (draining) so a load balancer
/// stops sending here. (The tunnel used to be cut at the signal, with no close.)
#[tokio::test]
async fn sigterm_keeps_an_upgraded_connection_until_it_closes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = Upstream::start().await;
    let mut p = start(&up.url(), "1000/1s").await;
    let addr = p.proxy.trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(
        b"GET /upgrade HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: echo\r\n\r\n",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 101"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    let echo = async |s: &mut tokio::net::TcpStream, msg: &[u8]| {
        s.write_all(msg).await.unwrap();
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(got, msg);
    };
    echo(&mut s, b"before").await;

    p.signal("TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    echo(&mut s, b"during the drain").await;
    let c = client();
    let ready = c.get(format!("{}/readyz", p.admin)).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let body: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(body["draining"], true, "{body}");
    let metrics = c.get(format!("{}/metrics", p.admin)).send().await.unwrap();
    assert_eq!(metrics.status(), 200);

    let closed = Instant::now();
    drop(s);
    assert!(p.exited_ok().await);
    // Ended by the tunnel closing, not by the 5 s grace period running out.
    assert!(
        closed.elapsed() < Duration::from_secs(2),
        "{:?}",
        closed.elapsed()
    );
}

/// A second SIGTERM / SIGINT during the drain exits at once (status 1), without waiting for
/// the in-flight request or the grace period, as an operator pressing Ctrl-C twice expects.
#[tokio::test]
async fn a_second_signal_exits_at_once() {
    let up = Upstream::start().await;
    let mut p = start(&up.url(), "1000/1s").await;
    let slow = tokio::spawn({
        let url = format!("{}/slow?ms=4000", p.proxy);
        let c = client();
        async move { c.get(url).send().await.map(|r| r.status().as_u16()) }
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while up.hits() == 0 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    p.signal("INT");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    p.signal("INT");
    assert_eq!(p.exit_code().await, Some(1));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(
        slow.await.unwrap().is_err(),
        "the in-flight request was cut"
    );
}

/// A deleted config file is said once in the log (it used to go unsaid), however many events
/// follow while it is gone, and the running config keeps serving.
#[tokio::test]
async fn a_deleted_config_file_is_logged_once_and_the_running_config_stays() {
    use std::io::{BufRead, BufReader};
    use std::sync::{Arc, Mutex};
    const LINE: &str = "the config file cannot be read; the running config stays";
    let up = Upstream::start().await;
    let mut p = Proc::start(&routes(&up.url(), "1000/1s"), &[], &[], true).await;
    let log = Arc::new(Mutex::new(String::new()));
    let stderr = p.child.stderr.take().unwrap();
    let reader = std::thread::spawn({
        let log = log.clone();
        move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut log = log.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        }
    });
    let said = || log.lock().unwrap().matches(LINE).count();
    let c = client();
    // The watcher starts in a task of its own once the listeners are up: a change it applies
    // shows it is watching before the file goes.
    // On a loaded machine the watcher may start after a first write: write again until one
    // is applied.
    let text = std::fs::read_to_string(&p.path)
        .unwrap()
        .replace("1000/1s", "999/1s");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        std::fs::write(&p.path, &text).unwrap();
        let applied = tokio::time::timeout(
            Duration::from_secs(1),
            wait_for_rate(&c, &p.admin, "999/1s"),
        )
        .await;
        if applied.is_ok() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the watcher never applied a change"
        );
    }
    std::fs::remove_file(&p.path).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while said() == 0 {
        assert!(
            Instant::now() < deadline,
            "not logged: {}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status(&c, &p.proxy).await, 200);
    // More events in the directory while the file is gone: read again, not said again.
    std::fs::write(p.path.with_file_name("other.txt"), "x").unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    p.signal("TERM");
    assert!(p.exited_ok().await);
    reader.join().unwrap();
    assert_eq!(said(), 1, "{}", log.lock().unwrap());
}
