//! Kept-alive HTTP/1.1 connections to one plain `http://` upstream, on hyper's connection API.
//!
//! Why not hyper-util's pooled client here: it was a tenth of the gateway's CPU per proxied
//! request in a profile, for work a reverse proxy does not need per request —
//! keying the pool by scheme and authority on every request, a boxed checkout future, and a task
//! spawned per response to put the connection back once its body is read. Here each upstream
//! holds its own idle list (found once, not per request), a connection goes back the moment its
//! response body ends (the body wrapper does it), and nothing is spawned on the way.
//!
//! The rules are the usual pool's: last in, first out (the warmest connection, and the cold ones
//! age out at the bottom); a connection idle longer than [`IDLE_TIMEOUT`] or closed by the upstream
//! is never handed out; at most [`MAX_IDLE`] are kept, and a reaper closes idle ones that aged out
//! or were closed while no request came. A request that finds its connection closed
//! before any byte of it was written (the upstream timed the connection out while it sat idle)
//! goes again on another one, as hyper-util's client does; one whose bytes may have reached the
//! upstream is never resent.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{Request, Response, Uri};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::client::legacy::connect::HttpConnector;
use parking_lot::Mutex;
use tower::ServiceExt;

use super::{Body, STALE_RETRIES, UpstreamError};

/// Longer than nginx's default `keepalive_timeout` (75 s) would be pointless: an upstream closes
/// its end first, and its connections are noticed closed here.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
pub(crate) const MAX_IDLE: usize = 1024;
/// How often idle connections are checked while they sit unused.
const REAP_EVERY: Duration = Duration::from_secs(15);

/// Calls `reap` on `owner` every [`REAP_EVERY`] until the owner is dropped: the idle-connection
/// reaper of both pools (this one and the fast path's).
pub(crate) fn spawn_reaper<T: Send + Sync + 'static>(owner: &Arc<T>, reap: fn(&T, Instant)) {
    let owner = Arc::downgrade(owner);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(REAP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(owner) = owner.upgrade() else { return };
            reap(&owner, Instant::now());
        }
    });
}

/// One upstream's idle connections.
#[derive(Debug)]
pub struct Host {
    /// `http://authority/`: what the connector dials.
    dial: Uri,
    idle: Mutex<Vec<Idle>>,
    reaper: std::sync::Once,
}

struct Idle {
    sender: http1::SendRequest<Body>,
    since: Instant,
}

impl std::fmt::Debug for Idle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idle").field("since", &self.since).finish()
    }
}

impl Host {
    pub fn new(authority: &Authority) -> Arc<Self> {
        let dial = Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(authority.clone())
            .path_and_query("/")
            .build()
            .expect("an authority makes a URI");
        Arc::new(Self {
            dial,
            idle: Mutex::new(Vec::new()),
            reaper: std::sync::Once::new(),
        })
    }

    /// Idle connections held now (for tests and metrics).
    pub fn idle(&self) -> usize {
        self.idle.lock().len()
    }

    /// `now`: when the request started (read once for the whole exchange).
    fn checkout(&self, now: Instant) -> Option<http1::SendRequest<Body>> {
        let mut idle = self.idle.lock();
        while let Some(c) = idle.pop() {
            if now.saturating_duration_since(c.since) < IDLE_TIMEOUT && c.sender.is_ready() {
                return Some(c.sender);
            }
        }
        None
    }

    /// Every [`REAP_EVERY`], idle connections that aged out or that the upstream closed are
    /// dropped, so their sockets do not stay open while no request comes (an upstream that never
    /// closes idle connections, one removed from the config by a reload). Ends with the host.
    fn start_reaper(self: &Arc<Self>) {
        self.reaper.call_once(|| spawn_reaper(self, Self::reap));
    }

    /// Drops the idle connections that aged out by `now` or that the upstream closed.
    fn reap(&self, now: Instant) {
        let stale: Vec<Idle> = {
            let mut idle = self.idle.lock();
            let (keep, stale) = std::mem::take(&mut *idle).into_iter().partition(|c| {
                now.saturating_duration_since(c.since) < IDLE_TIMEOUT && !c.sender.is_closed()
            });
            *idle = keep;
            stale
        };
        // Closed outside the lock.
        drop(stale);
    }

    fn checkin(self: &Arc<Self>, sender: http1::SendRequest<Body>) {
        if sender.is_ready() {
            self.push(sender);
        } else if !sender.is_closed() {
            // The connection has not yet taken up its next request (its task has not run since
            // the body ended, possible on a multi-threaded runtime): it goes back once it has.
            let host = self.clone();
            let mut sender = sender;
            tokio::spawn(async move {
                if sender.ready().await.is_ok() {
                    host.push(sender);
                }
            });
        }
    }

    /// Idle from now: an exchange can be long (a download, a stream), so its start is no measure.
    fn push(&self, sender: http1::SendRequest<Body>) {
        let now = Instant::now();
        let mut idle = self.idle.lock();
        // The oldest are at the bottom: drop the ones that have aged out, a few at a time.
        let stale = idle
            .iter()
            .take(8)
            .take_while(|c| {
                now.saturating_duration_since(c.since) >= IDLE_TIMEOUT || c.sender.is_closed()
            })
            .count();
        idle.drain(..stale);
        if idle.len() < MAX_IDLE {
            idle.push(Idle { sender, since: now });
        }
    }
}

/// Sends `req` (origin-form URI, `Host` set) to `host` over a kept-alive connection or a new one;
/// the response body hands the connection back when it ends.
pub(crate) async fn send(
    connector: &HttpConnector,
    host: &Arc<Host>,
    mut req: Request<Body>,
    started: Instant,
) -> Result<Response<Body>, SendError> {
    for _ in 0..STALE_RETRIES {
        let Some(mut sender) = host.checkout(started) else {
            break;
        };
        match sender.try_send_request(req).await {
            Ok(resp) => return Ok(pooled(resp, sender, host)),
            Err(mut e) => match e.take_message() {
                Some(unsent) => req = unsent,
                None => return Err(SendError::Sent(UpstreamError::new(e.into_error()))),
            },
        }
    }
    // Boxed: a new connection is the rare case, and its state would otherwise be part of every
    // request's future.
    let mut sender = match Box::pin(connect(connector, host)).await {
        Ok(sender) => sender,
        Err(e) => return Err(SendError::Connect(e, Box::new(req))),
    };
    host.start_reaper();
    match sender.try_send_request(req).await {
        Ok(resp) => Ok(pooled(resp, sender, host)),
        Err(e) => Err(SendError::Sent(UpstreamError::new(e.into_error()))),
    }
}

/// Why [`send`] failed.
pub enum SendError {
    /// No connection could be made: the request comes back untouched, for another upstream.
    Connect(UpstreamError, Box<Request<Body>>),
    /// The request, or part of it, may have gone out.
    Sent(UpstreamError),
}

async fn connect(
    connector: &HttpConnector,
    host: &Host,
) -> Result<http1::SendRequest<Body>, UpstreamError> {
    let io = connector
        .clone()
        .oneshot(host.dial.clone())
        .await
        .map_err(UpstreamError::new)?;
    let (sender, conn) = http1::Builder::new()
        .handshake(io)
        .await
        .map_err(UpstreamError::new)?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "upstream connection ended");
        }
    });
    Ok(sender)
}

fn pooled(
    resp: Response<Incoming>,
    sender: http1::SendRequest<Body>,
    host: &Arc<Host>,
) -> Response<Body> {
    let (parts, body) = resp.into_parts();
    let body = if body.is_end_stream() {
        host.checkin(sender);
        PooledBody { body, back: None }
    } else {
        PooledBody {
            body,
            back: Some((sender, host.clone())),
        }
    };
    Response::from_parts(parts, http_body_util::BodyExt::boxed(body))
}

/// The upstream's response body, carrying its connection back to the pool at its end. Dropped
/// before its end (the client went away), it takes the connection with it: hyper closes a
/// connection whose response was not read to the end.
struct PooledBody {
    body: Incoming,
    back: Option<(http1::SendRequest<Body>, Arc<Host>)>,
}

impl PooledBody {
    fn give_back(&mut self) {
        if let Some((sender, host)) = self.back.take() {
            host.checkin(sender);
        }
    }
}

impl HttpBody for PooledBody {
    type Data = Bytes;
    type Error = super::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, super::BoxError>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.give_back(),
            Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.give_back(),
            // An error ends the connection too; it is not given back.
            Poll::Ready(Some(Err(_))) => this.back = None,
            _ => {}
        }
        polled.map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // Read to its end but not polled past it (a reader that trusts `is_end_stream`).
        if self.body.is_end_stream() {
            self.give_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_reaper_drops_idle_connections_the_upstream_closed_or_that_aged_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let host = Host::new(&Authority::try_from(addr.to_string()).unwrap());
        let connector = HttpConnector::new();
        let mut a = connect(&connector, &host).await.unwrap();
        let (server_a, _) = listener.accept().await.unwrap();
        let mut b = connect(&connector, &host).await.unwrap();
        let (_server_b, _) = listener.accept().await.unwrap();
        a.ready().await.unwrap();
        b.ready().await.unwrap();
        host.push(a);
        host.push(b);
        assert_eq!(host.idle(), 2);
        // The upstream closes one; its connection task sees the end and the reaper drops it.
        drop(server_a);
        for _ in 0..200 {
            host.reap(Instant::now());
            if host.idle() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(host.idle(), 1);
        // The other is open but has been idle for the whole timeout.
        host.reap(Instant::now() + IDLE_TIMEOUT);
        assert_eq!(host.idle(), 0);
    }
}
