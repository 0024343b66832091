//! RedisStore against a real redis-server on the server's own clock: key expiry, the function
//! library (loaded at connect, versions side by side, reloaded after `FUNCTION FLUSH`), the
//! EVALSHA path (reloaded after `SCRIPT FLUSH`; a server without functions), and the circuit
//! breaker through an outage and a start with Redis down.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::support::redis::{RedisServer, command_calls};
use tollgate::limit::algorithm::{
    Algorithm, FixedWindow, Gcra, Micros, Quota, SlidingLog, SlidingWindow, Snapshot,
};
use tollgate::limit::redis::{
    GlobalLimit, LimitVerdict, RedisError, RedisSettings, RedisStore, RedisTarget, ScriptPath,
    library, redis_keys,
};

/// `redis-server` arguments that take FUNCTION and FCALL away, as on Redis 6: what tollgate
/// sees of a server without functions.
pub const WITHOUT_FUNCTIONS: [&str; 6] = [
    "--rename-command",
    "FUNCTION",
    "",
    "--rename-command",
    "FCALL",
    "",
];

/// Shared by the tests that do not stop their server.
fn server() -> &'static RedisServer {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    SERVER.get_or_init(RedisServer::start)
}

fn settings(url: String, timeout: Duration) -> RedisSettings {
    let mut s = RedisSettings::new(RedisTarget::Single(url));
    s.timeout = timeout;
    s
}

fn quota(count: u64, period_ms: u64) -> Quota {
    Quota {
        count,
        period: period_ms * 1000,
        burst: count,
    }
}

fn one_of_each(period_ms: u64) -> Vec<Algorithm> {
    vec![
        Algorithm::Gcra(Gcra::new(quota(5, period_ms))),
        Algorithm::FixedWindow(FixedWindow::new(quota(3, period_ms))),
        Algorithm::SlidingWindow(SlidingWindow::new(quota(3, period_ms))),
        Algorithm::SlidingLog(SlidingLog::new(quota(3, period_ms))),
    ]
}

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

fn pttl_ms(server: &RedisServer, key: &str) -> i64 {
    server
        .cli(&["pttl", key])
        .parse()
        .expect("PTTL is an integer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_expires_once_its_state_is_full() {
    let server = server();
    let store = RedisStore::connect(settings(server.url(), Duration::from_secs(2))).unwrap();
    let algs = one_of_each(200);
    let keys: Vec<String> = (0..algs.len()).map(|i| format!("tg:{{ttl/{i}}}")).collect();
    let limits = limits(&algs, &keys);

    let mut longest: Micros = 0;
    for _ in 0..2 {
        let decided = Instant::now();
        let d = store.decide(&limits, None).await.unwrap();
        assert!(d.admitted);
        for (limit, verdict) in limits.iter().zip(&d.per_limit) {
            let LimitVerdict::Admitted { snapshot, .. } = verdict else {
                panic!("{} rejected", limit.key)
            };
            longest = longest.max(snapshot.reset_after);
            // The TTL is the time until full, rounded up to the millisecond.
            let bound = snapshot.reset_after.div_ceil(1000) as i64;
            for key in redis_keys(limit.key, limit.algorithm) {
                let pttl = pttl_ms(server, &key);
                if pttl == -2 || pttl == 0 {
                    // Gone already, or going within the millisecond (PTTL rounds down): only
                    // right if the state was full by now (a window that happened to end within
                    // a millisecond or so, or a slow read on a loaded machine).
                    assert!(
                        decided.elapsed() + Duration::from_millis(1)
                            >= Duration::from_micros(snapshot.reset_after),
                        "{key} expired early: full in {} µs",
                        snapshot.reset_after
                    );
                    continue;
                }
                assert!(
                    pttl > 0 && pttl <= bound + 1,
                    "{key}: PTTL {pttl} ms, full in {} µs",
                    snapshot.reset_after
                );
            }
        }
    }

    tokio::time::sleep(Duration::from_micros(longest) + Duration::from_millis(30)).await;
    for limit in &limits {
        for key in redis_keys(limit.key, limit.algorithm) {
            assert_eq!(
                server.cli(&["exists", &key]),
                "0",
                "{key} outlived its state"
            );
        }
        let q = limit.algorithm.quota();
        let full = store.peek(limit).await.unwrap();
        let count = if matches!(limit.algorithm, Algorithm::Gcra(_)) {
            q.burst
        } else {
            q.count
        };
        assert_eq!(
            full,
            Snapshot {
                remaining: count,
                reset_after: 0
            }
        );
    }
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_reload_after_function_flush_and_script_flush() {
    // Its own server: flushing the shared one could land between another test's reload and its
    // retry, a second NOSCRIPT that the store rightly does not retry again.
    let server = &RedisServer::start();
    // (path, what to flush, its command, calls turned down after a flush: the library holds
    // decide and peek, the script cache has them as two scripts)
    for (path, flush, call, missed) in [
        (ScriptPath::Functions, "function", "fcall", 1),
        (ScriptPath::Evalsha, "script", "evalsha", 2),
    ] {
        let store =
            RedisStore::connect_with(settings(server.url(), Duration::from_secs(2)), path).unwrap();
        let algs = one_of_each(60_000);
        let keys: Vec<String> = (0..algs.len())
            .map(|i| format!("tg:{{flush/{call}/{i}}}"))
            .collect();
        let limits = limits(&algs, &keys);
        if path == ScriptPath::Functions {
            // Loaded at connect: a flush before that would go unseen.
            let name = library().name.as_str();
            let loaded = wait_for(Duration::from_secs(5), || {
                server.cli(&["function", "list"]).contains(name)
            })
            .await;
            assert!(loaded.is_some(), "{name} not loaded at connect");
        }
        for round in 0..3u64 {
            let (_, failed_before) = command_calls(&server.cli(&["info", "commandstats"]), call);
            assert_eq!(server.cli(&[flush, "flush"]), "OK");
            let d = store.decide(&limits, None).await.unwrap();
            assert!(d.admitted, "{path:?} round {round}");
            // The state carried over: one unit more taken each round.
            let remaining: Vec<u64> = d
                .per_limit
                .iter()
                .map(|v| match v {
                    LimitVerdict::Admitted { snapshot, .. } => snapshot.remaining,
                    LimitVerdict::Rejected(r) => panic!("rejected: {r:?}"),
                })
                .collect();
            assert_eq!(remaining, [4 - round, 2 - round, 2 - round, 2 - round]);
            assert!(store.peek(&limits[0]).await.is_ok());
            // The flush was seen (calls turned down, then reloaded), on this store's path.
            let (_, failed) = command_calls(&server.cli(&["info", "commandstats"]), call);
            assert_eq!(failed, failed_before + missed, "{path:?} round {round}");
        }
        assert!(store.is_available());
        assert_eq!(store.script_path(), path);
        store.shutdown().await;
    }
}

/// A server without FUNCTION and FCALL (Redis 6) is decided by EVALSHA, with the same answers:
/// the store finds out at connect, or at its first call if that comes first, and stays there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_without_functions_is_decided_by_evalsha() {
    let server = &RedisServer::start_with(&WITHOUT_FUNCTIONS);
    assert!(
        server
            .cli(&["function", "list"])
            .contains("unknown command")
    );
    let store = RedisStore::connect(settings(server.url(), Duration::from_secs(2))).unwrap();
    let algs = one_of_each(60_000);
    let keys: Vec<String> = (0..algs.len())
        .map(|i| format!("tg:{{nofn/{i}}}"))
        .collect();
    let limits = limits(&algs, &keys);
    for round in 0..3u64 {
        let d = store.decide(&limits, None).await.unwrap();
        assert!(d.admitted, "round {round}");
        assert!(store.peek(&limits[3]).await.is_ok());
    }
    assert_eq!(store.script_path(), ScriptPath::Evalsha);
    let stats = server.cli(&["info", "commandstats"]);
    let (evalsha, _) = command_calls(&stats, "evalsha");
    assert!(evalsha >= 6, "{evalsha} EVALSHA");
    assert!(store.is_available());
    store.shutdown().await;
}

/// The library is on the server before the first decision, under its versioned name; a library
/// of another tollgate version stays loaded and callable next to it (a rollout), and a second
/// instance of this version loading it again replaces nothing but its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_loads_at_connect_next_to_other_versions() {
    let server = &RedisServer::start();
    let old = "tollgate_v000000000000";
    let old_lib = format!(
        "#!lua name={old}\nredis.register_function('{old}_decide', function(keys, args) return {{ 7 }} end)"
    );
    assert_eq!(server.cli(&["function", "load", &old_lib]), old);
    let name = &library().name;
    assert!(name.starts_with("tollgate_v") && name != old);

    let stores: Vec<RedisStore> = (0..2)
        .map(|_| RedisStore::connect(settings(server.url(), Duration::from_secs(2))).unwrap())
        .collect();
    let loaded = wait_for(Duration::from_secs(5), || {
        server.cli(&["function", "list"]).contains(name.as_str())
    })
    .await;
    assert!(loaded.is_some(), "{name} not loaded at connect");
    // Both instances try at connect, each in a task of its own: wait for the second try too.
    wait_for(Duration::from_secs(5), || {
        let stats = server.cli(&["info", "commandstats"]);
        command_calls(&stats, "function|load").0 >= 3
    })
    .await;
    let stats = server.cli(&["info", "commandstats"]);
    // The test's own load, then this version's: loaded by one instance, found there by the
    // other (a failed call, which compiled nothing).
    assert_eq!(command_calls(&stats, "function|load"), (3, 1), "{stats}");
    assert_eq!(command_calls(&stats, "fcall").0, 0);

    let algs = one_of_each(60_000);
    let keys: Vec<String> = (0..algs.len())
        .map(|i| format!("tg:{{versions/{i}}}"))
        .collect();
    let limits = limits(&algs, &keys);
    for (i, store) in stores.iter().enumerate() {
        let d = store.decide(&limits, None).await.unwrap();
        assert!(d.admitted);
        assert_eq!(store.script_path(), ScriptPath::Functions);
        let remaining = match d.per_limit[0] {
            LimitVerdict::Admitted { snapshot, .. } => snapshot.remaining,
            LimitVerdict::Rejected(r) => panic!("rejected: {r:?}"),
        };
        assert_eq!(remaining, 4 - i as u64, "the two instances share the key");
    }
    let stats = server.cli(&["info", "commandstats"]);
    assert_eq!(
        command_calls(&stats, "fcall"),
        (2, 0),
        "no call found it missing"
    );
    assert_eq!(command_calls(&stats, "evalsha").0, 0);
    let list = server.cli(&["function", "list"]);
    assert!(list.contains(old) && list.contains(name.as_str()), "{list}");
    assert_eq!(
        server.cli(&["fcall", &format!("{old}_decide"), "0"]),
        "7",
        "the other version's library still answers"
    );
    for store in stores {
        store.shutdown().await;
    }
}

/// bench/library_lua.sh, which bench/script.sh loads, prints the library tollgate loads.
#[test]
fn bench_library_lua_prints_the_library_tollgate_loads() {
    let out =
        std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/bench/library_lua.sh"))
            .output()
            .expect("bench/library_lua.sh runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8(out.stdout).unwrap() == library().source);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_request_and_bad_parameters_never_reach_redis() {
    let store = RedisStore::connect(settings(server().url(), Duration::from_secs(2))).unwrap();
    let d = store.decide(&[], None).await.unwrap();
    assert!(d.admitted && d.per_limit.is_empty());
    let huge = Algorithm::FixedWindow(FixedWindow::new(Quota {
        count: 1,
        period: u64::MAX / 2,
        burst: 1,
    }));
    let limit = GlobalLimit {
        algorithm: &huge,
        key: "tg:{bad}",
        cost: 1,
        max_delay: 0,
    };
    let err = store.decide(&[limit], None).await.unwrap_err();
    assert_eq!(err.kind(), "script", "{err}");
    store.shutdown().await;
}

/// Waits until `cond` holds, polling; returns how long it took.
async fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// Decides until the breaker answers `Unavailable`; asserts the calls before it were
/// bounded by the timeout and the ones after it are immediate.
/// Returns the `kind` of each failure before the breaker opened.
async fn decide_until_breaker_opens(
    store: &RedisStore,
    limits: &[GlobalLimit<'_>],
    timeout: Duration,
) -> Vec<&'static str> {
    let mut kinds = Vec::new();
    let mut failures_before_open = 0;
    let t0 = Instant::now();
    loop {
        let t = Instant::now();
        let result = store.decide(limits, None).await;
        let took = t.elapsed();
        match result {
            Err(RedisError::Unavailable) => {
                assert!(
                    took < Duration::from_millis(20),
                    "open breaker took {took:?}"
                );
                break;
            }
            Err(e) => {
                assert!(
                    took < timeout + Duration::from_millis(100),
                    "{e} took {took:?}"
                );
                kinds.push(e.kind());
                failures_before_open += 1;
            }
            Ok(d) => panic!("decided with redis down: {d:?}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "breaker never opened"
        );
    }
    assert!(
        failures_before_open <= 3,
        "{failures_before_open} slow failures"
    );
    assert!(!store.is_available());
    // Open: no request waits for Redis any more.
    let t = Instant::now();
    for _ in 0..100 {
        assert_eq!(
            store.decide(limits, None).await.unwrap_err(),
            RedisError::Unavailable
        );
    }
    assert!(
        t.elapsed() < timeout,
        "100 decisions with the breaker open took {:?}",
        t.elapsed()
    );
    kinds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_opens_during_an_outage_and_closes_when_redis_returns() {
    let mut server = RedisServer::start();
    let timeout = Duration::from_millis(200);
    let store = RedisStore::connect(settings(server.url(), timeout)).unwrap();
    let algs = one_of_each(60_000);
    let keys: Vec<String> = (0..algs.len())
        .map(|i| format!("tg:{{outage/{i}}}"))
        .collect();
    let limits = limits(&algs, &keys);
    assert!(store.decide(&limits, None).await.unwrap().admitted);
    assert!(store.is_available());

    server.stop();
    decide_until_breaker_opens(&store, &limits, timeout).await;

    server.restart();
    let back = wait_for(Duration::from_secs(2), || store.is_available()).await;
    assert!(
        back.is_some(),
        "breaker still open 2 s after redis came back"
    );
    // Fresh server: empty script cache and dataset.
    let d = store.decide(&limits, None).await.unwrap();
    assert!(d.admitted);
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starting_with_redis_down_is_not_an_error() {
    let mut server = RedisServer::start();
    server.stop();
    let timeout = Duration::from_millis(200);
    let t = Instant::now();
    let store = RedisStore::connect(settings(server.url(), timeout)).unwrap();
    assert!(t.elapsed() < Duration::from_millis(50), "connect blocked");
    let algs = one_of_each(60_000);
    let keys: Vec<String> = (0..algs.len())
        .map(|i| format!("tg:{{down/{i}}}"))
        .collect();
    let limits = limits(&algs, &keys);
    let kinds = decide_until_breaker_opens(&store, &limits, timeout).await;
    // Never connected: counted as Redis being down, not as a slow Redis.
    assert!(kinds.iter().all(|&k| k == "connection"), "{kinds:?}");
    assert!(store.ping().await.is_err());

    server.restart();
    let back = wait_for(Duration::from_secs(2), || store.is_available()).await;
    assert!(back.is_some(), "breaker still open 2 s after redis came up");
    assert!(store.decide(&limits, None).await.unwrap().admitted);
    assert!(store.ping().await.is_ok());
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_url_is_the_only_connect_error() {
    let err =
        RedisStore::connect(settings("http://nope".into(), Duration::from_millis(50))).unwrap_err();
    assert_eq!(err.kind(), "connection");
}
