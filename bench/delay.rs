//! `on_limit: delay`: how close to its slot a waiting request is forwarded, and what a waiting
//! request costs in memory (issue 4).
//!
//! `cargo bench --bench delay` runs the real binary (RUST_LOG=warn) against an upstream on
//! loopback in this process, and prints a report meant to be pasted as it is:
//!
//! 1. **Accuracy.** N requests at once at one gcra limit with `burst: 1` and emission interval T:
//!    the first is forwarded at once, the k-th waits for the slot t_first + k·T. The upstream
//!    stamps every arrival; over the sorted arrivals, lateness_k = arrival_k − (arrival_0 + k·T)
//!    for k = 1..N−1. Run for T = 1 ms (N = 2000) and T = 10 ms (N = 300).
//! 2. **Waiter memory.** The gateway's VmRSS idle, with W requests waiting at once (all decided
//!    `delayed`, checked on /metrics), and after the clients left (all counted abandoned).
//!
//! About 15 s of wall time; the CPU is busy only while the bursts are sent.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::join_all;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

const ROUTE: &str = "paced";
const LIMIT: &str = "gcra";

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(run());
}

async fn run() {
    let up = Upstream::start();
    println!("{}", header());
    println!(
        "accuracy: lateness_k = arrival_k - (arrival_0 + k*T) at the upstream, k = 1..N-1 (ms)"
    );
    for (rate, t, n) in [
        ("1000/1s", Duration::from_millis(1), 2000),
        ("100/1s", Duration::from_millis(10), 300),
    ] {
        let a = accuracy(&up, rate, t, n, 16).await;
        println!("{a}");
    }
    let m = waiter_memory(&up, 10_000, 50).await;
    println!("{m}");
}

// ---------------------------------------------------------------------------------------------
// The two measurements

struct Accuracy {
    rate: &'static str,
    t: Duration,
    n: usize,
    conns: usize,
    ok: usize,
    delayed: f64,
    /// Sorted, in microseconds.
    late_us: Vec<f64>,
}

async fn accuracy(
    up: &Upstream,
    rate: &'static str,
    t: Duration,
    n: usize,
    conns: usize,
) -> Accuracy {
    let g = Gateway::start(&format!("acc{}", t.as_millis()), up.addr, rate, "10s").await;
    let clients: Vec<reqwest::Client> = (0..conns).map(|_| h2_client()).collect();
    // Open every client connection, and the gateway's pooled connections to the upstream, before
    // the burst: the route `warm` has no limit.
    join_all(clients.iter().map(|c| get(c.clone(), g.url("/warm")))).await;
    join_all((0..4).map(|_| get(clients[0].clone(), g.url("/warm")))).await;
    up.take();

    let url = g.url("/paced");
    let tasks: Vec<_> = (0..n)
        .map(|i| tokio::spawn(get(clients[i % conns].clone(), url.clone())))
        .collect();
    let mut ok = 0;
    for t in tasks {
        if t.await.expect("request task") == 200 {
            ok += 1;
        }
    }
    let mut at = up.take();
    at.sort();
    let late_us = match at.first() {
        Some(&a0) => {
            let mut v: Vec<f64> = at
                .iter()
                .enumerate()
                .skip(1)
                .map(|(k, a)| {
                    (a.duration_since(a0).as_secs_f64() - k as f64 * t.as_secs_f64()) * 1e6
                })
                .collect();
            v.sort_by(f64::total_cmp);
            v
        }
        None => Vec::new(),
    };
    let delayed = g.counter("decision", "delayed").await;
    assert_eq!(at.len(), n, "the upstream saw {} of {n} requests", at.len());
    Accuracy {
        rate,
        t,
        n,
        conns,
        ok,
        delayed,
        late_us,
    }
}

impl std::fmt::Display for Accuracy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |p: f64| percentile(&self.late_us, p) / 1000.0;
        write!(
            f,
            "  T={:>2} ms (rate {}, N={}, {} h2 conns): min {:+.3}  p50 {:+.3}  p99 {:+.3}  max {:+.3}  \
             [{} x 200, delayed {}]",
            self.t.as_millis(),
            self.rate,
            self.n,
            self.conns,
            ms(0.0),
            ms(0.50),
            ms(0.99),
            ms(1.0),
            self.ok,
            self.delayed,
        )
    }
}

struct WaiterMemory {
    w: usize,
    conns: usize,
    idle: Mem,
    connected: Mem,
    waiting: Mem,
    after: Mem,
    delayed: f64,
    decided_in: Duration,
    abandoned: f64,
    abandoned_in: Duration,
    forwarded: usize,
}

async fn waiter_memory(up: &Upstream, w: usize, conns: usize) -> WaiterMemory {
    // T = 1 min and max_delay 7 d: all W fit (the last slot is W min ≈ 6.9 d away) and none
    // comes due during the measurement.
    let g = Gateway::start("mem", up.addr, "1/1m", "7d").await;
    let warm = h2_client();
    for _ in 0..4 {
        join_all((0..8).map(|_| get(warm.clone(), g.url("/warm")))).await;
    }
    // Takes the one slot available now, so that every request that follows waits.
    assert_eq!(get(warm.clone(), g.url("/paced")).await, 200);
    drop(warm);
    up.take();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    if let Ok(secs) = std::env::var("TMP_HOLD") {
        eprintln!("HOLD pid {}", g.child.id());
        tokio::time::sleep(Duration::from_secs(secs.parse().unwrap())).await;
    }
    let idle = g.mem();

    let clients: Vec<reqwest::Client> = (0..conns).map(|_| h2_client()).collect();
    join_all(clients.iter().map(|c| get(c.clone(), g.url("/warm")))).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let connected = g.mem();

    // hyper's HTTP/2 server allows 200 concurrent streams per connection by default.
    let per = w / conns;
    assert_eq!(per * conns, w);
    assert!(
        per <= 200,
        "more streams per connection than the server allows"
    );
    let started = Instant::now();
    let tasks: Vec<_> = clients
        .iter()
        .map(|c| {
            let (c, url) = (c.clone(), g.url("/paced"));
            tokio::spawn(
                async move { join_all((0..per).map(|_| get(c.clone(), url.clone()))).await },
            )
        })
        .collect();
    let delayed = g
        .wait_counter("decision", "delayed", w as f64, Duration::from_secs(30))
        .await;
    let decided_in = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let waiting = g.mem();

    // Every client leaves: the streams are reset and the connections closed.
    for t in &tasks {
        t.abort();
    }
    drop(clients);
    for t in tasks {
        let _ = t.await;
    }
    let left = Instant::now();
    let abandoned = g
        .wait_counter("abandoned", "", w as f64, Duration::from_secs(30))
        .await;
    let abandoned_in = left.elapsed();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = g.mem();
    WaiterMemory {
        w,
        conns,
        idle,
        connected,
        waiting,
        after,
        delayed,
        decided_in,
        abandoned,
        abandoned_in,
        forwarded: up.take().len(),
    }
}

impl std::fmt::Display for WaiterMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per = self.w / self.conns;
        writeln!(
            f,
            "waiter memory: W={} waiting (rate 1/1m, max_delay 7d) over {} h2 conns x {per} streams",
            self.w, self.conns
        )?;
        writeln!(f, "  idle after warm-up      {}", self.idle)?;
        writeln!(
            f,
            "  + {} idle h2 conns      {}  = {:.1} KiB/conn",
            self.conns,
            self.connected,
            self.connected.rss_delta(&self.idle) / 1024.0 / self.conns as f64
        )?;
        writeln!(
            f,
            "  + {} waiting         {}  delayed={} (all decided {:.2} s after sending began)",
            self.w,
            self.waiting,
            self.delayed,
            self.decided_in.as_secs_f64()
        )?;
        writeln!(
            f,
            "  per waiter: {:.0} bytes of RSS (h2 stream + request head + hyper's per-stream task \
             with the proxy future + timer entry)",
            self.waiting.rss_delta(&self.connected) / self.w as f64
        )?;
        write!(
            f,
            "  all left: abandoned={} (in {:.2} s), forwarded={}; after  {}",
            self.abandoned,
            self.abandoned_in.as_secs_f64(),
            self.forwarded,
            self.after
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The gateway process

/// The real binary on free loopback ports; killed (and its temp dir removed) on drop, panics
/// included.
struct Gateway {
    child: Child,
    proxy: SocketAddr,
    admin: SocketAddr,
    dir: PathBuf,
    http: reqwest::Client,
}

impl Gateway {
    async fn start(name: &str, upstream: SocketAddr, rate: &str, max_delay: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tollgate-bench-delay-{}-{name}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let (proxy, admin) = free_ports();
        let yaml = format!(
            "server:
  listen: {proxy}
  admin: {admin}
  max_waiters: 100000
routes:
  - name: {ROUTE}
    match:
      path_prefix: /paced
    upstream: http://{upstream}
    limits:
      - name: {LIMIT}
        key: [literal:all]
        algorithm: gcra
        rate: {rate}
        burst: 1
        on_limit: delay
        max_delay: {max_delay}
  - name: warm
    upstream: http://{upstream}
"
        );
        let config = dir.join("routes.yaml");
        std::fs::write(&config, yaml).expect("write routes.yaml");
        let log = std::fs::File::create(dir.join("stderr.log")).expect("stderr.log");
        let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("run")
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn tollgate");
        let mut g = Self {
            child,
            proxy,
            admin,
            dir,
            http: reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("client"),
        };
        g.wait_healthy().await;
        g
    }

    async fn wait_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("tollgate exited at start ({status}):\n{}", self.stderr());
            }
            let url = format!("http://{}/healthz", self.admin);
            if let Ok(r) = self.http.get(url).send().await
                && r.status() == 200
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no /healthz within 10 s:\n{}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proxy)
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default()
    }

    fn mem(&self) -> Mem {
        Mem::of(self.child.id())
    }

    /// `tollgate_limit_decisions_total{..,decision=VALUE}` for kind "decision", or
    /// `tollgate_delayed_abandoned_total` for kind "abandoned"; 0 when absent.
    async fn counter(&self, kind: &str, value: &str) -> f64 {
        let series = match kind {
            "decision" => format!(
                "tollgate_limit_decisions_total{{route=\"{ROUTE}\",limit=\"{LIMIT}\",decision=\"{value}\"}}"
            ),
            _ => format!("tollgate_delayed_abandoned_total{{route=\"{ROUTE}\",limit=\"{LIMIT}\"}}"),
        };
        let url = format!("http://{}/metrics", self.admin);
        let text = match self.http.get(url).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str())?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// Polls the counter until it reaches `target`; panics after `limit`.
    async fn wait_counter(&self, kind: &str, value: &str, target: f64, limit: Duration) -> f64 {
        let deadline = Instant::now() + limit;
        loop {
            let v = self.counter(kind, value).await;
            if v >= target {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{kind} {value} stuck at {v} (want {target})\n{}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let log = self.stderr();
        if !log.trim().is_empty() {
            println!("  tollgate stderr (RUST_LOG=warn):");
            for l in log.lines().take(10) {
                println!("    {l}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Two loopback ports the kernel just handed out (free again once the listeners are dropped).
fn free_ports() -> (SocketAddr, SocketAddr) {
    let a = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let b = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    (a.local_addr().expect("addr"), b.local_addr().expect("addr"))
}

/// VmRSS and VmHWM of a process, and its open sockets.
#[derive(Clone, Copy)]
struct Mem {
    rss_kib: u64,
    hwm_kib: u64,
    sockets: usize,
}

impl Mem {
    fn of(pid: u32) -> Self {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        let sockets = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| {
                d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                    .filter(|p| p.to_string_lossy().starts_with("socket:"))
                    .count()
            })
            .unwrap_or(0);
        Self {
            rss_kib: field("VmRSS:"),
            hwm_kib: field("VmHWM:"),
            sockets,
        }
    }

    /// RSS difference in bytes.
    fn rss_delta(&self, base: &Mem) -> f64 {
        (self.rss_kib as f64 - base.rss_kib as f64) * 1024.0
    }
}

impl std::fmt::Display for Mem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "VmRSS {:>6.1} MiB  VmHWM {:>6.1} MiB  sockets {:>3}",
            self.rss_kib as f64 / 1024.0,
            self.hwm_kib as f64 / 1024.0,
            self.sockets
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Upstream and clients

/// HTTP/1.1 on loopback, answering 200 "ok" at once, stamping each `/paced` request when its
/// head has been read. It runs on its own thread and single-threaded runtime so that the stamps
/// are not queued behind the load generator's tasks.
struct Upstream {
    addr: SocketAddr,
    paced: Arc<Mutex<Vec<Instant>>>,
}

impl Upstream {
    fn start() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("upstream addr");
        let paced = Arc::new(Mutex::new(Vec::with_capacity(16_384)));
        let arrivals = paced.clone();
        std::thread::Builder::new()
            .name("upstream".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("upstream runtime");
                rt.block_on(serve_upstream(listener, arrivals));
            })
            .expect("upstream thread");
        Self { addr, paced }
    }

    /// The stamps so far, clearing them.
    fn take(&self) -> Vec<Instant> {
        std::mem::take(&mut *self.paced.lock().expect("arrivals"))
    }
}

async fn serve_upstream(listener: std::net::TcpListener, arrivals: Arc<Mutex<Vec<Instant>>>) {
    let listener = tokio::net::TcpListener::from_std(listener).expect("upstream listener");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let arrivals = arrivals.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let at = Instant::now();
                if req.uri().path().starts_with("/paced") {
                    arrivals.lock().expect("arrivals").push(at);
                }
                async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok")))) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// One client = one HTTP/2 (prior knowledge) connection, multiplexing every request sent on it.
fn h2_client() -> reqwest::Client {
    reqwest::Client::builder()
        .http2_prior_knowledge()
        .no_proxy()
        .build()
        .expect("h2 client")
}

/// The status, 0 on a transport error; the body is read to the end.
async fn get(c: reqwest::Client, url: String) -> u16 {
    match c.get(url).send().await {
        Ok(r) => {
            let s = r.status().as_u16();
            let _ = r.bytes().await;
            s
        }
        Err(_) => 0,
    }
}

// ---------------------------------------------------------------------------------------------
// Report helpers

/// Nearest-rank percentile of sorted values (p in 0..=1); NaN when empty.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn header() -> String {
    let sh = |cmd: &str, args: &[&str]| {
        Command::new(cmd)
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_else(|| "?".into())
    };
    let commit = sh("git", &["rev-parse", "--short", "HEAD"]);
    let dirty = if sh("git", &["status", "--porcelain"]).is_empty() {
        ""
    } else {
        " (+ uncommitted changes)"
    };
    let date = sh("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    format!(
        "$ cargo bench --bench delay\ntollgate {commit}{dirty}, {date}, {cpus} CPUs, loadavg {load}"
    )
}
