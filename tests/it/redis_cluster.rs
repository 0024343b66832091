//! RedisStore on a 3-primary Redis Cluster: a request whose limits live on different nodes
//! is decided per slot and refunded when one rejects, so it stays all-or-nothing; the
//! function library is on every primary, and comes back to one that lost it.

use std::time::Duration;

use crate::support::redis::{RedisCluster, command_calls};
use tollgate::limit::algorithm::{
    Algorithm, FixedWindow, Gcra, Micros, Quota, SlidingLog, SlidingWindow, State,
};
use tollgate::limit::redis::{
    Decision, GlobalLimit, LimitVerdict, RedisSettings, RedisStore, RedisTarget, ScriptPath,
    library, redis_keys,
};

const EPOCH: Micros = 1_700_000_000_000_000;

/// One base key per node: tags are tried in turn until every primary owns one.
fn keys_on_every_node(cluster: &RedisCluster, alg_for: impl Fn(usize) -> Algorithm) -> Vec<String> {
    let mut found: Vec<Option<String>> = vec![None; 3];
    for i in 0.. {
        let key = format!("tg:{{cluster/user-{i}}}");
        let node = cluster.node_for_key(&key);
        if found[node].is_none() {
            found[node] = Some(key);
        }
        if found.iter().all(Option::is_some) {
            break;
        }
        assert!(i < 1000, "could not spread keys over the nodes");
    }
    let keys: Vec<String> = found.into_iter().map(Option::unwrap).collect();
    for (node, key) in keys.iter().enumerate() {
        for k in redis_keys(key, &alg_for(node)) {
            assert_eq!(cluster.node_for_key(&k), node, "suffixed key left its slot");
        }
    }
    keys
}

fn expected(alg: &Algorithm, state: &State, now: Micros, cost: u64) -> LimitVerdict {
    match alg.reserve(state, now, cost, 0) {
        Ok((snapshot, delay)) => LimitVerdict::Admitted { snapshot, delay },
        Err(rejection) => LimitVerdict::Rejected(rejection),
    }
}

fn connect(cluster: &RedisCluster) -> RedisStore {
    connect_with(cluster, ScriptPath::Functions)
}

fn connect_with(cluster: &RedisCluster, path: ScriptPath) -> RedisStore {
    let mut settings = RedisSettings::new(RedisTarget::Cluster(cluster.urls()));
    settings.timeout = Duration::from_secs(2);
    RedisStore::connect_with(settings, path).unwrap()
}

/// One limit per algorithm and key, cost 1, no reservation.
fn limits<'a>(algs: &'a [Algorithm], keys: &'a [String]) -> Vec<GlobalLimit<'a>> {
    algs.iter()
        .zip(keys)
        .map(|(algorithm, key)| GlobalLimit {
            algorithm,
            key,
            cost: 1,
            max_delay: 0,
        })
        .collect()
}

/// Six requests 1 ms apart, each decided by the store and by the Rust cores (every enforced
/// limit must admit; then each limit that admitted, shadow ones too, is charged); after each,
/// every key must read as the model says, so a slot charged for a request another slot
/// rejected was refunded. Returns how many requests were admitted.
async fn walk(store: &RedisStore, limits: &[GlobalLimit<'_>], shadow: &[bool]) -> usize {
    let mut states: Vec<State> = limits.iter().map(|l| l.algorithm.new_state()).collect();
    let mut admitted = 0;
    for step in 0..6u64 {
        let now = EPOCH + step * 1_000;
        let want: Vec<LimitVerdict> = limits
            .iter()
            .zip(&states)
            .map(|(l, s)| expected(l.algorithm, s, now, l.cost))
            .collect();
        let all = want
            .iter()
            .enumerate()
            .all(|(i, v)| shadow.get(i).copied().unwrap_or(false) || v.is_admitted());
        if all {
            for ((l, s), v) in limits.iter().zip(states.iter_mut()).zip(&want) {
                if v.is_admitted() {
                    l.algorithm.commit(s, now, l.cost);
                }
            }
        }
        let d = store
            .decide_with_shadows(limits, shadow, Some(now))
            .await
            .unwrap();
        assert_eq!(d.admitted, all, "step {step}");
        assert_eq!(d.per_limit, want, "step {step}");
        for (l, s) in limits.iter().zip(&states) {
            let (peek, _) = store.peek_at(l, Some(now)).await.unwrap();
            assert_eq!(
                peek,
                l.algorithm.peek(s, now),
                "{} after step {step}",
                l.key
            );
        }
        admitted += usize::from(d.admitted);
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_on_different_nodes_are_all_or_nothing() {
    let cluster = RedisCluster::start();
    let store = connect(&cluster);
    assert!(store.is_cluster());

    // Three limits, one per node; the sliding log runs out first.
    let q = |count| Quota {
        count,
        period: 60_000_000,
        burst: count,
    };
    let algs = [
        Algorithm::Gcra(Gcra::new(q(10))),
        Algorithm::FixedWindow(FixedWindow::new(q(10))),
        Algorithm::SlidingLog(SlidingLog::new(q(3))),
    ];
    let keys = keys_on_every_node(&cluster, |i| algs[i].clone());
    let limits = limits(&algs, &keys);
    // Rejected by the log alone: the other two nodes were charged and refunded.
    assert_eq!(walk(&store, &limits, &[]).await, 3);

    // Every node holds its limit's keys.
    for (node, (l, key)) in limits.iter().zip(&keys).enumerate() {
        for k in redis_keys(key, l.algorithm) {
            assert_eq!(
                cluster.cli_node(node, &["exists", &k]),
                "1",
                "{k} on node {node}"
            );
        }
    }
    // A reset (the admin API's DELETE) deletes one limit's keys for one key in one DEL, on
    // the node of their slot: the sliding log's two keys share it. Another instance hears of
    // it (published on the cluster), whichever node its subscription landed on.
    let other = connect(&cluster);
    let mut heard = other.resets();
    // Its subscription is made once its connection is up.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (node, (l, key)) in limits.iter().zip(&keys).enumerate() {
        let ks = redis_keys(key, l.algorithm);
        assert_eq!(store.reset(ks.clone()).await, Ok(ks.len() as u64), "{key}");
        for k in ks {
            assert_eq!(cluster.cli_node(node, &["exists", &k]), "0", "{k}");
        }
        let tag = tokio::time::timeout(Duration::from_secs(5), heard.recv()).await;
        let want = key.trim_start_matches("tg:{").trim_end_matches('}');
        assert_eq!(tag.expect("heard in time").unwrap(), want);
    }
    other.shutdown().await;
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_sharing_a_tag_go_in_one_call_and_scripts_load_on_every_node() {
    one_call_per_slot_and_scripts_on_every_node(ScriptPath::Functions).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_sharing_a_tag_go_in_one_evalsha_and_scripts_load_on_every_node() {
    one_call_per_slot_and_scripts_on_every_node(ScriptPath::Evalsha).await;
}

async fn one_call_per_slot_and_scripts_on_every_node(path: ScriptPath) {
    let cluster = RedisCluster::start();
    let store = connect_with(&cluster, path);
    // The command a decision is, and the one that loads it on a node.
    let (call, load) = match path {
        ScriptPath::Functions => ("fcall", "function|load"),
        ScriptPath::Evalsha => ("evalsha", "script|load"),
    };
    let q = Quota {
        count: 2,
        period: 60_000_000,
        burst: 2,
    };
    let sw = Algorithm::SlidingWindow(SlidingWindow::new(q));
    let log = Algorithm::SlidingLog(SlidingLog::new(Quota { count: 5, ..q }));
    // Same tag, two limits: one script call on one node.
    let limits = [
        GlobalLimit {
            algorithm: &sw,
            key: "tg:{tenant-7}:a",
            cost: 1,
            max_delay: 0,
        },
        GlobalLimit {
            algorithm: &log,
            key: "tg:{tenant-7}:b",
            cost: 1,
            max_delay: 0,
        },
    ];
    let node = cluster.node_for_key("tg:{tenant-7}:a");
    let script_calls =
        |n: usize| command_calls(&cluster.cli_node(n, &["info", "commandstats"]), call).0;
    let before: Vec<u64> = (0..3).map(script_calls).collect();
    let mut verdicts = Vec::new();
    for step in 0..3u64 {
        verdicts.push(
            store
                .decide(&limits, Some(EPOCH + step))
                .await
                .unwrap()
                .admitted,
        );
    }
    assert_eq!(verdicts, [true, true, false]);
    let after: Vec<u64> = (0..3).map(script_calls).collect();
    for n in 0..3 {
        // The first call's NOSCRIPT (or, before the load at connect, `Function not found`)
        // counts as a failed call too.
        let calls = after[n] - before[n];
        if n == node {
            assert!(
                (3..=4).contains(&calls),
                "{calls} {call} on the owning node"
            );
        } else {
            assert_eq!(calls, 0, "node {n} was asked");
        }
    }
    // The load (at connect, or after the first NOSCRIPT) went to every primary.
    for n in 0..3 {
        let info = cluster.cli_node(n, &["info", "commandstats"]);
        assert!(
            info.contains(&format!("cmdstat_{load}")),
            "node {n} never got {load}"
        );
    }
    assert_eq!(store.script_path(), path);
    store.shutdown().await;
}

/// A shadow limit on another node is charged only with the request: when an enforced limit
/// rejects, the shadow one's slot is refunded like any other, and its own rejection (it is
/// the smallest here after a while) stops nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_limit_on_another_node_is_charged_only_with_the_request() {
    let cluster = RedisCluster::start();
    let store = connect(&cluster);
    let q = |count| Quota {
        count,
        period: 60_000_000,
        burst: count,
    };
    // Node 0: enforced, 4 per minute; node 1: shadow, 2 per minute; node 2: enforced, 10.
    let algs = [
        Algorithm::FixedWindow(FixedWindow::new(q(4))),
        Algorithm::Gcra(Gcra::new(q(2))),
        Algorithm::Gcra(Gcra::new(q(10))),
    ];
    let keys = keys_on_every_node(&cluster, |i| algs[i].clone());
    // The shadow limit runs out after 2 and stops nothing; the fixed window lets 4 through.
    let admitted = walk(&store, &limits(&algs, &keys), &[false, true, false]).await;
    assert_eq!(admitted, 4);
    store.shutdown().await;
}

/// A slot moving between primaries while the gateway decides on its keys. During the move
/// (keys already on the target) Redis answers `ASK`, which fred 10.1 does not follow (it sends
/// the command after `ASKING` to the old owner again): those calls fail as `redirect`, Redis
/// up, only that slot's keys affected. Once the move ends, the old owner answers `MOVED`,
/// which is followed. Before, fred counted the redirection as a second attempt: a `MOVED`
/// failed the call, and an `ASK` ended the connection's task for good (every later call on it
/// timed out). Should a fred upgrade follow `ASK`, the `during` assertion fails: the moving
/// key is then admitted, and the README's Cluster note is to be updated with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moving_slot_costs_only_its_own_keys_and_is_followed_once_moved() {
    let cluster = RedisCluster::start();
    let mut settings = RedisSettings::new(RedisTarget::Cluster(cluster.urls()));
    settings.timeout = Duration::from_millis(500);
    let store = RedisStore::connect(settings).unwrap();
    let gcra = Algorithm::Gcra(Gcra::new(Quota {
        count: 1_000,
        period: 60_000_000,
        burst: 1_000,
    }));
    let keys = keys_on_every_node(&cluster, |_| gcra.clone());
    let limit = |key| {
        [GlobalLimit {
            algorithm: &gcra,
            key,
            cost: 1,
            max_delay: 0,
        }]
    };
    let mut now = EPOCH;
    // Every decision, per key: admitted, or the error it failed with.
    let mut decide_all = async |store: &RedisStore, rounds: usize| {
        let mut outcomes = vec![Vec::new(); keys.len()];
        for _ in 0..rounds {
            for (i, key) in keys.iter().enumerate() {
                now += 1_000;
                outcomes[i].push(match store.decide(&limit(key), Some(now)).await {
                    Ok(Decision { admitted: true, .. }) => "admitted".to_string(),
                    Ok(d) => format!("{d:?}"),
                    Err(e) => e.kind().to_string(),
                });
            }
        }
        outcomes
    };
    let all = |what: &str, n: usize| vec![vec![what.to_string(); n]; 3];
    assert_eq!(decide_all(&store, 2).await, all("admitted", 2));

    // Move the first key's slot from node 0 to node 1, keys first (the ASK phase).
    let slot = cluster.cli(&["cluster", "keyslot", &keys[0]]);
    let id = |n: usize| cluster.cli_node(n, &["cluster", "myid"]);
    let (from, to) = (id(0), id(1));
    let setslot = |n: usize, args: &[&str]| {
        let mut cmd = vec!["cluster", "setslot", &slot];
        cmd.extend(args);
        assert_eq!(cluster.cli_node(n, &cmd), "OK", "{cmd:?} on node {n}");
    };
    setslot(1, &["importing", &from]);
    setslot(0, &["migrating", &to]);
    let port = cluster.ports()[1].to_string();
    let moving = redis_keys(&keys[0], &gcra);
    let mut migrate = vec!["migrate", "127.0.0.1", &port, "", "0", "5000", "keys"];
    migrate.extend(moving.iter().map(String::as_str));
    assert_eq!(cluster.cli_node(0, &migrate), "OK");
    let mut during = all("admitted", 4);
    during[0] = vec!["redirect".to_string(); 4];
    assert_eq!(decide_all(&store, 4).await, during);

    // The move ends: every node learns the new owner; the client's slot map is stale (MOVED).
    for n in 0..3 {
        setslot(n, &["node", &to]);
    }
    assert_eq!(decide_all(&store, 4).await, all("admitted", 4));
    assert_eq!(cluster.node_for_key(&keys[0]), 1);
    for k in &moving {
        assert_eq!(cluster.cli_node(1, &["exists", k]), "1", "{k} on node 1");
    }
    store.shutdown().await;
}

/// A primary without the library (`FUNCTION FLUSH` here; a node added, or a replica promoted
/// that never got it, look the same) answers `Function not found`: the store loads the library
/// on every primary and calls again, and the decisions stay exact. The same walk on the
/// EVALSHA path gives the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_lost_the_library_gets_it_back_and_both_paths_agree() {
    let cluster = RedisCluster::start();
    let q = |count| Quota {
        count,
        period: 60_000_000,
        burst: count,
    };
    let algs = [
        Algorithm::SlidingWindow(SlidingWindow::new(q(4))),
        Algorithm::Gcra(Gcra::new(q(10))),
        Algorithm::SlidingLog(SlidingLog::new(q(3))),
    ];
    let keys = keys_on_every_node(&cluster, |i| algs[i].clone());
    let limits = limits(&algs, &keys);
    let name = library().name.as_str();
    for path in [ScriptPath::Functions, ScriptPath::Evalsha] {
        let store = connect_with(&cluster, path);
        // A first decision: the library is there (loaded at connect or by this call) ...
        assert!(
            store
                .decide(&limits[..1], Some(EPOCH))
                .await
                .unwrap()
                .admitted
        );
        for n in 0..3 {
            assert_eq!(cluster.cli_node(n, &["flushall"]), "OK");
            // ... and then gone from every node.
            assert_eq!(cluster.cli_node(n, &["function", "flush"]), "OK");
        }
        // The sliding log runs out first; the other nodes are refunded.
        assert_eq!(walk(&store, &limits, &[]).await, 3, "{path:?}");
        for n in 0..3 {
            let list = cluster.cli_node(n, &["function", "list"]);
            assert_eq!(
                list.contains(name),
                path == ScriptPath::Functions,
                "{path:?}: node {n}: {list}"
            );
        }
        assert_eq!(store.script_path(), path);
        store.shutdown().await;
    }
}

/// A library already on one primary (an instance of this version loaded it before a node was
/// added, say) is left alone there and loaded on the others: that node's `already exists` is
/// not an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_on_some_primaries_is_loaded_on_the_others() {
    let cluster = RedisCluster::start();
    let name = library().name.as_str();
    assert_eq!(
        cluster.cli_node(1, &["function", "load", &library().source]),
        name
    );
    let store = connect(&cluster);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !(0..3).all(|n| cluster.cli_node(n, &["function", "list"]).contains(name)) {
        assert!(
            std::time::Instant::now() < deadline,
            "{name} not loaded on every primary at connect"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let algs: Vec<Algorithm> = (0..3)
        .map(|_| {
            Algorithm::FixedWindow(FixedWindow::new(Quota {
                count: 2,
                period: 60_000_000,
                burst: 2,
            }))
        })
        .collect();
    let keys = keys_on_every_node(&cluster, |i| algs[i].clone());
    let limits = limits(&algs, &keys);
    assert_eq!(walk(&store, &limits, &[]).await, 2);
    for n in 0..3 {
        let stats = cluster.cli_node(n, &["info", "commandstats"]);
        // Every decision found the function: none was turned down and reloaded.
        assert_eq!(command_calls(&stats, "fcall").1, 0, "node {n}: {stats}");
    }
    assert_eq!(store.script_path(), ScriptPath::Functions);
    store.shutdown().await;
}
