//! Bodies in flight on the fast codec: the request body pumped to the upstream, the response
//! body relayed to the client, and both at once while the request body is still coming.

use std::future::poll_fn;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::client::read_more;
use super::framing::Framing;
use super::write::push_body;
use super::{ClientIo, Failure, WAIT_READ_MAX};

/// Why a body in flight was cut: the client must see it end badly, never as complete.
#[derive(Debug, thiserror::Error)]
pub(super) enum Cut {
    /// The client's connection failed or closed.
    #[error("client connection ended mid-exchange")]
    Client,
    /// The upstream's connection failed or closed before the body's end.
    #[error("upstream connection ended mid-body")]
    Upstream,
    /// The upstream's body broke its framing, or the client's did.
    #[error("malformed body")]
    Malformed,
}

/// The request body's side of an exchange: bytes counted as body (taken out of the client's
/// buffer) but not yet sent, and whether the upstream stopped taking them.
#[derive(Default)]
pub(super) struct Pump {
    pub pending: Bytes,
    pub broken: bool,
}

impl Pump {
    /// Takes the next body bytes from `rbuf` when the last ones are sent; an error once the
    /// body is malformed. Once the upstream stopped taking the body, what comes is dropped (the
    /// client is still read, so it can finish sending and read its answer).
    pub(super) fn feed(&mut self, rbuf: &mut BytesMut, body: &mut Framing) -> Result<(), Failure> {
        if self.broken {
            self.pending.clear();
        }
        if self.pending.is_empty() && !body.is_done() && !rbuf.is_empty() {
            let n = body.advance(rbuf).map_err(|_| Failure::BadBody)?;
            let taken = rbuf.split_to(n);
            if !self.broken {
                self.pending = taken.freeze();
            }
        }
        Ok(())
    }

    /// Wants more of the body from the client.
    pub(super) fn wants(&self, body: &Framing) -> bool {
        self.pending.is_empty() && !body.is_done()
    }
}

/// Copies the rest of a response body (its framing says when it ends) to the client, after
/// what `out` holds (the head and the body bytes that came with it).
pub(super) async fn relay<C: ClientIo>(
    client: &mut C,
    up: &mut TcpStream,
    ubuf: &mut BytesMut,
    out: &mut Vec<u8>,
    framing: &mut Framing,
    rechunk: bool,
) -> Result<(), Cut> {
    // Each write is followed by a flush on TLS, written out at each write rather than in a
    // helper: the plain path pays no extra future for it.
    let tls = client.is_tls();
    client.write_all(out).await.map_err(|_| Cut::Client)?;
    if tls {
        client.flush().await.map_err(|_| Cut::Client)?;
    }
    while !framing.is_done() {
        ubuf.clear();
        match read_more(up, ubuf).await {
            Ok(0) if rechunk => {
                client
                    .write_all(b"0\r\n\r\n")
                    .await
                    .map_err(|_| Cut::Client)?;
                if tls {
                    client.flush().await.map_err(|_| Cut::Client)?;
                }
                return Ok(());
            }
            Ok(n) if n > 0 => {}
            _ => return Err(Cut::Upstream),
        }
        let n = framing.advance(ubuf).map_err(|_| Cut::Malformed)?;
        #[cfg(feature = "panic-injection")]
        crate::panics::inject::body(&ubuf[..n]);
        let sent = if rechunk {
            out.clear();
            push_body(out, &ubuf[..n], true);
            client.write_all(out).await
        } else {
            client.write_all(&ubuf[..n]).await
        };
        sent.map_err(|_| Cut::Client)?;
        if tls {
            client.flush().await.map_err(|_| Cut::Client)?;
        }
        ubuf.advance(n);
    }
    Ok(())
}

/// [`relay`] while the request body is still being sent: both directions at once, as an
/// upstream that streams its answer while reading the body needs. Each step is one read or one
/// write; a request body the upstream no longer takes is read and dropped (the connection
/// closes after).
#[allow(clippy::too_many_arguments)]
pub(super) async fn relay_duplex<C: ClientIo>(
    client: &mut C,
    rbuf: &mut BytesMut,
    body: &mut Framing,
    pump: &mut Pump,
    up: &mut TcpStream,
    ubuf: &mut BytesMut,
    out: &mut Vec<u8>,
    framing: &mut Framing,
    rechunk: bool,
) -> Result<(), Cut> {
    let tls = client.is_tls();
    let (mut cr, mut cw) = client.halves();
    let (mut ur, mut uw) = up.split();
    let mut written = 0;
    let mut done = framing.is_done();
    // Bytes the client's stream took but may still hold (TLS): flushed before the next read
    // from the upstream, and before the end.
    let mut unflushed = false;
    loop {
        if written == out.len() && !unflushed {
            out.clear();
            written = 0;
            if done {
                return Ok(());
            }
        }
        pump.feed(rbuf, body).map_err(|_| Cut::Malformed)?;
        let sending = !pump.broken && !pump.pending.is_empty();
        let wants = pump.wants(body) && rbuf.len() < WAIT_READ_MAX;
        let flushing = written < out.len();
        let flush = tls && unflushed && !flushing;
        tokio::select! {
            r = uw.write(&pump.pending), if sending => match r {
                Ok(n) if n > 0 => pump.pending.advance(n),
                _ => pump.broken = true,
            },
            r = read_more(&mut cr, rbuf), if wants => match r {
                Ok(n) if n > 0 => {}
                _ => return Err(Cut::Client),
            },
            // One branch writes, or flushes once all is written: both need the write half.
            r = poll_fn(|cx| {
                let w = std::pin::Pin::new(&mut cw);
                if flushing {
                    w.poll_write(cx, &out[written..]).map_ok(Some)
                } else {
                    w.poll_flush(cx).map_ok(|()| None)
                }
            }), if flushing || flush => match r {
                Ok(Some(n)) if n > 0 => {
                    written += n;
                    unflushed = tls;
                }
                Ok(None) => unflushed = false,
                _ => return Err(Cut::Client),
            },
            r = read_more(&mut ur, ubuf), if !flushing && !flush && !done => {
                match r {
                    Ok(0) if rechunk => {
                        out.extend_from_slice(b"0\r\n\r\n");
                        done = true;
                        continue;
                    }
                    Ok(n) if n > 0 => {}
                    _ => return Err(Cut::Upstream),
                }
                let n = framing.advance(ubuf).map_err(|_| Cut::Malformed)?;
                push_body(out, &ubuf[..n], rechunk);
                ubuf.advance(n);
                done = framing.is_done();
                if !done {
                    ubuf.clear();
                }
            }
        }
    }
}
