//! The fast HTTP/1.1 path, spoken to over raw sockets: pipelining, bodies passed through as
//! their bytes, answers of tollgate's own that leave the connection usable (and never let a
//! body be read as a request), upstream bodies that end at close, and requests it leaves to the
//! general path on the same connection. The fast codec serves TLS connections too (ALPN
//! `http/1.1`), so the checks that compare the two paths run on both transports, and the ones
//! about the fast codec's own behaviour on TLS as well where a transport could change it.

use crate::support;

use std::time::Duration;

use crate::support::Gateway;
use crate::support::upstream::Upstream;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn yaml(upstream: &str, limits: &str) -> String {
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nroutes:\n  - name: all\n    upstream: {upstream}\n{limits}"
    )
}

/// Gateways on `upstream` with the fast path (the default) and without it, each on plain TCP
/// and on TLS, for checks that both paths answer alike on either transport; each with its
/// label ("fast", "general", "fast tls", "general tls").
async fn both_paths(upstream: &str) -> Vec<(&'static str, Gateway)> {
    both_paths_of(&yaml(upstream, "")).await
}

/// [`both_paths`] for a whole config (its `server` section with `admin: 127.0.0.1:0`).
async fn both_paths_of(config: &str) -> Vec<(&'static str, Gateway)> {
    let general = config.replace(
        "  admin: 127.0.0.1:0\n",
        "  admin: 127.0.0.1:0\n  fast_path: false\n",
    );
    vec![
        ("fast", Gateway::start(config).await),
        ("general", Gateway::start(&general).await),
        ("fast tls", Gateway::start_tls(config).await),
        ("general tls", Gateway::start_tls(&general).await),
    ]
}

/// Plain TCP and TLS, for the fast codec's own checks.
const TRANSPORTS: [bool; 2] = [false, true];

/// One request on a connection of its own, and its response.
async fn ask(g: &Gateway, req: &[u8]) -> Resp {
    let mut c = connect(g).await;
    c.send(req).await;
    c.next(false).await
}

/// One response read off a raw connection.
#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// Reads responses from a raw connection (TCP or TLS), keeping bytes past one response for
/// the next.
struct Reader {
    stream: Box<dyn support::Stream>,
    buf: Vec<u8>,
}

impl Reader {
    fn new(stream: Box<dyn support::Stream>) -> Self {
        Self {
            stream,
            buf: Vec::new(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 8192];
        let n = tokio::time::timeout(Duration::from_secs(5), self.stream.read(&mut chunk))
            .await
            .expect("no answer in 5 s")
            .unwrap_or(0);
        self.buf.extend_from_slice(&chunk[..n]);
        n > 0
    }

    /// The next response; `head`: it answers a HEAD request (no body).
    async fn next(&mut self, head: bool) -> Resp {
        loop {
            let mut fields = [httparse::EMPTY_HEADER; 128];
            let mut r = httparse::Response::new(&mut fields);
            if let httparse::Status::Complete(len) = r.parse(&self.buf).unwrap() {
                let headers: Vec<(String, String)> = r
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect();
                let status = r.code.unwrap();
                self.buf.drain(..len);
                let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
                let body = if head || status == 204 || status == 304 {
                    Vec::new()
                } else if get("transfer-encoding").is_some() {
                    self.dechunk().await
                } else if let Some(cl) = get("content-length") {
                    let cl: usize = cl.parse().unwrap();
                    while self.buf.len() < cl {
                        assert!(self.fill().await, "body cut short");
                    }
                    self.buf.drain(..cl).collect()
                } else {
                    while self.fill().await {}
                    std::mem::take(&mut self.buf)
                };
                return Resp {
                    status,
                    headers,
                    body,
                };
            }
            assert!(self.fill().await, "connection closed before a response");
        }
    }

    async fn dechunk(&mut self) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(p) = self.buf.windows(2).position(|w| w == b"\r\n") {
                    break p;
                }
                assert!(self.fill().await);
            };
            let size_text = String::from_utf8_lossy(&self.buf[..line_end]).into_owned();
            let size =
                usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
            self.buf.drain(..line_end + 2);
            while self.buf.len() < size + 2 {
                assert!(self.fill().await);
            }
            body.extend(self.buf.drain(..size));
            self.buf.drain(..2);
            if size == 0 {
                return body;
            }
        }
    }

    /// True when the gateway closed the connection (and sent nothing more).
    async fn closed(&mut self) -> bool {
        !self.fill().await && self.buf.is_empty()
    }
}

/// An upstream that answers its first request with `answer` as soon as the request's first
/// bytes arrive (without reading a body), then holds the connection open.
async fn one_shot_upstream(answer: &'static [u8]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 1024];
        let _ = s.read(&mut buf).await;
        let _ = s.write_all(answer).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    url
}

async fn connect(g: &Gateway) -> Reader {
    Reader::new(g.connect().await)
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order_on_one_connection() {
    let up = Upstream::start().await;
    for tls in TRANSPORTS {
        let g = Gateway::start_on(&yaml(&up.url(), ""), tls).await;
        let mut c = connect(&g).await;
        c.send(
            b"GET /a HTTP/1.1\r\nhost: t\r\n\r\nHEAD /b HTTP/1.1\r\nhost: t\r\n\r\nGET /c?x=1 HTTP/1.1\r\nhost: t\r\n\r\n",
        )
        .await;
        let a = c.next(false).await;
        assert_eq!(a.json()["path"], "/a");
        let proto = if tls { "https" } else { "http" };
        assert_eq!(a.json()["headers"]["x-forwarded-proto"], proto);
        let b = c.next(true).await;
        assert_eq!(b.status, 200);
        let cc = c.next(false).await;
        assert_eq!(cc.json()["path"], "/c");
        assert_eq!(cc.json()["query"], "x=1");
    }
    assert_eq!(up.hits(), 6);
}

#[tokio::test]
async fn a_chunked_request_body_reaches_the_upstream_whole_and_the_next_request_follows() {
    let up = Upstream::start().await;
    for tls in TRANSPORTS {
        let g = Gateway::start_on(&yaml(&up.url(), ""), tls).await;
        let mut c = connect(&g).await;
        // Sizes in both cases, an extension, a trailer; the next request right behind it.
        c.send(
            b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\nA\r\n0123456789\r\na\r\nabcdefghij\r\n0\r\nx-trailer: 1\r\n\r\nGET /next HTTP/1.1\r\nhost: t\r\n\r\n",
        )
        .await;
        let first = c.next(false).await;
        assert_eq!(first.status, 200);
        assert_eq!(first.json()["body_len"], 25);
        assert_eq!(first.json()["headers"]["transfer-encoding"], "chunked");
        let next = c.next(false).await;
        assert_eq!(next.json()["path"], "/next");
    }
    assert_eq!(up.hits(), 4);
}

#[tokio::test]
async fn a_body_tollgate_answers_itself_is_read_off_and_never_taken_for_a_request() {
    let up = Upstream::start().await;
    let limits = "    limits:\n      - name: one\n        algorithm: fixed_window\n        rate: 1/1m\n        key: [literal:all]\n";
    for tls in TRANSPORTS {
        body_read_off_on(&Gateway::start_on(&yaml(&up.url(), limits), tls).await).await;
    }
    assert_eq!(up.hits(), 2, "only the first request on each was forwarded");
}

async fn body_read_off_on(g: &Gateway) {
    let mut c = connect(g).await;
    // The body of a rejected request spells a request: it must be read off as body.
    let smuggled = "GET /smuggled HTTP/1.1\r\nhost: t\r\n\r\n";
    let post = format!(
        "POST /p HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n{smuggled}",
        smuggled.len()
    );
    let chunked = format!(
        "POST /p HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{smuggled}\r\n0\r\n\r\n",
        smuggled.len()
    );
    for (i, req) in [post.clone(), post, chunked].iter().enumerate() {
        c.send(req.as_bytes()).await;
        let r = c.next(false).await;
        assert_eq!(r.status, if i == 0 { 200 } else { 429 }, "request {i}");
    }
    c.send(b"GET /last HTTP/1.1\r\nhost: t\r\n\r\n").await;
    assert_eq!(c.next(false).await.status, 429);
}

#[tokio::test]
async fn a_malformed_chunked_body_is_refused_with_400_and_the_connection_closed() {
    let up = Upstream::start().await;
    for tls in TRANSPORTS {
        let g = Gateway::start_on(&yaml(&up.url(), ""), tls).await;
        let mut c = connect(&g).await;
        c.send(b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n")
            .await;
        let r = c.next(false).await;
        assert_eq!(r.status, 400);
        assert_eq!(r.header("connection"), Some("close"));
        assert!(c.closed().await, "tls: {tls}");
    }
}

/// An upstream that answers every request with a body that ends when it closes.
async fn close_delimited_upstream() -> String {
    support::upstream::raw(&[b"HTTP/1.1 200 OK\r\n\r\nhello ", b"world"]).await
}

#[tokio::test]
async fn an_upstream_body_that_ends_at_close_is_sent_chunked_and_the_client_connection_stays_open()
{
    let url = close_delimited_upstream().await;
    for tls in TRANSPORTS {
        let g = Gateway::start_on(&yaml(&url, ""), tls).await;
        let mut c = connect(&g).await;
        for _ in 0..2 {
            c.send(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await;
            let r = c.next(false).await;
            assert_eq!(r.status, 200);
            assert_eq!(r.header("transfer-encoding"), Some("chunked"));
            assert_eq!(r.body, b"hello world");
        }
    }
}

/// An upstream answer framed both ways (`Content-Length` and `Transfer-Encoding: chunked`) is
/// framed by the chunks (RFC 9112 §6.3), and the length is dropped before it is passed on: the
/// general path kept it, so a client read `Content-Length: 3` and three bytes of "hello",
/// complete-looking, on a connection kept open.
#[tokio::test]
async fn an_upstream_answer_with_both_lengths_is_passed_on_whole_on_both_paths() {
    let url = support::upstream::raw(&[
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    ])
    .await;
    for (path, g) in &both_paths(&url).await {
        for req in [
            &b"GET / HTTP/1.1\r\nhost: t\r\n\r\n"[..],
            b"GET / HTTP/1.0\r\nhost: t\r\n\r\n",
        ] {
            let r = ask(g, req).await;
            assert_eq!(r.status, 200, "{path}");
            assert_eq!(r.body, b"hello", "{path} {:?}", r.headers);
            assert_ne!(r.header("content-length"), Some("3"), "{path}");
        }
    }
}

/// `X_Forwarded_For` and `Transfer_Encoding` reach a CGI-style upstream as the very variables
/// the dashed fields make (`HTTP_X_FORWARDED_FOR`): a client could forge its address past
/// tollgate's or frame its body differently there. Dropped on both paths; other names with `_`
/// pass.
#[tokio::test]
async fn underscore_spellings_of_forwarding_and_framing_fields_do_not_reach_the_upstream() {
    let up = Upstream::start().await;
    for (path, g) in &both_paths(&up.url()).await {
        let r = ask(g, b"GET /u HTTP/1.1\r\nHost: t\r\nX_Forwarded_For: 6.6.6.6\r\nTransfer_Encoding: chunked\r\nx_real_ip: 6.6.6.6\r\napi_key: k1\r\n\r\n").await;
        assert_eq!(r.status, 200, "{path}");
        let h = &r.json()["headers"];
        for gone in ["x_forwarded_for", "transfer_encoding", "x_real_ip"] {
            assert!(h.get(gone).is_none(), "{path}: {gone} passed: {h}");
        }
        assert_eq!(h["api_key"], "k1", "{path}");
        assert_eq!(h["x-forwarded-for"], "127.0.0.1", "{path}");
        let proto = if g.tls.is_some() { "https" } else { "http" };
        assert_eq!(h["x-forwarded-proto"], proto, "{path}");
    }
}

/// An upstream head with many fields or a long one is passed on by both paths alike (the fast
/// path answered 502 past 64 fields or 64 KiB, where the general path's client takes hyper's
/// 100 fields and ~400 KiB); a 204's `Content-Length` is not passed on (RFC 9110 §8.6).
#[tokio::test]
async fn big_upstream_heads_and_a_204s_length_are_handled_alike_on_both_paths() {
    let mut head = String::from("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n");
    for i in 0..90 {
        head.push_str(&format!("Set-Cookie: c{i}=v\r\n"));
    }
    head.push_str(&format!("X-Big: {}\r\n\r\nok", "b".repeat(100_000)));
    let head: &'static [u8] = Box::leak(head.into_bytes().into_boxed_slice());
    let parts: &'static [&'static [u8]] = Box::leak(Box::new([head]));
    let big = support::upstream::raw(parts).await;
    let no_content =
        support::upstream::raw(&[b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"]).await;
    let bigs = both_paths(&big).await;
    let empties = both_paths(&no_content).await;
    for ((path, g), (_, empty)) in bigs.iter().zip(&empties) {
        let r = ask(g, b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await;
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.body, b"ok", "{path}");
        let cookies = r.headers.iter().filter(|(n, _)| n == "set-cookie").count();
        assert_eq!(cookies, 90, "{path}");
        assert_eq!(r.header("x-big").map(str::len), Some(100_000), "{path}");
        let mut c = connect(empty).await;
        c.send(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await;
        let r = c.next(false).await;
        assert_eq!(r.status, 204, "{path}");
        assert_eq!(r.header("content-length"), None, "{path}");
    }
}

/// A request body in a coding besides `chunked` (`gzip, chunked`) reached the upstream as
/// plain chunked, its gzip label lost: now 501 (RFC 9112 §6.1, as nginx), on both paths, and
/// the connection closes (its body was not read).
#[tokio::test]
async fn a_transfer_coding_besides_chunked_is_answered_501_on_both_paths() {
    let up = Upstream::start().await;
    let gateways = both_paths(&up.url()).await;
    for (path, g) in &gateways {
        let mut c = connect(g).await;
        c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
            .await;
        let r = c.next(false).await;
        assert_eq!(r.status, 501, "{path}");
        assert!(c.closed().await, "{path}");
        // Plain chunked still passes.
        assert_eq!(ask(g, b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n").await.status, 200, "{path}");
    }
    assert_eq!(up.hits(), gateways.len());
}

/// An upstream that switches protocols on a request that asked for no upgrade: nothing can be
/// relayed after its 101, so both paths answer 502 (the general path passed the 101 on, then
/// closed).
#[tokio::test]
async fn an_unasked_protocol_switch_is_a_502_on_both_paths() {
    let url = support::upstream::raw(&[
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: foo\r\nConnection: upgrade\r\n\r\n",
    ])
    .await;
    for (path, g) in &both_paths(&url).await {
        assert_eq!(
            ask(g, b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await.status,
            502,
            "{path}"
        );
    }
}

/// Upstream lengths as hyper's client reads them, on both paths: a list of one value (`5, 5`)
/// or two equal fields pass on as one `Content-Length: 5`; a bad length beside chunked framing
/// is ignored (the chunks frame the body), where it frames the body it is a 502.
#[tokio::test]
async fn upstream_lengths_are_read_and_passed_on_alike_on_both_paths() {
    let cases: [(&'static [u8], u16, &[u8]); 4] = [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello", 200, b"hello"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello", 200, b"hello"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 200, b"hello"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello", 502, b""),
    ];
    for (answer, status, body) in cases {
        let parts: &'static [&'static [u8]] = Box::leak(Box::new([answer]));
        let url = support::upstream::raw(parts).await;
        for (path, g) in &both_paths(&url).await {
            let what = format!("{path}: {:?}", String::from_utf8_lossy(&answer[..40]));
            let r = ask(g, b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await;
            assert_eq!(r.status, status, "{what}");
            if status == 200 {
                assert_eq!(r.body, body, "{what}");
                let lengths: Vec<&str> = r
                    .headers
                    .iter()
                    .filter(|(n, _)| n == "content-length")
                    .map(|(_, v)| v.as_str())
                    .collect();
                assert!(
                    lengths == ["5"] || lengths.is_empty(),
                    "{what}: {lengths:?}"
                );
            }
        }
    }
}

/// `CONNECT` asks for a tunnel to an address the client names: a reverse proxy does not give
/// one (it told the client `200 Connection Established`, then closed). 405 on both paths,
/// whatever the target's form, and nothing reaches the upstream.
#[tokio::test]
async fn connect_is_refused_with_405_on_both_paths() {
    let up = Upstream::start().await;
    for (path, g) in &both_paths(&up.url()).await {
        for req in [
            &b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"[..],
            b"CONNECT /x HTTP/1.1\r\nHost: t\r\n\r\n",
        ] {
            let r = ask(g, req).await;
            assert_eq!(r.status, 405, "{path}");
            assert!(r.header("allow").is_some(), "{path}");
            assert_eq!(r.json()["error"], "method_not_allowed", "{path}");
        }
    }
    assert_eq!(up.hits(), 0);
}

#[tokio::test]
async fn requests_the_fast_path_leaves_are_served_by_the_general_path_on_the_same_connection() {
    for tls in TRANSPORTS {
        let up = Upstream::start().await;
        let g = Gateway::start_on(&yaml(&up.url(), ""), tls).await;
        leave_to_general_on(&g, &up).await;
    }
}

async fn leave_to_general_on(g: &Gateway, up: &Upstream) {
    let mut c = connect(g).await;
    // Fast path first, then an absolute-form target (the general path's), then more requests,
    // which the general path now serves on this connection.
    c.send(b"GET /one HTTP/1.1\r\nhost: t\r\n\r\n").await;
    assert_eq!(c.next(false).await.json()["path"], "/one");
    c.send(b"GET http://t/two HTTP/1.1\r\nhost: t\r\n\r\n")
        .await;
    assert_eq!(c.next(false).await.json()["path"], "/two");
    c.send(b"GET /three HTTP/1.1\r\nhost: t\r\n\r\n").await;
    assert_eq!(c.next(false).await.json()["path"], "/three");
    // HTTP/1.0 on a connection of its own: answered, then closed.
    let mut old = connect(g).await;
    old.send(b"GET /old HTTP/1.0\r\nhost: t\r\n\r\n").await;
    let r = old.next(false).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["path"], "/old");
    assert!(old.closed().await);
    // A client that speaks first and then goes quiet past nothing: a partial head and close.
    let mut partial = connect(g).await;
    partial.send(b"GET / HTT").await;
    partial.stream.shutdown().await.unwrap();
    assert!(partial.closed().await);
    assert_eq!(up.hits(), 4);
    // A pooling HTTP/1.1 client still works alongside.
    assert_eq!(g.get("/after").await.status, 200);
}

#[tokio::test]
async fn an_upstream_that_answers_before_reading_the_body_gets_no_more_of_it_and_the_client_connection_closes()
 {
    for tls in TRANSPORTS {
        // Answers 413 to any request head at once, without reading the body.
        let url = one_shot_upstream(
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\nconnection: close\r\n\r\nbig",
        )
        .await;
        let g = Gateway::start_on(&yaml(&url, ""), tls).await;
        let mut c = connect(&g).await;
        c.send(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 100000\r\n\r\nstart")
            .await;
        let r = c.next(false).await;
        assert_eq!(r.status, 413, "tls: {tls}");
        assert_eq!(r.body, b"big");
        assert_eq!(r.header("connection"), Some("close"));
    }
}

#[tokio::test]
async fn a_framing_field_named_by_connection_still_frames_the_body() {
    for tls in TRANSPORTS {
        let up = Upstream::start().await;
        let g = Gateway::start_on(&yaml(&up.url(), ""), tls).await;
        framing_field_on(&g, &up).await;
    }
}

async fn framing_field_on(g: &Gateway, up: &Upstream) {
    let mut c = connect(g).await;
    // `Connection: content-length` must not strip the length upstream: the body would be
    // read there as a request of its own, past every limit.
    let inner = "GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n";
    let req = format!(
        "POST /echo HTTP/1.1\r\nhost: t\r\nconnection: content-length, x-secret\r\nx-secret: 1\r\ncontent-length: {}\r\n\r\n{inner}",
        inner.len()
    );
    c.send(req.as_bytes()).await;
    let r = c.next(false).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["body_len"], inner.len());
    assert_eq!(
        r.json()["headers"]["content-length"],
        inner.len().to_string()
    );
    assert!(r.json()["headers"].get("x-secret").is_none());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(up.hits(), 1, "the body was not taken for a request");
}

#[tokio::test]
async fn an_upstream_that_streams_its_answer_while_reading_the_body_gets_all_of_it() {
    // On TLS the client's stream is one rustls session for both directions: the halves share
    // it, and what it buffers of the answer must still go out.
    for tls in TRANSPORTS {
        let g = Gateway::start_on(&yaml(&echoing_upstream().await, ""), tls).await;
        let size = 16 << 20;
        let r = tokio::time::timeout(
            Duration::from_secs(30),
            g.fetcher()
                .send(http::Method::POST, "/dup", vec![b'x'; size].into()),
        )
        .await
        .expect("no deadlock");
        assert_eq!(r.status, 200, "tls: {tls}");
        assert_eq!(r.body.unwrap().len(), size, "tls: {tls}");
    }
}

/// An upstream that sends its head at once, then each piece of the request body back as a
/// chunk as it reads it: more than the sockets buffer, so a proxy that stopped sending the body
/// once the head came (or stopped reading the answer while sending) would wait forever.
async fn echoing_upstream() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 65536];
        let head_end = loop {
            let n = s.read(&mut chunk).await.unwrap();
            buf.extend_from_slice(&chunk[..n]);
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
        };
        let text = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let len: usize = text
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            .await
            .unwrap();
        let mut pending = buf[head_end..].to_vec();
        let mut seen = 0;
        loop {
            if !pending.is_empty() {
                seen += pending.len();
                let mut out = format!("{:x}\r\n", pending.len()).into_bytes();
                out.extend_from_slice(&pending);
                out.extend_from_slice(b"\r\n");
                s.write_all(&out).await.unwrap();
                pending.clear();
            }
            if seen >= len {
                break;
            }
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0);
            pending.extend_from_slice(&chunk[..n]);
        }
        s.write_all(b"0\r\n\r\n").await.unwrap();
    });
    url
}

/// The fields of a response that do not vary between two answers to the same request.
fn stable(r: &Resp) -> Vec<(String, String)> {
    let mut h: Vec<(String, String)> = r
        .headers
        .iter()
        .filter(|(k, _)| k != "date" && k != "x-request-id")
        .cloned()
        .collect();
    h.sort();
    h
}

#[tokio::test]
async fn answers_of_tollgate_s_own_are_the_same_on_both_paths() {
    let up = Upstream::start().await;
    let limits = "    limits:\n      - name: one\n        algorithm: fixed_window\n        rate: 1/1m\n        key: [literal:all]\n";
    let (g, _clock) = Gateway::start_manual(&yaml(&up.url(), limits)).await;
    let mut fast = connect(&g).await;
    fast.send(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n").await;
    assert_eq!(fast.next(false).await.status, 200);
    // The clock stands still: both rejections have the same numbers.
    fast.send(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n").await;
    let a = fast.next(false).await;
    // An absolute-form target is the general path's.
    let mut general = connect(&g).await;
    general
        .send(b"GET http://t/x HTTP/1.1\r\nhost: t\r\n\r\n")
        .await;
    let b = general.next(false).await;
    assert_eq!(a.status, 429);
    assert_eq!(b.status, 429);
    assert_eq!(stable(&a), stable(&b));
    assert_eq!(a.body, b.body);
    assert_eq!(a.header("x-request-id").map(str::len), Some(32));
    // And a 404.
    let yaml404 = "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nroutes:\n  - name: api\n    match: { path_prefix: /api }\n    upstream: http://127.0.0.1:9\n";
    let g2 = Gateway::start(yaml404).await;
    let mut fast = connect(&g2).await;
    fast.send(b"GET /nope HTTP/1.1\r\nhost: t\r\n\r\n").await;
    let a = fast.next(false).await;
    let mut general = connect(&g2).await;
    general
        .send(b"GET http://t/nope HTTP/1.1\r\nhost: t\r\n\r\n")
        .await;
    let b = general.next(false).await;
    assert_eq!(a.status, 404);
    assert_eq!(stable(&a), stable(&b));
    assert_eq!(a.body, b.body);
}

#[tokio::test]
async fn an_upstream_body_that_is_malformed_from_its_first_byte_is_a_502() {
    let url =
        one_shot_upstream(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n")
            .await;
    let g = Gateway::start(&yaml(&url, "")).await;
    let mut c = connect(&g).await;
    c.send(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await;
    let r = c.next(false).await;
    assert_eq!(r.status, 502);
    assert_eq!(r.json()["error"], "bad_gateway");
}

#[tokio::test]
async fn server_fast_path_chooses_the_codec_of_plain_and_tls_http11_connections() {
    // An upstream whose field names are mixed case: the fast path passes names through as
    // they are; hyper writes them lower-case. That tells the two paths apart from outside.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        let resp =
                            b"HTTP/1.1 200 OK\r\nX-Mixed-Case: 1\r\ncontent-length: 2\r\n\r\nok";
                        if s.write_all(resp).await.is_err() {
                            return;
                        }
                    }
                    match s.read(&mut chunk).await {
                        Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                        _ => return,
                    }
                }
            });
        }
    });
    for (fast, name, tls) in [
        (true, "X-Mixed-Case", false),
        (false, "x-mixed-case", false),
        (true, "X-Mixed-Case", true),
        (false, "x-mixed-case", true),
    ] {
        let yaml = format!(
            "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\n  fast_path: {fast}\nroutes:\n  - name: all\n    upstream: {url}\n"
        );
        let g = Gateway::start_on(&yaml, tls).await;
        let mut c = connect(&g).await;
        c.send(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await;
        let _ = c.next(false).await;
        // The raw field name as it came over the wire.
        c.send(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await;
        let mut raw = Vec::new();
        while !raw.windows(4).any(|w| w == b"\r\n\r\n") {
            assert!(c.fill().await);
            raw = c.buf.clone();
        }
        let text = String::from_utf8_lossy(&raw);
        assert!(
            text.contains(&format!("{name}: 1")),
            "fast_path {fast}, tls {tls}: {text}"
        );
    }
}

/// Mangled requests (bytes flipped, inserted, dropped, cut short; on a connection whose client
/// then stops sending) never crash a connection's task and never get a 5xx: each is answered
/// (a 4xx, or the upstream's answer when what is left is still a valid request) or closed,
/// and the gateway keeps serving. Deterministic: a fixed seed, 400 cases.
#[tokio::test]
async fn mangled_requests_get_a_4xx_or_a_close_never_a_panic_or_a_5xx() {
    static PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        // The hook is the process's: `panics::` tests running beside this one inject theirs.
        let text = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if !text.starts_with("injected panic") {
            PANICS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        previous(info);
    }));
    let up = Upstream::start().await;
    let limits = "    limits:\n      - name: l\n        key: [ip, header:x-user]\n        rate: 1000000/1s\n";
    for (path, g) in &both_paths_of(&yaml(&up.url(), limits)).await {
        mangle_against(path, g).await;
    }
    assert_eq!(PANICS.load(std::sync::atomic::Ordering::SeqCst), 0);
}

async fn mangle_against(path: &str, g: &Gateway) {
    let bases: [&[u8]; 3] = [
        b"GET /a/b?q=1 HTTP/1.1\r\nHost: h\r\nX-User: u1\r\nAccept: */*\r\n\r\n",
        b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nX-User: u2\r\n\r\nhello",
        b"PUT /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nT: v\r\n\r\n",
    ];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = |n: usize| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) as usize % n.max(1)
    };
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for case in 0..400 {
        let mut req = bases[case % bases.len()].to_vec();
        for _ in 0..1 + next(3) {
            if req.is_empty() {
                break;
            }
            let at = next(req.len());
            match next(5) {
                0 => req[at] ^= 1 << next(8),
                1 => req.insert(at, b" :\r\n\0\x7f\xff;"[next(8)]),
                2 => {
                    req.remove(at);
                }
                3 => req.truncate(at),
                _ => req[at] = b"\r\n :\t"[next(5)],
            }
        }
        let mut s = g.connect().await;
        let _ = s.write_all(&req).await;
        let _ = s.shutdown().await;
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
            .await
            .unwrap_or_else(|_| panic!("{path} case {case}: no answer and no close for {req:?}"))
            .ok();
        if got.is_empty() {
            *statuses.entry(0).or_default() += 1;
            continue;
        }
        let text = String::from_utf8_lossy(&got);
        let status: u16 = text
            .strip_prefix("HTTP/1.1 ")
            .and_then(|t| t.get(..3))
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{path} case {case}: not a response: {text:?} for {req:?}"));
        assert!(
            status < 500,
            "{path} case {case}: {status} for {req:?}: {text}"
        );
        *statuses.entry(status).or_default() += 1;
    }
    println!(
        "mangled requests, {path} path, status → count (0 = closed without an answer): {statuses:?}"
    );
    assert_eq!(g.get("/after").await.status, 200);
}

/// A client that shuts its write side right after its request still gets the answer, on both
/// paths (hyper's default dropped the connection at the EOF, request and all), and one that
/// shuts it before its body's end gets a 400 on both.
#[tokio::test]
async fn a_half_closed_client_still_gets_its_answer_on_both_paths() {
    let up = Upstream::start().await;
    let gateways = both_paths(&up.url()).await;
    // A whole request is answered; one whose body the shutdown cut short gets a 400 that says
    // so, and one with a malformed chunk a 400 that says that, in the same words on both.
    let cases: [(&[u8], &str, &str); 3] = [
        (b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n", "HTTP/1.1 200 ", ""),
        (
            b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhe",
            "HTTP/1.1 400 ",
            r#""message":"request body cut short""#,
        ),
        (
            b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhe\r\n0\r\n\r\n",
            "HTTP/1.1 400 ",
            r#""message":"malformed request body""#,
        ),
    ];
    for (path, g) in &gateways {
        for (req, want, says) in cases {
            let mut s = g.connect().await;
            s.write_all(req).await.unwrap();
            s.shutdown().await.unwrap();
            let mut got = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
                .await
                .unwrap();
            let text = String::from_utf8_lossy(&got);
            assert!(read.is_ok(), "{path}: {read:?} after {text:?}");
            assert!(text.starts_with(want), "{path}: {text:?}");
            assert!(text.contains(says), "{path}: {text:?}");
        }
    }
}

/// What RFC 9112 has a server refuse or read in a particular way, on both paths alike: the
/// `Host` rules of §3.2 (400 without one on HTTP/1.1, with two, or with one that is not a
/// host), the absolute form's authority before `Host` (§3.2.2), paths no upstream can read as
/// tollgate does (a `%` without two hex digits, an escaped NUL), an oversized head (431, as
/// Envoy's 60 KiB limit), and an `h2c` upgrade, which is not passed on.
#[tokio::test]
async fn requests_are_read_as_rfc_9112_says_on_both_paths() {
    let up = Upstream::start().await;
    let routes = format!(
        "  - name: by-host\n    match: {{ path_prefix: /h, host: example.com }}\n    upstream: {u}\n  - name: all\n    upstream: {u}\n",
        u = up.url()
    );
    let base = format!("server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nroutes:\n{routes}");
    let gateways = both_paths_of(&base).await;
    let big = format!(
        "GET /x HTTP/1.1\r\nHost: h\r\nX-Big: {}\r\n\r\n",
        "a".repeat(70_000)
    );
    let cases: [(&[u8], u16); 11] = [
        (b"GET /x HTTP/1.1\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nHost: a b\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nHost: user@h\r\n\r\n", 400),
        (b"GET /x HTTP/1.0\r\n\r\n", 200),
        (b"GET /x/%zz HTTP/1.1\r\nHost: h\r\n\r\n", 400),
        (b"GET /x/a%00 HTTP/1.1\r\nHost: h\r\n\r\n", 400),
        (b"GET /x/%41 HTTP/1.1\r\nHost: h\r\n\r\n", 200),
        (big.as_bytes(), 431),
        (
            b"GET http://example.com/h HTTP/1.1\r\nHost: other\r\n\r\n",
            200,
        ),
        (
            b"GET http://u@example.com/h HTTP/1.1\r\nHost: example.com\r\n\r\n",
            400,
        ),
    ];
    for (path, g) in &gateways {
        for (req, want) in cases {
            let r = ask(g, req).await;
            let first = String::from_utf8_lossy(&req[..req.len().min(60)]);
            assert_eq!(r.status, want, "{path}: {first:?}");
        }
        // The absolute form's authority chose the route, and is the Host the upstream sees.
        let before = g.metrics().await;
        let r = ask(
            g,
            b"GET http://example.com/h HTTP/1.1\r\nHost: other\r\n\r\n",
        )
        .await;
        assert_eq!(r.json()["headers"]["host"], "example.com", "{path}");
        let after = g.metrics().await;
        let routed = |m: &str| {
            support::metric(
                m,
                "tollgate_requests_total{route=\"by-host\",status=\"200\"}",
            )
            .unwrap_or(0.0)
        };
        assert_eq!(routed(&after) - routed(&before), 1.0, "{path}");
        // An h2c upgrade is served as the plain request it also is; the upstream is not asked
        // to switch.
        let r = ask(g, b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n").await;
        assert_eq!(r.status, 200, "{path}");
        let seen = r.json();
        for field in ["upgrade", "http2-settings", "connection"] {
            assert!(seen["headers"].get(field).is_none(), "{path}: {seen}");
        }
    }
}

/// A key part sent twice with different values (`X-Api-Key: rand` then `X-Api-Key: real`, or
/// `?k=rand&k=real`) could be charged under one and read by the upstream as the other: it is
/// answered 400 `ambiguous_key` on both paths, before the upstream. The same value twice is one
/// value, and an empty value is no value (`on_missing` decides: here, reject).
#[tokio::test]
async fn differing_repeated_key_values_are_refused_and_empty_ones_are_missing_on_both_paths() {
    let up = Upstream::start().await;
    let limits = "    limits:\n      - name: l\n        key: [header:x-api-key, query:k]\n        on_missing: reject\n        rate: 1000/1s\n";
    let gateways = both_paths_of(&yaml(&up.url(), limits)).await;
    for (_, g) in &gateways {
        let get = |target: &str, keys: &[&str]| {
            let mut req = format!("GET {target} HTTP/1.1\r\nHost: h\r\n");
            for k in keys {
                req.push_str(&format!("X-Api-Key: {k}\r\n"));
            }
            req.push_str("\r\n");
            req.into_bytes()
        };
        for (target, keys) in [
            ("/?k=1", &["rand", "real"][..]),
            ("/?k=rand&k=real", &["real"][..]),
        ] {
            let r = ask(g, &get(target, keys)).await;
            assert_eq!(r.status, 400, "{target} {keys:?}");
            let body = r.json();
            assert_eq!(body["error"], "ambiguous_key", "{body}");
            assert_eq!(body["limit"], "l", "{body}");
        }
        assert_eq!(ask(g, &get("/?k=1&k=1", &["a", "a"])).await.status, 200);
        let empty = ask(g, &get("/?k=1", &[""])).await;
        assert_eq!(empty.status, 429);
        assert_eq!(empty.json()["error"], "missing_key");
    }
    assert_eq!(
        up.hits(),
        gateways.len(),
        "only the unambiguous request of each reached the upstream"
    );
}

/// The route `timeout` bounds the whole upstream exchange: an upstream that sends its head and
/// then stalls in the body has the response cut at the deadline on both paths — the client
/// sees the body fail, never a complete-looking one — while a body within the deadline passes.
#[tokio::test]
async fn a_body_stalled_past_the_route_timeout_is_cut_on_both_paths() {
    let up = Upstream::start().await;
    let config = yaml(&up.url(), "    timeout: 300ms\n");
    for (path, g) in &both_paths_of(&config).await {
        assert_eq!(g.get("/late-body?ms=50").await.text(), "late\n", "{path}");
        let t = std::time::Instant::now();
        let r = g.get("/late-body?ms=3000").await;
        assert_eq!(r.status, 200, "{path}");
        assert!(
            r.body.is_err(),
            "{path}: a cut body must not read as complete"
        );
        let took = t.elapsed();
        assert!(
            took >= std::time::Duration::from_millis(250)
                && took < std::time::Duration::from_secs(2),
            "{path}: {took:?}"
        );
    }
}

/// A path no upstream should get (dot segments, bad escapes) is a 400 before routing on both
/// paths, counted under `_unmatched`, also where no route would match it (it was a 404 then).
#[tokio::test]
async fn bad_paths_are_refused_before_routing_on_both_paths() {
    let up = Upstream::start().await;
    let config = format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nroutes:\n  - name: api\n    match: {{ path_prefix: /api }}\n    upstream: {}\n",
        up.url()
    );
    for (path, g) in &both_paths_of(&config).await {
        for target in ["/x/../a", "/x/%zz", "/api/../x"] {
            let r = ask(
                g,
                format!("GET {target} HTTP/1.1\r\nHost: h\r\n\r\n").as_bytes(),
            )
            .await;
            assert_eq!(r.status, 400, "{path}: {target}");
        }
        let m = g.metrics().await;
        let n = support::metric(
            &m,
            "tollgate_requests_total{route=\"_unmatched\",status=\"400\"}",
        );
        assert_eq!(n, Some(3.0), "{path}: {m}");
    }
    assert_eq!(up.hits(), 0);
}

/// A request hyper cannot parse gets its 400 from hyper (both paths hand such bytes to it);
/// that answer is counted under `_unmatched` like tollgate's own, so `tollgate_requests_total`
/// holds every answer given.
#[tokio::test]
async fn unparsable_requests_are_counted_on_both_paths() {
    let up = Upstream::start().await;
    for (path, g) in &both_paths(&up.url()).await {
        let r = ask(g, b"GET / HTTP/1.1\r\nHost: h\r\nBad Header\r\n\r\n").await;
        assert_eq!(r.status, 400, "{path}");
        let series = "tollgate_requests_total{route=\"_unmatched\",status=\"400\"}";
        let t = std::time::Instant::now();
        // Counted when hyper's connection task ends, just after the answer.
        while support::metric(&g.metrics().await, series) != Some(1.0) {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "{path}: never counted"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(up.hits(), 0);
}
