//! The per-request service: route → limits → forward, and the answer when any step says no.
//!
//! [`Proxy::handle`] reads one [`ConfigSnapshot`] snapshot for the whole request. Limits are decided
//! before a byte of the body is read; an admitted request's body streams to the upstream and the
//! upstream's body streams back, neither buffered. Errors map to responses in one place each
//! (see [`response`]).

pub mod deadline;
pub mod forward;
pub mod h1;
pub mod headers;
pub mod request_id;
pub mod response;
pub mod tunnels;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;

use crate::key::{RequestParts, client_ip};
use crate::limit::clock::SharedClock;
use crate::limit::{Context, HeaderInfo, Verdict};
use crate::metrics::{Histogram, Metrics};
use crate::routing::{normalize_path, path_problem};
use crate::snapshot::{ConfigSnapshot, Route};

/// The one body type for everything the proxy sends: upstream bodies and its own.
pub type Body = BoxBody<Bytes, hyper::Error>;

/// Everything a request needs, shared by all connections.
pub struct Proxy {
    pub snapshot: ArcSwap<ConfigSnapshot>,
    pub metrics: Arc<Metrics>,
    pub clock: SharedClock,
    pub client: forward::Client,
    /// `X-Forwarded-Proto` for requests on this listener.
    pub proto: &'static str,
    /// Upgraded connections still open, which the drain waits for.
    pub tunnels: Arc<tunnels::Tunnels>,
}

impl Proxy {
    pub async fn serve(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Result<Response<deadline::Served>, Infallible> {
        let mut resp = self.handle(req, peer).await;
        let at = resp.extensions_mut().remove::<deadline::BodyDeadline>();
        Ok(resp.map(|body| deadline::Served::new(body, at)))
    }

    pub async fn handle(&self, mut req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let id = request_id::ensure(req.headers_mut());
        let head = req.method() == http::Method::HEAD;
        let mut resp = self.dispatch(req, peer, &id).await;
        resp.headers_mut().insert(&request_id::X_REQUEST_ID, id);
        if head && !http_body::Body::is_end_stream(resp.body()) {
            // tollgate's own answers (404, 429, 502…) come with a body. HTTP/1.1 leaves it
            // unsent after a HEAD by itself; HTTP/2 would send it as DATA frames, which the
            // client must treat as a protocol error. The head, Content-Length included, stays.
            if let Some(n) = http_body::Body::size_hint(resp.body()).exact()
                && !resp.headers().contains_key(http::header::CONTENT_LENGTH)
            {
                resp.headers_mut()
                    .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(n));
            }
            resp = resp.map(|_| response::full(Bytes::new()));
        }
        resp
    }

    async fn dispatch(
        &self,
        mut req: Request<Incoming>,
        peer: SocketAddr,
        id: &http::HeaderValue,
    ) -> Response<Body> {
        let started = Instant::now();
        if let Some(uri) = normalize_path(req.uri()) {
            *req.uri_mut() = uri;
        }
        let rt = self.snapshot.load_full();
        let refused = if req.method() == http::Method::CONNECT {
            Some(response::connect_not_allowed())
        } else if !headers::only_chunked(req.headers()) {
            Some(response::coding_not_implemented())
        } else if req.uri().scheme().is_none() && req.uri().authority().is_some() {
            // `GET host:port HTTP/1.1`: the authority form is CONNECT's alone (RFC 9112 §3.2.3);
            // nginx answers 400 too, where routing would have answered 404.
            Some(response::bad_request(
                "the request target must start with / (or be an absolute URI)",
            ))
        } else {
            // A path no upstream should be sent (dot segments, bad escapes, NUL) is refused
            // before routing, whether or not a route would match it: 400, never a 404.
            path_problem(req.uri().path()).map(response::bad_request)
        };
        if let Some(resp) = refused {
            rt.unmatched.request(resp.status().as_u16());
            return timed(resp, started, &rt.unmatched.request_duration);
        }
        let host = match headers::request_host(req.version(), req.uri(), req.headers()) {
            Ok(host) => host,
            Err(why) => {
                let resp = response::bad_request(why);
                rt.unmatched.request(resp.status().as_u16());
                return timed(resp, started, &rt.unmatched.request_duration);
            }
        };
        let Some(idx) = rt
            .table
            .find(req.method(), host.map(str::as_bytes), req.uri().path())
        else {
            let resp = response::not_found();
            rt.unmatched.request(resp.status().as_u16());
            tracing::debug!(request_id = %request_id::LogId(id.as_bytes()), method = %req.method(), status = 404, "no route");
            return timed(resp, started, &rt.unmatched.request_duration);
        };
        let route = &rt.routes[idx];
        let method = req.method().clone();
        let resp = self.handle_route(&rt, route, req, peer, id).await;
        let status = resp.status().as_u16();
        route.metrics.request(status);
        tracing::debug!(request_id = %request_id::LogId(id.as_bytes()), route = %route.name, %method, status, head_after = ?started.elapsed(), "request");
        timed(resp, started, &route.metrics.request_duration)
    }

    async fn handle_route(
        &self,
        rt: &ConfigSnapshot,
        route: &Route,
        req: Request<Incoming>,
        peer: SocketAddr,
        id: &http::HeaderValue,
    ) -> Response<Body> {
        let client = client_ip(peer.ip(), req.headers(), &rt.trusted_proxies);
        let parts = RequestParts {
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
            client_ip: client,
            client_ip_text: None,
            route: &route.name,
        };
        let info = match self
            .admit(rt, route, &parts, request_id::LogId(id.as_bytes()))
            .await
        {
            Admission::Answer(resp) => return resp,
            Admission::Reject { limit, rejection } => {
                let l = &route.limits.limits[limit];
                return response::too_many_requests(&route.name, l, &rejection);
            }
            Admission::Forward(admitted) => {
                let Admitted {
                    info,
                    delay,
                    delayed_by,
                    waiter,
                } = admitted;
                if !delay.is_zero() {
                    // Dropped (client gone) before the slot comes: the reserved slot stays
                    // consumed, and the abandonment is counted.
                    let guard = AbandonGuard(delayed_by.map(|i| &route.limits.limits[i]));
                    tokio::time::sleep(delay).await;
                    std::mem::forget(guard);
                }
                drop(waiter);
                info
            }
        };
        let mut resp = forward::forward(self, route, req, peer, rt).await;
        if let (true, Some(info)) = (route.headers, info) {
            response::set_ratelimit(resp.headers_mut(), &route.limits.limits[info.limit], &info);
        }
        resp
    }
}

impl Proxy {
    /// The limits' answer for a routed request: an answer of tollgate's own (429, 503, the
    /// `on_missing: reject` 429), or leave to forward after an optional wait. Shared by both
    /// HTTP paths; the wait is the caller's, so each can notice a client leaving in its own way.
    pub(crate) async fn admit<'r>(
        &self,
        rt: &ConfigSnapshot,
        route: &'r Route,
        parts: &RequestParts<'_>,
        request_id: request_id::LogId<'_>,
    ) -> Admission<'r> {
        let limits = &route.limits;
        if limits.is_empty() {
            return Admission::Forward(Admitted {
                info: None,
                delay: std::time::Duration::ZERO,
                delayed_by: None,
                waiter: None,
            });
        }
        // A slot in the route's waiter cap is taken before deciding, so a request that would
        // have to wait past the cap is rejected without reserving anything.
        let mut waiter = None;
        let allow_delay = limits.can_delay && {
            waiter = WaiterSlot::acquire(route);
            waiter.is_some()
        };
        let started = std::time::Instant::now();
        let cx = Context {
            now: self.clock.at(started),
            started,
            clock: &*self.clock,
            probe_wait: rt
                .config
                .redis
                .as_ref()
                .map_or(std::time::Duration::ZERO, |r| r.timeout),
            redis: rt.redis.as_ref(),
            on_error: rt.on_error,
            allow_delay,
            metrics: &self.metrics,
        };
        match limits.evaluate(parts, &cx).await {
            Verdict::Reject { limit, rejection } => {
                let l = &limits.limits[limit];
                if rt.config.server.log_keys {
                    let mut key = crate::key::KeyBuf::new();
                    l.key.build(parts, &mut key);
                    let key = String::from_utf8_lossy(&key);
                    tracing::info!(%request_id, route = %route.name, limit = %l.name, status = 429, %key, "rate limited");
                } else {
                    tracing::info!(%request_id, route = %route.name, limit = %l.name, status = 429, "rate limited");
                }
                Admission::Reject { limit, rejection }
            }
            Verdict::Unavailable { limit } => Admission::Answer(response::unavailable(
                &route.name,
                &limits.limits[limit].name,
            )),
            Verdict::MissingKey { limit, part } => Admission::Answer(response::missing_key(
                &route.name,
                &limits.limits[limit].name,
                &part,
            )),
            Verdict::AmbiguousKey { limit, part } => Admission::Answer(response::ambiguous_key(
                &route.name,
                &limits.limits[limit].name,
                &part,
            )),
            Verdict::Admit {
                delay,
                delayed_by,
                info,
            } => Admission::Forward(Admitted {
                info,
                delay,
                delayed_by,
                waiter,
            }),
        }
    }
}

pub(crate) enum Admission<'r> {
    /// `429` from this limit (by index): each path writes it its own way.
    Reject {
        limit: usize,
        rejection: crate::limit::algorithm::Rejection,
    },
    Answer(Response<Body>),
    Forward(Admitted<'r>),
}

/// An admitted request: forward it after `delay` (its reserved slot), holding `waiter` until
/// then; `info` is the limit whose `RateLimit` fields the response carries.
pub(crate) struct Admitted<'r> {
    pub info: Option<HeaderInfo>,
    pub delay: std::time::Duration,
    pub delayed_by: Option<usize>,
    pub waiter: Option<WaiterSlot<'r>>,
}

/// `tollgate_request_duration_seconds` covers the whole request: until the response body has
/// been sent (or the client went away), not just until its head. A body that is already over
/// is observed at once; any other is wrapped to observe at its end.
fn timed(resp: Response<Body>, started: Instant, hist: &Histogram) -> Response<Body> {
    if http_body::Body::is_end_stream(resp.body()) {
        hist.observe(started.elapsed());
        return resp;
    }
    resp.map(|body| {
        http_body_util::BodyExt::boxed(Timed {
            body,
            started,
            hist: Some(hist.clone()),
        })
    })
}

struct Timed {
    body: Body,
    started: Instant,
    /// Taken when observed, so a request is observed once.
    hist: Option<Histogram>,
}

impl Timed {
    fn observe(&mut self) {
        if let Some(h) = self.hist.take() {
            h.observe(self.started.elapsed());
        }
    }
}

impl http_body::Body for Timed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        let polled = std::pin::Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(None) | std::task::Poll::Ready(Some(Err(_))) => self.observe(),
            std::task::Poll::Ready(Some(Ok(_))) if self.body.is_end_stream() => self.observe(),
            _ => {}
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

impl Drop for Timed {
    fn drop(&mut self) {
        self.observe();
    }
}

/// A place in a route's cap of waiting requests, released on drop.
pub(crate) struct WaiterSlot<'a>(&'a Route);

impl<'a> WaiterSlot<'a> {
    fn acquire(route: &'a Route) -> Option<Self> {
        let prev = route.waiters.fetch_add(1, Ordering::AcqRel);
        if prev >= route.max_waiters {
            route.waiters.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self(route))
    }
}

impl Drop for WaiterSlot<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

pub(crate) struct AbandonGuard<'a>(pub Option<&'a crate::limit::Limit>);

impl Drop for AbandonGuard<'_> {
    fn drop(&mut self) {
        if let Some(l) = self.0 {
            l.metrics.abandoned.inc();
        }
    }
}
