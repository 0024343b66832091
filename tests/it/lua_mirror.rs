//! decide.lua and peek.lua against the Rust cores: random timelines (clock overridden) fed to
//! both must give identical decisions and identical states, step by step, for every
//! algorithm, for reservations (`on_limit: delay`, and `reserve_ahead`'s reserve.lua against
//! `Gcra::grant`), for refunds and settlements, and for requests with several limits (where a rejection
//! must leave every key untouched). Every case runs on both ways the scripts reach Redis: the
//! function library (`FCALL`) and `EVALSHA`, the path of servers without functions.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::support::redis::RedisServer;
use fred::prelude::{Builder, Client, ClientLike, Config, KeysInterface};
use jiff::tz::TimeZone;
use posix_zones::posix_zone;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tokio::runtime::Runtime;
use tollgate::limit::algorithm::calendar::Unit;
use tollgate::limit::algorithm::{
    Algorithm, Calendar, FixedWindow, Gcra, GcraState, Micros, Quota, Settlement, SlidingLog,
    SlidingWindow, State,
};
use tollgate::limit::redis::{
    GlobalLimit, LimitVerdict, RedisError, RedisSettings, RedisStore, RedisTarget, ScriptPath,
    redis_keys,
};

/// The zones `limit/algorithm/calendar.rs` tests, by path: one generator for both.
#[path = "../../src/limit/algorithm/posix_zones.rs"]
mod posix_zones;

/// A realistic epoch (µs since 1970), so Lua handles today's timestamps exactly.
const EPOCH: Micros = 1_700_000_000_000_000;

struct Shared {
    rt: Runtime,
    _server: RedisServer,
    /// One store per [`ScriptPath`], in [`PATHS`] order.
    stores: Vec<RedisStore>,
    raw: Client,
}

const PATHS: [ScriptPath; 2] = [ScriptPath::Functions, ScriptPath::Evalsha];

impl Shared {
    /// Each store with the path it must still be on after a case: a store that fell back from
    /// functions to EVALSHA would leave the function path untested.
    fn stores(&self) -> impl Iterator<Item = (ScriptPath, &RedisStore)> {
        PATHS.into_iter().zip(&self.stores)
    }
}

/// One server, store and raw client for the whole binary; each case uses its own keys.
fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let server = RedisServer::start();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let (stores, raw) = rt.block_on(async {
            let mut settings = RedisSettings::new(RedisTarget::Single(server.url()));
            settings.timeout = Duration::from_secs(5);
            let stores = PATHS
                .map(|path| RedisStore::connect_with(settings.clone(), path).expect("connect"))
                .to_vec();
            let raw = Builder::from_config(Config::from_url(&server.url()).expect("url"))
                .build()
                .expect("client");
            raw.init().await.expect("raw client");
            (stores, raw)
        });
        Shared {
            rt,
            _server: server,
            stores,
            raw,
        }
    })
}

fn fresh_key(tag: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    format!(
        "tg:{{mirror/{tag}/{}}}",
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// Kinds 0 to 3: the four algorithms; 4: fixed_window on the calendar days of Berlin (whose
/// windows a test's microseconds rarely cross, but whose arguments are laid out differently).
fn algorithm(kind: u8, q: Quota) -> Algorithm {
    match kind {
        0 => Algorithm::Gcra(Gcra::new(q)),
        1 => Algorithm::FixedWindow(FixedWindow::new(q)),
        2 => Algorithm::SlidingWindow(SlidingWindow::new(q)),
        3 => Algorithm::SlidingLog(SlidingLog::new(q)),
        _ => Algorithm::FixedWindow(FixedWindow::calendar(
            q,
            Calendar::new(Unit::Day, TimeZone::get("Europe/Berlin").expect("zone")),
        )),
    }
}

/// Small quotas hit every branch; the large ones make sliding_window's products exceed 2^53,
/// the range where Lua's doubles stop being exact on their own.
fn quota() -> impl Strategy<Value = Quota> {
    prop_oneof![
        3 => (1u64..=20, 1u64..=50, 1u64..=20),
        3 => (1u64..=20, 1u64..=10_000, 1u64..=20),
        1 => (1u64..=1_000, 1_000u64..=60_000_000, 1u64..=1_000),
        1 => (1_000_000u64..=50_000_000, 3_600_000_000u64..=604_800_000_000, 1u64..=20),
    ]
    .prop_map(|(count, period, burst)| Quota {
        count,
        period,
        burst,
    })
}

/// `(gap before the request, cost)` steps: mostly faster than the limit allows, sometimes a
/// pause of up to three periods, several requests at one instant.
fn steps(q: Quota, max_cost: u64, len: usize) -> impl Strategy<Value = Vec<(Micros, u64)>> {
    let p = q.period;
    let slot = (p / q.count).max(1);
    let gap = prop_oneof![4 => 0..=slot, 3 => 0..=p, 1 => 0..=3 * p];
    let cost = prop_oneof![3 => Just(1u64), 1 => 1..=max_cost.max(1)];
    prop::collection::vec((gap, cost), 1..=len)
}

fn start(q: Quota) -> impl Strategy<Value = Micros> {
    prop_oneof![0..=3 * q.period, EPOCH..=EPOCH + 3 * q.period]
}

/// What the Rust core answers for one limit, in the store's terms.
fn rust_verdict(
    alg: &Algorithm,
    state: &State,
    now: Micros,
    cost: u64,
    max_delay: Micros,
) -> LimitVerdict {
    match alg.reserve(state, now, cost, max_delay) {
        Ok((snapshot, delay)) => LimitVerdict::Admitted { snapshot, delay },
        Err(rejection) => LimitVerdict::Rejected(rejection),
    }
}

async fn dump_all(raw: &Client, keys: &[String]) -> Vec<Option<Vec<u8>>> {
    let mut out = Vec::new();
    for k in keys {
        out.push(raw.dump(k.as_str()).await.expect("DUMP"));
    }
    out
}

/// One limit, one timeline: every decision and every state (through peek) must match.
fn mirror_one(
    kind: u8,
    q: Quota,
    start: Micros,
    steps: &[(Micros, u64)],
    max_delay: Micros,
) -> Result<(), TestCaseError> {
    let sh = shared();
    let alg = algorithm(kind, q);
    let max_delay = if alg.can_reserve() { max_delay } else { 0 };
    for (path, store) in sh.stores() {
        let key = fresh_key(&format!("a{kind}"));
        sh.rt.block_on(async {
            let mut state = alg.new_state();
            let mut now = start;
            for (i, &(gap, cost)) in steps.iter().enumerate() {
                now += gap;
                let cost = cost.min(alg.max_cost());
                let limit = GlobalLimit {
                    algorithm: &alg,
                    key: &key,
                    cost,
                    max_delay,
                };
                let expected = rust_verdict(&alg, &state, now, cost, max_delay);
                if expected.is_admitted() {
                    alg.commit(&mut state, now, cost);
                }
                let got = store.decide(&[limit], Some(now)).await.expect("decide");
                prop_assert_eq!(
                    got.admitted,
                    expected.is_admitted(),
                    "{:?} step {} at {} cost {}",
                    path,
                    i,
                    now,
                    cost
                );
                prop_assert_eq!(
                    got.per_limit,
                    vec![expected],
                    "{:?} step {} at {} cost {}",
                    path,
                    i,
                    now,
                    cost
                );
                let (peek, at) = store.peek_at(&limit, Some(now)).await.expect("peek");
                prop_assert_eq!(at, now);
                prop_assert_eq!(
                    peek,
                    alg.peek(&state, now),
                    "{:?} peek after step {} at {}",
                    path,
                    i,
                    now
                );
            }
            let keys = redis_keys(&key, &alg);
            let _: i64 = sh.raw.del(keys).await.expect("DEL");
            Ok(())
        })?;
        prop_assert_eq!(store.script_path(), path);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn gcra_matches_rust_with_and_without_reservations(
        (q, start, steps, max_delay) in quota().prop_flat_map(|q| {
            let tau = Gcra::new(q).tau();
            (Just(q), start(q), steps(q, q.burst, 200), prop_oneof![Just(0), 0..=tau, 0..=3 * tau])
        })
    ) {
        mirror_one(0, q, start, &steps, max_delay)?;
    }

    #[test]
    fn fixed_window_matches_rust((q, start, steps) in quota().prop_flat_map(|q| (Just(q), start(q), steps(q, q.count, 200)))) {
        mirror_one(1, q, start, &steps, 0)?;
    }

    #[test]
    fn sliding_window_matches_rust((q, start, steps) in quota().prop_flat_map(|q| (Just(q), start(q), steps(q, q.count, 200)))) {
        mirror_one(2, q, start, &steps, 0)?;
    }

    #[test]
    fn sliding_log_matches_rust((q, start, steps) in quota().prop_flat_map(|q| (Just(q), start(q), steps(q, q.count, 200)))) {
        mirror_one(3, q, start, &steps, 0)?;
    }
}

/// A request's limits: `(algorithm kind, quota, max_delay)` each.
fn limit_set() -> impl Strategy<Value = Vec<(u8, Quota, Micros)>> {
    let small = (1u64..=6, 1u64..=2_000, 1u64..=6).prop_map(|(count, period, burst)| Quota {
        count,
        period,
        burst,
    });
    (
        prop::collection::vec(
            (0u8..5, small, prop_oneof![Just(0u64), 0..=3_000u64]),
            2..=3,
        ),
        prop::bool::weighted(0.4),
    )
        .prop_map(|(mut set, gcra_only)| {
            // decide.lua answers a request whose limits are all gcra on a path of its own
            // (decide_gcra.lua), which mixed sets would rarely reach.
            if gcra_only {
                for limit in &mut set {
                    limit.0 = 0;
                }
            }
            set
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// All limits are checked, and charged only together: a request one enforced limit
    /// rejects leaves every key byte for byte as it was. A shadow limit's rejection stops
    /// nothing, and it is charged (when it admits) exactly when the others are, as in process.
    #[test]
    fn several_limits_are_all_or_nothing(
        (set, start, steps, shadow) in limit_set().prop_flat_map(|set| {
            let n = set.len();
            (
                Just(set),
                prop_oneof![0..=10_000u64, EPOCH..=EPOCH + 10_000],
                prop::collection::vec(
                    (prop_oneof![3 => 0..=300u64, 1 => 0..=3_000u64], prop::collection::vec(prop_oneof![3 => Just(1u64), 1 => 1..=6u64], n)),
                    1..=150,
                ),
                prop::collection::vec(prop::bool::weighted(0.3), n),
            )
        })
    ) {
        let sh = shared();
        let algs: Vec<Algorithm> = set.iter().map(|&(kind, q, _)| algorithm(kind, q)).collect();
        let delays: Vec<Micros> = set
            .iter()
            .zip(&algs)
            .map(|(&(_, _, d), alg)| if alg.can_reserve() { d } else { 0 })
            .collect();
        for (path, store) in sh.stores() {
        let keys: Vec<String> = (0..algs.len()).map(|i| fresh_key(&format!("multi{i}"))).collect();
        let all_keys: Vec<String> = keys.iter().zip(&algs).flat_map(|(k, a)| redis_keys(k, a)).collect();
        sh.rt.block_on(async {
            let mut states: Vec<State> = algs.iter().map(Algorithm::new_state).collect();
            let mut now = start;
            let mut rejected = 0;
            for (i, (gap, costs)) in steps.iter().enumerate() {
                now += gap;
                let limits: Vec<GlobalLimit<'_>> = (0..algs.len())
                    .map(|j| GlobalLimit {
                        algorithm: &algs[j],
                        key: &keys[j],
                        cost: costs[j].min(algs[j].max_cost()),
                        max_delay: delays[j],
                    })
                    .collect();
                let expected: Vec<LimitVerdict> = limits
                    .iter()
                    .zip(&states)
                    .map(|(l, s)| rust_verdict(l.algorithm, s, now, l.cost, l.max_delay))
                    .collect();
                let all = expected
                    .iter()
                    .zip(&shadow)
                    .all(|(v, &sh)| sh || v.is_admitted());
                if all {
                    for ((l, s), v) in limits.iter().zip(states.iter_mut()).zip(&expected) {
                        if v.is_admitted() {
                            l.algorithm.commit(s, now, l.cost);
                        }
                    }
                } else {
                    rejected += 1;
                }
                let before = dump_all(&sh.raw, &all_keys).await;
                let got = store
                    .decide_with_shadows(&limits, &shadow, Some(now))
                    .await
                    .expect("decide");
                prop_assert_eq!(got.admitted, all, "{:?} step {} at {}", path, i, now);
                prop_assert_eq!(&got.per_limit, &expected, "{:?} step {} at {}", path, i, now);
                if !all {
                    prop_assert_eq!(dump_all(&sh.raw, &all_keys).await, before, "{:?}: a rejected request wrote (step {})", path, i);
                }
                for (l, s) in limits.iter().zip(&states) {
                    let (peek, _) = store.peek_at(l, Some(now)).await.expect("peek");
                    prop_assert_eq!(peek, l.algorithm.peek(s, now), "{:?} peek {} after step {}", path, l.key, i);
                }
            }
            let _ = rejected;
            let _: i64 = sh.raw.del(all_keys).await.expect("DEL");
            Ok(())
        })?;
        prop_assert_eq!(store.script_path(), path);
        }
    }
}

/// Deterministic reservation walk-through, so a regression reads as a story rather than a
/// shrunk random case.
#[test]
fn gcra_reservation_queues_requests_behind_each_other() {
    let sh = shared();
    // 10/s (T = 100 ms), burst 2.
    let alg = Algorithm::Gcra(Gcra::new(Quota {
        count: 10,
        period: 1_000_000,
        burst: 2,
    }));
    for (path, store) in sh.stores() {
        let key = fresh_key("reserve");
        let limit = |max_delay| GlobalLimit {
            algorithm: &alg,
            key: &key,
            cost: 1,
            max_delay,
        };
        sh.rt.block_on(async {
            let now = EPOCH;
            let delays: Vec<Option<Micros>> = {
                let mut out = Vec::new();
                for _ in 0..5 {
                    let d = store
                        .decide(&[limit(250_000)], Some(now))
                        .await
                        .expect("decide");
                    out.push(match d.per_limit[0] {
                        LimitVerdict::Admitted { delay, .. } => Some(delay),
                        LimitVerdict::Rejected(_) => None,
                    });
                }
                out
            };
            // Burst of 2 at once, then slots 100 ms and 200 ms out, then beyond max_delay.
            assert_eq!(
                delays,
                [Some(0), Some(0), Some(100_000), Some(200_000), None],
                "{path:?}"
            );
            // Without a reservation the same request is simply rejected, 300 ms to wait.
            let d = store.decide(&[limit(0)], Some(now)).await.expect("decide");
            assert_eq!(
                d.per_limit[0],
                LimitVerdict::Rejected(tollgate::limit::algorithm::Rejection {
                    retry_after: 300_000,
                    remaining: 0,
                    reset_after: 400_000,
                }),
                "{path:?}"
            );
        });
        assert_eq!(store.script_path(), path);
    }
}

/// What to do with a step's commit in the refund test.
#[derive(Clone, Copy, Debug)]
enum Undo {
    Keep,
    /// Refund right after the decision, at the same instant.
    Now,
    /// Refund after the next step's decision, which saw these units (the cluster path's
    /// race: another request decided between a commit and its refund).
    AfterNext,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// refund.lua leaves the state as if the refunded request had never been admitted.
    #[test]
    fn refund_gives_back_exactly_what_a_commit_took(
        (kind, q, start, steps) in (0u8..5, quota()).prop_flat_map(|(kind, q)| {
            let undo = if kind == 0 {
                // gcra: a refund after the bucket drained returns up to `cost` too much
                // (documented), so only same-instant refunds are exact.
                prop_oneof![2 => Just(Undo::Keep), 1 => Just(Undo::Now)].boxed()
            } else {
                prop_oneof![2 => Just(Undo::Keep), 1 => Just(Undo::Now), 1 => Just(Undo::AfterNext)].boxed()
            };
            let max_cost = algorithm(kind, q).max_cost();
            (Just(kind), Just(q), start(q), (steps(q, max_cost, 120), prop::collection::vec(undo, 120)))
        })
    ) {
        let sh = shared();
        let alg = algorithm(kind, q);
        let (steps, undos) = steps;
        for (path, store) in sh.stores() {
        let key = fresh_key(&format!("refund{kind}"));
        sh.rt.block_on(async {
            let mut state = alg.new_state();
            // (state without the pending commit, its instant, its cost)
            let mut pending: Option<(State, Micros, u64)> = None;
            let mut now = start;
            for (i, (&(gap, cost), &undo)) in steps.iter().zip(&undos).enumerate() {
                now += gap;
                let cost = cost.min(alg.max_cost());
                let limit = GlobalLimit { algorithm: &alg, key: &key, cost, max_delay: 0 };
                let expected = rust_verdict(&alg, &state, now, cost, 0);
                let got = store.decide(&[limit], Some(now)).await.expect("decide");
                prop_assert_eq!(&got.per_limit, &vec![expected], "{:?} step {} at {}", path, i, now);
                let admitted = expected.is_admitted();
                // The state without the pending commit and without this step's.
                let prior = match &pending {
                    Some((without, _, _)) => without.clone(),
                    None => state.clone(),
                };
                if let Some((_, at, pending_cost)) = pending.take() {
                    let l = GlobalLimit {
                        cost: pending_cost,
                        ..limit
                    };
                    store.refund(&l, at, Some(now)).await.expect("refund");
                }
                state = prior.clone();
                if admitted {
                    alg.commit(&mut state, now, cost);
                    match undo {
                        Undo::Keep => {}
                        Undo::Now => {
                            let refunded = store.refund(&limit, now, Some(now)).await.expect("refund");
                            prop_assert!(refunded || cost == 0);
                            state = prior;
                        }
                        Undo::AfterNext => pending = Some((prior, now, cost)),
                    }
                }
                let (peek, _) = store.peek_at(&limit, Some(now)).await.expect("peek");
                prop_assert_eq!(peek, alg.peek(&state, now), "{:?} peek after step {} ({:?}) at {}", path, i, undo, now);
            }
            let _: i64 = sh.raw.del(redis_keys(&key, &alg)).await.expect("DEL");
            Ok(())
        })?;
        prop_assert_eq!(store.script_path(), path);
        }
    }
}

/// A gcra refund after another request was decided cannot know where that request's
/// emission would have started without the refunded one: it keeps the difference, so the
/// bucket is never laxer than without the refunded request, and stricter by at most the
/// time between commit and refund.
#[test]
fn gcra_refund_after_another_commit_is_never_laxer() {
    let sh = shared();
    // 10/s (T = 100 ms), burst 5.
    let alg = Algorithm::Gcra(Gcra::new(Quota {
        count: 10,
        period: 1_000_000,
        burst: 5,
    }));
    let t = EPOCH;
    let lag = 30_000;
    // (units taken before t, how far the refunded bucket may be behind the ideal one)
    for ((busy, slack), (path, store)) in [(0, 0), (3, lag)]
        .into_iter()
        .flat_map(|b| sh.stores().map(move |s| (b, s)))
    {
        let key = fresh_key("gcra-refund");
        let limit = GlobalLimit {
            algorithm: &alg,
            key: &key,
            cost: 1,
            max_delay: 0,
        };
        let mut without = alg.new_state();
        sh.rt.block_on(async {
            for _ in 0..busy {
                assert!(store.decide(&[limit], Some(t)).await.unwrap().admitted);
                alg.commit(&mut without, t, 1);
            }
            // A at t (to be refunded), B at t + lag, then A's refund.
            assert!(store.decide(&[limit], Some(t)).await.unwrap().admitted);
            assert!(
                store
                    .decide(&[limit], Some(t + lag))
                    .await
                    .unwrap()
                    .admitted
            );
            alg.commit(&mut without, t + lag, 1);
            assert!(store.refund(&limit, t, Some(t + lag)).await.unwrap());
            let (got, _) = store.peek_at(&limit, Some(t + lag)).await.unwrap();
            let ideal = alg.peek(&without, t + lag);
            assert!(
                got.reset_after >= ideal.reset_after
                    && got.reset_after <= ideal.reset_after + slack,
                "{path:?} busy {busy}: refunded {got:?}, without the request {ideal:?}"
            );
            if slack == 0 {
                assert_eq!(got, ideal, "{path:?}");
            }
        });
        assert_eq!(store.script_path(), path);
    }
}

const HOUR: Micros = 3_600_000_000;

/// A real zone or an arbitrary rule, and a unit.
fn calendar() -> impl Strategy<Value = (String, Unit)> {
    let zone = prop_oneof![
        prop::sample::select(vec![
            "Europe/Berlin",
            "America/New_York",
            "Australia/Lord_Howe"
        ])
        .prop_map(str::to_owned),
        posix_zone(),
    ];
    (
        zone,
        prop::sample::select(vec![Unit::Day, Unit::Week, Unit::Month]),
    )
}

fn calendar_algorithm(zone: &str, unit: Unit, count: u64) -> Algorithm {
    let tz = TimeZone::get(zone)
        .or_else(|_| TimeZone::posix(zone))
        .expect("zone");
    Algorithm::FixedWindow(FixedWindow::calendar(
        Quota {
            count,
            period: unit.nominal(),
            burst: count,
        },
        Calendar::new(unit, tz),
    ))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Calendar windows on Redis's clock: each step the instance sends the windows around its
    /// own clock, up to 20 hours off Redis's (any day is longer than 22 hours, so one of the
    /// three holds Redis's instant), and the script's decision, counted in the window of
    /// Redis's time, equals the Rust core's at Redis's time. Timelines cross windows, in real
    /// zones and arbitrary daylight-saving rules.
    #[test]
    fn calendar_fixed_window_matches_rust_whatever_window_the_instance_sees(
        ((zone, unit), count, start, steps) in (calendar(), 1u64..=6).prop_flat_map(|((zone, unit), count)| {
            let span = unit.nominal();
            let gap = prop_oneof![4 => 0..=HOUR, 3 => 0..=span / 4, 1 => 0..=span];
            let cost = prop_oneof![3 => Just(1u64), 1 => 1..=count];
            let skew = prop_oneof![2 => Just(0i64), 3 => -20 * HOUR as i64..=20 * HOUR as i64];
            (
                Just((zone, unit)),
                Just(count),
                // 2000 to 2040
                946_684_800_000_000u64..=2_208_988_800_000_000,
                prop::collection::vec((gap, cost, skew), 1..=60),
            )
        })
    ) {
        let sh = shared();
        let alg = calendar_algorithm(&zone, unit, count);
        for (path, store) in sh.stores() {
            let key = fresh_key("calendar");
            sh.rt.block_on(async {
                let mut state = alg.new_state();
                let mut now = start;
                for (i, &(gap, cost, skew)) in steps.iter().enumerate() {
                    now += gap;
                    let limit = GlobalLimit { algorithm: &alg, key: &key, cost, max_delay: 0 };
                    let expected = rust_verdict(&alg, &state, now, cost, 0);
                    if expected.is_admitted() {
                        alg.commit(&mut state, now, cost);
                    }
                    let seen = now.saturating_add_signed(skew);
                    let got = store
                        .decide_seen_from(&[limit], &[], &[], Some(now), seen)
                        .await
                        .expect("decide");
                    prop_assert_eq!(
                        &got.per_limit,
                        &vec![expected],
                        "{:?} {} {:?} step {} at {} seen at {}",
                        path, &zone, unit, i, now, seen
                    );
                    let (peek, _) = store.peek_at(&limit, Some(now)).await.expect("peek");
                    prop_assert_eq!(peek, alg.peek(&state, now), "{:?} peek after step {}", path, i);
                }
                let _: i64 = sh.raw.del(redis_keys(&key, &alg)).await.expect("DEL");
                Ok(())
            })?;
            prop_assert_eq!(store.script_path(), path);
        }
    }
}

/// An instance whose clock is more than a window from Redis's sends windows that do not hold
/// Redis's instant: the script refuses to count in any of them (a script error, which
/// `on_error` decides), and writes nothing.
#[test]
fn calendar_windows_far_from_redis_time_are_a_script_error() {
    let sh = shared();
    let alg = calendar_algorithm("Europe/Berlin", Unit::Day, 5);
    for (path, store) in sh.stores() {
        let key = fresh_key("calendar-skew");
        let limit = GlobalLimit {
            algorithm: &alg,
            key: &key,
            cost: 1,
            max_delay: 0,
        };
        sh.rt.block_on(async {
            let now = EPOCH;
            for seen in [now + 3 * 24 * HOUR, now - 3 * 24 * HOUR] {
                match store
                    .decide_seen_from(&[limit], &[], &[], Some(now), seen)
                    .await
                {
                    Err(RedisError::Script(msg)) => assert!(
                        msg.contains("is outside the calendar windows sent")
                            && msg.contains("differ by more than a window"),
                        "{path:?}: {msg}"
                    ),
                    other => panic!("{path:?}: {other:?}"),
                }
            }
            let keys = redis_keys(&key, &alg);
            assert_eq!(dump_all(&sh.raw, &keys).await, vec![None], "{path:?}");
            // 20 hours off the other way is still one of the three windows.
            let d = store
                .decide_seen_from(&[limit], &[], &[], Some(now), now - 20 * HOUR)
                .await
                .expect("decide");
            assert!(d.admitted, "{path:?}");
            let _: i64 = sh.raw.del(keys).await.expect("DEL");
        });
        assert_eq!(store.script_path(), path);
    }
}

/// One request of a settlement timeline: the gap before it, its estimate, its true cost, after
/// how many later steps its response settles it (0: at once, at its own instant), and how far
/// the instance's clock is from Redis's when it settles (calendar windows only).
type SettleStep = (Micros, u64, u64, usize, i64);

/// Decisions and settlements of one limit, in Redis and in the Rust core: responses settle in
/// any order and across window boundaries, several in flight at once. Every decision, and the
/// state (through peek) after every settlement, must match.
fn mirror_settlements(
    alg: &Algorithm,
    start: Micros,
    steps: &[SettleStep],
    tail: Micros,
) -> Result<(), TestCaseError> {
    let sh = shared();
    for (path, store) in sh.stores() {
        let key = fresh_key("settle");
        sh.rt.block_on(async {
            let mut state = alg.new_state();
            let mut now = start;
            // (due at step, the settlement, skew)
            let mut pending: Vec<(usize, Settlement, i64)> = Vec::new();
            let settle = |state: &mut State, now: Micros, s: Settlement, skew| {
                // The limit's cost is not read: the settlement's estimate is sent.
                let limit = GlobalLimit {
                    algorithm: alg,
                    key: &key,
                    cost: 0,
                    max_delay: 0,
                };
                alg.settle(state, s, now);
                let seen = now.saturating_add_signed(skew);
                async move {
                    store
                        .settle_seen_from(&limit, s, Some(now), seen)
                        .await
                        .expect("settle");
                    store.peek_at(&limit, Some(now)).await.expect("peek").0
                }
            };
            let steps_len = steps.len();
            for (i, &(gap, estimate, cost, after, skew)) in steps.iter().enumerate() {
                now += gap;
                let due: Vec<_> = pending.iter().filter(|p| p.0 <= i).copied().collect();
                pending.retain(|p| p.0 > i);
                for (_, s, skew) in due {
                    let got = settle(&mut state, now, s, skew).await;
                    prop_assert_eq!(
                        got,
                        alg.peek(&state, now),
                        "{:?} settling {:?} at {} (step {})",
                        path,
                        s,
                        now,
                        i
                    );
                }
                let estimate = estimate.min(alg.max_cost());
                let limit = GlobalLimit {
                    algorithm: alg,
                    key: &key,
                    cost: estimate,
                    max_delay: 0,
                };
                let expected = rust_verdict(alg, &state, now, estimate, 0);
                let got = store.decide(&[limit], Some(now)).await.expect("decide");
                prop_assert_eq!(
                    &got.per_limit,
                    &vec![expected],
                    "{:?} step {} at {}",
                    path,
                    i,
                    now
                );
                if !expected.is_admitted() {
                    continue;
                }
                alg.commit(&mut state, now, estimate);
                prop_assert_eq!(got.at[0], now);
                let LimitVerdict::Admitted { snapshot, .. } = expected else {
                    unreachable!("admitted above")
                };
                // What the gateway sends: the decision's instant plus its reset_after, for gcra
                // the TAT the admission stored.
                let full_at = got.at[0] + snapshot.reset_after;
                if let State::Gcra(g) = &state {
                    prop_assert_eq!(full_at, g.tat);
                }
                let delta = cost as i64 - estimate as i64;
                if delta == 0 {
                    continue;
                }
                let s = Settlement {
                    at: now,
                    estimate,
                    full_at,
                    delta,
                };
                if after == 0 {
                    let got = settle(&mut state, now, s, skew).await;
                    prop_assert_eq!(
                        got,
                        alg.peek(&state, now),
                        "{:?} settling step {} at once",
                        path,
                        i
                    );
                } else {
                    pending.push(((i + after).min(steps_len), s, skew));
                }
            }
            // The responses still out end after the last step, `tail` later.
            now += tail;
            for (_, s, skew) in pending {
                let got = settle(&mut state, now, s, skew).await;
                prop_assert_eq!(
                    got,
                    alg.peek(&state, now),
                    "{:?} settling {:?} at the end, {}",
                    path,
                    s,
                    now
                );
            }
            let _: i64 = sh.raw.del(redis_keys(&key, alg)).await.expect("DEL");
            Ok(())
        })?;
        prop_assert_eq!(store.script_path(), path);
    }
    Ok(())
}

/// Settlement steps over `q`: gaps as [`steps`] makes them, estimates up to `max_cost`, true
/// costs from 0 to three times the count (debts), responses out for up to 3 steps.
fn settle_steps(q: Quota, max_cost: u64, len: usize) -> impl Strategy<Value = Vec<SettleStep>> {
    let p = q.period;
    let slot = (p / q.count).max(1);
    let gap = prop_oneof![4 => 0..=slot, 3 => 0..=p, 1 => 0..=3 * p];
    let estimate = prop_oneof![3 => Just(1u64), 1 => 1..=max_cost.max(1)];
    let cost = prop_oneof![2 => 0..=q.count, 1 => 0..=3 * q.count];
    let after = prop_oneof![2 => Just(0usize), 2 => 1..=3usize];
    prop::collection::vec((gap, estimate, cost, after, Just(0i64)), 1..=len)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// settle.lua against settle.rs on every rate algorithm with epoch windows (and gcra and
    /// the log, interleaved the same way): charges and refunds, in the admission's window, the
    /// next one, or later.
    #[test]
    fn settlements_match_rust_in_flight_and_across_windows(
        (kind, q, start, steps, tail) in (0u8..4, quota()).prop_flat_map(|(kind, q)| {
            let max_cost = algorithm(kind, q).max_cost();
            (Just(kind), Just(q), start(q), settle_steps(q, max_cost, 120), 0..=3 * q.period)
        })
    ) {
        mirror_settlements(&algorithm(kind, q), start, &steps, tail)?;
    }

    /// The same on calendar windows, in real zones and arbitrary daylight-saving rules, with
    /// the instance's clock up to 20 hours off Redis's when it settles (the windows it sends
    /// are around its own clock; Redis's decides).
    #[test]
    fn calendar_settlements_match_rust_whatever_window_the_instance_sees(
        ((zone, unit), count, start, steps, tail) in (calendar(), 1u64..=6).prop_flat_map(|((zone, unit), count)| {
            let span = unit.nominal();
            let gap = prop_oneof![4 => 0..=HOUR, 3 => 0..=span / 4, 1 => 0..=span];
            let estimate = prop_oneof![3 => Just(1u64), 1 => 1..=count];
            let cost = prop_oneof![2 => 0..=count, 1 => 0..=3 * count];
            let after = prop_oneof![2 => Just(0usize), 2 => 1..=3usize];
            let skew = prop_oneof![2 => Just(0i64), 3 => -20 * HOUR as i64..=20 * HOUR as i64];
            (
                Just((zone, unit)),
                Just(count),
                946_684_800_000_000u64..=2_208_988_800_000_000,
                prop::collection::vec((gap, estimate, cost, after, skew), 1..=60),
                0..=span,
            )
        })
    ) {
        mirror_settlements(&calendar_algorithm(&zone, unit, count), start, &steps, tail)?;
    }
}

/// One step of a reservation timeline: the gap before it, its cost, what it asks for beyond
/// (or, when `short`, short of) the cost, and whether it is a reservation (else a per-request
/// decision of the same reduced gcra, as `reserve_ahead`'s fallback makes).
type ReserveStep = (Micros, u64, u64, bool, bool);

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// reserve.lua against `Gcra::grant`, on both script paths: from a random stored TAT (before,
    /// at or beyond now, up to past a full bucket), timelines of reservations of a random cost
    /// and want (a want under the cost included, and costs above the burst: never granted)
    /// mixed with per-request decisions. Every grant (units and snapshot) or rejection (the one
    /// a decision of the cost gets), its instant, and the state after it (through peek) must
    /// match, and a rejected reservation writes nothing.
    #[test]
    fn reserve_matches_gcra_grant(
        (q, start, tat_offset, steps) in quota().prop_flat_map(|q| {
            let g = Gcra::new(q);
            let (t, tau) = (g.emission_interval(), g.tau());
            let slot = t.max(1);
            let gap = prop_oneof![4 => 0..=slot, 2 => 0..=slot * (q.burst + 1), 1 => 0..=2 * tau + slot];
            let cost = prop_oneof![4 => Just(1u64), 2 => 1..=q.burst, 1 => 1..=q.burst + 1];
            let want = 0..=3 * q.burst + 1;
            let short = prop::bool::weighted(0.15);
            let reserve = prop::bool::weighted(0.8);
            (
                Just(q),
                start(q),
                0..=2 * tau + 2 * slot,
                prop::collection::vec((gap, cost, want, short, reserve), 1..=80),
            )
        })
    ) {
        mirror_reservations(q, start, tat_offset, &steps)?;
    }
}

fn mirror_reservations(
    q: Quota,
    start: Micros,
    tat_offset: Micros,
    steps: &[ReserveStep],
) -> Result<(), TestCaseError> {
    let sh = shared();
    let g = Gcra::new(q);
    let alg = Algorithm::Gcra(g.clone());
    for (path, store) in sh.stores() {
        let key = fresh_key("reserve");
        let tat_key = redis_keys(&key, &alg).swap_remove(0);
        sh.rt.block_on(async {
            // A random state: the TAT `tat_offset - tau` from the start (clamped at 0).
            let mut state = GcraState {
                tat: (start + tat_offset).saturating_sub(g.tau()),
            };
            if state.tat > 0 {
                let _: () = sh
                    .raw
                    .set(tat_key.as_str(), state.tat, None, None, false)
                    .await
                    .expect("SET");
            }
            let mut now = start;
            for (i, &(gap, cost, extra, short, reserve)) in steps.iter().enumerate() {
                now += gap;
                let limit = GlobalLimit {
                    algorithm: &alg,
                    key: &key,
                    cost,
                    max_delay: 0,
                };
                if !reserve {
                    let cost = cost.min(g.max_cost());
                    let limit = GlobalLimit { cost, ..limit };
                    let expected = rust_verdict(&alg, &State::Gcra(state), now, cost, 0);
                    if expected.is_admitted() {
                        g.commit(&mut state, now, cost);
                    }
                    let got = store.decide(&[limit], Some(now)).await.expect("decide");
                    prop_assert_eq!(
                        &got.per_limit,
                        &vec![expected],
                        "{:?} step {} (decide) at {}",
                        path,
                        i,
                        now
                    );
                    continue;
                }
                let want = if short { extra.min(cost) } else { cost + extra };
                let before = dump_all(&sh.raw, std::slice::from_ref(&tat_key)).await;
                let expected = g.grant(&mut state, now, cost, want);
                let got = store
                    .reserve(&limit, want, Some(now))
                    .await
                    .expect("reserve");
                prop_assert_eq!(
                    &got.verdict,
                    &expected,
                    "{:?} step {} at {}: cost {} want {}",
                    path,
                    i,
                    now,
                    cost,
                    want
                );
                prop_assert_eq!(got.at, now);
                if expected.is_err() {
                    prop_assert_eq!(
                        dump_all(&sh.raw, std::slice::from_ref(&tat_key)).await,
                        before,
                        "{:?}: a rejected reservation wrote (step {})",
                        path,
                        i
                    );
                }
                let (peek, _) = store.peek_at(&limit, Some(now)).await.expect("peek");
                prop_assert_eq!(
                    peek,
                    g.peek(&state, now),
                    "{:?} peek after step {} at {}",
                    path,
                    i,
                    now
                );
            }
            let _: i64 = sh.raw.del(tat_key.as_str()).await.expect("DEL");
            Ok(())
        })?;
        prop_assert_eq!(store.script_path(), path);
    }
    Ok(())
}

/// A reservation walk-through (10/s, burst 5): what a key near its limit grants, and that a
/// refused reservation is the rejection a decision of its cost gets.
#[test]
fn a_reservation_grants_what_fits_and_is_refused_as_a_decision_of_its_cost() {
    let sh = shared();
    let g = Gcra::new(Quota {
        count: 10,
        period: 1_000_000,
        burst: 5,
    });
    let alg = Algorithm::Gcra(g.clone());
    for (path, store) in sh.stores() {
        let key = fresh_key("reserve-walk");
        let limit = |cost| GlobalLimit {
            algorithm: &alg,
            key: &key,
            cost,
            max_delay: 0,
        };
        sh.rt.block_on(async {
            let now = EPOCH;
            let grant = |cost, want, at| {
                let limit = limit(cost);
                async move {
                    store
                        .reserve(&limit, want, Some(at))
                        .await
                        .expect("reserve")
                        .verdict
                }
            };
            let units = |r: Result<(u64, tollgate::limit::algorithm::Snapshot), _>| {
                r.map(|(n, s)| (n, s.remaining))
            };
            // 3 wanted of a full bucket of 5: 3, 2 left.
            assert_eq!(units(grant(1, 3, now).await), Ok((3, 2)), "{path:?}");
            // 4 wanted, 2 fit.
            assert_eq!(units(grant(1, 4, now).await), Ok((2, 0)), "{path:?}");
            // Nothing fits: a decision of the cost's rejection, 200 ms to wait.
            let refused = grant(2, 4, now).await.unwrap_err();
            let decided = store.decide(&[limit(2)], Some(now)).await.expect("decide");
            assert_eq!(
                decided.per_limit,
                vec![LimitVerdict::Rejected(refused)],
                "{path:?}"
            );
            assert_eq!(refused.retry_after, 200_000, "{path:?}");
            // 200 ms later exactly the cost of 2 fits, whatever the want.
            assert_eq!(
                units(grant(2, 9, now + 200_000).await),
                Ok((2, 0)),
                "{path:?}"
            );
        });
        assert_eq!(store.script_path(), path);
    }
}
