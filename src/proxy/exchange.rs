//! The after-response phase: what must happen when an exchange ends, whichever way it ends
//! (answered in full, client gone, upstream failed, timed out, connection drained), in one
//! guard that runs exactly once. It observes `tollgate_request_duration_seconds`, gives back
//! the request's concurrency slots, and settles its costs from the response's status, head or
//! trailers (see `limit::held`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Instant;

use crate::limit::Held;
use crate::metrics::Histogram;
use crate::snapshot::ConfigSnapshot;

/// One exchange, from its head until its answer has been sent or abandoned. The codec owns it
/// for as long as the answer is being sent: the fast codec on its stack, the hyper codec inside
/// the response body ([`super::Guarded`]), so a body dropped half-sent still ends it.
pub(crate) struct ExchangeEnd {
    snapshot: Arc<ConfigSnapshot>,
    /// Index of the route, once routed; `None` counts under `_unmatched`.
    route: Option<usize>,
    started: Instant,
    /// What the admitted request holds until it ends: its concurrency slots, given back when
    /// the exchange ends (dropped with the guard), and its settlements.
    held: Held,
    /// The status whose head went out (0: none yet), so a panic caught later knows whether a
    /// 500 can still be sent. An atomic because the fast codec lends the guard out by `&`
    /// across awaits; a relaxed store is a plain store.
    answered: AtomicU16,
    /// Set once ended, so the drop does nothing more.
    ended: bool,
}

impl ExchangeEnd {
    /// An exchange whose head arrived at `started`, served on `snapshot`.
    #[inline]
    pub(crate) fn begin(snapshot: Arc<ConfigSnapshot>, started: Instant) -> Self {
        Self {
            snapshot,
            route: None,
            started,
            held: Held::default(),
            answered: AtomicU16::new(0),
            ended: false,
        }
    }

    /// The config the exchange is served on, for its whole life.
    #[inline]
    pub(crate) fn snapshot(&self) -> &Arc<ConfigSnapshot> {
        &self.snapshot
    }

    /// The route, once routed.
    #[inline]
    pub(crate) fn route(&self) -> Option<&crate::snapshot::Route> {
        self.route.map(|i| &self.snapshot.routes[i])
    }

    /// The exchange was routed to the route at `idx`.
    #[inline]
    pub(crate) fn routed(&mut self, idx: usize) {
        self.route = Some(idx);
    }

    /// The admitted request's slots and settlements, held until the exchange ends.
    #[inline]
    pub(crate) fn hold(&mut self, held: Held) {
        self.held = held;
    }

    /// The slots, taken out to be held elsewhere: by an upgraded connection's tunnel, which
    /// outlives the exchange (its 101 response has no body to hold them).
    pub(crate) fn take_held(&mut self) -> Held {
        std::mem::take(&mut self.held)
    }

    /// The answer's head went out with `status`: counted in `tollgate_requests_total`.
    #[inline]
    pub(crate) fn answered(&self, status: u16) {
        self.answered.store(status, Ordering::Relaxed);
        match self.route {
            Some(i) => self.snapshot.routes[i].metrics.request(status),
            None => self.snapshot.unmatched.request(status),
        }
    }

    /// The response head as the client gets it: settlements its status refunds, or its cost
    /// header prices, are applied.
    #[inline]
    pub(crate) fn response_head(&mut self, status: u16, headers: &http::HeaderMap) {
        if self.held.settles() {
            self.held.response_head(status, headers);
        }
    }

    /// The response's trailers: settlements still waiting read their cost there.
    #[inline]
    pub(crate) fn trailers(&mut self, trailers: &http::HeaderMap) {
        if self.held.settles() {
            self.held.trailers(trailers);
        }
    }

    /// Whether an answer's head has gone out (or is going: [`Self::answered`] comes first).
    #[inline]
    pub(crate) fn is_answered(&self) -> bool {
        self.answered.load(Ordering::Relaxed) != 0
    }

    /// Ends the exchange at `now` (a clock read the caller needed anyway).
    #[inline]
    pub(crate) fn end_at(mut self, now: Instant) {
        self.finish(now);
    }

    #[inline]
    fn histogram(&self) -> &Histogram {
        match self.route {
            Some(i) => &self.snapshot.routes[i].metrics.request_duration,
            None => &self.snapshot.unmatched.request_duration,
        }
    }

    #[inline]
    fn finish(&mut self, now: Instant) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        self.histogram()
            .observe(now.saturating_duration_since(self.started));
        if !self.held.is_empty() {
            self.held.end();
        }
    }
}

impl Drop for ExchangeEnd {
    #[inline]
    fn drop(&mut self) {
        // The clock is read only when the exchange has not been ended already.
        if !self.ended {
            self.finish(Instant::now());
        }
    }
}
