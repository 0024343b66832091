//! Every `tollgate_*` metric, registered once per process.
//!
//! Label sets hold route, limit, status, scope, kind and result names only — never a client
//! key, IP or raw path — so cardinality is bounded by the config, not by traffic.
//! The request path never looks a metric up by label: routes and limits keep handles
//! ([`RouteMetrics`], [`LimitMetrics`]) resolved when the config is built, and histograms are
//! lock-free ([`AtomicHistogram`]) because prometheus-client's own takes a mutex per observation.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

mod text;
pub use text::Format;

/// Seconds; from 100 µs (a local decision with headroom) to 30 s (the default route timeout).
const LATENCY_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    10.0, 30.0,
];

/// A Prometheus histogram whose observation is a handful of relaxed atomic adds.
#[derive(Debug)]
pub struct AtomicHistogram {
    bounds: &'static [f64],
    /// Per-bucket counts (not cumulative), one more than `bounds` for +Inf.
    counts: Box<[AtomicU64]>,
    sum_nanos: AtomicU64,
}

impl AtomicHistogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    /// Counts `d` in its bucket and adds it to the sum.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
}

/// Shared handle, so a `Family` can hand out clones that observe into one histogram.
#[derive(Clone, Debug)]
pub struct Histogram(Arc<AtomicHistogram>);

impl Histogram {
    fn latency() -> Self {
        Self(Arc::new(AtomicHistogram::new(&LATENCY_BUCKETS)))
    }
    /// Counts `d` in its bucket and adds it to the sum.
    pub fn observe(&self, d: Duration) {
        self.0.observe(d)
    }
    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0.count()
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let h = &self.0;
        let mut buckets = Vec::with_capacity(h.counts.len());
        let mut count = 0;
        for (i, c) in h.counts.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            count += n;
            let bound = h.bounds.get(i).copied().unwrap_or(f64::INFINITY);
            buckets.push((bound, n));
        }
        let sum = h.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }
    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteStatus {
    route: String,
    status: u16,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLimit {
    route: String,
    limit: String,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLimitDecision {
    route: String,
    limit: String,
    decision: &'static str,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLimitDirection {
    route: String,
    limit: String,
    direction: &'static str,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScopeLabel {
    scope: &'static str,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    scope: &'static str,
    tier: &'static str,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreLabel {
    store: &'static str,
}

/// The `store` label values of the key-budget metrics: the kinds of in-process store
/// (`limit::budget::StoreKind`), so their series exist from the start.
pub const KEY_STORES: [&str; 3] = ["local", "deny_tier", "eventual"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TaskLabel {
    task: &'static str,
}

/// The `task` values of `tollgate_panics_total`, each a series from the start: one request's
/// phases, one client connection outside them, the background tasks, and anything else.
pub const PANIC_TASKS: [&str; 7] = [
    "request",
    "connection",
    "sweep",
    "resets",
    "eventual_sync",
    "config_watch",
    "other",
];

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// The process's metrics. Cheap to share (`Arc`); families are internally synchronised.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RouteStatus, Counter>,
    decisions: Family<RouteLimitDecision, Counter>,
    request_duration: HistogramFamily<RouteLabel>,
    upstream_duration: HistogramFamily<RouteLabel>,
    limiter_duration: HistogramFamily<ScopeLabel>,
    decisions_by_tier: Family<TierLabel, Counter>,
    redis_errors: Family<KindLabel, Counter>,
    fallback: Family<RouteLimit, Counter>,
    reloads: Family<ResultLabel, Counter>,
    panics: Family<TaskLabel, Counter>,
    delay: HistogramFamily<RouteLimit>,
    waiters_abandoned: Family<RouteLimit, Counter>,
    local_keys: Gauge,
    in_flight: Family<RouteLimit, Gauge>,
    lease_renewals: Family<RouteLimit, Counter>,
    lease_expiries: Family<RouteLimit, Counter>,
    settled: Family<RouteLimitDirection, Counter>,
    settle_missing: Family<RouteLimit, Counter>,
    limit_keys: Family<StoreLabel, Gauge>,
    limit_keys_evicted: Family<StoreLabel, Counter>,
    limit_keys_max: Gauge,
    eventual_units_lost: Counter,
    redis_decide_calls: Counter,
    redis_decide_decisions: Counter,
    redis_decide_queued: Counter,
    /// The Redis store's own counts at the last [`Metrics::redis_batches`]: what the counters
    /// above already hold of them.
    redis_batch_seen: std::sync::Mutex<[u64; 3]>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every `tollgate_*` family, the Redis error and reload series at 0.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::default();
        let decisions = Family::default();
        let request_duration: HistogramFamily<RouteLabel> =
            Family::new_with_constructor(Histogram::latency);
        let upstream_duration: HistogramFamily<RouteLabel> =
            Family::new_with_constructor(Histogram::latency);
        let limiter_duration: HistogramFamily<ScopeLabel> =
            Family::new_with_constructor(Histogram::latency);
        let decisions_by_tier = Family::default();
        let redis_errors = Family::default();
        let fallback = Family::default();
        let reloads = Family::default();
        let panics = Family::default();
        let delay: HistogramFamily<RouteLimit> = Family::new_with_constructor(Histogram::latency);
        let waiters_abandoned = Family::default();
        let local_keys = Gauge::default();
        let in_flight = Family::default();
        let lease_renewals = Family::default();
        let lease_expiries = Family::default();
        let settled = Family::default();
        let settle_missing = Family::default();
        let limit_keys = Family::default();
        let limit_keys_evicted = Family::default();
        let limit_keys_max = Gauge::default();
        let eventual_units_lost = Counter::default();
        let redis_decide_calls = Counter::default();
        let redis_decide_decisions = Counter::default();
        let redis_decide_queued = Counter::default();
        // prometheus-client appends `_total` to counters and `_seconds` comes from the name.
        registry.register(
            "tollgate_requests",
            "Requests answered, by route and HTTP status",
            requests.clone(),
        );
        registry.register(
            "tollgate_limit_decisions",
            "Limit decisions by route, limit and decision",
            decisions.clone(),
        );
        registry.register(
            "tollgate_request_duration_seconds",
            "Whole request, from its head until the response body is sent or the client goes away",
            request_duration.clone(),
        );
        registry.register(
            "tollgate_upstream_duration_seconds",
            "Upstream exchange, until the response head",
            upstream_duration.clone(),
        );
        registry.register(
            "tollgate_limiter_duration_seconds",
            "Time to decide a request's limits, by scope",
            limiter_duration.clone(),
        );
        registry.register(
            "tollgate_limiter_tier_decisions",
            "Decisions by the tier that answered: local store, in-process tier in front of Redis, or Redis",
            decisions_by_tier.clone(),
        );
        registry.register(
            "tollgate_redis_errors",
            "Redis failures by kind",
            redis_errors.clone(),
        );
        registry.register(
            "tollgate_fallback_decisions",
            "Decisions taken by the on_error policy because Redis could not answer",
            fallback.clone(),
        );
        registry.register(
            "tollgate_config_reloads",
            "Config reloads by result",
            reloads.clone(),
        );
        registry.register(
            "tollgate_panics",
            "Panics caught, by what was running: the request or connection it ended, or the background task it restarted",
            panics.clone(),
        );
        registry.register(
            "tollgate_delay_seconds",
            "Delay given to requests that waited for a reserved slot",
            delay.clone(),
        );
        registry.register(
            "tollgate_delayed_abandoned",
            "Delayed requests whose client went away while waiting (a gcra reservation stays consumed; a concurrency waiter takes no slot)",
            waiters_abandoned.clone(),
        );
        registry.register(
            "tollgate_local_keys",
            "Keys held by the in-process limit stores",
            local_keys.clone(),
        );
        registry.register(
            "tollgate_in_flight",
            "Requests holding a slot of a concurrency limit now, on this instance",
            in_flight.clone(),
        );
        registry.register(
            "tollgate_lease_renewals",
            "Concurrency leases renewed in Redis because their request outlived half a lease",
            lease_renewals.clone(),
        );
        registry.register(
            "tollgate_lease_expiries",
            "Concurrency leases found run out in Redis before their request gave them back",
            lease_expiries.clone(),
        );
        registry.register(
            "tollgate_settled_units",
            "Units settled after responses: charged beyond the estimate, or refunded",
            settled.clone(),
        );
        registry.register(
            "tollgate_settle_missing",
            "Responses whose cost header or trailer was missing or not a whole number: the estimate stayed charged",
            settle_missing.clone(),
        );
        registry.register(
            "tollgate_limit_keys",
            "Keys held by the in-process limit stores, by kind of store",
            limit_keys.clone(),
        );
        registry.register(
            "tollgate_limit_keys_evicted",
            "Keys evicted from the in-process limit stores to stay within server.max_keys, by kind of store",
            limit_keys_evicted.clone(),
        );
        registry.register(
            "tollgate_limit_keys_max",
            "server.max_keys: the most keys the in-process limit stores hold together",
            limit_keys_max.clone(),
        );
        registry.register(
            "tollgate_eventual_units_lost",
            "Units admitted by eventual limits that no sync will push: their key was evicted while the queue of evicted keys' units was full",
            eventual_units_lost.clone(),
        );
        registry.register(
            "tollgate_redis_decide_calls",
            "Decide calls sent to Redis: one request's decision, or a batch of those that queued behind a call in flight",
            redis_decide_calls.clone(),
        );
        registry.register(
            "tollgate_redis_decide_decisions",
            "Requests decided by those calls (decisions / calls: the mean batch)",
            redis_decide_decisions.clone(),
        );
        registry.register(
            "tollgate_redis_decide_queued",
            "Decisions that waited behind a call in flight on their queue rather than going at once",
            redis_decide_queued.clone(),
        );
        // Series that exist from the start, so dashboards and alerts see 0 rather than nothing.
        for kind in [
            "timeout",
            "connection",
            "script",
            "protocol",
            "unavailable",
            "redirect",
        ] {
            let _ = redis_errors.get_or_create_owned(&KindLabel { kind });
        }
        for result in ["success", "error"] {
            let _ = reloads.get_or_create_owned(&ResultLabel { result });
        }
        for store in KEY_STORES {
            let _ = limit_keys.get_or_create_owned(&StoreLabel { store });
            let _ = limit_keys_evicted.get_or_create_owned(&StoreLabel { store });
        }
        for task in PANIC_TASKS {
            let _ = panics.get_or_create_owned(&TaskLabel { task });
        }
        Self {
            registry,
            requests,
            decisions,
            request_duration,
            upstream_duration,
            limiter_duration,
            decisions_by_tier,
            redis_errors,
            fallback,
            reloads,
            panics,
            delay,
            waiters_abandoned,
            local_keys,
            in_flight,
            lease_renewals,
            lease_expiries,
            settled,
            settle_missing,
            limit_keys,
            limit_keys_evicted,
            limit_keys_max,
            eventual_units_lost,
            redis_decide_calls,
            redis_decide_decisions,
            redis_decide_queued,
            redis_batch_seen: std::sync::Mutex::new([0; 3]),
        }
    }

    /// The registry in `format`. prometheus-client writes OpenMetrics only; classic text is
    /// derived from it (the `text` module says why).
    pub fn encode(&self, format: Format) -> String {
        let mut openmetrics = String::with_capacity(16 * 1024);
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut openmetrics, &self.registry);
        match format {
            Format::OpenMetrics => openmetrics,
            Format::Text => {
                let mut out = String::new();
                text::openmetrics_to_text(&openmetrics, &mut out);
                out
            }
        }
    }

    /// Handles for `route`'s series: requests by status, request and upstream durations.
    pub fn route(&self, route: &str) -> RouteMetrics {
        let label = RouteLabel {
            route: route.to_owned(),
        };
        RouteMetrics {
            route: route.to_owned(),
            requests: self.requests.clone(),
            statuses: (0..STATUS_SLOTS).map(|_| OnceLock::new()).collect(),
            request_duration: self.request_duration.get_or_create_owned(&label),
            upstream_duration: self.upstream_duration.get_or_create_owned(&label),
        }
    }

    /// Handles for one limit's series, created now so they read 0 before the first request.
    pub fn limit(&self, route: &str, limit: &str) -> LimitMetrics {
        let d = |decision| {
            self.decisions.get_or_create_owned(&RouteLimitDecision {
                route: route.to_owned(),
                limit: limit.to_owned(),
                decision,
            })
        };
        let rl = RouteLimit {
            route: route.to_owned(),
            limit: limit.to_owned(),
        };
        LimitMetrics {
            allowed: d("allowed"),
            rejected: d("rejected"),
            delayed: d("delayed"),
            shadow_rejected: d("shadow_rejected"),
            exempt: d("exempt"),
            fallback: self.fallback.get_or_create_owned(&rl),
            delay: self.delay.get_or_create_owned(&rl),
            abandoned: self.waiters_abandoned.get_or_create_owned(&rl),
            slots: None,
            settle: None,
        }
    }

    /// Handles for a settled limit's series (units charged and refunded, costs missing), created
    /// now so they read 0 before the first response. Only limits with `settle:` have them.
    pub fn settle(&self, route: &str, limit: &str) -> SettleMetrics {
        let d = |direction| {
            self.settled.get_or_create_owned(&RouteLimitDirection {
                route: route.to_owned(),
                limit: limit.to_owned(),
                direction,
            })
        };
        SettleMetrics {
            charged: d("charged"),
            refunded: d("refunded"),
            missing: self.settle_missing.get_or_create_owned(&RouteLimit {
                route: route.to_owned(),
                limit: limit.to_owned(),
            }),
        }
    }

    /// Handles for a concurrency limit's series (in flight, lease renewals and expiries),
    /// created now so they read 0 before the first request. Only concurrency limits have them.
    pub fn slots(&self, route: &str, limit: &str) -> SlotMetrics {
        let rl = RouteLimit {
            route: route.to_owned(),
            limit: limit.to_owned(),
        };
        SlotMetrics {
            in_flight: self.in_flight.get_or_create_owned(&rl),
            renewals: self.lease_renewals.get_or_create_owned(&rl),
            expiries: self.lease_expiries.get_or_create_owned(&rl),
        }
    }

    /// A handle that counts Redis failures in `tollgate_redis_errors_total` from a background
    /// task that holds no `Metrics`.
    pub fn redis_errors(&self) -> RedisErrors {
        RedisErrors(self.redis_errors.clone())
    }

    /// The `tollgate_limiter_duration_seconds` histogram of `scope`.
    pub fn limiter_duration(&self, scope: &'static str) -> Histogram {
        self.limiter_duration
            .get_or_create_owned(&ScopeLabel { scope })
    }

    /// The `tollgate_limiter_tier_decisions_total` counter of `tier`, the store that answered,
    /// within `scope`.
    pub fn tier(&self, scope: &'static str, tier: &'static str) -> Counter {
        self.decisions_by_tier
            .get_or_create_owned(&TierLabel { scope, tier })
    }

    /// Counts one Redis failure of `kind` in `tollgate_redis_errors_total`.
    pub fn redis_error(&self, kind: &'static str) {
        self.redis_errors.get_or_create(&KindLabel { kind }).inc();
    }

    /// Counts one config reload in `tollgate_config_reloads_total`: `success` if `ok`, else
    /// `error`.
    pub fn reload(&self, ok: bool) {
        let result = if ok { "success" } else { "error" };
        self.reloads.get_or_create(&ResultLabel { result }).inc();
    }

    /// Counts one panic caught in `task` (one of [`PANIC_TASKS`]) in `tollgate_panics_total`.
    pub fn panicked(&self, task: &'static str) {
        self.panics.get_or_create(&TaskLabel { task }).inc();
    }

    /// Sets the `tollgate_local_keys` gauge: keys the in-process stores hold.
    pub fn set_local_keys(&self, n: usize) {
        self.local_keys.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Sets `tollgate_limit_keys{store}`: keys the in-process stores of that kind hold.
    pub fn set_limit_keys(&self, store: &'static str, n: usize) {
        self.limit_keys
            .get_or_create(&StoreLabel { store })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Adds `n` to `tollgate_limit_keys_evicted_total{store}`.
    pub fn keys_evicted(&self, store: &'static str, n: u64) {
        self.limit_keys_evicted
            .get_or_create(&StoreLabel { store })
            .inc_by(n);
    }

    /// Sets `tollgate_limit_keys_max`: the running `server.max_keys`.
    pub fn set_limit_keys_max(&self, n: usize) {
        self.limit_keys_max
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Adds `n` to `tollgate_eventual_units_lost_total`.
    pub fn eventual_units_lost(&self, n: u64) {
        self.eventual_units_lost.inc_by(n);
    }

    /// The Redis store's counts so far (decide calls, the decisions they made, the decisions
    /// that queued) into `tollgate_redis_decide_*_total`: what grew since the last report. A
    /// count below the last one is a new store (a reload changed the `redis` section), counted
    /// from 0.
    pub fn redis_batches(&self, counts: [u64; 3]) {
        let mut seen = self
            .redis_batch_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let counters = [
            &self.redis_decide_calls,
            &self.redis_decide_decisions,
            &self.redis_decide_queued,
        ];
        for ((now, last), counter) in counts.iter().zip(seen.iter_mut()).zip(counters) {
            let grown = if *now >= *last { *now - *last } else { *now };
            counter.inc_by(grown);
            *last = *now;
        }
    }
}

/// Status codes 100..=599 get one lazily created counter each.
const STATUS_SLOTS: usize = 500;

/// A route's metric handles, resolved once per config build.
#[derive(Debug)]
pub struct RouteMetrics {
    route: String,
    requests: Family<RouteStatus, Counter>,
    statuses: Box<[OnceLock<Counter>]>,
    /// `tollgate_request_duration_seconds`: the whole request, from its head until the response
    /// body is sent or the client goes away.
    pub request_duration: Histogram,
    /// `tollgate_upstream_duration_seconds`: the upstream exchange, until the response head.
    pub upstream_duration: Histogram,
}

impl RouteMetrics {
    /// Counts one request answered with `status` in `tollgate_requests_total`.
    pub fn request(&self, status: u16) {
        let make = || {
            self.requests.get_or_create_owned(&RouteStatus {
                route: self.route.clone(),
                status,
            })
        };
        match self.statuses.get(usize::from(status).wrapping_sub(100)) {
            Some(slot) => slot.get_or_init(make).inc(),
            None => make().inc(),
        };
    }
}

/// A limit's metric handles, resolved once per config build.
#[derive(Clone, Debug)]
pub struct LimitMetrics {
    /// `decision="allowed"`: admitted by this limit without a wait.
    pub allowed: Counter,
    /// `decision="rejected"`: refused by this limit (over the rate, or a key part missing or
    /// ambiguous).
    pub rejected: Counter,
    /// `decision="delayed"`: admitted with a reserved slot to wait for (a shadow limit's
    /// reservation too, though nobody waits for it).
    pub delayed: Counter,
    /// `decision="shadow_rejected"`: a `shadow` limit would have refused; the request went on.
    pub shadow_rejected: Counter,
    /// `decision="exempt"`: an override (or the overrides file) exempts the request's key;
    /// this limit did not count it.
    pub exempt: Counter,
    /// `tollgate_fallback_decisions_total`: decided by the local store under `on_error: allow`
    /// because Redis could not answer.
    pub fallback: Counter,
    /// `tollgate_delay_seconds`: the wait this limit gave each request it delayed (never
    /// observed for a shadow limit).
    pub delay: Histogram,
    /// `tollgate_delayed_abandoned_total`: delayed requests whose client went away while
    /// waiting; a gcra reservation stays consumed, a concurrency waiter takes no slot.
    pub abandoned: Counter,
    /// A concurrency limit's series ([`Metrics::slots`]); `None` for a rate limit.
    pub slots: Option<SlotMetrics>,
    /// A settled limit's series ([`Metrics::settle`]); `None` without `settle:`.
    pub settle: Option<SettleMetrics>,
}

/// A settled limit's series, labelled with route and limit.
#[derive(Clone, Debug)]
pub struct SettleMetrics {
    /// `tollgate_settled_units_total{direction="charged"}`: units charged beyond the estimate.
    pub charged: Counter,
    /// `tollgate_settled_units_total{direction="refunded"}`: units of the estimate given back.
    pub refunded: Counter,
    /// `tollgate_settle_missing_total`: responses that never said their cost (or not as a
    /// whole number); the estimate stayed charged.
    pub missing: Counter,
}

impl SettleMetrics {
    /// Counts a settlement of `delta` units (true cost minus estimate).
    pub fn count(&self, delta: i64) {
        if delta > 0 {
            self.charged.inc_by(delta.unsigned_abs());
        } else {
            self.refunded.inc_by(delta.unsigned_abs());
        }
    }
}

/// A concurrency limit's series, labelled with route and limit.
#[derive(Clone, Debug)]
pub struct SlotMetrics {
    /// `tollgate_in_flight`: requests holding one of its slots now, on this instance.
    pub in_flight: Gauge,
    /// `tollgate_lease_renewals_total`: leases renewed because their request outlived half a
    /// lease.
    pub renewals: Counter,
    /// `tollgate_lease_expiries_total`: leases found run out before their request gave them back
    /// (Redis unreachable for half a lease, or the key reset meanwhile).
    pub expiries: Counter,
}

/// `tollgate_redis_errors_total`, for counting from anywhere.
#[derive(Clone, Debug)]
pub struct RedisErrors(Family<KindLabel, Counter>);

impl RedisErrors {
    /// Counts one failure of `kind`.
    pub fn count(&self, kind: &'static str) {
        self.0.get_or_create(&KindLabel { kind }).inc();
    }
}

/// The route label of requests that matched no route (an empty label value would read as "no
/// label" to Prometheus).
pub const UNMATCHED_ROUTE: &str = "_unmatched";

#[cfg(test)]
mod tests {
    use super::*;

    fn observed() -> Metrics {
        let m = Metrics::new();
        let r = m.route("users");
        r.request_duration.observe(Duration::from_micros(50));
        r.request_duration.observe(Duration::from_millis(3));
        r.request(200);
        r.request(429);
        r.request(429);
        m.limit("users", "per-ip").allowed.inc();
        m.set_local_keys(3);
        m
    }

    #[test]
    fn histogram_encodes_cumulative_buckets_and_sum() {
        let m = observed();
        for format in [Format::Text, Format::OpenMetrics] {
            let text = m.encode(format);
            for series in [
                "tollgate_request_duration_seconds_bucket{le=\"0.0001\",route=\"users\"} 1\n",
                "tollgate_request_duration_seconds_bucket{le=\"+Inf\",route=\"users\"} 2\n",
                "tollgate_request_duration_seconds_count{route=\"users\"} 2\n",
                "tollgate_requests_total{route=\"users\",status=\"429\"} 2\n",
                "tollgate_requests_total{route=\"users\",status=\"200\"} 1\n",
            ] {
                assert!(text.contains(series), "{format:?} lacks {series}{text}");
            }
        }
    }

    /// Every sample of the classic text belongs to the family its `# TYPE` line announces, as a
    /// classic parser matches them; OpenMetrics keeps its own family names and `# EOF`.
    #[test]
    fn classic_text_announces_every_family_by_its_sample_names() {
        let m = observed();
        let text = m.encode(Format::Text);
        let mut family: Option<(&str, &str)> = None;
        let mut samples = 0;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                family = rest.split_once(' ');
                continue;
            }
            if line.starts_with('#') {
                assert!(line.starts_with("# HELP "), "{line}");
                continue;
            }
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            let (fam, kind) = family.unwrap_or_else(|| panic!("{line} before any # TYPE"));
            let ok = match kind {
                "counter" | "gauge" => name == fam,
                "histogram" => ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| name.strip_prefix(fam) == Some(*s)),
                _ => false,
            };
            assert!(ok, "{line} under # TYPE {fam} {kind}");
            samples += 1;
        }
        assert!(samples > 20, "{text}");
        assert!(
            text.contains("# TYPE tollgate_requests_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP tollgate_requests_total Requests answered"),
            "{text}"
        );
        assert!(text.contains("tollgate_local_keys 3\n"), "{text}");

        let om = m.encode(Format::OpenMetrics);
        assert!(om.contains("# TYPE tollgate_requests counter\n"), "{om}");
        assert!(om.ends_with("# EOF\n"), "{om}");
    }
}
