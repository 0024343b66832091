//! A panic ends only what it happened in (issue 22, item 5): one request's connection (HTTP/1.1)
//! or stream (HTTP/2), or one background task, which starts again. It is counted in
//! `tollgate_panics_total{task}` and logged once; the process goes on serving.
//!
//! The panics are real ones, injected by the `panic-injection` cargo feature that only this
//! package's test builds turn on (`src/panics.rs`, `inject`): a request to
//! `/panic-injection/request` panics in its admission (before any answer), and response body
//! bytes `panic-injection:body` panic while the body is relayed (after the head went out).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::process::Proc;
use crate::support::upstream::Upstream;
use crate::support::{Gateway, TempDir, metric};

const PANIC_PATH: &str = "/panic-injection/request";
/// The upstream sends its head at once and this body 150 ms later.
const PANIC_BODY_PATH: &str = "/late-body?ms=150&say=panic-injection:body";

fn yaml(upstream: &str, fast_path: bool) -> String {
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\n  fast_path: {fast_path}\nroutes:\n  - name: all\n    upstream: {upstream}\n"
    )
}

fn panics(text: &str, task: &str) -> f64 {
    metric(text, &format!("tollgate_panics_total{{task=\"{task}\"}}")).unwrap_or(-1.0)
}

async fn send(s: &mut TcpStream, path: &str) {
    let req = format!("GET {path} HTTP/1.1\r\nhost: t\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
}

/// Everything until the connection ends (at most 5 s).
async fn read_to_end(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf))
        .await
        .expect("the connection ends")
        .ok();
    String::from_utf8_lossy(&buf).into_owned()
}

/// One whole response with a `content-length` body (the upstream's and tollgate's answers).
async fn read_response(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_owned)
                })
                .and_then(|v| v.trim().parse::<usize>().ok())
                .expect("a content-length");
            if buf.len() >= end + 4 + len {
                return text;
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut chunk))
            .await
            .expect("an answer in time")
            .unwrap();
        assert!(n > 0, "closed before a whole answer: {text}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Connection A's request panics before its answer while connection B has one in flight: A
/// gets a 500 and is closed; B's in-flight and next requests and a new connection are served.
async fn a_panic_before_the_answer(fast_path: bool) {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), fast_path)).await;
    let mut b = TcpStream::connect(g.addr).await.unwrap();
    send(&mut b, "/slow?ms=400").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut a = TcpStream::connect(g.addr).await.unwrap();
    send(&mut a, PANIC_PATH).await;
    let answer = read_to_end(&mut a).await;
    let lower = answer.to_ascii_lowercase();
    assert!(answer.starts_with("HTTP/1.1 500"), "{answer}");
    assert!(lower.contains("connection: close"), "{answer}");
    assert!(lower.contains("x-request-id: "), "{answer}");
    let body: serde_json::Value =
        serde_json::from_str(&answer[answer.find("\r\n\r\n").unwrap() + 4..]).unwrap();
    assert_eq!(body["error"], "internal_error");
    assert_eq!(body["route"], "all");

    let in_flight = read_response(&mut b).await;
    assert!(in_flight.starts_with("HTTP/1.1 200"), "{in_flight}");
    send(&mut b, "/echo").await;
    let next = read_response(&mut b).await;
    assert!(next.starts_with("HTTP/1.1 200"), "{next}");
    let mut c = TcpStream::connect(g.addr).await.unwrap();
    send(&mut c, "/echo").await;
    assert!(read_response(&mut c).await.starts_with("HTTP/1.1 200"));

    let m = g.metrics().await;
    assert_eq!(panics(&m, "request"), 1.0, "{m}");
    assert_eq!(panics(&m, "connection"), 0.0, "{m}");
    assert_eq!(
        metric(&m, "tollgate_requests_total{route=\"all\",status=\"500\"}"),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test]
async fn a_panic_before_the_answer_gets_500_and_closes_only_its_connection_fast_codec() {
    a_panic_before_the_answer(true).await;
}

#[tokio::test]
async fn a_panic_before_the_answer_gets_500_and_closes_only_its_connection_hyper_http1() {
    a_panic_before_the_answer(false).await;
}

/// A panic once the response head went out: no 500 can follow it, so the connection is closed
/// before the body's end (a chunked body without its last chunk: the client sees it cut, never
/// complete). The neighbour connection is served.
async fn a_panic_in_the_body(fast_path: bool) {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), fast_path)).await;
    let mut b = TcpStream::connect(g.addr).await.unwrap();
    let mut a = TcpStream::connect(g.addr).await.unwrap();
    send(&mut a, PANIC_BODY_PATH).await;
    send(&mut b, "/slow?ms=300").await;
    let cut = read_to_end(&mut a).await;
    assert!(cut.starts_with("HTTP/1.1 200"), "the head went out: {cut}");
    assert!(
        cut.to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{cut}"
    );
    assert!(!cut.contains("panic-injection:body"), "{cut}");
    assert!(
        !cut.ends_with("0\r\n\r\n"),
        "the body must not look complete: {cut}"
    );
    assert!(read_response(&mut b).await.starts_with("HTTP/1.1 200"));
    send(&mut b, "/echo").await;
    assert!(read_response(&mut b).await.starts_with("HTTP/1.1 200"));
    let m = g.metrics().await;
    assert_eq!(panics(&m, "request"), 1.0, "{m}");
    assert_eq!(panics(&m, "connection"), 0.0, "{m}");
}

#[tokio::test]
async fn a_panic_in_a_response_body_cuts_only_its_connection_fast_codec() {
    a_panic_in_the_body(true).await;
}

#[tokio::test]
async fn a_panic_in_a_response_body_cuts_only_its_connection_hyper_http1() {
    a_panic_in_the_body(false).await;
}

type H2 = hyper::client::conn::http2::SendRequest<Empty<Bytes>>;

async fn h2_get(h2: &mut H2, addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let req = http::Request::get(format!("http://{addr}{path}"))
        .body(Empty::new())
        .unwrap();
    let resp = h2.send_request(req).await.map_err(|e| format!("{e:?}"))?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{e:?}"))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// HTTP/2 (h2c): the streams of one connection are served by one tollgate connection, and
/// hyper polls each stream's handling in a task of its own. A panic in one stream's handling
/// answers that stream 500 (before its head) or resets it (after); the other streams of the
/// same connection, in flight or new, are served.
#[tokio::test]
async fn a_panic_in_one_http2_stream_leaves_the_other_streams_of_its_connection() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url(), true)).await;
    let tcp = TcpStream::connect(g.addr).await.unwrap();
    let (h2, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let addr = g.addr;

    let in_flight = tokio::spawn({
        let mut h2 = h2.clone();
        async move { h2_get(&mut h2, addr, "/slow?ms=400").await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, body) = h2_get(&mut h2.clone(), addr, PANIC_PATH).await.unwrap();
    assert_eq!(status, 500);
    assert!(body.contains("internal_error"), "{body}");
    let cut = h2_get(&mut h2.clone(), addr, PANIC_BODY_PATH).await;
    let err = cut.expect_err("a body cut by a panic is an error, never complete");
    // INTERNAL_ERROR: tollgate's catch ended the body in an error (hyper alone, the stream's
    // task ending in the panic, would reset it with CANCEL, uncounted).
    assert!(err.contains("INTERNAL_ERROR"), "{err}");
    assert_eq!(in_flight.await.unwrap().unwrap().0, 200);
    assert_eq!(h2_get(&mut h2.clone(), addr, "/echo").await.unwrap().0, 200);
    assert!(!conn.is_finished(), "the connection is still up");

    let m = g.metrics().await;
    assert_eq!(panics(&m, "request"), 2.0, "{m}");
    assert_eq!(panics(&m, "connection"), 0.0, "{m}");
}

/// The binary as operators run it: the panic is one log line at error level with the client's
/// address, the route and where it happened, not Rust's own "panicked at" text besides (the
/// hook leaves it to the code that caught it), and the metric says 1.
#[tokio::test]
async fn a_panic_is_logged_once_with_the_peer_and_counted() {
    use std::io::Read;
    let up = Upstream::start().await;
    let yaml = format!(
        "server:\n  listen: 127.0.0.1:PROXY_PORT\n  admin: 127.0.0.1:ADMIN_PORT\nroutes:\n  - name: all\n    upstream: {}\n",
        up.url()
    );
    let mut p = Proc::start(&yaml, &[], &[("RUST_LOG", "warn")], true).await;
    let addr: SocketAddr = p.proxy.trim_start_matches("http://").parse().unwrap();
    let mut a = TcpStream::connect(addr).await.unwrap();
    let peer = a.local_addr().unwrap();
    send(&mut a, PANIC_PATH).await;
    assert!(read_to_end(&mut a).await.starts_with("HTTP/1.1 500"));
    let mut c = TcpStream::connect(addr).await.unwrap();
    send(&mut c, "/echo").await;
    assert!(read_response(&mut c).await.starts_with("HTTP/1.1 200"));
    let m = reqwest::get(format!("{}/metrics", p.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(panics(&m, "request"), 1.0, "{m}");
    assert_eq!(panics(&m, "other"), 0.0, "{m}");
    p.signal("TERM");
    assert!(p.exited_ok().await);
    let mut log = String::new();
    p.child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("panic")).collect();
    assert_eq!(lines.len(), 1, "{log}");
    let line = lines[0];
    assert!(line.contains("ERROR"), "{line}");
    assert!(line.contains("a panic ended a request"), "{line}");
    assert!(line.contains(&format!("peer={peer}")), "{line}");
    assert!(line.contains("route=\"all\""), "{line}");
    assert!(line.contains("location=\"src/panics.rs:"), "{line}");
    assert!(line.contains("answered 500"), "{line}");
    assert!(!log.contains("panicked at"), "{log}");
}

/// A config watcher that panics is counted, logged and started again a second later; the new
/// one reloads at once (the change the old one saw is not lost) and then follows the file.
#[tokio::test]
async fn a_config_watcher_that_panics_is_counted_and_started_again() {
    use tollgate::app::{App, Options};
    let up = Upstream::start().await;
    let dir = TempDir::new();
    // The injection fires the first time a watcher of a file named so sees it change.
    let path = dir.path.join("panic-injection-routes.yaml");
    let text = |rate: &str| {
        format!(
            "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nroutes:\n  - name: all\n    upstream: {}\n    limits:\n      - name: l\n        key: [ip]\n        scope: local\n        rate: {rate}\n",
            up.url()
        )
    };
    std::fs::write(&path, text("1000/1s")).unwrap();
    let cfg = tollgate::config::parse_str(&path, &text("1000/1s")).unwrap();
    let app = App::bind(
        cfg,
        Options {
            config_path: Some(path.clone()),
            listen: None,
            admin: None,
        },
        std::sync::Arc::new(tollgate::limit::clock::TokioClock::new()),
    )
    .await
    .unwrap();
    let admin = app.admin_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(app.run(async move {
        let _ = stopped.await;
    }));
    let metrics = || async move {
        reqwest::get(format!("http://{admin}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let rate = || async move {
        let cfg: serde_json::Value = reqwest::get(format!("http://{admin}/admin/config"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        cfg.to_string()
    };
    // Write until the watcher has seen a change (it starts in a task of its own): its first
    // sight of one panics.
    let deadline = Instant::now() + Duration::from_secs(20);
    while panics(&metrics().await, "config_watch") < 1.0 {
        assert!(Instant::now() < deadline, "the watcher never saw a change");
        std::fs::write(&path, text("999/1s")).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Restarted after a second, it reloads: the change is applied.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !rate().await.contains("999") {
        assert!(
            Instant::now() < deadline,
            "the restarted watcher did not reload"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // And it follows the file from then on.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !rate().await.contains("998") {
        assert!(
            Instant::now() < deadline,
            "the restarted watcher does not watch"
        );
        std::fs::write(&path, text("998/1s")).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let m = metrics().await;
    assert_eq!(panics(&m, "config_watch"), 1.0, "{m}");
    let _ = stop.send(());
    run.await.unwrap();
}

/// The eventual-consistency syncer panics on its first pass over a limit named
/// `panic-injection`: counted, logged, started again a second later, and the counts admitted
/// meanwhile still reach Redis (the syncer's state lives with the limits, not in the task).
#[tokio::test]
async fn an_eventual_syncer_that_panics_is_counted_and_started_again() {
    use crate::support::redis::RedisServer;
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let g = Gateway::start(&format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nredis:\n  url: {}\n  timeout: 1s\n  on_error: allow\nroutes:\n  - name: all\n    upstream: {}\n    limits:\n      - name: panic-injection\n        key: [literal:k]\n        algorithm: fixed_window\n        rate: 1000/1h\n        consistency: eventual\n        sync_interval: 50ms\n",
        redis.url(),
        up.url()
    ))
    .await;
    let c = crate::support::client();
    for _ in 0..5 {
        assert_eq!(c.get(g.url("/echo")).send().await.unwrap().status(), 200);
    }
    let pushed = || {
        redis
            .cli(&["--scan", "--pattern", "tg:{all/panic-injection/k}:*"])
            .lines()
            .map(|k| redis.cli(&["GET", k]).parse::<u64>().unwrap_or(0))
            .sum::<u64>()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while pushed() < 5 {
        assert!(
            Instant::now() < deadline,
            "the restarted syncer never pushed the counts"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = g.metrics().await;
    assert_eq!(panics(&m, "eventual_sync"), 1.0, "{m}");
    assert_eq!(panics(&m, "request"), 0.0, "{m}");
}
