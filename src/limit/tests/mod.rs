//! Orchestration tests of [`LimitSet::evaluate`]: a route's limits compiled from YAML, decided
//! on a [`ManualClock`] against a fake global store ([`fake::FakeStore`]) that decides with
//! the pure cores, so every tier around the store — the in-process deny tier, local and
//! eventual limits, `on_error`, shadow limits — is exercised without a server. Real Redis and
//! Cluster behaviour is `tests/global.rs`, `tests/eventual.rs` and `tests/redis_cluster.rs`.

mod fake;
mod reserve;

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::oneshot;

use super::*;
use crate::limit::clock::{Clock, ManualClock};
use fake::FakeStore;
use redis::{GlobalLimit, RedisError};

/// Local time of every decision: 0.1 s into a second, so a `1s` window holds them all.
const NOW: Micros = 1_700_000_000_100_000;

/// A route `r` whose limits are `limits`, each a YAML flow mapping (`{name: a, key: [..], ..}`);
/// `redis` is configured (the test decides what answers for it), so limits default to
/// `scope: global`. Eventual limits take `now` as Redis's time, as a first sync would have set
/// it.
fn limit_set(metrics: &Metrics, limits: &[&str], now: Micros) -> LimitSet {
    let mut yaml = String::from(
        "redis:\n  url: redis://127.0.0.1:1\nroutes:\n  - name: r\n    upstream: http://a:1\n    limits:\n",
    );
    for l in limits {
        yaml.push_str("      - ");
        yaml.push_str(l);
        yaml.push('\n');
    }
    let config = crate::config::parse_str(std::path::Path::new("t.yaml"), &yaml).unwrap();
    let limits: Vec<Limit> = config.routes[0]
        .limits
        .iter()
        .map(|lc| {
            Limit::new(
                "r",
                lc,
                Arc::default(),
                Arc::default(),
                None,
                metrics.limit("r", &lc.name),
            )
        })
        .collect();
    for l in &limits {
        if let Some(ev) = &l.eventual {
            let clock = eventual::SyncItem::pull(b"\x00clock", 0);
            ev.apply(&l.algorithm, &clock, (0, 0), now, now, now);
        }
    }
    LimitSet::new(limits, TierMetrics::new(metrics), false)
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn context<'a, G>(
    clock: &'a ManualClock,
    store: Option<&'a G>,
    on_error: OnError,
    metrics: &'a Metrics,
) -> Context<'a, G> {
    Context {
        now: clock.now(),
        started: std::time::Instant::now(),
        clock,
        probe_wait: Duration::from_millis(50),
        redis: store,
        on_error,
        leases: None,
        allow_delay: true,
        waited: 0,
        metrics,
    }
}

/// The request parts of `GET uri` from 127.0.0.1 (its `Method` and `HeaderMap` in `held`).
fn parts<'a>(uri: &'a http::Uri, held: &'a (http::Method, http::HeaderMap)) -> RequestParts<'a> {
    RequestParts {
        method: &held.0,
        uri,
        headers: &held.1,
        client_ip: [127, 0, 0, 1].into(),
        client_ip_text: None,
        route: "r",
        peer_trusted: false,
    }
}

/// What a request is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    Admit,
    /// 429 naming this limit.
    Reject(&'static str),
    /// 503 naming this limit (`on_error: deny`).
    Unavailable(&'static str),
}

/// How the global store answers.
#[derive(Clone)]
enum Store {
    Answers,
    /// Every call fails so (`Unavailable`: what Redis answers with its breaker open).
    Fails(RedisError),
    /// None could be set up (`Context::redis` is `None`).
    Absent,
}

struct Row {
    name: &'static str,
    limits: &'static [&'static str],
    store: Store,
    on_error: OnError,
    /// The first request is overtaken: it waits inside the store's `decide` until the second
    /// has been decided from start to end.
    overtaken: bool,
    /// The answers to requests for one key, in order, all at one instant.
    expect: &'static [Expect],
    /// Calls the store got: (`decide`, syncs of eventual counts).
    calls: (usize, usize),
    /// Units left afterwards, per limit, where it is decided: the global store for a strict
    /// global limit, the instance's counts for an eventual one, the local store for a local
    /// one; `name/local` is a global limit's local (fallback) store.
    left: &'static [(&'static str, u64)],
    /// Counted decisions: (limit, `allowed` | `rejected` | `shadow_rejected` | `fallback`, n),
    /// or (`tier`, `local` | `in_process` | `redis` | `fallback`, n).
    counted: &'static [(&'static str, &'static str, u64)],
}

use Expect::{Admit, Reject, Unavailable};

const STRICT: OnError = OnError::Deny;
const LAX: OnError = OnError::Allow;

fn rows() -> Vec<Row> {
    let timeout = || Store::Fails(RedisError::Timeout);
    vec![
        Row {
            name: "local limits only: no store call",
            limits: &[
                "{name: loc, key: [query:k], algorithm: fixed_window, rate: 2/1s, scope: local}",
            ],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Admit, Reject("loc")],
            calls: (0, 0),
            left: &[("loc", 0)],
            counted: &[
                ("loc", "allowed", 2),
                ("loc", "rejected", 1),
                ("tier", "local", 3),
            ],
        },
        Row {
            name: "global admit: charged in the store, not in the fallback store",
            limits: &["{name: glob, key: [query:k], algorithm: sliding_window, rate: 2/1s}"],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Admit],
            calls: (2, 0),
            left: &[("glob", 0), ("glob/local", 2)],
            counted: &[("glob", "allowed", 2), ("tier", "redis", 2)],
        },
        Row {
            name: "global reject, then the in-process tier answers without a call",
            limits: &["{name: glob, key: [query:k], algorithm: sliding_window, rate: 1/1s}"],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Reject("glob"), Reject("glob")],
            calls: (2, 0),
            left: &[("glob", 0)],
            counted: &[
                ("glob", "rejected", 2),
                ("tier", "redis", 2),
                ("tier", "in_process", 1),
            ],
        },
        Row {
            name: "the tier's 429 names the refusing limit with the longest wait, not the first",
            limits: &[
                "{name: short, key: [query:k], algorithm: gcra, rate: 1/1s, burst: 1}",
                "{name: long, key: [query:k], algorithm: gcra, rate: 1/1h, burst: 1}",
            ],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Reject("long"), Reject("long")],
            calls: (1, 0),
            left: &[("short", 0), ("long", 0)],
            counted: &[("tier", "redis", 1), ("tier", "in_process", 2)],
        },
        Row {
            name: "tier hit: a used-up fixed window is learned from the admission",
            limits: &["{name: glob, key: [query:k], algorithm: fixed_window, rate: 1/1s}"],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Reject("glob"), Reject("glob")],
            calls: (1, 0),
            left: &[("glob", 0)],
            counted: &[("tier", "redis", 1), ("tier", "in_process", 2)],
        },
        Row {
            name: "eventual: decided in process after one pull of the key",
            limits: &[
                "{name: ev, key: [query:k], algorithm: fixed_window, rate: 2/1s, consistency: eventual}",
            ],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Admit, Reject("ev")],
            calls: (0, 1),
            left: &[("ev", 0)],
            counted: &[
                ("ev", "allowed", 2),
                ("ev", "rejected", 1),
                ("tier", "local", 3),
            ],
        },
        Row {
            name: "a local rejection needs no round trip",
            limits: &[
                "{name: loc, key: [query:k], algorithm: fixed_window, rate: 1/1s, scope: local}",
                "{name: glob, key: [query:k], algorithm: sliding_window, rate: 5/1s}",
            ],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Reject("loc")],
            calls: (1, 0),
            left: &[("loc", 0), ("glob", 4)],
            counted: &[("tier", "local", 1), ("tier", "redis", 1)],
        },
        Row {
            name: "an eventual rejection needs no round trip",
            limits: &[
                "{name: ev, key: [query:k], algorithm: fixed_window, rate: 1/1s, consistency: eventual}",
                "{name: glob, key: [query:k], algorithm: sliding_window, rate: 5/1s}",
            ],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Reject("ev")],
            calls: (1, 1),
            left: &[("ev", 0), ("glob", 4)],
            counted: &[],
        },
        Row {
            name: "all or nothing: a global rejection charges no other limit",
            limits: &[
                "{name: loc, key: [query:k], algorithm: fixed_window, rate: 5/1s, scope: local}",
                "{name: ev, key: [query:k], algorithm: fixed_window, rate: 5/1s, consistency: eventual}",
                "{name: wide, key: [query:k], algorithm: sliding_window, rate: 5/1s}",
                "{name: narrow, key: [query:k], algorithm: sliding_window, rate: 1/1s}",
            ],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Reject("narrow"), Reject("narrow")],
            calls: (2, 1),
            left: &[("loc", 4), ("ev", 4), ("wide", 4), ("narrow", 0)],
            counted: &[
                ("wide", "allowed", 1),
                ("wide", "rejected", 0),
                ("narrow", "rejected", 2),
            ],
        },
        Row {
            name: "store error, on_error allow: the local fallback store decides",
            limits: &["{name: glob, key: [query:k], algorithm: sliding_window, rate: 1/1s}"],
            store: timeout(),
            on_error: LAX,
            overtaken: false,
            expect: &[Admit, Reject("glob")],
            calls: (2, 0),
            left: &[("glob/local", 0)],
            counted: &[
                ("glob", "fallback", 2),
                ("tier", "fallback", 2),
                ("tier", "redis", 0),
            ],
        },
        Row {
            name: "store error, on_error deny: 503, nothing charged",
            limits: &[
                "{name: loc, key: [query:k], algorithm: fixed_window, rate: 5/1s, scope: local}",
                "{name: glob, key: [query:k], algorithm: sliding_window, rate: 1/1s}",
            ],
            store: timeout(),
            on_error: STRICT,
            overtaken: false,
            expect: &[Unavailable("glob"), Unavailable("glob")],
            calls: (2, 0),
            left: &[("loc", 5), ("glob/local", 1)],
            counted: &[("glob", "fallback", 0), ("tier", "fallback", 0)],
        },
        Row {
            name: "breaker open, on_error allow: all or nothing across the fallback",
            limits: &[
                "{name: loc, key: [query:k], algorithm: fixed_window, rate: 5/1s, scope: local}",
                "{name: glob, key: [query:k], algorithm: sliding_window, rate: 1/1s}",
            ],
            store: Store::Fails(RedisError::Unavailable),
            on_error: LAX,
            overtaken: false,
            expect: &[Admit, Reject("glob")],
            calls: (2, 0),
            left: &[("loc", 4), ("glob/local", 0)],
            counted: &[("glob", "fallback", 2)],
        },
        Row {
            name: "no store could be set up, on_error deny: 503",
            limits: &["{name: glob, key: [query:k], algorithm: sliding_window, rate: 1/1s}"],
            store: Store::Absent,
            on_error: STRICT,
            overtaken: false,
            expect: &[Unavailable("glob")],
            calls: (0, 0),
            left: &[("glob/local", 1)],
            counted: &[],
        },
        Row {
            name: "shadow local limit: its rejection is counted, the request admitted",
            limits: &[
                "{name: sh, key: [query:k], algorithm: fixed_window, rate: 1/1s, scope: local, shadow: true}",
            ],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Admit, Admit],
            calls: (0, 0),
            left: &[("sh", 0)],
            counted: &[
                ("sh", "allowed", 1),
                ("sh", "shadow_rejected", 2),
                ("sh", "rejected", 0),
            ],
        },
        Row {
            name: "shadow global limit beside an enforced one: one call, charged together",
            limits: &[
                "{name: glob, key: [query:k], algorithm: sliding_window, rate: 5/1s}",
                "{name: sh, key: [query:k], algorithm: sliding_window, rate: 1/1s, shadow: true}",
            ],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Admit, Admit],
            calls: (3, 0),
            left: &[("glob", 2), ("sh", 0)],
            counted: &[
                ("sh", "allowed", 1),
                ("sh", "shadow_rejected", 2),
                ("glob", "allowed", 3),
            ],
        },
        Row {
            name: "a shadow global limit's store error changes nothing",
            limits: &[
                "{name: sh, key: [query:k], algorithm: sliding_window, rate: 1/1s, shadow: true}",
            ],
            store: timeout(),
            on_error: STRICT,
            overtaken: false,
            expect: &[Admit, Admit],
            calls: (2, 0),
            left: &[("sh/local", 1)],
            counted: &[("sh", "fallback", 0), ("tier", "fallback", 0)],
        },
        Row {
            name: "a local limit used up during the round trip: rejected, global units stay taken",
            limits: &[
                "{name: loc, key: [query:k], algorithm: fixed_window, rate: 1/1s, scope: local}",
                "{name: glob, key: [query:k], algorithm: sliding_window, rate: 5/1s}",
            ],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: true,
            expect: &[Reject("loc"), Admit],
            calls: (2, 0),
            left: &[("loc", 0), ("glob", 3)],
            counted: &[("loc", "rejected", 1)],
        },
        Row {
            name: "an eventual limit used up during the round trip: rejected, global units stay taken",
            limits: &[
                "{name: ev, key: [query:k], algorithm: fixed_window, rate: 1/1s, consistency: eventual}",
                "{name: glob, key: [query:k], algorithm: sliding_window, rate: 5/1s}",
            ],
            store: Store::Answers,
            on_error: STRICT,
            overtaken: true,
            expect: &[Reject("ev"), Admit],
            calls: (2, 1),
            left: &[("ev", 0), ("glob", 3)],
            counted: &[("ev", "rejected", 1)],
        },
        Row {
            name: "an eventual limit used up during a failing call: rejected, nothing charged",
            limits: &[
                "{name: ev, key: [query:k], algorithm: fixed_window, rate: 1/1s, consistency: eventual}",
                "{name: glob, key: [query:k], algorithm: sliding_window, rate: 5/1s}",
            ],
            store: Store::Fails(RedisError::Unavailable),
            on_error: LAX,
            overtaken: true,
            expect: &[Reject("ev"), Admit],
            calls: (2, 1),
            left: &[("ev", 0), ("glob/local", 4)],
            counted: &[("ev", "rejected", 1), ("glob", "fallback", 2)],
        },
    ]
}

impl Expect {
    fn text(self) -> String {
        match self {
            Admit => "admit".to_owned(),
            Reject(limit) => format!("429 {limit}"),
            Unavailable(limit) => format!("503 {limit}"),
        }
    }
}

/// A verdict as [`Expect::text`] writes the expected one.
fn answer(set: &LimitSet, v: &Verdict) -> String {
    match v {
        Verdict::Admit { .. } => "admit".to_owned(),
        Verdict::Reject { limit, .. } => format!("429 {}", set.limits[*limit].name),
        Verdict::Unavailable { limit } => format!("503 {}", set.limits[*limit].name),
        other => format!("{other:?}"),
    }
}

/// Units left at key `k` for `which` (see [`Row::left`]).
fn left(set: &LimitSet, store: &FakeStore<'_>, which: &str, now: Micros) -> u64 {
    let (name, fallback) = match which.strip_suffix("/local") {
        Some(name) => (name, true),
        None => (which, false),
    };
    let l = set.limits.iter().find(|l| &*l.name == name).unwrap();
    if let Some(ev) = &l.eventual {
        return ev.peek(&l.algorithm, b"k", now).remaining;
    }
    if l.is_global() && !fallback {
        return store.remaining(&l.algorithm, &l.redis_key(b"k"));
    }
    l.store.peek(&l.algorithm, b"k", now).remaining
}

fn counted(set: &LimitSet, who: &str, what: &str) -> u64 {
    if who == "tier" {
        let t = &set.tiers;
        let c = match what {
            "local" => &t.local,
            "in_process" => &t.in_process,
            "redis" => &t.redis,
            "fallback" => &t.fallback,
            _ => panic!("no tier counter {what}"),
        };
        return c.get();
    }
    let m = &set.limits.iter().find(|l| &*l.name == who).unwrap().metrics;
    match what {
        "allowed" => m.allowed.get(),
        "rejected" => m.rejected.get(),
        "shadow_rejected" => m.shadow_rejected.get(),
        "fallback" => m.fallback.get(),
        _ => panic!("no limit counter {what}"),
    }
}

/// Decides `row`'s requests; every mismatch as a line.
fn run(row: &Row) -> Vec<String> {
    let metrics = Metrics::new();
    let clock = ManualClock::new(NOW);
    let set = limit_set(&metrics, row.limits, NOW);
    let store = FakeStore::new(&clock);
    if let Store::Fails(e) = &row.store {
        store.fail_with(Some(e.clone()));
    }
    let present = (!matches!(row.store, Store::Absent)).then_some(&store);
    let cx = context(&clock, present, row.on_error, &metrics);
    let uri: http::Uri = "/?k=k".parse().unwrap();
    let held = (http::Method::GET, http::HeaderMap::new());
    let req = parts(&uri, &held);
    let rt = current_thread();
    let mut got = Vec::new();
    let mut rest = row.expect.len();
    if row.overtaken {
        let (go, parked) = oneshot::channel();
        store.park_next(parked);
        let first = set.evaluate(&req, &cx);
        let second = async {
            let v = set.evaluate(&req, &cx).await;
            let _ = go.send(());
            v
        };
        let (a, b) = rt.block_on(async { tokio::join!(first, second) });
        got.extend([answer(&set, &a), answer(&set, &b)]);
        rest -= 2;
    }
    for _ in 0..rest {
        let v = rt.block_on(set.evaluate(&req, &cx));
        got.push(answer(&set, &v));
    }
    let mut wrong = Vec::new();
    let expected: Vec<String> = row.expect.iter().map(|e| e.text()).collect();
    if got != expected {
        wrong.push(format!("answers {got:?}, expected {expected:?}"));
    }
    let calls = (
        store.decides.load(Ordering::SeqCst),
        store.syncs.load(Ordering::SeqCst),
    );
    if calls != row.calls {
        wrong.push(format!("store calls {calls:?}, expected {:?}", row.calls));
    }
    for &(which, want) in row.left {
        let have = left(&set, &store, which, NOW);
        if have != want {
            wrong.push(format!("{which}: {have} left, expected {want}"));
        }
    }
    for &(who, what, want) in row.counted {
        let have = counted(&set, who, what);
        if have != want {
            wrong.push(format!("{who} {what}: counted {have}, expected {want}"));
        }
    }
    wrong
}

#[test]
fn the_tiers_decide_as_the_table_says() {
    let failures: Vec<String> = rows()
        .iter()
        .flat_map(|row| run(row).into_iter().map(|w| format!("{}: {w}", row.name)))
        .collect();
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// The store's peek is what the admin API shows for a global limit: the state the decisions
/// left, as the last one reported it, charging nothing.
#[test]
fn the_store_peeks_what_decisions_left() {
    let metrics = Metrics::new();
    let clock = ManualClock::new(NOW);
    let set = limit_set(
        &metrics,
        &["{name: glob, key: [query:k], algorithm: gcra, rate: 10/1s}"],
        NOW,
    );
    let store = FakeStore::new(&clock);
    let cx = context(&clock, Some(&store), STRICT, &metrics);
    let uri: http::Uri = "/?k=k".parse().unwrap();
    let held = (http::Method::GET, http::HeaderMap::new());
    let rt = current_thread();
    let mut last = None;
    for _ in 0..3 {
        last = Some(rt.block_on(set.evaluate(&parts(&uri, &held), &cx)));
    }
    let Some(Verdict::Admit {
        info: Some(info), ..
    }) = last
    else {
        panic!("{last:?}");
    };
    let l = &set.limits[0];
    let key = l.redis_key(b"k");
    let g = GlobalLimit {
        algorithm: &l.algorithm,
        key: &key,
        cost: l.cost,
        max_delay: 0,
    };
    let peeked = rt.block_on(store.peek(&g)).unwrap();
    assert_eq!((peeked.remaining, info.remaining), (7, 7));
    assert_eq!(peeked.reset_after, info.reset_after);
    assert_eq!(store.decides.load(Ordering::SeqCst), 3);
}

/// Decides one request for `uri` without a global store (`on_error: allow`): whether it was
/// admitted.
fn admitted_without_store(
    limits: &LimitSet,
    uri: &http::Uri,
    metrics: &Metrics,
    clock: &ManualClock,
    rt: &tokio::runtime::Runtime,
) -> bool {
    let held = (http::Method::GET, http::HeaderMap::new());
    let cx = context::<FakeStore<'_>>(clock, None, OnError::Allow, metrics);
    matches!(
        rt.block_on(limits.evaluate(&parts(uri, &held), &cx)),
        Verdict::Admit { .. }
    )
}

/// An eventual limit beside a strict global one: requests for one key deciding at the same
/// instant on two threads never both pass on its last unit. Every key allows one request; both
/// threads send one request per key, in the same order, so they meet on thousands of last
/// units. No store answers, so the global limit falls back to its local store (`on_error:
/// allow`); with a Redis the window between the eventual limit's first check and its charge
/// is a whole round trip (`tests/eventual.rs` has that variant, the table above an overtaken
/// request).
#[test]
fn an_eventual_limit_beside_a_strict_global_one_admits_each_unit_once() {
    let metrics = Metrics::new();
    let limits = limit_set(
        &metrics,
        &[
            "{name: ev, key: [query:k], algorithm: fixed_window, rate: 1/1d, consistency: eventual}",
            "{name: glob, key: [query:k], algorithm: fixed_window, rate: 1000000/1s}",
        ],
        NOW,
    );
    const KEYS: usize = 20_000;
    let uris: Vec<http::Uri> = (0..KEYS)
        .map(|i| format!("/?k={i}").parse().unwrap())
        .collect();
    let clock = ManualClock::new(NOW);
    let count = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let rt = current_thread();
                for uri in &uris {
                    if admitted_without_store(&limits, uri, &metrics, &clock, &rt) {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    assert_eq!(count.into_inner(), KEYS);
}

/// A reset (the admin API's `DELETE`) makes an exhausted key full again whichever tier held it:
/// a local limit's store, a strict global limit's store and in-process tier, an eventual
/// limit's counts in process and in the store (window counters, or gcra's TAT); and every
/// rejection before it was recorded for `top`.
#[test]
fn a_reset_key_is_full_again_in_every_tier() {
    let cases = [
        ("local", "scope: local, algorithm: fixed_window", None),
        ("strict gcra", "algorithm: gcra", Some(1)),
        ("strict log", "algorithm: sliding_log", Some(1)),
        (
            "eventual window",
            "algorithm: sliding_window, consistency: eventual",
            Some(2),
        ),
        (
            "eventual gcra",
            "algorithm: gcra, consistency: eventual",
            Some(1),
        ),
    ];
    let rt = current_thread();
    for (case, how) in cases.iter().map(|(c, h, d)| (*c, (*h, *d))) {
        let (settings, deleted) = how;
        let metrics = Metrics::new();
        let clock = ManualClock::new(NOW);
        let yaml = format!("{{name: l, key: [query:k], rate: 2/1d, {settings}}}");
        let set = limit_set(&metrics, &[&yaml], NOW);
        let store = FakeStore::new(&clock);
        let cx = context(&clock, Some(&store), STRICT, &metrics);
        let uri: http::Uri = "/?k=k".parse().unwrap();
        let held = (http::Method::GET, http::HeaderMap::new());
        let decide = || answer(&set, &rt.block_on(set.evaluate(&parts(&uri, &held), &cx)));
        let got: Vec<String> = (0..4).map(|_| decide()).collect();
        assert_eq!(got, ["admit", "admit", "429 l", "429 l"], "{case}");
        let l = &set.limits[0];
        let top = l.top.top(10, NOW);
        assert_eq!(top.keys.len(), 1, "{case}");
        assert_eq!((&top.keys[0].key[..], top.keys[0].count), (&b"k"[..], 2));
        // Every key a reset deletes shares the limit's key's hash tag: one Cluster slot.
        let keys = l.reset_keys(b"k", NOW);
        assert!(
            keys.iter().all(|k| redis::hash_tag(k) == Some("r/l/k")),
            "{case}: {keys:?}"
        );
        // A reset published by another instance names the key by its hash tag.
        let heard = l.reset_key_of("r/l/k");
        assert_eq!(heard, deleted.map(|_| &b"k"[..]), "{case}");
        assert_eq!(l.reset_key_of("r/l/"), None);
        assert_eq!(l.reset_key_of("r/other/k"), None);
        let reset = rt.block_on(l.reset(b"k", Some(&store), NOW)).unwrap();
        assert_eq!(reset.redis_deleted, deleted.map(|d| d as u64), "{case}");
        let f = reset.in_process;
        match case {
            "local" => assert!(f.local && !f.deny_tier && !f.eventual),
            c if c.starts_with("strict gcra") => assert!(!f.local && f.deny_tier, "{f:?}"),
            c if c.starts_with("eventual") => assert!(f.eventual, "{f:?}"),
            _ => {}
        }
        let got: Vec<String> = (0..3).map(|_| decide()).collect();
        assert_eq!(got, ["admit", "admit", "429 l"], "{case} after the reset");
    }
}

/// Redis not answering a reset: the error says so and carries what this instance forgot,
/// which it forgot all the same (its fallback store, for `on_error: allow`, is full again).
#[test]
fn a_reset_redis_does_not_confirm_still_forgets_in_process() {
    let metrics = Metrics::new();
    let clock = ManualClock::new(NOW);
    let set = limit_set(
        &metrics,
        &["{name: l, key: [query:k], algorithm: fixed_window, rate: 1/1d}"],
        NOW,
    );
    let store = FakeStore::new(&clock);
    store.fail_with(Some(RedisError::Timeout));
    let cx = context(&clock, Some(&store), LAX, &metrics);
    let uri: http::Uri = "/?k=k".parse().unwrap();
    let held = (http::Method::GET, http::HeaderMap::new());
    let rt = current_thread();
    let decide = || answer(&set, &rt.block_on(set.evaluate(&parts(&uri, &held), &cx)));
    assert_eq!(
        [decide(), decide()],
        ["admit", "429 l"],
        "decided on the fallback"
    );
    let l = &set.limits[0];
    let e = rt.block_on(l.reset(b"k", Some(&store), NOW)).unwrap_err();
    assert_eq!(e.error, RedisError::Timeout);
    assert!(e.in_process.local, "{e:?}");
    assert_eq!(store.resets.load(Ordering::SeqCst), 1);
    assert_eq!(decide(), "admit", "the fallback store forgot the key");
    // No store at all: as Redis down.
    let e = rt
        .block_on(l.reset::<FakeStore<'_>>(b"k", None, NOW))
        .unwrap_err();
    assert_eq!(e.error, RedisError::Unavailable);
}

/// A route with a queueing concurrency limit and a gcra limit: a request refused only for lack
/// of a slot is asked to wait (`Queue`), counted nowhere and charged nothing; without room to
/// wait it is a 429; after a wait its admission counts as `delayed`; refused by the rate limit
/// too, it is a 429 (no use waiting for a slot).
#[test]
fn a_request_refused_only_for_a_slot_is_asked_to_wait_and_charged_nothing() {
    let metrics = Metrics::new();
    let clock = ManualClock::new(NOW);
    let set = limit_set(
        &metrics,
        &[
            "{name: slots, key: [query:k], algorithm: concurrency, max_in_flight: 1, on_limit: delay, max_delay: 1s, scope: local}",
            "{name: rate, key: [query:k], rate: 2/1h, burst: 2, scope: local}",
        ],
        NOW,
    );
    assert_eq!(set.queue, Some(0));
    let store = FakeStore::new(&clock);
    let cx = context(&clock, Some(&store), STRICT, &metrics);
    let uri: http::Uri = "/?k=k".parse().unwrap();
    let req = (http::Method::GET, http::HeaderMap::new());
    let rt = current_thread();
    let decide =
        |cx: &Context<'_, FakeStore<'_>>| rt.block_on(set.evaluate_held(&parts(&uri, &req), cx));
    let (v, first) = decide(&cx);
    assert_eq!(answer(&set, &v), "admit");
    let (v, held) = decide(&cx);
    let Verdict::Queue { limit: 0, hash, .. } = v else {
        panic!("{v:?}")
    };
    assert!(held.is_empty());
    assert_eq!(hash, set.limits[0].store.key_hash(b"k"));
    assert_eq!(
        left(&set, &store, "rate", NOW),
        1,
        "the wait charged nothing"
    );
    assert_eq!(
        (
            counted(&set, "slots", "rejected"),
            counted(&set, "slots", "allowed")
        ),
        (0, 1),
        "a request asked to wait is counted nowhere"
    );
    let no_room = Context {
        allow_delay: false,
        ..cx
    };
    assert_eq!(answer(&set, &decide(&no_room).0), "429 slots");
    assert_eq!(counted(&set, "slots", "rejected"), 1);
    drop(first);
    let waited = Context {
        waited: 5_000,
        ..cx
    };
    let (v, _second) = decide(&waited);
    assert_eq!(answer(&set, &v), "admit");
    let m = &set.limits[0].metrics;
    assert_eq!((m.delayed.get(), m.allowed.get()), (1, 1));
    assert_eq!(left(&set, &store, "rate", NOW), 0);
    // The slot is held and the rate used up: a wait for the slot would be in vain.
    assert_eq!(answer(&set, &decide(&cx).0), "429 rate");
    assert_eq!(counted(&set, "rate", "rejected"), 1);
}
