//! `reserve_ahead` end to end, on a real redis-server: instances spend a hot key's units in
//! process from reservations, and the key still never admits more than its gcra bound
//! (`burst + floor(L / T)` in any interval of length L) across instances; a hot key costs Redis
//! a call per many requests; an exhausted key answers 429 with the Retry-After Redis gave; a
//! request refused by another limit gives its units back; Redis going away ends the spending
//! within `reserve_ahead` (`on_error: deny`) or falls back to the local store (`allow`); and
//! `tier="reserved"` counts the decisions answered from reservations.
//!
//! One server is shared by the tests that neither stop it nor count its commands; their routes
//! have distinct names, so their keys never meet.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use crate::support::process::Proc;
use crate::support::redis::{RedisServer, command_calls};
use crate::support::upstream::Upstream;
use crate::support::{Gateway, client, closed_addr, metric};

fn shared_redis() -> &'static RedisServer {
    static R: OnceLock<RedisServer> = OnceLock::new();
    R.get_or_init(RedisServer::start)
}

/// A config on `redis_url` with `on_error` and the Redis `timeout`, listening on port 0 (the
/// in-process [`Gateway`] replaces them anyway), with `routes`.
fn config(redis_url: &str, on_error: &str, timeout: &str, routes: &str) -> String {
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\nredis:\n  url: {redis_url}\n  timeout: {timeout}\n  on_error: {on_error}\n  pool_size: 2\nroutes:\n{routes}"
    )
}

/// A route `name` (every path under `prefix`) to `upstream` with `limits`.
fn route(name: &str, prefix: &str, upstream: &str, limits: &str) -> String {
    format!(
        "  - name: {name}\n    match: {{ path_prefix: {prefix} }}\n    upstream: {upstream}\n    limits:\n{limits}"
    )
}

/// A strict global gcra limit `name` on `key` of `rate` and `burst` that reserves `ahead`.
fn reserving(name: &str, key: &str, rate: &str, burst: u64, ahead: &str) -> String {
    format!(
        "      - name: {name}\n        key: [{key}]\n        algorithm: gcra\n        rate: {rate}\n        burst: {burst}\n        scope: global\n        reserve_ahead: {ahead}\n"
    )
}

/// `FCALL` and `EVALSHA` calls Redis ran so far: every script call tollgate makes.
fn script_calls(redis: &RedisServer) -> u64 {
    let stats = redis.cli(&["INFO", "commandstats"]);
    command_calls(&stats, "fcall").0 + command_calls(&stats, "evalsha").0
}

/// `tollgate_limiter_tier_decisions_total` of the global `tier` in `metrics` (0 when absent).
fn tier(metrics: &str, tier: &str) -> f64 {
    metric(
        metrics,
        &format!("tollgate_limiter_tier_decisions_total{{scope=\"global\",tier=\"{tier}\"}}"),
    )
    .unwrap_or(0.0)
}

/// One request as the client saw it: when it was sent, when its answer was read, its status.
#[derive(Clone, Copy, Debug)]
struct Sample {
    sent: Instant,
    done: Instant,
    status: u16,
}

/// `workers` clients, each sending GET `urls[i % urls.len()]` one after the other (with
/// `headers`) until `run` has passed; every answer, in no particular order.
async fn drive(
    urls: &[String],
    workers: usize,
    run: Duration,
    headers: &[(&'static str, &'static str)],
) -> Vec<Sample> {
    let end = Instant::now() + run;
    let tasks = (0..workers).map(|w| {
        let url = urls[w % urls.len()].clone();
        let headers = headers.to_vec();
        tokio::spawn(async move {
            let c = client();
            let mut out = Vec::new();
            while Instant::now() < end {
                let mut req = c.get(&url);
                for (k, v) in &headers {
                    req = req.header(*k, *v);
                }
                let sent = Instant::now();
                let r = req.send().await.expect("an answer");
                let status = r.status().as_u16();
                let _ = r.bytes().await;
                out.push(Sample {
                    sent,
                    done: Instant::now(),
                    status,
                });
            }
            out
        })
    });
    join_all(tasks)
        .await
        .into_iter()
        .flat_map(|t| t.expect("worker"))
        .collect()
}

/// Asserts the gcra bound on the admitted samples: for every interval `[s, s + w]` that starts
/// at an admitted request's send time, with `w` each of `windows` and the whole run (first
/// admitted request's send to the last one's answer), the requests admitted wholly inside it
/// (each was admitted between its send and its answer) are at most `burst + floor(w / t)`.
/// Returns the whole run's length and bound.
fn assert_gcra_bound(
    samples: &[Sample],
    burst: u64,
    t: Duration,
    windows: &[Duration],
) -> (Duration, u64) {
    let mut ok: Vec<Sample> = samples
        .iter()
        .copied()
        .filter(|s| s.status == 200)
        .collect();
    ok.sort_by_key(|s| s.sent);
    let first = ok.first().expect("some admitted").sent;
    let last = ok.iter().map(|s| s.done).max().expect("some admitted");
    let run = last - first;
    let bound = |w: Duration| burst + (w.as_micros() / t.as_micros()) as u64;
    assert!(
        ok.len() as u64 <= bound(run),
        "{} admitted in {run:?} (first request sent to last answered), over the gcra bound \
         burst + floor(L / T) = {burst} + floor({} µs / {} µs) = {}",
        ok.len(),
        run.as_micros(),
        t.as_micros(),
        bound(run)
    );
    for &w in windows {
        for (i, start) in ok.iter().enumerate() {
            let end = start.sent + w;
            let inside = ok[i..].iter().filter(|s| s.done <= end).count() as u64;
            assert!(
                inside <= bound(w),
                "{inside} admitted within {w:?} (from the send of admitted request {i}), over \
                 the gcra bound {burst} + floor({} µs / {} µs) = {}",
                w.as_micros(),
                t.as_micros(),
                bound(w)
            );
        }
    }
    (run, bound(run))
}

fn count(samples: &[Sample], status: u16) -> usize {
    samples.iter().filter(|s| s.status == status).count()
}

/// Three tollgate processes on one Redis drive one key of a reserving limit (200/1s, burst 100,
/// reserve_ahead 100ms: T = 5 ms, 20 units given up) as hard as twelve clients can for 2.5 s.
/// The units admitted across them stay within the gcra bound over the whole run and over every
/// window of 100 ms to 1 s, and reach at least half of it (reserving does not starve the key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_sharing_a_reserving_key_never_exceed_its_gcra_bound() {
    let redis = shared_redis();
    let up = Upstream::start().await;
    let limits = reserving("hot", "literal:one", "200/1s", 100, "100ms");
    let yaml = config(
        &redis.url(),
        "deny",
        "2s",
        &route("bound", "/", &up.url(), &limits),
    )
    .replace("listen: 127.0.0.1:0", "listen: 127.0.0.1:PROXY_PORT")
    .replace("admin: 127.0.0.1:0", "admin: 127.0.0.1:ADMIN_PORT");
    let mut procs = Vec::new();
    for _ in 0..3 {
        procs.push(Proc::start(&yaml, &[], &[], false).await);
    }
    let urls: Vec<String> = procs.iter().map(|p| format!("{}/", p.proxy)).collect();
    let samples = drive(&urls, 12, Duration::from_millis(2500), &[]).await;
    let (ok, limited) = (count(&samples, 200), count(&samples, 429));
    assert_eq!(ok + limited, samples.len(), "only 200 and 429");
    let windows = [100, 250, 500, 1000].map(Duration::from_millis);
    let (run, bound) = assert_gcra_bound(&samples, 100, Duration::from_millis(5), &windows);
    assert!(
        ok as u64 * 2 >= bound,
        "{ok} admitted in {run:?}: under half the bound {bound} ({limited} refused)"
    );
    assert_eq!(up.hits(), ok, "the upstream saw what was admitted");
    // Every instance spent units from reservations of its own.
    for p in &procs {
        let m = client()
            .get(format!("{}/metrics", p.admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            tier(&m, "reserved") > 0.0,
            "no decision from a reservation:\n{m}"
        );
    }
}

/// A gateway with a reserving route `name` on `/` (key `literal:NAME`, `rate`, `burst`,
/// reserve_ahead 100ms) and a small one on `/warm`, asked once so that the function library is
/// loaded by a call on another key before the test counts Redis calls.
async fn warmed(redis: &RedisServer, up: &Upstream, name: &str, rate: &str, burst: u64) -> Gateway {
    let routes = route(
        "warm",
        "/warm",
        &up.url(),
        &reserving("l", "literal:w", "10/1s", 10, "100ms"),
    ) + &route(
        name,
        "/",
        &up.url(),
        &reserving("l", &format!("literal:{name}"), rate, burst, "100ms"),
    );
    let g = Gateway::start(&config(&redis.url(), "deny", "2s", &routes)).await;
    assert_eq!(g.get("/warm").await.status, 200);
    g
}

/// One instance, a key with room to spare (1000000/1s, burst 1000000, reserve_ahead 100ms),
/// eight clients, 3000 requests: every one admitted, with well under one Redis script call per
/// ten requests (the reservations grow with the key's rate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_costs_redis_well_under_a_call_per_ten_requests() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let g = warmed(&redis, &up, "hot", "1000000/1s", 1_000_000).await;
    let before = script_calls(&redis);
    let fetcher = g.fetcher();
    let per_client = 375;
    let clients = (0..8).map(|_| {
        let f = fetcher.clone();
        tokio::spawn(async move {
            let mut ok = 0;
            for _ in 0..per_client {
                if f.get("/").await.status == 200 {
                    ok += 1;
                }
            }
            ok
        })
    });
    let ok: usize = join_all(clients)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .sum();
    assert_eq!(ok, 8 * per_client, "every request admitted");
    let calls = script_calls(&redis) - before;
    let per_request = calls as f64 / ok as f64;
    assert!(
        per_request < 0.05,
        "{calls} script calls for {ok} admitted requests: {per_request:.4} per request"
    );
    let m = g.metrics().await;
    assert!(tier(&m, "reserved") >= 0.9 * ok as f64, "{m}");
}

/// An exhausted key (2/1s, burst 3, reserve_ahead 100ms: 2 units after the one given up) is
/// refused with 429, `Retry-After` rounded up to seconds and the exact wait in the body; still
/// refused shortly before that wait is over, admitted once it is.
#[tokio::test]
async fn an_exhausted_key_is_refused_with_retry_after_and_admitted_after_it() {
    let redis = shared_redis();
    let up = Upstream::start().await;
    let limits = reserving("slow", "literal:k", "2/1s", 3, "100ms");
    let g = Gateway::start(&config(
        &redis.url(),
        "deny",
        "2s",
        &route("exhaust", "/", &up.url(), &limits),
    ))
    .await;
    assert_eq!(g.get("/").await.status, 200);
    assert_eq!(g.get("/").await.status, 200);
    let refused = g.get("/").await;
    let at = Instant::now();
    assert_eq!(refused.status, 429);
    assert_eq!(refused.headers["retry-after"], "1", "{:?}", refused.headers);
    let body = refused.json();
    assert_eq!(body["limit"], "slow");
    let wait = body["retry_after_ms"].as_u64().expect("retry_after_ms");
    // Two units taken at one instant: the next comes one emission interval (500 ms) later.
    assert!(wait > 300 && wait <= 500, "retry_after_ms {wait}");
    tokio::time::sleep(Duration::from_millis(wait - 200).saturating_sub(at.elapsed())).await;
    let early = g.get("/").await;
    assert_eq!(early.status, 429, "admitted before its Retry-After");
    let left = early.json()["retry_after_ms"].as_u64().unwrap();
    assert!(
        left > 0 && left <= 200,
        "retry_after_ms {left} with 200 ms to go"
    );
    tokio::time::sleep(Duration::from_millis(wait + 30).saturating_sub(at.elapsed())).await;
    assert_eq!(
        g.get("/").await.status,
        200,
        "refused after its Retry-After"
    );
    assert_eq!(up.hits(), 3);
}

/// A route with a reserving global limit (`shared`: 100/1h, burst 10, reserve_ahead 30s: one
/// unit given up, 9 left, reservations of one unit) and a second one per user (1/1h, burst 1)
/// of `per_user_scope`. Twenty requests of user `a` that `per-user` refuses take nothing from
/// `shared`. After them Redis has given out only `a`'s admitted unit, so exactly 8 other users
/// are admitted, and the next one is refused by `shared`. Returns the gateway's metrics.
async fn a_refused_flood_takes_nothing_reserved(route_name: &str, per_user_scope: &str) -> String {
    let redis = shared_redis();
    let up = Upstream::start().await;
    let key = format!("literal:{route_name}");
    let limits = reserving("shared", &key, "100/1h", 10, "30s")
        + &format!(
            "      - name: per-user\n        key: [header:x-user]\n        rate: 1/1h\n        burst: 1\n        scope: {per_user_scope}\n"
        );
    let g = Gateway::start(&config(
        &redis.url(),
        "deny",
        "2s",
        &route(route_name, "/", &up.url(), &limits),
    ))
    .await;
    let c = client();
    let get = |user: String| c.get(g.url("/")).header("x-user", user).send();
    assert_eq!(get("a".into()).await.unwrap().status(), 200);
    for i in 0..20 {
        let r = get("a".into()).await.unwrap();
        assert_eq!(r.status(), 429, "request {i} of user a");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["limit"], "per-user", "request {i} of user a");
    }
    // Redis's view: 9 units, 1 given out.
    let state = g
        .admin_json(&format!(
            "/admin/limits/{route_name}/shared?key={route_name}"
        ))
        .await;
    assert_eq!(state["store"], "redis", "{state}");
    assert_eq!(state["remaining"], 8, "{state}");
    assert_eq!(state["reserve_burst"], 9, "{state}");
    for u in 0..8 {
        let r = get(format!("u{u}")).await.unwrap();
        assert_eq!(r.status(), 200, "user u{u}, after {u} others");
    }
    let r = get("u8".into()).await.unwrap();
    assert_eq!(r.status(), 429);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["limit"], "shared", "{body}");
    assert_eq!(up.hits(), 1 + 8);
    g.metrics().await
}

/// A local limit beside the reserving one is checked before the reservation is touched.
#[tokio::test]
async fn requests_another_limit_refuses_take_nothing_reserved() {
    a_refused_flood_takes_nothing_reserved("aon", "local").await;
}

/// With a second strict global limit beside the reserving one, a request is decided per
/// request, both in one call: the refused ones take nothing (no reservation is made whose
/// units would be dropped), and no decision is answered from a reservation.
#[tokio::test]
async fn requests_with_a_second_global_limit_are_decided_per_request_taking_nothing() {
    let metrics = a_refused_flood_takes_nothing_reserved("two", "global").await;
    assert!(
        metrics.contains(
            "tollgate_limiter_tier_decisions_total{scope=\"global\",tier=\"reserved\"} 0"
        ),
        "{metrics}"
    );
}

/// `on_error: deny`: four clients drive a hot key hard, so the instance's reservations grow to
/// about 50 ms of that traffic; then Redis is killed and one client goes on at a request every
/// 10 ms, far too slowly to spend the last reservation by its end. No request sent
/// `reserve_ahead` (100 ms) after Redis died is admitted (the last reservation was sent before
/// it died, its units are dropped 100 ms after), they are answered 503 soon after, and none
/// waits for Redis more than once (`redis.timeout`, 150 ms): a reservation Redis did not
/// answer is not asked again per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_deny_stops_admitting_within_reserve_ahead() {
    let mut redis = RedisServer::start();
    let up = Upstream::start().await;
    let limits = reserving("l", "literal:k", "100000/1s", 100_000, "100ms");
    let g = Gateway::start(&config(
        &redis.url(),
        "deny",
        "150ms",
        &route("gone", "/", &up.url(), &limits),
    ))
    .await;
    let urls = [g.url("/")];
    let hard = drive(&urls, 4, Duration::from_millis(400), &[]).await;
    assert!(
        hard.iter().all(|s| s.status == 200),
        "admitted while Redis was up: {:?}",
        hard.iter().map(|s| s.status).collect::<Vec<_>>()
    );
    redis.stop();
    let dead = Instant::now();
    let f = g.fetcher();
    let mut after = Vec::new();
    // Long enough for three calls to time out and open the breaker, and for fast 503s after.
    while dead.elapsed() < Duration::from_millis(900) {
        let sent = Instant::now();
        let status = f.get("/").await.status;
        after.push(Sample {
            sent,
            done: Instant::now(),
            status,
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ahead = Duration::from_millis(100);
    let late: Vec<&Sample> = after.iter().filter(|s| s.sent >= dead + ahead).collect();
    let admitted_late: Vec<Duration> = late
        .iter()
        .filter(|s| s.status == 200)
        .map(|s| s.sent - dead)
        .collect();
    assert!(
        admitted_late.is_empty(),
        "admitted from stale units, sent this long after Redis died: {admitted_late:?}"
    );
    assert!(
        late.len() >= 10 && late.iter().all(|s| s.status == 503),
        "{:?}",
        late.iter().map(|s| s.status).collect::<Vec<_>>()
    );
    let slowest = after.iter().map(|s| s.done - s.sent).max().unwrap();
    assert!(
        slowest < Duration::from_millis(260),
        "a request waited {slowest:?} with redis.timeout 150ms"
    );
    let first_503 = after
        .iter()
        .filter(|s| s.status == 503)
        .map(|s| s.done - dead)
        .min()
        .expect("some 503");
    assert!(
        first_503 <= ahead + Duration::from_millis(350),
        "first 503 {first_503:?} after Redis died"
    );
}

/// `on_error: allow` with Redis down from the start: the reserving limit is decided by the
/// local fallback store on its own quota (2/1s, burst 3: three at once), and counted there.
#[tokio::test]
async fn with_redis_down_allow_decides_a_reserving_limit_on_the_local_fallback() {
    let up = Upstream::start().await;
    let limits = reserving("l", "literal:k", "2/1s", 3, "100ms");
    let g = Gateway::start(&config(
        &format!("redis://{}", closed_addr()),
        "allow",
        "100ms",
        &route("fallback", "/", &up.url(), &limits),
    ))
    .await;
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(g.get("/").await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    let m = g.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tollgate_fallback_decisions_total{route=\"fallback\",limit=\"l\"}"
        ),
        Some(5.0),
        "{m}"
    );
    assert_eq!(tier(&m, "reserved"), 0.0);
}

/// `tier="reserved"` counts exactly the decisions answered from this instance's reservations:
/// of 300 requests one after the other on a key with room to spare, every one that made no
/// Redis call; those that did (each reservation) count as `tier="redis"`.
#[tokio::test]
async fn reserved_tier_counts_the_decisions_answered_in_process() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let g = warmed(&redis, &up, "counted", "100000/1s", 100_000).await;
    let m = g.metrics().await;
    let (reserved0, redis0) = (tier(&m, "reserved"), tier(&m, "redis"));
    let calls0 = script_calls(&redis);
    let n = 300;
    for i in 0..n {
        assert_eq!(g.get("/").await.status, 200, "request {i}");
    }
    let calls = (script_calls(&redis) - calls0) as f64;
    let m = g.metrics().await;
    let (reserved, asked) = (tier(&m, "reserved") - reserved0, tier(&m, "redis") - redis0);
    assert_eq!(asked, calls, "one redis decision per call:\n{m}");
    assert_eq!(
        reserved,
        n as f64 - calls,
        "the rest from reservations:\n{m}"
    );
    assert!(
        reserved >= 0.5 * n as f64,
        "{reserved} of {n} from reservations"
    );
    assert_eq!(tier(&m, "in_process"), 0.0);
    assert_eq!(up.hits(), n + 1);
}
