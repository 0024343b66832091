//! TLS for tests: a CA and a `localhost` / `127.0.0.1` certificate made at test time (rcgen, no
//! files in the repo), an HTTPS upstream that reports what it negotiated, and an HTTPS client.
//!
//! The upstream answers every request with JSON: `version` (of the request as it arrived),
//! `alpn`, `sni` (the server name the client's hello carried), `authority` (the request URI's,
//! which over HTTP/2 is `:authority`), `path`, `headers`, and `connection` (the 1-based number of
//! the TLS connection it arrived on). `/upgrade` with an `Upgrade` header switches to a raw echo
//! protocol (HTTP/1.1 only); `?ms=N` waits N ms first.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A test CA and one server certificate it signed, valid for `localhost` and `127.0.0.1`.
pub struct Pki {
    pub ca_pem: String,
    pub ca_der: CertificateDer<'static>,
    pub cert_pem: String,
    pub cert_der: CertificateDer<'static>,
    pub key_pem: String,
    key_der: Vec<u8>,
}

impl Pki {
    pub fn new() -> Self {
        Self::named("tollgate test CA")
    }

    pub fn named(ca_name: &str) -> Self {
        Self::with_names(ca_name, &["localhost", "127.0.0.1"])
    }

    /// A CA called `ca_name` and a server certificate for `names` (DNS names or IP addresses).
    pub fn with_names(ca_name: &str, names: &[&str]) -> Self {
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params
            .distinguished_name
            .push(DnType::CommonName, ca_name);
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names.clone()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, names[0].as_str());
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca).unwrap();
        Self {
            ca_pem: ca.pem(),
            ca_der: ca.der().clone(),
            cert_pem: cert.pem(),
            cert_der: cert.der().clone(),
            key_pem: key.serialize_pem(),
            key_der: key.serialize_der(),
        }
    }

    /// Writes `ca.pem`, `cert.pem` (leaf, then the CA: a full chain) and `key.pem` into `dir`.
    pub fn write(&self, dir: &Path) -> PkiFiles {
        let files = PkiFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        };
        std::fs::write(&files.ca, &self.ca_pem).unwrap();
        std::fs::write(&files.cert, format!("{}{}", self.cert_pem, self.ca_pem)).unwrap();
        std::fs::write(&files.key, &self.key_pem).unwrap();
        files
    }

    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }

    /// A server config for this certificate offering `alpn` (e.g. `[b"h2", b"http/1.1"]`).
    pub fn server_config(&self, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![self.cert_der.clone(), self.ca_der.clone()], self.key())
            .unwrap();
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(cfg)
    }
}

pub struct PkiFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// What an [`HttpsUpstream`] saw of one TLS connection.
#[derive(Clone, Debug)]
pub struct Seen {
    pub sni: Option<String>,
    pub alpn: Option<String>,
}

/// An HTTPS upstream on loopback: TLS with the given ALPN list, then HTTP/1.1 or HTTP/2.
pub struct HttpsUpstream {
    pub addr: SocketAddr,
    /// TLS connections completed, in order.
    pub connections: Arc<std::sync::Mutex<Vec<Seen>>>,
    /// Handshakes that failed (e.g. the client did not trust the certificate).
    pub failed_handshakes: Arc<AtomicUsize>,
    kill: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HttpsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HttpsUpstream {
    pub async fn start(pki: &Pki, alpn: &[&[u8]]) -> Self {
        let acceptor = TlsAcceptor::from(pki.server_config(alpn));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(std::sync::Mutex::new(Vec::new()));
        let failed_handshakes = Arc::new(AtomicUsize::new(0));
        let (conns, failed) = (connections.clone(), failed_handshakes.clone());
        let (kill, kill_rx) = tokio::sync::watch::channel(0u64);
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, conns, failed) = (acceptor.clone(), conns.clone(), failed.clone());
                let mut kill_rx = kill_rx.clone();
                kill_rx.mark_unchanged();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        failed.fetch_add(1, Ordering::SeqCst);
                        return;
                    };
                    let (_, session) = tls.get_ref();
                    let seen = Seen {
                        sni: session.server_name().map(str::to_owned),
                        alpn: session
                            .alpn_protocol()
                            .map(|p| String::from_utf8_lossy(p).into_owned()),
                    };
                    let number = {
                        let mut c = conns.lock().unwrap();
                        c.push(seen.clone());
                        c.len()
                    };
                    let svc = service_fn(move |req| report(req, seen.clone(), number));
                    let builder = auto::Builder::new(TokioExecutor::new());
                    let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), svc);
                    tokio::select! {
                        _ = conn => {}
                        // Dropped without a GOAWAY: what a crashed or restarted upstream does.
                        _ = kill_rx.changed() => {}
                    }
                });
            }
        });
        Self {
            addr,
            connections,
            failed_handshakes,
            kill,
            task,
        }
    }

    /// Closes every open connection at once (TCP close, no GOAWAY).
    pub fn kill_connections(&self) {
        self.kill.send_modify(|n| *n += 1);
    }

    /// `https://localhost:PORT`: the name the certificate is for, so SNI is sent.
    pub fn url(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }

    pub fn connection_count(&self) -> usize {
        self.connections.lock().unwrap().len()
    }
}

async fn report(
    mut req: Request<Incoming>,
    seen: Seen,
    connection: usize,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.uri().path() == "/upgrade" && req.headers().contains_key("upgrade") {
        let on = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            if let Ok(io) = on.await {
                let mut io = TokioIo::new(io);
                let (mut r, mut w) = tokio::io::split(&mut io);
                let _ = tokio::io::copy(&mut r, &mut w).await;
            }
        });
        let mut r = Response::new(Full::new(Bytes::new()));
        *r.status_mut() = hyper::StatusCode::SWITCHING_PROTOCOLS;
        r.headers_mut().insert("upgrade", "echo".parse().unwrap());
        r.headers_mut()
            .insert("connection", "upgrade".parse().unwrap());
        return Ok(r);
    }
    if let Some(ms) = req
        .uri()
        .query()
        .and_then(|q| q.strip_prefix("ms="))
        .and_then(|v| v.parse().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let headers: serde_json::Map<String, serde_json::Value> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned().into(),
            )
        })
        .collect();
    let v = serde_json::json!({
        "version": format!("{:?}", req.version()),
        "alpn": seen.alpn,
        "sni": seen.sni,
        "authority": req.uri().authority().map(|a| a.to_string()),
        "path": req.uri().path(),
        "headers": headers,
        "connection": connection,
    });
    let _ = req.into_body().collect().await;
    Ok(Response::new(Full::new(Bytes::from(v.to_string()))))
}

pub type HttpsClient =
    hyper_util::client::legacy::Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// A client that trusts only `ca` and offers ALPN `h2` + `http/1.1` (`h2: true`) or no ALPN.
pub fn https_client(ca: &CertificateDer<'static>, h2: bool) -> HttpsClient {
    let cfg = client_config(ca);
    let b = HttpsConnectorBuilder::new()
        .with_tls_config(cfg)
        .https_only()
        .enable_http1();
    let connector = if h2 {
        b.enable_http2().build()
    } else {
        b.build()
    };
    hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector)
}

/// GET `url` with `client`; the status, the response's HTTP version and the body as text.
pub async fn get(client: &HttpsClient, url: &str) -> (u16, hyper::Version, String) {
    let resp = client
        .request(Request::get(url).body(Full::new(Bytes::new())).unwrap())
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e:?}"));
    let status = resp.status().as_u16();
    let version = resp.version();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, version, String::from_utf8_lossy(&body).into_owned())
}

/// A TLS handshake as a client that trusts only `ca`, offering `alpn` (none when empty), for
/// `localhost`.
pub async fn handshake(
    tcp: tokio::net::TcpStream,
    ca: &CertificateDer<'static>,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let mut cfg = client_config(ca);
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .expect("TLS handshake with the gateway")
}

/// A client config that trusts only `ca`, no ALPN; TLS 1.3 and 1.2, rustls' defaults
/// otherwise (AES-256-GCM listed first, session resumption on).
pub fn client_config(ca: &CertificateDer<'static>) -> rustls::ClientConfig {
    client_config_for(ca, rustls::DEFAULT_VERSIONS)
}

/// [`client_config`] for these protocol versions only.
pub fn client_config_for(
    ca: &CertificateDer<'static>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// What one request on a TLS connection of its own negotiated, and the response.
#[derive(Debug)]
pub struct Negotiated {
    pub kind: rustls::HandshakeKind,
    pub version: rustls::ProtocolVersion,
    pub suite: rustls::CipherSuite,
    /// None for a resumed TLS 1.2 session (no key exchange).
    pub group: Option<rustls::NamedGroup>,
    pub alpn: Option<Vec<u8>>,
    /// The whole response, as text.
    pub response: String,
}

/// GET `path` on a new TLS connection to `addr` made with `cfg` (server name `localhost`),
/// asking the server to close after it; reads until the close, so that session tickets sent
/// after the handshake reach `cfg`'s session store.
pub async fn tls_get(addr: SocketAddr, cfg: Arc<rustls::ClientConfig>, path: &str) -> Negotiated {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(cfg)
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .expect("TLS handshake with the gateway");
    let req = format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n");
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tls.read_to_end(&mut got).await.unwrap();
    let (_, c) = tls.get_ref();
    Negotiated {
        kind: c.handshake_kind().unwrap(),
        version: c.protocol_version().unwrap(),
        suite: c.negotiated_cipher_suite().unwrap().suite(),
        group: c.negotiated_key_exchange_group().map(|g| g.name()),
        alpn: c.alpn_protocol().map(<[u8]>::to_vec),
        response: String::from_utf8_lossy(&got).into_owned(),
    }
}
