//! The proxy listener: accept loop for HTTP/1.1 and h2c (prior knowledge) on one port, with
//! upgrades, and graceful drain.
//!
//! On shutdown the loop stops accepting, every open connection is told to finish its in-flight
//! requests and close (HTTP/1.1: no more keep-alive; HTTP/2: GOAWAY), and the drain waits up to
//! the grace period before giving up on stragglers.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::proxy::Proxy;

pub fn builder() -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .keep_alive(true);
    b.http2().timer(TokioTimer::new());
    b
}

/// Serves `listener` until `shutdown` resolves, then drains for at most `grace`.
/// Returns the number of connections that were still open when the grace period ran out.
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> usize {
    let builder = builder();
    let graceful = GracefulShutdown::new();
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
        let proxy = proxy.clone();
        let svc = service_fn(move |req| proxy.clone().serve(req, peer));
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), svc)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let open = graceful.count();
    tracing::info!(open, "draining connections");
    match tokio::time::timeout(grace, graceful.shutdown()).await {
        Ok(()) => 0,
        Err(_) => {
            tracing::warn!(?grace, "grace period over with connections still open");
            open
        }
    }
}
