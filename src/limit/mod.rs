//! Deciding a request's limits: all admit, or none consumes.
//!
//! [`LimitSet::evaluate`] builds each limit's key, skips limits whose key part is absent
//! (`on_missing: skip`), and decides in tiers, cheapest first:
//!
//! 1. the in-process tier in front of Redis ([`local::deny`]) rejects a global limit's key that
//!    Redis is known to reject right now, without a round trip;
//! 2. local and eventual limits are checked (not yet charged) in process: a rejection there
//!    needs no round trip either;
//! 3. the global limits go to Redis in one script call, which charges them only if all admit;
//! 4. then the local and eventual limits are checked again and charged, each check and its
//!    charge under one lock. Should a concurrent request have used their units in between (the
//!    only window where in-process and global limits are not one atomic step), this request is
//!    rejected and the global units it took stay taken: the race errs towards limiting.
//!
//! When Redis cannot answer, `redis.on_error` decides: `allow` decides the global limits with
//! their local stores (same quota, per instance) and counts each such decision; `deny` answers
//! 503. `shadow` limits are decided and counted but never reject and never show in headers.
//! Policy after the decision lives in one place ([`LimitSet::conclude`]), where it is counted.

pub mod algorithm;
pub mod clock;
pub mod eventual;
pub mod local;
pub mod redis;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use smallvec::SmallVec;

use prometheus_client::metrics::counter::Counter;

use crate::config::{AlgorithmKind, Consistency, LimitConfig, OnError, OnLimit, Scope};
use crate::key::{KeyOutcome, KeySpec, RequestParts};
use crate::metrics::{Histogram, LimitMetrics, Metrics};
use algorithm::{
    Algorithm, FixedWindow, Gcra, Micros, Quota, Rejection, SlidingLog, SlidingWindow, Snapshot,
};
use eventual::EventualStore;
use local::deny::{DenyCache, Probe};
use local::{LocalCheck, LocalStore, LocalVerdict};
use redis::{GlobalLimit, LimitVerdict, RedisStore};

/// One limit of a route, compiled from its config.
#[derive(Debug)]
pub struct Limit {
    pub name: Arc<str>,
    pub config: LimitConfig,
    pub key: KeySpec,
    pub algorithm: Algorithm,
    pub cost: u64,
    pub scope: Scope,
    /// 0 unless `on_limit: delay`.
    pub max_delay: Micros,
    pub shadow: bool,
    /// Kept across reloads when the limit's definition is unchanged. For a global limit it
    /// is the fallback store used while Redis cannot answer.
    pub store: Arc<LocalStore>,
    /// Global limits: what Redis is known to reject (the in-process tier).
    pub tier: Arc<DenyCache>,
    /// `consistency: eventual`: decided here on counts synced with Redis periodically.
    pub eventual: Option<Arc<EventualStore>>,
    /// Eventual limits: how often counts are exchanged with Redis.
    pub sync_interval: Micros,
    /// Global limits: `tg:{ROUTE/LIMIT/` — the key value and `}` complete a Redis key whose
    /// hash tag holds all of it, so one limit's keys share a Cluster slot.
    pub redis_prefix: String,
    pub metrics: LimitMetrics,
    /// The `RateLimit-Policy` item, formatted once: `"name";q=100;w=60`.
    pub policy: HeaderValue,
}

impl Limit {
    pub fn new(
        route: &str,
        config: &LimitConfig,
        store: Arc<LocalStore>,
        tier: Arc<DenyCache>,
        eventual: Option<Arc<EventualStore>>,
        metrics: LimitMetrics,
    ) -> Self {
        let algorithm = algorithm_for(config);
        let window = policy_window(config.rate.period);
        let policy = HeaderValue::from_str(&format!(
            "\"{}\";q={};w={}",
            config.name, config.rate.count, window
        ))
        .unwrap_or_else(|_| HeaderValue::from_static("\"limit\""));
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
            tier,
            eventual: match (config.scope, config.consistency) {
                (Scope::Global, Consistency::Eventual) => Some(eventual.unwrap_or_default()),
                _ => None,
            },
            sync_interval: micros(config.sync_interval),
            redis_prefix: format!("tg:{{{route}/{}/", config.name),
            metrics,
            policy,
        }
    }

    pub fn redis_key(&self, key: &[u8]) -> String {
        let mut k = String::with_capacity(self.redis_prefix.len() + key.len() + 1);
        k.push_str(&self.redis_prefix);
        // Keys are ASCII by construction (`key` escapes everything else).
        k.push_str(std::str::from_utf8(key).unwrap_or("~invalid"));
        k.push('}');
        k
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
    fn fresh_for(&self, cx: &Context<'_>) -> Micros {
        self.sync_interval + micros(cx.probe_wait)
    }

    /// Exchanges one key's counts of an eventual limit with Redis (`sync.lua`, or
    /// `sync_gcra.lua`): pushes its unpushed units, learns the window totals (gcra: the TAT).
    /// On failure the units stay for the next sync.
    pub async fn sync_eventual(
        &self,
        redis: &RedisStore,
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

pub fn micros(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The pure algorithm a limit config asks for.
pub fn algorithm_for(config: &LimitConfig) -> Algorithm {
    let quota = Quota {
        count: config.rate.count,
        period: config.rate.period_micros().max(1),
        burst: config.burst,
    };
    match config.algorithm {
        AlgorithmKind::Gcra => Algorithm::Gcra(Gcra::new(quota)),
        AlgorithmKind::FixedWindow => Algorithm::FixedWindow(FixedWindow::new(quota)),
        AlgorithmKind::SlidingWindow => Algorithm::SlidingWindow(SlidingWindow::new(quota)),
        AlgorithmKind::SlidingLog => Algorithm::SlidingLog(SlidingLog::new(quota)),
    }
}

/// What the `RateLimit` fields report: one limit's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderInfo {
    pub limit: usize,
    pub remaining: u64,
    /// Seconds part of the `RateLimit` field (`t`).
    pub reset_after: Micros,
}

/// The outcome of a request's limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Forward (after `delay`, when a slot was reserved). `info`: most restrictive limit.
    Admit {
        delay: Duration,
        /// The limit that reserved the slot being waited for, when `delay` > 0.
        delayed_by: Option<usize>,
        info: Option<HeaderInfo>,
    },
    /// 429 from `limit` (index into the route's limits).
    Reject { limit: usize, rejection: Rejection },
    /// `on_missing: reject` and the named key part is absent.
    MissingKey { limit: usize, part: String },
    /// The named key part has several differing values: 400 (see [`KeyOutcome::Ambiguous`]).
    AmbiguousKey { limit: usize, part: String },
    /// Redis could not answer and `redis.on_error: deny`: 503.
    Unavailable { limit: usize },
}

/// What a decision needs besides the request.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    /// Local monotonic time (global limits use Redis's clock inside the script).
    pub now: Micros,
    /// When the decision started, for the limiter-duration metrics: the instant `now` was read
    /// from ([`clock::Clock::at`]), so a decision reads the clock once at its start.
    pub started: std::time::Instant,
    /// For the time after a wait (a request following another's Redis call for a hot key).
    pub clock: &'a dyn clock::Clock,
    /// The longest a request waits for another's Redis call (the Redis timeout).
    pub probe_wait: Duration,
    pub redis: Option<&'a RedisStore>,
    pub on_error: OnError,
    /// `false` when the route's waiter cap is full: a request that would wait is rejected.
    pub allow_delay: bool,
    pub metrics: &'a Metrics,
}

/// Counters and timers of the tiers, resolved once per config build.
#[derive(Debug, Clone)]
pub struct TierMetrics {
    pub local: Counter,
    pub in_process: Counter,
    pub redis: Counter,
    pub fallback: Counter,
    pub local_duration: Histogram,
    pub in_process_duration: Histogram,
    pub global_duration: Histogram,
}

impl TierMetrics {
    pub fn new(m: &Metrics) -> Self {
        Self {
            local: m.tier("local", "local"),
            in_process: m.tier("global", "in_process"),
            redis: m.tier("global", "redis"),
            fallback: m.tier("global", "fallback"),
            local_duration: m.limiter_duration("local"),
            in_process_duration: m.limiter_duration("in_process"),
            global_duration: m.limiter_duration("global"),
        }
    }
}

#[derive(Debug)]
pub struct LimitSet {
    pub limits: Vec<Limit>,
    /// Whether any limit can reserve (so the proxy knows to count waiters).
    pub can_delay: bool,
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
}

/// One applicable limit of this request: its index and its key's span in the key buffer.
type Span = (usize, usize, usize);

impl LimitSet {
    /// `cluster`: global limits live on a Redis Cluster.
    pub fn new(limits: Vec<Limit>, tiers: TierMetrics, cluster: bool) -> Self {
        let can_delay = limits.iter().any(|l| l.max_delay > 0);
        let has_eventual = limits.iter().any(|l| l.eventual.is_some());
        let enforced_global = limits.iter().filter(|l| l.is_global() && !l.shadow).count();
        let reads_headers = limits.iter().any(|l| {
            l.key
                .parts
                .iter()
                .any(|p| matches!(p, crate::config::KeyPart::Header(_)))
        });
        Self {
            tier_enabled: !(cluster && enforced_global > 1),
            reads_headers,
            has_eventual,
            limits,
            can_delay,
            tiers,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// Decides every limit for this request.
    pub async fn evaluate(&self, req: &RequestParts<'_>, cx: &Context<'_>) -> Verdict {
        if self.limits.is_empty() {
            return Verdict::Admit {
                delay: Duration::ZERO,
                delayed_by: None,
                info: None,
            };
        }
        let started = cx.started;
        let mut keys = crate::key::KeyBuf::new();
        let mut spans: SmallVec<[Span; 4]> = SmallVec::new();
        for (i, limit) in self.limits.iter().enumerate() {
            let start = keys.len();
            match limit.key.build(req, &mut keys) {
                KeyOutcome::Built => spans.push((i, start, keys.len())),
                KeyOutcome::Skip => {}
                // A shadow limit never rejects: it counts what it would have done and does
                // not apply, as with `on_missing: skip`.
                KeyOutcome::Reject(_) if limit.shadow => {
                    limit.metrics.shadow_rejected.inc();
                }
                KeyOutcome::Reject(part) => {
                    limit.metrics.rejected.inc();
                    return Verdict::MissingKey { limit: i, part };
                }
                // Refused (400) before any limit decides, counted as this limit's rejection as
                // a missing key is; a shadow limit counts what enforcing it would have refused
                // and does not apply.
                KeyOutcome::Ambiguous(_) if limit.shadow => {
                    limit.metrics.shadow_rejected.inc();
                }
                KeyOutcome::Ambiguous(part) => {
                    limit.metrics.rejected.inc();
                    return Verdict::AmbiguousKey { limit: i, part };
                }
            }
        }
        if let Some(redis) = cx.redis {
            // Boxed like the Redis path: only a key's first request on this instance gets here.
            let new = |&&(i, s, e): &&Span| {
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
                return self.decide(&keys, &spans, &after, started).await;
            }
        }
        self.decide(&keys, &spans, cx, started).await
    }

    /// Decides every limit for this request, its keys built and its eventual keys known.
    async fn decide(
        &self,
        keys: &[u8],
        spans: &[Span],
        cx: &Context<'_>,
        started: std::time::Instant,
    ) -> Verdict {
        if spans.is_empty() {
            // Every limit was skipped (a key part missing, `on_missing: skip`): nothing decided,
            // so nothing is counted as a decision either.
            return self.conclude(&Results::new());
        }
        if spans.iter().any(|s| self.limits[s.0].is_global()) {
            // Boxed: the Redis path's state is large (about 13 KB of fred futures); inline, it
            // would be part of every request's future, local-only ones and waiters included.
            // One allocation per global decision is small next to its round trip.
            return Box::pin(self.evaluate_global(keys, spans, cx, started)).await;
        }
        if !self.has_eventual {
            // Local limits only, the common route: no eventual keys to hold, and the verdicts
            // are concluded where they are.
            let checks = self.local_checks(keys, spans, cx, Limit::is_local);
            let (_, verdicts) = local::decide(&checks, cx.now);
            self.count_local(started);
            return self.conclude_each(self.local_indexes(spans).zip(verdicts.iter()));
        }
        // A request whose only limit is an eventual one: checked and charged at once.
        if let [(i, s, e)] = *spans
            && let Some(ev) = &self.limits[i].eventual
        {
            let l = &self.limits[i];
            let v = ev.decide(&l.algorithm, &keys[s..e], cx.now, l.cost);
            self.count_local(started);
            let mut results = Results::new();
            results.push((i, v.map(|snap| (snap, 0))));
            return self.conclude(&results);
        }
        let mut results = Results::new();
        self.commit_in_process(keys, spans, cx, Limit::is_local, &mut results);
        self.count_local(started);
        self.conclude(&results)
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
    async fn learn_eventual(
        &self,
        keys: &[u8],
        spans: &[Span],
        new: impl Fn(&&Span) -> bool,
        redis: &RedisStore,
        cx: &Context<'_>,
    ) {
        let wait = micros(cx.probe_wait);
        let mut leads: SmallVec<[_; 2]> = SmallVec::new();
        let mut follows: SmallVec<[_; 2]> = SmallVec::new();
        for &(i, s, e) in spans.iter().filter(new) {
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
    fn hold_eventual<'k>(
        &'k self,
        keys: &'k [u8],
        spans: &[Span],
        cx: &Context<'_>,
    ) -> SmallVec<[(usize, eventual::Held<'k>); 2]> {
        if !self.has_eventual {
            return SmallVec::new();
        }
        let mut order: SmallVec<[(usize, &EventualStore, &'k [u8]); 2]> = spans
            .iter()
            .filter_map(|&(i, s, e)| Some((i, self.limits[i].eventual.as_deref()?, &keys[s..e])))
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
    fn check_eventual(&self, keys: &[u8], spans: &[Span], cx: &Context<'_>) -> Results {
        spans
            .iter()
            .filter_map(|&(i, s, e)| {
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
    fn commit_in_process(
        &self,
        keys: &[u8],
        spans: &[Span],
        cx: &Context<'_>,
        pick: impl Fn(&Limit) -> bool,
        results: &mut Results,
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

    fn local_checks<'k>(
        &'k self,
        keys: &'k [u8],
        spans: &[Span],
        cx: &Context<'_>,
        pick: impl Fn(&Limit) -> bool,
    ) -> SmallVec<[LocalCheck<'k>; 4]> {
        spans
            .iter()
            .filter(|s| pick(&self.limits[s.0]))
            .map(|&(i, s, e)| {
                let l = &self.limits[i];
                LocalCheck {
                    store: &l.store,
                    algorithm: &l.algorithm,
                    key: &keys[s..e],
                    cost: l.cost,
                    max_delay: if cx.allow_delay { l.max_delay } else { 0 },
                    shadow: l.shadow,
                }
            })
            .collect()
    }

    async fn evaluate_global(
        &self,
        keys: &[u8],
        spans: &[Span],
        cx: &Context<'_>,
        started: std::time::Instant,
    ) -> Verdict {
        let delay_of = |l: &Limit| if cx.allow_delay { l.max_delay } else { 0 };
        let mut results: Results = SmallVec::new();
        // 1. The in-process tier: what Redis is known to reject right now. For a hot key that
        //    just came free, one request asks Redis and the others wait for its answer.
        let mut to_redis: SmallVec<[Span; 4]> = SmallVec::new();
        let mut probes = SmallVec::<[_; 2]>::new();
        let mut now = cx.now;
        for &(i, s, e) in spans.iter().filter(|s| self.limits[s.0].is_global()) {
            let l = &self.limits[i];
            let key = &keys[s..e];
            // Following other requests' probes is bounded in total, not per wake: a leader's
            // answer can free the key again a moment later (its request reached Redis a hair
            // before its slot), and the followers must then elect a new leader, not all go.
            let deadline = cx.now + micros(cx.probe_wait);
            loop {
                let known = if self.tier_enabled {
                    l.tier.check(key, now, delay_of(l))
                } else {
                    None
                };
                match known {
                    Some(r) if !l.shadow => {
                        self.tiers.in_process.inc();
                        self.tiers.in_process_duration.observe(started.elapsed());
                        return self.conclude(&[(i, Err(r))]);
                    }
                    Some(r) => results.push((i, Err(r))),
                    None if !self.tier_enabled || now >= deadline => to_redis.push((i, s, e)),
                    None => match l.tier.begin(key, now) {
                        Probe::Free => to_redis.push((i, s, e)),
                        Probe::Lead(guard) => {
                            probes.push(guard);
                            to_redis.push((i, s, e));
                        }
                        Probe::Follow => {
                            let left = Duration::from_micros(deadline - now);
                            l.tier.wait_probe(key, now, left).await;
                            now = cx.clock.now();
                            continue;
                        }
                    },
                }
                break;
            }
        }
        // 2. Local and eventual limits, checked but not charged.
        let local = self.local_checks(keys, spans, cx, Limit::is_local);
        let (local_ok, local_verdicts) = local::check(&local, cx.now);
        let local_idx = self.local_indexes(spans);
        let eventual = self.check_eventual(keys, spans, cx);
        let eventual_ok = eventual
            .iter()
            .all(|(i, v)| v.is_ok() || self.limits[*i].shadow);
        results.extend(eventual);
        if !(local_ok && eventual_ok) {
            results.extend(local_idx.zip(local_verdicts));
            self.count_local(started);
            return self.conclude(&results);
        }
        // 3. Redis: every global limit in one call; the script commits only if every enforced
        //    one admits, and a shadow limit's rejection blocks nothing.
        let redis_keys: SmallVec<[String; 4]> = to_redis
            .iter()
            .map(|&(i, s, e)| self.limits[i].redis_key(&keys[s..e]))
            .collect();
        let globals: Vec<GlobalLimit<'_>> = to_redis
            .iter()
            .zip(&redis_keys)
            .map(|(&(i, _, _), k)| {
                let l = &self.limits[i];
                GlobalLimit {
                    algorithm: &l.algorithm,
                    key: k,
                    cost: l.cost,
                    max_delay: delay_of(l),
                }
            })
            .collect();
        let shadow: SmallVec<[bool; 4]> =
            to_redis.iter().map(|sp| self.limits[sp.0].shadow).collect();
        let answer = match cx.redis {
            Some(redis) => match redis.decide_with_shadows(&globals, &shadow, None).await {
                // A shadow limit never changes what the client gets: with no enforced global
                // limit in the call, its failure is counted and the shadow limits are left
                // undecided (no 503, no fallback charge).
                Err(e) if !shadow.contains(&false) => {
                    cx.metrics.redis_error(e.kind());
                    Ok(redis::Decision {
                        admitted: true,
                        per_limit: Vec::new(),
                    })
                }
                other => other,
            },
            None => Err(redis::RedisError::Unavailable),
        };
        self.tiers.global_duration.observe(started.elapsed());
        // No later than the moment the script was sent: what the tier learns is anchored here.
        let sent = now;
        match answer {
            Ok(main) => {
                self.tiers.redis.inc();
                let decided = to_redis.iter().zip(&globals).zip(main.per_limit);
                for ((&(i, s, e), g), v) in decided {
                    let l = &self.limits[i];
                    let key = &keys[s..e];
                    results.push((
                        i,
                        match v {
                            LimitVerdict::Admitted { snapshot, delay } => {
                                // Charged only if the request went through (shadow limits
                                // too), and only then is there a new state to learn.
                                if self.tier_enabled && main.admitted {
                                    l.tier.admitted(
                                        key,
                                        sent,
                                        &l.algorithm,
                                        l.cost,
                                        &snapshot,
                                        g.max_delay,
                                    );
                                }
                                Ok((snapshot, delay))
                            }
                            LimitVerdict::Rejected(r) => {
                                if self.tier_enabled {
                                    l.tier.rejected(key, sent, &r, g.max_delay);
                                }
                                Err(r)
                            }
                        },
                    ));
                }
                if !main.admitted {
                    results.extend(local_idx.zip(local_verdicts));
                    return self.conclude(&results);
                }
                // 4. Charge the local and eventual limits, each checked again as it is charged.
                self.commit_in_process(keys, spans, cx, Limit::is_local, &mut results);
                self.conclude(&results)
            }
            Err(e) => {
                cx.metrics.redis_error(e.kind());
                // The limit named in the 503: an enforced one (only their call fails here).
                let first_global = to_redis
                    .iter()
                    .find(|s| !self.limits[s.0].shadow)
                    .map_or(0, |s| s.0);
                if cx.on_error == OnError::Deny {
                    warn_deny(cx.now, &e);
                    return Verdict::Unavailable {
                        limit: first_global,
                    };
                }
                // on_error: allow — the global limits fall back to their local stores.
                self.tiers.fallback.inc();
                let in_fallback = |l: &Limit| {
                    l.is_local() || to_redis.iter().any(|s| std::ptr::eq(&self.limits[s.0], l))
                };
                self.commit_in_process(keys, spans, cx, in_fallback, &mut results);
                for &(i, _, _) in to_redis.iter() {
                    self.limits[i].metrics.fallback.inc();
                }
                self.conclude(&results)
            }
        }
    }

    /// [`LimitSet::conclude_each`] over collected results.
    fn conclude(&self, results: &[(usize, LocalVerdict)]) -> Verdict {
        self.conclude_each(results.iter().map(|(i, v)| (*i, v)))
    }

    /// Policy after the decision, in one place: shadow rewrites a rejection into an admission,
    /// every decision is counted, and the most restrictive limit is picked for the headers.
    /// Takes the verdicts where they are (an iterator walked up to three times), so the local
    /// path need not copy them into one more list first.
    fn conclude_each<'v>(
        &self,
        results: impl Iterator<Item = (usize, &'v LocalVerdict)> + Clone,
    ) -> Verdict {
        let mut worst_reject: Option<(usize, Rejection)> = None;
        for (i, v) in results.clone() {
            let l = &self.limits[i];
            if let Err(r) = v {
                if l.shadow {
                    continue;
                }
                if worst_reject.is_none_or(|(_, w)| r.retry_after > w.retry_after) {
                    worst_reject = Some((i, *r));
                }
            }
        }
        if let Some((limit, rejection)) = worst_reject {
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
            return Verdict::Reject { limit, rejection };
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
                    if !l.shadow {
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
        remaining: s.remaining,
        reset_after: s.reset_after,
    }
}
