//! `on_limit: delay`: how close to its slot a waiting request is forwarded, and what a waiting
//! request costs in memory (issue 4).
//!
//! `cargo bench --bench delay` runs the real binary (RUST_LOG=warn) against an HTTP/1.1 upstream
//! on loopback in this process, and prints a report meant to be pasted as it is:
//!
//! 1. **Accuracy.** One gcra limit with `burst: 1` and emission interval T. Request 0 is
//!    admitted at once; N more, sent over 16 HTTP/2 connections right behind it, take slots 1..N
//!    at t_0 + k·T. The upstream stamps every arrival; over the sorted arrivals,
//!    lateness_k = arrival_k − (arrival_0 + k·T). Reported over 3 runs for all slots and for the
//!    slots due ≥ 100 ms after slot 0 (past the burst's intake), for T = 1 ms (N = 2000) and
//!    T = 10 ms (N = 300). A run where more than one request was admitted at once (the schedule
//!    restarted) is flagged and left out.
//! 2. **Waiter memory.** The gateway's VmRSS idle, with W = 10 000 requests waiting (all decided
//!    `delayed`, checked on /metrics), after every client left (all counted abandoned), and the
//!    same again, which shows whether the memory is reused or leaked.
//!
//! CPU use by other processes is measured and printed, since it moves the tail. About 30 s.

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
    // `cargo test --all-targets` runs bench targets without `--bench`: a measurement of timer
    // accuracy in a debug build on a busy CI machine would mean nothing, so only `cargo bench`
    // measures (the build itself is still checked by the test run).
    if !std::env::args().any(|a| a == "--bench") {
        println!("delay bench: measures only under `cargo bench --bench delay`");
        return;
    }
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
        "accuracy: lateness_k = arrival_k - (arrival_0 + k*T) at the upstream, k = 1..N \
         (request 0, then N right behind it)"
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

/// Independent runs per T: the timer's 1 ms tick has a random phase against each run's
/// schedule, and that phase is most of a run's lateness, so one run is one sample of it.
const RUNS: usize = 3;

/// Slots due this long after slot 0 are past the burst's intake.
const SETTLED: Duration = Duration::from_millis(100);

struct Accuracy {
    rate: &'static str,
    t: Duration,
    n: usize,
    conns: usize,
    runs: Vec<Run>,
}

struct Run {
    ok: usize,
    allowed: f64,
    delayed: f64,
    busy_before: f64,
    others: f64,
    /// lateness_k in microseconds, k = 1..=N in slot order.
    late_us: Vec<f64>,
}

impl Run {
    /// One chain of slots: exactly one request admitted at once.
    fn sound(&self) -> bool {
        self.allowed == 1.0
    }
}

async fn accuracy(
    up: &Upstream,
    rate: &'static str,
    t: Duration,
    n: usize,
    conns: usize,
) -> Accuracy {
    let mut runs = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        runs.push(accuracy_run(up, rate, t, n, conns).await);
    }
    Accuracy {
        rate,
        t,
        n,
        conns,
        runs,
    }
}

/// A fresh gateway, request 0 and N more; lateness of slots 1..N.
async fn accuracy_run(
    up: &Upstream,
    rate: &'static str,
    t: Duration,
    n: usize,
    conns: usize,
) -> Run {
    let g = Gateway::start(&format!("acc{}", t.as_millis()), up.addr, rate, "10s").await;
    let clients: Vec<reqwest::Client> = (0..conns).map(|_| h2_client()).collect();
    // Open every client connection, and the gateway's pooled connections to the upstream, before
    // the burst: the route `warm` has no limit.
    join_all(clients.iter().map(|c| get(c.clone(), g.url("/warm")))).await;
    let busy_before = wait_quiet(Duration::from_secs(3)).await;
    up.take();

    // Sending 2000 requests costs the client tens of milliseconds of CPU on the same cores as
    // the gateway. Were they all released at once, the first of them could reach the gateway
    // later than T after the request before it, which restarts the schedule (the gateway is
    // right to admit it at once). So a head goes first: request 0 and one request per
    // connection, a few hundred microseconds of work for both sides, which reserves the next
    // `conns` slots; the rest follow 2 ms later, well before those slots have passed. Request 0
    // is thus forwarded while the gateway takes in only the head, not the whole burst.
    let url = g.url("/paced");
    let mut burst: Vec<_> = (0..=n)
        .map(|i| get(clients[i % conns].clone(), url.clone()))
        .collect();
    let tail = burst.split_off(conns + 1);
    let cpu = Cpu::start(g.child.id());
    let head = tokio::spawn(join_all(burst));
    tokio::time::sleep(Duration::from_millis(2)).await;
    let statuses = join_all(tail).await;
    let ok = head
        .await
        .expect("head")
        .into_iter()
        .chain(statuses)
        .filter(|s| *s == 200)
        .count();
    let others = cpu.others();
    let mut at = up.take();
    assert_eq!(
        at.len(),
        n + 1,
        "the upstream saw {} of {} requests",
        at.len(),
        n + 1
    );
    at.sort();
    let a0 = at[0];
    let late_us = at
        .iter()
        .enumerate()
        .skip(1)
        .map(|(k, a)| (a.duration_since(a0).as_secs_f64() - k as f64 * t.as_secs_f64()) * 1e6)
        .collect();
    Run {
        ok,
        allowed: g.counter("decision", "allowed").await,
        delayed: g.counter("decision", "delayed").await,
        busy_before,
        others,
        late_us,
    }
}

/// min, p50, p99, max of a sample, in ms.
fn summary(us: &[f64]) -> String {
    let mut v = us.to_vec();
    v.sort_by(f64::total_cmp);
    let ms = |p: f64| percentile(&v, p) / 1000.0;
    format!(
        "min {:+.3}  p50 {:+.3}  p99 {:+.3}  max {:+.3} ms",
        ms(0.0),
        ms(0.5),
        ms(0.99),
        ms(1.0)
    )
}

impl std::fmt::Display for Accuracy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Slot k is due k·T after slot 0; late_us[i] is slot i + 1.
        let skip = (SETTLED.as_nanos() / self.t.as_nanos()) as usize;
        let sound: Vec<&Run> = self.runs.iter().filter(|r| r.sound()).collect();
        let all: Vec<f64> = sound
            .iter()
            .flat_map(|r| r.late_us.iter().copied())
            .collect();
        let settled: Vec<f64> = sound
            .iter()
            .flat_map(|r| r.late_us.iter().skip(skip).copied())
            .collect();
        let p50s: Vec<String> = self
            .runs
            .iter()
            .map(|r| {
                let mut v = r.late_us.clone();
                v.sort_by(f64::total_cmp);
                format!("{:+.3}", percentile(&v, 0.5) / 1000.0)
            })
            .collect();
        writeln!(
            f,
            "  T={:>2} ms, rate {}, {} runs x (1 + {}) requests, {} h2 conns; p50 per run: {} ms",
            self.t.as_millis(),
            self.rate,
            self.runs.len(),
            self.n,
            self.conns,
            p50s.join(" "),
        )?;
        writeln!(f, "    all {:>5} slots:     {}", all.len(), summary(&all))?;
        writeln!(
            f,
            "    {:>5} due >= {} ms: {}",
            settled.len(),
            SETTLED.as_millis(),
            summary(&settled)
        )?;
        let max = |g: fn(&Run) -> f64| self.runs.iter().map(g).fold(0.0, f64::max);
        let each = |g: fn(&Run) -> f64| {
            let v: Vec<String> = self.runs.iter().map(|r| g(r).to_string()).collect();
            v.join("/")
        };
        write!(
            f,
            "    {}/{} got 200; per run {} admitted at once, {} delayed; CPUs <= {:.0}% busy \
             before, other processes <= {:.0}% of the CPUs during a run",
            self.runs.iter().map(|r| r.ok).sum::<usize>(),
            self.runs.len() * (self.n + 1),
            each(|r| r.allowed),
            each(|r| r.delayed),
            max(|r| r.busy_before),
            max(|r| r.others),
        )?;
        let unsound = self.runs.len() - sound.len();
        if unsound > 0 {
            write!(
                f,
                "\n    ! {unsound} run(s) left out: more than one request admitted at once, so the \
                 schedule restarted (the burst reached the gateway more than T after the request \
                 before it) and lateness from arrival_0 is not delay accuracy"
            )?;
        }
        Ok(())
    }
}

struct Round {
    connected: Mem,
    waiting: Mem,
    after: Mem,
    delayed: f64,
    decided_in: Duration,
    abandoned: f64,
    abandoned_in: Duration,
}

struct WaiterMemory {
    w: usize,
    conns: usize,
    idle: Mem,
    first: Round,
    second: Round,
    forwarded: usize,
}

async fn waiter_memory(up: &Upstream, w: usize, conns: usize) -> WaiterMemory {
    // T = 1 min and max_delay 30 d: both rounds fit (the last slot is 2·W min ≈ 13.9 d away;
    // abandoned slots stay reserved) and no slot comes due during the measurement.
    let g = Gateway::start("mem", up.addr, "1/1m", "30d").await;
    let warm = h2_client();
    for _ in 0..4 {
        join_all((0..8).map(|_| get(warm.clone(), g.url("/warm")))).await;
    }
    // Takes the one slot available now, so that every request that follows waits.
    assert_eq!(get(warm.clone(), g.url("/paced")).await, 200);
    drop(warm);
    up.take();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let idle = g.mem();
    let first = waiter_round(&g, w, conns, 1).await;
    let second = waiter_round(&g, w, conns, 2).await;
    WaiterMemory {
        w,
        conns,
        idle,
        first,
        second,
        forwarded: up.take().len(),
    }
}

/// `conns` new HTTP/2 connections, W requests waiting over them, then every client leaves.
async fn waiter_round(g: &Gateway, w: usize, conns: usize, nth: usize) -> Round {
    let clients: Vec<reqwest::Client> = (0..conns).map(|_| h2_client()).collect();
    // One at a time, so that the gateway needs a single pooled connection to the upstream.
    for c in &clients {
        assert_eq!(get(c.clone(), g.url("/warm")).await, 200);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let connected = g.mem();

    // hyper's HTTP/2 server allows 200 concurrent streams per connection by default.
    let per = w / conns;
    assert!(per * conns == w && per <= 200, "W must be conns × (≤ 200)");
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
    let want = (w * nth) as f64;
    let delayed = g
        .wait_counter("decision", "delayed", want, Duration::from_secs(20))
        .await;
    let decided_in = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let waiting = g.mem();

    // Every client leaves: its streams are reset and its connection closed.
    for t in &tasks {
        t.abort();
    }
    drop(clients);
    for t in tasks {
        let _ = t.await;
    }
    let left = Instant::now();
    let abandoned = g
        .wait_counter("abandoned", "", want, Duration::from_secs(20))
        .await;
    let abandoned_in = left.elapsed();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    Round {
        connected,
        waiting,
        after: g.mem(),
        delayed,
        decided_in,
        abandoned,
        abandoned_in,
    }
}

impl std::fmt::Display for WaiterMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (w, conns) = (self.w, self.conns);
        let (a, b) = (&self.first, &self.second);
        let mib = |bytes: f64| bytes / (1024.0 * 1024.0);
        writeln!(
            f,
            "waiter memory: W={w} waiting (rate 1/1m, max_delay 30d), {conns} h2 conns x {} streams; \
             gateway's /proc/PID/status",
            w / conns
        )?;
        writeln!(f, "  idle after warm-up       {}", self.idle)?;
        writeln!(
            f,
            "  {:<25}{}  +{:.1} KiB per idle conn",
            format!("{conns} h2 conns open"),
            a.connected,
            a.connected.rss_delta(&self.idle) / 1024.0 / conns as f64
        )?;
        writeln!(
            f,
            "  W waiting                {}  delayed={} (all decided {:.2} s after sending began)",
            a.waiting,
            a.delayed,
            a.decided_in.as_secs_f64()
        )?;
        writeln!(
            f,
            "    => {:.0} bytes of RSS per waiter (h2 stream state, request head, and hyper's task for \
             the stream, which holds the whole request future; the timer is inside that future)",
            a.waiting.rss_delta(&a.connected) / w as f64
        )?;
        writeln!(
            f,
            "  all left                 {}  abandoned={} ({:.2} s after the clients closed)",
            a.after,
            a.abandoned,
            a.abandoned_in.as_secs_f64()
        )?;
        writeln!(
            f,
            "  round 2: W waiting       {}  delayed={} total; {:+.1} MiB vs round 1 waiting",
            b.waiting,
            b.delayed,
            mib(b.waiting.rss_delta(&a.waiting))
        )?;
        write!(
            f,
            "  round 2: all left        {}  abandoned={} total; forwarded to the upstream: {}",
            b.after, b.abandoned, self.forwarded
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

/// Busy and total jiffies of all CPUs, from /proc/stat.
fn cpu_jiffies() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.len() < 8 {
        return (0, 0);
    }
    // user nice system idle iowait irq softirq steal
    let idle = v[3] + v[4];
    let total: u64 = v.iter().sum();
    (total - idle, total)
}

/// utime + stime of a process, in jiffies.
fn proc_jiffies(pid: &str) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after_comm = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after_comm.split_whitespace().collect();
    // Fields 14 and 15 of stat(5); `f` starts at field 3.
    let get = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    get(11) + get(12)
}

/// Waits (at most `limit`) until the CPUs are under 20 % busy over half a second, so that the
/// timing runs are not made while someone compiles; returns the last busy percentage seen.
async fn wait_quiet(limit: Duration) -> f64 {
    let deadline = Instant::now() + limit;
    loop {
        let (b0, t0) = cpu_jiffies();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (b1, t1) = cpu_jiffies();
        let busy = 100.0 * (b1 - b0) as f64 / (t1 - t0).max(1) as f64;
        if busy < 20.0 || Instant::now() >= deadline {
            return busy;
        }
    }
}

/// CPU used by processes other than this one and the gateway, between `start` and `others`.
struct Cpu {
    gateway: String,
    all: (u64, u64),
    ours: u64,
}

impl Cpu {
    fn start(gateway_pid: u32) -> Self {
        let gateway = gateway_pid.to_string();
        let ours = proc_jiffies("self") + proc_jiffies(&gateway);
        Self {
            all: cpu_jiffies(),
            ours,
            gateway,
        }
    }

    /// Percentage of all CPUs' time.
    fn others(&self) -> f64 {
        let (b, t) = cpu_jiffies();
        let ours = (proc_jiffies("self") + proc_jiffies(&self.gateway)).saturating_sub(self.ours);
        let busy = (b - self.all.0).saturating_sub(ours);
        100.0 * busy as f64 / (t - self.all.1).max(1) as f64
    }
}

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
