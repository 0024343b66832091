//! Forwarding an admitted request to the route's upstream over a pooled connection.
//!
//! The request body streams through untouched; the upstream request is rewritten only where a
//! proxy must: absolute-form URI for the client, hop-by-hop fields removed, `X-Forwarded-*` set,
//! `Host` kept or replaced per `preserve_host`. It is sent as HTTP/1.1, or as HTTP/2 to an
//! `https://` upstream that offers `h2` (see [`client`]). The route's `timeout` bounds the whole
//! exchange: no response head by then is a 504, and a body still coming then is cut (see
//! [`super::deadline`]).

mod client;
pub(crate) mod pool;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use http::header::HOST;
use http::uri::{PathAndQuery, Scheme};
use http::{HeaderValue, Request, Response, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;

pub use self::client::{Client, UpstreamError};
pub use self::pool::Host;
use super::deadline::BodyDeadline;
use super::{Body, Proxy, headers, response};
use crate::snapshot::{ConfigSnapshot, Route, Upstream};

pub async fn forward(
    proxy: &Proxy,
    route: &Route,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    rt: &ConfigSnapshot,
) -> Response<Body> {
    let order = route.upstream_order();
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
    headers::strip_hop_by_hop(&mut parts.headers, upgrade);
    let peer_trusted = rt
        .trusted_proxies
        .iter()
        .any(|n| n.contains(&peer.ip().to_canonical()));
    headers::set_forwarded(
        &mut parts.headers,
        peer.ip(),
        peer_trusted,
        proxy.proto,
        client_host.as_ref(),
    );
    let keep_host = route.preserve_host && client_host.is_some();
    if let (true, Some(h)) = (keep_host, client_host) {
        parts.headers.insert(HOST, h);
    }
    let client_uri = std::mem::take(&mut parts.uri);
    parts.version = Version::HTTP_11;
    // Only a body that is coming can fail; an empty one costs nothing to watch.
    let client_body_failed = Arc::new(AtomicBool::new(false));
    let body = if http_body::Body::is_end_stream(&body) {
        body.boxed()
    } else {
        ClientBody {
            inner: body,
            failed: Arc::clone(&client_body_failed),
        }
        .boxed()
    };
    let mut upstream_req = Request::from_parts(parts, body);

    let started = Instant::now();
    let deadline = tokio::time::Instant::from_std(started) + route.timeout;
    // Put on the response: the route's timeout also bounds its body (see `proxy::deadline`).
    let body_deadline = || BodyDeadline {
        at: deadline,
        route: route.name.clone(),
    };
    let mut result = None;
    for (i, upstream) in order.iter().enumerate() {
        // Plain HTTP/1.1 without a protocol switch: the common case, on the upstream's own
        // pool. (CONNECT never gets here: it is refused before routing.)
        let plain = !upgrade && upstream.scheme == Scheme::HTTP;
        if aim(&mut upstream_req, upstream, &client_uri, plain, keep_host).is_err() {
            return response::bad_request("request target cannot be forwarded");
        }
        if !plain {
            // Boxed: TLS, HTTP/2 and upgrades keep their larger state out of the common path's
            // future. The request is consumed here: no other upstream is tried after it.
            let sent = Box::pin(proxy.client.request(upstream_req, client_upgrade.is_some()));
            result = Some(
                tokio::time::timeout_at(deadline, sent)
                    .await
                    .map(|r| r.map(Exchange::Other)),
            );
            break;
        }
        let sent = proxy.client.send_plain(upstream, upstream_req, started);
        match tokio::time::timeout_at(deadline, sent).await {
            Ok(Err(pool::SendError::Connect(e, back))) => {
                upstream.mark_down();
                if i + 1 == order.len() {
                    result = Some(Ok(Err(e)));
                    break;
                }
                tracing::warn!(route = %route.name, upstream = %upstream.authority, error = %e, "upstream refused the connection: trying the next");
                upstream_req = *back;
            }
            r => {
                result = Some(r.map(|r| match r {
                    Ok(resp) => Ok(Exchange::Plain(resp)),
                    Err(pool::SendError::Sent(e) | pool::SendError::Connect(e, _)) => Err(e),
                }));
                break;
            }
        }
    }
    route.metrics.upstream_duration.observe(started.elapsed());
    let Some(result) = result else {
        return response::bad_gateway(&route.name);
    };
    match result {
        // A protocol switch the client did not ask for: nothing can be relayed after it (the
        // fast path answers the same).
        Ok(Ok(ref e))
            if e.status() == http::StatusCode::SWITCHING_PROTOCOLS && client_upgrade.is_none() =>
        {
            tracing::warn!(route = %route.name, "upstream switched protocols unasked");
            response::bad_gateway(&route.name)
        }
        Ok(Ok(Exchange::Plain(mut resp))) => {
            headers::strip_hop_by_hop(resp.headers_mut(), false);
            *resp.version_mut() = client_version;
            resp.extensions_mut().insert(body_deadline());
            resp
        }
        Ok(Ok(Exchange::Other(mut resp))) => {
            let switched = resp.status() == http::StatusCode::SWITCHING_PROTOCOLS;
            if let (true, Some(client_upgrade)) = (switched, client_upgrade) {
                let upstream_upgrade = hyper::upgrade::on(&mut resp);
                let open = proxy.tunnels.open();
                let route = route.name.clone();
                tokio::spawn(async move {
                    tunnel(client_upgrade, upstream_upgrade, route).await;
                    drop(open);
                });
            }
            let (mut parts, body) = resp.into_parts();
            headers::strip_hop_by_hop(&mut parts.headers, switched);
            parts.version = client_version;
            if !switched {
                parts.extensions.insert(body_deadline());
            }
            Response::from_parts(parts, body.boxed())
        }
        // The client sent a body it could not finish (a malformed chunk): its fault, not the
        // upstream's, and answered as the fast path answers it.
        Ok(Err(e)) if client_body_failed.load(Ordering::Relaxed) => {
            tracing::debug!(route = %route.name, error = %e, "malformed request body");
            response::bad_request("malformed request body")
        }
        Ok(Err(e)) => {
            tracing::warn!(route = %route.name, error = %e, "upstream request failed");
            response::bad_gateway(&route.name)
        }
        Err(_) => {
            tracing::warn!(route = %route.name, timeout = ?route.timeout, "upstream timed out");
            response::gateway_timeout(&route.name)
        }
    }
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

/// The client's request body, noting whether reading it failed, so that an exchange it broke
/// is answered 400 (the client's fault) rather than 502.
struct ClientBody {
    inner: Incoming,
    failed: Arc<AtomicBool>,
}

impl http_body::Body for ClientBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Err(_))) = &polled {
            this.failed.store(true, Ordering::Relaxed);
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
