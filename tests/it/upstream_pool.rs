//! Kept-alive connections to plain `http://` upstreams: reused while they are good, never handed
//! out once the upstream has closed or announced closing them, and never reused mid-response.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::upstream::Upstream;
use crate::support::{Gateway, client};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn yaml(upstream: &str) -> String {
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nroutes:\n  - name: all\n    upstream: {upstream}\n"
    )
}

async fn sequential_requests_share_one_connection() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url())).await;
    let c = client();
    for i in 0..20 {
        // A body of known length back, HEAD (a response that ends at its head), a POST with a
        // body, and a chunked body back.
        let r = match i % 4 {
            0 => c.get(g.url("/echo")).send().await.unwrap(),
            1 => c.head(g.url("/echo")).send().await.unwrap(),
            2 => c
                .post(g.url("/echo"))
                .body("x".repeat(1000))
                .send()
                .await
                .unwrap(),
            _ => c.get(g.url("/stream?bytes=100000")).send().await.unwrap(),
        };
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    assert_eq!(up.hits(), 20);
    assert_eq!(up.connections(), 1);
}

#[tokio::test]
async fn sequential_requests_share_one_upstream_connection() {
    sequential_requests_share_one_connection().await;
}

/// The same on a multi-threaded runtime, where a connection can come back before its task has
/// taken up the end of the last exchange.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_requests_share_one_upstream_connection_on_two_threads() {
    sequential_requests_share_one_connection().await;
}

#[tokio::test]
async fn concurrent_requests_open_connections_then_reuse_them() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url())).await;
    let c = client();
    for _ in 0..4 {
        let batch = (0..8).map(|_| {
            let c = c.clone();
            let url = g.url("/slow?ms=300");
            async move { c.get(url).send().await.unwrap().status() }
        });
        for status in futures_util::future::join_all(batch).await {
            assert_eq!(status, 200);
        }
    }
    assert_eq!(up.hits(), 32);
    // Eight at once (each held 300 ms) need eight connections; the later batches find them idle.
    assert_eq!(up.connections(), 8);
}

#[tokio::test]
async fn a_response_the_client_abandons_is_not_reused() {
    let up = Upstream::start().await;
    let g = Gateway::start(&yaml(&up.url())).await;
    let c = client();
    let r = c.get(g.url("/stream?bytes=8388608")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    drop(r);
    for _ in 0..3 {
        let r = c.get(g.url("/echo")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    // The abandoned download's connection was closed mid-body; the next three share one.
    assert_eq!(up.connections(), 2);
}

/// An upstream on raw TCP that answers each `GET` with `ok` and then either closes the
/// connection after `idle` without a word (as a keep-alive timeout does) or, with `idle` of
/// `None`, says `Connection: close` and closes it at once.
async fn raw_upstream(idle: Option<Duration>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    let conns = connections.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            conns.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let wait = idle.unwrap_or(Duration::from_secs(30));
                    let n = match tokio::time::timeout(wait, s.read(&mut chunk)).await {
                        Ok(Ok(n)) if n > 0 => n,
                        // Idle past its timeout, or the gateway closed: close without a word.
                        _ => return,
                    };
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        let close = if idle.is_none() {
                            "connection: close\r\n"
                        } else {
                            ""
                        };
                        let resp = format!("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n{close}\r\nok");
                        if s.write_all(resp.as_bytes()).await.is_err() || idle.is_none() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (url, connections)
}

#[tokio::test]
async fn a_connection_the_upstream_closed_while_idle_is_not_handed_out() {
    let (url, connections) = raw_upstream(Some(Duration::from_millis(400))).await;
    let g = Gateway::start(&yaml(&url)).await;
    let c = client();
    for round in 0..2 {
        // Two back to back share a connection...
        for _ in 0..2 {
            let r = c.get(g.url("/")).send().await.unwrap();
            assert_eq!(r.status(), 200, "round {round}");
            assert_eq!(r.text().await.unwrap(), "ok");
        }
        // ...which the upstream then times out; the next round needs a new one, not a 502.
        tokio::time::sleep(Duration::from_millis(1000)).await;
    }
    assert_eq!(connections.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_connection_the_upstream_announced_closing_is_not_reused() {
    let (url, connections) = raw_upstream(None).await;
    let g = Gateway::start(&yaml(&url)).await;
    let c = client();
    for _ in 0..5 {
        let r = c.get(g.url("/")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "ok");
    }
    assert_eq!(connections.load(Ordering::SeqCst), 5);
}

#[tokio::test]
async fn an_http_1_0_upstream_does_not_downgrade_the_client_connection() {
    // An upstream that speaks HTTP/1.0 and closes after each response, as python's http.server.
    let url = support::upstream::raw(&[b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok"]).await;
    let g = Gateway::start(&yaml(&url)).await;
    // One raw HTTP/1.1 client connection, two requests on it.
    let mut c = tokio::net::TcpStream::connect(g.addr).await.unwrap();
    for _ in 0..2 {
        c.write_all(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        let mut resp = Vec::new();
        let mut chunk = [0u8; 4096];
        while !resp.ends_with(b"ok") {
            let n = c.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the gateway closed the client connection");
            resp.extend_from_slice(&chunk[..n]);
        }
        let text = String::from_utf8_lossy(&resp).to_lowercase();
        assert!(text.starts_with("http/1.1 200"), "{text}");
        assert!(!text.contains("connection: close"), "{text}");
    }
}
