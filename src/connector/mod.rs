//! The connector: every upstream connection, owned by the app (not by a config snapshot, so
//! connections outlive reloads) and kept per upstream authority in one [`Pools`]: raw TCP
//! streams for the fast codec ([`raw`]), hyper HTTP/1.1 connections for the hyper codec
//! ([`http1`]), TLS to `https://` upstreams, and HTTP/2 to `https://` upstreams that offer `h2`
//! by ALPN. A connection refused by an authority marks it down for every route that uses it.
//!
//! Why not hand everything to hyper-util's pooled client with ALPN on: over HTTP/2 the host goes
//! in `:authority`, which that client takes from the URI it also pools and dials by. The proxy
//! dials the upstream but (with `preserve_host`) must present the client's host, and RFC 9113
//! §8.3.1 forbids a `Host` that differs from `:authority` — servers such as Go's take the host
//! from `:authority` only. So HTTP/2 connections are kept here, one multiplexed connection per
//! upstream, and each request's `:authority` is the `Host` it is forwarded with. The rest of
//! HTTP/1.1 (upgrades, TLS upstreams without `h2`) goes through hyper-util's pooled client, whose
//! TLS connector offers no ALPN, which servers read as HTTP/1.1.
//!
//! SNI and certificate verification use the upstream URL's host, never the client's `Host`.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::HOST;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use parking_lot::{Mutex, RwLock};
use rustls::pki_types::CertificateDer;
use tokio::net::TcpStream;
use tower::ServiceExt;

pub(crate) mod http1;
pub(crate) mod raw;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;

use self::http1::Host;

/// The one body type for everything the hyper codec sends: upstream bodies and its own. Its
/// error is boxed, not hyper's: a body read from a raw pooled connection (`proxy::raw_upstream`)
/// fails with errors of its own.
pub(crate) type Body = BoxBody<Bytes, BoxError>;

/// TCP connect to a plain upstream, on either pool.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A request is tried on at most this many pooled connections that turn out closed, then on a
/// new one.
pub(crate) const STALE_RETRIES: usize = 4;
/// How long an upstream that refused a connection is tried after its route's others: nginx's
/// `max_fails=1 fail_timeout=10s` default.
pub(crate) const FAIL_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything kept for one plain upstream authority, shared by every route and every config
/// snapshot that names it.
#[derive(Debug)]
pub struct Pools {
    /// The fast codec's raw connections.
    pub raw: Arc<raw::Pool>,
    /// The hyper codec's HTTP/1.1 connections.
    pub http1: Arc<Host>,
    /// Until when (ms on [`millis`]'s clock) this authority counts as down: it refused a
    /// connection, and the other upstreams of a route are tried first until then.
    down_until: AtomicU64,
}

impl Pools {
    fn new(authority: &Authority) -> Self {
        Self {
            raw: raw::Pool::new(authority),
            http1: Host::new(authority),
            down_until: AtomicU64::new(0),
        }
    }

    /// Notes that a connection to this authority failed (nothing was sent).
    pub fn mark_down(&self) {
        self.down_until.store(
            millis() + FAIL_TIMEOUT.as_millis() as u64,
            Ordering::Relaxed,
        );
    }

    /// Whether the authority refused a connection less than [`FAIL_TIMEOUT`] ago.
    pub fn is_down(&self) -> bool {
        self.down_until.load(Ordering::Relaxed) > millis()
    }
}

/// Milliseconds since the first call: a clock for the down marks, cheap to compare.
fn millis() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// Any error, boxed.
pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;
type Pooled = hyper_util::client::legacy::Client<HttpsConnector<HttpConnector>, Body>;

/// TCP connect plus TLS handshake to an upstream that is dialled for HTTP/2.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// An upstream that answered ALPN with HTTP/1.1 is asked again after this long (it may have been
/// upgraded); meanwhile its requests use the HTTP/1.1 pool.
const REPROBE_AFTER: Duration = Duration::from_secs(300);

/// Every upstream connection of the process.
pub struct Connector {
    /// Dials plain `http://` upstreams for the hyper codec's pool.
    plain: HttpConnector,
    /// One [`Pools`] per plain authority, handed to each config snapshot that names it.
    pools: Mutex<HashMap<Authority, Arc<Pools>>>,
    /// HTTP/1.1, pooled: upgrades, and `https://` upstreams without `h2`.
    http1: Pooled,
    /// Dials `https://` upstreams offering ALPN `h2` and `http/1.1`.
    alpn: HttpsConnector<HttpConnector>,
    /// What each `https://` upstream (by authority) answered to ALPN.
    h2: RwLock<HashMap<Authority, H2State>>,
}

#[derive(Clone)]
enum H2State {
    /// Not asked yet, or its HTTP/2 connection closed.
    Unknown,
    /// Chose HTTP/1.1 at `since`.
    Http1 { since: Instant },
    /// One HTTP/2 connection; requests are multiplexed over it.
    Ready(http2::SendRequest<Body>),
}

/// Why an upstream exchange failed before a response head arrived; displays the whole cause
/// chain ("client error (Connect): invalid peer certificate: UnknownIssuer").
#[derive(Debug)]
pub struct UpstreamError(BoxError);

impl fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut last = self.0.to_string();
        let mut source = self.0.source();
        while let Some(s) = source {
            let text = s.to_string();
            // hyper-util repeats its inner error's text at some levels.
            if !last.contains(&text) {
                write!(f, ": {text}")?;
            }
            last = text;
            source = s.source();
        }
        Ok(())
    }
}

impl StdError for UpstreamError {}

impl UpstreamError {
    pub fn new(e: impl Into<BoxError>) -> Self {
        Self(e.into())
    }
}

fn http_connector() -> HttpConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_keepalive(Some(Duration::from_secs(60)));
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http
}

impl Connector {
    /// `upstream_ca`: trusted for `https://` upstreams on top of the system roots.
    pub fn new(upstream_ca: &[CertificateDer<'static>]) -> Self {
        let tls = crate::tls::client_config(upstream_ca);
        let no_alpn = HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(http_connector());
        let http1 = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .build(no_alpn);
        let alpn = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http_connector());
        Self {
            plain: http_connector(),
            pools: Mutex::new(HashMap::new()),
            http1,
            alpn,
            h2: RwLock::new(HashMap::new()),
        }
    }

    /// The pools of a plain authority, made on first use; a config snapshot takes them once
    /// per upstream when it is built, so a request never looks them up.
    pub fn pools(&self, authority: &Authority) -> Arc<Pools> {
        self.pools
            .lock()
            .entry(authority.clone())
            .or_insert_with(|| Arc::new(Pools::new(authority)))
            .clone()
    }

    /// Sends `req` (origin-form URI, `Host` set) to a plain `http://` upstream over one of its
    /// kept-alive connections.
    pub async fn send_plain(
        &self,
        pools: &Pools,
        req: Request<Body>,
        started: Instant,
    ) -> Result<Response<Body>, http1::SendError> {
        http1::send(&self.plain, &pools.http1, req, started).await
    }

    /// Sends `req` (absolute URI: the upstream's scheme and authority; `Host` as it should reach
    /// the upstream, or absent for the upstream's own). `upgrade`: the request asks for a
    /// protocol switch, which only HTTP/1.1 can carry.
    pub async fn request(
        &self,
        req: Request<Body>,
        upgrade: bool,
    ) -> Result<Response<Incoming>, UpstreamError> {
        if upgrade || req.uri().scheme() != Some(&Scheme::HTTPS) {
            return self.pooled(req).await;
        }
        let Some(authority) = req.uri().authority().cloned() else {
            return self.pooled(req).await;
        };
        let mut req = req;
        // A connection can close between the look-up and the send (GOAWAY, upstream restart);
        // hyper hands the request back when nothing of it was sent, and it goes on a new one.
        for _ in 0..2 {
            let mut sender = match self.state(&authority) {
                H2State::Ready(sender) => sender,
                H2State::Http1 { .. } => return self.pooled(req).await,
                // Boxed: the dial's state (TCP + TLS handshake) would otherwise be part of every
                // in-flight request's future, waiting ones included.
                H2State::Unknown => match Box::pin(self.dial(&authority)).await? {
                    Some(sender) => sender,
                    None => return self.pooled(req).await,
                },
            };
            match sender.try_send_request(for_h2(req)).await {
                Ok(resp) => return Ok(resp),
                Err(mut e) => match e.take_message() {
                    Some(unsent) if sender.is_closed() => {
                        self.forget(&authority);
                        req = unsent;
                    }
                    _ => return Err(UpstreamError(e.into_error().into())),
                },
            }
        }
        Err(UpstreamError(
            "the upstream closed two HTTP/2 connections in a row before the request was sent"
                .into(),
        ))
    }

    async fn pooled(&self, req: Request<Body>) -> Result<Response<Incoming>, UpstreamError> {
        self.http1
            .request(req)
            .await
            .map_err(|e| UpstreamError(e.into()))
    }

    fn state(&self, authority: &Authority) -> H2State {
        let state = self.h2.read().get(authority).cloned();
        match state {
            Some(H2State::Ready(s)) if !s.is_closed() => H2State::Ready(s),
            Some(H2State::Http1 { since }) if since.elapsed() < REPROBE_AFTER => {
                H2State::Http1 { since }
            }
            _ => H2State::Unknown,
        }
    }

    /// Marks the upstream's HTTP/2 connection gone, unless another request already replaced it.
    fn forget(&self, authority: &Authority) {
        let mut table = self.h2.write();
        if let Some(H2State::Ready(s)) = table.get(authority)
            && s.is_closed()
        {
            table.insert(authority.clone(), H2State::Unknown);
        }
    }

    /// Connects with ALPN `h2` + `http/1.1`. HTTP/2: the connection is kept for every later
    /// request to this upstream and its sender returned. HTTP/1.1: remembered, the connection is
    /// dropped, and `None` sends the request through the HTTP/1.1 pool. Requests that find the
    /// state unknown at the same moment each dial (as a pool does); the last HTTP/2 connection
    /// stays in the table and the others close once their requests are done.
    async fn dial(
        &self,
        authority: &Authority,
    ) -> Result<Option<http2::SendRequest<Body>>, UpstreamError> {
        let target = Uri::builder()
            .scheme(Scheme::HTTPS)
            .authority(authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|e| UpstreamError(e.into()))?;
        let io = tokio::time::timeout(DIAL_TIMEOUT, self.alpn.clone().oneshot(target))
            .await
            .map_err(|_| UpstreamError(format!("TLS connect to {authority} timed out").into()))?
            .map_err(UpstreamError)?;
        if !negotiated_h2(&io) {
            self.h2.write().insert(
                authority.clone(),
                H2State::Http1 {
                    since: Instant::now(),
                },
            );
            return Ok(None);
        }
        let (sender, conn) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            // Pings while idle too: a connection that died quietly (NAT, a restarted upstream
            // behind a load balancer) is noticed and replaced before a request waits on it.
            .keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true)
            .handshake(io)
            .await
            .map_err(|e| UpstreamError(e.into()))?;
        let name = authority.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(upstream = %name, error = %e, "HTTP/2 upstream connection ended");
            }
        });
        tracing::debug!(upstream = %authority, "HTTP/2 to upstream (ALPN h2)");
        self.h2
            .write()
            .insert(authority.clone(), H2State::Ready(sender.clone()));
        Ok(Some(sender))
    }
}

fn negotiated_h2(io: &MaybeHttpsStream<TokioIo<TcpStream>>) -> bool {
    match io {
        MaybeHttpsStream::Https(tls) => {
            tls.inner().get_ref().1.alpn_protocol() == Some(crate::tls::ALPN_H2)
        }
        MaybeHttpsStream::Http(_) => false,
    }
}

/// The same request as HTTP/2: `:authority` is the `Host` it is forwarded with (the upstream's
/// own authority when it has none), and `Host`, when kept, is identical to it.
fn for_h2(req: Request<Body>) -> Request<Body> {
    let (mut parts, body) = req.into_parts();
    parts.version = Version::HTTP_2;
    let host = parts.headers.get(HOST).map(|h| {
        Authority::try_from(h.as_bytes())
            .ok()
            .filter(|a| !a.as_str().contains('@'))
    });
    match host {
        Some(Some(authority)) => {
            let pq = parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/"));
            if let Ok(uri) = Uri::builder()
                .scheme(Scheme::HTTPS)
                .authority(authority)
                .path_and_query(pq)
                .build()
            {
                parts.uri = uri;
            }
        }
        // Not an authority: it cannot be sent consistently with `:authority`.
        Some(None) => {
            parts.headers.remove(HOST);
        }
        None => {}
    }
    Request::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Empty};

    fn req(uri: &str, host: Option<&str>) -> Request<Body> {
        let mut b = Request::builder().uri(uri);
        if let Some(h) = host {
            b = b.header(HOST, h);
        }
        b.body(Empty::new().map_err(|e| match e {}).boxed())
            .unwrap()
    }

    #[test]
    fn h2_authority_is_the_forwarded_host() {
        let r = for_h2(req(
            "https://10.0.0.5:8443/v1/x?q=1",
            Some("api.example.com:8080"),
        ));
        assert_eq!(r.version(), Version::HTTP_2);
        assert_eq!(r.uri(), "https://api.example.com:8080/v1/x?q=1");
        assert_eq!(r.headers()[HOST], "api.example.com:8080");
    }

    #[test]
    fn h2_without_host_keeps_the_upstream_authority() {
        let r = for_h2(req("https://10.0.0.5:8443/x", None));
        assert_eq!(r.uri(), "https://10.0.0.5:8443/x");
        assert!(r.headers().get(HOST).is_none());
    }

    #[test]
    fn h2_drops_a_host_that_is_not_an_authority() {
        for bad in ["user@evil", "a b", ""] {
            let r = for_h2(req("https://u:1/x", Some(bad)));
            assert_eq!(r.uri(), "https://u:1/x", "{bad:?}");
            assert!(r.headers().get(HOST).is_none(), "{bad:?}");
        }
    }
}
