//! HTTP/2 to tollgate, spoken as raw frames (h2c by prior knowledge): what the response heads
//! cost the connection's HPACK state.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::Gateway;
use crate::support::upstream::Upstream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 1;
const SETTINGS: u8 = 4;
const GOAWAY: u8 = 7;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// `GET /echo` on `stream`: static-table indexes for the method, scheme and path, the authority
/// as a literal that is not indexed (RFC 7541 §6).
fn get(stream: u32) -> Vec<u8> {
    let mut block = vec![0x82, 0x86, 0x04, 5];
    block.extend_from_slice(b"/echo");
    block.extend_from_slice(&[0x01, 1, b'h']);
    frame(HEADERS, 0x5, stream, &block)
}

/// An HPACK prefixed integer of `bits` bits at `b[*at]`.
fn integer(b: &[u8], at: &mut usize, bits: u32) -> usize {
    let max = (1usize << bits) - 1;
    let mut v = (b[*at] as usize) & max;
    *at += 1;
    if v == max {
        let mut shift = 0;
        loop {
            let byte = b[*at] as usize;
            *at += 1;
            v += (byte & 0x7f) << shift;
            shift += 7;
            if byte & 0x80 == 0 {
                break;
            }
        }
    }
    v
}

/// The kind of each field representation in a header block (RFC 7541 §6): "indexed",
/// "incremental" (a literal added to the dynamic table), "without" (not added), "never" (never
/// to be added, by anyone), "size" (a table size update). Strings are skipped, not decoded.
fn representations(block: &[u8]) -> Vec<&'static str> {
    let mut kinds = Vec::new();
    let mut at = 0;
    let skip_string = |at: &mut usize| {
        let len = integer(block, at, 7);
        *at += len;
    };
    while at < block.len() {
        let b = block[at];
        let (kind, bits) = match b {
            _ if b & 0x80 != 0 => ("indexed", 7),
            _ if b & 0xc0 == 0x40 => ("incremental", 6),
            _ if b & 0xe0 == 0x20 => ("size", 5),
            _ if b & 0xf0 == 0x10 => ("never", 4),
            _ => ("without", 4),
        };
        let name = integer(block, &mut at, bits);
        if kind != "indexed" && kind != "size" {
            if name == 0 {
                skip_string(&mut at);
            }
            skip_string(&mut at);
        }
        kinds.push(kind);
    }
    kinds
}

/// Fields whose values change with every response (`X-Request-Id`; `Date` each second) went
/// into the connection's dynamic table, each new value evicting older ones, and every later
/// response walked all the entries of the name first (a sixth of an HTTP/2 stream's
/// instructions). They are sent never-indexed: from the second response on one connection,
/// nothing new enters the table.
#[tokio::test]
async fn per_response_values_stay_out_of_the_hpack_table() {
    let up = Upstream::start().await;
    let g = Gateway::start(&format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nroutes:\n  - name: r\n    upstream: {}\n",
        up.url()
    ))
    .await;
    let mut s = TcpStream::connect(g.addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    s.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    let mut blocks = Vec::new();
    let mut buf = Vec::new();
    for stream in [1u32, 3, 5] {
        s.write_all(&get(stream)).await.unwrap();
        // Frames until this stream's response head (a HEADERS frame with END_HEADERS).
        loop {
            while buf.len() < 9
                || buf.len() < 9 + (u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize)
            {
                let mut chunk = [0u8; 16384];
                let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut chunk))
                    .await
                    .expect("a frame within 5 s")
                    .unwrap();
                assert!(n > 0, "connection closed");
                buf.extend_from_slice(&chunk[..n]);
            }
            let len = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize;
            let (kind, flags) = (buf[3], buf[4]);
            let id = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
            let payload = buf[9..9 + len].to_vec();
            buf.drain(..9 + len);
            assert_ne!(kind, GOAWAY, "GOAWAY: {payload:?}");
            if kind == SETTINGS && flags & 1 == 0 {
                s.write_all(&frame(SETTINGS, 1, 0, &[])).await.unwrap();
            }
            if kind == HEADERS && id == stream {
                assert_eq!(flags & 0x4, 0x4, "one HEADERS frame per head");
                assert_eq!(flags & 0x28, 0, "no padding or priority");
                blocks.push(payload);
                break;
            }
        }
    }
    let kinds: Vec<Vec<&str>> = blocks.iter().map(|b| representations(b)).collect();
    // `:status`, and the fields: from the upstream (content-type, date, content-length) and
    // tollgate's own (x-request-id).
    assert!(kinds[0].len() >= 5, "{kinds:?}");
    for later in &kinds[1..] {
        assert!(!later.contains(&"incremental"), "{kinds:?}");
        // x-request-id (new each time) and date (when it changed, or unchanged: it is never
        // indexed either way) at least.
        assert!(
            later.iter().filter(|k| **k == "never").count() >= 2,
            "{kinds:?}"
        );
    }
    assert_eq!(up.hits(), 3);
}

fn h2c() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .unwrap()
}

fn config(upstream: &str, route: &str) -> String {
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nroutes:\n  - name: r\n    upstream: {upstream}\n{route}"
    )
}

/// Bodyless HTTP/2 streams reach a plain upstream over the raw pool (`proxy::raw_upstream`):
/// every way an upstream frames its answer comes out whole, with one length however the
/// upstream spelled it; a length it contradicts is a 502, as on HTTP/1.1.
#[tokio::test]
async fn bodyless_http2_streams_get_every_upstream_framing_whole() {
    let cases: [(&'static [u8], u16, &str, Option<&str>); 6] = [
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\nhello\r\n6\r\n world\r\n0\r\nT: 1\r\n\r\n",
            200,
            "hello world",
            None,
        ),
        (b"HTTP/1.1 200 OK\r\n\r\nhello world", 200, "hello world", None),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello",
            200,
            "hello",
            Some("5"),
        ),
        (
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: x-gone\r\nX-Gone: 1\r\nX-Kept: 1\r\n\r\nok",
            200,
            "ok",
            Some("2"),
        ),
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n", 204, "", None),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello", 502, "", None),
    ];
    let c = h2c();
    for (answer, status, body, length) in cases {
        let parts: &'static [&'static [u8]] = Box::leak(Box::new([answer]));
        let url = crate::support::upstream::raw(parts).await;
        let g = Gateway::start(&config(&url, "")).await;
        let what = String::from_utf8_lossy(&answer[..30]).into_owned();
        let r = c.get(g.url("/x")).send().await.unwrap();
        assert_eq!(r.version(), reqwest::Version::HTTP_2);
        assert_eq!(r.status().as_u16(), status, "{what}");
        let got_length = r
            .headers()
            .get("content-length")
            .map(|v| v.to_str().unwrap().to_owned());
        assert!(r.headers().get("x-gone").is_none(), "{what}");
        if status == 200 {
            assert_eq!(got_length.as_deref(), length, "{what}");
            assert_eq!(r.text().await.unwrap(), body, "{what}");
        }
    }
}

/// The raw pool keeps its connections: many bodyless streams, one after the other, use one
/// upstream connection; a body streams through whole; a HEAD answer keeps its length and has
/// no body; a stream with a body (hyper's client) works beside them.
#[tokio::test]
async fn bodyless_http2_streams_reuse_upstream_connections_and_stream_bodies() {
    let up = Upstream::start().await;
    let g = Gateway::start(&config(&up.url(), "")).await;
    let c = h2c();
    for i in 0..20 {
        let r = c.get(g.url(&format!("/echo/{i}"))).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["path"], format!("/echo/{i}"));
        assert_eq!(v["headers"]["x-forwarded-proto"], "http");
    }
    assert_eq!(up.connections(), 1);
    let size = 3 << 20;
    let r = c
        .get(g.url(&format!("/stream?bytes={size}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.bytes().await.unwrap().len(), size);
    let r = c.head(g.url("/echo")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("content-length"));
    assert!(r.bytes().await.unwrap().is_empty());
    let r = c
        .post(g.url("/echo"))
        .body(vec![b'x'; 100_000])
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["body_len"],
        100_000
    );
}

/// An upstream that closes each connection after its answer without saying so: the pooled
/// connection is found closed at the next request, which goes on a new one (a safe method,
/// nothing of an answer read); an upstream that is down is a 502, one that does not answer
/// in the route's timeout a 504.
#[tokio::test]
async fn bodyless_http2_streams_survive_closed_pooled_connections() {
    let url =
        crate::support::upstream::raw(&[b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]).await;
    let g = Gateway::start(&config(&url, "")).await;
    let c = h2c();
    for _ in 0..5 {
        let r = c.get(g.url("/x")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "ok");
    }
    let down = Gateway::start(&config(
        &format!("http://{}", crate::support::closed_addr()),
        "",
    ))
    .await;
    assert_eq!(c.get(down.url("/x")).send().await.unwrap().status(), 502);
    let up = Upstream::start().await;
    let slow = Gateway::start(&config(&up.url(), "    timeout: 200ms\n")).await;
    assert_eq!(
        c.get(slow.url("/slow?ms=2000"))
            .send()
            .await
            .unwrap()
            .status(),
        504
    );
    let r = c.get(slow.url("/late-body?ms=2000")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.bytes().await.is_err(),
        "a cut body must not end as complete"
    );
}
