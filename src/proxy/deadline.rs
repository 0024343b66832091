//! The route `timeout` over a response body still coming from the upstream.
//!
//! `timeout` bounds the whole upstream exchange (spec: "whole upstream exchange; past it:
//! 504"). Before the response head that is a 504; after it the status is gone, so an upstream
//! that stalls mid-body (or trickles it past the deadline) has its response cut: the client
//! connection is closed (HTTP/1.1) or the stream reset (HTTP/2), never ended as if complete.
//! Envoy's route timeout works the same way; a route that streams longer answers (downloads,
//! server-sent events) needs a `timeout` that long.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as _, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use super::Body;

pub(crate) use crate::connector::BoxError;

/// Put on a response by the forwarding code: when its upstream exchange must be over.
#[derive(Clone, Debug)]
pub(crate) struct BodyDeadline {
    pub at: Instant,
    pub route: Arc<str>,
}

/// The body hyper serves: as the handler made it, or cut at its deadline.
pub(crate) enum Served {
    Plain(Body),
    Timed {
        body: Body,
        at: Instant,
        /// Made the first time the body is not ready: a body that is (a small answer, read
        /// with its head) never puts a timer in the runtime's wheel, nor allocates one.
        sleep: Option<Pin<Box<Sleep>>>,
        route: Arc<str>,
    },
}

impl Served {
    pub(crate) fn new(body: Body, deadline: Option<BodyDeadline>) -> Self {
        match deadline {
            Some(d) if !body.is_end_stream() => Served::Timed {
                body,
                at: d.at,
                sleep: None,
                route: d.route,
            },
            _ => Served::Plain(body),
        }
    }
}

fn cut(route: &str) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    tracing::warn!(route = %route, "upstream timed out in the response body: cut");
    Poll::Ready(Some(Err(
        "the route's timeout ended the response body".into()
    )))
}

impl http_body::Body for Served {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Served::Plain(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
            Served::Timed {
                body,
                at,
                sleep,
                route,
            } => {
                // The deadline first: a body that is always ready (a fast upstream, a client
                // reading slowly) is cut at it too, as the fast path cuts its relay. Until a
                // timer exists, that is a look at the clock.
                let over = match sleep {
                    Some(sleep) => sleep.as_mut().poll(cx).is_ready(),
                    None => Instant::now() >= *at,
                };
                if over {
                    return cut(route);
                }
                let polled = Pin::new(body).poll_frame(cx).map_err(Into::into);
                if polled.is_pending() && sleep.is_none() {
                    let mut timer = Box::pin(tokio::time::sleep_until(*at));
                    if timer.as_mut().poll(cx).is_ready() {
                        return cut(route);
                    }
                    *sleep = Some(timer);
                }
                polled
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Served::Plain(b) | Served::Timed { body: b, .. } => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Served::Plain(b) | Served::Timed { body: b, .. } => b.size_hint(),
        }
    }
}
