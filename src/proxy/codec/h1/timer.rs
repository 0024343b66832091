//! A connection's timer for one kind of deadline (the wait for a request head, or the route
//! timeout of the exchange in progress), moved only when it has to fire earlier than it is set.
//!
//! Why: a timer set for every request (`tokio::time::timeout_at`, `Sleep::reset`) is an insert
//! into tokio's timer wheel and a removal from it, a visible part of a proxied request's
//! instructions (`bench/instructions.sh`). Deadlines on one connection mostly move later,
//! request after request, so the timer
//! is left where it is; when it fires before the deadline of the moment, it is set again, once
//! per timeout period at most. Only a deadline earlier than the timer (a route with a shorter
//! timeout than the last one) moves it back.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// Where a fresh timer is parked until its first deadline: further than any deadline it gets.
const PARKED: Duration = Duration::from_secs(86_400 * 365);

pub(crate) struct LazyTimer {
    sleep: Pin<Box<Sleep>>,
}

/// The deadline passed first.
#[derive(Debug)]
pub(crate) struct Elapsed;

impl Default for LazyTimer {
    fn default() -> Self {
        Self::new()
    }
}

impl LazyTimer {
    pub(crate) fn new() -> Self {
        Self {
            // Not in the timer wheel until first polled.
            sleep: Box::pin(tokio::time::sleep(PARKED)),
        }
    }

    /// Completes at `deadline`, never before.
    pub(crate) async fn until(&mut self, deadline: Instant) {
        if self.sleep.deadline() > deadline {
            self.sleep.as_mut().reset(deadline);
        }
        loop {
            self.sleep.as_mut().await;
            if Instant::now() >= deadline {
                return;
            }
            // Set for an earlier request's deadline: now this one's.
            self.sleep.as_mut().reset(deadline);
        }
    }

    /// `fut`'s output, or [`Elapsed`] when `deadline` comes first (`fut` is polled first, as
    /// `tokio::time::timeout_at` does).
    pub(crate) async fn within<F: Future>(
        &mut self,
        deadline: Instant,
        fut: F,
    ) -> Result<F::Output, Elapsed> {
        tokio::pin!(fut);
        tokio::select! {
            biased;
            out = &mut fut => Ok(out),
            () = self.until(deadline) => Err(Elapsed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_timer_that_fires_early_waits_on_to_the_deadline() {
        let mut t = LazyTimer::new();
        let first = Instant::now() + Duration::from_millis(20);
        t.until(first).await;
        assert!(Instant::now() >= first);
        // Still set for `first`, which has passed: it fires at once and is set again.
        let second = Instant::now() + Duration::from_millis(30);
        t.until(second).await;
        assert!(Instant::now() >= second);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_earlier_deadline_moves_the_timer_back() {
        let mut t = LazyTimer::new();
        let late = Instant::now() + Duration::from_secs(5);
        let quick = tokio::time::sleep(Duration::from_millis(10));
        assert!(t.within(late, quick).await.is_ok());
        // The timer is in the wheel for `late`; this deadline is much earlier.
        let from = Instant::now();
        let near = from + Duration::from_millis(20);
        let slow = tokio::time::sleep(Duration::from_secs(5));
        assert!(t.within(near, slow).await.is_err());
        // On paused time the clock moves exactly to the deadline that fired.
        assert_eq!(Instant::now(), near);
        assert!(from.elapsed() < Duration::from_secs(2));
        assert_eq!(
            t.within(near, async { 7 }).await.unwrap(),
            7,
            "the output comes first"
        );
    }
}
