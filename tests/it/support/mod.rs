//! Test support: real upstream HTTP servers on loopback and the gateway in process on port 0.
#![allow(dead_code)]

pub mod process;
pub mod redis;
pub mod tls;
pub mod upstream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::oneshot;
use tollgate::app::{App, Options, Shared};
use tollgate::limit::clock::{ManualClock, SharedClock, TokioClock};

/// A running gateway; stops (and drains) on drop.
pub struct Gateway {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub shared: Arc<Shared>,
    pub config_path: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<()>>,
    _dir: TempDir,
}

impl Gateway {
    /// Starts tollgate on `yaml` (listen/admin are forced to 127.0.0.1:0) with the real clock.
    pub async fn start(yaml: &str) -> Self {
        Self::start_with_clock(yaml, Arc::new(TokioClock::new())).await
    }

    /// Starts with a manual clock; returns it so the test moves time instead of sleeping.
    pub async fn start_manual(yaml: &str) -> (Self, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000_000_000_000));
        let g = Self::start_with_clock(yaml, clock.clone()).await;
        (g, clock)
    }

    pub async fn start_with_clock(yaml: &str, clock: SharedClock) -> Self {
        let dir = TempDir::new();
        let path = dir.path.join("routes.yaml");
        std::fs::write(&path, yaml).unwrap();
        let cfg = tollgate::config::parse_str(&path, yaml)
            .unwrap_or_else(|e| panic!("test config invalid: {e}\n{yaml}"));
        let app = App::bind(
            cfg,
            Options {
                config_path: Some(path.clone()),
                listen: Some("127.0.0.1:0".parse().unwrap()),
                admin: Some("127.0.0.1:0".parse().unwrap()),
            },
            clock,
        )
        .await
        .expect("gateway binds");
        let (tx, rx) = oneshot::channel::<()>();
        let addr = app.proxy_addr();
        let admin = app.admin_addr();
        let shared = app.shared();
        let task = tokio::spawn(app.run(async move {
            let _ = rx.await;
        }));
        Self {
            addr,
            admin,
            shared,
            config_path: path,
            stop: Some(tx),
            task: Some(task),
            _dir: dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// Signals shutdown and waits for the drain to finish.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }

    /// An admin path's JSON body.
    pub async fn admin_json(&self, path: &str) -> serde_json::Value {
        reqwest::get(self.admin_url(path))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    pub async fn metrics(&self) -> String {
        reqwest::get(self.admin_url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// The value of one sample line in Prometheus text, e.g. `metric(&text, "tollgate_requests_total{route=\"a\",status=\"200\"}")`.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// A temporary directory removed on drop (no extra crates).
pub struct TempDir {
    pub path: PathBuf,
}

impl TempDir {
    pub fn new() -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "tollgate-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self { path }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A loopback address nothing listens on (it was free a moment ago): an upstream or a Redis
/// that is down.
pub fn closed_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}
