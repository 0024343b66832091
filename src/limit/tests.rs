//! Orchestration tests of [`LimitSet::evaluate`]: a route's limits compiled from YAML, decided
//! on a [`ManualClock`].

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::limit::clock::{Clock, ManualClock};

/// A route `r` whose limits are `limits`, each a YAML flow mapping (`{name: a, key: [..], ..}`);
/// `redis` is configured (never reached) so that global limits load.
fn limit_set(metrics: &Metrics, limits: &[&str]) -> LimitSet {
    let mut yaml = String::from(
        "redis:\n  url: redis://127.0.0.1:1\nroutes:\n  - name: r\n    upstream: http://a:1\n    limits:\n",
    );
    for l in limits {
        yaml.push_str("      - ");
        yaml.push_str(l);
        yaml.push('\n');
    }
    let config = crate::config::parse_str(std::path::Path::new("t.yaml"), &yaml).unwrap();
    let limits = config.routes[0]
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
    LimitSet::new(limits, TierMetrics::new(metrics), false)
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Decides one request for `uri` without Redis (`on_error: allow`): whether it was admitted.
fn admitted_without_redis(
    limits: &LimitSet,
    uri: &http::Uri,
    metrics: &Metrics,
    clock: &ManualClock,
    rt: &tokio::runtime::Runtime,
) -> bool {
    let (method, headers) = (http::Method::GET, http::HeaderMap::new());
    let cx = Context {
        now: clock.now(),
        started: std::time::Instant::now(),
        clock,
        probe_wait: Duration::from_millis(50),
        redis: None,
        on_error: OnError::Allow,
        allow_delay: true,
        metrics,
    };
    let parts = RequestParts {
        method: &method,
        uri,
        headers: &headers,
        client_ip: [127, 0, 0, 1].into(),
        client_ip_text: None,
        route: "r",
    };
    matches!(
        rt.block_on(limits.evaluate(&parts, &cx)),
        Verdict::Admit { .. }
    )
}

/// An eventual limit beside a strict global one: requests for one key deciding at the same
/// instant on two threads never both pass on its last unit. Every key allows one request; both
/// threads send one request per key, in the same order, so they meet on thousands of last
/// units. No Redis answers, so the global limit falls back to its local store (`on_error:
/// allow`); with a Redis the window between the eventual limit's check and its charge is a
/// whole round trip (`tests/eventual.rs` has that variant).
#[test]
fn an_eventual_limit_beside_a_strict_global_one_admits_each_unit_once() {
    let metrics = Metrics::new();
    let limits = limit_set(
        &metrics,
        &[
            "{name: ev, key: [query:k], algorithm: fixed_window, rate: 1/1d, consistency: eventual}",
            "{name: glob, key: [query:k], algorithm: fixed_window, rate: 1000000/1s}",
        ],
    );
    const KEYS: usize = 20_000;
    let uris: Vec<http::Uri> = (0..KEYS)
        .map(|i| format!("/?k={i}").parse().unwrap())
        .collect();
    let clock = ManualClock::new(1_000_000);
    let count = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let rt = current_thread();
                for uri in &uris {
                    if admitted_without_redis(&limits, uri, &metrics, &clock, &rt) {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    assert_eq!(count.into_inner(), KEYS);
}
