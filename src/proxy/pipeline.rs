//! The phases every request goes through, written once and called by both codecs:
//!
//! 1. **refuse** what no upstream should be sent ([`refuse`]; the fast codec hands such requests
//!    to hyper before they get here, so only the hyper codec meets most of them);
//! 2. **route** ([`route`]): a bad path is 400 whether or not a route matches, then 404;
//! 3. **keys and admit** ([`super::Gateway::admit`]): the limits' decision;
//! 4. **upstream request**: the header rules of [`super::forwarding`], then
//!    the route's upstreams are tried in order ([`Tries`]);
//! 5. **response filter**: [`super::forwarding::client_response`];
//! 6. **after response**: [`super::exchange::ExchangeEnd`].
//!
//! Any phase that fails returns a [`ProxyError`]; [`super::error::rescue`] turns it into the
//! answer. A codec only parses, calls the phases, and writes what they decided.

use std::time::Instant;

use http::Method;

use super::error::ProxyError;
use crate::routing::path_problem;
use crate::snapshot::{ConfigSnapshot, Route, Upstream, UpstreamOrder};

/// What a request's first line and framing said, as far as refusals go.
pub(crate) struct Refusable<'a> {
    /// The request method.
    pub method: &'a Method,
    /// The target is in authority form (`host:port`), which is CONNECT's alone (RFC 9112
    /// §3.2.3).
    pub authority_form: bool,
    /// `Transfer-Encoding`, if any, is `chunked` alone: the one coding a body is passed on in.
    pub only_chunked: bool,
}

/// Phase 1: requests refused before routing, whatever route would match.
pub(crate) fn refuse(r: &Refusable<'_>) -> Result<(), ProxyError> {
    if *r.method == Method::CONNECT {
        Err(ProxyError::ConnectNotAllowed)
    } else if !r.only_chunked {
        Err(ProxyError::CodingNotImplemented)
    } else if r.authority_form {
        // nginx answers 400 too, where routing would have answered 404.
        Err(ProxyError::BadRequest(
            "the request target must start with / (or be an absolute URI)",
        ))
    } else {
        Ok(())
    }
}

/// Phase 2: the route for a request. A path no upstream should be sent (dot segments, bad
/// escapes, NUL) is refused first, whether or not a route would match it: 400, never a 404;
/// then a `Host` that is missing or not a host (`host`'s error).
#[inline]
pub(crate) fn route(
    snapshot: &ConfigSnapshot,
    method: &Method,
    host: Result<Option<&[u8]>, &'static str>,
    path: &str,
) -> Result<usize, ProxyError> {
    if let Some(why) = path_problem(path) {
        return Err(ProxyError::BadRequest(why));
    }
    let host = host.map_err(ProxyError::BadRequest)?;
    snapshot
        .table
        .find(method, host, path)
        .ok_or(ProxyError::NoRoute)
}

/// Phase 4's bookkeeping: the route's upstreams in the order to try them (those marked down
/// last), for a codec's loop that tries each until one takes the request. An upstream that
/// refused a connection (nothing of the request was sent) is marked down, nginx's `max_fails=1
/// fail_timeout=10s`, and the next one is tried; the last refusal is a 502. The time spent is
/// `tollgate_upstream_duration_seconds`.
///
/// A loop in each codec rather than a function taking the codec's try as an async closure: the
/// fast codec's try borrows its connection mutably, and such a closure's future cannot be
/// proven `Send` for the connection task.
pub(crate) struct Tries<'r> {
    route: &'r Route,
    order: UpstreamOrder<'r>,
    next: usize,
    started: Instant,
    refused: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl<'r> Tries<'r> {
    /// The tries of one request on `route`, which began at `started`.
    #[inline]
    pub(crate) fn new(route: &'r Route, started: Instant) -> Self {
        Self {
            route,
            order: route.upstream_order(),
            next: 0,
            started,
            refused: None,
        }
    }

    /// The next upstream to try.
    #[inline]
    pub(crate) fn next_upstream(&mut self) -> Option<&'r Upstream> {
        let u = self.order.get(self.next).copied();
        self.next += 1;
        u
    }

    /// `upstream` refused the connection: nothing of the request was sent.
    pub(crate) fn refused(
        &mut self,
        upstream: &Upstream,
        e: Box<dyn std::error::Error + Send + Sync>,
    ) {
        upstream.mark_down();
        if self.next < self.order.len() {
            tracing::warn!(route = %self.route.name, upstream = %upstream.authority, error = %e, "upstream refused the connection: trying the next");
        }
        self.refused = Some(e);
    }

    /// How the tries ended: `done` (an upstream took the request), else the last refusal.
    #[inline]
    pub(crate) fn outcome<T>(self, done: Option<Result<T, ProxyError>>) -> Result<T, ProxyError> {
        self.route
            .metrics
            .upstream_duration
            .observe(self.started.elapsed());
        done.unwrap_or_else(|| {
            Err(ProxyError::Upstream(
                self.refused
                    .unwrap_or_else(|| "the route has no upstream".into()),
            ))
        })
    }
}
