//! Upgraded connections (WebSocket) in flight, for the drain.
//!
//! After a `101` the HTTP connection is done, as far as hyper and the drain's connection count
//! know, and the bytes go through a task of their own. Counted here, those tunnels are waited
//! for on SIGTERM like in-flight requests (up to the grace period), as nginx keeps its
//! WebSockets until they close or `worker_shutdown_timeout`, instead of being cut at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

#[derive(Default, Debug)]
pub struct Tunnels {
    open: AtomicUsize,
    closed: Notify,
}

/// One open tunnel; dropping it closes it in the count.
pub struct Open(Arc<Tunnels>);

impl Drop for Open {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.closed.notify_waiters();
        }
    }
}

impl Tunnels {
    pub fn open(self: &Arc<Self>) -> Open {
        self.open.fetch_add(1, Ordering::AcqRel);
        Open(self.clone())
    }

    pub fn count(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Resolves once no tunnel is open.
    pub async fn all_closed(&self) {
        loop {
            let closed = self.closed.notified();
            tokio::pin!(closed);
            // Registered before the check, so a close between the two is not missed.
            closed.as_mut().enable();
            if self.count() == 0 {
                return;
            }
            closed.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn all_closed_waits_for_the_last_tunnel() {
        let t = Arc::new(Tunnels::default());
        t.all_closed().await;
        let (a, b) = (t.open(), t.open());
        assert_eq!(t.count(), 2);
        let waiting = tokio::spawn({
            let t = t.clone();
            async move { t.all_closed().await }
        });
        drop(a);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(b);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap();
    }
}
