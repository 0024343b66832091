//! A real upstream on loopback that reports what it received.
//!
//! Paths: `/echo...` (default) answers 200 with a JSON body of method, path, query and headers
//! and the request body's length (counted while streaming, never buffered); `/slow?ms=N` waits
//! N ms first; `/stream?bytes=N` streams N bytes back in 64 KiB chunks; `/first-chunk` answers as
//! soon as the first body chunk arrived (proves the gateway streams request bodies);
//! `/hop` answers with hop-by-hop headers that the gateway must remove; `/late-body?ms=N` sends
//! its head at once and its body N ms later (`&say=TEXT`: TEXT as the body, else `late`);
//! `/usage?n=TEXT&status=S` answers status S (default 200) with `x-usage: TEXT` (none without
//! `n`), as an upstream reporting a request's true cost does.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

type Body = BoxBody<Bytes, Infallible>;

pub struct Upstream {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    /// TCP connections accepted.
    pub connections: Arc<AtomicUsize>,
    /// When each request arrived, in arrival order.
    pub arrivals: Arc<std::sync::Mutex<Vec<std::time::Instant>>>,
    pub name: &'static str,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream {
    pub async fn start() -> Self {
        Self::named("up").await
    }

    pub async fn named(name: &'static str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let connections = Arc::new(AtomicUsize::new(0));
        let conns = connections.clone();
        let arrivals = Arc::new(std::sync::Mutex::new(Vec::new()));
        let h = hits.clone();
        let arr = arrivals.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                conns.fetch_add(1, Ordering::SeqCst);
                let h = h.clone();
                let arr = arr.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        h.fetch_add(1, Ordering::SeqCst);
                        arr.lock().unwrap().push(std::time::Instant::now());
                        handle(req, name)
                    });
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self {
            addr,
            hits,
            connections,
            arrivals,
            name,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Asserts that the k-th request (by arrival) arrived k × `step` after `t0`: never more
    /// than `early` before its slot (the requests' own start skew), never more than `late`
    /// after it.
    pub fn assert_paced(
        &self,
        t0: std::time::Instant,
        step: Duration,
        early: Duration,
        late: Duration,
    ) {
        let mut at: Vec<Duration> = self
            .arrivals
            .lock()
            .unwrap()
            .iter()
            .map(|t| *t - t0)
            .collect();
        at.sort();
        for (i, a) in at.iter().enumerate() {
            let scheduled = step * i as u32;
            assert!(*a + early >= scheduled, "slot {i} forwarded early: {a:?}");
            assert!(*a <= scheduled + late, "slot {i} forwarded late: {a:?}");
        }
    }
}

fn full(s: impl Into<Bytes>) -> Body {
    Full::new(s.into()).boxed()
}

fn query(req: &Request<Incoming>, name: &str) -> Option<u64> {
    req.uri().query()?.split('&').find_map(|p| {
        let (k, v) = p.split_once('=')?;
        (k == name).then(|| v.parse().ok()).flatten()
    })
}

async fn handle(req: Request<Incoming>, name: &'static str) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    if path.starts_with("/slow") {
        let ms = query(&req, "ms").unwrap_or(1000);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if path.starts_with("/late-body") {
        // The head at once, the body `ms` later.
        let ms = query(&req, "ms").unwrap_or(100);
        let say = req
            .uri()
            .query()
            .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("say=")))
            .map_or(Bytes::from_static(b"late\n"), |t| {
                Bytes::copy_from_slice(t.as_bytes())
            });
        let stream = futures_util::stream::once(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok::<_, Infallible>(Frame::data(say))
        });
        return Ok(Response::new(BodyExt::boxed(StreamBody::new(stream))));
    }
    if path.starts_with("/stream") {
        let total = query(&req, "bytes").unwrap_or(1 << 20) as usize;
        let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
        let stream = futures_util::stream::unfold(total, move |left| {
            let chunk = chunk.clone();
            async move {
                if left == 0 {
                    return None;
                }
                let n = left.min(chunk.len());
                Some((Ok::<_, Infallible>(Frame::data(chunk.slice(..n))), left - n))
            }
        });
        return Ok(Response::new(BodyExt::boxed(StreamBody::new(stream))));
    }
    if path.starts_with("/first-chunk") {
        let mut body = req.into_body();
        let first = loop {
            match body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data()
                        && !d.is_empty()
                    {
                        break d.len();
                    }
                }
                _ => break 0,
            }
        };
        // Keep draining in the background so the client's remaining chunks are accepted.
        tokio::spawn(async move { while body.frame().await.is_some() {} });
        return Ok(Response::new(full(format!("first:{first}"))));
    }
    if path.starts_with("/upgrade") && req.headers().contains_key("upgrade") {
        // Switch to a raw echo protocol: whatever arrives is sent back.
        let mut req = req;
        let on = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            if let Ok(io) = on.await {
                let mut io = TokioIo::new(io);
                let (mut r, mut w) = tokio::io::split(&mut io);
                let _ = tokio::io::copy(&mut r, &mut w).await;
            }
        });
        let mut r = Response::new(full(""));
        *r.status_mut() = hyper::StatusCode::SWITCHING_PROTOCOLS;
        r.headers_mut().insert("upgrade", "echo".parse().unwrap());
        r.headers_mut()
            .insert("connection", "upgrade".parse().unwrap());
        return Ok(r);
    }
    if path.starts_with("/usage") {
        let text = req.uri().query().unwrap_or("").split('&').find_map(|p| {
            let (k, v) = p.split_once('=')?;
            (k == "n").then(|| v.to_owned())
        });
        let mut r = Response::new(full("used"));
        *r.status_mut() = hyper::StatusCode::from_u16(query(&req, "status").unwrap_or(200) as u16)
            .unwrap_or(hyper::StatusCode::OK);
        if let Some(text) = text {
            r.headers_mut().insert("x-usage", text.parse().unwrap());
        }
        return Ok(r);
    }
    if path.starts_with("/hop") {
        let mut r = Response::new(full("hop"));
        let h = r.headers_mut();
        h.insert("connection", "x-internal".parse().unwrap());
        h.insert("x-internal", "secret".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("proxy-authenticate", "Basic".parse().unwrap());
        h.insert("x-end-to-end", "kept".parse().unwrap());
        return Ok(r);
    }
    let method = req.method().to_string();
    let query_s = req.uri().query().unwrap_or("").to_owned();
    let headers: serde_json::Map<String, serde_json::Value> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                serde_json::Value::String(String::from_utf8_lossy(v.as_bytes()).into_owned()),
            )
        })
        .collect();
    let mut body = req.into_body();
    let mut len = 0usize;
    let mut chunks = 0usize;
    while let Some(Ok(f)) = body.frame().await {
        if let Ok(d) = f.into_data() {
            len += d.len();
            chunks += 1;
        }
    }
    let v = serde_json::json!({
        "upstream": name,
        "method": method,
        "path": path,
        "query": query_s,
        "headers": headers,
        "body_len": len,
        "body_chunks": chunks,
    });
    let mut r = Response::new(full(v.to_string()));
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    Ok(r)
}

/// Reads from `s` until a request head's end (`CRLF CRLF`) has arrived: what was read, or
/// `None` when the connection ends first.
async fn read_head(s: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut chunk).await {
            Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return None,
        }
    }
    Some(buf)
}

/// A hand-written upstream for answers hyper would not give: for every connection it reads a
/// request head, writes `parts` one after the other 20 ms apart, and closes. Returns its URL.
pub async fn raw(parts: &'static [&'static [u8]]) -> String {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                if read_head(&mut s).await.is_none() {
                    return;
                }
                for (i, part) in parts.iter().enumerate() {
                    if i > 0 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let _ = s.write_all(part).await;
                }
            });
        }
    });
    url
}

/// A hand-written upstream whose cost trailer waits to be released: for every connection it
/// reads a request head, writes a chunked 200 head and body at once, then, once the returned
/// semaphore has a permit for it (taken, one per answer), the last chunk with the trailer
/// `x-usage: N` (N from the request's `?n=N`), and closes. So a test can hold a response open
/// past its admission and decide when its cost settles. Returns its URL.
pub async fn trailer_on_release() -> (String, Arc<tokio::sync::Semaphore>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let permits = Arc::clone(&release);
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let permits = Arc::clone(&permits);
            tokio::spawn(async move {
                let Some(buf) = read_head(&mut s).await else {
                    return;
                };
                let head = String::from_utf8_lossy(&buf).into_owned();
                let n: String = head
                    .split_once("n=")
                    .map(|(_, rest)| rest.chars().take_while(char::is_ascii_digit).collect())
                    .unwrap_or_default();
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-usage\r\n\r\n4\r\nheld\r\n")
                    .await;
                let Ok(permit) = permits.acquire().await else {
                    return;
                };
                permit.forget();
                let _ = s
                    .write_all(format!("0\r\nx-usage: {n}\r\n\r\n").as_bytes())
                    .await;
            });
        }
    });
    (url, release)
}
