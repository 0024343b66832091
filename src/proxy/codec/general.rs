//! The hyper codec: HTTP/2 (h2c by prior knowledge, and TLS by ALPN), TLS HTTP/1.1, upgrades,
//! and whatever the fast codec hands over. hyper parses and writes; the phases are
//! [`crate::proxy::pipeline`]'s, as for the fast codec.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;

use crate::key::{RequestParts, client_ip};
use crate::proxy::deadline::{BodyDeadline, Served};
use crate::proxy::error::ProxyError;
use crate::proxy::exchange::ExchangeEnd;
use crate::proxy::pipeline::{self, Refusable};
use crate::proxy::{AbandonGuard, Admitted, Body, Gateway, forward, headers, request_id, response};
use crate::routing::normalize_path;

/// The largest request head served; a larger one gets 431 (HTTP/1.1) or a stream reset
/// (HTTP/2). Envoy's default is 60 KiB, nginx's 32 KiB in four 8 KiB lines; hyper's own were
/// about 400 KB for HTTP/1.1 and 16 KiB for HTTP/2. One figure for both protocols, so a
/// client's headers pass or fail alike whichever it speaks.
pub(crate) const MAX_REQUEST_HEAD: usize = 64 * 1024;

pub(crate) fn builder() -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .keep_alive(true)
        // A client may shut its write side once the request is sent (`nc -N`, some HTTP/1.0
        // tools) and still wait for the answer; nginx and the fast path answer it. hyper's
        // default dropped such a connection, request and all, at the EOF.
        .half_close(true)
        .max_buf_size(MAX_REQUEST_HEAD);
    b.http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_REQUEST_HEAD as u32);
    b
}

/// One connection on any transport: HTTP/1.1 (with upgrades) or HTTP/2, detected from the first
/// bytes (for TLS, ALPN has made the client send what it agreed to).
pub(crate) fn serve_one<I>(
    builder: &auto::Builder<TokioExecutor>,
    io: I,
    gateway: Arc<Gateway>,
    peer: SocketAddr,
) -> impl hyper_util::server::graceful::GracefulConnection<
    Output = Result<(), Box<dyn std::error::Error + Send + Sync>>,
> + Send
+ 'static
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    // Boxed: hyper spawns a task per HTTP/2 stream holding this future, and moving the whole
    // exchange's state into the task (twice, by value) was a tenth of a stream's instructions.
    let svc = service_fn(move |req| Box::pin(serve(gateway.clone(), req, peer)));
    builder.serve_connection_with_upgrades(io, svc).into_owned()
}

/// A general-path connection that ended with an error. One hyper ended on a request it could
/// not parse, after answering it itself (400; 431 for a head too large), is counted under
/// `_unmatched` as tollgate's own unroutable answers are, so `tollgate_requests_total` holds
/// every answer given.
pub(crate) fn ended_with(
    gateway: &Gateway,
    peer: SocketAddr,
    e: &(dyn std::error::Error + Send + Sync + 'static),
) {
    if let Some(h) = e.downcast_ref::<hyper::Error>()
        && h.is_parse()
    {
        let status = if h.is_parse_too_large() { 431 } else { 400 };
        gateway.snapshot.load().unmatched.request(status);
    }
    tracing::debug!(error = %e, %peer, "connection ended with an error");
}

/// hyper's service function: one request, one answer.
pub(crate) async fn serve(
    gateway: Arc<Gateway>,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Result<Response<Sent>, Infallible> {
    let h2 = req.version() == http::Version::HTTP_2;
    let mut resp = handle(&gateway, req, peer).await;
    let at = resp.extensions_mut().remove::<BodyDeadline>();
    let request_id = resp.headers().get(&request_id::X_REQUEST_ID).cloned();
    Ok(resp.map(|body| Sent {
        body: Served::new(body, at),
        panicked: false,
        gateway,
        peer,
        request_id,
        h2,
    }))
}

/// The response body hyper sends, with a panic while producing it caught (`crate::panics`):
/// the head has gone out, so the body ends in an error, which hyper turns into a closed
/// connection (HTTP/1.1) or a reset of this stream alone (HTTP/2), never a body that looks
/// complete. On HTTP/2 this is the only place such a panic could be caught: hyper polls each
/// stream's service and body in a task of its own.
pub(crate) struct Sent {
    body: Served,
    panicked: bool,
    gateway: Arc<Gateway>,
    peer: SocketAddr,
    request_id: Option<HeaderValue>,
    h2: bool,
}

impl http_body::Body for Sent {
    type Data = Bytes;
    type Error = crate::proxy::deadline::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if !this.panicked {
            let body = &mut this.body;
            let polled = crate::panics::catch_now(|| {
                let polled = std::pin::Pin::new(body).poll_frame(cx);
                #[cfg(feature = "panic-injection")]
                if let std::task::Poll::Ready(Some(Ok(f))) = &polled
                    && let Some(data) = f.data_ref()
                {
                    crate::panics::inject::body(data);
                }
                polled
            });
            match polled {
                Ok(p) => return p,
                Err(p) => {
                    this.panicked = true;
                    let then = if this.h2 {
                        "response cut: stream reset"
                    } else {
                        "response cut: connection closed"
                    };
                    let id = this.request_id.as_ref().map_or(&b"-"[..], |v| v.as_bytes());
                    let metrics = &this.gateway.metrics;
                    crate::proxy::request_panicked(
                        metrics,
                        this.peer,
                        None,
                        request_id::LogId(id),
                        then,
                        &p,
                    );
                }
            }
        }
        std::task::Poll::Ready(Some(Err("a panic cut the response body".into())))
    }

    fn is_end_stream(&self) -> bool {
        !self.panicked && self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

async fn handle(gateway: &Gateway, mut req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
    let started = Instant::now();
    let mut end = ExchangeEnd::begin(gateway.snapshot.load_full(), started);
    let id = request_id::ensure(req.headers_mut());
    let head = req.method() == http::Method::HEAD;
    let method = req.method().clone();
    let h2 = req.version() == http::Version::HTTP_2;
    let caught = {
        let phases = std::pin::pin!(exchange(gateway, &mut end, req, peer, &id));
        crate::panics::catch_pinned(phases).await
    };
    let exchanged = match caught {
        Ok(r) => r,
        Err(p) => {
            let then = if h2 {
                "answered 500 on its stream"
            } else {
                "answered 500, connection closed"
            };
            let id = request_id::LogId(id.as_bytes());
            crate::proxy::request_panicked(&gateway.metrics, peer, end.route(), id, then, &p);
            Err(ProxyError::Panicked)
        }
    };
    let mut resp = match exchanged {
        Ok(resp) => resp,
        Err(e) => {
            let mut resp = response::answer(&e, end.route())
                // hyper drops a request's future when its client goes: nobody to answer.
                .unwrap_or_else(|| Response::new(response::full(Bytes::new())));
            resp.headers_mut()
                .insert(&request_id::X_REQUEST_ID, id.clone());
            if h2 {
                // The stream is what ends on HTTP/2; `Connection` is not an HTTP/2 field.
                resp.headers_mut().remove(http::header::CONNECTION);
            }
            resp
        }
    };
    if h2 {
        headers::never_index_varying(resp.headers_mut());
    }
    let status = resp.status().as_u16();
    end.answered(status);
    end.response_head(status, resp.headers());
    let route = end.route().map(|r| r.name.clone());
    tracing::debug!(request_id = %request_id::LogId(id.as_bytes()), route = route.as_deref().unwrap_or("-"), %method, status, head_after = ?started.elapsed(), "request");
    if head && !http_body::Body::is_end_stream(resp.body()) {
        // tollgate's own answers (404, 429, 502…) come with a body. HTTP/1.1 leaves it
        // unsent after a HEAD by itself; HTTP/2 would send it as DATA frames, which the
        // client must treat as a protocol error. The head, Content-Length included, stays.
        if let Some(n) = http_body::Body::size_hint(resp.body()).exact()
            && !resp.headers().contains_key(http::header::CONTENT_LENGTH)
        {
            resp.headers_mut()
                .insert(http::header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        resp = resp.map(|_| response::full(Bytes::new()));
    }
    guarded(resp, end)
}

/// The phases for one request; any that fails says why.
async fn exchange(
    gateway: &Gateway,
    end: &mut ExchangeEnd,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    id: &HeaderValue,
) -> Result<Response<Body>, ProxyError> {
    if let Some(uri) = normalize_path(req.uri()) {
        *req.uri_mut() = uri;
    }
    pipeline::refuse(&Refusable {
        method: req.method(),
        authority_form: req.uri().scheme().is_none() && req.uri().authority().is_some(),
        only_chunked: headers::only_chunked(req.headers()),
    })?;
    let host = headers::request_host(req.version(), req.uri(), req.headers())
        .map(|h| h.map(str::as_bytes));
    let idx = pipeline::route(end.snapshot(), req.method(), host, req.uri().path())?;
    end.routed(idx);
    // Its own handle on the snapshot: the guard is written to below (the slots it holds).
    let snapshot = Arc::clone(end.snapshot());
    let rt = &*snapshot;
    let route = &rt.routes[idx];
    let client = client_ip(peer.ip(), req.headers(), &rt.trusted_proxies);
    let parts = RequestParts {
        method: req.method(),
        uri: req.uri(),
        headers: req.headers(),
        client_ip: client,
        client_ip_text: None,
        route: &route.name,
        peer_trusted: crate::key::client_ip::peer_trusted(peer.ip(), &rt.trusted_proxies),
    };
    let Admitted {
        info,
        delay,
        delayed_by,
        waiter,
        held,
    } = match gateway
        .admit(rt, route, &parts, request_id::LogId(id.as_bytes()))
        .await
    {
        Err(ProxyError::Queued(q)) => {
            // hyper drops this future when the client goes (an HTTP/2 stream reset, a closed
            // connection): a wait for a slot ends with it.
            let waited = gateway.wait_for_slot(
                rt,
                route,
                &parts,
                request_id::LogId(id.as_bytes()),
                q,
                std::future::pending(),
            );
            waited.await?
        }
        admitted => admitted?,
    };
    // Until the exchange ends: the response body sent, or dropped (see `guarded`).
    end.hold(held);
    if !delay.is_zero() {
        // Dropped (client gone) before the slot comes: the reserved slot stays consumed, and
        // the abandonment is counted.
        let guard = AbandonGuard(delayed_by.map(|i| &route.limits.limits[i]));
        tokio::time::sleep(delay).await;
        std::mem::forget(guard);
    }
    drop(waiter);
    let info = info.filter(|_| route.headers);
    forward::forward(gateway, route, req, peer, rt, id, info, end).await
}

/// The response with the exchange's end attached: at once for a body already over, else when
/// the body has been sent or dropped.
fn guarded(resp: Response<Body>, end: ExchangeEnd) -> Response<Body> {
    if http_body::Body::is_end_stream(resp.body()) {
        return resp;
    }
    resp.map(|body| {
        http_body_util::BodyExt::boxed(Guarded {
            body,
            end: Some(end),
        })
    })
}

/// A response body that ends its exchange when it is over (or dropped).
struct Guarded {
    body: Body,
    /// Taken when the body ends, so the end is not waited for until the body is dropped.
    end: Option<ExchangeEnd>,
}

impl http_body::Body for Guarded {
    type Data = Bytes;
    type Error = crate::connector::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, crate::connector::BoxError>>> {
        let polled = std::pin::Pin::new(&mut self.body).poll_frame(cx);
        let over = match &polled {
            std::task::Poll::Ready(None) | std::task::Poll::Ready(Some(Err(_))) => true,
            std::task::Poll::Ready(Some(Ok(frame))) => {
                if let (Some(trailers), Some(end)) = (frame.trailers_ref(), self.end.as_mut()) {
                    end.trailers(trailers);
                }
                self.body.is_end_stream()
            }
            std::task::Poll::Pending => false,
        };
        if over {
            self.end.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
