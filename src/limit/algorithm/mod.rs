//! Pure decision cores: `(state, now, cost) → admit | reject`, with no clock, I/O or metrics.
//!
//! Every algorithm is split into a read-only [`Algorithm::check`] and a mutating
//! [`Algorithm::commit`]. A request with several limits checks all of them first and commits
//! only when every one admitted, so a rejected request consumes from none. The Lua scripts in
//! `limit/redis/lua` mirror these functions step for step (same integer arithmetic, same
//! rounding), and a test drives both with one timeline.
//!
//! Time is integer microseconds ([`Micros`]) from an arbitrary epoch: the Unix epoch for Redis
//! (`TIME`), the process start for local limits. Microseconds since 1970 stay below 2^53, so Lua's
//! doubles hold every value the Rust side computes exactly.

pub mod calendar;
pub mod concurrency;
pub mod fixed_window;
pub mod gcra;
pub mod settle;
pub mod sliding_log;
pub mod sliding_window;

pub use calendar::Calendar;
pub use concurrency::{Concurrency, ConcurrencyState};
pub use fixed_window::{FixedWindow, WindowState, Windows};
pub use gcra::{Gcra, GcraState};
pub use settle::Settlement;
pub use sliding_log::{LogState, SlidingLog};
pub use sliding_window::{SlidingState, SlidingWindow};

/// Microseconds since the clock's epoch.
pub type Micros = u64;

/// `COUNT` per `period`, as the config states it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quota {
    /// Units admitted per period (the `COUNT` of `rate: COUNT/PERIOD`).
    pub count: u64,
    /// The period, in microseconds (> 0).
    pub period: Micros,
    /// gcra only: units that may be taken at once from a full bucket (default `count`).
    pub burst: u64,
}

/// What an admitted request leaves behind, for the `RateLimit` fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// Units that could still be taken right now after this decision.
    pub remaining: u64,
    /// Time until the state is back to full (nothing consumed is still counted).
    pub reset_after: Micros,
}

/// A rejection knows its answer: headers are formatted from it, never recomputed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// The same request (same cost) is admitted after this long, if nothing else is admitted
    /// meanwhile. Always > 0.
    pub retry_after: Micros,
    /// Units that could be taken right now (less than the request's cost).
    pub remaining: u64,
    /// Time until the state is back to full.
    pub reset_after: Micros,
}

/// One limit's algorithm with its parameters, compiled from the config once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// `gcra` (also `token_bucket` and `leaky_bucket`).
    Gcra(Gcra),
    /// `fixed_window`.
    FixedWindow(FixedWindow),
    /// `sliding_window`.
    SlidingWindow(SlidingWindow),
    /// `sliding_log`.
    SlidingLog(SlidingLog),
    /// `concurrency`: slots held, not a rate.
    Concurrency(Concurrency),
}

/// Per-key state of any algorithm. A fresh key starts from [`Algorithm::new_state`] ("full").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// State of a [`Gcra`] limit.
    Gcra(GcraState),
    /// State of a [`FixedWindow`] limit.
    FixedWindow(WindowState),
    /// State of a [`SlidingWindow`] limit.
    SlidingWindow(SlidingState),
    /// Boxed: a log is rare and large; inline it would make every key's state (in every
    /// store entry, for every algorithm) as big as a `VecDeque`.
    SlidingLog(Box<LogState>),
    /// State of a [`Concurrency`] limit.
    Concurrency(ConcurrencyState),
}

/// Runs `$body` with the algorithm and a reference to its own kind of state. A key holding
/// another kind's state (the limit's algorithm changed on reload) is read as a fresh key:
/// the old state means nothing to the new algorithm, and a fresh key is what it would have
/// become once evicted.
macro_rules! with_state {
    ($alg:expr, $state:expr, |$a:ident, $s:ident| $body:expr) => {
        match $alg {
            Algorithm::Gcra($a) => match $state {
                State::Gcra($s) => $body,
                _ => {
                    let $s = &$a.new_state();
                    $body
                }
            },
            Algorithm::FixedWindow($a) => match $state {
                State::FixedWindow($s) => $body,
                _ => {
                    let $s = &$a.new_state();
                    $body
                }
            },
            Algorithm::SlidingWindow($a) => match $state {
                State::SlidingWindow($s) => $body,
                _ => {
                    let $s = &$a.new_state();
                    $body
                }
            },
            Algorithm::SlidingLog($a) => match $state {
                State::SlidingLog($s) => $body,
                _ => {
                    let $s = &$a.new_state();
                    $body
                }
            },
            Algorithm::Concurrency($a) => match $state {
                State::Concurrency($s) => $body,
                _ => {
                    let $s = &$a.new_state();
                    $body
                }
            },
        }
    };
}

impl Algorithm {
    /// The quota the algorithm was built from.
    pub fn quota(&self) -> Quota {
        match self {
            Algorithm::Gcra(a) => a.quota(),
            Algorithm::FixedWindow(a) => a.quota(),
            Algorithm::SlidingWindow(a) => a.quota(),
            Algorithm::SlidingLog(a) => a.quota(),
            Algorithm::Concurrency(a) => a.quota(),
        }
    }

    /// The state of a key never seen (or evicted): nothing consumed.
    #[inline]
    pub fn new_state(&self) -> State {
        match self {
            Algorithm::Gcra(a) => State::Gcra(a.new_state()),
            Algorithm::FixedWindow(a) => State::FixedWindow(a.new_state()),
            Algorithm::SlidingWindow(a) => State::SlidingWindow(a.new_state()),
            Algorithm::SlidingLog(a) => State::SlidingLog(Box::new(a.new_state())),
            Algorithm::Concurrency(a) => State::Concurrency(a.new_state()),
        }
    }

    /// Decides without consuming, so that every limit of a request can be asked before any
    /// of them is charged.
    // This and the other dispatchers a decision calls are `#[inline]`: the store's decision is
    // their hot caller, and as calls their results came back through the stack.
    #[inline]
    pub fn check(&self, state: &State, now: Micros, cost: u64) -> Result<Snapshot, Rejection> {
        with_state!(self, state, |a, s| a.check(s, now, cost))
    }

    /// Charges an admitted request. Only meaningful after [`Algorithm::check`] (or
    /// [`Algorithm::reserve`]) admitted the same `cost` at the same `now` on this state;
    /// the returned snapshot then equals [`Algorithm::peek`] of the committed state.
    #[inline]
    pub fn commit(&self, state: &mut State, now: Micros, cost: u64) {
        match self {
            Algorithm::Gcra(a) => {
                if !matches!(state, State::Gcra(_)) {
                    *state = State::Gcra(a.new_state());
                }
                if let State::Gcra(s) = state {
                    a.commit(s, now, cost);
                }
            }
            Algorithm::FixedWindow(a) => {
                if !matches!(state, State::FixedWindow(_)) {
                    *state = State::FixedWindow(a.new_state());
                }
                if let State::FixedWindow(s) = state {
                    a.commit(s, now, cost);
                }
            }
            Algorithm::SlidingWindow(a) => {
                if !matches!(state, State::SlidingWindow(_)) {
                    *state = State::SlidingWindow(a.new_state());
                }
                if let State::SlidingWindow(s) = state {
                    a.commit(s, now, cost);
                }
            }
            Algorithm::SlidingLog(a) => {
                if !matches!(state, State::SlidingLog(_)) {
                    *state = State::SlidingLog(Box::new(a.new_state()));
                }
                if let State::SlidingLog(s) = state {
                    a.commit(s, now, cost);
                }
            }
            Algorithm::Concurrency(a) => {
                if !matches!(state, State::Concurrency(_)) {
                    *state = State::Concurrency(a.new_state());
                }
                if let State::Concurrency(s) = state {
                    a.commit(s, now, cost);
                }
            }
        }
    }

    /// Gives back `cost` slots a concurrency limit's [`Algorithm::commit`] took; nothing for the
    /// rate algorithms (whose units come back with time) or a state of another kind.
    #[inline]
    pub fn release(&self, state: &mut State, cost: u64) {
        if let (Algorithm::Concurrency(a), State::Concurrency(s)) = (self, state) {
            a.release(s, cost);
        }
    }

    /// Whether this is a concurrency limit (slots, not a rate): it sends no `RateLimit` fields,
    /// and its slots are given back when the request ends.
    #[inline]
    pub fn is_concurrency(&self) -> bool {
        matches!(self, Algorithm::Concurrency(_))
    }

    /// What the `RateLimit` fields and the admin endpoint report without a request.
    pub fn peek(&self, state: &State, now: Micros) -> Snapshot {
        with_state!(self, state, |a, s| a.peek(s, now))
    }

    /// From this instant on the state decides exactly as [`Algorithm::new_state`] would, so
    /// the store may drop the key (and Redis may expire it) without changing any decision.
    #[inline]
    pub fn full_at(&self, state: &State) -> Micros {
        with_state!(self, state, |a, s| a.full_at(s))
    }

    /// A cost above this is never admitted, whatever the wait; config refuses such limits.
    pub fn max_cost(&self) -> u64 {
        match self {
            Algorithm::Gcra(a) => a.max_cost(),
            Algorithm::FixedWindow(a) => a.max_cost(),
            Algorithm::SlidingWindow(a) => a.max_cost(),
            Algorithm::SlidingLog(a) => a.max_cost(),
            Algorithm::Concurrency(a) => a.max_cost(),
        }
    }

    /// Whether `on_limit: delay` makes sense: only gcra orders its capacity in time.
    pub fn can_reserve(&self) -> bool {
        match self {
            Algorithm::Gcra(a) => a.can_reserve(),
            Algorithm::FixedWindow(a) => a.can_reserve(),
            Algorithm::SlidingWindow(a) => a.can_reserve(),
            Algorithm::SlidingLog(a) => a.can_reserve(),
            Algorithm::Concurrency(a) => a.can_reserve(),
        }
    }

    /// [`Algorithm::check`] for `on_limit: delay`: admitted now or after the returned delay
    /// (at most `max_delay`); commit it at the same `now` either way. Algorithms that cannot
    /// reserve answer as `check` with a delay of 0.
    #[inline]
    pub fn reserve(
        &self,
        state: &State,
        now: Micros,
        cost: u64,
        max_delay: Micros,
    ) -> Result<(Snapshot, Micros), Rejection> {
        with_state!(self, state, |a, s| a.reserve(s, now, cost, max_delay))
    }
}

#[cfg(test)]
mod posix_zones;
#[cfg(test)]
mod testkit;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn quota() -> Quota {
        Quota {
            count: 5,
            period: 1000,
            burst: 3,
        }
    }

    fn all() -> [Algorithm; 4] {
        let q = quota();
        [
            Algorithm::Gcra(Gcra::new(q)),
            Algorithm::FixedWindow(FixedWindow::new(q)),
            Algorithm::SlidingWindow(SlidingWindow::new(q)),
            Algorithm::SlidingLog(SlidingLog::new(q)),
        ]
    }

    #[test]
    fn dispatch_reaches_each_algorithm() {
        for alg in all() {
            assert_eq!(alg.quota(), quota());
            let mut state = alg.new_state();
            let max = alg.max_cost();
            assert_eq!(max, if alg.can_reserve() { 3 } else { 5 });
            let snapshot = alg.check(&state, 100, max).unwrap();
            alg.commit(&mut state, 100, max);
            assert_eq!(alg.peek(&state, 100), snapshot);
            assert_eq!(snapshot.remaining, 0);
            assert!(alg.check(&state, 100, 1).is_err());
            assert!(alg.full_at(&state) > 100);
            let reserved = alg.reserve(&state, 100, 1, u64::MAX);
            assert_eq!(reserved.is_ok(), alg.can_reserve());
        }
    }

    #[test]
    fn a_state_of_another_kind_reads_as_fresh() {
        let algs = all();
        for alg in &algs {
            for other in &algs {
                let mut foreign = other.new_state();
                other.commit(&mut foreign, 100, 1);
                let fresh = alg.new_state();
                if std::mem::discriminant(&foreign) == std::mem::discriminant(&fresh) {
                    continue;
                }
                assert_eq!(alg.check(&foreign, 100, 1), alg.check(&fresh, 100, 1));
                assert_eq!(alg.peek(&foreign, 100), alg.peek(&fresh, 100));
                assert_eq!(alg.full_at(&foreign), alg.full_at(&fresh));
                assert_eq!(
                    alg.reserve(&foreign, 100, 1, 10),
                    alg.reserve(&fresh, 100, 1, 10)
                );
                let mut expected = fresh.clone();
                alg.commit(&mut expected, 100, 1);
                alg.commit(&mut foreign, 100, 1);
                assert_eq!(foreign, expected);
            }
        }
    }

    /// Edge values are where overflow hides; plain random u64s almost never hit them.
    fn edgy() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0),
            Just(1),
            Just(u64::MAX),
            Just(u64::MAX - 1),
            Just(1 << 63),
            0..100u64,
            any::<u64>(),
        ]
    }

    proptest! {
        /// Config guarantees sane quotas and the clock sane times, but a corrupt state or a
        /// stray value must not take the proxy down: nothing panics or overflows.
        #[test]
        fn arbitrary_inputs_never_panic(
            (count, period, burst) in (edgy(), edgy(), edgy()),
            (a, b, c) in (edgy(), edgy(), edgy()),
            (now, cost, max_delay) in (edgy(), edgy(), edgy()),
        ) {
            let q = Quota { count, period, burst };
            let algs = [
                Algorithm::Gcra(Gcra::new(q)),
                Algorithm::FixedWindow(FixedWindow::new(q)),
                Algorithm::SlidingWindow(SlidingWindow::new(q)),
                Algorithm::SlidingLog(SlidingLog::new(q)),
                Algorithm::FixedWindow(FixedWindow::calendar(q, Calendar::new(
                    calendar::Unit::Month,
                    jiff::tz::TimeZone::get("America/New_York").unwrap(),
                ))),
            ];
            let states = [
                State::Gcra(GcraState { tat: a }),
                State::FixedWindow(WindowState { start: a, count: b }),
                State::SlidingWindow(SlidingState { start: a, curr: b, prev: c }),
                State::SlidingLog(Box::new(LogState {
                    entries: [(a.min(b), c), (a.max(b), b)].into(),
                    sum: c,
                })),
            ];
            for alg in &algs {
                for state in &states {
                    let _ = alg.check(state, now, cost);
                    let _ = alg.reserve(state, now, cost, max_delay);
                    let _ = alg.peek(state, now);
                    let _ = alg.full_at(state);
                    let mut state = state.clone();
                    alg.commit(&mut state, now, cost);
                    alg.commit(&mut state, now.saturating_add(a), cost);
                    let _ = alg.peek(&state, now);
                }
            }
        }
    }
}
