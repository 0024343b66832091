//! Forwarding an admitted request to the route's upstream over a pooled connection.
//!
//! The request body streams through untouched; the upstream request is rewritten only where a
//! proxy must: absolute-form URI for the client, hop-by-hop fields removed, `X-Forwarded-*` set,
//! `Host` kept or replaced per `preserve_host`. It is sent as HTTP/1.1, or as HTTP/2 to an
//! `https://` upstream that offers `h2` (see [`client`]). The route's `timeout` bounds the whole
//! exchange: no response head by then is a 504, and a body still coming then is cut (see
//! [`super::deadline`]).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use http::header::HOST;
use http::uri::{PathAndQuery, Scheme};
use http::{HeaderValue, Request, Response, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::deadline::BodyDeadline;
use super::error::ProxyError;
use super::exchange::ExchangeEnd;
use super::forwarding::{self, RequestRule, ResponseRule};
use super::headers::{self, MapEdit};
use super::pipeline::Tries;
use super::raw_upstream::{self, RawError};
use super::{Body, Gateway};
use crate::connector::http1::SendError;
use crate::limit::HeaderInfo;
use crate::snapshot::{ConfigSnapshot, Route, Upstream};

/// Phase 4 on the hyper codec: the request rewritten by the header rules, sent to the route's
/// upstreams in order, and the response head filtered back by the response rule.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn forward(
    gateway: &Gateway,
    route: &Route,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    rt: &ConfigSnapshot,
    id: &HeaderValue,
    info: Option<HeaderInfo>,
    end: &mut ExchangeEnd,
) -> Result<Response<Body>, ProxyError> {
    // The client gets its own protocol version back, whatever the upstream spoke (an HTTP/1.0
    // upstream must not turn a keep-alive HTTP/1.1 client connection into a closing one).
    let client_version = req.version();
    let upgrade = headers::is_upgrade(client_version, req.headers());
    // Taken before the request is consumed: the client side of a protocol switch.
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    // The host routing read (the target's authority first, then `Host`), by the same rule.
    let client_host = headers::request_host(client_version, &parts.uri, &parts.headers)
        .ok()
        .flatten()
        .and_then(|h| HeaderValue::from_str(h).ok());
    let keep_host = route.preserve_host && client_host.is_some();
    let mut peer_text = [0; crate::key::IP_TEXT_MAX];
    let rule = RequestRule {
        trusted: rt
            .trusted_proxies
            .iter()
            .any(|n| n.contains(&peer.ip().to_canonical())),
        proto: gateway.proto,
        peer: crate::key::ip_text(peer.ip(), &mut peer_text),
        client_host: client_host.as_ref().map(HeaderValue::as_bytes),
        // Otherwise set for each upstream tried (see `aim`).
        host: client_host
            .as_ref()
            .filter(|_| keep_host)
            .map(HeaderValue::as_bytes),
        // `request_id::ensure` put the exchange's id in the request already.
        own_request_id: None,
        upgrade,
    };
    let mut edit = MapEdit::default();
    forwarding::upstream_request(&parts.headers, &rule, &mut edit);
    edit.apply(&mut parts.headers);
    let client_uri = std::mem::take(&mut parts.uri);
    parts.version = Version::HTTP_11;
    // Only a body that is coming can fail; an empty one costs nothing to watch.
    let client_body_failed = Arc::new(AtomicU8::new(OK));
    let body = if http_body::Body::is_end_stream(&body) {
        body.map_err(Into::into).boxed()
    } else {
        ClientBody {
            inner: body,
            failed: Arc::clone(&client_body_failed),
        }
        .map_err(Into::into)
        .boxed()
    };
    let mut pending = Some(Request::from_parts(parts, body));

    let started = Instant::now();
    let deadline = tokio::time::Instant::from_std(started) + route.timeout;
    let mut tries = Tries::new(route, started);
    let mut done = None;
    while let Some(upstream) = tries.next_upstream() {
        let Some(mut req) = pending.take() else {
            break;
        };
        // Plain HTTP/1.1 without a protocol switch: the common case, on the upstream's own
        // pool. (CONNECT never gets here: it is refused before routing.)
        let plain = !upgrade && upstream.scheme == Scheme::HTTP;
        if aim(&mut req, upstream, &client_uri, plain, keep_host).is_err() {
            done = Some(Err(ProxyError::BadRequest(
                "request target cannot be forwarded",
            )));
            break;
        }
        if !plain {
            // Boxed: TLS, HTTP/2 and upgrades keep their larger state out of the common path's
            // future. The request is consumed here: no other upstream is tried after it.
            let sent = Box::pin(gateway.connector.request(req, upgrade));
            done = Some(match tokio::time::timeout_at(deadline, sent).await {
                Ok(Ok(resp)) => Ok(Exchange::Other(resp)),
                Ok(Err(e)) => Err(ProxyError::Upstream(Box::new(e))),
                Err(_) => Err(ProxyError::UpstreamTimeout),
            });
            break;
        }
        if client_version == Version::HTTP_2
            && http_body::Body::is_end_stream(req.body())
            && !route.limits.settles
        {
            // A bodyless HTTP/2 stream: the raw pool, from this task (see `raw_upstream`),
            // unless the route settles costs, which may come in trailers the raw pool drops.
            let sent = raw_upstream::send(&upstream.pools.raw, &req, started);
            done = Some(match tokio::time::timeout_at(deadline, sent).await {
                Ok(Ok(resp)) => Ok(Exchange::Plain(resp)),
                Ok(Err(RawError::Connect(e))) => {
                    pending = Some(req);
                    tries.refused(upstream, Box::new(e));
                    continue;
                }
                Ok(Err(RawError::Sent(e))) => Err(e.into()),
                Err(_) => Err(ProxyError::UpstreamTimeout),
            });
            break;
        }
        let sent = gateway.connector.send_plain(&upstream.pools, req, started);
        done = Some(match tokio::time::timeout_at(deadline, sent).await {
            Ok(Ok(resp)) => Ok(Exchange::Plain(resp)),
            Ok(Err(SendError::Connect(e, back))) => {
                pending = Some(*back);
                tries.refused(upstream, Box::new(e));
                continue;
            }
            Ok(Err(SendError::Sent(e))) => Err(ProxyError::Upstream(Box::new(e))),
            Err(_) => Err(ProxyError::UpstreamTimeout),
        });
        break;
    }
    let sent = tries.outcome(done);
    let exchanged = match sent {
        // The client sent a body it could not finish (a malformed chunk, or its connection
        // closed early): its fault, not the upstream's, and answered as the fast codec does.
        Err(ProxyError::Upstream(e)) if client_body_failed.load(Ordering::Relaxed) != OK => {
            tracing::debug!(route = %route.name, error = %e, "bad request body");
            return Err(match client_body_failed.load(Ordering::Relaxed) {
                CUT_SHORT => ProxyError::BodyCutShort,
                _ => ProxyError::MalformedBody,
            });
        }
        r => r?,
    };
    // A protocol switch the client did not ask for: nothing can be relayed after it.
    let switched = exchanged.status() == http::StatusCode::SWITCHING_PROTOCOLS;
    if switched && client_upgrade.is_none() {
        return Err(ProxyError::SwitchedUnasked);
    }
    let (mut parts, body) = match exchanged {
        Exchange::Plain(resp) => resp.into_parts(),
        Exchange::Other(mut resp) => {
            if let (true, Some(client_upgrade)) = (switched, client_upgrade) {
                let upstream_upgrade = hyper::upgrade::on(&mut resp);
                let open = gateway.tunnels.open();
                let route = route.name.clone();
                // The request's concurrency slots are held while the connection stays open.
                let held = end.take_held();
                tokio::spawn(async move {
                    tunnel(client_upgrade, upstream_upgrade, route).await;
                    drop(held);
                    drop(open);
                });
            }
            let (parts, body) = resp.into_parts();
            (parts, body.map_err(Into::into).boxed())
        }
    };
    let rule = ResponseRule {
        request_id: id.as_bytes(),
        ratelimit: info.as_ref().map(|i| (&route.limits.limits[i.limit], i)),
        switched,
        legacy: route.legacy_headers,
    };
    let mut edit = MapEdit::default();
    forwarding::client_response(&parts.headers, &rule, &mut edit);
    edit.apply(&mut parts.headers);
    parts.version = client_version;
    if !switched {
        // The route's timeout also bounds the body (see `proxy::deadline`).
        parts.extensions.insert(BodyDeadline {
            at: deadline,
            route: route.name.clone(),
        });
    }
    Ok(Response::from_parts(parts, body))
}

/// Points the request at `upstream`: its target (origin form on the plain pool, absolute for
/// the general client) and, unless the client's `Host` is kept, the upstream's host.
fn aim(
    req: &mut Request<Body>,
    upstream: &Upstream,
    client_uri: &Uri,
    plain: bool,
    keep_host: bool,
) -> Result<(), http::Error> {
    *req.uri_mut() = if plain {
        origin_form(upstream, client_uri)?
    } else {
        let pq = client_uri.path_and_query().map_or("/", |pq| pq.as_str());
        upstream.target(pq)?
    };
    if !keep_host {
        if plain {
            // Written by hand on the plain path; the general client fills it from the URI.
            req.headers_mut().insert(HOST, upstream.host.clone());
        } else {
            req.headers_mut().remove(HOST);
        }
    }
    Ok(())
}

/// The client's request body, noting whether reading it failed and how, so that an exchange
/// it broke is answered 400 (the client's fault) rather than 502.
struct ClientBody {
    inner: Incoming,
    failed: Arc<AtomicU8>,
}

/// [`ClientBody::failed`]: the body is fine so far.
const OK: u8 = 0;
/// [`ClientBody::failed`]: the body broke its framing.
const MALFORMED: u8 = 1;
/// [`ClientBody::failed`]: the client's connection ended before the body did.
const CUT_SHORT: u8 = 2;

impl http_body::Body for ClientBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Err(e))) = &polled {
            // hyper reads a body its connection ended under as an `UnexpectedEof`.
            let eof = std::error::Error::source(e)
                .and_then(|s| s.downcast_ref::<std::io::Error>())
                .is_some_and(|io| io.kind() == std::io::ErrorKind::UnexpectedEof);
            let how = if eof || e.is_incomplete_message() {
                CUT_SHORT
            } else {
                MALFORMED
            };
            this.failed.store(how, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

enum Exchange {
    Plain(Response<Body>),
    Other(Response<Incoming>),
}

/// The request target as an HTTP/1.1 origin server reads it: the upstream's base path, then the
/// client's path and query (shared, not copied, when there is no base path).
fn origin_form(upstream: &Upstream, client: &Uri) -> Result<Uri, http::Error> {
    let pq = client.path_and_query();
    // `OPTIONS *` asks about the server, not a path: it stays `*`.
    if upstream.base_path.is_empty() || pq.is_some_and(|pq| pq.as_str() == "*") {
        let pq = pq
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        return Ok(Uri::from(pq));
    }
    let pq = pq.map_or("/", |pq| pq.as_str());
    let mut joined = String::with_capacity(upstream.base_path.len() + pq.len());
    joined.push_str(&upstream.base_path);
    joined.push_str(pq);
    Ok(Uri::from(PathAndQuery::try_from(joined)?))
}

/// Copies bytes both ways once both sides have switched protocols (WebSocket and any other
/// `Upgrade`); the limit decision was made on the upgrade request.
async fn tunnel(
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    route: std::sync::Arc<str>,
) {
    match tokio::try_join!(client, upstream) {
        Ok((c, u)) => {
            let mut c = hyper_util::rt::TokioIo::new(c);
            let mut u = hyper_util::rt::TokioIo::new(u);
            if let Err(e) = tokio::io::copy_bidirectional(&mut c, &mut u).await {
                tracing::debug!(route = %route, error = %e, "upgraded connection ended");
            }
        }
        Err(e) => tracing::debug!(route = %route, error = %e, "upgrade failed"),
    }
}

impl Exchange {
    fn status(&self) -> http::StatusCode {
        match self {
            Exchange::Plain(r) => r.status(),
            Exchange::Other(r) => r.status(),
        }
    }
}
