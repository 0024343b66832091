//! Test support: real upstream HTTP servers on loopback and the gateway in process on port 0.
#![allow(dead_code)]

pub mod process;
pub mod redis;
pub mod tls;
pub mod upstream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::oneshot;
use tollgate::app::{App, Options, Shared};
use tollgate::limit::clock::{ManualClock, SharedClock, TokioClock};

/// A running gateway; stops (and drains) on drop.
pub struct Gateway {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub shared: Arc<Shared>,
    pub config_path: PathBuf,
    /// The test CA that signed the listener's certificate, when it serves TLS
    /// ([`Gateway::start_tls`]).
    pub tls: Option<CertificateDer<'static>>,
    stop: Option<oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<()>>,
    _dir: TempDir,
}

/// A client's byte stream to the gateway: TCP, or TLS over it.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

impl Gateway {
    /// Starts tollgate on `yaml` (listen/admin are forced to 127.0.0.1:0) with the real clock.
    pub async fn start(yaml: &str) -> Self {
        Self::start_with_clock(yaml, Arc::new(TokioClock::new())).await
    }

    /// [`Gateway::start`] with the listener on TLS: a fresh test CA and certificate (for
    /// `localhost` and `127.0.0.1`) written next to the config, `server.tls` added to `yaml`
    /// (which must have a `server:` section). [`Gateway::connect`], [`Gateway::url`] and
    /// [`Gateway::fetcher`] speak TLS to it.
    pub async fn start_tls(yaml: &str) -> Self {
        let pki = tls::Pki::new();
        let dir = TempDir::new();
        pki.write(&dir.path);
        assert!(yaml.contains("server:\n"), "no server section: {yaml}");
        let yaml = yaml.replacen(
            "server:\n",
            "server:\n  tls:\n    cert: cert.pem\n    key: key.pem\n",
            1,
        );
        let mut g = Self::start_in(dir, &yaml, Arc::new(TokioClock::new())).await;
        g.tls = Some(pki.ca_der.clone());
        g
    }

    /// [`Gateway::start_tls`] when `tls`, else [`Gateway::start`].
    pub async fn start_on(yaml: &str, tls: bool) -> Self {
        if tls {
            Self::start_tls(yaml).await
        } else {
            Self::start(yaml).await
        }
    }

    /// A new connection to the proxy listener: TLS (ALPN `http/1.1`) when it serves TLS.
    pub async fn connect(&self) -> Box<dyn Stream> {
        let tcp = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        match &self.tls {
            None => Box::new(tcp),
            Some(ca) => Box::new(tls::handshake(tcp, ca, &[b"http/1.1"]).await),
        }
    }

    /// An HTTP client for this gateway (HTTPS when its listener serves TLS).
    pub fn fetcher(&self) -> Fetcher {
        match &self.tls {
            None => Fetcher::Plain(client(), self.url("")),
            Some(ca) => Fetcher::Tls(Box::new(tls::https_client(ca, false)), self.url("")),
        }
    }

    /// GET `path` with a [`Gateway::fetcher`].
    pub async fn get(&self, path: &str) -> Fetched {
        self.fetcher().get(path).await
    }

    /// Starts with a manual clock; returns it so the test moves time instead of sleeping.
    pub async fn start_manual(yaml: &str) -> (Self, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000_000_000_000));
        let g = Self::start_with_clock(yaml, clock.clone()).await;
        (g, clock)
    }

    pub async fn start_with_clock(yaml: &str, clock: SharedClock) -> Self {
        Self::start_in(TempDir::new(), yaml, clock).await
    }

    /// Starts with the config written to `dir` (kept for the gateway's life).
    async fn start_in(dir: TempDir, yaml: &str, clock: SharedClock) -> Self {
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
            tls: None,
            stop: Some(tx),
            task: Some(task),
            _dir: dir,
        }
    }

    /// The URL of `path` on the proxy listener: `https://localhost:PORT` (the certificate's
    /// name) when it serves TLS.
    pub fn url(&self, path: &str) -> String {
        match self.tls {
            None => format!("http://{}{}", self.addr, path),
            Some(_) => format!("https://localhost:{}{}", self.addr.port(), path),
        }
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

/// An HTTP client for one gateway, over TCP or TLS; cheap to clone into a task.
#[derive(Clone)]
pub enum Fetcher {
    Plain(reqwest::Client, String),
    Tls(Box<tls::HttpsClient>, String),
}

/// A response read whole: its body, or why it could not be read to its end.
#[derive(Debug)]
pub struct Fetched {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Result<bytes::Bytes, String>,
}

impl Fetched {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(self.body.as_ref().expect("a whole body")).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        let text = self.text();
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }
}

impl Fetcher {
    /// GET `path`; panics when no response head comes.
    pub async fn get(&self, path: &str) -> Fetched {
        self.send(http::Method::GET, path, bytes::Bytes::new())
            .await
    }

    /// `method` `path` with `body`; panics when no response head comes.
    pub async fn send(&self, method: http::Method, path: &str, body: bytes::Bytes) -> Fetched {
        match self {
            Fetcher::Plain(c, base) => {
                let r = c
                    .request(method, format!("{base}{path}"))
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                let (status, headers) = (r.status().as_u16(), r.headers().clone());
                let body = r.bytes().await.map_err(|e| e.to_string());
                Fetched {
                    status,
                    headers,
                    body,
                }
            }
            Fetcher::Tls(c, base) => {
                use http_body_util::BodyExt;
                let req = http::Request::builder()
                    .method(method)
                    .uri(format!("{base}{path}"))
                    .body(http_body_util::Full::new(body))
                    .unwrap();
                let r = c.request(req).await.unwrap();
                let (parts, body) = r.into_parts();
                let body = body
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .map_err(|e| format!("{e:?}"));
                Fetched {
                    status: parts.status.as_u16(),
                    headers: parts.headers,
                    body,
                }
            }
        }
    }
}
