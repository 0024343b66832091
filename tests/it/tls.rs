//! TLS end to end on real sockets: `https://` upstreams (custom CA, SNI, HTTP/2 by ALPN, an
//! untrusted certificate), the TLS listener (HTTP/1.1 and HTTP/2 by ALPN, `X-Forwarded-Proto`,
//! failed handshakes, drain, certificate rotation on reload), and `tollgate check` on bad files.
//! Certificates are made at test time.

use std::time::Duration;

use std::sync::Arc;

use rustls::{CipherSuite, HandshakeKind, NamedGroup, ProtocolVersion};

use crate::support::tls::{
    HttpsUpstream, Pki, client_config, client_config_for, get, https_client, tls_get,
};
use crate::support::upstream::Upstream;
use crate::support::{Gateway, TempDir, client};
use serde_json::Value;

const H2_AND_H1: &[&[u8]] = &[b"h2", b"http/1.1"];
const H1_ONLY: &[&[u8]] = &[b"http/1.1"];

fn yaml(server: &str, route: &str) -> String {
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\n{server}routes:\n  - name: r\n{route}"
    )
}

async fn json(resp: reqwest::Response) -> Value {
    let text = resp.text().await.unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[tokio::test]
async fn https_upstream_trusted_through_upstream_ca_gets_sni_and_http2() {
    let pki = Pki::new();
    let dir = TempDir::new();
    let files = pki.write(&dir.path);
    let up = HttpsUpstream::start(&pki, H2_AND_H1).await;
    let g = Gateway::start(&yaml(
        &format!("  upstream_ca: {}\n", files.ca.display()),
        &format!("    upstream: {}\n", up.url()),
    ))
    .await;
    let c = client();
    for i in 0..5 {
        let r = c.get(g.url(&format!("/a/{i}"))).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let v = json(r).await;
        assert_eq!(v["sni"], "localhost", "{v}");
        assert_eq!(v["alpn"], "h2", "{v}");
        assert_eq!(v["version"], "HTTP/2.0", "{v}");
        assert_eq!(v["path"], format!("/a/{i}"));
        // preserve_host (the default): `:authority` is the client's Host, and a Host sent along
        // is the same (RFC 9113 §8.3.1).
        let client_host = g.addr.to_string();
        assert_eq!(v["authority"], client_host.as_str(), "{v}");
        assert_eq!(v["headers"]["host"], client_host.as_str(), "{v}");
        assert_eq!(v["headers"]["x-forwarded-proto"], "http");
    }
    // Concurrent requests share the one HTTP/2 connection.
    let many = (0..20).map(|i| {
        let (c, url) = (c.clone(), g.url(&format!("/m/{i}")));
        async move { c.get(url).send().await.unwrap().status().as_u16() }
    });
    let statuses = futures_util::future::join_all(many).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(up.connection_count(), 1, "{:?}", up.connections);
}

#[tokio::test]
async fn a_lost_http2_upstream_connection_is_replaced() {
    let pki = Pki::new();
    let dir = TempDir::new();
    let files = pki.write(&dir.path);
    let up = HttpsUpstream::start(&pki, H2_AND_H1).await;
    let g = Gateway::start(&yaml(
        &format!("  upstream_ca: {}\n", files.ca.display()),
        &format!("    upstream: {}\n", up.url()),
    ))
    .await;
    let c = client();
    let v = json(c.get(g.url("/1")).send().await.unwrap()).await;
    assert_eq!(
        (v["version"].as_str(), v["connection"].as_u64()),
        (Some("HTTP/2.0"), Some(1))
    );
    for round in 2..=3 {
        up.kill_connections();
        // Time for the gateway to see the close; a request already on its way when a
        // connection dies is a 502, as with any proxy.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let r = c.get(g.url("/again")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let v = json(r).await;
        assert_eq!(v["version"], "HTTP/2.0", "{v}");
        assert_eq!(v["connection"], round, "{v}");
    }
}

#[tokio::test]
async fn upgrades_to_an_http2_capable_https_upstream_go_over_http11() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pki = Pki::new();
    let dir = TempDir::new();
    let files = pki.write(&dir.path);
    let up = HttpsUpstream::start(&pki, H2_AND_H1).await;
    let g = Gateway::start(&yaml(
        &format!("  upstream_ca: {}\n", files.ca.display()),
        &format!("    upstream: {}\n", up.url()),
    ))
    .await;
    let mut s = tokio::net::TcpStream::connect(g.addr).await.unwrap();
    s.write_all(
        b"GET /upgrade HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: echo\r\n\r\n",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    for msg in [&b"ping"[..], b"and pong"] {
        s.write_all(msg).await.unwrap();
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(got, msg);
    }
    let seen = up.connections.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        seen[0].alpn, None,
        "an upgrade must not be offered h2: {seen:?}"
    );
    assert_eq!(seen[0].sni.as_deref(), Some("localhost"));
}

#[tokio::test]
async fn without_preserve_host_http2_authority_is_the_upstreams() {
    let pki = Pki::new();
    let dir = TempDir::new();
    let files = pki.write(&dir.path);
    let up = HttpsUpstream::start(&pki, H2_AND_H1).await;
    let g = Gateway::start(&yaml(
        &format!("  upstream_ca: {}\n", files.ca.display()),
        &format!("    upstream: {}\n    preserve_host: false\n", up.url()),
    ))
    .await;
    let v = json(client().get(g.url("/x")).send().await.unwrap()).await;
    assert_eq!(v["version"], "HTTP/2.0", "{v}");
    assert_eq!(
        v["authority"],
        format!("localhost:{}", up.addr.port()).as_str()
    );
    assert!(v["headers"].get("host").is_none(), "{v}");
}

#[tokio::test]
async fn http1_only_https_upstream_gets_http11_over_tls() {
    let pki = Pki::new();
    let dir = TempDir::new();
    let files = pki.write(&dir.path);
    let up = HttpsUpstream::start(&pki, H1_ONLY).await;
    let g = Gateway::start(&yaml(
        &format!("  upstream_ca: {}\n", files.ca.display()),
        &format!("    upstream: {}/base\n", up.url()),
    ))
    .await;
    let c = client();
    for _ in 0..3 {
        let r = c.get(g.url("/x?y=1")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let v = json(r).await;
        assert_eq!(v["version"], "HTTP/1.1", "{v}");
        assert_eq!(v["sni"], "localhost", "{v}");
        assert_eq!(v["path"], "/base/x");
        assert_eq!(v["headers"]["host"], g.addr.to_string().as_str());
    }
    // One ALPN probe, then the HTTP/1.1 pool (kept alive): two connections, not one per request.
    assert_eq!(up.connection_count(), 2, "{:?}", up.connections);
}

#[tokio::test]
async fn untrusted_upstream_certificate_is_502() {
    let pki = Pki::new();
    let up = HttpsUpstream::start(&pki, H2_AND_H1).await;
    // No upstream_ca: the test CA is in no system store.
    let g = Gateway::start(&yaml("", &format!("    upstream: {}\n", up.url()))).await;
    let r = client().get(g.url("/x")).send().await.unwrap();
    assert_eq!(r.status(), 502);
    // A CA that did not sign the upstream's certificate does not help either.
    let other = Pki::named("another CA");
    let dir = TempDir::new();
    let files = other.write(&dir.path);
    let g2 = Gateway::start(&yaml(
        &format!("  upstream_ca: {}\n", files.ca.display()),
        &format!("    upstream: {}\n", up.url()),
    ))
    .await;
    let r = client().get(g2.url("/x")).send().await.unwrap();
    assert_eq!(r.status(), 502);
    assert!(
        up.failed_handshakes
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 2
    );
    assert_eq!(up.connection_count(), 0);
}

#[tokio::test]
async fn upstream_certificate_must_name_the_upstream_host() {
    // Signed by the trusted CA, but for another name than the upstream URL's host.
    let pki = Pki::with_names("tollgate test CA", &["api.example.test"]);
    let dir = TempDir::new();
    let files = pki.write(&dir.path);
    let up = HttpsUpstream::start(&pki, H2_AND_H1).await;
    let g = Gateway::start(&yaml(
        &format!(
            "  upstream_ca: {}
",
            files.ca.display()
        ),
        &format!(
            "    upstream: {}
",
            up.url()
        ),
    ))
    .await;
    let r = client().get(g.url("/x")).send().await.unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(up.connection_count(), 0);
}

/// A gateway whose listener serves TLS with `pki`'s certificate, in front of a plain upstream.
async fn tls_gateway(pki: &Pki, dir: &TempDir, up: &Upstream) -> Gateway {
    let files = pki.write(&dir.path);
    Gateway::start(&yaml(
        &format!(
            "  tls:\n    cert: {}\n    key: {}\n",
            files.cert.display(),
            files.key.display()
        ),
        &format!("    upstream: {}\n", up.url()),
    ))
    .await
}

#[tokio::test]
async fn tls_listener_serves_http11_and_http2_by_alpn() {
    let pki = Pki::new();
    let dir = TempDir::new();
    let up = Upstream::start().await;
    let g = tls_gateway(&pki, &dir, &up).await;
    let url = format!("https://localhost:{}/echo", g.addr.port());

    let (status, version, body) = get(&https_client(&pki.ca_der, false), &url).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(version, hyper::Version::HTTP_11);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["headers"]["x-forwarded-proto"], "https", "{v}");

    let (status, version, body) = get(&https_client(&pki.ca_der, true), &url).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(version, hyper::Version::HTTP_2);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["headers"]["x-forwarded-proto"], "https", "{v}");

    // By address too (no SNI; the certificate carries 127.0.0.1).
    let url = format!("https://127.0.0.1:{}/echo", g.addr.port());
    let (status, _, _) = get(&https_client(&pki.ca_der, true), &url).await;
    assert_eq!(status, 200);
}

/// HTTP/1.1 over TLS is the fast codec's whatever the client's ALPN says (`http/1.1`, or none
/// at all), with the same answers and `X-Forwarded-Proto: https`; `h2` is hyper's.
#[tokio::test]
async fn tls_http11_with_or_without_alpn_is_served_and_h2_too() {
    let pki = Pki::new();
    let dir = TempDir::new();
    let up = Upstream::start().await;
    let g = tls_gateway(&pki, &dir, &up).await;
    for (alpn, want) in [
        (vec![], None),
        (vec![b"http/1.1".to_vec()], Some(&b"http/1.1"[..])),
    ] {
        let mut cfg = client_config(&pki.ca_der);
        cfg.alpn_protocols = alpn;
        let n = tls_get(g.addr, Arc::new(cfg), "/echo").await;
        assert_eq!(n.alpn.as_deref(), want);
        assert!(
            n.response.starts_with("HTTP/1.1 200 OK\r\n"),
            "{}",
            n.response
        );
        assert!(
            n.response.contains(r#""x-forwarded-proto":"https""#),
            "{}",
            n.response
        );
    }
    let (status, version, _) = get(
        &https_client(&pki.ca_der, true),
        &format!("https://localhost:{}/echo", g.addr.port()),
    )
    .await;
    assert_eq!((status, version), (200, hyper::Version::HTTP_2));
    assert_eq!(up.hits(), 3);
}

/// Sessions resume, as nginx's do by default: TLS 1.3 by ticket, TLS 1.2 by ticket or by
/// session id, also after a reload (which builds a new TLS config); and the handshake takes
/// X25519 and AES-128-GCM even from a client that lists AES-256-GCM first (rustls' and
/// OpenSSL's clients do).
#[tokio::test]
async fn tls_sessions_resume_across_reloads_with_x25519_and_aes_128_gcm() {
    let pki = Pki::new();
    let dir = TempDir::new();
    let up = Upstream::start().await;
    let g = tls_gateway(&pki, &dir, &up).await;
    let tls12_by_id = {
        let mut c = client_config_for(&pki.ca_der, &[&rustls::version::TLS12]);
        c.resumption = rustls::client::Resumption::in_memory_sessions(8)
            .tls12_resumption(rustls::client::Tls12Resumption::SessionIdOnly);
        c
    };
    let clients = [
        (
            client_config_for(&pki.ca_der, &[&rustls::version::TLS13]),
            ProtocolVersion::TLSv1_3,
            CipherSuite::TLS13_AES_128_GCM_SHA256,
        ),
        (
            client_config_for(&pki.ca_der, &[&rustls::version::TLS12]),
            ProtocolVersion::TLSv1_2,
            CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        ),
        (
            tls12_by_id,
            ProtocolVersion::TLSv1_2,
            CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        ),
    ];
    for (cfg, version, suite) in clients {
        let cfg = Arc::new(cfg);
        let mut kinds = Vec::new();
        for round in 0..3 {
            if round == 2 {
                g.shared.reload().await.expect("reload");
            }
            let n = tls_get(g.addr, cfg.clone(), "/echo").await;
            assert!(n.response.starts_with("HTTP/1.1 200 "), "{}", n.response);
            // TLS 1.3 resumes with a fresh key exchange (psk_dhe_ke); TLS 1.2 without one.
            let group =
                (round == 0 || version == ProtocolVersion::TLSv1_3).then_some(NamedGroup::X25519);
            assert_eq!((n.version, n.suite, n.group), (version, suite, group));
            kinds.push(n.kind);
        }
        assert_eq!(
            kinds,
            [
                HandshakeKind::Full,
                HandshakeKind::Resumed,
                HandshakeKind::Resumed
            ],
            "{version:?} {:?}",
            cfg.resumption
        );
    }
}

/// OpenSSL-based clients (wrk, many libraries) given `https://127.0.0.1/` put the address in
/// SNI, which rustls ignores (RFC 6066 allows host names only) and warned about, a line per
/// connection: the binary at `RUST_LOG=warn` serves such a client and logs nothing about it.
#[tokio::test]
async fn an_ip_address_in_sni_is_ignored_without_a_log_line_per_connection() {
    use crate::support::process::Proc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pki = Pki::new();
    let dir = TempDir::new();
    let files = pki.write(&dir.path);
    let up = Upstream::start().await;
    let yaml = format!(
        "server:\n  listen: 127.0.0.1:PROXY_PORT\n  admin: 127.0.0.1:ADMIN_PORT\n  tls:\n    cert: {}\n    key: {}\nroutes:\n  - name: r\n    upstream: {}\n",
        files.cert.display(),
        files.key.display(),
        up.url()
    );
    let mut p = Proc::start(&yaml, &[], &[], true).await;
    let addr: std::net::SocketAddr = p.proxy.trim_start_matches("http://").parse().unwrap();
    // rustls' client never sends an address as SNI: its ClientHello for a name of the same
    // length, with the name's bytes replaced.
    let mut hello = Vec::new();
    let mut c = rustls::ClientConnection::new(
        Arc::new(client_config(&pki.ca_der)),
        "abc.def.g".try_into().unwrap(),
    )
    .unwrap();
    c.write_tls(&mut hello).unwrap();
    let at = hello.windows(9).position(|w| w == b"abc.def.g").unwrap();
    hello[at..at + 9].copy_from_slice(b"127.0.0.1");
    for _ in 0..3 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(&hello).await.unwrap();
        // A handshake record back: the hello was read and answered.
        let mut first = [0u8; 1];
        s.read_exact(&mut first).await.unwrap();
        assert_eq!(first[0], 0x16, "a TLS handshake record");
    }
    let n = tls_get(addr, Arc::new(client_config(&pki.ca_der)), "/echo").await;
    assert!(n.response.starts_with("HTTP/1.1 200 "), "{}", n.response);
    p.signal("TERM");
    assert!(p.exited_ok().await);
    let mut stderr = String::new();
    std::io::Read::read_to_string(p.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(!stderr.contains("SNI"), "{stderr}");
}

#[tokio::test]
async fn failed_handshakes_cost_only_their_connection() {
    let pki = Pki::new();
    let dir = TempDir::new();
    let up = Upstream::start().await;
    let g = tls_gateway(&pki, &dir, &up).await;
    let url = format!("https://localhost:{}/echo", g.addr.port());

    // A client that trusts another CA fails its handshake.
    let stranger = https_client(&Pki::named("stranger").ca_der, true);
    let r = stranger
        .request(
            hyper::Request::get(&url)
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap(),
        )
        .await;
    assert!(r.is_err(), "an untrusted certificate was accepted");
    // Plain HTTP on the TLS port gets no HTTP answer.
    let r = client()
        .get(format!("http://127.0.0.1:{}/echo", g.addr.port()))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(r.is_err() || r.unwrap().status() != 200);
    // A silent TCP connection does not block the accept loop.
    let _idle = tokio::net::TcpStream::connect(g.addr).await.unwrap();

    let (status, _, _) = get(&https_client(&pki.ca_der, false), &url).await;
    assert_eq!(status, 200);
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn tls_connections_drain_on_shutdown() {
    let pki = Pki::new();
    let dir = TempDir::new();
    let up = Upstream::start().await;
    let g = tls_gateway(&pki, &dir, &up).await;
    let url = format!("https://localhost:{}/slow?ms=600", g.addr.port());
    // One HTTP/1.1 and one HTTP/2 request in flight when shutdown starts.
    let inflight: Vec<_> = [false, true]
        .into_iter()
        .map(|h2| {
            let (c, url) = (https_client(&pki.ca_der, h2), url.clone());
            tokio::spawn(async move { get(&c, &url).await })
        })
        .collect();
    while up.hits() < 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = std::time::Instant::now();
    g.stop().await;
    let drained = started.elapsed();
    let mut versions = Vec::new();
    for t in inflight {
        let (status, version, body) = t.await.unwrap();
        assert_eq!(status, 200, "{body}");
        versions.push(version);
    }
    assert_eq!(versions, [hyper::Version::HTTP_11, hyper::Version::HTTP_2]);
    assert!(drained < Duration::from_secs(5), "{drained:?}");
}

#[tokio::test]
async fn reload_rotates_the_listener_certificate() {
    let old = Pki::named("old CA");
    let dir = TempDir::new();
    let up = Upstream::start().await;
    let g = tls_gateway(&old, &dir, &up).await;
    let url = format!("https://localhost:{}/echo", g.addr.port());
    assert_eq!(get(&https_client(&old.ca_der, false), &url).await.0, 200);

    let new = Pki::named("new CA");
    new.write(&dir.path);
    g.shared.reload().await.expect("reload with renewed files");
    assert_eq!(get(&https_client(&new.ca_der, false), &url).await.0, 200);
    let stale = https_client(&old.ca_der, false)
        .request(
            hyper::Request::get(&url)
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap(),
        )
        .await;
    assert!(stale.is_err(), "the old certificate is still served");
}

fn check(yaml: &str, dir: &TempDir) -> (Option<i32>, String) {
    let path = dir.path.join("routes.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[test]
fn check_refuses_a_missing_certificate_file_at_its_line_and_column() {
    let dir = TempDir::new();
    let yaml =
        "server:\n  tls:\n    cert: missing-cert.pem\n    key: missing-key.pem\nroutes: []\n";
    let (code, text) = check(yaml, &dir);
    assert_eq!(code, Some(1), "{text}");
    let path = dir.path.join("routes.yaml");
    let expected = format!("{}:3:11: tls.cert: cannot read `", path.display());
    assert!(text.starts_with(&expected), "{text}");
    // Relative to the config file's directory.
    assert!(
        text.contains(&dir.path.join("missing-cert.pem").display().to_string()),
        "{text}"
    );
}

#[test]
fn check_accepts_good_files_and_names_them_in_the_summary() {
    let dir = TempDir::new();
    let files = Pki::new().write(&dir.path);
    let yaml = "server:\n  tls: {cert: cert.pem, key: key.pem}\n  upstream_ca: ca.pem\nroutes:\n  - name: r\n    upstream: https://localhost:1\n";
    let (code, text) = check(yaml, &dir);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("TLS, ALPN h2 + http/1.1"), "{text}");
    assert!(text.contains(&files.cert.display().to_string()), "{text}");
    assert!(
        text.contains(&format!("system roots + {}", files.ca.display())),
        "{text}"
    );
}

#[test]
fn check_refuses_a_key_that_does_not_match_the_certificate() {
    let dir = TempDir::new();
    Pki::new().write(&dir.path);
    std::fs::write(dir.path.join("other.pem"), Pki::new().key_pem).unwrap();
    let yaml = "server:\n  tls:\n    cert: cert.pem\n    key: other.pem\n";
    let (code, text) = check(yaml, &dir);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("routes.yaml:4:10: tls.key: the key does not belong"),
        "{text}"
    );
}
