//! The proxy: one pipeline of phases ([`pipeline`]) that both codecs ([`codec`]) call, the
//! header rules ([`forwarding`]), one error type and its rescue ([`error`]), and the
//! after-response guard ([`exchange`]).
//!
//! [`Gateway`] is the state every connection shares. A request reads one [`ConfigSnapshot`] for
//! its whole life. Limits are decided before a byte of the body is read; an admitted request's
//! body streams to the upstream and the upstream's body streams back, neither buffered.

pub(crate) mod codec;
pub(crate) mod deadline;
pub(crate) mod error;
pub(crate) mod exchange;
pub(crate) mod fields;
pub(crate) mod forward;
pub(crate) mod forwarding;
pub(crate) mod headers;
pub(crate) mod pipeline;
pub(crate) mod raw_upstream;
pub(crate) mod request_id;
pub(crate) mod response;
mod slot_wait;
pub(crate) mod tunnels;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use arc_swap::ArcSwap;

use self::error::{ProxyError, SlotWait};
use crate::connector::Connector;
use crate::key::RequestParts;
use crate::limit::algorithm::Rejection;
use crate::limit::clock::SharedClock;
use crate::limit::{Context, HeaderInfo, Held, Verdict};
use crate::metrics::Metrics;
use crate::panics::Panic;
use crate::snapshot::{ConfigSnapshot, Route};

pub(crate) use crate::connector::Body;

/// Everything a request needs, shared by all connections.
pub struct Gateway {
    /// The running config; a request loads it once.
    pub snapshot: ArcSwap<ConfigSnapshot>,
    /// Every metric, registered once.
    pub metrics: Arc<Metrics>,
    /// The clock limits decide on.
    pub clock: SharedClock,
    /// Every upstream connection.
    pub connector: Connector,
    /// `X-Forwarded-Proto` for requests on this listener.
    pub proto: &'static str,
    /// Upgraded connections still open, which the drain waits for.
    pub tunnels: Arc<tunnels::Tunnels>,
}

impl Gateway {
    /// Phase 3, the limits' answer for a routed request: leave to forward (after an optional
    /// wait, the caller's, so each codec can notice a client leaving in its own way), or why
    /// not (429, 503, the `on_missing: reject` 429).
    ///
    /// A request refused only for lack of a concurrency slot that may wait for one gets
    /// [`ProxyError::Queued`]: its wait is the caller's too ([`Gateway::wait_for_slot`]), so
    /// that only a request that waits carries the wait's state (a client-gone future made for
    /// every request cost the admit path about 130 instructions).
    pub(crate) async fn admit<'r>(
        &self,
        rt: &ConfigSnapshot,
        route: &'r Route,
        parts: &RequestParts<'_>,
        request_id: request_id::LogId<'_>,
    ) -> Result<Admitted<'r>, ProxyError> {
        #[cfg(feature = "panic-injection")]
        crate::panics::inject::request(parts.uri.path());
        let limits = &route.limits;
        if limits.is_empty() {
            return Ok(Admitted {
                info: None,
                delay: std::time::Duration::ZERO,
                delayed_by: None,
                waiter: None,
                held: Held::default(),
            });
        }
        // A slot in the route's waiter cap is taken before deciding, so a request that would
        // have to wait past the cap is rejected without reserving anything.
        let mut waiter = None;
        let allow_delay = limits.can_delay && {
            waiter = WaiterSlot::acquire(route);
            waiter.is_some()
        };
        let started = std::time::Instant::now();
        let cx = self.context(rt, started, allow_delay);
        // Someone already waits for a slot of this request's key: it queues behind them
        // undecided, not taking the slot one of them was woken for.
        let busy = match limits.queue {
            Some(_) if allow_delay => limits.busy_line(parts),
            _ => None,
        };
        let (verdict, held) = match busy {
            None => limits.evaluate_held(parts, &cx).await,
            Some((limit, hash)) => {
                return Err(ProxyError::Queued(Box::new(SlotWait {
                    limit,
                    hash,
                    rejection: Rejection {
                        retry_after: 0,
                        remaining: 0,
                        reset_after: 0,
                    },
                    started,
                })));
            }
        };
        if let Verdict::Queue {
            limit,
            rejection,
            hash,
        } = verdict
        {
            return Err(ProxyError::Queued(Box::new(SlotWait {
                limit,
                hash,
                rejection,
                started,
            })));
        }
        self.admission(rt, route, parts, request_id, (verdict, held), waiter)
    }

    /// A request [`Gateway::admit`] answered [`ProxyError::Queued`] waits in its key's line
    /// (`slot_wait`) until it is admitted, `max_delay` passes, or `gone` resolves (the codec's
    /// sign that the client left: then `ClientGone`). It takes its place in the route's waiter
    /// cap again; found full, it is decided once more without room to wait.
    ///
    /// The future is made on the heap here, in a plain function, so that the codecs' request
    /// futures hold a pointer to it and not room for it.
    pub(crate) fn wait_for_slot<'a, 'r: 'a>(
        &'a self,
        rt: &'a ConfigSnapshot,
        route: &'r Route,
        parts: &'a RequestParts<'_>,
        request_id: request_id::LogId<'a>,
        queued: Box<SlotWait>,
        gone: impl Future<Output = ()> + 'a,
    ) -> std::pin::Pin<Box<impl Future<Output = Result<Admitted<'r>, ProxyError>> + 'a>> {
        Box::pin(self.wait_in_line(rt, route, parts, request_id, queued, gone))
    }

    async fn wait_in_line<'r>(
        &self,
        rt: &ConfigSnapshot,
        route: &'r Route,
        parts: &RequestParts<'_>,
        request_id: request_id::LogId<'_>,
        queued: Box<SlotWait>,
        gone: impl Future<Output = ()>,
    ) -> Result<Admitted<'r>, ProxyError> {
        let waiter = WaiterSlot::acquire(route);
        let cx = self.context(rt, queued.started, waiter.is_some());
        let decided = if waiter.is_some() {
            slot_wait::wait(self, route, parts, &cx, (queued.limit, queued.hash), gone).await?
        } else {
            route.limits.evaluate_held(parts, &cx).await
        };
        self.admission(rt, route, parts, request_id, decided, waiter)
    }

    /// What a request's limits decided at `started`, with room to wait or not.
    #[inline]
    fn context<'a>(
        &'a self,
        rt: &'a ConfigSnapshot,
        started: std::time::Instant,
        allow_delay: bool,
    ) -> Context<'a> {
        Context {
            now: self.clock.at(started),
            started,
            clock: &*self.clock,
            probe_wait: rt
                .config
                .redis
                .as_ref()
                .map_or(std::time::Duration::ZERO, |r| r.timeout),
            redis: rt.redis.as_ref(),
            on_error: rt.on_error,
            leases: rt.leases.as_ref(),
            allow_delay,
            waited: 0,
            metrics: &self.metrics,
        }
    }

    /// A decision's verdict as the codecs take it: admitted (with what it holds), or the error
    /// its answer is written from.
    #[inline]
    fn admission<'r>(
        &self,
        rt: &ConfigSnapshot,
        route: &'r Route,
        parts: &RequestParts<'_>,
        request_id: request_id::LogId<'_>,
        (verdict, mut held): (Verdict, Held),
        waiter: Option<WaiterSlot<'r>>,
    ) -> Result<Admitted<'r>, ProxyError> {
        let limits = &route.limits;
        if held.settles() {
            held.set_clock(self.clock.clone());
        }
        match verdict {
            Verdict::Reject {
                limit,
                rate,
                rejection,
            } => {
                let l = &limits.limits[limit];
                if rt.config.server.log_keys {
                    let mut key = crate::key::KeyBuf::new();
                    l.key.build(parts, &mut key);
                    let key = String::from_utf8_lossy(&key);
                    tracing::info!(%request_id, route = %route.name, limit = %l.name, status = route.rejection.as_ref().map_or(429, |r| r.status.as_u16()), %key, "rate limited");
                } else {
                    tracing::info!(%request_id, route = %route.name, limit = %l.name, status = route.rejection.as_ref().map_or(429, |r| r.status.as_u16()), "rate limited");
                }
                Err(ProxyError::Limited {
                    limit,
                    rate,
                    rejection,
                })
            }
            // Not returned by a decision after the wait (it is made without room to wait).
            Verdict::Queue {
                limit, rejection, ..
            } => Err(ProxyError::Limited {
                limit,
                rate: 0,
                rejection,
            }),
            Verdict::Unavailable { limit } => Err(ProxyError::LimiterUnavailable { limit }),
            Verdict::MissingKey { limit, part } => Err(ProxyError::MissingKey { limit, part }),
            Verdict::AmbiguousKey { limit, part } => Err(ProxyError::AmbiguousKey { limit, part }),
            Verdict::Admit {
                delay,
                delayed_by,
                info,
            } => Ok(Admitted {
                info,
                delay,
                delayed_by,
                waiter,
                held,
            }),
        }
    }
}

/// A panic caught in one request's handling, on either codec: counted under `task="request"`
/// and logged once, with the client, the route, the request id and what became of the
/// connection (`then`).
pub(crate) fn request_panicked(
    metrics: &Metrics,
    peer: SocketAddr,
    route: Option<&Route>,
    request_id: request_id::LogId<'_>,
    then: &'static str,
    p: &Panic,
) {
    metrics.panicked("request");
    tracing::error!(
        %peer,
        route = route.map_or("-", |r| &*r.name),
        %request_id,
        panic = %p.message,
        location = p.location(),
        backtrace = p.backtrace.as_deref(),
        then,
        "a panic ended a request"
    );
}

/// An admitted request: forward it after `delay` (its reserved slot), holding `waiter` until
/// then; `info` is the limit whose `RateLimit` fields the response carries; `held` (its
/// concurrency slots) is kept until the exchange ends.
pub(crate) struct Admitted<'r> {
    pub info: Option<HeaderInfo>,
    pub delay: std::time::Duration,
    pub delayed_by: Option<usize>,
    pub waiter: Option<WaiterSlot<'r>>,
    pub held: Held,
}

/// A place in a route's cap of waiting requests, released on drop.
pub(crate) struct WaiterSlot<'a>(&'a Route);

impl<'a> WaiterSlot<'a> {
    fn acquire(route: &'a Route) -> Option<Self> {
        let prev = route.waiters.fetch_add(1, Ordering::AcqRel);
        if prev >= route.max_waiters {
            route.waiters.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self(route))
    }
}

impl Drop for WaiterSlot<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

pub(crate) struct AbandonGuard<'a>(pub Option<&'a crate::limit::Limit>);

impl Drop for AbandonGuard<'_> {
    fn drop(&mut self) {
        if let Some(l) = self.0 {
            l.metrics.abandoned.inc();
        }
    }
}
