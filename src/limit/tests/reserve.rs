//! `reserve_ahead` across a fleet: two or three instances (each its own [`LimitSet`], so its
//! own in-process tier) share one [`FakeStore`] and decide random schedules of requests on one
//! key of reserving gcra limits. Whatever the schedule, the units admitted for a limit in any
//! interval `[s, t]`, summed over every instance, stay within the gcra bound of the limit's own
//! rate and burst, `burst + floor((t - s) / T)` (`limit/reserve.rs` has the argument); and one
//! instance with a steady flow makes fewer reservations than it admits requests.

use std::cell::Cell;

use proptest::prelude::*;

use super::*;

const SECOND: Micros = 1_000_000;

/// The reserving limits of a case, in route order: `a`, then `b` when there are two.
const RESERVING: [&str; 2] = ["a", "b"];

/// A reserving gcra limit's config: `count/1s`, `burst`, `cost`, `reserve_ahead` in ms.
#[derive(Clone, Copy, Debug)]
struct Reserving {
    count: u64,
    burst: u64,
    cost: u64,
    ahead_ms: u64,
}

impl Reserving {
    /// `T`, as `Gcra::new` has it.
    fn interval(&self) -> Micros {
        SECOND.div_ceil(self.count)
    }

    fn given_up(&self) -> u64 {
        (self.ahead_ms * 1000).div_ceil(self.interval())
    }

    /// The limit's YAML, keyed on the query's `k`.
    fn yaml(&self, name: &str) -> String {
        format!(
            "{{name: {name}, key: [query:k], algorithm: gcra, rate: {}/1s, burst: {}, cost: {}, reserve_ahead: {}ms}}",
            self.count, self.burst, self.cost, self.ahead_ms
        )
    }

    /// The first interval of `admitted` ((local time, units), sorted) found over the bound, as
    /// a message; `None` when every one is within it.
    fn overshoot(&self, admitted: &[(Micros, u64)]) -> Option<String> {
        let t = self.interval();
        for (i, &(from, _)) in admitted.iter().enumerate() {
            let mut units = 0;
            for &(to, n) in &admitted[i..] {
                units += n;
                let bound = self.burst + (to - from) / t;
                if units > bound {
                    return Some(format!(
                        "{units} units admitted in [{}, {}] (µs from the start), bound {bound} (T = {t} µs)",
                        from - NOW,
                        to - NOW
                    ));
                }
            }
        }
        None
    }
}

/// Any valid reserving limit: `T` from 5 ms to 1 s, `reserve_ahead` from 1 ms to 300 ms, and a
/// burst of what it gives up, the cost, and up to 20 more.
fn reserving() -> impl Strategy<Value = Reserving> {
    (1u64..=200, 1u64..=3, 1u64..=300, 0u64..=20).prop_map(|(count, cost, ahead_ms, extra)| {
        let r = Reserving {
            count,
            burst: 0,
            cost,
            ahead_ms,
        };
        Reserving {
            burst: r.given_up() + cost + extra,
            ..r
        }
    })
}

/// One request of a schedule.
#[derive(Clone, Copy, Debug)]
struct Request {
    /// The clock moves on by this much before it.
    dt: Micros,
    /// Which instance decides it (modulo the fleet's size).
    instance: usize,
    /// `l=` in its query: the local limit `loc` (one request per value and instance) applies.
    local: Option<u8>,
    /// `m=` in its query: the global limit `g` (one request per value, fleet-wide) applies.
    global: Option<u8>,
    /// Whether it waits for another request's reservation (`probe_wait`) or goes to Redis
    /// at once.
    waits: bool,
    /// The store calls made for it fail (a timeout; `on_error: deny`); a parked request's
    /// call after the park fails as the last request decided meanwhile did.
    fails: bool,
}

/// A request, and when `park` is set, its reservation call is in flight while the clock moves
/// on: by the `dt` of each request decided meanwhile (on any instance), then by the last.
#[derive(Clone, Debug)]
struct Step {
    request: Request,
    park: Option<(Vec<Request>, Micros)>,
}

fn dt() -> impl Strategy<Value = Micros> {
    prop_oneof![
        3 => Just(0),
        3 => 0..=5_000u64,
        2 => 0..=300_000u64,
        1 => 0..=2 * SECOND,
    ]
}

fn request() -> impl Strategy<Value = Request> {
    (
        dt(),
        0usize..3,
        proptest::option::of(0u8..4),
        proptest::option::weighted(0.2, 0u8..8),
        proptest::bool::weighted(0.8),
        proptest::bool::weighted(0.05),
    )
        .prop_map(|(dt, instance, local, global, waits, fails)| Request {
            dt,
            instance,
            local,
            global,
            waits,
            fails,
        })
}

fn step() -> impl Strategy<Value = Step> {
    (
        request(),
        proptest::option::weighted(
            0.2,
            (proptest::collection::vec(request(), 0..6), 0..=300_000u64),
        ),
    )
        .prop_map(|(request, park)| Step { request, park })
}

/// A fleet's route: its reserving limits (`a`, and `b` when two), whether the global limit `g`
/// comes before them, and whether the route has the local limit `loc`.
#[derive(Clone, Debug)]
struct Route {
    reserving: Vec<Reserving>,
    global_first: bool,
    local: bool,
}

impl Route {
    fn yaml(&self) -> Vec<String> {
        let g = "{name: g, key: [query:m], on_missing: skip, algorithm: fixed_window, rate: 1/1d}"
            .to_owned();
        let mut limits = Vec::new();
        if self.global_first {
            limits.push(g.clone());
        }
        for (r, name) in self.reserving.iter().zip(RESERVING) {
            limits.push(r.yaml(name));
        }
        if !self.global_first {
            limits.push(g);
        }
        if self.local {
            limits.push(
                "{name: loc, key: [query:l], on_missing: skip, scope: local, algorithm: fixed_window, rate: 1/1d}"
                    .to_owned(),
            );
        }
        limits
    }
}

fn route() -> impl Strategy<Value = Route> {
    (
        proptest::collection::vec(reserving(), 1..=2),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(reserving, global_first, local)| Route {
            reserving,
            global_first,
            local,
        })
}

/// Instances sharing one store, on one clock; what each reserving limit admitted, fleet-wide,
/// at the local time its units were decided.
struct Fleet<'c> {
    clock: &'c ManualClock,
    store: FakeStore<'c>,
    instances: Vec<(Metrics, LimitSet)>,
    /// Per reserving limit: (local time, units) of every admission.
    admitted: Vec<Vec<(Micros, u64)>>,
    costs: Vec<u64>,
    requests: usize,
}

impl<'c> Fleet<'c> {
    fn new(clock: &'c ManualClock, route: &Route, instances: usize) -> Self {
        let yaml = route.yaml();
        let limits: Vec<&str> = yaml.iter().map(String::as_str).collect();
        let instances = (0..instances)
            .map(|_| {
                let metrics = Metrics::new();
                let set = limit_set(&metrics, &limits, NOW);
                (metrics, set)
            })
            .collect();
        Self {
            clock,
            store: FakeStore::new(clock),
            instances,
            admitted: vec![Vec::new(); route.reserving.len()],
            costs: route.reserving.iter().map(|r| r.cost).collect(),
            requests: 0,
        }
    }

    /// Index of the instance that decides `r`.
    fn which(&self, r: &Request) -> usize {
        r.instance % self.instances.len()
    }

    /// Decides `r` on its instance at the clock's time now; whether it was admitted.
    async fn decide(&self, r: &Request, waits: bool) -> bool {
        let (metrics, set) = &self.instances[self.which(r)];
        let mut uri = String::from("/?k=k");
        if let Some(l) = r.local {
            uri.push_str(&format!("&l={l}"));
        }
        if let Some(m) = r.global {
            uri.push_str(&format!("&m={m}"));
        }
        let uri: http::Uri = uri.parse().unwrap();
        let held = (http::Method::GET, http::HeaderMap::new());
        let mut cx = context(self.clock, Some(&self.store), STRICT, metrics);
        if !waits {
            cx.probe_wait = Duration::ZERO;
        }
        self.store.fail_with(r.fails.then_some(RedisError::Timeout));
        let v = set.evaluate(&parts(&uri, &held), &cx).await;
        self.store.fail_with(None);
        matches!(v, Verdict::Admit { .. })
    }

    /// Records an admitted request: each reserving limit's units at `at(limit index)`.
    fn admit(&mut self, at: impl Fn(usize) -> Micros) {
        for (i, admitted) in self.admitted.iter_mut().enumerate() {
            admitted.push((at(i), self.costs[i]));
        }
    }

    /// Runs `step` to its end.
    fn run(&mut self, rt: &tokio::runtime::Runtime, step: &Step) {
        self.clock.advance(step.request.dt);
        self.requests += 1;
        let Some((during, last)) = &step.park else {
            if rt.block_on(self.decide(&step.request, step.request.waits)) {
                let now = self.clock.now();
                self.admit(|_| now);
            }
            return;
        };
        let (go, parked) = oneshot::channel();
        self.store.park_next_reserve(parked);
        let t0 = self.clock.now();
        let parked_instance = self.which(&step.request);
        let done = Cell::new(false);
        let during_admitted = std::cell::RefCell::new(Vec::new());
        let this = &*self;
        let first = async {
            let admitted = this.decide(&step.request, step.request.waits).await;
            done.set(true);
            (admitted, this.clock.now())
        };
        let meanwhile = async {
            // The parked request runs until it waits in its reservation call, or ends
            // without one.
            while !done.get() && this.store.parked_reserve_key().is_none() {
                tokio::task::yield_now().await;
            }
            if this.store.parked_reserve_key().is_none() {
                this.store.unpark_reserve();
            }
            for r in during {
                this.clock.advance(r.dt);
                // On the parked instance a request would wait for the parked reservation,
                // which this very task holds up: it goes to Redis at once instead.
                let waits = r.waits && this.which(r) != parked_instance;
                if this.decide(r, waits).await {
                    during_admitted.borrow_mut().push(this.clock.now());
                }
            }
            this.clock.advance(*last);
            let _ = go.send(());
        };
        let ((admitted, t1), ()) = rt.block_on(async { tokio::join!(first, meanwhile) });
        self.requests += during.len();
        for at in during_admitted.into_inner() {
            self.admit(|_| at);
        }
        if admitted {
            // The reserving limits before the one whose reservation was in flight took their
            // units from this instance's reservations at the start; that one got its units when
            // Redis decided, and the ones after it when the request went on (all at the start
            // when no call was in flight: the request ended before the clock moved).
            let key = self.store.parked_reserve_key();
            let set = &self.instances[parked_instance].1;
            let parked_at = RESERVING
                .iter()
                .position(|name| {
                    let l = set.limits.iter().find(|l| &*l.name == *name);
                    l.is_some_and(|l| Some(l.redis_key(b"k")) == key)
                })
                .unwrap_or(0);
            self.admit(|i| if i < parked_at { t0 } else { t1 });
        }
    }

    /// Every reserving limit's worst interval over its bound, as messages.
    fn overshoots(&mut self, route: &Route) -> Vec<String> {
        let mut wrong = Vec::new();
        for ((r, name), admitted) in route
            .reserving
            .iter()
            .zip(RESERVING)
            .zip(&mut self.admitted)
        {
            admitted.sort_unstable();
            if let Some(o) = r.overshoot(admitted) {
                wrong.push(format!("{name} ({}): {o}", r.yaml(name)));
            }
        }
        wrong
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn prop_a_fleet_of_reserving_instances_keeps_the_limits_bound(
        route in route(),
        instances in 2usize..=3,
        steps in proptest::collection::vec(step(), 1..80),
    ) {
        let clock = ManualClock::new(NOW);
        let mut fleet = Fleet::new(&clock, &route, instances);
        let rt = current_thread();
        for step in &steps {
            fleet.run(&rt, step);
        }
        let wrong = fleet.overshoots(&route);
        prop_assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    /// One instance, a steady flow within the rate: reservations grow past one request's
    /// cost, so some answer several requests (fewer calls than admissions).
    #[test]
    fn prop_a_steady_key_is_answered_mostly_from_reservations(
        (count, cost, extra_ms, extra_burst) in (10u64..=200, 1u64..=2, 0u64..=100, 0u64..=10),
        gaps in proptest::collection::vec(0u64..=1000, 40..100),
    ) {
        let interval = SECOND.div_ceil(count);
        // Requests at most four to a quarter of the reservation's life apart, so that a
        // reservation outlives several.
        let most = 2 * interval * cost;
        let r = Reserving { count, burst: 0, cost, ahead_ms: (4 * most).div_ceil(1000) + extra_ms };
        // Room left for reservations of several requests (they take at most half of it).
        let r = Reserving { burst: r.given_up() + 4 * cost + extra_burst, ..r };
        let route = Route { reserving: vec![r], global_first: false, local: false };
        let clock = ManualClock::new(NOW);
        let mut fleet = Fleet::new(&clock, &route, 1);
        let rt = current_thread();
        for gap in gaps {
            // From one request's worth of the rate to two.
            let request = Request {
                dt: interval * cost + interval * cost * gap / 1000,
                instance: 0,
                local: None,
                global: None,
                waits: true,
                fails: false,
            };
            fleet.run(&rt, &Step { request, park: None });
        }
        let admitted = fleet.admitted[0].len();
        let reserves = fleet.store.reserves.load(Ordering::SeqCst);
        prop_assert!(reserves < admitted, "{reserves} reservations for {admitted} admissions of {}", r.yaml("a"));
        let wrong = fleet.overshoots(&route);
        prop_assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }
}

/// A request with two reserving limits (two strict global limits) is decided per request,
/// both in one call, against their smaller bursts: no reservation is made, so a refusal by one
/// takes nothing from the other, and a slow call cannot leave one limit's units to be spent
/// past their time.
#[test]
fn a_request_with_two_reserving_limits_is_decided_per_request() {
    let request = |dt| Request {
        dt,
        instance: 0,
        local: None,
        global: None,
        waits: true,
        fails: false,
    };
    let a = Reserving {
        count: 1,
        burst: 5,
        cost: 1,
        ahead_ms: 1,
    };
    let b = Reserving {
        count: 1000,
        burst: 200,
        cost: 1,
        ahead_ms: 100,
    };
    let route = Route {
        reserving: vec![a, b],
        global_first: false,
        local: false,
    };
    let clock = ManualClock::new(NOW);
    let mut fleet = Fleet::new(&clock, &route, 1);
    let rt = current_thread();
    for dt in [0, 1_000, 1_000] {
        fleet.run(
            &rt,
            &Step {
                request: request(dt),
                park: None,
            },
        );
    }
    assert_eq!(fleet.store.reserves.load(Ordering::SeqCst), 0);
    assert_eq!(fleet.store.decides.load(Ordering::SeqCst), 3);
    // `a` gives up one unit of its burst of five: the three fit in the four left.
    assert_eq!(fleet.admitted[0].len(), 3, "admitted");
    let wrong = fleet.overshoots(&route);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A reload that shortens `reserve_ahead` keeps the in-process tier (same rate, burst and key:
/// `snapshot.rs` carries it), and with it the reservations made under the longer one. Their
/// units are spent only within the new `reserve_ahead` of their call: the other instances
/// decide against the larger burst the new one leaves, so units spent later than that would go
/// over the bound.
#[test]
fn a_reload_that_shortens_reserve_ahead_spends_no_unit_past_the_new_one() {
    let before = Reserving {
        count: 1000,
        burst: 200,
        cost: 1,
        ahead_ms: 100,
    };
    let after = Reserving {
        ahead_ms: 10,
        ..before
    };
    let clock = ManualClock::new(NOW);
    let store = FakeStore::new(&clock);
    let metrics = Metrics::new();
    let old = limit_set(&metrics, &[&before.yaml("a")], NOW);
    let mut reloaded = limit_set(&metrics, &[&after.yaml("a")], NOW);
    reloaded.limits[0].deny_cache = Arc::clone(&old.limits[0].deny_cache);
    let other = limit_set(&metrics, &[&after.yaml("a")], NOW);
    let uri: http::Uri = "/?k=k".parse().unwrap();
    let held = (http::Method::GET, http::HeaderMap::new());
    let rt = current_thread();
    let admitted = std::cell::RefCell::new(Vec::new());
    let decide = |set: &LimitSet, n: usize| {
        for _ in 0..n {
            let mut cx = context(&clock, Some(&store), STRICT, &metrics);
            cx.probe_wait = Duration::ZERO;
            if matches!(
                rt.block_on(set.evaluate(&parts(&uri, &held), &cx)),
                Verdict::Admit { .. }
            ) {
                admitted.borrow_mut().push((clock.now(), 1));
            }
        }
    };
    // One request a millisecond for 64 ms: the key's reservations grow to 50 units, 49 of
    // them left at the reload, to be spent until 163 ms under the old reserve_ahead.
    for _ in 0..64 {
        decide(&old, 1);
        clock.advance(1_000);
    }
    assert_eq!(
        store.reserves.load(Ordering::SeqCst),
        7,
        "1, 2, 4, .. 32 units, then 50 at 63 ms"
    );
    // The reload; 30 ms later the other instance takes what Redis has, and this one what its
    // last reservation had left.
    clock.advance(30_000);
    decide(&other, 300);
    decide(&reloaded, 60);
    let mut admitted = admitted.into_inner();
    admitted.sort_unstable();
    assert_eq!(after.overshoot(&admitted), None);
}
