//! The fast codec with its client on in-memory pipes (`tokio::io::duplex`): pipelining, answers
//! of tollgate's own that keep or close the connection, a client that half-closes, and the
//! hand-over to hyper.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use super::{ClientIo, Control, serve};
use crate::connector::Connector;
use crate::limit::clock::ManualClock;
use crate::metrics::Metrics;
use crate::proxy::Gateway;
use crate::proxy::codec::general;
use crate::snapshot::ConfigSnapshot;

/// The gateway's side of a connection: what the client writes arrives on `r`, what the
/// gateway writes goes out on `w`.
struct Pipe {
    r: DuplexStream,
    w: DuplexStream,
}

impl tokio::io::AsyncRead for Pipe {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.r).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Pipe {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.w).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.w).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.w).poll_shutdown(cx)
    }
}

impl ClientIo for Pipe {
    type Reader<'a> = &'a mut DuplexStream;
    type Writer<'a> = &'a mut DuplexStream;

    fn halves(&mut self) -> (Self::Reader<'_>, Self::Writer<'_>) {
        (&mut self.r, &mut self.w)
    }
}

/// The client's side: `tx` to send, `rx` to read the answers.
struct Client {
    tx: DuplexStream,
    rx: DuplexStream,
}

impl Client {
    /// Everything the gateway sends until it closes its side.
    async fn read_to_close(&mut self) -> String {
        let mut all = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), self.rx.read_to_end(&mut all))
            .await
            .expect("the gateway closes the connection")
            .unwrap();
        String::from_utf8_lossy(&all).into_owned()
    }

    /// Reads until `n` complete answers with a `content-length` body have arrived.
    async fn read_answers(&mut self, n: usize) -> Vec<String> {
        let mut buf = Vec::new();
        let mut answers = Vec::new();
        while answers.len() < n {
            let mut chunk = [0u8; 4096];
            let got = tokio::time::timeout(Duration::from_secs(5), self.rx.read(&mut chunk))
                .await
                .expect("an answer in time")
                .unwrap();
            assert!(got > 0, "closed after {} answers", answers.len());
            buf.extend_from_slice(&chunk[..got]);
            while let Some(end) = complete(&buf) {
                answers.push(String::from_utf8_lossy(&buf[..end]).into_owned());
                buf.drain(..end);
            }
        }
        answers
    }
}

/// The length of the first complete answer in `buf`, head and `content-length` body.
fn complete(buf: &[u8]) -> Option<usize> {
    let text = String::from_utf8_lossy(buf);
    let head_end = text.find("\r\n\r\n")? + 4;
    let len = text[..head_end]
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length: ")
                .map(str::to_owned)
        })
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    (buf.len() >= head_end + len).then_some(head_end + len)
}

/// A gateway on `routes` (YAML), serving one piped connection.
fn connect(routes: &str) -> Client {
    let yaml = format!("routes:\n{routes}");
    let config = crate::config::parse_str(std::path::Path::new("t.yaml"), &yaml).unwrap();
    let metrics = Metrics::new();
    let connector = Connector::new(&[]);
    let snapshot = ConfigSnapshot::build(config, &metrics, &connector, None);
    let gateway = Arc::new(Gateway {
        snapshot: ArcSwap::from_pointee(snapshot),
        metrics: Arc::new(metrics),
        clock: Arc::new(ManualClock::new(1_000_000_000_000)),
        connector,
        proto: "http",
        tunnels: Default::default(),
    });
    let (client_tx, gateway_r) = tokio::io::duplex(64 * 1024);
    let (gateway_w, client_rx) = tokio::io::duplex(64 * 1024);
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let ctl = Control {
        builder: Arc::new(general::builder()),
        stop: stopped,
    };
    let graceful = GracefulShutdown::new();
    let watcher = graceful.watcher();
    let peer: SocketAddr = "192.0.2.7:40000".parse().unwrap();
    tokio::spawn(async move {
        serve(
            gateway,
            Pipe {
                r: gateway_r,
                w: gateway_w,
            },
            peer,
            ctl,
            watcher,
        )
        .await;
        drop((_stop, graceful));
    });
    Client {
        tx: client_tx,
        rx: client_rx,
    }
}

/// A route whose upstream nobody listens on, limited to one request per hour per client.
const LIMITED: &str = "  - name: api\n    match: { path_prefix: /api }\n    upstream: http://127.0.0.1:9\n    limits:\n      - name: one\n        rate: 1/h\n        key: [ip]\n";

#[tokio::test]
async fn pipelined_requests_are_answered_in_order_on_one_connection() {
    let mut c = connect(LIMITED);
    c.tx.write_all(b"GET /a HTTP/1.1\r\nhost: t\r\n\r\nGET /b/../c HTTP/1.1\r\nhost: t\r\n\r\nGET /d HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let answers = c.read_answers(3).await;
    assert!(answers[0].starts_with("HTTP/1.1 404 "), "{}", answers[0]);
    assert!(answers[1].starts_with("HTTP/1.1 400 "), "{}", answers[1]);
    assert!(answers[2].starts_with("HTTP/1.1 404 "), "{}", answers[2]);
    for a in &answers {
        assert!(!a.contains("connection: close"), "{a}");
        assert!(a.contains("x-request-id: "), "{a}");
    }
}

#[tokio::test]
async fn an_answer_to_a_request_whose_body_is_here_keeps_the_connection() {
    let mut c = connect(LIMITED);
    // The first request is admitted and finds no upstream (502); the second is limited
    // (429) with its whole body already sent; the third is still answered.
    c.tx.write_all(b"POST /api HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    let first = c.read_answers(1).await;
    assert!(first[0].starts_with("HTTP/1.1 502 "), "{}", first[0]);
    c.tx.write_all(b"POST /api HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\nhelloGET /x HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let answers = c.read_answers(2).await;
    assert!(answers[0].starts_with("HTTP/1.1 429 "), "{}", answers[0]);
    assert!(answers[0].contains("retry-after: "), "{}", answers[0]);
    assert!(
        answers[0].contains("\"error\":\"rate_limited\""),
        "{}",
        answers[0]
    );
    assert!(!answers[0].contains("connection: close"), "{}", answers[0]);
    assert!(answers[1].starts_with("HTTP/1.1 404 "), "{}", answers[1]);
}

#[tokio::test]
async fn an_answer_before_the_body_has_come_closes_the_connection() {
    let mut c = connect(LIMITED);
    c.tx.write_all(b"POST /nowhere HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\npart")
        .await
        .unwrap();
    let answer = c.read_to_close().await;
    assert!(answer.starts_with("HTTP/1.1 404 "), "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
}

#[tokio::test]
async fn a_client_that_half_closes_after_its_request_is_answered() {
    let mut c = connect(LIMITED);
    c.tx.write_all(b"GET /nowhere HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    c.tx.shutdown().await.unwrap();
    let answer = c.read_to_close().await;
    assert!(answer.starts_with("HTTP/1.1 404 "), "{answer}");
}

#[tokio::test]
async fn a_request_the_codec_does_not_take_is_handed_to_hyper_on_the_same_connection() {
    let mut c = connect(LIMITED);
    // HTTP/1.0 goes to hyper, which answers the unrouted path as the fast codec would.
    c.tx.write_all(b"GET /fast HTTP/1.1\r\nhost: t\r\n\r\nGET /slow HTTP/1.0\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let all = c.read_to_close().await;
    assert_eq!(all.matches(" 404 ").count(), 2, "{all}");
    let (fast, hyper) = all.split_at(all.rfind("HTTP/1.").unwrap());
    assert!(fast.starts_with("HTTP/1.1 404 "), "{fast}");
    assert!(hyper.starts_with("HTTP/1.0 404 "), "{hyper}");
    assert!(hyper.contains("\"error\":\"not_found\""), "{hyper}");
}
