//! Batched and coalesced decisions against a real redis-server (and a real Cluster): any split
//! of a sequence of requests into `decide_many` calls decides exactly as the same requests
//! decided one at a time in that order (every algorithm, costs, shadow limits, several limits
//! per request, reservations, both script paths); concurrent requests on one hot key share
//! calls and are never admitted over the limit; a lone request goes at once.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::support::redis::{RedisCluster, RedisServer, command_calls};
use jiff::tz::TimeZone;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tokio::runtime::Runtime;
use tollgate::limit::algorithm::calendar::Unit;
use tollgate::limit::algorithm::{
    Algorithm, Calendar, Concurrency, FixedWindow, Gcra, Micros, Quota, SlidingLog, SlidingWindow,
};
use tollgate::limit::redis::{
    BatchRequest, Decision, GlobalLimit, RedisSettings, RedisStore, RedisTarget, ScriptPath,
};

/// A realistic epoch (µs since 1970), so Lua handles today's timestamps exactly.
const EPOCH: Micros = 1_700_000_000_000_000;

struct Shared {
    rt: Runtime,
    _server: RedisServer,
    /// One store per script path: FCALL, then EVALSHA.
    stores: Vec<(ScriptPath, RedisStore)>,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let server = RedisServer::start();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let stores = rt.block_on(async {
            let mut settings = RedisSettings::new(RedisTarget::Single(server.url()));
            settings.timeout = Duration::from_secs(5);
            [ScriptPath::Functions, ScriptPath::Evalsha]
                .map(|path| {
                    (
                        path,
                        RedisStore::connect_with(settings.clone(), path).expect("connect"),
                    )
                })
                .to_vec()
        });
        Shared {
            rt,
            _server: server,
            stores,
        }
    })
}

/// A number no other case of this binary has, for its keys.
fn fresh() -> u64 {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    SEQ.fetch_add(1, Ordering::Relaxed)
}

/// Kinds: 0 gcra, 1 fixed_window, 2 sliding_window, 3 sliding_log, 4 fixed_window on
/// calendar days, 5 concurrency: the six algorithm codes of the scripts.
fn algorithm(kind: u8, q: Quota) -> Algorithm {
    match kind {
        0 => Algorithm::Gcra(Gcra::new(q)),
        1 => Algorithm::FixedWindow(FixedWindow::new(q)),
        2 => Algorithm::SlidingWindow(SlidingWindow::new(q)),
        3 => Algorithm::SlidingLog(SlidingLog::new(q)),
        4 => Algorithm::FixedWindow(FixedWindow::calendar(
            q,
            Calendar::new(Unit::Day, TimeZone::get("Europe/Berlin").expect("zone")),
        )),
        _ => Algorithm::Concurrency(Concurrency::new(q.count, 1_000, q.period)),
    }
}

/// One limit of a case: its algorithm and whether it reserves (gcra `on_limit: delay`).
#[derive(Clone, Debug)]
struct Spec {
    kind: u8,
    quota: Quota,
    max_delay: Micros,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        0u8..=5,
        (1u64..=6, 1u64..=4_000, 1u64..=6),
        prop_oneof![3 => Just(0u64), 1 => 1u64..=3_000],
    )
        .prop_map(|(kind, (count, period, burst), max_delay)| Spec {
            kind,
            quota: Quota {
                count,
                period,
                burst,
            },
            max_delay,
        })
}

/// One request of a case: which of the case's limits it has (a bit each, at least one),
/// which are shadow, which of two keys each uses, its cost, and the µs since the last one.
#[derive(Clone, Debug)]
struct Req {
    mask: u8,
    shadow: u8,
    keys: u8,
    cost: u64,
    gap: Micros,
}

fn req(specs: usize) -> impl Strategy<Value = Req> {
    let full = (1u16 << specs) - 1;
    (
        1..=full,
        any::<u8>(),
        any::<u8>(),
        prop_oneof![3 => Just(1u64), 1 => 0u64..=3],
        prop_oneof![2 => Just(0u64), 3 => 0u64..=1_500, 1 => 0u64..=10_000],
    )
        .prop_map(|(mask, shadow, keys, cost, gap)| Req {
            mask: mask as u8,
            shadow,
            keys,
            cost,
            gap,
        })
}

/// The requests of a case as the store takes them, on `keys` (per limit, two keys).
fn requests<'a>(
    algs: &'a [Algorithm],
    specs: &[Spec],
    keys: &'a [[String; 2]],
    reqs: &[Req],
    start: Micros,
) -> Vec<BatchRequest<'a>> {
    let mut now = start;
    reqs.iter()
        .enumerate()
        .map(|(r, q)| {
            now += q.gap;
            let mut out = BatchRequest {
                now_override: Some(now),
                ..BatchRequest::default()
            };
            for (i, alg) in algs.iter().enumerate() {
                if q.mask & (1 << i) == 0 {
                    continue;
                }
                let concurrency = alg.is_concurrency();
                out.limits.push(GlobalLimit {
                    algorithm: alg,
                    key: &keys[i][usize::from(q.keys >> i & 1)],
                    cost: if concurrency { 1 } else { q.cost },
                    max_delay: if alg.can_reserve() {
                        specs[i].max_delay
                    } else {
                        0
                    },
                });
                out.shadow.push(q.shadow & (1 << i) != 0);
                out.leases.push(if concurrency { r as u64 + 1 } else { 0 });
            }
            out
        })
        .collect()
}

fn case_keys(run: &str, case: u64, n: usize) -> Vec<[String; 2]> {
    (0..n)
        .map(|i| ["alice", "bob"].map(|who| format!("tg:{{batch/{case}/{run}/{i}/{who}}}")))
        .collect()
}

/// The case decided one request at a time (each its own `decide` call, in order), and split
/// into `decide_many` calls at `cuts`: every decision must be the same.
fn same_as_one_at_a_time(
    specs: &[Spec],
    reqs: &[Req],
    cuts: &[bool],
    start: Micros,
) -> Result<(), TestCaseError> {
    let sh = shared();
    let algs: Vec<Algorithm> = specs.iter().map(|s| algorithm(s.kind, s.quota)).collect();
    for (path, store) in &sh.stores {
        let case = fresh();
        let (alone_keys, batch_keys) = (
            case_keys("alone", case, algs.len()),
            case_keys("batch", case, algs.len()),
        );
        let alone = requests(&algs, specs, &alone_keys, reqs, start);
        let batched = requests(&algs, specs, &batch_keys, reqs, start);
        let (one, many) = sh.rt.block_on(async {
            let mut one: Vec<Decision> = Vec::new();
            for r in &alone {
                one.push(
                    store
                        .decide_leasing(&r.limits, &r.shadow, &r.leases, r.now_override)
                        .await
                        .expect("decide"),
                );
            }
            let mut many: Vec<Decision> = Vec::new();
            let mut from = 0;
            for i in 0..batched.len() {
                if i + 1 == batched.len() || cuts.get(i).copied().unwrap_or(false) {
                    many.extend(store.decide_batch(&batched[from..=i]).await.expect("batch"));
                    from = i + 1;
                }
            }
            (one, many)
        });
        prop_assert_eq!(store.script_path(), *path, "the store left its path");
        prop_assert_eq!(one.len(), many.len());
        for (i, (a, b)) in one.iter().zip(&many).enumerate() {
            prop_assert_eq!(a, b, "{:?}: request {} of {:?}", path, i, reqs[i]);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn any_split_into_batches_decides_as_one_at_a_time(
        specs in prop::collection::vec(spec(), 1..=3),
        (reqs, cuts) in (1usize..=3).prop_flat_map(|_| (
            prop::collection::vec(req(3), 1..=40),
            prop::collection::vec(any::<bool>(), 0..=40),
        )),
        start in prop_oneof![Just(EPOCH), EPOCH..=EPOCH + 10_000_000],
        twin in any::<bool>(),
    ) {
        // Two limits alike in every value (one spec on the wire, sent twice for a request
        // that has both).
        let mut specs = specs;
        if twin && specs.len() >= 2 {
            specs[1] = specs[0].clone();
        }
        // A request's mask may name limits the case does not have: only its bits below
        // specs.len() count, and a request left with none gets the first limit.
        let n = specs.len();
        let reqs: Vec<Req> = reqs
            .into_iter()
            .map(|mut r| {
                r.mask &= (1u8 << n) - 1;
                if r.mask == 0 {
                    r.mask = 1;
                }
                r
            })
            .collect();
        same_as_one_at_a_time(&specs, &reqs, &cuts, start)?;
    }
}

/// Every algorithm in one batch, one key each, many requests at one instant on the server's
/// own clock: the batch is decided at one `TIME`, each key exactly to its quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_on_the_server_clock_admits_each_key_to_its_quota() {
    let server = RedisServer::start();
    let store = RedisStore::connect(RedisSettings::new(RedisTarget::Single(server.url())))
        .expect("connect");
    store.ping().await.expect("redis up");
    let q = Quota {
        count: 5,
        period: 3_600_000_000,
        burst: 5,
    };
    let algs: Vec<Algorithm> = (0..=5).map(|k| algorithm(k, q)).collect();
    let keys: Vec<String> = (0..algs.len())
        .map(|i| format!("tg:{{clock/{i}}}"))
        .collect();
    let reqs: Vec<BatchRequest<'_>> = (0..12)
        .flat_map(|r| {
            algs.iter().zip(&keys).map(move |(a, k)| BatchRequest {
                limits: vec![GlobalLimit {
                    algorithm: a,
                    key: k,
                    cost: 1,
                    max_delay: 0,
                }],
                leases: vec![r + 1],
                ..BatchRequest::default()
            })
        })
        .collect();
    let decisions = store.decide_batch(&reqs).await.expect("batch");
    for (i, _) in algs.iter().enumerate() {
        let admitted = decisions
            .iter()
            .skip(i)
            .step_by(algs.len())
            .filter(|d| d.admitted)
            .count();
        assert_eq!(admitted, 5, "algorithm {i}");
    }
    let now = decisions[0].at[0];
    assert!(decisions.iter().all(|d| d.at == [now]), "one TIME per call");
}

/// `n` requests at once on `limits(i)`, each in its own task: the decisions.
async fn concurrently(
    store: &RedisStore,
    n: usize,
    keys: impl Fn(usize) -> Vec<(Algorithm, String)>,
) -> Vec<Decision> {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let store = store.clone();
        let limits = keys(i);
        tasks.spawn(async move {
            let limits: Vec<GlobalLimit<'_>> = limits
                .iter()
                .map(|(algorithm, key)| GlobalLimit {
                    algorithm,
                    key,
                    cost: 1,
                    max_delay: 0,
                })
                .collect();
            store.decide(&limits, None).await.expect("decide")
        });
    }
    tasks.join_all().await
}

fn hot_gcra(burst: u64) -> Algorithm {
    Algorithm::Gcra(Gcra::new(Quota {
        count: 1,
        period: 3_600_000_000,
        burst,
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_a_hot_key_share_calls_and_never_exceed_the_limit() {
    let server = RedisServer::start();
    let store = RedisStore::connect(RedisSettings::new(RedisTarget::Single(server.url())))
        .expect("connect");
    store.ping().await.expect("redis up");
    let _ = server.cli(&["config", "resetstat"]);
    let n = 400;
    let decisions =
        concurrently(&store, n, |_| vec![(hot_gcra(100), "tg:{hot}".to_string())]).await;
    assert_eq!(decisions.iter().filter(|d| d.admitted).count(), 100);
    let stats = store.batch_stats();
    assert_eq!(stats.decisions, n as u64);
    // A first FCALL may find the library not loaded yet (a failed call, then a reload).
    let (calls, failed) = command_calls(&server.cli(&["info", "commandstats"]), "fcall");
    let calls = calls - failed;
    assert_eq!(calls, stats.calls, "one FCALL per call the batcher counted");
    assert!(
        calls * 10 <= n as u64,
        "{calls} calls for {n} requests: at most one call per 10 requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_request_goes_at_once_as_one_decide() {
    let server = RedisServer::start();
    let store = RedisStore::connect(RedisSettings::new(RedisTarget::Single(server.url())))
        .expect("connect");
    store.ping().await.expect("redis up");
    let alg = hot_gcra(10);
    for i in 0..5 {
        let key = format!("tg:{{lone/{i}}}");
        let limit = GlobalLimit {
            algorithm: &alg,
            key: &key,
            cost: 1,
            max_delay: 0,
        };
        let d = store.decide(&[limit], None).await.expect("decide");
        assert!(d.admitted);
    }
    let stats = store.batch_stats();
    assert_eq!(
        (stats.calls, stats.decisions, stats.queued),
        (5, 5, 0),
        "each request its own call, none waited"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batching_off_sends_one_call_per_decision() {
    let server = RedisServer::start();
    let mut settings = RedisSettings::new(RedisTarget::Single(server.url()));
    settings.batch_max = 1;
    let store = RedisStore::connect(settings).expect("connect");
    store.ping().await.expect("redis up");
    let _ = server.cli(&["config", "resetstat"]);
    let decisions =
        concurrently(&store, 60, |_| vec![(hot_gcra(30), "tg:{off}".to_string())]).await;
    assert_eq!(decisions.iter().filter(|d| d.admitted).count(), 30);
    // A first FCALL may find the library not loaded yet (a failed call, then a reload).
    let (calls, failed) = command_calls(&server.cli(&["info", "commandstats"]), "fcall");
    assert_eq!(calls - failed, 60);
    assert_eq!(store.batch_stats().calls, 0);
}

/// On a Cluster each slot has its queue; a request over two slots (a hot key shared by all and
/// a key of its own) is reserved on both and refunded where it must be: the hot key admits
/// exactly its burst, in far fewer calls than requests on its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_batches_per_slot_and_stays_exact_across_slots() {
    let cluster = RedisCluster::start();
    let mut settings = RedisSettings::new(RedisTarget::Cluster(cluster.urls()));
    settings.timeout = Duration::from_secs(2);
    let store = RedisStore::connect(settings).expect("connect");
    store.ping().await.expect("cluster up");
    for node in 0..cluster.ports().len() {
        let _ = cluster.cli_node(node, &["config", "resetstat"]);
    }
    let n = 300;
    let own = Algorithm::Gcra(Gcra::new(Quota {
        count: 1,
        period: 3_600_000_000,
        burst: 5,
    }));
    let decisions = concurrently(&store, n, |i| {
        vec![
            (hot_gcra(50), "tg:{hot-cluster}".to_string()),
            (own.clone(), format!("tg:{{own/{i}}}")),
        ]
    })
    .await;
    assert_eq!(decisions.iter().filter(|d| d.admitted).count(), 50);
    let hot_node = cluster.node_for_key("tg:{hot-cluster}:gcra");
    let (calls, _) = command_calls(
        &cluster.cli_node(hot_node, &["info", "commandstats"]),
        "fcall",
    );
    let stats = store.batch_stats();
    assert_eq!(stats.decisions, 2 * n as u64);
    assert!(stats.queued > 0, "requests on the hot slot queued");
    // The hot key's node also holds some of the per-request keys, and refunds: its calls stay
    // far below one per request all the same.
    assert!(
        calls < n as u64,
        "{calls} calls on the hot node for {n} requests"
    );
}
