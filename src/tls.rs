//! TLS material: PEM files to rustls configs, for the listener and for `https://` upstreams.
//!
//! Everything runs on rustls' `ring` provider, passed explicitly to every config builder, so no
//! process-wide default provider has to be installed (and a second provider compiled in by some
//! other crate could not make the choice ambiguous). Both sides offer ALPN `h2` then `http/1.1`:
//! a peer that speaks HTTP/2 gets it, any other gets HTTP/1.1.
//!
//! The listener's handshakes are made as cheap as they safely can be, as nginx's are by
//! default: sessions resume (TLS 1.3 and 1.2 tickets, and a session cache for TLS 1.2 clients
//! without tickets), shared by every config the process loads so a certificate rotation does
//! not send every client back to a full handshake; X25519 is the first key exchange; and the
//! server picks the cipher suite: AES-128-GCM first where the CPU has AES instructions (it is
//! the cheapest there, and AES-256 buys nothing against a 128-bit key exchange), ChaCha20
//! first where it has not. See docs/benchmarks.md for what each costs.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// ALPN protocol ids, most preferred first.
pub(crate) const ALPN_H2: &[u8] = b"h2";
pub(crate) const ALPN_HTTP11: &[u8] = b"http/1.1";

/// The one crypto provider tollgate uses.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// The listener's provider: ring's, with its cipher suites in the order the server picks them
/// ([`suite_order`]) and X25519 first (it is already; said here so it stays so).
fn listener_provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            use rustls::crypto::ring::kx_group;
            let mut p = rustls::crypto::ring::default_provider();
            p.cipher_suites = suite_order(aes_instructions());
            p.kx_groups = vec![kx_group::X25519, kx_group::SECP256R1, kx_group::SECP384R1];
            Arc::new(p)
        })
        .clone()
}

/// The cipher suites, the server's choice first: with AES instructions AES-128-GCM, then
/// AES-256-GCM, then ChaCha20-Poly1305; without them ChaCha20 first (AES in software is slower
/// and not constant-time). TLS 1.3 before TLS 1.2 (the version is chosen before the suite).
fn suite_order(aes: bool) -> Vec<rustls::SupportedCipherSuite> {
    use rustls::crypto::ring::cipher_suite as cs;
    if aes {
        vec![
            cs::TLS13_AES_128_GCM_SHA256,
            cs::TLS13_AES_256_GCM_SHA384,
            cs::TLS13_CHACHA20_POLY1305_SHA256,
            cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            cs::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
            cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            cs::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
            cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            cs::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ]
    } else {
        vec![
            cs::TLS13_CHACHA20_POLY1305_SHA256,
            cs::TLS13_AES_128_GCM_SHA256,
            cs::TLS13_AES_256_GCM_SHA384,
            cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            cs::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
            cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            cs::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
            cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            cs::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        ]
    }
}

/// The CPU has AES and carry-less multiply instructions (what AES-GCM runs fast and in
/// constant time on).
fn aes_instructions() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("aes")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes")
            && std::arch::is_aarch64_feature_detected!("pmull")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// Resumed TLS sessions of the listener, one store for the process: every config a reload
/// builds resumes what the configs before it started.
struct Resumption {
    /// Stateless tickets (TLS 1.3, and TLS 1.2 clients that ask for them), under keys rustls
    /// makes at random and rotates every 6 hours; a client's ticket outlives a reload.
    ticketer: Arc<dyn rustls::server::ProducesTickets>,
    /// Session ids of TLS 1.2 clients that do not take tickets.
    cache: Arc<dyn rustls::server::StoresServerSessions>,
}

/// TLS 1.2 sessions kept for resumption by id; about what nginx's `ssl_session_cache
/// shared:SSL:1m` holds.
const SESSION_CACHE: usize = 4096;

fn resumption() -> Result<&'static Resumption, String> {
    static RESUMPTION: OnceLock<Resumption> = OnceLock::new();
    if let Some(r) = RESUMPTION.get() {
        return Ok(r);
    }
    let ticketer = rustls::crypto::ring::Ticketer::new()
        .map_err(|e| format!("cannot make TLS session ticket keys: {e}"))?;
    Ok(RESUMPTION.get_or_init(|| Resumption {
        ticketer,
        cache: rustls::server::ServerSessionMemoryCache::new(SESSION_CACHE),
    }))
}

/// Every certificate in a PEM file, in file order (for a chain: leaf first).
pub(crate) fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("`{}` is not valid PEM: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "`{}` holds no certificate: expected PEM `-----BEGIN CERTIFICATE-----` blocks",
            path.display()
        ));
    }
    Ok(certs)
}

/// The first private key in a PEM file: PKCS#8, PKCS#1 (RSA) or SEC1 (EC).
pub(crate) fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let bytes = read(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| match e {
        pem::Error::NoItemsFound => format!(
            "`{}` holds no private key: expected an unencrypted PEM key (`BEGIN PRIVATE KEY`, `BEGIN RSA PRIVATE KEY` or `BEGIN EC PRIVATE KEY`)",
            path.display()
        ),
        e => format!("`{}` is not a valid PEM private key: {e}", path.display()),
    })
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))
}

/// The listener's config: one certificate chain and its key, ALPN `h2` + `http/1.1`, sessions
/// resumed and the cipher suite of the server's choosing (see the module's docs).
/// Refuses a key that does not belong to the chain's first certificate.
pub(crate) fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<ServerConfig>, String> {
    let mut cfg = ServerConfig::builder_with_provider(listener_provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| match e {
            rustls::Error::InconsistentKeys(_) => {
                "the key does not belong to the certificate (the first one in the cert file)"
                    .to_owned()
            }
            e => format!("the certificate and key cannot be used: {e}"),
        })?;
    cfg.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_HTTP11.to_vec()];
    let resumption = resumption()?;
    cfg.ticketer = resumption.ticketer.clone();
    cfg.session_storage = resumption.cache.clone();
    // The suite order above, not the client's: OpenSSL-based clients (curl, wrk, most
    // libraries) list AES-256-GCM first.
    cfg.ignore_client_order = true;
    // One TLS 1.3 ticket per handshake, not rustls' two: a client resuming (the common new
    // connection) needs one for its next connection, as OpenSSL sends after a resumption, and
    // each ticket costs the client a session to build (measured in docs/benchmarks.md).
    cfg.send_tls13_tickets = 1;
    Ok(Arc::new(cfg))
}

/// Checks that every certificate of a CA bundle can serve as a trust anchor.
pub(crate) fn check_roots(certs: &[CertificateDer<'static>]) -> Result<(), String> {
    let mut store = RootCertStore::empty();
    for (i, cert) in certs.iter().enumerate() {
        store.add(cert.clone()).map_err(|e| {
            format!(
                "certificate {} cannot be used as a trust anchor: {e}",
                i + 1
            )
        })?;
    }
    Ok(())
}

/// The system's trust store (`/etc/ssl/certs` and friends, `SSL_CERT_FILE` / `SSL_CERT_DIR`),
/// read once per process.
fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for e in &found.errors {
            tracing::warn!(error = %e, "cannot read part of the system trust store");
        }
        if found.certs.is_empty() {
            tracing::warn!(
                "no system root certificates found: https upstreams are trusted only through server.upstream_ca"
            );
        }
        found.certs
    })
}

/// The upstream side: system roots plus `extra` (`server.upstream_ca`), no client certificate,
/// no ALPN (the connector sets it).
pub(crate) fn client_config(extra: &[CertificateDer<'static>]) -> ClientConfig {
    let mut roots = RootCertStore::empty();
    let (_, ignored) = roots.add_parsable_certificates(system_roots().iter().cloned());
    if ignored > 0 {
        tracing::debug!(
            ignored,
            "system root certificates rustls cannot use were skipped"
        );
    }
    for cert in extra {
        // Checked when the config was validated.
        if let Err(e) = roots.add(cert.clone()) {
            tracing::warn!(error = %e, "upstream_ca certificate skipped");
        }
    }
    ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

#[cfg(test)]
mod tests {
    use rustls::CipherSuite as Cs;

    #[test]
    fn aes_128_gcm_leads_with_aes_instructions_and_chacha20_without() {
        let firsts = |aes| {
            let order = super::suite_order(aes);
            let tls13: Vec<Cs> = order.iter().take(3).map(|s| s.suite()).collect();
            let tls12 = order[3].suite();
            assert_eq!(order.len(), rustls::crypto::ring::ALL_CIPHER_SUITES.len());
            (tls13, tls12)
        };
        assert_eq!(
            firsts(true),
            (
                vec![
                    Cs::TLS13_AES_128_GCM_SHA256,
                    Cs::TLS13_AES_256_GCM_SHA384,
                    Cs::TLS13_CHACHA20_POLY1305_SHA256
                ],
                Cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
            )
        );
        assert_eq!(
            firsts(false),
            (
                vec![
                    Cs::TLS13_CHACHA20_POLY1305_SHA256,
                    Cs::TLS13_AES_128_GCM_SHA256,
                    Cs::TLS13_AES_256_GCM_SHA384
                ],
                Cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
            )
        );
    }
}
