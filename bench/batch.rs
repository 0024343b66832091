//! Coalescing and batching of strict global decisions (issue 20): what a queued decision waits,
//! how many Redis calls a burst costs, and Redis's CPU per decision, with batching on
//! (`batch_max: 64`) and off (`batch_max: 1`), straight through `RedisStore` (no HTTP).
//!
//! `cargo bench --bench batch` starts a redis-server (`--save '' --appendonly no`, pinned to
//! core 0 with taskset when there is one) and, from this process (a 1-thread Tokio runtime,
//! pinned to core 1), for each setting:
//!
//! 1. **Lone decisions.** 2000 decisions one after another (each waits for the one before),
//!    each on its own key: the time of one call (round trip + script), p50 and p99. Every one
//!    must be its own call and none may queue.
//! 2. **Concurrency C = 8 and 64, hot and cold.** C tasks each deciding as fast as answers
//!    come for 3 s, all on one key (hot; gcra 10⁹/s, burst 10⁹: every decision admitted) or
//!    each on a key never used before (cold). Reported: decisions/s, Redis calls per decision
//!    (INFO commandstats), redis-server CPU per decision (utime + stime from procfs, so socket
//!    work included), and each decision's latency p50 / p99 next to the lone call's: a queued
//!    decision waits for the call in flight, then for its own.
//!
//! Figures are wall-clock on a shared 2-core machine: they move with its load; the
//! instruction counts of `CALLGRIND=1 BATCH=1 bench/script.sh` do not. About 40 s.
//! `cargo test --all-targets` runs it without `--bench`: a smoke run of a few hundred
//! decisions per row, whose figures mean nothing, checking that it still works.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate::limit::algorithm::{Algorithm, Gcra, Quota};
use tollgate::limit::redis::{GlobalLimit, RedisSettings, RedisStore, RedisTarget};

struct Redis {
    child: Child,
    port: u16,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn has(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn start_redis() -> Redis {
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("tollgate-bench-batch-{port}"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let args = [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        &dir.display().to_string(),
    ]
    .map(String::from);
    let mut cmd = if has("taskset") {
        let mut c = Command::new("taskset");
        c.args(["-c", "0", "redis-server"]);
        c
    } else {
        Command::new("redis-server")
    };
    let child = cmd
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server (apt-get install redis-server)");
    let redis = Redis { child, port };
    let deadline = Instant::now() + Duration::from_secs(10);
    while cli(port, &["ping"]) != "PONG" {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    redis
}

fn cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// FCALL calls so far (failed ones excluded).
fn fcalls(port: u16) -> u64 {
    let stats = cli(port, &["info", "commandstats"]);
    let line = stats
        .lines()
        .find(|l| l.starts_with("cmdstat_fcall:"))
        .unwrap_or("");
    let field = |name: &str| -> u64 {
        line.split([':', ','])
            .find_map(|kv| kv.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or(0)
    };
    field("calls=") - field("failed_calls=")
}

/// utime + stime of `pid`, in seconds.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn gcra() -> Algorithm {
    Algorithm::Gcra(Gcra::new(Quota {
        count: 1_000_000_000,
        period: 1_000_000,
        burst: 1_000_000_000,
    }))
}

async fn decide(store: &RedisStore, alg: &Algorithm, key: &str) -> Duration {
    let limit = GlobalLimit {
        algorithm: alg,
        key,
        cost: 1,
        max_delay: 0,
    };
    let t = Instant::now();
    let d = store.decide(&[limit], None).await.expect("decide");
    assert!(d.admitted, "every decision admits");
    t.elapsed()
}

struct Run {
    rate: f64,
    calls_per_decision: f64,
    redis_us: f64,
    p50: f64,
    p99: f64,
}

async fn concurrent(store: &RedisStore, redis: &Redis, c: usize, hot: bool, run: Duration) -> Run {
    static COLD: AtomicU64 = AtomicU64::new(0);
    let stop = Arc::new(AtomicBool::new(false));
    let calls0 = fcalls(redis.port);
    let cpu0 = cpu_secs(redis.child.id());
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..c {
        let (store, stop) = (store.clone(), stop.clone());
        tasks.spawn(async move {
            let alg = gcra();
            let mut lat = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let key = if hot {
                    "tg:{bench/hot}".to_string()
                } else {
                    format!("tg:{{bench/cold/{}}}", COLD.fetch_add(1, Ordering::Relaxed))
                };
                lat.push(decide(&store, &alg, &key).await);
            }
            lat
        });
    }
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    let mut lat: Vec<Duration> = tasks.join_all().await.into_iter().flatten().collect();
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_secs(redis.child.id()) - cpu0;
    let calls = fcalls(redis.port) - calls0;
    lat.sort();
    let n = lat.len() as f64;
    Run {
        rate: n / elapsed,
        calls_per_decision: calls as f64 / n,
        redis_us: cpu / n * 1e6,
        p50: pct(&lat, 0.5),
        p99: pct(&lat, 0.99),
    }
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let (run, lone_n) = if bench {
        (Duration::from_secs(3), 2000)
    } else {
        (Duration::from_millis(200), 50)
    };
    if has("taskset") {
        // This process (and the runtime's one worker) on core 1, Redis alone on core 0.
        let _ = Command::new("taskset")
            .args(["-pc", "1", &std::process::id().to_string()])
            .stdout(Stdio::null())
            .status();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "bench/batch.rs: strict global decisions through RedisStore, redis-server on core 0, this process on core 1"
    );
    println!(
        "{:<10} {:<6} {:>4} {:>12} {:>11} {:>14} {:>9} {:>9}",
        "batch_max", "keys", "C", "decisions/s", "calls/dec", "redis us/dec", "p50 us", "p99 us"
    );
    for batch_max in [64usize, 1] {
        let redis = start_redis();
        rt.block_on(async {
            let mut settings = RedisSettings::new(RedisTarget::Single(format!(
                "redis://127.0.0.1:{}",
                redis.port
            )));
            settings.timeout = Duration::from_secs(1);
            settings.batch_max = batch_max;
            let store = RedisStore::connect(settings).expect("connect");
            store.ping().await.expect("redis up");
            let alg = gcra();
            // Warm: the library loaded, connections up.
            for i in 0..200 {
                decide(&store, &alg, &format!("tg:{{bench/warm/{i}}}")).await;
            }
            let before = store.batch_stats();
            let mut lone = Vec::new();
            for i in 0..lone_n {
                lone.push(decide(&store, &alg, &format!("tg:{{bench/lone/{i}}}")).await);
            }
            let after = store.batch_stats();
            if batch_max > 1 {
                assert_eq!(
                    after.calls - before.calls,
                    lone_n,
                    "each lone decision its own call"
                );
                assert_eq!(after.queued, before.queued, "no lone decision queued");
            }
            lone.sort();
            println!(
                "{:<10} {:<6} {:>4} {:>12} {:>11} {:>14} {:>9.0} {:>9.0}",
                batch_max,
                "lone",
                1,
                "-",
                "1.000",
                "-",
                pct(&lone, 0.5),
                pct(&lone, 0.99)
            );
            for hot in [true, false] {
                for c in [8, 64] {
                    let r = concurrent(&store, &redis, c, hot, run).await;
                    println!(
                        "{:<10} {:<6} {:>4} {:>12.0} {:>11.3} {:>14.2} {:>9.0} {:>9.0}",
                        batch_max,
                        if hot { "hot" } else { "cold" },
                        c,
                        r.rate,
                        r.calls_per_decision,
                        r.redis_us,
                        r.p50,
                        r.p99
                    );
                }
            }
            store.shutdown().await;
        });
    }
}
