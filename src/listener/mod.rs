//! The proxy listener: accept loop for HTTP/1.1 and h2c (prior knowledge) on one port, with
//! upgrades, or for TLS with ALPN `h2` / `http/1.1` when `server.tls` is set; and graceful drain.
//! HTTP/1.1 goes to the fast codec on either transport, HTTP/2 to hyper.
//!
//! On shutdown the loop stops accepting, every open connection is told to finish its in-flight
//! requests and close (HTTP/1.1: no more keep-alive; HTTP/2: GOAWAY), and the drain waits up to
//! the grace period before giving up on stragglers. A TLS connection is counted from its accept,
//! so one still in its handshake is waited for too (and closed right after it).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

use crate::metrics::Metrics;
use crate::proxy::Gateway;
use crate::proxy::codec::{general, h1};

/// A client that has not finished its TLS handshake by then is dropped.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `listener` until `shutdown` resolves, then drains for at most `grace`.
/// Returns the number of connections that were still open when the grace period ran out.
///
/// The listener speaks TLS when the config it starts with has `server.tls`. Each new connection
/// takes the certificate of the config running at its accept, so a reload with renewed files
/// rotates the certificate without a restart; turning TLS on or off needs one.
pub(crate) async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> usize {
    let builder = Arc::new(general::builder());
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
    let plain = h1::Control {
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
                let conn =
                    general::serve_one(&builder, TokioIo::new(stream), gateway.clone(), peer);
                let conn = graceful.watch(conn);
                let g = gateway.clone();
                tokio::spawn(supervised(gateway.metrics.clone(), peer, async move {
                    if let Err(e) = conn.await {
                        general::ended_with(&g, peer, &*e);
                    }
                }));
                continue;
            }
            let conn = h1::serve(
                gateway.clone(),
                h1::Stream::Plain(stream),
                peer,
                plain.clone(),
                graceful.watcher(),
            );
            tokio::spawn(supervised(gateway.metrics.clone(), peer, conn));
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
        let conn = serve_tls(
            acceptor,
            stream,
            plain.clone(),
            gateway.clone(),
            peer,
            graceful.watcher(),
        );
        tokio::spawn(supervised(gateway.metrics.clone(), peer, conn));
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

/// One client connection's task, whichever codec serves it. A panic its requests' own catches
/// did not take (the fast codec reading a head, hyper's connection state machine, a TLS
/// handshake) ends this future, which closes this connection alone; it is counted and logged
/// once, with the peer (`crate::panics`). Cheaper than a second task per connection awaiting
/// the first's `JoinHandle`: no spawn, a few instructions per poll (docs/benchmarks.md).
async fn supervised(metrics: Arc<Metrics>, peer: SocketAddr, conn: impl Future<Output = ()>) {
    if let Err(p) = crate::panics::catch(conn).await {
        metrics.panicked("connection");
        tracing::error!(
            %peer,
            panic = %p.message,
            location = p.location(),
            backtrace = p.backtrace.as_deref(),
            "a panic closed a client connection"
        );
    }
}

/// Handshake, then serve: HTTP/1.1 (ALPN `http/1.1`, or none) on the fast codec unless
/// `server.fast_path` is off, which hands over to hyper as on a plain connection; HTTP/2 (ALPN
/// `h2`) on hyper. A failed or slow handshake costs only this connection, logged at debug
/// (scanners and clients that distrust the certificate do it all day).
async fn serve_tls(
    acceptor: TlsAcceptor,
    stream: TcpStream,
    plain: h1::Control,
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
    let h2 = stream.get_ref().1.alpn_protocol() == Some(crate::tls::ALPN_H2);
    if !h2 && gateway.snapshot.load().config.server.fast_path {
        let stream = h1::Stream::Tls(Box::new(stream));
        h1::serve(gateway, stream, peer, plain, watcher).await;
        return;
    }
    let conn = general::serve_one(&plain.builder, TokioIo::new(stream), gateway.clone(), peer);
    if let Err(e) = watcher.watch(conn).await {
        general::ended_with(&gateway, peer, &*e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_in_a_connection_ends_its_task_normally_and_is_counted() {
        let metrics = Arc::new(Metrics::new());
        let peer: SocketAddr = "192.0.2.1:40000".parse().unwrap();
        let conn = async {
            tokio::task::yield_now().await;
            panic!("in the connection");
        };
        let task = tokio::spawn(supervised(metrics.clone(), peer, conn));
        task.await.expect("the panic stays inside supervised");
        let text = metrics.encode(crate::metrics::Format::Text);
        assert!(
            text.contains("tollgate_panics_total{task=\"connection\"} 1"),
            "{text}"
        );
    }
}
