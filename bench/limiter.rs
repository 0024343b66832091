//! Limiter latency floor: one decision (check, then commit when admitted) on one hot key,
//! per algorithm, with no store or lock around it. Run with `cargo bench --bench limiter`.

use std::hint::black_box;
use std::net::IpAddr;

use criterion::{Criterion, criterion_group, criterion_main};
use tollgate::key::{IP_TEXT_MAX, ip_text};
use tollgate::limit::algorithm::calendar::Unit;
use tollgate::limit::algorithm::{
    Algorithm, Calendar, FixedWindow, Gcra, Micros, Quota, SlidingLog, SlidingWindow, State,
};
use tollgate::limit::local::{self, LocalCheck, LocalStore};

/// The gateway's allocator, so the store's tables are placed as in production.
#[global_allocator]
static ALLOC: tollgate::alloc::HugePages = tollgate::alloc::HugePages;

/// 100 per second.
const QUOTA: Quota = Quota {
    count: 100,
    period: 1_000_000,
    burst: 100,
};

/// Requests at twice the rate: about half admit and half reject, so both paths are measured,
/// and the sliding log stays at its full 100 entries, its worst case.
const STEP: Micros = 5_000;

/// One request as the limiter makes it; returns something of the outcome so nothing is
/// optimised away.
fn decide(alg: &Algorithm, state: &mut State, now: Micros) -> u64 {
    match alg.check(state, now, 1) {
        Ok(snapshot) => {
            alg.commit(state, now, 1);
            snapshot.remaining
        }
        Err(rejection) => rejection.retry_after,
    }
}

fn algorithm(c: &mut Criterion) {
    let mut group = c.benchmark_group("algorithm");
    for (id, alg) in [
        ("gcra", Algorithm::Gcra(Gcra::new(QUOTA))),
        (
            "fixed_window",
            Algorithm::FixedWindow(FixedWindow::new(QUOTA)),
        ),
        (
            "sliding_window",
            Algorithm::SlidingWindow(SlidingWindow::new(QUOTA)),
        ),
        ("sliding_log", Algorithm::SlidingLog(SlidingLog::new(QUOTA))),
        (
            "fixed_window_calendar",
            Algorithm::FixedWindow(FixedWindow::calendar(
                QUOTA,
                Calendar::new(
                    Unit::Day,
                    jiff::tz::TimeZone::get("Europe/Berlin").expect("zone"),
                ),
            )),
        ),
    ] {
        group.bench_function(id, |b| {
            let mut state = alg.new_state();
            let mut now: Micros = 0;
            b.iter(|| {
                now += STEP;
                decide(&alg, &mut state, black_box(now))
            });
        });
    }
    group.finish();
}

/// Key `i` as the gateway builds an `ip` key (the address "10.a.b.c", written by the gateway's
/// own `ip_text` into a stack buffer): the key bytes are hot in cache, as they are for a request,
/// so the figure is the store's own cost (a table of a million pre-built keys would add a cache
/// miss of the benchmark's own to every decision).
fn decide_ip(store: &LocalStore, alg: &Algorithm, i: usize, now: Micros) -> bool {
    let mut buf = [0; IP_TEXT_MAX];
    let ip = IpAddr::from([10, (i >> 16) as u8, (i >> 8) as u8, i as u8]);
    let check = [LocalCheck {
        store,
        algorithm: alg,
        key: ip_text(ip, &mut buf),
        cost: 1,
        max_delay: 0,
        shadow: false,
    }];
    local::decide(black_box(&check), now).0
}

/// A local decision through the store (hash, shard lock, lookup, check, commit), as the request
/// path makes it, with 1 to 1M distinct active keys. Keys are visited in a scrambled order so
/// the larger sets really miss the cache. The goal: under 200 ns and flat across key counts.
fn store(c: &mut Criterion) {
    let mut group = c.benchmark_group("store");
    let alg = Algorithm::Gcra(Gcra::new(Quota {
        count: 1_000_000,
        period: 1_000_000,
        burst: 1_000_000,
    }));
    for n in [1usize, 1_000, 1_000_000] {
        let store = LocalStore::new();
        // Fill the store first, so the measurement is of lookups in a store of n keys.
        for i in 0..n {
            decide_ip(&store, &alg, i, 1);
        }
        let mut i = 0usize;
        let mut now: Micros = 1;
        group.bench_function(format!("gcra_keys_{n}"), |b| {
            b.iter(|| {
                // A full-period walk with a large stride: every key equally often, no locality
                // (the worst case: each decision a cache and TLB miss once n outgrows the caches).
                i = (i + 7_919) % n;
                now += 1;
                black_box(decide_ip(&store, &alg, i, now))
            });
        });
        if n == 1_000_000 {
            // Skewed like real traffic: 90 % of decisions go to 1 % of the keys.
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
            group.bench_function("gcra_keys_1000000_skewed", |b| {
                b.iter(|| {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    let r = (x >> 33) as usize;
                    let k = if r % 10 < 9 { r % (n / 100) } else { r % n };
                    now += 1;
                    black_box(decide_ip(&store, &alg, k, now))
                });
            });
        }
    }
    group.finish();
}

/// The floor under `store/gcra_keys_1000000`: one dependent read of a random cache line in
/// 128 MB (the size of a million keys' tables), allocated as those tables are. A decision on a
/// key the caches do not hold cannot cost less than this on the machine at hand.
///
/// The smaller regions show where the caches this process really gets end (a VM's share of an
/// L3 can be far below what `lscpu` reports), and `_written` dirties each line it reads, as a
/// decision does, so evicting it costs a write-back: together they say whether any layout of a
/// million keys could stay in cache, and what a decision that misses must at least pay.
fn memory(c: &mut Criterion) {
    for (mb, write) in [
        (4, false),
        (8, false),
        (16, false),
        (128, false),
        (128, true),
    ] {
        let name = format!(
            "memory/random_line_{mb}MB{}",
            if write { "_written" } else { "" }
        );
        memory_floor(c, &name, (mb << 20) / 64, write);
    }
}

fn memory_floor(c: &mut Criterion, name: &str, count: usize, write: bool) {
    #[repr(align(64))]
    #[derive(Clone, Copy)]
    struct Line([usize; 8]);
    let mut lines = vec![Line([0; 8]); count];
    // One cycle through every line in a scrambled order (a full-period LCG over the indices),
    // so each read depends on the last and no prefetcher can guess the next.
    let mut order: Vec<usize> = (0..count).collect();
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    for i in (1..count).rev() {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        order.swap(i, (x >> 33) as usize % (i + 1));
    }
    for w in 0..count {
        lines[order[w]].0[0] = order[(w + 1) % count];
    }
    drop(order);
    let mut at = 0usize;
    c.bench_function(name, |b| {
        b.iter(|| {
            let line = &mut lines[at].0;
            if write {
                line[1] = line[1].wrapping_add(1);
            }
            at = line[0];
            black_box(at)
        })
    });
}

/// Two threads deciding on the same store at once: distinct keys (the common case: shards
/// rarely collide) and one hot key (every decision takes the same shard lock).
fn contention(c: &mut Criterion) {
    let mut group = c.benchmark_group("store_contention");
    let alg = Algorithm::Gcra(Gcra::new(Quota {
        count: 1_000_000,
        period: 1_000_000,
        burst: 1_000_000,
    }));
    for (id, hot) in [
        ("two_threads_distinct_keys", false),
        ("two_threads_one_key", true),
    ] {
        group.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let store = LocalStore::new();
                let start = std::time::Instant::now();
                std::thread::scope(|s| {
                    for t in 0..2u64 {
                        let (store, alg) = (&store, &alg);
                        s.spawn(move || {
                            for n in 0..iters {
                                let k = if hot { 0 } else { (n % 4096) * 2 + t };
                                let key = k.to_le_bytes();
                                let check = [LocalCheck {
                                    store,
                                    algorithm: alg,
                                    key: &key,
                                    cost: 1,
                                    max_delay: 0,
                                    shadow: false,
                                }];
                                black_box(local::decide(&check, n + 1).0);
                            }
                        });
                    }
                });
                // Per decision, with two running at once.
                start.elapsed() / 2
            });
        });
    }
    group.finish();
}

criterion_group!(benches, algorithm, store, memory, contention);
criterion_main!(benches);
