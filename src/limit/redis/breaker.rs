//! Circuit breaker for the Redis tier: a pure state machine, clock passed in by the caller.
//!
//! Without it a dead Redis costs every request the full command timeout. After
//! [`Breaker::threshold`] consecutive outage failures it opens, requests skip Redis at once,
//! and only a background probe (PING every [`Breaker::probe_every`]) talks to Redis until one
//! answers. Until the first answer the state is [`Health::Unknown`]: requests are let through
//! (Redis is probably fine at startup) and the probe runs, so a Redis that is down from the
//! start opens the breaker even if no request arrives.

use std::time::{Duration, Instant};

/// The breaker's state: whether requests go to Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// No answer from Redis yet: requests go through, the probe runs.
    Unknown,
    /// Redis answered last time.
    Closed,
    /// Too many consecutive failures since `since`: requests are refused without I/O.
    Open {
        /// When it opened.
        since: Instant,
    },
}

/// A change worth a log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// Consecutive outage failures reached the threshold: requests now skip Redis.
    Opened,
    /// Redis answered while the breaker was open or unknown: requests go to it again.
    Closed {
        /// How long it was open (zero when it closes from `Unknown`).
        after: Duration,
    },
}

/// The circuit breaker (see the module); the caller passes the time in.
#[derive(Clone, Debug)]
pub struct Breaker {
    health: Health,
    failures: u32,
    threshold: u32,
    probe_every: Duration,
    last_probe: Option<Instant>,
}

impl Breaker {
    /// A breaker in [`Health::Unknown`] that opens after `threshold` consecutive outage failures
    /// (at least 1) and then probes every `probe_every`.
    pub fn new(threshold: u32, probe_every: Duration) -> Self {
        Self {
            health: Health::Unknown,
            failures: 0,
            threshold: threshold.max(1),
            probe_every,
            last_probe: None,
        }
    }

    /// The current state.
    pub fn health(&self) -> Health {
        self.health
    }

    /// Consecutive outage failures that open the breaker.
    pub fn threshold(&self) -> u32 {
        self.threshold
    }

    /// How often the probe PINGs while the breaker is not closed.
    pub fn probe_every(&self) -> Duration {
        self.probe_every
    }

    /// Whether a request may go to Redis.
    pub fn allows_requests(&self) -> bool {
        !matches!(self.health, Health::Open { .. })
    }

    /// Redis answered (a request or a probe).
    pub fn record_success(&mut self, now: Instant) -> Option<Transition> {
        self.failures = 0;
        let transition = match self.health {
            Health::Closed => None,
            Health::Unknown => Some(Transition::Closed {
                after: Duration::ZERO,
            }),
            Health::Open { since } => Some(Transition::Closed {
                after: now.saturating_duration_since(since),
            }),
        };
        self.health = Health::Closed;
        transition
    }

    /// Redis timed out or the connection failed.
    pub fn record_failure(&mut self, now: Instant) -> Option<Transition> {
        if let Health::Open { .. } = self.health {
            return None;
        }
        self.failures = self.failures.saturating_add(1);
        if self.failures < self.threshold {
            return None;
        }
        self.health = Health::Open { since: now };
        // The first probe waits a full interval: Redis just failed several times.
        self.last_probe = Some(now);
        Some(Transition::Opened)
    }

    /// Whether the probe should PING now; if so, the probe is counted as started.
    pub fn probe_due(&mut self, now: Instant) -> bool {
        if self.health == Health::Closed {
            return false;
        }
        let due = self
            .last_probe
            .is_none_or(|last| now.saturating_duration_since(last) >= self.probe_every);
        if due {
            self.last_probe = Some(now);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROBE: Duration = Duration::from_millis(250);

    fn ms(t0: Instant, n: u64) -> Instant {
        t0 + Duration::from_millis(n)
    }

    #[test]
    fn starts_unknown_letting_requests_through_and_probing() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, PROBE);
        assert_eq!(b.health(), Health::Unknown);
        assert!(b.allows_requests());
        assert!(b.probe_due(t0));
        assert!(!b.probe_due(ms(t0, 249)));
        assert!(b.probe_due(ms(t0, 250)));
        assert_eq!(
            b.record_success(ms(t0, 251)),
            Some(Transition::Closed {
                after: Duration::ZERO
            })
        );
        assert_eq!(b.health(), Health::Closed);
        assert!(!b.probe_due(ms(t0, 10_000)), "no probing while closed");
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, PROBE);
        b.record_success(t0);
        assert_eq!(b.record_failure(t0), None);
        assert_eq!(b.record_failure(t0), None);
        // A success in between resets the count.
        b.record_success(t0);
        assert_eq!(b.record_failure(t0), None);
        assert_eq!(b.record_failure(t0), None);
        assert!(b.allows_requests());
        assert_eq!(b.record_failure(ms(t0, 5)), Some(Transition::Opened));
        assert!(!b.allows_requests());
        assert_eq!(b.health(), Health::Open { since: ms(t0, 5) });
        // Further failures (late in-flight requests) change nothing.
        assert_eq!(b.record_failure(ms(t0, 6)), None);
    }

    #[test]
    fn a_down_redis_at_startup_opens_it_from_probes() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, PROBE);
        for i in 0..2 {
            assert!(b.probe_due(ms(t0, i * 250)));
            assert_eq!(b.record_failure(ms(t0, i * 250 + 50)), None);
        }
        assert!(b.probe_due(ms(t0, 500)));
        assert_eq!(b.record_failure(ms(t0, 550)), Some(Transition::Opened));
        assert!(!b.allows_requests());
    }

    #[test]
    fn probes_every_interval_while_open_and_closes_on_answer() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, PROBE);
        b.record_success(t0);
        for _ in 0..3 {
            b.record_failure(t0);
        }
        assert!(
            !b.probe_due(ms(t0, 100)),
            "first probe one interval after opening"
        );
        assert!(b.probe_due(ms(t0, 250)));
        assert!(!b.probe_due(ms(t0, 300)));
        b.record_failure(ms(t0, 300));
        assert!(!b.allows_requests());
        assert!(b.probe_due(ms(t0, 500)));
        assert_eq!(
            b.record_success(ms(t0, 510)),
            Some(Transition::Closed {
                after: Duration::from_millis(510)
            })
        );
        assert!(b.allows_requests());
        // Closed again: it takes a full threshold of new failures to reopen.
        assert_eq!(b.record_failure(ms(t0, 600)), None);
        assert!(b.allows_requests());
    }

    #[test]
    fn threshold_is_at_least_one() {
        let t0 = Instant::now();
        let mut b = Breaker::new(0, PROBE);
        assert_eq!(b.threshold(), 1);
        assert_eq!(b.record_failure(t0), Some(Transition::Opened));
    }
}
