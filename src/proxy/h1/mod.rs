//! The fast path: plain HTTP/1.1 from client to a plain `http://` upstream, in one task per
//! client connection, with the bytes of both heads parsed in place and written straight out.
//!
//! Why it exists: the issue asks for at least nginx's requests/s as a plain proxy. Measured on the
//! load harness's layout, tollgate on hyper spent the same kernel time per request as nginx but
//! twice its user time (hyper's two connection state machines, the hand-off between the client's
//! and the upstream connection's tasks, a `HeaderMap` built and re-encoded on each side, boxed
//! bodies). This path does what nginx does: parse the request head once with `httparse` into
//! offsets of the read buffer, write the upstream request from those offsets (hop-by-hop fields
//! dropped, `X-Forwarded-*`, `Host` and `X-Request-Id` set exactly as the general path does),
//! drive the upstream connection from the same task, and pass bodies through as the bytes they
//! are (a chunked body stays chunked; its end is found by [`framing`]).
//!
//! What it does not do it leaves to the general path (`crate::listener`, hyper), which stays the
//! reference for every answer: TLS, HTTP/2 (h2c prior knowledge), HTTP/1.0 clients, protocol
//! switches, `Expect`, ambiguous body lengths, absolute-form targets, oversized heads, routes with
//! an `https://` upstream. Such a request is handed over with the connection: the general path
//! reads it (and what follows it) from the start. Limits, routing, responses of tollgate's own,
//! metrics and logs are shared code, so both paths answer alike.

pub mod framing;
pub mod head;
pub mod timer;
pub mod upstream;

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::uri::Scheme;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::Watcher;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;

use self::framing::Framing;
use self::head::{Field, Name, ParsedRequest, ParsedResponse, RequestHead, ResponseHead};
use self::timer::LazyTimer;
use super::{AbandonGuard, Admission, Body, Proxy, request_id, response};
use crate::key::{RequestParts, client_ip};
use crate::limit::HeaderInfo;
use crate::metrics::RouteMetrics;
use crate::routing::{normalize_path, path_problem};
use crate::snapshot::{ConfigSnapshot, Route};

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
/// A request is tried on at most this many pooled connections that turn out closed.
const STALE_RETRIES: usize = 4;

/// What the listener gives each plain connection.
#[derive(Clone)]
pub struct Control {
    pub builder: Arc<auto::Builder<TokioExecutor>>,
    /// Turns true when the listener drains: idle connections close, busy ones after their
    /// current exchange.
    pub stop: watch::Receiver<bool>,
}

/// Serves one plain TCP connection; `watcher` counts it for the drain.
pub async fn serve(
    proxy: Arc<Proxy>,
    stream: TcpStream,
    peer: SocketAddr,
    ctl: Control,
    watcher: Watcher,
) {
    let mut conn = Conn {
        proxy: proxy.clone(),
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
    let Some(prefix) = conn.run().await else {
        return;
    };
    let io = Rewind {
        prefix,
        inner: conn.client,
    };
    let c = crate::listener::serve_one(&ctl.builder, TokioIo::new(io), proxy.clone(), peer);
    if let Err(e) = watcher.watch(c).await {
        crate::listener::ended_with(&proxy, peer, &*e);
    }
}

struct Conn {
    proxy: Arc<Proxy>,
    client: TcpStream,
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

impl Conn {
    /// Serves requests until the connection closes; returns the bytes to hand to the general
    /// path with the connection, if it came to that.
    async fn run(&mut self) -> Option<Bytes> {
        // One wait on the drain signal for the connection's life, not one per request: each
        // new wait is a registration (and its removal) under the signal's lock.
        let mut stop = self.stop.clone();
        let stopped = stop.changed();
        tokio::pin!(stopped);
        loop {
            let head = match self.read_head(stopped.as_mut()).await {
                ReadHead::Head(h) => h,
                ReadHead::Closed => return None,
                ReadHead::General => return Some(self.rbuf.split().freeze()),
            };
            match self.handle(head).await {
                Step::Keep => {}
                Step::Close { linger } => {
                    self.close(linger).await;
                    return None;
                }
                Step::General(prefix) => return Some(prefix),
            }
        }
    }

    /// `stopped`: resolves when the listener drains (polled only while idle between requests).
    async fn read_head<F: Future>(&mut self, mut stopped: Pin<&mut F>) -> ReadHead {
        let deadline = self.idle_from + HEAD_TIMEOUT;
        loop {
            if !self.rbuf.is_empty() {
                match head::parse_request(&self.rbuf, &mut self.fields) {
                    ParsedRequest::Complete(h) => return ReadHead::Head(h),
                    ParsedRequest::Partial => {}
                    ParsedRequest::General => return ReadHead::General,
                }
            } else if *self.stop.borrow() {
                return ReadHead::Closed;
            }
            tokio::select! {
                biased;
                r = read_more(&mut self.client, &mut self.rbuf) => match r {
                    Ok(n) if n > 0 => {}
                    // A head cut off by the client's close: nothing to answer to.
                    _ => return ReadHead::Closed,
                },
                _ = stopped.as_mut(), if self.rbuf.is_empty() => return ReadHead::Closed,
                () = self.idle.until(deadline) => return ReadHead::Closed,
            }
        }
    }

    async fn handle(&mut self, mut head: RequestHead) -> Step {
        let started = Instant::now();
        let bytes = self.rbuf.split_to(head.len).freeze();
        let Ok(raw_uri) = Uri::from_maybe_shared(bytes.slice(head.target.clone())) else {
            return self.general(bytes);
        };
        let normalized = normalize_path(&raw_uri);
        let uri = normalized.as_ref().unwrap_or(&raw_uri);
        let rt = self.proxy.snapshot.load_full();
        // `parse_request` checked it is a host (ASCII, no space or control byte).
        let host = head.host.clone().map(|r| &bytes[r]);
        let found = rt.table.find(&head.method, host, uri.path());
        if let Some(i) = found
            && !rt.routes[i]
                .upstreams
                .iter()
                .all(|u| u.scheme == Scheme::HTTP)
        {
            return self.general(bytes);
        }
        let rid = match head.request_id.clone() {
            Some(r) if request_id::sane(&bytes[r.clone()]) => RequestId::Client(r),
            _ => RequestId::Ours(request_id::generate_hex()),
        };
        // A bad path is refused before routing, as the general path does: 400 whether or not a
        // route matches. No route: 404.
        let idx = match (path_problem(uri.path()), found) {
            (None, Some(idx)) => idx,
            (problem, _) => {
                let resp = match problem {
                    Some(why) => response::bad_request(why),
                    None => response::not_found(),
                };
                let status = resp.status().as_u16();
                let step = self
                    .answer(resp, &mut head, &bytes, &rid, &rt.unmatched)
                    .await;
                tracing::debug!(request_id = %rid.log(&bytes), method = %head.method, status, "not routed");
                rt.unmatched.request_duration.observe(self.ended(started));
                return step;
            }
        };
        let route = &rt.routes[idx];
        let step = self
            .route(&rt, route, &mut head, &bytes, uri, &rid, started)
            .await;
        route.metrics.request_duration.observe(self.ended(started));
        step
    }

    /// Marks the end of an exchange that began at `started`; returns its duration. The clock
    /// read serves the duration metric and the next head's timeout both.
    fn ended(&mut self, started: Instant) -> Duration {
        let now = tokio::time::Instant::now();
        self.idle_from = now;
        now.into_std().saturating_duration_since(started)
    }

    /// Gives up on this request: the general path reads it from its head.
    fn general(&mut self, head: Bytes) -> Step {
        let mut all = BytesMut::with_capacity(head.len() + self.rbuf.len());
        all.extend_from_slice(&head);
        all.extend_from_slice(&self.rbuf);
        self.rbuf.clear();
        Step::General(all.freeze())
    }

    #[allow(clippy::too_many_arguments)]
    async fn route(
        &mut self,
        rt: &ConfigSnapshot,
        route: &Route,
        head: &mut RequestHead,
        bytes: &Bytes,
        uri: &Uri,
        rid: &RequestId,
        started: Instant,
    ) -> Step {
        let peer_ip = self.peer.ip();
        let trusted = !rt.trusted_proxies.is_empty()
            && rt
                .trusted_proxies
                .iter()
                .any(|n| n.contains(&peer_ip.to_canonical()));
        // The key reads fields only through `header:` parts, or forwarding fields from a
        // trusted peer: otherwise no map is built.
        let map = if !route.limits.is_empty() && (trusted || route.limits.reads_headers) {
            header_map(bytes, &self.fields)
        } else {
            HeaderMap::new()
        };
        let client = client_ip(peer_ip, &map, &rt.trusted_proxies);
        let parts = RequestParts {
            method: &head.method,
            uri,
            headers: &map,
            client_ip: client,
            client_ip_text: (client == peer_ip).then_some(self.peer_text.as_bytes()),
            route: &route.name,
        };
        let request_id = rid.log(bytes);
        let admitted = match self.proxy.admit(rt, route, &parts, request_id).await {
            Admission::Answer(resp) => {
                return self.answer(resp, head, bytes, rid, &route.metrics).await;
            }
            Admission::Reject { limit, rejection } => {
                let (mut fields, mut body) = std::mem::take(&mut self.scratch);
                fields.clear();
                body.clear();
                let l = &route.limits.limits[limit];
                response::write_too_many_requests(
                    &mut fields,
                    &mut body,
                    &route.name,
                    l,
                    &rejection,
                );
                let step = self
                    .answer_raw(
                        StatusCode::TOO_MANY_REQUESTS,
                        &fields,
                        &body,
                        head,
                        bytes,
                        rid,
                        &route.metrics,
                    )
                    .await;
                self.scratch = (fields, body);
                return step;
            }
            Admission::Forward(a) => a,
        };
        if !admitted.delay.is_zero() {
            // A client that leaves before its slot: the slot stays consumed, the abandonment
            // is counted (the guard), nothing is forwarded.
            let guard = AbandonGuard(admitted.delayed_by.map(|i| &route.limits.limits[i]));
            if !self.wait(admitted.delay).await {
                return Step::Close { linger: false };
            }
            std::mem::forget(guard);
        }
        drop(admitted.waiter);
        let info = admitted.info.filter(|_| route.headers);
        let (status, step) = self
            .forward(route, head, bytes, uri, rid, trusted, info)
            .await;
        tracing::debug!(%request_id, route = %route.name, method = %head.method, status, head_after = ?started.elapsed(), "request");
        step
    }

    /// Sleeps `delay` while watching the client: false when it went away meanwhile.
    async fn wait(&mut self, delay: Duration) -> bool {
        let sleep = tokio::time::sleep(delay);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => return true,
                r = read_more(&mut self.client, &mut self.rbuf), if self.rbuf.len() < WAIT_READ_MAX => {
                    if !matches!(r, Ok(n) if n > 0) {
                        return false;
                    }
                }
            }
        }
    }

    /// Forwards an admitted request; returns the status sent and what becomes of the connection.
    #[allow(clippy::too_many_arguments)]
    async fn forward(
        &mut self,
        route: &Route,
        head: &mut RequestHead,
        bytes: &Bytes,
        uri: &Uri,
        rid: &RequestId,
        trusted: bool,
        info: Option<HeaderInfo>,
    ) -> (u16, Step) {
        let t0 = Instant::now();
        let mut pump = Pump::default();
        let order = route.upstream_order();
        let deadline = tokio::time::Instant::from_std(t0) + route.timeout;
        // Set by the first try (a route has at least one upstream), replaced by each next one.
        let mut result = Ok(Err(Failure::Connect(io::ErrorKind::NotFound.into())));
        let mut pool = self.proxy.client.raw_pool(order[0]);
        for (i, upstream) in order.iter().enumerate() {
            pool = self.proxy.client.raw_pool(upstream);
            self.write_upstream_head(route, upstream, head, bytes, uri, rid, trusted);
            result = self
                .route_timer
                .within(
                    deadline,
                    exchange(
                        pool,
                        &self.out,
                        &head.method,
                        &mut head.framing,
                        &mut pump,
                        &mut self.client,
                        &mut self.rbuf,
                        &mut self.ubuf,
                        &mut self.ufields,
                        t0,
                    ),
                )
                .await;
            match &result {
                Ok(Err(Failure::Connect(e))) => {
                    upstream.mark_down();
                    if i + 1 < order.len() {
                        tracing::warn!(route = %route.name, upstream = %upstream.authority, error = %e, "upstream refused the connection: trying the next");
                    }
                }
                _ => break,
            }
        }
        route.metrics.upstream_duration.observe(t0.elapsed());
        // Anything but a response head is answered by tollgate itself (or, the client gone,
        // not at all).
        let exchanged = match result {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(Failure::Client)) => return (0, Step::Close { linger: false }),
            Ok(Err(Failure::BadBody)) => {
                Err((400, response::bad_request("malformed chunked request body")))
            }
            // As the general path (hyper) answers it; the upstream connection, holding half a
            // request, is dropped.
            Ok(Err(Failure::CutShort)) => {
                Err((400, response::bad_request("request body cut short")))
            }
            Ok(Err(Failure::Upstream(e) | Failure::Connect(e))) => {
                tracing::warn!(route = %route.name, error = %e, "upstream request failed");
                Err((502, response::bad_gateway(&route.name)))
            }
            Err(_) => {
                tracing::warn!(route = %route.name, timeout = ?route.timeout, "upstream timed out");
                Err((504, response::gateway_timeout(&route.name)))
            }
        };
        let (mut up, resp) = match exchanged {
            Ok(r) => r,
            Err((status, resp)) => {
                return (
                    status,
                    self.answer(resp, head, bytes, rid, &route.metrics).await,
                );
            }
        };
        // The request body still coming when the response starts: the client connection closes
        // after this exchange (whatever of the body the upstream does not take is read off).
        let body_sent = head.framing.is_done() && pump.pending.is_empty();
        let close = head.connection.close || !body_sent || *self.stop.borrow();
        let mut framing = resp.framing.clone();
        let rechunk = framing == Framing::UntilClose;
        // The body bytes that came with the head go out with it, in one write.
        let Ok(n) = framing.advance(&self.ubuf[resp.len..]) else {
            tracing::warn!(route = %route.name, "upstream sent a malformed body");
            let resp = response::bad_gateway(&route.name);
            return (
                502,
                self.answer(resp, head, bytes, rid, &route.metrics).await,
            );
        };
        route.metrics.request(resp.status);
        self.write_client_head(route, &resp, bytes, rid, info.as_ref(), close);
        self.ubuf.advance(resp.len);
        push_body(&mut self.out, &self.ubuf[..n], rechunk);
        self.ubuf.advance(n);
        // The route's timeout bounds the whole exchange: a body still coming at the deadline
        // is cut (see `proxy::deadline`, which does the same on the general path). Two `within`
        // arms rather than one over an async block or a `future::Either` of the two relays:
        // either way cost 57-80 more instructions per proxied request (`bench/instructions.sh`).
        let relayed = if body_sent {
            self.route_timer
                .within(
                    deadline,
                    relay(
                        &mut self.client,
                        &mut up,
                        &mut self.ubuf,
                        &mut self.out,
                        &mut framing,
                        rechunk,
                    ),
                )
                .await
        } else {
            self.route_timer
                .within(
                    deadline,
                    relay_duplex(
                        &mut self.client,
                        &mut self.rbuf,
                        &mut head.framing,
                        &mut pump,
                        &mut up,
                        &mut self.ubuf,
                        &mut self.out,
                        &mut framing,
                        rechunk,
                    ),
                )
                .await
        };
        let relayed = relayed.unwrap_or_else(|_| {
            tracing::warn!(route = %route.name, "upstream timed out in the response body: cut");
            Err(())
        });
        if relayed.is_err() {
            // Cut short on either side: the client must see the body end badly, not complete.
            return (resp.status, Step::Close { linger: false });
        }
        let request_done = head.framing.is_done() && pump.pending.is_empty() && !pump.broken;
        if request_done && !resp.closes && !rechunk && self.ubuf.is_empty() {
            pool.checkin(up, Instant::now());
        }
        self.ubuf.clear();
        if self.ubuf.capacity() > WAIT_READ_MAX {
            // One answer with a long head (up to ~400 KiB) does not stay with a kept-alive
            // client connection.
            self.ubuf = BytesMut::new();
        }
        if self.out.capacity() > WAIT_READ_MAX {
            self.out = Vec::new();
        }
        let step = if close {
            // A body that was still coming at the head may have been followed by more bytes.
            Step::Close {
                linger: !body_sent || !head.framing.is_done(),
            }
        } else {
            Step::Keep
        };
        (resp.status, step)
    }

    #[allow(clippy::too_many_arguments)]
    fn write_upstream_head(
        &mut self,
        route: &Route,
        upstream: &crate::snapshot::Upstream,
        head: &RequestHead,
        bytes: &Bytes,
        uri: &Uri,
        rid: &RequestId,
        trusted: bool,
    ) {
        let out = &mut self.out;
        out.clear();
        out.extend_from_slice(head.method.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(upstream.base_path.as_bytes());
        out.extend_from_slice(uri.path_and_query().map_or("/", |p| p.as_str()).as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        // Fields the client's `Connection` names are hop-by-hop, except those that frame the
        // message or that tollgate sets itself: dropping `Content-Length` would let the body be
        // read upstream as a request of its own.
        let named = !head.connection.named.is_empty();
        let dropped = |name: &[u8]| named && head.connection.names(bytes, name);
        let xff_kept = !dropped(b"x-forwarded-for");
        let xfp_kept = trusted && head.x_forwarded_proto && !dropped(b"x-forwarded-proto");
        let xfh_kept = trusted && head.x_forwarded_host && !dropped(b"x-forwarded-host");
        let mut xff: smallvec::SmallVec<[Range; 2]> = smallvec::SmallVec::new();
        for f in &self.fields {
            let keep = match f.kind {
                Name::Host
                | Name::Connection
                | Name::TransferEncoding
                | Name::HopByHop
                | Name::Upgrade => false,
                Name::ContentLength => true,
                Name::XForwardedFor => {
                    if xff_kept {
                        xff.push(f.value.clone());
                    }
                    false
                }
                Name::XForwardedProto => xfp_kept,
                Name::XForwardedHost => xfh_kept,
                Name::RequestId => {
                    matches!(rid, RequestId::Client(_)) && !dropped(&bytes[f.name.clone()])
                }
                _ => !dropped(&bytes[f.name.clone()]),
            };
            if keep {
                head::push_field(out, &bytes[f.name.clone()], &bytes[f.value.clone()]);
            }
        }
        let client_host = head.host.clone().map(|r| &bytes[r]);
        match client_host {
            Some(h) if route.preserve_host => head::push_field(out, b"host", h),
            _ => head::push_field(out, b"host", upstream.host.as_bytes()),
        }
        // The peer appended to what came in; several lines are one list (RFC 9110 §5.3).
        let peer_text = self.peer_text.as_bytes();
        out.extend_from_slice(b"x-forwarded-for: ");
        let first = xff.first().map(|r| &bytes[r.clone()]);
        if first.is_some_and(|v| visible(v).is_some_and(|s| !s.trim().is_empty())) {
            for r in &xff {
                if let Some(v) = visible(&bytes[r.clone()]) {
                    out.extend_from_slice(v.as_bytes());
                    out.extend_from_slice(b", ");
                }
            }
        }
        out.extend_from_slice(peer_text);
        out.extend_from_slice(b"\r\n");
        if !xfp_kept {
            head::push_field(out, b"x-forwarded-proto", self.proxy.proto.as_bytes());
        }
        if !xfh_kept && let Some(h) = client_host {
            head::push_field(out, b"x-forwarded-host", h);
        }
        if let RequestId::Ours(id) = rid {
            head::push_field(out, b"x-request-id", id);
        }
        if matches!(head.framing, Framing::Chunked(_)) {
            head::push_field(out, b"transfer-encoding", b"chunked");
        }
        out.extend_from_slice(b"\r\n");
    }

    fn write_client_head(
        &mut self,
        route: &Route,
        resp: &ResponseHead,
        bytes: &Bytes,
        rid: &RequestId,
        info: Option<&HeaderInfo>,
        close: bool,
    ) {
        let out = &mut self.out;
        let up = &self.ubuf[..resp.len];
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        response::push_u64(out, u64::from(resp.status));
        out.push(b' ');
        if resp.reason.is_empty() {
            let canonical = http::StatusCode::from_u16(resp.status)
                .ok()
                .and_then(|s| s.canonical_reason())
                .unwrap_or("");
            out.extend_from_slice(canonical.as_bytes());
        } else {
            out.extend_from_slice(&up[resp.reason.clone()]);
        }
        out.extend_from_slice(b"\r\n");
        let named = !resp.connection.named.is_empty();
        let length_framed = matches!(resp.framing, Framing::Length(_));
        let mut dated = false;
        for f in &self.ufields {
            let dropped = named && resp.connection.names(up, &up[f.name.clone()]);
            let keep = match f.kind {
                Name::Connection | Name::TransferEncoding | Name::HopByHop | Name::Upgrade => false,
                Name::RequestId => false,
                // Written once below, as read (never taken as hop-by-hop: see the request side).
                Name::ContentLength => false,
                Name::RateLimit | Name::RateLimitPolicy => info.is_none() && !dropped,
                Name::Date => {
                    dated |= !dropped;
                    !dropped
                }
                _ => !dropped,
            };
            if keep {
                head::push_field(out, &up[f.name.clone()], &up[f.value.clone()]);
            }
        }
        if let (true, Some(n)) = (length_framed, resp.length) {
            out.extend_from_slice(b"content-length: ");
            response::push_u64(out, n);
            out.extend_from_slice(b"\r\n");
        }
        head::push_field(out, b"x-request-id", rid.bytes(bytes));
        if let Some(info) = info {
            let limit = &route.limits.limits[info.limit];
            head::push_field(out, b"ratelimit-policy", limit.policy.as_bytes());
            out.extend_from_slice(b"ratelimit: ");
            response::push_ratelimit(out, limit, info.remaining, info.reset_after);
            out.extend_from_slice(b"\r\n");
        }
        if !length_framed {
            head::push_field(out, b"transfer-encoding", b"chunked");
        }
        if !dated {
            push_date(out);
        }
        if close {
            head::push_field(out, b"connection", b"close");
        }
        out.extend_from_slice(b"\r\n");
    }

    /// Sends a response of tollgate's own. The part of the request's body already here is
    /// dropped, and the connection stays usable when that was all of it; a body still coming is
    /// not waited for (the answer goes at once and the connection closes, reading off what the
    /// client still sends for a moment, see [`Conn::close`]).
    async fn answer(
        &mut self,
        resp: Response<Body>,
        head: &mut RequestHead,
        bytes: &Bytes,
        rid: &RequestId,
        metrics: &RouteMetrics,
    ) -> Step {
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let (mut fields, spare) = std::mem::take(&mut self.scratch);
        fields.clear();
        for (name, value) in &parts.headers {
            head::push_field(&mut fields, name.as_str().as_bytes(), value.as_bytes());
        }
        let step = self
            .answer_raw(parts.status, &fields, &body, head, bytes, rid, metrics)
            .await;
        self.scratch = (fields, spare);
        step
    }

    /// [`Conn::answer`] with the header fields (`name: value\r\n` each) and body as bytes.
    #[allow(clippy::too_many_arguments)]
    async fn answer_raw(
        &mut self,
        status: StatusCode,
        fields: &[u8],
        body: &[u8],
        head: &mut RequestHead,
        bytes: &Bytes,
        rid: &RequestId,
        metrics: &RouteMetrics,
    ) -> Step {
        metrics.request(status.as_u16());
        let body_read = match head.framing.advance(&self.rbuf) {
            Ok(n) => {
                self.rbuf.advance(n);
                head.framing.is_done()
            }
            Err(_) => false,
        };
        let close = head.connection.close || !body_read || *self.stop.borrow();
        let out = &mut self.out;
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(fields);
        head::push_field(out, b"x-request-id", rid.bytes(bytes));
        out.extend_from_slice(b"content-length: ");
        response::push_u64(out, body.len() as u64);
        out.extend_from_slice(b"\r\n");
        push_date(out);
        if close {
            head::push_field(out, b"connection", b"close");
        }
        out.extend_from_slice(b"\r\n");
        if head.method != Method::HEAD {
            out.extend_from_slice(body);
        }
        if self.client.write_all(&self.out).await.is_err() {
            return Step::Close { linger: false };
        }
        if close {
            Step::Close { linger: !body_read }
        } else {
            Step::Keep
        }
    }

    /// Closes the connection after its last response. With `linger`, what the client may still
    /// be sending is read off for a moment first, so the close does not reset the connection
    /// before the client has read the response.
    async fn close(&mut self, linger: bool) {
        let _ = self.client.shutdown().await;
        if linger {
            let drain = async {
                let mut left = DISCARD_MAX;
                let mut buf = [0u8; 4096];
                while let Ok(n) = self.client.read(&mut buf).await {
                    if n == 0 || n >= left {
                        break;
                    }
                    left -= n;
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(2), drain).await;
        }
    }
}

/// The request body's side of an exchange: bytes counted as body (taken out of the client's
/// buffer) but not yet sent, and whether the upstream stopped taking them.
#[derive(Default)]
struct Pump {
    pending: Bytes,
    broken: bool,
}

impl Pump {
    /// Takes the next body bytes from `rbuf` when the last ones are sent; an error once the
    /// body is malformed. Once the upstream stopped taking the body, what comes is dropped (the
    /// client is still read, so it can finish sending and read its answer).
    fn feed(&mut self, rbuf: &mut BytesMut, body: &mut Framing) -> Result<(), Failure> {
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
    fn wants(&self, body: &Framing) -> bool {
        self.pending.is_empty() && !body.is_done()
    }
}

/// Writes the request to a pooled (or new) upstream connection and reads the response head,
/// sending the request body meanwhile: an upstream may answer before it has read the body, and
/// one that stops reading it can still answer (a 413, say).
///
/// A pooled connection that fails the first write took nothing: the request goes on another.
/// One that ends before any byte of a response may have been closed by the upstream just as
/// the request went out, or may have been acted on: only a safe method is sent again then.
#[allow(clippy::too_many_arguments)]
async fn exchange(
    pool: &Arc<upstream::Pool>,
    request_head: &[u8],
    method: &Method,
    body: &mut Framing,
    pump: &mut Pump,
    client: &mut TcpStream,
    rbuf: &mut BytesMut,
    ubuf: &mut BytesMut,
    ufields: &mut Vec<Field>,
    now: Instant,
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
        let read = if body.is_done() {
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
    client: &mut TcpStream,
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

/// Copies the rest of a response body (its framing says when it ends) to the client, after
/// what `out` holds (the head and the body bytes that came with it).
async fn relay(
    client: &mut TcpStream,
    up: &mut TcpStream,
    ubuf: &mut BytesMut,
    out: &mut Vec<u8>,
    framing: &mut Framing,
    rechunk: bool,
) -> Result<(), ()> {
    client.write_all(out).await.map_err(|_| ())?;
    while !framing.is_done() {
        ubuf.clear();
        match read_more(up, ubuf).await {
            Ok(0) if rechunk => {
                return client.write_all(b"0\r\n\r\n").await.map_err(|_| ());
            }
            Ok(n) if n > 0 => {}
            _ => return Err(()),
        }
        let n = framing.advance(ubuf).map_err(|_| ())?;
        let sent = if rechunk {
            out.clear();
            push_body(out, &ubuf[..n], true);
            client.write_all(out).await
        } else {
            client.write_all(&ubuf[..n]).await
        };
        sent.map_err(|_| ())?;
        ubuf.advance(n);
    }
    Ok(())
}

/// [`relay`] while the request body is still being sent: both directions at once, as an
/// upstream that streams its answer while reading the body needs. Each step is one read or one
/// write; a request body the upstream no longer takes is read and dropped (the connection
/// closes after).
#[allow(clippy::too_many_arguments)]
async fn relay_duplex(
    client: &mut TcpStream,
    rbuf: &mut BytesMut,
    body: &mut Framing,
    pump: &mut Pump,
    up: &mut TcpStream,
    ubuf: &mut BytesMut,
    out: &mut Vec<u8>,
    framing: &mut Framing,
    rechunk: bool,
) -> Result<(), ()> {
    let (mut cr, mut cw) = client.split();
    let (mut ur, mut uw) = up.split();
    let mut written = 0;
    let mut done = framing.is_done();
    loop {
        if written == out.len() {
            out.clear();
            written = 0;
            if done {
                return Ok(());
            }
        }
        pump.feed(rbuf, body).map_err(|_| ())?;
        let sending = !pump.broken && !pump.pending.is_empty();
        let wants = pump.wants(body) && rbuf.len() < WAIT_READ_MAX;
        let flushing = written < out.len();
        tokio::select! {
            r = uw.write(&pump.pending), if sending => match r {
                Ok(n) if n > 0 => pump.pending.advance(n),
                _ => pump.broken = true,
            },
            r = read_more(&mut cr, rbuf), if wants => match r {
                Ok(n) if n > 0 => {}
                _ => return Err(()),
            },
            r = cw.write(&out[written..]), if flushing => match r {
                Ok(n) if n > 0 => written += n,
                _ => return Err(()),
            },
            r = read_more(&mut ur, ubuf), if !flushing && !done => {
                match r {
                    Ok(0) if rechunk => {
                        out.extend_from_slice(b"0\r\n\r\n");
                        done = true;
                        continue;
                    }
                    Ok(n) if n > 0 => {}
                    _ => return Err(()),
                }
                let n = framing.advance(ubuf).map_err(|_| ())?;
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

#[derive(Debug)]
enum ReadError {
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
async fn read_response<R: AsyncRead + Unpin>(
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

async fn read_more<R: AsyncRead + Unpin>(r: &mut R, buf: &mut BytesMut) -> io::Result<usize> {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(READ_CHUNK);
    }
    r.read_buf(buf).await
}

/// Appends body bytes; `chunk`: wrapped as one chunk (an upstream body that ends at close,
/// sent chunked so the client connection can stay open).
fn push_body(out: &mut Vec<u8>, data: &[u8], chunk: bool) {
    if data.is_empty() {
        return;
    }
    if chunk {
        out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    } else {
        out.extend_from_slice(data);
    }
}

/// `date: ...`, formatted once a second.
fn push_date(out: &mut Vec<u8>) {
    use std::cell::RefCell;
    use std::time::SystemTime;
    thread_local! {
        static DATE: RefCell<(u64, [u8; 29])> = const { RefCell::new((u64::MAX, [0; 29])) };
    }
    let secs = coarse_unix_secs();
    DATE.with(|d| {
        let mut d = d.borrow_mut();
        if d.0 != secs {
            let text = httpdate::fmt_http_date(SystemTime::now());
            if text.len() == 29 {
                d.1.copy_from_slice(text.as_bytes());
                d.0 = secs;
            }
        }
        head::push_field(out, b"date", &d.1);
    });
}

/// Seconds since the epoch from the kernel's coarse clock (updated each tick, read without a
/// timer read): plenty for a `Date` that changes once a second, and cheaper than
/// `SystemTime::now` on every response.
fn coarse_unix_secs() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec for the call's duration.
        if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } == 0 {
            return ts.tv_sec as u64;
        }
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The field's text when it is visible ASCII (what `HeaderValue::to_str` accepts).
fn visible(v: &[u8]) -> Option<&str> {
    v.iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
        .then(|| std::str::from_utf8(v).ok())
        .flatten()
}

/// The request's fields as a map, for keys that read them.
fn header_map(bytes: &Bytes, fields: &[Field]) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(fields.len());
    for f in fields {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(&bytes[f.name.clone()]),
            HeaderValue::from_maybe_shared(bytes.slice(f.value.clone())),
        ) {
            map.append(n, v);
        }
    }
    map
}

/// A connection handed to the general path: the bytes already read come first.
struct Rewind {
    prefix: Bytes,
    inner: TcpStream,
}

impl AsyncRead for Rewind {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
