//! The fast codec's upstream side: the request written to a pooled (or new) connection, the
//! request body sent while the response head is awaited, and the final response head read.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Buf, BytesMut};
use http::Method;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::framing::Framing;
use super::head::{self, Field, ParsedResponse, ResponseHead};
use super::relay::Pump;
use super::{Failure, READ_CHUNK, WAIT_READ_MAX};
use crate::connector::STALE_RETRIES;
use crate::connector::raw::Pool;

/// Writes the request to a pooled (or new) upstream connection and reads the response head,
/// sending the request body meanwhile: an upstream may answer before it has read the body, and
/// one that stops reading it can still answer (a 413, say).
///
/// A pooled connection that fails the first write took nothing: the request goes on another.
/// One that ends before any byte of a response may have been closed by the upstream just as
/// the request went out, or may have been acted on: only a safe method is sent again then.
///
/// With `watch_client` (the request holds a concurrency slot), a client that goes away while
/// the head is awaited ends the exchange (`Failure::Client`), so its slot comes back then and
/// not when the upstream answers; other requests are not watched, which costs them nothing.
#[allow(clippy::too_many_arguments)]
pub(super) async fn exchange(
    pool: &Arc<Pool>,
    request_head: &[u8],
    method: &Method,
    body: &mut Framing,
    pump: &mut Pump,
    client: &mut (impl AsyncRead + Unpin),
    rbuf: &mut BytesMut,
    ubuf: &mut BytesMut,
    ufields: &mut Vec<Field>,
    now: Instant,
    watch_client: bool,
) -> Result<(TcpStream, ResponseHead), Failure> {
    let safe = matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    );
    let head_request = *method == Method::HEAD;
    // Sent again only when nothing of the client's body was used up by the first try.
    let bodyless = body.is_done();
    let mut stale = 0;
    loop {
        let pooled = if stale < STALE_RETRIES {
            pool.checkout(now)
        } else {
            None
        };
        let (mut up, reused) = match pooled {
            Some(s) => (s, true),
            None => (pool.connect().await.map_err(Failure::Connect)?, false),
        };
        ubuf.clear();
        match up.write(request_head).await {
            Ok(n) if n > 0 => {
                if n < request_head.len() {
                    up.write_all(&request_head[n..])
                        .await
                        .map_err(Failure::Upstream)?;
                }
            }
            Ok(_) | Err(_) if reused => {
                stale += 1;
                continue;
            }
            Ok(_) => return Err(Failure::Upstream(io::ErrorKind::WriteZero.into())),
            Err(e) => return Err(Failure::Upstream(e)),
        }
        let read = if body.is_done() && watch_client {
            tokio::select! {
                biased;
                r = read_response(&mut up, ubuf, ufields, head_request) => r,
                () = client_gone(client, rbuf) => return Err(Failure::Client),
            }
        } else if body.is_done() {
            read_response(&mut up, ubuf, ufields, head_request).await
        } else {
            send_body_until_head(
                client,
                rbuf,
                body,
                pump,
                &mut up,
                ubuf,
                ufields,
                head_request,
            )
            .await?
        };
        match read {
            Ok(h) => return Ok((up, h)),
            Err(ReadError::Closed) if reused && safe && bodyless => {
                stale += 1;
                continue;
            }
            Err(e) => return Err(Failure::Upstream(e.into())),
        }
    }
}

/// Sends the request body as it comes while waiting for the response head. Each step is one
/// read or one write, so what is not done stays in `pump` and the buffers when the head comes.
#[allow(clippy::too_many_arguments)]
async fn send_body_until_head(
    client: &mut (impl AsyncRead + Unpin),
    rbuf: &mut BytesMut,
    body: &mut Framing,
    pump: &mut Pump,
    up: &mut TcpStream,
    ubuf: &mut BytesMut,
    ufields: &mut Vec<Field>,
    head_request: bool,
) -> Result<Result<ResponseHead, ReadError>, Failure> {
    let (mut ur, mut uw) = up.split();
    let mut got_any = false;
    loop {
        pump.feed(rbuf, body)?;
        let sending = !pump.broken && !pump.pending.is_empty();
        let wants = pump.wants(body);
        tokio::select! {
            r = uw.write(&pump.pending), if sending => match r {
                Ok(n) if n > 0 => pump.pending.advance(n),
                // The upstream stopped reading: its answer may still come.
                _ => pump.broken = true,
            },
            r = read_more(client, rbuf), if wants => match r {
                Ok(n) if n > 0 => {}
                Ok(_) => return Err(Failure::CutShort),
                Err(_) => return Err(Failure::Client),
            },
            r = read_more(&mut ur, ubuf) => {
                match r {
                    Ok(0) if !got_any => return Ok(Err(ReadError::Closed)),
                    Ok(0) => return Ok(Err(ReadError::Invalid("response head cut short"))),
                    Ok(_) => got_any = true,
                    Err(e) => return Ok(Err(ReadError::Io(e))),
                }
                match parse_final(ubuf, head_request, ufields) {
                    Ok(Some(h)) => return Ok(Ok(h)),
                    Ok(None) => {}
                    Err(e) => return Ok(Err(e)),
                }
            }
        }
    }
}

#[derive(Debug)]
pub(crate) enum ReadError {
    /// The connection ended before any byte of a response.
    Closed,
    Io(io::Error),
    Invalid(&'static str),
}

impl From<ReadError> for io::Error {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Closed => io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the upstream closed the connection before answering",
            ),
            ReadError::Io(e) => e,
            ReadError::Invalid(what) => io::Error::new(io::ErrorKind::InvalidData, what),
        }
    }
}

/// Reads until a final response head is in `ubuf` (informational ones are skipped, as the
/// general path's client does).
pub(crate) async fn read_response<R: AsyncRead + Unpin>(
    up: &mut R,
    ubuf: &mut BytesMut,
    ufields: &mut Vec<Field>,
    head_request: bool,
) -> Result<ResponseHead, ReadError> {
    let mut got_any = false;
    loop {
        match read_more(up, ubuf).await {
            Ok(0) if !got_any => return Err(ReadError::Closed),
            Ok(0) => return Err(ReadError::Invalid("response head cut short")),
            Ok(_) => got_any = true,
            Err(e) if !got_any && e.kind() == io::ErrorKind::ConnectionReset => {
                return Err(ReadError::Closed);
            }
            Err(e) => return Err(ReadError::Io(e)),
        }
        if let Some(h) = parse_final(ubuf, head_request, ufields)? {
            return Ok(h);
        }
    }
}

/// The final response head at the start of `ubuf`, once complete; informational heads before
/// it are dropped.
fn parse_final(
    ubuf: &mut BytesMut,
    head_request: bool,
    ufields: &mut Vec<Field>,
) -> Result<Option<ResponseHead>, ReadError> {
    loop {
        if ubuf.is_empty() {
            return Ok(None);
        }
        match head::parse_response(ubuf, head_request, ufields) {
            ParsedResponse::Complete(h) if h.status == 101 => {
                return Err(ReadError::Invalid("101 to a request that asked no upgrade"));
            }
            ParsedResponse::Complete(h) if h.status < 200 => ubuf.advance(h.len),
            ParsedResponse::Complete(h) => return Ok(Some(h)),
            ParsedResponse::Partial => return Ok(None),
            ParsedResponse::Invalid => return Err(ReadError::Invalid("malformed response head")),
        }
    }
}

/// Resolves when the client goes away (its side closed, or the connection failed), reading
/// what it sends meanwhile into `rbuf` (up to [`WAIT_READ_MAX`]: a pipelined request is kept
/// for later; past that, the client is not watched). What a wait for a concurrency slot, and
/// a slot holder's wait for its response head, are raced against.
pub(super) async fn client_gone<R: AsyncRead + Unpin>(client: &mut R, rbuf: &mut BytesMut) {
    while rbuf.len() < WAIT_READ_MAX {
        if !matches!(read_more(client, rbuf).await, Ok(n) if n > 0) {
            return;
        }
    }
    std::future::pending().await
}

pub(super) async fn read_more<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
) -> io::Result<usize> {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(READ_CHUNK);
    }
    r.read_buf(buf).await
}
