//! The fast codec: plain HTTP/1.1 from client to a plain `http://` upstream, in one task per
//! client connection, with the bytes of both heads parsed in place and written straight out.
//!
//! Why it exists: tollgate on hyper spent the same kernel time per request as nginx but twice
//! its user time (hyper's two connection state machines, the hand-off between the client's and
//! the upstream connection's tasks, a `HeaderMap` built and re-encoded on each side, boxed
//! bodies). This codec does what nginx does: parse the request head once with `httparse` into
//! offsets of the read buffer, write the upstream request from those offsets, drive the
//! upstream connection from the same task, and pass bodies through as the bytes they are (a
//! chunked body stays chunked; its end is found by [`framing`]).
//!
//! It parses and writes; it never decides. Refusals, routing, limits, the header rules, the
//! answers of tollgate's own and the end of an exchange are the pipeline's
//! ([`crate::proxy::pipeline`]), which the hyper codec calls too. What this codec does not parse
//! (TLS, HTTP/2, HTTP/1.0 clients, protocol switches, `Expect`, ambiguous body lengths,
//! absolute-form targets, oversized heads, routes with an `https://` upstream) it hands to hyper
//! with the connection ([`rewind`]): hyper reads it (and what follows it) from the start.
//!
//! The connection loop is [`conn`], one exchange's dispatch through the phases [`dispatch`], the
//! upstream side [`client`], bodies in flight [`relay`], and the heads' bytes [`write`].

mod client;
mod conn;
mod dispatch;
pub(crate) mod framing;
pub(crate) mod head;
mod relay;
mod rewind;
mod stream;
#[cfg(test)]
mod tests;
pub(crate) mod timer;
mod write;
pub(crate) use client::{ReadError, read_response};
pub(crate) use stream::Stream;
pub(crate) use write::upstream_head;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::Watcher;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;

use self::head::{Field, RequestHead};
use self::rewind::Rewind;
use self::timer::LazyTimer;
use crate::proxy::{Gateway, request_id};

/// Waiting for a request head (idle keep-alive included), as the general path's
/// `header_read_timeout`.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Reads ask for at least this much room.
const READ_CHUNK: usize = 16 * 1024;
/// A request body tollgate answers without forwarding is read and dropped up to this size, so
/// the connection stays usable; past it the connection is closed instead.
const DISCARD_MAX: usize = 1 << 20;
/// Bytes read from a client while its request waits for a reserved slot, at most.
const WAIT_READ_MAX: usize = 64 * 1024;

/// A client connection the fast codec serves: a byte stream whose read and write halves can be
/// borrowed apart for one exchange (both directions at once). [`Stream`] (plain TCP or TLS) in
/// production; an in-memory pipe in this module's tests.
pub(crate) trait ClientIo: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The read half, borrowed.
    type Reader<'a>: AsyncRead + Unpin + Send
    where
        Self: 'a;
    /// The write half, borrowed.
    type Writer<'a>: AsyncWrite + Unpin + Send
    where
        Self: 'a;
    /// The stream is TLS: a write may leave records in rustls's buffer that only a flush sends
    /// (the codec flushes after each write that ends what it has to say for now), and a close
    /// is announced (`close_notify`) however the connection ends.
    fn is_tls(&self) -> bool {
        false
    }
    /// Both halves, borrowed apart (for a socket, without a lock).
    fn halves(&mut self) -> (Self::Reader<'_>, Self::Writer<'_>);
}

/// What the listener gives each plain connection.
#[derive(Clone)]
pub(crate) struct Control {
    pub builder: Arc<auto::Builder<TokioExecutor>>,
    /// Turns true when the listener drains: idle connections close, busy ones after their
    /// current exchange.
    pub stop: watch::Receiver<bool>,
}

/// Serves one client connection (plain TCP, or TLS after its handshake); `watcher` counts it
/// for the drain.
pub(crate) async fn serve<S: ClientIo>(
    gateway: Arc<Gateway>,
    stream: S,
    peer: SocketAddr,
    ctl: Control,
    watcher: Watcher,
) {
    let mut conn = Conn {
        gateway: gateway.clone(),
        client: stream,
        peer,
        rbuf: BytesMut::with_capacity(READ_CHUNK),
        ubuf: BytesMut::new(),
        out: Vec::with_capacity(1024),
        fields: Vec::with_capacity(16),
        ufields: Vec::with_capacity(16),
        scratch: (Vec::new(), Vec::new()),
        stop: ctl.stop,
        peer_text: crate::key::IpText::new(peer.ip()),
        idle: LazyTimer::new(),
        idle_from: tokio::time::Instant::now(),
        route_timer: LazyTimer::new(),
    };
    let prefix = match conn.run().await {
        Ended::General(prefix) => prefix,
        Ended::Quiet if conn.client.is_tls() => {
            // Idle, drained, or the client closed: TLS says so before the socket closes (a
            // plain socket's close says it by itself).
            conn.close(false).await;
            return;
        }
        Ended::Quiet | Ended::Closed => return,
    };
    let io = Rewind {
        prefix,
        inner: conn.client,
    };
    let c = super::general::serve_one(&ctl.builder, TokioIo::new(io), gateway.clone(), peer);
    if let Err(e) = watcher.watch(c).await {
        super::general::ended_with(&gateway, peer, &*e);
    }
}

struct Conn<S> {
    gateway: Arc<Gateway>,
    client: S,
    peer: SocketAddr,
    /// Bytes from the client not yet used.
    rbuf: BytesMut,
    /// Bytes from the upstream not yet used.
    ubuf: BytesMut,
    /// The head being written.
    out: Vec<u8>,
    fields: Vec<Field>,
    ufields: Vec<Field>,
    /// Header fields and body of tollgate's own answers, being written.
    scratch: (Vec<u8>, Vec<u8>),
    stop: watch::Receiver<bool>,
    /// The peer's address as text, for `X-Forwarded-For` and `ip` keys: formatted once.
    peer_text: crate::key::IpText,
    /// The head timeout, [`HEAD_TIMEOUT`] after `idle_from`.
    idle: LazyTimer,
    /// The end of the last exchange (or the connection's start): the head timeout counts from it.
    idle_from: tokio::time::Instant,
    /// The route timeout of the exchange in progress.
    route_timer: LazyTimer,
}

/// How a connection's loop ended.
enum Ended {
    /// Closed after its last answer ([`Conn::close`]).
    Closed,
    /// Between requests, with nothing to answer: the client closed, idled out, or the listener
    /// drains; nothing was said to the client.
    Quiet,
    /// Handed to the general path from these bytes on.
    General(Bytes),
}

enum Step {
    Keep,
    /// Close; `linger`: request bytes may be left unread, so read them off before closing
    /// (closing with unread bytes resets the connection, which can destroy the response).
    Close {
        linger: bool,
    },
    /// Hand the connection, from these bytes on, to the general path.
    General(Bytes),
}

enum ReadHead {
    Head(RequestHead),
    Closed,
    General,
}

/// Why an exchange with the upstream ended without a response head.
enum Failure {
    /// The client's connection failed mid-body.
    Client,
    /// The client shut its side before its body's end (it may still read an answer).
    CutShort,
    BadBody,
    Upstream(io::Error),
    /// No connection to the upstream: nothing of the request was sent, so another upstream
    /// of the route may take it.
    Connect(io::Error),
}

/// The request id: the client's when sane, else ours.
enum RequestId {
    Client(Range),
    Ours([u8; 32]),
}
type Range = std::ops::Range<usize>;

impl RequestId {
    fn bytes<'a>(&'a self, head: &'a [u8]) -> &'a [u8] {
        match self {
            RequestId::Client(r) => &head[r.clone()],
            RequestId::Ours(b) => b,
        }
    }

    fn log<'a>(&'a self, head: &'a [u8]) -> request_id::LogId<'a> {
        request_id::LogId(self.bytes(head))
    }
}
