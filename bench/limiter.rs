//! Limiter latency floor: one decision (check, then commit when admitted) on one hot key,
//! per algorithm, with no store or lock around it. Run with `cargo bench --bench limiter`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use tollgate::limit::algorithm::{
    Algorithm, FixedWindow, Gcra, Micros, Quota, SlidingLog, SlidingWindow, State,
};

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

criterion_group!(
    benches, algorithm,
    // store benches are added below by the store module
);
criterion_main!(benches);
