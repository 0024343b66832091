//! Costs settled from the upstream's answer (`settle:`), on real sockets: a cost header that
//! charges more (the key goes into debt, and its next request gets 429 with the exact
//! `Retry-After`) or less; a cost trailer over HTTP/1.1 chunked and over HTTP/2; statuses that
//! give the whole charge back (the upstream's and tollgate's own); a missing or unparsable
//! value that keeps the estimate and is counted; the same in a real Redis, at one script call
//! per settlement and none when the cost is the estimate; window limits too (a calendar day's
//! token quota in debt until local midnight; fixed and sliding windows in Redis); a gcra charge
//! whose response comes once its admission's TAT has passed, locally and in Redis, still runs
//! from that TAT.

use std::time::Duration;

use serde_json::Value;
use tollgate::metrics::Format;

use crate::support::redis::{RedisServer, command_calls};
use crate::support::upstream::{self, Upstream};
use crate::support::{Gateway, client, closed_addr, metric};

/// `rate: 100/100s` (one unit a second), burst 10, estimate `cost`, keyed by `x-key`.
fn tokens(algorithm: &str, cost: u64, scope: &str) -> String {
    format!(
        "      - name: tokens\n        key: [header:x-key]\n        algorithm: {algorithm}\n        rate: 100/100s\n        burst: 10\n        cost: {cost}\n        scope: {scope}\n        settle:\n          cost_header: x-usage\n          refund_status: [500-599]\n"
    )
    .replace(
        "        burst: 10\n",
        if algorithm == "gcra" {
            "        burst: 10\n"
        } else {
            ""
        },
    )
}

fn yaml(redis: Option<&str>, routes: &[(&str, &str)], limits: &str) -> String {
    let mut y = String::from("server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\n");
    if let Some(url) = redis {
        y.push_str(&format!(
            "redis:\n  url: {url}\n  timeout: 2s\n  on_error: deny\n"
        ));
    }
    y.push_str("routes:\n");
    for (name, upstream) in routes {
        y.push_str(&format!(
            "  - name: {name}\n    match: {{ path_prefix: /{name} }}\n    upstream: {upstream}\n    limits:\n{limits}"
        ));
    }
    y
}

async fn get(g: &Gateway, path: &str, key: &str) -> reqwest::Response {
    client()
        .get(g.url(path))
        .header("x-key", key)
        .send()
        .await
        .unwrap()
}

/// The `tokens` limit's state for `key` on `route` (the admin API).
async fn state(g: &Gateway, route: &str, key: &str) -> Value {
    g.admin_json(&format!("/admin/limits/{route}/tokens?key={key}"))
        .await
}

/// `key`'s `remaining` once it reads `want` (a settlement is sent after the response, in the
/// background), or as it is after 5 s.
async fn remaining_reaches(g: &Gateway, route: &str, key: &str, want: u64) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let remaining = state(g, route, key).await["remaining"].clone();
        if remaining == want || std::time::Instant::now() > deadline {
            return remaining;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn series(g: &Gateway, name: &str, route: &str, extra: &str) -> f64 {
    let text = g.shared.gateway.metrics.encode(Format::Text);
    metric(
        &text,
        &format!("{name}{{route=\"{route}\",limit=\"tokens\"{extra}}}"),
    )
    .unwrap_or(0.0)
}

fn settled(g: &Gateway, route: &str, direction: &str) -> f64 {
    series(
        g,
        "tollgate_settled_units_total",
        route,
        &format!(",direction=\"{direction}\""),
    )
}

/// A local gcra limit on a frozen clock: 1 charged, 15 used, so the key owes 5 units past its
/// burst of 10; the next request is refused for exactly as long as its unit takes to free.
#[tokio::test]
async fn a_cost_header_charges_the_difference_and_the_debt_gives_an_exact_retry_after() {
    let up = Upstream::start().await;
    let (g, clock) = Gateway::start_manual(&yaml(
        None,
        &[("usage", &up.url())],
        &tokens("gcra", 1, "local"),
    ))
    .await;
    let r = get(&g, "/usage?n=15", "k").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-usage"],
        "15",
        "the cost header reaches the client"
    );
    // TAT = now + 15 s, tau = 10 s: one more unit fits when the TAT is 9 s ahead, in 6 s.
    let r = get(&g, "/usage?n=1", "k").await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "6");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["retry_after_ms"], 6000);
    assert_eq!(state(&g, "usage", "k").await["reset_after_ms"], 15000);
    clock.advance(5_999_999);
    assert_eq!(get(&g, "/usage?n=1", "k").await.status(), 429);
    clock.advance(1);
    assert_eq!(get(&g, "/usage?n=1", "k").await.status(), 200);
    // Cheaper than estimated: given back.
    let (g2, _clock) = Gateway::start_manual(&yaml(
        None,
        &[("usage", &up.url())],
        &tokens("gcra", 4, "local"),
    ))
    .await;
    assert_eq!(get(&g2, "/usage?n=1", "k").await.status(), 200);
    assert_eq!(state(&g2, "usage", "k").await["remaining"], 9);
    assert_eq!(
        (
            settled(&g, "usage", "charged"),
            settled(&g2, "usage", "refunded")
        ),
        (14.0, 3.0)
    );
}

/// The sliding log owes its debt by the entries that must expire.
#[tokio::test]
async fn a_sliding_log_in_debt_refuses_until_its_entries_expire() {
    let up = Upstream::start().await;
    let (g, clock) = Gateway::start_manual(&yaml(
        None,
        &[("usage", &up.url())],
        &tokens("sliding_log", 1, "local"),
    ))
    .await;
    assert_eq!(get(&g, "/usage?n=130", "k").await.status(), 200);
    clock.advance(1_000_000);
    let r = get(&g, "/usage?n=1", "k").await;
    assert_eq!(r.status(), 429);
    // 130 units at t0 in a log of 100 per 100 s: free again when they expire, 99 s from now.
    assert_eq!(r.headers()["retry-after"], "99");
    clock.advance(99_000_000);
    assert_eq!(get(&g, "/usage?n=1", "k").await.status(), 200);
}

/// A status in `refund_status` gives the whole charge back: the upstream's, and tollgate's own
/// 502 when the upstream is down.
#[tokio::test]
async fn refund_status_gives_the_whole_charge_back() {
    let up = Upstream::start().await;
    let down = format!("http://{}", closed_addr());
    let limits = tokens("gcra", 10, "local");
    let (g, _clock) = Gateway::start_manual(&yaml(
        None,
        &[("usage", &up.url()), ("down", &down)],
        &limits,
    ))
    .await;
    for _ in 0..3 {
        // The whole burst each time, all of it given back.
        assert_eq!(get(&g, "/usage?status=503", "k").await.status(), 503);
        assert_eq!(get(&g, "/down", "k").await.status(), 502);
    }
    assert_eq!(state(&g, "usage", "k").await["remaining"], 10);
    assert_eq!(settled(&g, "usage", "refunded"), 30.0);
    assert_eq!(settled(&g, "down", "refunded"), 30.0);
    // A 200 keeps it.
    assert_eq!(get(&g, "/usage", "k").await.status(), 200);
    assert_eq!(get(&g, "/usage", "k").await.status(), 429);
}

/// No cost header, or one that is not a whole number: the estimate stays charged, and counted.
#[tokio::test]
async fn a_missing_or_unparsable_cost_keeps_the_estimate_and_is_counted() {
    let up = Upstream::start().await;
    let (g, _clock) = Gateway::start_manual(&yaml(
        None,
        &[("usage", &up.url())],
        &tokens("gcra", 3, "local"),
    ))
    .await;
    assert_eq!(get(&g, "/usage", "k").await.status(), 200);
    assert_eq!(get(&g, "/usage?n=12.5", "k").await.status(), 200);
    assert_eq!(get(&g, "/usage?n=-4", "k").await.status(), 200);
    assert_eq!(state(&g, "usage", "k").await["remaining"], 1);
    // A plus sign too (Rust's integer parser would take it), on a key of its own.
    assert_eq!(get(&g, "/usage?n=+7", "p").await.status(), 200);
    assert_eq!(state(&g, "usage", "p").await["remaining"], 7);
    assert_eq!(
        series(&g, "tollgate_settle_missing_total", "usage", ""),
        4.0
    );
    assert_eq!(
        settled(&g, "usage", "charged") + settled(&g, "usage", "refunded"),
        0.0
    );
}

/// The cost in a trailer of a chunked HTTP/1.1 answer, read whether the client speaks HTTP/1.1
/// or HTTP/2 to tollgate.
#[tokio::test]
async fn a_cost_trailer_settles_over_http1_chunked_and_over_http2() {
    let trailing = upstream::raw(&[
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-usage\r\n\r\n5\r\nhello\r\n",
        b"0\r\nx-usage: 7\r\n\r\n",
    ])
    .await;
    let (g, _clock) = Gateway::start_manual(&yaml(
        None,
        &[("t", &trailing)],
        &tokens("gcra", 1, "local"),
    ))
    .await;
    let r = get(&g, "/t", "one").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "hello");
    assert_eq!(state(&g, "t", "one").await["remaining"], 3);
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let r = h2
        .get(g.url("/t"))
        .header("x-key", "two")
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.text().await.unwrap(), "hello");
    assert_eq!(state(&g, "t", "two").await["remaining"], 3);
    assert_eq!(settled(&g, "t", "charged"), 12.0);
}

/// gcra charges a settlement from the TAT its admission left: admitted from a bucket that was
/// not full (TAT 5 s ahead after a first request's debt), then settled exactly when that TAT
/// (6 s) is reached, the 3 units more run from 6 s to 9 s, not from `admission + estimate × T`
/// (4 s, to 7 s), which would let the key admit more than its bound.
#[tokio::test]
async fn a_gcra_charge_settled_when_its_tat_passes_runs_from_the_admissions_tat() {
    let (held, release) = upstream::trailer_on_release().await;
    let (g, clock) =
        Gateway::start_manual(&yaml(None, &[("held", &held)], &tokens("gcra", 1, "local"))).await;
    // 1 charged, 5 used: the TAT 5 s ahead (T = 1 s, burst 10).
    release.add_permits(1);
    let r = get(&g, "/held?n=5", "k").await;
    assert_eq!(r.text().await.unwrap(), "held");
    assert_eq!(state(&g, "held", "k").await["reset_after_ms"], 5000);
    // 3 s later: admitted on 1 from the TAT at 5 s, to 6 s; the response head is out.
    clock.advance(3_000_000);
    let r = get(&g, "/held?n=4", "k").await;
    assert_eq!(r.status(), 200);
    assert_eq!(state(&g, "held", "k").await["reset_after_ms"], 3000);
    // Its cost (4: 3 more) comes at 6 s, the instant that TAT passes.
    clock.advance(3_000_000);
    release.add_permits(1);
    assert_eq!(r.text().await.unwrap(), "held");
    let s = state(&g, "held", "k").await;
    assert_eq!(
        (&s["reset_after_ms"], &s["remaining"]),
        (&3000.into(), &7.into())
    );
    assert_eq!(settled(&g, "held", "charged"), 7.0);
}

/// The same in Redis, on Redis's clock (T = 200 ms, burst 10): the second request's TAT
/// (1.2 s after the first) has passed when its 5 units more settle, and they still run from
/// it, so the key is 1 s from full at once; from `admission + estimate × T` they would have
/// drained before they were charged.
#[tokio::test]
async fn a_global_gcra_charge_settled_after_its_tat_runs_from_the_admissions_tat() {
    let (held, release) = upstream::trailer_on_release().await;
    let redis = RedisServer::start();
    let limit = tokens("gcra", 1, "global").replace("rate: 100/100s", "rate: 50/10s");
    let g = Gateway::start(&yaml(Some(&redis.url()), &[("held", &held)], &limit)).await;
    release.add_permits(1);
    assert_eq!(
        get(&g, "/held?n=5", "k").await.text().await.unwrap(),
        "held"
    );
    // Settled in the background: 5 of 10 taken, the TAT 1 s ahead.
    assert_eq!(remaining_reaches(&g, "held", "k", 5).await, 5);
    let r = get(&g, "/held?n=6", "k").await;
    assert_eq!(r.status(), 200);
    // Its TAT (1.2 s from the first admission) passes before the cost comes.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    release.add_permits(1);
    assert_eq!(r.text().await.unwrap(), "held");
    // From 1.2 s, the TAT goes to 2.2 s: about 0.9 s ahead now (never 0, as it would be from
    // `admission + estimate × T`, 0.2 s + 1 s, before now).
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let ahead = loop {
        let ahead = state(&g, "held", "k").await["reset_after_ms"]
            .as_u64()
            .unwrap();
        if ahead > 0 || std::time::Instant::now() > deadline {
            break ahead;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!((1..=900).contains(&ahead), "{ahead} ms ahead");
}

fn fcalls(redis: &RedisServer) -> u64 {
    command_calls(&redis.cli(&["INFO", "commandstats"]), "fcall").0
}

async fn fcalls_reach(redis: &RedisServer, n: u64) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while fcalls(redis) < n && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // And a moment more, to see no call beyond.
    tokio::time::sleep(Duration::from_millis(100)).await;
    fcalls(redis)
}

/// The same in Redis: one script call settles, none when the cost is the estimate; the debt
/// gives the exact Retry-After on Redis's clock; a refund status gives the charge back.
#[tokio::test]
async fn global_settlements_take_one_script_call_and_owe_in_redis() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    for algorithm in ["gcra", "sliding_log"] {
        let g = Gateway::start(&yaml(
            Some(&redis.url()),
            &[("usage", &up.url())],
            &tokens(algorithm, 1, "global"),
        ))
        .await;
        assert_eq!(get(&g, "/usage?n=1", "warm").await.status(), 200);
        let before = fcalls_reach(&redis, 0).await;
        // The cost is the estimate: the decision, nothing more.
        assert_eq!(get(&g, "/usage?n=1", "same").await.status(), 200);
        assert_eq!(
            fcalls_reach(&redis, before + 1).await,
            before + 1,
            "{algorithm}"
        );
        // A refund status: the decision and one settlement.
        assert_eq!(get(&g, "/usage?status=500", "back").await.status(), 500);
        assert_eq!(
            fcalls_reach(&redis, before + 3).await,
            before + 3,
            "{algorithm}"
        );
        // (The admin API's look at the key is one more call.)
        let full = if algorithm == "gcra" { 10 } else { 100 };
        assert_eq!(state(&g, "usage", "back").await["remaining"], full);
        // 15 used on an estimate of 1.
        assert_eq!(get(&g, "/usage?n=15", "k").await.status(), 200);
        assert_eq!(
            fcalls_reach(&redis, before + 6).await,
            before + 6,
            "{algorithm}"
        );
        let r = get(&g, "/usage?n=1", "k").await;
        if algorithm == "gcra" {
            // TAT 15 s ahead with tau 10 s: the next unit in 6 s (less the moment since).
            assert_eq!(r.status(), 429);
            assert_eq!(r.headers()["retry-after"], "6");
        } else {
            // 15 of 100 used: the log has room.
            assert_eq!(r.status(), 200);
            assert_eq!(state(&g, "usage", "k").await["remaining"], 84);
        }
        assert_eq!(settled(&g, "usage", "charged"), 14.0, "{algorithm}");
        assert_eq!(settled(&g, "usage", "refunded"), 1.0, "{algorithm}");
        redis.cli(&["FLUSHALL"]);
    }
}

/// A window limit settled from `x-usage`: `rate: 100/1d` (with `extra` lines such as
/// `align: calendar`), estimate `cost`, keyed by `x-key`.
fn window_tokens(algorithm: &str, extra: &str, cost: u64, scope: &str) -> String {
    format!(
        "      - name: tokens\n        key: [header:x-key]\n        algorithm: {algorithm}\n        rate: 100/1d\n{extra}        cost: {cost}\n        scope: {scope}\n        settle:\n          cost_header: x-usage\n          refund_status: [500-599]\n"
    )
}

/// The LLM gateway's daily token quota: a local calendar fixed_window (a day of Berlin, 23
/// hours long on 2024-03-31) settled from the cost header goes into debt, and its next request
/// gets 429 with `Retry-After` to the next local midnight, exact to the second; the new day
/// starts from 0. A response cheaper than the estimate gives the difference back.
#[tokio::test]
async fn a_calendar_token_quota_in_debt_refuses_until_local_midnight() {
    use jiff::Timestamp;
    use tollgate::limit::clock::ManualClock;
    let micros = |t: &str| u64::try_from(t.parse::<Timestamp>().unwrap().as_microsecond()).unwrap();
    let noon = micros("2024-03-31T10:00:00Z"); // 12:00 CEST
    let midnight = micros("2024-03-31T22:00:00Z"); // 00:00 CEST, 12 hours later
    let up = Upstream::start().await;
    let limit = "      - name: tokens\n        key: [header:x-key]\n        algorithm: fixed_window\n        align: calendar\n        timezone: Europe/Berlin\n        rate: 1000000/1d\n        cost: 500\n        settle:\n          cost_header: x-usage\n";
    let clock = std::sync::Arc::new(ManualClock::new(noon));
    let g =
        Gateway::start_with_clock(&yaml(None, &[("usage", &up.url())], limit), clock.clone()).await;
    // 500 charged, 1 200 000 used: 200 000 over the day's million.
    assert_eq!(get(&g, "/usage?n=1200000", "k").await.status(), 200);
    let s = state(&g, "usage", "k").await;
    assert_eq!(
        (&s["remaining"], &s["reset_after_ms"]),
        (&0.into(), &43_200_000.into())
    );
    clock.advance(1_000_000);
    let r = get(&g, "/usage?n=1", "k").await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "43199");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["retry_after_ms"], 43_199_000);
    clock.set(midnight - 1);
    assert_eq!(get(&g, "/usage?n=1", "k").await.status(), 429);
    // The next day starts from 0: its first request is charged its estimate, then 1 given back.
    clock.set(midnight);
    assert_eq!(get(&g, "/usage?n=1", "k").await.status(), 200);
    assert_eq!(state(&g, "usage", "k").await["remaining"], 999_999);
    assert_eq!(settled(&g, "usage", "charged"), 1_199_500.0);
    assert_eq!(settled(&g, "usage", "refunded"), 499.0);
}

/// Seconds from `now` (the wall clock, as Redis's) to the end of its window: a UTC day, or a
/// Berlin day.
fn to_window_end(now: std::time::SystemTime, calendar: bool) -> f64 {
    let now = jiff::Timestamp::try_from(now).unwrap();
    let end = if calendar {
        let tz = jiff::tz::TimeZone::get("Europe/Berlin").unwrap();
        let today = now.to_zoned_datetime(tz.clone()).date();
        today
            .tomorrow()
            .unwrap()
            .to_zoned_datetime(tz)
            .unwrap()
            .timestamp()
    } else {
        let day = 86_400_000_000i64;
        jiff::Timestamp::from_microsecond((now.as_microsecond() / day + 1) * day).unwrap()
    };
    (end.as_microsecond() - now.as_microsecond()) as f64 / 1e6
}

/// Window limits in Redis: one script call per settlement and none when the cost is the
/// estimate; a refund status gives the charge back; a debt refuses the key's next request
/// until the window's end (fixed_window, epoch and calendar) or until the weighted count has
/// room (sliding_window), with the Retry-After those give on Redis's clock.
#[tokio::test]
async fn global_window_settlements_take_one_script_call_and_owe_in_redis() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let cases = [
        ("fixed_window", ""),
        (
            "fixed_window",
            "        align: calendar\n        timezone: Europe/Berlin\n",
        ),
        ("sliding_window", ""),
    ];
    for (algorithm, extra) in cases {
        let calendar = !extra.is_empty();
        // The requests below must fall in one window: not within 10 s of its end.
        let left = to_window_end(std::time::SystemTime::now(), calendar);
        if left < 10.0 {
            tokio::time::sleep(Duration::from_secs_f64(left + 1.0)).await;
        }
        let g = Gateway::start(&yaml(
            Some(&redis.url()),
            &[("usage", &up.url())],
            &window_tokens(algorithm, extra, 1, "global"),
        ))
        .await;
        let case = format!("{algorithm} {extra:?}");
        assert_eq!(get(&g, "/usage?n=1", "warm").await.status(), 200);
        let before = fcalls_reach(&redis, 0).await;
        assert_eq!(get(&g, "/usage?n=1", "same").await.status(), 200);
        assert_eq!(fcalls_reach(&redis, before + 1).await, before + 1, "{case}");
        assert_eq!(get(&g, "/usage?status=500", "back").await.status(), 500);
        assert_eq!(fcalls_reach(&redis, before + 3).await, before + 3, "{case}");
        assert_eq!(state(&g, "usage", "back").await["remaining"], 100, "{case}");
        // 130 used on an estimate of 1: 30 over the day's 100.
        assert_eq!(get(&g, "/usage?n=130", "k").await.status(), 200);
        assert_eq!(fcalls_reach(&redis, before + 6).await, before + 6, "{case}");
        let sent = std::time::SystemTime::now();
        let r = get(&g, "/usage?n=1", "k").await;
        let answered = std::time::SystemTime::now();
        assert_eq!(r.status(), 429, "{case}");
        let retry: f64 = r.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let (early, late) = (
            to_window_end(answered, calendar),
            to_window_end(sent, calendar),
        );
        let (early, late) = if algorithm == "sliding_window" {
            // 130 in this window: 1 more fits once their weight in the next is 99, i.e. a
            // day × (1 - 99/130) into it.
            let e = 86_400.0 * (1.0 - 99.0 / 130.0);
            (early + e, late + e)
        } else {
            (early, late)
        };
        assert!(
            retry >= early.floor() && retry <= late.ceil() + 1.0,
            "{case}: Retry-After {retry}, expected between {early} and {late}"
        );
        assert_eq!(state(&g, "usage", "k").await["remaining"], 0, "{case}");
        // Another key under the count: charged its true cost, 10.
        assert_eq!(get(&g, "/usage?n=10", "j").await.status(), 200);
        assert_eq!(remaining_reaches(&g, "usage", "j", 90).await, 90, "{case}");
        assert_eq!(settled(&g, "usage", "charged"), 138.0, "{case}");
        assert_eq!(settled(&g, "usage", "refunded"), 1.0, "{case}");
        redis.cli(&["FLUSHALL"]);
    }
}

/// settle.lua against the Rust cores: random timelines of decisions and settlements (the clock
/// overridden) fed to both give identical decisions and states, step by step, for gcra and the
/// sliding log, on both ways the scripts reach Redis.
mod mirror {
    use std::sync::OnceLock;

    use proptest::prelude::*;
    use tollgate::limit::algorithm::{Algorithm, Gcra, Micros, Quota, Settlement, SlidingLog};
    use tollgate::limit::redis::{
        GlobalLimit, LimitVerdict, RedisSettings, RedisStore, RedisTarget, ScriptPath,
    };

    use crate::support::redis::RedisServer;

    const EPOCH: Micros = 1_700_000_000_000_000;

    struct Shared {
        rt: tokio::runtime::Runtime,
        _server: RedisServer,
        stores: Vec<RedisStore>,
    }

    fn shared() -> &'static Shared {
        static S: OnceLock<Shared> = OnceLock::new();
        S.get_or_init(|| {
            let server = RedisServer::start();
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let stores = rt.block_on(async {
                let mut settings = RedisSettings::new(RedisTarget::Single(server.url()));
                settings.timeout = std::time::Duration::from_secs(5);
                [ScriptPath::Functions, ScriptPath::Evalsha]
                    .map(|p| RedisStore::connect_with(settings.clone(), p).unwrap())
                    .to_vec()
            });
            Shared {
                rt,
                _server: server,
                stores,
            }
        })
    }

    /// `(gap, estimate, true cost, settled how long after)` per request.
    fn steps() -> impl Strategy<Value = Vec<(Micros, u64, u64, Micros)>> {
        prop::collection::vec(
            (
                0..600_000u64,
                1..4u64,
                0..14u64,
                prop_oneof![Just(0u64), 0..300_000u64],
            ),
            1..60,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        #[test]
        fn settle_lua_matches_rust(gcra in any::<bool>(), start in prop_oneof![Just(0u64), Just(EPOCH)], steps in steps()) {
            let q = Quota { count: 10, period: 1_000_000, burst: 5 };
            let alg = if gcra {
                Algorithm::Gcra(Gcra::new(q))
            } else {
                Algorithm::SlidingLog(SlidingLog::new(q))
            };
            let sh = shared();
            for (n, store) in sh.stores.iter().enumerate() {
                static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let key = format!("tg:{{mirror-settle/{n}/{seq}}}");
                sh.rt.block_on(async {
                    let mut state = alg.new_state();
                    let mut now = start;
                    for (i, &(gap, estimate, cost, after)) in steps.iter().enumerate() {
                        now += gap;
                        let limit = GlobalLimit { algorithm: &alg, key: &key, cost: estimate, max_delay: 0 };
                        let expected = alg.check(&state, now, estimate);
                        let got = store.decide(&[limit], Some(now)).await.expect("decide");
                        prop_assert_eq!(got.admitted, expected.is_ok(), "step {} at {}", i, now);
                        if let (Ok(snapshot), Some(LimitVerdict::Admitted { snapshot: s, .. })) = (expected, got.per_limit.first()) {
                            prop_assert_eq!(s, &snapshot);
                        }
                        if let (true, Ok(snapshot)) = (got.admitted, expected) {
                            alg.commit(&mut state, now, estimate);
                            let at = got.at[0];
                            prop_assert_eq!(at, now);
                            let delta = cost as i64 - estimate as i64;
                            let settled_at = now + after;
                            let s = Settlement { at, estimate, full_at: at + snapshot.reset_after, delta };
                            alg.settle(&mut state, s, settled_at);
                            store.settle(&limit, s, Some(settled_at)).await.expect("settle");
                            let (peek, _) = store.peek_at(&limit, Some(settled_at)).await.expect("peek");
                            prop_assert_eq!(peek, alg.peek(&state, settled_at), "after settling step {} at {}", i, settled_at);
                            now = settled_at;
                        }
                    }
                    Ok(())
                })?;
            }
        }
    }
}
