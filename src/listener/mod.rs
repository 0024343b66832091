//! The proxy listener: accept loop for HTTP/1.1 and h2c (prior knowledge) on one port, with
//! upgrades, or for TLS with ALPN `h2` / `http/1.1` when `server.tls` is set; and graceful drain.
//!
//! On shutdown the loop stops accepting, every open connection is told to finish its in-flight
//! requests and close (HTTP/1.1: no more keep-alive; HTTP/2: GOAWAY), and the drain waits up to
//! the grace period before giving up on stragglers. A TLS connection is counted from its accept,
//! so one still in its handshake is waited for too (and closed right after it).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

use crate::proxy::Gateway;

/// A client that has not finished its TLS handshake by then is dropped.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest request head served; a larger one gets 431 (HTTP/1.1) or a stream reset
/// (HTTP/2). Envoy's default is 60 KiB, nginx's 32 KiB in four 8 KiB lines; hyper's own were
/// about 400 KB for HTTP/1.1 and 16 KiB for HTTP/2. One figure for both protocols, so a
/// client's headers pass or fail alike whichever it speaks.
pub const MAX_HEAD: usize = 64 * 1024;

pub fn builder() -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .keep_alive(true)
        // A client may shut its write side once the request is sent (`nc -N`, some HTTP/1.0
        // tools) and still wait for the answer; nginx and the fast path answer it. hyper's
        // default dropped such a connection, request and all, at the EOF.
        .half_close(true)
        .max_buf_size(MAX_HEAD);
    b.http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HEAD as u32);
    b
}

/// Serves `listener` until `shutdown` resolves, then drains for at most `grace`.
/// Returns the number of connections that were still open when the grace period ran out.
///
/// The listener speaks TLS when the config it starts with has `server.tls`. Each new connection
/// takes the certificate of the config running at its accept, so a reload with renewed files
/// rotates the certificate without a restart; turning TLS on or off needs one.
pub async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> usize {
    let builder = Arc::new(builder());
    let graceful = GracefulShutdown::new();
    let mut tls = gateway
        .snapshot
        .load()
        .config
        .server
        .tls
        .as_ref()
        .map(|t| t.server_config.clone());
    let mut warned_tls_removed = false;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let plain = crate::proxy::codec::h1::Control {
        builder: builder.clone(),
        stop: stopped,
    };
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let Some(current) = &mut tls else {
            if !gateway.snapshot.load().config.server.fast_path {
                let conn = serve_one(&builder, TokioIo::new(stream), gateway.clone(), peer);
                let conn = graceful.watch(conn);
                let gateway = gateway.clone();
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        ended_with(&gateway, peer, &*e);
                    }
                });
                continue;
            }
            tokio::spawn(crate::proxy::codec::h1::serve(
                gateway.clone(),
                stream,
                peer,
                plain.clone(),
                graceful.watcher(),
            ));
            continue;
        };
        match &gateway.snapshot.load().config.server.tls {
            Some(t) => *current = t.server_config.clone(),
            None if !warned_tls_removed => {
                warned_tls_removed = true;
                tracing::warn!(
                    "server.tls was removed by a reload: the listener keeps serving TLS with the last certificate until restarted"
                );
            }
            None => {}
        }
        let acceptor = TlsAcceptor::from(current.clone());
        tokio::spawn(serve_tls(
            acceptor,
            stream,
            builder.clone(),
            gateway.clone(),
            peer,
            graceful.watcher(),
        ));
    }
    drop(listener);
    // Plain connections on the fast path hold a watcher each (so the count and the wait below
    // include them) and close on this signal.
    let _ = stop.send(true);
    let open = graceful.count();
    let tunnels = &gateway.tunnels;
    tracing::info!(open, upgraded = tunnels.count(), "draining connections");
    let drained = async {
        graceful.shutdown().await;
        // Upgraded connections (WebSockets) run until their ends close them, within the grace.
        tunnels.all_closed().await;
    };
    match tokio::time::timeout(grace, drained).await {
        Ok(()) => 0,
        Err(_) => {
            tracing::warn!(
                ?grace,
                upgraded = tunnels.count(),
                "grace period over with connections still open"
            );
            open + tunnels.count()
        }
    }
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
    let svc =
        service_fn(move |req| crate::proxy::codec::general::serve(gateway.clone(), req, peer));
    builder.serve_connection_with_upgrades(io, svc).into_owned()
}

/// Handshake, then serve. A failed or slow handshake costs only this connection, logged at debug
/// (scanners and clients that distrust the certificate do it all day).
async fn serve_tls(
    acceptor: TlsAcceptor,
    stream: TcpStream,
    builder: Arc<auto::Builder<TokioExecutor>>,
    gateway: Arc<Gateway>,
    peer: SocketAddr,
    watcher: Watcher,
) {
    let stream = match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, %peer, "TLS handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, timeout = ?TLS_HANDSHAKE_TIMEOUT, "TLS handshake timed out");
            return;
        }
    };
    let conn = serve_one(&builder, TokioIo::new(stream), gateway.clone(), peer);
    if let Err(e) = watcher.watch(conn).await {
        ended_with(&gateway, peer, &*e);
    }
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
