//! The running config: everything the request path reads, built aside and swapped in whole.
//!
//! A [`ConfigSnapshot`] is built from a validated [`Config`] once per load or reload and published
//! through an `ArcSwap`; a request loads it once and sees one consistent version for its whole
//! life. Limiter stores and waiter counters of limits whose definition did not change are
//! carried over from the previous snapshot, so a reload does not hand every client a fresh budget.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Uri};
use ipnet::IpNet;

use crate::config::{Config, Consistency, LimitConfig, OnError, RedisConfig, Scope};
use crate::connector::{Connector, Pools};
use crate::limit::eventual::EventualStore;
use crate::limit::local::LocalStore;
use crate::limit::local::deny::DenyCache;
use crate::limit::redis::{RedisSettings, RedisStore};
use crate::limit::top::TopKeys;
use crate::limit::{Limit, LimitSet, TierMetrics};
use crate::metrics::{Metrics, RouteMetrics, UNMATCHED_ROUTE};
use crate::routing::RouteTable;

/// One upstream base URL, split once so the request path only concatenates.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub scheme: Scheme,
    pub authority: Authority,
    /// Path prefix without a trailing `/` ("" for none).
    pub base_path: String,
    /// `Host` for requests that do not keep the client's: the authority without a default port,
    /// as an HTTP client writes it.
    pub host: HeaderValue,
    /// The connector's pools for this authority (taken once, when the snapshot is built).
    pub pools: Arc<Pools>,
}

impl Upstream {
    fn new(uri: &Uri, connector: &Connector) -> Self {
        let base = uri.path().trim_end_matches('/');
        let scheme = uri.scheme().cloned().unwrap_or(Scheme::HTTP);
        let authority = uri
            .authority()
            .cloned()
            .unwrap_or_else(|| Authority::from_static("localhost"));
        let default_port = if scheme == Scheme::HTTPS { 443 } else { 80 };
        let host = match authority.port_u16() {
            Some(p) if p != default_port => authority.as_str().to_owned(),
            _ => authority.host().to_owned(),
        };
        Self {
            host: HeaderValue::from_str(&host)
                .unwrap_or_else(|_| HeaderValue::from_static("localhost")),
            scheme,
            pools: connector.pools(&authority),
            authority,
            base_path: base.to_owned(),
        }
    }

    /// Notes that a connection to this upstream failed (nothing was sent).
    pub fn mark_down(&self) {
        self.pools.mark_down();
    }

    /// The upstream URI for a request's path and query.
    pub fn target(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        let mut pq = String::with_capacity(self.base_path.len() + path_and_query.len());
        pq.push_str(&self.base_path);
        pq.push_str(path_and_query);
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
    }
}

/// A request's upstreams in the order to try them (see [`Route::upstream_order`]).
pub(crate) type UpstreamOrder<'a> = smallvec::SmallVec<[&'a Upstream; 4]>;

#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    pub upstreams: Vec<Upstream>,
    next: AtomicUsize,
    pub timeout: Duration,
    pub preserve_host: bool,
    pub headers: bool,
    pub limits: LimitSet,
    pub metrics: RouteMetrics,
    /// Requests waiting for a reserved slot now; shared across reloads of the same route.
    pub waiters: Arc<AtomicUsize>,
    pub max_waiters: usize,
    /// The route's `rejection:`: what its rate-limited requests get instead of the default 429.
    pub rejection: Option<crate::config::RejectionConfig>,
    /// `rejection.legacy_headers`, read on every admitted response that carries `RateLimit`
    /// fields: `X-RateLimit-*` go with them.
    pub legacy_headers: bool,
}

impl Route {
    /// The upstreams to try for one request, in order: round-robin's pick, then the route's
    /// others after it; those marked down (a refused connection in the last [`crate::connector::FAIL_TIMEOUT`])
    /// after every other. A request goes on to the next only when it could not connect, so
    /// nothing of it was sent (nginx's `proxy_next_upstream error`).
    pub fn upstream_order(&self) -> UpstreamOrder<'_> {
        let n = self.upstreams.len();
        let mut order = UpstreamOrder::new();
        if n == 1 {
            order.push(&self.upstreams[0]);
            return order;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let down: smallvec::SmallVec<[bool; 4]> =
            self.upstreams.iter().map(|u| u.pools.is_down()).collect();
        // Round-robin over the upstreams that are up, so their shares stay even while one is
        // down; then the down ones.
        order.extend(
            self.upstreams
                .iter()
                .zip(&down)
                .filter(|(_, d)| !**d)
                .map(|(u, _)| u),
        );
        let up = order.len();
        order.extend(
            self.upstreams
                .iter()
                .zip(&down)
                .filter(|(_, d)| **d)
                .map(|(u, _)| u),
        );
        let ring = if up > 0 { up } else { n };
        order[..ring].rotate_left(turn % ring);
        order
    }
}

#[derive(Debug)]
pub struct ConfigSnapshot {
    pub config: Arc<Config>,
    /// The Redis tier, when `redis` is configured; kept across reloads with the same settings.
    pub redis: Option<RedisStore>,
    pub on_error: OnError,
    /// The concurrency leases this instance holds in `redis`, renewed in the background; kept
    /// with the store across reloads.
    pub leases: Option<Arc<crate::limit::LeaseBook>>,
    pub table: RouteTable,
    pub routes: Vec<Route>,
    pub unmatched: RouteMetrics,
    pub trusted_proxies: Vec<IpNet>,
}

/// What survives a reload, keyed by route and limit name.
type Carried = HashMap<(String, String), (LimitConfig, Stores)>;

/// A limit's state stores, carried over reloads together, with its rejected keys (`top`).
type Stores = (
    Arc<LocalStore>,
    Arc<DenyCache>,
    Option<Arc<EventualStore>>,
    Arc<TopKeys>,
);

impl ConfigSnapshot {
    pub fn build(
        config: Config,
        metrics: &Metrics,
        connector: &Connector,
        previous: Option<&ConfigSnapshot>,
    ) -> Self {
        let mut carried: Carried = HashMap::new();
        let mut waiters: HashMap<String, Arc<AtomicUsize>> = HashMap::new();
        if let Some(prev) = previous {
            for r in &prev.routes {
                waiters.insert(r.name.to_string(), r.waiters.clone());
                for l in &r.limits.limits {
                    carried.insert(
                        (
                            state_owner(&r.name, &l.config).to_owned(),
                            l.name.to_string(),
                        ),
                        (
                            l.config.clone(),
                            (
                                l.store.clone(),
                                l.deny_cache.clone(),
                                l.eventual.clone(),
                                l.top.clone(),
                            ),
                        ),
                    );
                }
            }
        }
        let redis = config.redis.as_ref().and_then(|rc| {
            let wanted = settings(rc);
            match previous.and_then(|p| p.redis.as_ref().map(|r| (p, r))) {
                // Same settings: keep the connected pool (and its breaker) across the reload.
                Some((p, r)) if p.config.redis.as_ref().map(settings) == Some(wanted.clone()) => {
                    Some(r.clone())
                }
                _ => match RedisStore::connect(wanted) {
                    Ok(store) => Some(store),
                    Err(e) => {
                        // Served as an outage: on_error decides every global limit.
                        tracing::error!(error = %e, "cannot set up the redis client");
                        None
                    }
                },
            }
        });
        let leases = redis.as_ref().map(|store| {
            match previous.and_then(|p| p.redis.as_ref().zip(p.leases.as_ref())) {
                Some((kept, book)) if kept.same(store) => Arc::clone(book),
                _ => {
                    let book = crate::limit::LeaseBook::new(
                        Arc::new(store.clone()),
                        Some(metrics.redis_errors()),
                    );
                    book.start_renewing();
                    book
                }
            }
        });
        let cluster = redis.as_ref().is_some_and(|r| r.is_cluster());
        let tiers = TierMetrics::new(metrics);
        // A shared limit's stores, taken by the first route that uses it and cloned by the rest:
        // one state per key, whichever route draws on it.
        let mut shared: HashMap<String, Stores> = HashMap::new();
        let routes = config
            .routes
            .iter()
            .map(|rc| {
                let limits = rc
                    .limits
                    .iter()
                    .map(|lc| {
                        let owner = state_owner(&rc.name, lc);
                        let mut carry =
                            || match carried.remove(&(owner.to_owned(), lc.name.clone())) {
                                Some((old, stores)) if same_state_shape(&old, lc) => stores,
                                _ => Default::default(),
                            };
                        let (store, tier, eventual, top) = if lc.shared {
                            shared
                                .entry(lc.name.clone())
                                .or_insert_with(|| {
                                    let (store, tier, eventual, top) = carry();
                                    // A global eventual limit's store is made here rather than
                                    // in `Limit::new`, so that every route shares it.
                                    let eventual = match (lc.scope, lc.consistency) {
                                        (Scope::Global, Consistency::Eventual) => {
                                            Some(eventual.unwrap_or_default())
                                        }
                                        _ => None,
                                    };
                                    (store, tier, eventual, top)
                                })
                                .clone()
                        } else {
                            carry()
                        };
                        let mut limit_metrics = metrics.limit(&rc.name, &lc.name);
                        if lc.concurrency.is_some() {
                            limit_metrics.slots = Some(metrics.slots(&rc.name, &lc.name));
                        }
                        if lc.settle.is_some() {
                            limit_metrics.settle = Some(metrics.settle(&rc.name, &lc.name));
                        }
                        let mut limit =
                            Limit::new(&rc.name, lc, store, tier, eventual, limit_metrics);
                        limit.top = top;
                        limit
                    })
                    .collect();
                Route {
                    name: rc.name.as_str().into(),
                    upstreams: rc
                        .upstreams
                        .iter()
                        .map(|u| Upstream::new(u, connector))
                        .collect(),
                    next: AtomicUsize::new(0),
                    timeout: rc.timeout,
                    preserve_host: rc.preserve_host,
                    headers: rc.headers,
                    limits: LimitSet::new(limits, tiers.clone(), cluster),
                    metrics: metrics.route(&rc.name),
                    waiters: waiters.remove(&rc.name).unwrap_or_default(),
                    max_waiters: config.server.max_waiters,
                    rejection: rc.rejection.clone(),
                    legacy_headers: rc.rejection.as_ref().is_some_and(|r| r.legacy_headers),
                }
            })
            .collect();
        Self {
            redis,
            leases,
            on_error: config.redis.as_ref().map_or(OnError::Allow, |r| r.on_error),
            table: RouteTable::new(config.routes.iter().map(|r| &r.matcher)),
            routes,
            unmatched: metrics.route(UNMATCHED_ROUTE),
            trusted_proxies: config.server.trusted_proxies.clone(),
            config: Arc::new(config),
        }
    }

    /// Every limit once: a shared limit (`- use:`) appears in each route that uses it, with the
    /// same stores; only its first appearance is listed.
    pub fn distinct_limits(&self) -> impl Iterator<Item = &Limit> {
        let mut seen = std::collections::HashSet::new();
        self.routes
            .iter()
            .flat_map(|r| r.limits.limits.iter())
            .filter(move |l| !l.config.shared || seen.insert(Arc::as_ptr(&l.store)))
    }

    /// Drops idle keys from every in-process store and holds them within `server.max_keys`
    /// (`limit::budget::rebalance`), then reports what they hold and evicted in `metrics`.
    /// The sweeper runs it every second; a new snapshot once before it serves, so its stores
    /// are capped from its first request (a reload may have lowered the cap). Returns the keys
    /// kept.
    pub fn sweep(&self, now: crate::limit::algorithm::Micros, metrics: &Metrics) -> usize {
        use crate::limit::budget::{StoreKind, rebalance};
        let limits = self.distinct_limits();
        let report = rebalance(limits, self.config.server.max_keys, now);
        for kind in StoreKind::ALL {
            metrics.set_limit_keys(kind.label(), report.held(kind));
            metrics.keys_evicted(kind.label(), report.evicted(kind));
        }
        metrics.eventual_units_lost(report.lost_units);
        metrics.set_limit_keys_max(self.config.server.max_keys);
        metrics.set_local_keys(report.total());
        if let Some(store) = &self.redis {
            let b = store.batch_stats();
            metrics.redis_batches([b.calls, b.decisions, b.queued]);
        }
        report.total()
    }
}

/// Who a limit's state belongs to across a reload: its route, or for a shared limit `@` (every
/// route that uses it; `@` cannot start a route's name).
fn state_owner<'a>(route: &'a str, limit: &LimitConfig) -> &'a str {
    if limit.shared { "@" } else { route }
}

/// State can be carried over when the algorithm and its quota are the same: a changed rate or
/// algorithm starts from a fresh store (the old state would mean something else), anything
/// else (shadow, headers, delay, cost) keeps it.
fn same_state_shape(old: &LimitConfig, new: &LimitConfig) -> bool {
    if old.concurrency.is_some() && new.concurrency.is_some() {
        // Slots held are slots held, whatever max_in_flight: a changed limit keeps counting
        // the requests still in flight (they give their slots back to this store).
        return old.key == new.key && old.scope == new.scope;
    }
    old.algorithm == new.algorithm
        && old.rate == new.rate
        && old.burst == new.burst
        && old.key == new.key
        && old.scope == new.scope
        && old.consistency == new.consistency
}

fn settings(rc: &RedisConfig) -> RedisSettings {
    RedisSettings {
        target: rc.target.clone(),
        timeout: rc.timeout,
        pool_size: rc.pool_size,
        batch_max: rc.batch_max,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_upstream_marked_down_is_tried_after_the_others() {
        let yaml = "routes:\n  - name: r\n    upstream: [http://a:1, http://b:1, http://c:1]\n";
        let config = crate::config::parse_str(std::path::Path::new("t.yaml"), yaml).unwrap();
        let rt = ConfigSnapshot::build(config, &Metrics::new(), &Connector::new(&[]), None);
        let route = &rt.routes[0];
        let names = |o: UpstreamOrder<'_>| -> Vec<String> {
            o.iter().map(|u| u.authority.host().to_owned()).collect()
        };
        assert_eq!(names(route.upstream_order()), ["a", "b", "c"]);
        assert_eq!(names(route.upstream_order()), ["b", "c", "a"]);
        route.upstreams[1].mark_down();
        // b, being down, only ever comes last; a and c share the first place evenly.
        let firsts: Vec<String> = (0..4)
            .map(|_| {
                let o = names(route.upstream_order());
                assert_eq!(o[2], "b");
                o[0].clone()
            })
            .collect();
        assert_eq!(firsts.iter().filter(|f| *f == "a").count(), 2, "{firsts:?}");
        assert_eq!(firsts.iter().filter(|f| *f == "c").count(), 2, "{firsts:?}");
    }

    /// Decides one request for `uri` on `limits` without Redis (eventual limits on this
    /// instance's own counts); whether it was admitted.
    fn admitted(
        limits: &crate::limit::LimitSet,
        uri: &http::Uri,
        metrics: &Metrics,
        clock: &crate::limit::clock::ManualClock,
        rt: &tokio::runtime::Runtime,
    ) -> bool {
        let (method, headers) = (http::Method::GET, http::HeaderMap::new());
        let cx = crate::limit::Context {
            now: crate::limit::clock::Clock::now(clock),
            started: std::time::Instant::now(),
            clock,
            probe_wait: std::time::Duration::from_millis(50),
            redis: None::<&RedisStore>,
            on_error: OnError::Allow,
            leases: None,
            allow_delay: true,
            waited: 0,
            metrics,
        };
        let parts = crate::key::RequestParts {
            method: &method,
            uri,
            headers: &headers,
            client_ip: [127, 0, 0, 1].into(),
            client_ip_text: None,
            route: "r",
            peer_trusted: false,
        };
        matches!(
            rt.block_on(limits.evaluate(&parts, &cx)),
            crate::limit::Verdict::Admit { .. }
        )
    }

    /// A route with two eventual limits and a local one, listed in `order` (limit names).
    fn eventual_route(order: &[&str]) -> Config {
        let mut yaml = String::from(
            "redis:\n  url: redis://127.0.0.1:1\nroutes:\n  - name: r\n    upstream: http://a:1\n    limits:\n",
        );
        for name in order {
            let (rate, scope) = match *name {
                "loc" => ("1000000/1s", "local"),
                _ => ("1/1d", "global"),
            };
            let consistency = if *name == "loc" { "strict" } else { "eventual" };
            yaml.push_str(&format!(
                "      - {{name: {name}, key: [query:k], algorithm: fixed_window, rate: {rate}, scope: {scope}, consistency: {consistency}}}\n"
            ));
        }
        crate::config::parse_str(std::path::Path::new("t.yaml"), &yaml).unwrap()
    }

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// An eventual limit on a route with a local limit too: requests for one key deciding at
    /// the same instant on two threads never both pass on its last unit. Every key allows one
    /// request; both threads send one request per key, in the same order, so they meet on
    /// thousands of last units. Decided without Redis (no pull, no sync): the instance's own
    /// counts, which are what the race was about (22–31 thousand admitted before the fix).
    #[test]
    fn eventual_and_local_limits_on_one_route_admit_each_unit_once() {
        let metrics = Metrics::new();
        let built = current_thread().block_on(async {
            ConfigSnapshot::build(
                eventual_route(&["ev", "loc"]),
                &metrics,
                &Connector::new(&[]),
                None,
            )
        });
        let limits = &built.routes[0].limits;
        const KEYS: usize = 20_000;
        let uris: Vec<http::Uri> = (0..KEYS)
            .map(|i| format!("/?k={i}").parse().unwrap())
            .collect();
        let clock = crate::limit::clock::ManualClock::new(1_000_000);
        let count = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    let rt = current_thread();
                    for uri in &uris {
                        if admitted(limits, uri, &metrics, &clock, &rt) {
                            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(count.into_inner(), KEYS);
    }

    /// A reload that lists a route's eventual limits in another order keeps their stores; a
    /// request still on the old config and one on the new hold the same eventual keys (and
    /// then the local one) at once, and must not each wait for the other's.
    #[test]
    fn opposite_eventual_limit_orders_across_a_reload_do_not_deadlock() {
        let metrics = Metrics::new();
        let (old, new) = current_thread().block_on(async {
            let old = ConfigSnapshot::build(
                eventual_route(&["ev1", "ev2", "loc"]),
                &metrics,
                &Connector::new(&[]),
                None,
            );
            let new = ConfigSnapshot::build(
                eventual_route(&["loc", "ev2", "ev1"]),
                &metrics,
                &Connector::new(&[]),
                Some(&old),
            );
            (old, new)
        });
        let (o, n) = (&old.routes[0].limits.limits, &new.routes[0].limits.limits);
        assert!(Arc::ptr_eq(
            o[0].eventual.as_ref().unwrap(),
            n[2].eventual.as_ref().unwrap()
        ));
        assert!(Arc::ptr_eq(&o[2].store, &n[0].store));
        // Who was rejected (the admin API's `top`) is carried with the stores.
        assert!(Arc::ptr_eq(&o[0].top, &n[2].top));
        let uri: http::Uri = "/?k=same".parse().unwrap();
        let clock = crate::limit::clock::ManualClock::new(1_000_000);
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            for rt_limits in [&old.routes[0].limits, &new.routes[0].limits] {
                let (uri, clock, metrics, done) = (&uri, &clock, &metrics, done.clone());
                s.spawn(move || {
                    let rt = current_thread();
                    for _ in 0..100_000 {
                        admitted(rt_limits, uri, metrics, clock, &rt);
                    }
                    done.send(()).unwrap();
                });
            }
            for _ in 0..2 {
                if finished
                    .recv_timeout(std::time::Duration::from_secs(30))
                    .is_err()
                {
                    // The threads cannot be unstuck; end the test process with the verdict.
                    eprintln!("decisions on the same eventual keys in opposite orders deadlocked");
                    std::process::exit(1);
                }
            }
        });
    }
}
