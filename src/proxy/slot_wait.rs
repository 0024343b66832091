//! A request waiting for a concurrency slot (`on_limit: delay` on `algorithm: concurrency`):
//! its place in its key's line ([`crate::limit::queue`]), and the whole route's decision made
//! again each time the place is woken, so that it is admitted only when every limit admits
//! (all or nothing: a decision that refuses charges nothing, so waiting charges nothing).
//!
//! Woken by a slot of its key given back in this instance, or by the place before it leaving.
//! A global limit's slots are also given back by other instances, which this one does not
//! hear of: the first place of a line also looks every [`GLOBAL_POLL`], one script call to
//! Redis each time. When `max_delay` has passed the request is decided once more without room
//! to wait: admitted if a slot is free just then, else the usual 429.

use std::future::Future;
use std::time::{Duration, Instant};

use super::Gateway;
use super::error::ProxyError;
use crate::config::Scope;
use crate::key::RequestParts;
use crate::limit::queue::GLOBAL_POLL;
use crate::limit::{Context, Held, Limit, Verdict, micros};
use crate::snapshot::Route;

/// Waits in the line `(limit, hash)` of `route` for the request `parts` first decided with
/// `cx`, until a decision does not ask it to wait; `ClientGone` when `gone` resolves first.
pub(super) async fn wait(
    gateway: &Gateway,
    route: &Route,
    parts: &RequestParts<'_>,
    cx: &Context<'_>,
    (limit, hash): (usize, u64),
    gone: impl Future<Output = ()>,
) -> Result<(Verdict, Held), ProxyError> {
    let limits = &route.limits;
    let l = &limits.limits[limit];
    let place = l.store.queue.join(hash);
    let deadline = tokio::time::Instant::from_std(cx.started) + Duration::from_micros(l.max_delay);
    // Only a global limit polls: other instances' releases are not announced.
    let mut poll = (l.scope == Scope::Global).then(|| {
        let mut poll =
            tokio::time::interval_at(tokio::time::Instant::now() + GLOBAL_POLL, GLOBAL_POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        poll
    });
    let abandoned = Abandoned(l);
    let mut gone = std::pin::pin!(gone);
    let mut expired = std::pin::pin!(tokio::time::sleep_until(deadline));
    loop {
        let last = tokio::select! {
            biased;
            () = &mut gone => return Err(ProxyError::ClientGone),
            () = &mut expired => true,
            () = place.turn() => false,
            _ = async { poll.as_mut().expect("guarded").tick().await }, if poll.is_some() => {
                if !place.is_first() {
                    continue;
                }
                false
            }
        };
        let now = Instant::now();
        let again = Context {
            now: gateway.clock.at(now),
            started: now,
            allow_delay: !last,
            waited: micros(now.duration_since(cx.started)).max(1),
            ..*cx
        };
        let (verdict, held) = limits.evaluate_held(parts, &again).await;
        if matches!(verdict, Verdict::Queue { .. }) {
            continue;
        }
        std::mem::forget(abandoned);
        return Ok((verdict, held));
    }
}

/// Counts a wait given up because the client left (dropped unforgotten): the request was
/// delayed, and abandoned.
struct Abandoned<'a>(&'a Limit);

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        self.0.metrics.delayed.inc();
        self.0.metrics.abandoned.inc();
    }
}
