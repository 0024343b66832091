//! The one clock local limits read, injected so tests control time.
//!
//! Production reads `tokio::time::Instant`, so `tokio::time::pause()` moves limiter time and
//! delay sleeps together; unit tests use [`ManualClock`]. Global limits never read this clock:
//! their time is the Redis server's.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::algorithm::Micros;

pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// Monotonic microseconds since an arbitrary epoch.
    fn now(&self) -> Micros;
}

pub type SharedClock = Arc<dyn Clock>;

/// Monotonic clock on `tokio::time::Instant` (follows a paused test runtime).
#[derive(Debug)]
pub struct TokioClock {
    start: tokio::time::Instant,
}

impl TokioClock {
    pub fn new() -> Self {
        Self {
            start: tokio::time::Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

/// Keeps local time far from 0 so no algorithm sees "before the epoch" arithmetic.
const EPOCH_OFFSET: Micros = 86_400_000_000;

impl Clock for TokioClock {
    fn now(&self) -> Micros {
        let e = self.start.elapsed().as_micros();
        EPOCH_OFFSET + u64::try_from(e).unwrap_or(u64::MAX - EPOCH_OFFSET)
    }
}

/// A clock that moves only when told; for tests.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn new(start: Micros) -> Self {
        Self(AtomicU64::new(start))
    }
    pub fn set(&self, t: Micros) {
        self.0.store(t, Ordering::SeqCst)
    }
    pub fn advance(&self, d: Micros) {
        self.0.fetch_add(d, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Micros {
        self.0.load(Ordering::SeqCst)
    }
}
