//! Kept-alive raw connections to one plain `http://` upstream, for the fast codec.
//!
//! The same rules as the hyper codec's pool ([`super::http1`]): last in, first out; a connection
//! idle longer than [`IDLE_TIMEOUT`] or seen closed by the upstream is never handed out; at most
//! [`MAX_IDLE`] are kept; a reaper drops the ones that aged out while no request came. A
//! connection is only put back after a complete exchange, with nothing left unread.

use std::io;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use http::uri::Authority;
use parking_lot::Mutex;
use tokio::net::TcpStream;

use super::CONNECT_TIMEOUT;
use super::http1::{IDLE_TIMEOUT, MAX_IDLE, spawn_reaper};

#[derive(Debug)]
pub struct Pool {
    host: String,
    port: u16,
    idle: Mutex<Vec<(TcpStream, Instant)>>,
    reaper: std::sync::Once,
}

impl Pool {
    pub fn new(authority: &Authority) -> Arc<Self> {
        Arc::new(Self {
            host: authority.host().trim_matches(['[', ']']).to_owned(),
            port: authority.port_u16().unwrap_or(80),
            idle: Mutex::new(Vec::new()),
            reaper: std::sync::Once::new(),
        })
    }

    /// The warmest idle connection that is still open. A connection the upstream closed shows
    /// as readable (its end of stream): that is checked without a system call while the event
    /// loop has not reported anything, which is the common case.
    pub fn checkout(&self, now: Instant) -> Option<TcpStream> {
        loop {
            let (stream, since) = self.idle.lock().pop()?;
            if now.saturating_duration_since(since) >= IDLE_TIMEOUT {
                continue;
            }
            if usable(&stream) {
                return Some(stream);
            }
        }
    }

    pub fn checkin(self: &Arc<Self>, stream: TcpStream, now: Instant) {
        {
            let mut idle = self.idle.lock();
            if idle.len() >= MAX_IDLE {
                return;
            }
            idle.push((stream, now));
        }
        self.start_reaper();
    }

    pub async fn connect(&self) -> io::Result<TcpStream> {
        let stream = tokio::time::timeout(
            CONNECT_TIMEOUT,
            TcpStream::connect((self.host.as_str(), self.port)),
        )
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        stream.set_nodelay(true)?;
        Ok(stream)
    }

    fn start_reaper(self: &Arc<Self>) {
        self.reaper.call_once(|| spawn_reaper(self, Self::reap));
    }

    /// Drops the idle connections that aged out by `now` or that the upstream closed (closed
    /// outside the lock).
    fn reap(&self, now: Instant) {
        let stale: Vec<_> = {
            let mut idle = self.idle.lock();
            let (keep, stale) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|(s, since)| {
                    now.saturating_duration_since(*since) < IDLE_TIMEOUT && usable(s)
                });
            *idle = keep;
            stale
        };
        drop(stale);
    }
}

/// An idle connection is usable while it has nothing to read: a readable one was closed by the
/// upstream (or sent bytes nobody asked for).
fn usable(stream: &TcpStream) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    match stream.poll_read_ready(&mut cx) {
        Poll::Pending => true,
        Poll::Ready(Err(_)) => false,
        // Readiness can be stale (the last read filled its buffer exactly): look.
        Poll::Ready(Ok(())) => {
            let mut byte = [0u8; 1];
            matches!(stream.try_read(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
        }
    }
}
