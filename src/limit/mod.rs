//! Deciding a request's limits: all admit, or none consumes.
//!
//! [`LimitSet::evaluate`] builds each limit's key, skips limits whose key part is absent
//! (`on_missing: skip`), and decides in tiers, cheapest first:
//!
//! 1. the in-process tier in front of Redis ([`local::deny`]) rejects a global limit's key that
//!    Redis is known to reject right now, without a round trip;
//! 2. local and eventual limits are checked (not yet charged) in process: a rejection there
//!    needs no round trip either;
//! 3. the global limits go to the [`GlobalStore`] (Redis: one script call), which charges them
//!    only if all admit;
//! 4. then the local and eventual limits are checked again and charged, each check and its
//!    charge under one lock. Should a concurrent request have used their units in between (the
//!    only window where in-process and global limits are not one atomic step), this request is
//!    rejected and the global units it took stay taken: the race errs towards limiting.
//!
//! When Redis cannot answer, `redis.on_error` decides (in one place, `on_store_error`): `allow`
//! decides the global limits with their local stores (same quota, per instance) and counts
//! each such decision; `deny` answers 503. `shadow` limits are decided and counted but never
//! reject and never show in headers. Policy after the decision lives in one place
//! ([`LimitSet::conclude`]), where it is counted.
//!
//! A route with local and eventual limits only is decided here; one with strict global limits
//! goes through the steps in `global.rs`, each its own function. The orchestration is tested
//! against a fake store on a manual clock (`tests/`), one table row per combination.

pub mod algorithm;
pub mod budget;
pub mod clock;
pub mod eventual;
mod global;
pub mod held;
pub mod local;
pub mod overrides;
pub mod queue;
pub mod redis;
pub mod reserve;
#[cfg(test)]
mod tests;
pub mod top;

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use prometheus_client::metrics::counter::Counter;

use crate::config::{Consistency, LimitConfig, OnError, OnLimit, Scope};
use crate::key::{KeyOutcome, KeySpec, RequestParts};
use crate::metrics::{Histogram, LimitMetrics, Metrics};
use algorithm::{Algorithm, Concurrency, Micros, Rejection, Snapshot};
use eventual::EventualStore;
pub use global::GlobalStore;
pub use held::{AfterStore, Held, LeaseBook};
use local::deny::DenyCache;
use local::{LocalCheck, LocalStore, LocalVerdict};
pub use overrides::{Applied, LimitRate, Overrides};
use redis::{RedisError, RedisStore};
use top::TopKeys;

/// One limit of a route, compiled from its config.
#[derive(Debug)]
pub struct Limit {
    /// The limit's `name`, as the config, the metrics and the `RateLimit` fields give it.
    pub name: Arc<str>,
    /// The config it was compiled from, kept so a reload can tell whether the definition changed.
    pub config: LimitConfig,
    /// How the request's key for this limit is built (`key`, `on_missing`).
    pub key: KeySpec,
    /// The algorithm with its quota.
    pub algorithm: Algorithm,
    /// Units one request takes (`cost`, default 1).
    pub cost: u64,
    /// `local` (this instance) or `global` (Redis).
    pub scope: Scope,
    /// 0 unless `on_limit: delay`.
    pub max_delay: Micros,
    /// `shadow: true`: decided and counted, but never rejects and never shows in headers.
    pub shadow: bool,
    /// Kept across reloads when the limit's definition is unchanged. For a global limit it
    /// is the fallback store used while Redis cannot answer.
    pub store: Arc<LocalStore>,
    /// Global limits: what Redis is known to reject (the in-process tier).
    pub deny_cache: Arc<DenyCache>,
    /// `consistency: eventual`: decided here on counts synced with Redis periodically.
    pub eventual: Option<Arc<EventualStore>>,
    /// Eventual limits: how often counts are exchanged with Redis.
    pub sync_interval: Micros,
    /// Global limits: `tg:{ROUTE/LIMIT/` — the key value and `}` complete a Redis key whose
    /// hash tag holds all of it, so one limit's keys share a Cluster slot.
    pub redis_prefix: String,
    /// This limit's decision counters, labelled with its route.
    pub metrics: LimitMetrics,
    /// The rates a key can be decided under: the limit's own first (`rates[0]`, whose
    /// algorithm is `algorithm`), then one per distinct rate its overrides give.
    pub rates: Vec<LimitRate>,
    /// `overrides` and `overrides_file`, compiled; `None` without either.
    pub overrides: Option<Box<Overrides>>,
    /// The keys this limit rejected most in the last minute (the admin API's `top`); carried
    /// over reloads with the stores.
    pub top: Arc<TopKeys>,
    /// `settle:`: what the response's status or cost header does to the charge afterwards.
    pub settle: Option<Arc<crate::config::SettleConfig>>,
}

/// What a reset of one key forgot in this instance: whether each in-process store held it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forgotten {
    /// The local store: a local limit's state, or a global limit's `on_error: allow` fallback.
    pub local: bool,
    /// The in-process tier in front of Redis (global limits): what Redis was known to reject.
    pub deny_tier: bool,
    /// The counts of a `consistency: eventual` limit.
    pub eventual: bool,
}

/// A key reset everywhere this instance can reach: it is full again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reset {
    /// What this instance held.
    pub in_process: Forgotten,
    /// Global limits: how many of the key's Redis keys existed and were deleted; `None` for a
    /// local limit, which has none.
    pub redis_deleted: Option<u64>,
}

/// A reset that Redis did not confirm: the key was forgotten in this instance (`in_process`),
/// and its Redis state may or may not have been deleted (a timed-out `DEL` can still run).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("forgotten in this instance, but redis did not confirm the reset: {error}")]
pub struct ResetError {
    /// What this instance held, forgotten all the same.
    pub in_process: Forgotten,
    /// Why Redis did not answer.
    #[source]
    pub error: RedisError,
}

impl Limit {
    /// Compiles `config` for `route` with the stores given (carried over by a reload when the
    /// definition is unchanged). `eventual` is kept only by a global `consistency: eventual`
    /// limit, which gets a fresh store when it is `None`.
    pub fn new(
        route: &str,
        config: &LimitConfig,
        store: Arc<LocalStore>,
        deny_cache: Arc<DenyCache>,
        eventual: Option<Arc<EventualStore>>,
        metrics: LimitMetrics,
    ) -> Self {
        let (rates, overrides) = overrides::compile(config);
        let algorithm = rates[0].algorithm.clone();
        Self {
            name: config.name.as_str().into(),
            config: config.clone(),
            key: KeySpec {
                parts: config.key.clone(),
                on_missing: config.on_missing,
            },
            algorithm,
            cost: config.cost,
            scope: config.scope,
            max_delay: match config.on_limit {
                OnLimit::Delay => micros(config.max_delay),
                OnLimit::Reject => 0,
            },
            shadow: config.shadow,
            store,
            deny_cache,
            eventual: match (config.scope, config.consistency) {
                (Scope::Global, Consistency::Eventual) => Some(eventual.unwrap_or_default()),
                _ => None,
            },
            sync_interval: micros(config.sync_interval),
            redis_prefix: redis_prefix(route, config),
            metrics,
            rates,
            overrides: overrides.map(Box::new),
            top: Arc::default(),
            settle: config.settle.clone().map(Arc::new),
        }
    }

    /// Forgets `key` everywhere it is held, so its next request finds it full (the admin API's
    /// `DELETE`): for a global limit first its Redis keys (one `DEL` through `store`; `None`,
    /// no store could be set up, fails as Redis down does), then this instance's local store,
    /// in-process tier and eventual counts, whatever Redis answered. In that order, so that a
    /// request in between is answered by what this instance still holds (the old state: it
    /// errs towards limiting), never by a Redis answer from before the reset that the tier
    /// would then learn again. The Redis store publishes the reset, and the other instances
    /// forget the key in process when they hear it ([`Limit::forget_in_process`]).
    pub async fn reset<G: GlobalStore>(
        &self,
        key: &[u8],
        store: Option<&G>,
        local_now: Micros,
    ) -> Result<Reset, ResetError> {
        let redis = if self.scope == Scope::Global {
            let keys = self.reset_keys(key, local_now);
            Some(match store {
                Some(s) => s.reset(keys).await,
                None => Err(RedisError::Unavailable),
            })
        } else {
            None
        };
        let in_process = self.forget_in_process(key, local_now);
        match redis {
            None => Ok(Reset {
                in_process,
                redis_deleted: None,
            }),
            Some(Ok(n)) => Ok(Reset {
                in_process,
                redis_deleted: Some(n),
            }),
            Some(Err(error)) => Err(ResetError { in_process, error }),
        }
    }

    /// Forgets `key` in this instance only: its local store, in-process tier and eventual
    /// counts. What [`Limit::reset`] does after Redis, and what every instance does when it
    /// hears of a reset made elsewhere (see [`Limit::reset_key_of`]).
    pub fn forget_in_process(&self, key: &[u8], local_now: Micros) -> Forgotten {
        Forgotten {
            local: self.store.forget(key, local_now),
            deny_tier: self.deny_cache.forget(key, local_now),
            eventual: self
                .eventual
                .as_ref()
                .is_some_and(|ev| ev.forget(key, local_now)),
        }
    }

    /// The key a published reset names for this limit: `tag` is the reset keys' hash tag,
    /// `ROUTE/LIMIT/KEY`; `None` when it is another limit's (or this is not a global limit).
    pub fn reset_key_of<'t>(&self, tag: &'t str) -> Option<&'t [u8]> {
        if self.scope != Scope::Global {
            return None;
        }
        let own = self.redis_prefix.strip_prefix("tg:{")?;
        tag.strip_prefix(own)
            .filter(|k| !k.is_empty())
            .map(str::as_bytes)
    }

    /// Every Redis key that may hold `key`'s state of this limit, all in one hash slot: the
    /// strict state (also an eventual gcra limit's TAT) and, for an eventual window limit,
    /// the counters of the window now (Redis time, as this instance estimates it), the one
    /// before (a sliding window reads it) and the one after (a clock a little behind Redis's).
    pub fn reset_keys(&self, key: &[u8], local_now: Micros) -> Vec<String> {
        let mut keys = redis::redis_keys(&self.redis_key(key), &self.algorithm);
        if let Some(ev) = &self.eventual
            && !matches!(self.algorithm, Algorithm::Gcra(_))
        {
            let period = self.algorithm.quota().period;
            let ws = ev.window(&self.algorithm, local_now);
            for w in [ws.saturating_sub(period), ws, ws + period] {
                keys.push(self.eventual_key(key, w));
            }
            keys.dedup();
        }
        keys
    }

    /// The Redis base key of `key` for this limit: `redis_prefix`, the key, then `}`.
    pub fn redis_key(&self, key: &[u8]) -> String {
        let mut k = String::with_capacity(self.redis_prefix.len() + key.len() + 1);
        k.push_str(&self.redis_prefix);
        // Keys are ASCII by construction (`key` escapes everything else).
        k.push_str(std::str::from_utf8(key).unwrap_or("~invalid"));
        k.push('}');
        k
    }

    /// The rate at `i` of [`Limit::rates`] (what an [`Applied::Rate`] names), the limit's own
    /// for an index it does not have.
    #[inline]
    pub fn rate(&self, i: u16) -> &LimitRate {
        self.rates.get(usize::from(i)).unwrap_or(&self.rates[0])
    }

    /// The rate `key` gets by its key alone, for the admin API (an override on the client's
    /// address or a header needs a request, and is not seen here).
    pub fn rate_for_key(&self, key: &[u8]) -> Applied {
        self.overrides
            .as_ref()
            .map_or(Applied::Rate(0), |o| o.for_key(key))
    }

    /// A concurrency limit's slots (`None` for a rate limit).
    #[inline]
    fn slots(&self) -> Option<&Concurrency> {
        match &self.algorithm {
            Algorithm::Concurrency(c) => Some(c),
            _ => None,
        }
    }

    /// Decided by the local store alone (`scope: local`).
    fn is_local(&self) -> bool {
        self.scope == Scope::Local
    }

    /// Decided in Redis on every request (`scope: global`, `consistency: strict`).
    fn is_global(&self) -> bool {
        self.scope == Scope::Global && self.eventual.is_none()
    }

    /// How old an eventual key's totals may be for a decision to go on them: a key in use is
    /// synced every `sync_interval`, and a sync takes up to the Redis timeout (a failed one
    /// too, Redis down: the key then stays decided on what this instance holds). Older (the
    /// key was idle here while other instances may have admitted on it), it is learned again
    /// before the decision.
    fn fresh_for<G>(&self, cx: &Context<'_, G>) -> Micros {
        self.sync_interval + micros(cx.probe_wait)
    }

    /// The longest this limit may delay a request: none when the route's waiter cap is full
    /// (`allow_delay` false), so a request that would wait is rejected instead.
    fn delay_allowed(&self, allow_delay: bool) -> Micros {
        if allow_delay { self.max_delay } else { 0 }
    }

    /// Exchanges one key's counts of an eventual limit with Redis (`sync.lua`, or
    /// `sync_gcra.lua`): pushes its unpushed units, learns the window totals (gcra: the TAT).
    /// On failure the units stay for the next sync.
    pub async fn sync_eventual<G: GlobalStore>(
        &self,
        redis: &G,
        item: &eventual::SyncItem,
        clock: &dyn clock::Clock,
    ) -> Result<(), redis::RedisError> {
        let Some(ev) = &self.eventual else {
            return Ok(());
        };
        let period = self.algorithm.quota().period;
        // How long after its start a window's counter is read: a fixed window only during
        // itself, a sliding window's also as the previous window of the next one.
        let life = match self.algorithm {
            Algorithm::SlidingWindow(_) => 2 * period,
            _ => period,
        };
        let sent = clock.now();
        let reply = match &self.algorithm {
            // gcra has no windows: the units go on the TAT strict decisions use (same key).
            Algorithm::Gcra(g) => {
                let key =
                    redis::redis_keys(&self.redis_key(&item.key), &self.algorithm).swap_remove(0);
                redis
                    .sync_gcra(key, item.push_curr, (g.emission_interval(), g.tau()))
                    .await
                    .map(|(tat, now)| (tat, 0, now))
            }
            _ => {
                redis
                    .sync_counts(
                        (
                            self.eventual_key(&item.key, item.ws),
                            self.eventual_key(&item.key, item.ws.saturating_sub(period)),
                        ),
                        (item.push_curr, item.push_prev),
                        item.ws,
                        life,
                        period,
                    )
                    .await
            }
        };
        match reply {
            Ok((curr, prev, server_now)) => {
                ev.apply(
                    &self.algorithm,
                    item,
                    (curr, prev),
                    server_now,
                    sent,
                    clock.now(),
                );
                Ok(())
            }
            // Written, unanswered: Redis will run it (see `pushed_unanswered`).
            Err(e @ redis::RedisError::Timeout) => {
                ev.pushed_unanswered(&self.algorithm, item, clock.now());
                Err(e)
            }
            Err(e) => {
                ev.retry(&self.algorithm, item, clock.now());
                Err(e)
            }
        }
    }

    /// The Redis counter of window `ws` of an eventual limit's key.
    pub fn eventual_key(&self, key: &[u8], ws: Micros) -> String {
        let mut k = self.redis_key(key);
        k.push_str(":ev:");
        k.push_str(&ws.to_string());
        k
    }
}

/// Logs an `on_error: deny` answer at most once a second: an outage under load would otherwise
/// write a line per request. Every one is counted (`tollgate_redis_errors_total`, and the 503s
/// in `tollgate_requests_total`), and the circuit breaker logs when it opens and closes.
fn warn_deny(now: Micros, e: &redis::RedisError) {
    static LAST_SECOND: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);
    let second = now / 1_000_000;
    if LAST_SECOND.swap(second, std::sync::atomic::Ordering::Relaxed) != second {
        tracing::warn!(error = %e, "redis unavailable: on_error deny (logged once a second)");
    }
}

/// `w` of `RateLimit-Policy`: whole seconds, rounded up as Retry-After is (1500ms is 2, 500ms
/// is 1), so a client pacing itself by `w` never goes faster than the limit.
fn policy_window(period: Duration) -> u128 {
    period.as_micros().div_ceil(1_000_000).max(1)
}

#[cfg(test)]
#[test]
fn policy_window_rounds_up_to_whole_seconds() {
    let w = |ms| policy_window(Duration::from_millis(ms));
    assert_eq!((w(500), w(1000), w(1500), w(60_000)), (1, 1, 2, 60));
}

/// The start of every Redis key of a limit: `tg:{ROUTE/LIMIT/`, or `tg:{@LIMIT/` for a shared
/// limit (`- use:`), whose state is the same whichever route draws on it. `@` is outside the
/// alphabet of route names, so the two forms never meet.
fn redis_prefix(route: &str, config: &LimitConfig) -> String {
    if config.shared {
        format!("tg:{{@{}/", config.name)
    } else {
        format!("tg:{{{route}/{}/", config.name)
    }
}

/// `d` in microseconds, saturating at `u64::MAX`.
pub fn micros(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// What the `RateLimit` fields report: one limit's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderInfo {
    /// Index of the limit in the route's limits.
    pub limit: usize,
    /// Which of the limit's rates applied (an index into [`Limit::rates`]; 0: its own).
    pub rate: u16,
    /// Units left (`r` of the `RateLimit` field).
    pub remaining: u64,
    /// Time until the limit is full again; `t` of the `RateLimit` field, sent in whole seconds
    /// rounded up.
    pub reset_after: Micros,
}

/// The outcome of a request's limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Forward (after `delay`, when a slot was reserved). `info`: most restrictive limit.
    Admit {
        /// How long to wait before forwarding (zero when admitted at once).
        delay: Duration,
        /// The limit that reserved the slot being waited for, when `delay` > 0.
        delayed_by: Option<usize>,
        /// The `RateLimit` fields to send: the most restrictive enforced limit's; `None` when no
        /// enforced limit decided.
        info: Option<HeaderInfo>,
    },
    /// 429 from `limit` (index into the route's limits).
    Reject {
        /// Index of the rejecting limit in the route's limits (of several, the one with the
        /// longest `retry_after`).
        limit: usize,
        /// Which of its rates applied (an index into [`Limit::rates`]; 0: its own).
        rate: u16,
        /// Its answer, which the headers and the body report.
        rejection: Rejection,
    },
    /// Refused only for lack of a slot of the route's queueing concurrency limit (`on_limit:
    /// delay`), with room among the route's waiters: the request may wait in its key's line
    /// (`hash`, in the limit's [`LocalStore::queue`]) and be decided again when woken, or be
    /// answered `rejection` (decided once more without room to wait, it is a [`Verdict::Reject`]). Nothing was charged or counted.
    Queue {
        /// Index of the concurrency limit in the route's limits.
        limit: usize,
        /// Its answer, should the request not wait (or wait in vain).
        rejection: Rejection,
        /// The key's hash in the limit's store: its line.
        hash: u64,
    },
    /// `on_missing: reject` and the named key part is absent.
    MissingKey {
        /// Index of the limit in the route's limits.
        limit: usize,
        /// The absent key part, as the config writes it (`header:x-user-id`).
        part: String,
    },
    /// The named key part has several differing values: 400 (see [`KeyOutcome::Ambiguous`]).
    AmbiguousKey {
        /// Index of the limit in the route's limits.
        limit: usize,
        /// The key part with differing values, as the config writes it.
        part: String,
    },
    /// Redis could not answer and `redis.on_error: deny`: 503.
    Unavailable {
        /// Index of the first enforced global limit left unanswered (0 when only shadow ones
        /// were asked).
        limit: usize,
    },
}

/// What a decision needs besides the request.
///
/// `G` is the store strict global limits are decided in: [`RedisStore`] in the gateway, a fake
/// in the orchestration tests. A type parameter rather than `&dyn GlobalStore`: the gateway
/// has one store type, so the request path compiles to what it would be without the seam (no
/// vtable call and no boxed future per store call), and a route without global limits never
/// touches the store at all.
pub struct Context<'a, G = RedisStore> {
    /// Local monotonic time (global limits use Redis's clock inside the script).
    pub now: Micros,
    /// When the decision started, for the limiter-duration metrics: the instant `now` was read
    /// from ([`clock::Clock::at`]), so a decision reads the clock once at its start.
    pub started: std::time::Instant,
    /// For the time after a wait (a request following another's Redis call for a hot key).
    pub clock: &'a dyn clock::Clock,
    /// The longest a request waits for another's Redis call (the Redis timeout).
    pub probe_wait: Duration,
    /// The global store (Redis); `None` when it could not be set up: every global decision
    /// is then a failure, which `on_error` decides.
    pub redis: Option<&'a G>,
    /// `redis.on_error`: what global limits do when Redis cannot answer.
    pub on_error: OnError,
    /// The leases this instance holds in `redis` (global concurrency limits); `None` without
    /// Redis, and then a global concurrency limit is decided as when Redis cannot answer.
    pub leases: Option<&'a Arc<LeaseBook>>,
    /// `false` when the route's waiter cap is full: a request that would wait is rejected.
    pub allow_delay: bool,
    /// How long the request has waited for a slot so far (0: it has not): a decision after a
    /// slot wait counts the queueing limit's admission as `delayed`.
    pub waited: Micros,
    /// Where Redis errors are counted (each limit counts its decisions in its own `metrics`).
    pub metrics: &'a Metrics,
}

// By hand: derived, they would ask `G: Clone` / `G: Copy`, though only `&G` is copied.
impl<G> Clone for Context<'_, G> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<G> Copy for Context<'_, G> {}

/// Counters and timers of the tiers, resolved once per config build.
#[derive(Debug, Clone)]
pub struct TierMetrics {
    /// Decisions made in process (local and eventual limits only).
    pub local: Counter,
    /// Global decisions answered by the in-process tier, without Redis.
    pub in_process: Counter,
    /// Global decisions Redis answered.
    pub redis: Counter,
    /// Global decisions answered from units this instance reserved in Redis (`reserve_ahead`).
    pub reserved: Counter,
    /// Global decisions made by the local stores because Redis could not answer
    /// (`on_error: allow`).
    pub fallback: Counter,
    /// Time of the decisions made in process.
    pub local_duration: Histogram,
    /// Time of the decisions the in-process tier answered.
    pub in_process_duration: Histogram,
    /// Time of the decisions that asked Redis, answered or not.
    pub global_duration: Histogram,
}

impl TierMetrics {
    /// Resolves the handles in `m`.
    pub fn new(m: &Metrics) -> Self {
        Self {
            local: m.tier("local", "local"),
            in_process: m.tier("global", "in_process"),
            redis: m.tier("global", "redis"),
            reserved: m.tier("global", "reserved"),
            fallback: m.tier("global", "fallback"),
            local_duration: m.limiter_duration("local"),
            in_process_duration: m.limiter_duration("in_process"),
            global_duration: m.limiter_duration("global"),
        }
    }
}

/// A route's limits, decided together: all admit, or none consumes.
#[derive(Debug)]
pub struct LimitSet {
    /// In config order; a [`Verdict`]'s `limit` is an index into it.
    pub limits: Vec<Limit>,
    /// Whether any limit can reserve (so the proxy knows to count waiters).
    pub can_delay: bool,
    /// The enforced concurrency limit with `on_limit: delay` (config allows one per route, and
    /// no other delay limit beside it): requests it alone refuses wait in its key's line.
    pub queue: Option<usize>,
    /// The in-process tier answers for this route's global limits. Off on a Redis Cluster
    /// for routes with several enforced global limits: their keys sit on different slots and
    /// are reserved then refunded, so Redis's answers can reflect units that are given back a
    /// moment later, and a tier remembering them until `retry_after` would be stricter than
    /// Redis by more than a request's cost. No other route's keys are ever refunded.
    tier_enabled: bool,
    tiers: TierMetrics,
    /// Some limit's key has a `header:` part: the fast HTTP/1.1 path then builds a header map
    /// for the key (without one, it skips that work).
    pub reads_headers: bool,
    /// Some limit is `eventual`: without one, a local decision skips holding eventual keys.
    has_eventual: bool,
    /// Some limit is a concurrency limit, or settles its cost: an admitted request may hold
    /// slots or settlements until its exchange ends.
    has_after: bool,
    /// Some limit settles its cost from the response (`settle:`): the fast HTTP/1.1 path, which
    /// relays the response's bytes without reading its trailers, leaves the route to hyper.
    pub settles: bool,
    /// Some limit has overrides: without one, every key is decided under its limit's own rate
    /// and the verdict needs no rate looked up.
    has_overrides: bool,
}

/// One applicable limit of this request: its index, its key's span in the key buffer, and
/// the rate its key gets (an index into [`Limit::rates`]).
type Span = (usize, usize, usize, u16);

impl LimitSet {
    /// `cluster`: global limits live on a Redis Cluster.
    pub fn new(limits: Vec<Limit>, tiers: TierMetrics, cluster: bool) -> Self {
        let can_delay = limits.iter().any(|l| l.max_delay > 0);
        let has_eventual = limits.iter().any(|l| l.eventual.is_some());
        let settles = limits.iter().any(|l| l.settle.is_some());
        let has_after = settles || limits.iter().any(|l| l.slots().is_some());
        let enforced_global = limits.iter().filter(|l| l.is_global() && !l.shadow).count();
        let reads_headers = limits.iter().any(|l| {
            l.key
                .parts
                .iter()
                .any(|p| matches!(p, crate::config::KeyPart::Header(_)))
                || l.overrides.as_ref().is_some_and(|o| o.reads_headers)
        });
        let queue = limits
            .iter()
            .position(|l| l.slots().is_some() && l.max_delay > 0 && !l.shadow);
        Self {
            has_overrides: limits.iter().any(|l| l.overrides.is_some()),
            queue,
            tier_enabled: !(cluster && enforced_global > 1),
            reads_headers,
            has_eventual,
            has_after,
            settles,
            limits,
            can_delay,
            tiers,
        }
    }

    /// Whether the route has no limits (every request is admitted undecided).
    pub fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// The queueing concurrency limit's line this request belongs in, when others wait in it:
    /// a newcomer then takes a place behind them before it is decided, rather than the slot one
    /// of them was woken for. `None` when no one waits for that limit (one atomic load), or its
    /// key does not apply to this request (a part missing, or an override exempts it).
    pub fn busy_line(&self, req: &RequestParts<'_>) -> Option<(usize, u64)> {
        let i = self.queue?;
        let l = &self.limits[i];
        if l.store.queue.waiting() == 0 {
            return None;
        }
        let mut key = crate::key::KeyBuf::new();
        if !matches!(l.key.build(req, &mut key), KeyOutcome::Built) {
            return None;
        }
        if let Some(o) = &l.overrides
            && matches!(o.resolve(req, &key), Applied::Exempt)
        {
            return None;
        }
        let hash = l.store.key_hash(&key);
        l.store.queue.busy(hash).then_some((i, hash))
    }

    /// Decides every limit for this request. Slots an admitted request takes are given back at
    /// once: for a request that is not forwarded (the admin API, tests); the proxy uses
    /// [`LimitSet::evaluate_held`].
    pub async fn evaluate<G: GlobalStore>(
        &self,
        req: &RequestParts<'_>,
        cx: &Context<'_, G>,
    ) -> Verdict {
        self.evaluate_held(req, cx).await.0
    }

    /// Decides every limit for this request; an admitted request also gets what it holds until
    /// its exchange ends (its concurrency slots, given back when the [`Held`] drops). Any other
    /// verdict holds nothing.
    pub async fn evaluate_held<G: GlobalStore>(
        &self,
        req: &RequestParts<'_>,
        cx: &Context<'_, G>,
    ) -> (Verdict, Held) {
        if self.limits.is_empty() {
            return (
                Verdict::Admit {
                    delay: Duration::ZERO,
                    delayed_by: None,
                    info: None,
                },
                Held::default(),
            );
        }
        let started = cx.started;
        let mut keys = crate::key::KeyBuf::new();
        let mut spans: SmallVec<[Span; 4]> = SmallVec::new();
        for (i, limit) in self.limits.iter().enumerate() {
            let start = keys.len();
            match limit.key.build(req, &mut keys) {
                KeyOutcome::Built => match &limit.overrides {
                    None => spans.push((i, start, keys.len(), 0)),
                    Some(o) => match o.resolve(req, &keys[start..]) {
                        Applied::Rate(r) => spans.push((i, start, keys.len(), r)),
                        // Not counted by this limit at all, and never in its headers.
                        Applied::Exempt => {
                            limit.metrics.exempt.inc();
                            keys.truncate(start);
                        }
                    },
                },
                KeyOutcome::Skip => {}
                // A shadow limit never rejects: it counts what it would have done and does
                // not apply, as with `on_missing: skip`.
                KeyOutcome::Reject(_) if limit.shadow => {
                    limit.metrics.shadow_rejected.inc();
                }
                KeyOutcome::Reject(part) => {
                    limit.metrics.rejected.inc();
                    return (Verdict::MissingKey { limit: i, part }, Held::default());
                }
                // Refused (400) before any limit decides, counted as this limit's rejection as
                // a missing key is; a shadow limit counts what enforcing it would have refused
                // and does not apply.
                KeyOutcome::Ambiguous(_) if limit.shadow => {
                    limit.metrics.shadow_rejected.inc();
                }
                KeyOutcome::Ambiguous(part) => {
                    limit.metrics.rejected.inc();
                    return (Verdict::AmbiguousKey { limit: i, part }, Held::default());
                }
            }
        }
        if let Some(redis) = cx.redis {
            // Boxed like the Redis path: only a key's first request on this instance gets here.
            let new = |&&(i, s, e, _): &&Span| {
                let l = &self.limits[i];
                l.eventual
                    .as_ref()
                    .is_some_and(|ev| !ev.knows(&keys[s..e], cx.now, l.fresh_for(cx)))
            };
            if spans.iter().any(|sp| new(&sp)) {
                Box::pin(self.learn_eventual(&keys, &spans, new, redis, cx)).await;
                // That took up to a round trip: decide at the time it is now.
                let after = Context {
                    now: cx.clock.now(),
                    ..*cx
                };
                let mut held = Held::default();
                let verdict = self.decide(&keys, &spans, &after, started, &mut held).await;
                return self.finish(verdict, held, &keys, &spans, after.now);
            }
        }
        let mut held = Held::default();
        let verdict = self.decide(&keys, &spans, cx, started, &mut held).await;
        self.finish(verdict, held, &keys, &spans, cx.now)
    }

    /// The verdict as the request gets it: the rate each reported limit's key got (decided
    /// per span, reported per limit), and a 429's key recorded for `top`. What `held` took is
    /// given back unless the request is admitted (a race lost after Redis granted a lease).
    #[inline]
    fn finish(
        &self,
        mut verdict: Verdict,
        held: Held,
        keys: &[u8],
        spans: &[Span],
        now: Micros,
    ) -> (Verdict, Held) {
        if self.has_overrides {
            let rate_of = |limit: usize| spans.iter().find(|sp| sp.0 == limit).map_or(0, |sp| sp.3);
            match &mut verdict {
                Verdict::Reject { limit, rate, .. } => *rate = rate_of(*limit),
                Verdict::Admit {
                    info: Some(info), ..
                } => info.rate = rate_of(info.limit),
                _ => {}
            }
        }
        self.record_rejection(&verdict, keys, spans, now);
        if let Verdict::Queue { limit, hash, .. } = &mut verdict
            && let Some(&(_, s, e, _)) = spans.iter().find(|sp| sp.0 == *limit)
        {
            *hash = self.limits[*limit].store.key_hash(&keys[s..e]);
        }
        let mut held = held;
        if !held.is_empty() && !matches!(verdict, Verdict::Admit { .. }) {
            held.release();
        }
        (verdict, held)
    }

    /// A 429's key, into its limit's [`TopKeys`] (the admin API's `top`); nothing for any
    /// other verdict. The key is the one already built for the decision, so the reject path
    /// pays a hash and a short locked scan (see [`top`]), and an admitted request nothing.
    #[inline]
    fn record_rejection(&self, verdict: &Verdict, keys: &[u8], spans: &[Span], now: Micros) {
        if let Verdict::Reject { limit, .. } = *verdict
            && let Some(&(_, s, e, _)) = spans.iter().find(|sp| sp.0 == limit)
        {
            self.limits[limit].top.record(&keys[s..e], now);
        }
    }

    /// Decides every limit for this request, its keys built and its eventual keys known; the
    /// slots an admission takes go into `held`.
    async fn decide<G: GlobalStore>(
        &self,
        keys: &[u8],
        spans: &[Span],
        cx: &Context<'_, G>,
        started: std::time::Instant,
        held: &mut Held,
    ) -> Verdict {
        if spans.is_empty() {
            // Every limit was skipped (a key part missing, `on_missing: skip`): nothing decided,
            // so nothing is counted as a decision either.
            return self.conclude(&Results::new(), cx);
        }
        if spans.iter().any(|s| self.limits[s.0].is_global()) {
            // Boxed: the Redis path's state is large (about 13 KB of fred futures); inline, it
            // would be part of every request's future, local-only ones and waiters included.
            // One allocation per global decision is small next to its round trip.
            return Box::pin(self.evaluate_global(keys, spans, cx, started, held)).await;
        }
        if !self.has_eventual {
            // Local limits only, the common route: no eventual keys to hold, and the verdicts
            // are concluded where they are.
            let checks = self.local_checks(keys, spans, cx, Limit::is_local);
            let (admitted, verdicts) = local::decide(&checks, cx.now);
            if admitted && self.has_after {
                self.hold_local(keys, spans, cx, Limit::is_local, &verdicts, held);
            }
            self.count_local(started);
            return self.conclude_each(self.local_indexes(spans).zip(verdicts.iter()), cx);
        }
        // A request whose only limit is an eventual one: checked and charged at once.
        if let [(i, s, e, _)] = *spans
            && let Some(ev) = &self.limits[i].eventual
        {
            let l = &self.limits[i];
            let v = ev.decide(&l.algorithm, &keys[s..e], cx.now, l.cost);
            self.count_local(started);
            let mut results = Results::new();
            results.push((i, v.map(|snap| (snap, 0))));
            return self.conclude(&results, cx);
        }
        let mut results = Results::new();
        self.commit_in_process(keys, spans, cx, Limit::is_local, &mut results, held);
        self.count_local(started);
        self.conclude(&results, cx)
    }

    /// The slots of the concurrency limits `pick` selects that admitted (`verdicts`, one per
    /// picked span, in order) in a decision that charged them, and the settlements of those
    /// that settle, into `held`.
    fn hold_local<G>(
        &self,
        keys: &[u8],
        spans: &[Span],
        cx: &Context<'_, G>,
        pick: impl Fn(&Limit) -> bool,
        verdicts: &[LocalVerdict],
        held: &mut Held,
    ) {
        let picked = spans.iter().filter(|s| pick(&self.limits[s.0]));
        for (&(i, s, e, r), v) in picked.zip(verdicts) {
            let l = &self.limits[i];
            let Ok((snapshot, _)) = v else { continue };
            if l.slots().is_some() {
                held.local(&l.store, &keys[s..e], l.metrics.slots.as_ref());
            }
            if let Some(settle) = &l.settle {
                held.settle_local(
                    settle,
                    l.metrics.settle.as_ref(),
                    &l.store,
                    &l.rate(r).algorithm,
                    &keys[s..e],
                    (l.cost, cx.now, cx.now.saturating_add(snapshot.reset_after)),
                );
            }
        }
    }

    /// Counts a decision made in process (local and eventual limits), begun at `started`.
    fn count_local(&self, started: std::time::Instant) {
        self.tiers.local.inc();
        self.tiers.local_duration.observe(started.elapsed());
    }

    /// The indexes of the request's local limits, in the order [`LimitSet::local_checks`]
    /// lists their checks.
    fn local_indexes<'s>(&'s self, spans: &'s [Span]) -> impl Iterator<Item = usize> + Clone + 's {
        spans
            .iter()
            .filter(|s| self.limits[s.0].is_local())
            .map(|s| s.0)
    }

    /// Learns from Redis the totals of eventual keys this instance does not hold, before
    /// deciding on them: without it a client moving to an instance new to its key would get a
    /// fresh budget there until that instance's next sync. A failure leaves the key unknown (it
    /// is decided from this instance's own counts, as before any sync) and is counted.
    async fn learn_eventual<G: GlobalStore>(
        &self,
        keys: &[u8],
        spans: &[Span],
        new: impl Fn(&&Span) -> bool,
        redis: &G,
        cx: &Context<'_, G>,
    ) {
        let wait = micros(cx.probe_wait);
        let mut leads: SmallVec<[_; 2]> = SmallVec::new();
        let mut follows: SmallVec<[_; 2]> = SmallVec::new();
        for &(i, s, e, _) in spans.iter().filter(new) {
            let l = &self.limits[i];
            let Some(ev) = &l.eventual else { continue };
            match ev.begin_learn(&l.algorithm, &keys[s..e], cx.now, wait, l.fresh_for(cx)) {
                eventual::Learn::Known => {}
                eventual::Learn::Lead(guard) => leads.push((l, ev, guard)),
                eventual::Learn::Follow => follows.push((ev, &keys[s..e])),
            }
        }
        let pulls = leads.into_iter().map(|(l, ev, guard)| async move {
            let item = eventual::SyncItem::pull(guard.key(), ev.window(&l.algorithm, cx.now));
            let r = l.sync_eventual(redis, &item, cx.clock).await;
            drop(guard);
            r
        });
        for r in futures_util::future::join_all(pulls).await {
            if let Err(e) = r {
                cx.metrics.redis_error(e.kind());
            }
        }
        for (ev, key) in follows {
            ev.wait_learned(key, cx.clock, cx.now + wait).await;
        }
    }

    /// The request's eventual keys, locked in store-address order (one order for every
    /// request), with their limits' indexes in the route's order.
    fn hold_eventual<'k, G>(
        &'k self,
        keys: &'k [u8],
        spans: &[Span],
        cx: &Context<'_, G>,
    ) -> SmallVec<[(usize, eventual::Held<'k>); 2]> {
        if !self.has_eventual {
            return SmallVec::new();
        }
        let mut order: SmallVec<[(usize, &EventualStore, &'k [u8]); 2]> = spans
            .iter()
            .filter_map(|&(i, s, e, _)| Some((i, self.limits[i].eventual.as_deref()?, &keys[s..e])))
            .collect();
        order.sort_unstable_by_key(|(_, ev, _)| std::ptr::from_ref(*ev) as usize);
        let mut held: SmallVec<[(usize, eventual::Held<'k>); 2]> = order
            .into_iter()
            .map(|(i, ev, key)| (i, ev.hold(&self.limits[i].algorithm, key, cx.now)))
            .collect();
        held.sort_unstable_by_key(|(i, _)| *i);
        held
    }

    /// Charges the held eventual keys whose limit admitted when the request was admitted
    /// (`admitted`), and marks the ones that rejected for the next sync either way: a
    /// rejection needs fresh totals.
    fn charge_eventual(
        &self,
        held: &mut [(usize, eventual::Held<'_>)],
        results: &Results,
        admitted: bool,
    ) {
        for ((i, h), (_, v)) in held.iter_mut().zip(results) {
            let l = &self.limits[*i];
            match v {
                Ok(_) if admitted => h.charge(&l.algorithm, l.cost),
                Ok(_) => {}
                Err(_) => h.charge(&l.algorithm, 0),
            }
        }
    }

    /// Every eventual limit's answer for this request, without charging.
    fn check_eventual<G>(&self, keys: &[u8], spans: &[Span], cx: &Context<'_, G>) -> Results {
        spans
            .iter()
            .filter_map(|&(i, s, e, _)| {
                let l = &self.limits[i];
                let mut held = l.eventual.as_ref()?.hold(&l.algorithm, &keys[s..e], cx.now);
                let v = held.check(&l.algorithm, l.cost);
                if v.is_err() {
                    // Rejections need fresh totals too: marked under the same lock take.
                    held.charge(&l.algorithm, 0);
                }
                Some((i, v.map(|snap| (snap, 0))))
            })
            .collect()
    }

    /// Decides and charges the request's eventual limits and the in-process limits `pick`
    /// selects as one step, once every other tier has admitted. The eventual keys are held
    /// (locked) from their check to their charge while the local stores decide (see
    /// `eventual::Held` for the lock order), so two requests for one key never both pass on its
    /// last unit; a check made earlier and released (before the global store was asked) only
    /// spares a round trip, it admits nothing. Each eventual verdict replaces the one `results`
    /// holds for its limit; the local verdicts are appended. Whether the request is admitted:
    /// when not, nothing here is charged, and what the global store charged stays taken (the
    /// race errs towards limiting, as for local limits).
    fn commit_in_process<G>(
        &self,
        keys: &[u8],
        spans: &[Span],
        cx: &Context<'_, G>,
        pick: impl Fn(&Limit) -> bool,
        results: &mut Results,
        slots: &mut Held,
    ) -> bool {
        let mut held = self.hold_eventual(keys, spans, cx);
        let eventual: Results = held
            .iter()
            .map(|(i, h)| {
                let l = &self.limits[*i];
                (*i, h.check(&l.algorithm, l.cost).map(|snap| (snap, 0)))
            })
            .collect();
        let mut admitted = eventual
            .iter()
            .all(|(i, v)| v.is_ok() || self.limits[*i].shadow);
        let mut local = SmallVec::<[LocalVerdict; 4]>::new();
        if admitted {
            let checks = self.local_checks(keys, spans, cx, &pick);
            (admitted, local) = local::decide(&checks, cx.now);
            if admitted && self.has_after {
                self.hold_local(keys, spans, cx, &pick, &local, slots);
            }
        }
        self.charge_eventual(&mut held, &eventual, admitted);
        drop(held);
        for (i, v) in eventual {
            match results.iter_mut().find(|(j, _)| *j == i) {
                Some(slot) => slot.1 = v,
                None => results.push((i, v)),
            }
        }
        let picked = spans.iter().filter(|s| pick(&self.limits[s.0]));
        results.extend(picked.map(|s| s.0).zip(local));
        admitted
    }

    fn local_checks<'k, G>(
        &'k self,
        keys: &'k [u8],
        spans: &[Span],
        cx: &Context<'_, G>,
        pick: impl Fn(&Limit) -> bool,
    ) -> SmallVec<[LocalCheck<'k>; 4]> {
        spans
            .iter()
            .filter(|s| pick(&self.limits[s.0]))
            .map(|&(i, s, e, r)| {
                let l = &self.limits[i];
                LocalCheck {
                    store: &l.store,
                    algorithm: &l.rate(r).algorithm,
                    key: &keys[s..e],
                    cost: l.cost,
                    max_delay: l.delay_allowed(cx.allow_delay),
                    shadow: l.shadow,
                }
            })
            .collect()
    }

    /// [`LimitSet::conclude_each`] over collected results.
    fn conclude<G>(&self, results: &[(usize, LocalVerdict)], cx: &Context<'_, G>) -> Verdict {
        self.conclude_each(results.iter().map(|(i, v)| (*i, v)), cx)
    }

    /// Policy after the decision, in one place: shadow rewrites a rejection into an admission,
    /// every decision is counted, and the most restrictive limit is picked for the headers.
    /// Takes the verdicts where they are (an iterator walked up to three times), so the local
    /// path need not copy them into one more list first.
    ///
    /// A request refused only by the route's queueing concurrency limit, while the route's
    /// waiters have room (`cx.allow_delay`), gets [`Verdict::Queue`], counted nowhere: it will
    /// be decided again, and its last decision is the one counted. An admission after such a
    /// wait (`cx.waited`) counts as that limit's `delayed`, with the wait as its delay.
    fn conclude_each<'v, G>(
        &self,
        results: impl Iterator<Item = (usize, &'v LocalVerdict)> + Clone,
        cx: &Context<'_, G>,
    ) -> Verdict {
        let mut worst_reject: Option<(usize, Rejection)> = None;
        let mut only_slots = true;
        for (i, v) in results.clone() {
            let l = &self.limits[i];
            if let Err(r) = v {
                if l.shadow {
                    continue;
                }
                only_slots &= self.queue == Some(i);
                if worst_reject.is_none_or(|(_, w)| r.retry_after > w.retry_after) {
                    worst_reject = Some((i, *r));
                }
            }
        }
        if let Some((limit, rejection)) = worst_reject {
            if only_slots && cx.allow_delay {
                return Verdict::Queue {
                    limit,
                    rejection,
                    hash: 0,
                };
            }
            for (i, v) in results.clone() {
                let l = &self.limits[i];
                match v {
                    Err(_) if l.shadow => {
                        l.metrics.shadow_rejected.inc();
                    }
                    Err(_) => {
                        l.metrics.rejected.inc();
                    }
                    // Admitted by this limit but not consumed: the request as a whole is rejected.
                    Ok(_) => {}
                }
            }
            return Verdict::Reject {
                limit,
                rate: 0,
                rejection,
            };
        }
        let mut delay: Micros = 0;
        let mut delayed_by = None;
        let mut info: Option<HeaderInfo> = None;
        for (i, v) in results {
            let l = &self.limits[i];
            match v {
                Err(_) => {
                    l.metrics.shadow_rejected.inc();
                }
                Ok((_, _)) if cx.waited > 0 && self.queue == Some(i) => {
                    // Admitted after waiting for a slot (the wait is over: no delay is returned).
                    l.metrics.delayed.inc();
                    l.metrics.delay.observe(Duration::from_micros(cx.waited));
                }
                Ok((snap, d)) => {
                    if *d > 0 {
                        l.metrics.delayed.inc();
                        // Delays given: a shadow limit's is never waited for.
                        if !l.shadow {
                            l.metrics.delay.observe(Duration::from_micros(*d));
                        }
                    } else {
                        l.metrics.allowed.inc();
                    }
                    // A shadow limit's reservation is counted (as `delayed`) but never
                    // waited for: shadow limits do not change what the client gets.
                    if *d > delay && !l.shadow {
                        delay = *d;
                        delayed_by = Some(i);
                    }
                    if !l.shadow && l.slots().is_none() {
                        let candidate = header_info(i, snap);
                        if info.is_none_or(|cur| {
                            (
                                candidate.remaining,
                                std::cmp::Reverse(candidate.reset_after),
                            ) < (cur.remaining, std::cmp::Reverse(cur.reset_after))
                        }) {
                            info = Some(candidate);
                        }
                    }
                }
            }
        }
        Verdict::Admit {
            delay: Duration::from_micros(delay),
            delayed_by,
            info,
        }
    }
}

/// Per applicable limit: its index and its verdict.
type Results = SmallVec<[(usize, LocalVerdict); 4]>;

fn header_info(limit: usize, s: &Snapshot) -> HeaderInfo {
    HeaderInfo {
        limit,
        rate: 0,
        remaining: s.remaining,
        reset_after: s.reset_after,
    }
}
