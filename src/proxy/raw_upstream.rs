//! HTTP/2 streams that carry no request body, sent to a plain `http://` upstream over the fast
//! codec's raw connection pool instead of hyper's HTTP/1.1 client.
//!
//! Why: on an HTTP/2 stream, hyper's client was a quarter of the stream's instructions
//! (docs/benchmarks.md): a connection task per upstream connection that the stream's request
//! reaches through a channel and whose answer comes back through another, a second state machine
//! for the exchange, and the response head turned into a `HeaderMap` by a parser that also
//! interns every name. Here the stream's own task writes the request head (from the map the
//! header rules left), reads the response head with the fast codec's parser
//! ([`h1::read_response`]: the same strictness about lengths, informational answers and
//! protocol switches), builds the map the HTTP/2 side needs, and streams the body from the
//! connection, which goes back to the pool when the body has been read to its end.
//!
//! A request with a body keeps hyper's client: sending a body while the answer may already be
//! coming is what hyper's connection task does well, and GETs are most of what HTTP/2 clients
//! send. Response trailers of a chunked body are dropped, as on the general path's HTTP/1.1
//! side.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::Body;
use super::codec::h1::framing::Framing;
use super::codec::h1::{ReadError, read_response};
use crate::connector::raw::Pool;
use crate::connector::{BoxError, STALE_RETRIES};

/// Why no response came.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RawError {
    /// No connection to the upstream: nothing was sent, another upstream may take the request.
    #[error("cannot connect to the upstream: {0}")]
    Connect(io::Error),
    /// The request was (or may have been) sent: it is not sent again.
    #[error("{0}")]
    Sent(io::Error),
}

/// Sends `req`, whose body is empty, on a pooled (or new) connection of `pool`, and reads the
/// response head. A pooled connection that turns out closed before any byte of an answer takes
/// the request to another one when the method is safe, as the fast codec's client does.
pub(crate) async fn send(
    pool: &Arc<Pool>,
    req: &Request<Body>,
    now: Instant,
) -> Result<Response<Body>, RawError> {
    let head = request_head(req);
    let method = req.method();
    let safe = matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    );
    let head_request = *method == Method::HEAD;
    let mut fields = Vec::new();
    let mut stale = 0;
    let (up, resp, buf) = loop {
        let pooled = if stale < STALE_RETRIES {
            pool.checkout(now)
        } else {
            None
        };
        let (mut up, reused) = match pooled {
            Some(s) => (s, true),
            None => (pool.connect().await.map_err(RawError::Connect)?, false),
        };
        match up.write(&head).await {
            Ok(n) if n > 0 => {
                if n < head.len() {
                    up.write_all(&head[n..]).await.map_err(RawError::Sent)?;
                }
            }
            Ok(_) | Err(_) if reused => {
                stale += 1;
                continue;
            }
            Ok(_) => return Err(RawError::Sent(io::ErrorKind::WriteZero.into())),
            Err(e) => return Err(RawError::Sent(e)),
        }
        let mut buf = BytesMut::new();
        match read_response(&mut up, &mut buf, &mut fields, head_request).await {
            Ok(h) => break (up, h, buf),
            Err(ReadError::Closed) if reused && safe => stale += 1,
            Err(e) => return Err(RawError::Sent(e.into())),
        }
    };
    let mut buf = buf;
    let head_bytes = buf.split_to(resp.len).freeze();
    let mut map = HeaderMap::with_capacity(fields.len() + 1);
    for f in &fields {
        let name = &head_bytes[f.name.clone()];
        if name.eq_ignore_ascii_case(b"content-length")
            || name.eq_ignore_ascii_case(b"transfer-encoding")
        {
            // The framing is this side's: the length once, as parsed, below.
            continue;
        }
        // httparse read the name as a token and the value as field-value bytes: both convert.
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name),
            HeaderValue::from_maybe_shared(head_bytes.slice(f.value.clone())),
        ) else {
            return Err(RawError::Sent(io::Error::new(
                io::ErrorKind::InvalidData,
                "a response field that is not a field",
            )));
        };
        map.append(name, value);
    }
    if let Some(n) = resp.length {
        map.insert(CONTENT_LENGTH, HeaderValue::from(n));
    }
    debug_assert!(!map.contains_key(TRANSFER_ENCODING));
    let status = StatusCode::from_u16(resp.status).map_err(|_| {
        RawError::Sent(io::Error::new(io::ErrorKind::InvalidData, "invalid status"))
    })?;
    let body = RawBody {
        up: Some(up),
        reusable: !resp.closes,
        buf,
        framing: resp.framing,
        pool: Arc::clone(pool),
    };
    let body = if body.framing.is_done() {
        // Nothing to read: the connection goes back now.
        let mut body = body;
        body.finish();
        crate::proxy::response::full(Bytes::new())
    } else {
        body.boxed()
    };
    let mut out = Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = map;
    Ok(out)
}

/// The HTTP/1.1 request head: the request line with the target as the request holds it (origin
/// form), every field of its map, and a zero length where a body is expected but empty (as
/// hyper's client writes it).
fn request_head(req: &Request<Body>) -> Vec<u8> {
    let mut head = Vec::with_capacity(256);
    head.extend_from_slice(req.method().as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(
        req.uri()
            .path_and_query()
            .map_or("/", |pq| pq.as_str())
            .as_bytes(),
    );
    head.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in req.headers() {
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    let bodyless_method = matches!(
        *req.method(),
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE
    );
    if !bodyless_method && !req.headers().contains_key(CONTENT_LENGTH) {
        head.extend_from_slice(b"content-length: 0\r\n");
    }
    head.extend_from_slice(b"\r\n");
    head
}

/// A response body read from a raw connection by its framing; the connection goes back to the
/// pool once the body has been read to its end with nothing after it.
struct RawBody {
    /// Taken when the body ends.
    up: Option<TcpStream>,
    /// The upstream keeps the connection open after this answer.
    reusable: bool,
    /// Bytes read and not yet given out.
    buf: BytesMut,
    framing: Framing,
    pool: Arc<Pool>,
}

impl RawBody {
    /// The body is over: its connection back to the pool, if it can serve another request.
    fn finish(&mut self) {
        if let Some(up) = self.up.take()
            && self.reusable
            && self.buf.is_empty()
            && !matches!(self.framing, Framing::UntilClose)
        {
            self.pool.checkin(up, Instant::now());
        }
    }

    /// The next data among the bytes read, as the framing finds it.
    fn take_data(&mut self) -> Result<Option<Bytes>, BoxError> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        if let Framing::Chunked(c) = &mut self.framing {
            let mut spans: smallvec::SmallVec<[Range<usize>; 2]> = smallvec::SmallVec::new();
            let used = c.scan_data(&self.buf, |r| spans.push(r))?;
            let consumed = self.buf.split_to(used).freeze();
            return Ok(match spans.as_slice() {
                [] => None,
                [one] => Some(consumed.slice(one.clone())),
                many => {
                    let mut joined = BytesMut::with_capacity(many.iter().map(|r| r.len()).sum());
                    for r in many {
                        joined.extend_from_slice(&consumed[r.clone()]);
                    }
                    Some(joined.freeze())
                }
            });
        }
        let n = self.framing.advance(&self.buf)?;
        Ok((n > 0).then(|| self.buf.split_to(n).freeze()))
    }
}

impl http_body::Body for RawBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            match this.take_data() {
                Err(e) => {
                    this.up = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Ok(Some(data)) => {
                    if this.framing.is_done() {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(None) => {}
            }
            if this.framing.is_done() {
                this.finish();
                return Poll::Ready(None);
            }
            let Some(up) = this.up.as_mut() else {
                return Poll::Ready(None);
            };
            if this.buf.capacity() - this.buf.len() < 1024 {
                this.buf.reserve(16 * 1024);
            }
            ready!(up.poll_read_ready(cx))?;
            match up.try_read_buf(&mut this.buf) {
                Ok(0) if matches!(this.framing, Framing::UntilClose) => {
                    this.up = None;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    this.up = None;
                    return Poll::Ready(Some(Err(
                        "the upstream closed the connection mid-body".into()
                    )));
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    this.up = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing.is_done() && self.buf.is_empty()
    }
}
