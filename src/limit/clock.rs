//! The one clock local limits read, injected so tests control time.
//!
//! Production reads `tokio::time::Instant`, so `tokio::time::pause()` moves limiter time and
//! delay sleeps together; unit tests use [`ManualClock`]. Global limits decide on the Redis
//! server's clock; this one only bounds how long units reserved there (`reserve_ahead`) may
//! be spent here, a duration that needs no agreement with Redis.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::algorithm::Micros;

/// Where local limits read the time: [`TokioClock`] in the gateway, [`ManualClock`] in tests.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// Monotonic microseconds since an epoch (for [`TokioClock`], about 1970).
    fn now(&self) -> Micros;

    /// The time at `t`, an instant the caller has just read: a request reads the clock once
    /// for its decision's time and its duration metrics. Clocks not on real time ignore it.
    fn at(&self, t: std::time::Instant) -> Micros {
        let _ = t;
        self.now()
    }
}

/// The clock handle the gateway passes around.
pub type SharedClock = Arc<dyn Clock>;

/// Monotonic clock on `tokio::time::Instant` (follows a paused test runtime), counted from the
/// wall-clock time it was created at: windows (`fixed_window`, `sliding_window`) then start on
/// the wall clock's boundaries (a `1m` window at every whole minute, a `1d` one at midnight
/// UTC) as operators expect and as global limits' windows do on Redis's clock, while the
/// clock itself never jumps with the system time.
#[derive(Debug)]
pub struct TokioClock {
    start: tokio::time::Instant,
    /// Microseconds since 1970 at `start`.
    epoch: Micros,
}

impl TokioClock {
    /// A clock counting on from the wall-clock time now (never less than a day past 1970).
    pub fn new() -> Self {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()
            .and_then(|d| u64::try_from(d.as_micros()).ok());
        Self {
            start: tokio::time::Instant::now(),
            epoch: wall.unwrap_or(EPOCH_OFFSET).max(EPOCH_OFFSET),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

/// The least `now` can be, should the system clock read before 1970: keeps local time far
/// from 0 so no algorithm sees "before the epoch" arithmetic.
const EPOCH_OFFSET: Micros = 86_400_000_000;

impl TokioClock {
    fn since_start(&self, t: tokio::time::Instant) -> Micros {
        let e = t.saturating_duration_since(self.start).as_micros();
        self.epoch
            .saturating_add(u64::try_from(e).unwrap_or(u64::MAX))
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Micros {
        self.since_start(tokio::time::Instant::now())
    }

    /// `tokio::time::Instant` is `std::time::Instant` unless tokio's `test-util` pauses time,
    /// a feature tollgate does not enable.
    fn at(&self, t: std::time::Instant) -> Micros {
        self.since_start(tokio::time::Instant::from_std(t))
    }
}

/// A clock that moves only when told; for tests.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock reading `start` until moved.
    pub fn new(start: Micros) -> Self {
        Self(AtomicU64::new(start))
    }
    /// Sets the time to `t` (microseconds); it may move backwards.
    pub fn set(&self, t: Micros) {
        self.0.store(t, Ordering::SeqCst)
    }
    /// Moves the time forward by `d` microseconds.
    pub fn advance(&self, d: Micros) {
        self.0.fetch_add(d, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Micros {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokio_clock_reads_wall_time_since_1970() {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        let now = TokioClock::new().now();
        assert!(now.abs_diff(wall) < 60_000_000, "{now} vs {wall}");
    }
}
