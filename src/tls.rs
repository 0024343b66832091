//! TLS material: PEM files to rustls configs, for the listener and for `https://` upstreams.
//!
//! Everything runs on rustls' `ring` provider, passed explicitly to every config builder, so no
//! process-wide default provider has to be installed (and a second provider compiled in by some
//! other crate could not make the choice ambiguous). Both sides offer ALPN `h2` then `http/1.1`:
//! a peer that speaks HTTP/2 gets it, any other gets HTTP/1.1.

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

/// The listener's config: one certificate chain and its key, ALPN `h2` + `http/1.1`.
/// Refuses a key that does not belong to the chain's first certificate.
pub(crate) fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<ServerConfig>, String> {
    let mut cfg = ServerConfig::builder_with_provider(provider())
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
