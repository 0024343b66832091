//! `redis.sentinel` on a real master, replica and sentinel(s) started on free ports: exact
//! global limits on the master the sentinels name, the reset broadcast, eventual syncs, and
//! failovers under load (the master killed, or demoted alive by `SENTINEL FAILOVER`): no
//! request fails beyond what `on_error` says, and the gateway moves to the new master by itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use crate::support::redis::{RedisSentinel, RedisServer, command_calls};
use crate::support::upstream::Upstream;
use crate::support::{Gateway, client, metric};

/// How long a failover may take here: `down-after` plus the election and promotion, on a
/// loaded CI machine.
const FAILOVER_WITHIN: Duration = Duration::from_secs(15);

fn cfg(setup: &RedisSentinel, on_error: &str, timeout: &str, routes: &str) -> String {
    cfg_target(&setup.yaml(), on_error, timeout, routes)
}

fn cfg_target(target: &str, on_error: &str, timeout: &str, routes: &str) -> String {
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\n  admin_token: s3cret\nredis:\n  {target}\n  timeout: {timeout}\n  on_error: {on_error}\n  pool_size: 2\nroutes:\n{routes}"
    )
}

/// Script calls (`FCALL`, or `EVALSHA` on the fallback path) `server` has run, and how many
/// of them failed.
fn script_calls(server: &RedisServer) -> (u64, u64) {
    let stats = server.cli(&["INFO", "commandstats"]);
    let (f, ff) = command_calls(&stats, "fcall");
    let (e, ef) = command_calls(&stats, "evalsha");
    (f + e, ff + ef)
}

async fn statuses(g: &Gateway, path: &str, user: &str, n: usize) -> Vec<u16> {
    let c = client();
    let mut out = Vec::new();
    for _ in 0..n {
        let r = c
            .get(g.url(path))
            .header("x-user", user)
            .send()
            .await
            .unwrap();
        out.push(r.status().as_u16());
    }
    out
}

/// The pause between two requests of one load client: ~200 requests/s per client at most.
const PACE: Duration = Duration::from_millis(5);

/// Requests from `workers` clients in a loop, each over a few users, until `stop`; every
/// status with the time it came, since `t0`.
fn load(
    g: &Gateway,
    workers: usize,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<(Duration, u16)>> {
    let url = g.url("/load");
    tokio::spawn(async move {
        let t0 = Instant::now();
        let runs = (0..workers).map(|w| {
            let (url, stop) = (url.clone(), stop.clone());
            async move {
                let c = client();
                let mut seen = Vec::new();
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let user = format!("w{w}-{}", i % 3);
                    i += 1;
                    let status = match c.get(&url).header("x-user", user).send().await {
                        Ok(r) => r.status().as_u16(),
                        Err(_) => 0,
                    };
                    seen.push((t0.elapsed(), status));
                    // Steady traffic, not a flood: the suite's other tests share the machine.
                    tokio::time::sleep(PACE).await;
                }
                seen
            }
        });
        join_all(runs).await.into_iter().flatten().collect()
    })
}

/// Routes for the failover tests: `/load` (the traffic during the failover) and `/exact` (a
/// fresh budget to measure once it is over).
fn failover_routes(up: &Upstream) -> String {
    format!(
        "  - name: load\n    match: {{ path: /load }}\n    upstream: {u}\n    limits:\n      - name: per-user\n        key: [header:x-user]\n        algorithm: gcra\n        rate: 20/1s\n        burst: 5\n\
         \x20 - name: exact\n    match: {{ path: /exact }}\n    upstream: {u}\n    limits:\n      - name: per-user\n        key: [header:x-user]\n        algorithm: sliding_log\n        rate: 5/1d\n",
        u = up.url()
    )
}

/// Waits until `server` has run a script call more than `before` (a decision landed there).
async fn wait_for_decisions_on(server: &RedisServer, before: u64, within: Duration) -> Duration {
    let t = Instant::now();
    while script_calls(server).0 <= before {
        assert!(
            t.elapsed() < within,
            "no decision reached the new master within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.elapsed()
}

/// Waits until every sentinel names a master other than `old`, and returns its port. Async:
/// the gateway under test runs on this runtime.
async fn wait_for_new_master(setup: &RedisSentinel, old: u16) -> u16 {
    let t = Instant::now();
    loop {
        let named = setup.named_masters();
        if let Some(Some(new)) = named.first()
            && *new != old
            && named.iter().all(|p| *p == Some(*new))
        {
            return *new;
        }
        assert!(
            t.elapsed() < FAILOVER_WITHIN,
            "no failover within {FAILOVER_WITHIN:?}: sentinels name {named:?}\n{}",
            setup.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Redis failures the gateway counted so far, all kinds.
async fn redis_errors(g: &Gateway) -> f64 {
    g.metrics()
        .await
        .lines()
        .filter(|l| l.starts_with("tollgate_redis_errors_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Once a failover is over, a fresh budget of 5 (`sliding_log 5/1d`) gives exactly 5 of 8, all
/// decided in Redis; returns the key used. A round in which a call failed (a decision slower
/// than `redis.timeout` on a loaded machine, then the fallback's or a 503) measures the
/// machine, not Redis: it is done again with another key, up to three times.
async fn exact_again(g: &Gateway) -> String {
    for round in 0..3 {
        let key = format!("fresh-{round}");
        let errors = redis_errors(g).await;
        let got = statuses(g, "/exact", &key, 8).await;
        if redis_errors(g).await == errors {
            assert_eq!(got, [200, 200, 200, 200, 200, 429, 429, 429], "{key}");
            return key;
        }
    }
    panic!("three rounds with Redis failing: no measurement of exactness");
}

async fn ready(g: &Gateway) -> u16 {
    client()
        .get(g.admin_url("/readyz"))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// Exact budgets on the master the sentinel names, shared by three instances, for every
/// algorithm; the decisions run on the master (the replica only receives their effects); and
/// the admin reset reaches the other instances through the master's pub/sub.
#[tokio::test]
async fn a_master_named_by_sentinel_shares_one_exact_budget_and_resets() {
    let setup = RedisSentinel::start("exact");
    let up = Upstream::start().await;
    let cases = [
        (
            "s-gcra",
            "algorithm: gcra\n        rate: 1000/1d\n        burst: 17",
        ),
        ("s-fixed", "algorithm: fixed_window\n        rate: 17/1d"),
        (
            "s-sliding",
            "algorithm: sliding_window\n        rate: 17/1d",
        ),
        ("s-log", "algorithm: sliding_log\n        rate: 17/1d"),
    ];
    let routes: String = cases
        .iter()
        .map(|(name, alg)| {
            format!(
                "  - name: {name}\n    match: {{ path_prefix: /{name} }}\n    upstream: {}\n    limits:\n      - name: per-user\n        key: [header:x-user]\n        {alg}\n",
                up.url()
            )
        })
        .collect();
    let yaml = cfg(&setup, "deny", "2s", &routes);
    let gws = [
        Gateway::start(&yaml).await,
        Gateway::start(&yaml).await,
        Gateway::start(&yaml).await,
    ];
    for g in &gws {
        assert_eq!(ready(g).await, 200);
    }
    let c = client();
    for (name, _) in cases {
        let reqs = (0..60).map(|i| {
            c.get(gws[i % 3].url(&format!("/{name}")))
                .header("x-user", "ann")
                .send()
        });
        let got: Vec<u16> = join_all(reqs)
            .await
            .into_iter()
            .map(|r| r.unwrap().status().as_u16())
            .collect();
        assert_eq!(
            got.iter().filter(|s| **s == 200).count(),
            17,
            "{name}: {got:?}"
        );
        assert_eq!(got.iter().filter(|s| **s == 429).count(), 43, "{name}");
    }
    let master = setup.server(setup.master_port());
    let replica = setup.server(setup.replica_port());
    // Concurrent decisions share calls (decide_many): at least one per case.
    assert!(script_calls(master).0 >= 4, "the master decides");
    assert_eq!(
        script_calls(replica).0,
        0,
        "nothing is decided on the replica"
    );
    let keys = master.cli(&["--scan", "--pattern", "tg:{s-*/per-user/ann}*"]);
    for (name, _) in cases {
        assert!(
            keys.contains(&format!("tg:{{{name}/per-user/ann}}")),
            "{name}: {keys}"
        );
    }

    // A reset through one instance: gone from Redis, and the others hear it.
    let r = c
        .delete(gws[0].admin_url("/admin/limits/s-log/per-user?key=ann"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        body["redis_keys_deleted"], 2,
        "the log and its meta key: {body}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // gws[1] held "rejected" in its in-process tier: only the broadcast clears it.
        let got = statuses(&gws[1], "/s-log", "ann", 1).await;
        if got == [200] {
            break;
        }
        assert!(Instant::now() < deadline, "gws[1] never heard of the reset");
        // A reset published before gws[1] subscribed is not heard: send it again.
        c.delete(gws[0].admin_url("/admin/limits/s-log/per-user?key=ann"))
            .bearer_auth("s3cret")
            .send()
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An eventual limit syncs its counts through the master the sentinel names.
#[tokio::test]
async fn eventual_counts_reach_the_master_named_by_sentinel() {
    let setup = RedisSentinel::start("eventual");
    let up = Upstream::start().await;
    let routes = format!(
        "  - name: ev\n    upstream: {}\n    limits:\n      - name: per-user\n        key: [header:x-user]\n        algorithm: sliding_window\n        rate: 10/1d\n        consistency: eventual\n        sync_interval: 20ms\n",
        up.url()
    );
    let g = Gateway::start(&cfg(&setup, "deny", "2s", &routes)).await;
    assert_eq!(statuses(&g, "/", "ann", 4).await, [200; 4]);
    let master = setup.server(setup.master_port());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let keys = master.cli(&["--scan", "--pattern", "tg:{ev/per-user/ann}*"]);
        let total: u64 = keys
            .lines()
            .map(|k| master.cli(&["GET", k]).parse::<u64>().unwrap_or(0))
            .sum();
        if total == 4 {
            break;
        }
        assert!(Instant::now() < deadline, "counts on the master: {total}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The master is killed (SIGKILL) under load with `on_error: allow`: every request is answered
/// 200 or 429 (the local fallback decides meanwhile), and once the sentinel has promoted the
/// replica the gateway's decisions land there by themselves, exact again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_is_replaced_under_load_without_a_failed_request() {
    let mut setup = RedisSentinel::start("killed-allow");
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&setup, "allow", "100ms", &failover_routes(&up))).await;
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = load(&g, 4, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;

    let old = setup.kill_master();
    let killed = Instant::now();
    let new = wait_for_new_master(&setup, old).await;
    let switched = killed.elapsed();
    let promoted = setup.server(new);
    let after_switch = wait_for_decisions_on(promoted, 0, Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = traffic.await.unwrap();
    let failed: Vec<&(Duration, u16)> = seen
        .iter()
        .filter(|(_, s)| ![200, 429].contains(s))
        .collect();
    println!(
        "killed master: switch after {switched:?}, decisions on the new master {after_switch:?} later; {} requests",
        seen.len()
    );
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(
        seen.iter().any(|(_, s)| *s == 200),
        "some requests went through"
    );
    let m = g.metrics().await;
    assert!(
        metric(
            &m,
            "tollgate_fallback_decisions_total{route=\"load\",limit=\"per-user\"}"
        )
        .unwrap_or(0.0)
            > 0.0,
        "the local fallback decided during the outage"
    );

    // Exact again, on the promoted replica.
    let before = script_calls(promoted).0;
    let key = exact_again(&g).await;
    assert!(
        script_calls(promoted).0 >= before + 6,
        "decided on the new master"
    );
    let keys = promoted.cli(&[
        "--scan",
        "--pattern",
        &format!("tg:{{exact/per-user/{key}}}*"),
    ]);
    assert!(!keys.is_empty(), "the budget's keys are on the new master");
    // The function library is there: Redis replicated it before the failover.
    let library = tollgate::limit::redis::library().name.clone();
    let functions = promoted.cli(&["FUNCTION", "LIST", "LIBRARYNAME", &library]);
    assert!(functions.contains(&library), "{functions}");
    assert_eq!(ready(&g).await, 200);
}

/// The same failover with `on_error: deny`: during the outage requests get 503 and nothing
/// else fails; afterwards they are decided again, and `/readyz` is 200, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_fails_closed_with_503_only_then_decides_again() {
    let mut setup = RedisSentinel::start("killed-deny");
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&setup, "deny", "100ms", &failover_routes(&up))).await;
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = load(&g, 4, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;

    let old = setup.kill_master();
    let new = wait_for_new_master(&setup, old).await;
    let promoted = setup.server(new);
    wait_for_decisions_on(promoted, 0, Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = traffic.await.unwrap();
    let failed: Vec<&(Duration, u16)> = seen
        .iter()
        .filter(|(_, s)| ![200, 429, 503].contains(s))
        .collect();
    assert!(
        failed.is_empty(),
        "requests that failed otherwise than 503: {failed:?}"
    );
    let unavailable = seen.iter().filter(|(_, s)| *s == 503).count();
    assert!(unavailable > 0, "no 503 while there was no master");
    println!(
        "killed master, deny: {unavailable} of {} requests got 503",
        seen.len()
    );

    assert_eq!(ready(&g).await, 200);
    exact_again(&g).await;
}

/// `SENTINEL FAILOVER` demotes a master that is alive, and Sentinel closes its clients only
/// when it reconfigures it as a replica, seconds later: the gateway hears the switch from the
/// sentinels and moves its decisions to the new master at once (within 3 s, where the old
/// master stays writable for 8), with no request failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_failover_moves_decisions_to_the_new_master_at_once() {
    let setup = RedisSentinel::start_with_sentinels("manual", 2);
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&setup, "allow", "1s", &failover_routes(&up))).await;
    let stop = Arc::new(AtomicBool::new(false));
    let load_started = Instant::now();
    let traffic = load(&g, 4, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;

    let old = setup.master_port();
    let failed_over_at = load_started.elapsed();
    setup.failover();
    let new = wait_for_new_master(&setup, old).await;
    let switched = Instant::now();
    let promoted = setup.server(new);
    let moved = wait_for_decisions_on(promoted, 0, Duration::from_secs(3)).await;
    // Once moved, the old master (still a writable master for a while) sees no decision.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let on_old = script_calls(setup.server(old)).0;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = traffic.await.unwrap();
    assert_eq!(
        script_calls(setup.server(old)).0,
        on_old,
        "decisions still went to the demoted master"
    );
    let fallbacks = metric(
        &g.metrics().await,
        "tollgate_fallback_decisions_total{route=\"load\",limit=\"per-user\"}",
    );
    println!(
        "manual failover: decisions on the new master {moved:?} after the sentinels switched ({:?} ago); {} requests, {fallbacks:?} decided by the fallback",
        switched.elapsed(),
        seen.len()
    );
    let failed: Vec<&(Duration, u16)> = seen
        .iter()
        .filter(|(_, s)| ![200, 429].contains(s))
        .collect();
    if !failed.is_empty() {
        let m = g.metrics().await;
        let errors: Vec<&str> = m
            .lines()
            .filter(|l| l.starts_with("tollgate_redis_errors_total"))
            .collect();
        panic!(
            "failed requests: {failed:?}\nfailover at {:?} into the load; {errors:?}\n{}",
            failed_over_at,
            setup.logs()
        );
    }
    exact_again(&g).await;
}

/// Sentinels and servers that require a password each: the node URLs carry the sentinels',
/// `password` the master's, and the two are never mixed up (the sentinels' password alone does
/// not open the master: the gateway then fails closed, as for any Redis it cannot use).
#[tokio::test]
async fn sentinels_and_the_master_authenticate_with_their_own_passwords() {
    let setup = RedisSentinel::start_with_auth("auth", "masterpw", "sentpw");
    let up = Upstream::start().await;
    let node = setup.sentinel_urls()[0].replace("redis://", "redis://:sentpw@");
    let both = format!("sentinel: {{ master: auth, nodes: ['{node}'], password: masterpw }}");
    let g = Gateway::start(&cfg_target(&both, "deny", "2s", &failover_routes(&up))).await;
    assert_eq!(
        statuses(&g, "/exact", "ann", 8).await,
        [200, 200, 200, 200, 200, 429, 429, 429]
    );
    assert!(script_calls(setup.server(setup.master_port())).0 >= 6);
    assert_eq!(ready(&g).await, 200);

    let sentinels_only = format!("sentinel: {{ master: auth, nodes: ['{node}'] }}");
    let g = Gateway::start(&cfg_target(
        &sentinels_only,
        "deny",
        "200ms",
        &failover_routes(&up),
    ))
    .await;
    assert_eq!(statuses(&g, "/exact", "bob", 2).await, [503, 503]);
    assert_eq!(ready(&g).await, 503);
}
