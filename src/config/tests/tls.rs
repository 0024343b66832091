//! `server.tls` and `server.upstream_ca`: files read at validation, refusals at the field's
//! position, relative paths from the config file's directory. Certificates are made here.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

use super::super::{Config, ConfigError, parse_str, summary};
use super::lines;

/// A directory of PEM files, removed on drop: `ca.pem`, `cert.pem` (leaf + CA), `key.pem`,
/// `other-key.pem` (a key of no certificate here), `junk.pem`.
struct Files {
    dir: PathBuf,
}

impl Files {
    fn new() -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tollgate-config-tls-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let write = |name: &str, text: String| std::fs::write(dir.join(name), text).unwrap();
        write("ca.pem", ca.pem());
        write("cert.pem", format!("{}{}", cert.pem(), ca.pem()));
        write("key.pem", key.serialize_pem());
        write(
            "other-key.pem",
            KeyPair::generate().unwrap().serialize_pem(),
        );
        write("junk.pem", "not pem at all\n".to_owned());
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Parses `yaml` as if it were `routes.yaml` in this directory.
    fn parse(&self, yaml: &str) -> Result<Config, ConfigError> {
        parse_str(&self.dir.join("routes.yaml"), yaml)
    }

    #[track_caller]
    fn err(&self, yaml: &str, line: u64, column: u64, fragment: &str) {
        let e = match self.parse(yaml) {
            Ok(_) => panic!("expected an error at {line}:{column}\n{yaml}"),
            Err(e) => e,
        };
        assert!(
            e.message.contains(fragment),
            "message {:?} lacks {fragment:?}",
            e.message
        );
        assert_eq!(
            (e.line, e.column),
            (line, column),
            "wrong position for: {e}"
        );
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn tls(cert: &str, key: &str) -> String {
    lines(&[
        "server:",
        "  tls:",
        &format!("    cert: {cert}"),
        &format!("    key: {key}"),
    ])
}

#[test]
fn relative_paths_resolve_from_the_config_files_directory() {
    let f = Files::new();
    let mut yaml = tls("cert.pem", "key.pem");
    yaml.push_str("  upstream_ca: ca.pem\n");
    let cfg = f.parse(&yaml).unwrap();
    let t = cfg.server.tls.as_ref().unwrap();
    assert_eq!(t.cert, f.path("cert.pem"));
    assert_eq!(t.key, f.path("key.pem"));
    assert_eq!(
        t.server_config.alpn_protocols,
        [b"h2".to_vec(), b"http/1.1".to_vec()]
    );
    let ca = cfg.server.upstream_ca.as_ref().unwrap();
    assert_eq!(ca.path, f.path("ca.pem"));
    assert_eq!(ca.certs.len(), 1);

    let json = serde_json::to_value(&cfg).unwrap();
    assert_eq!(
        json["server"]["tls"],
        serde_json::json!({"cert": f.path("cert.pem"), "key": f.path("key.pem")})
    );
    assert_eq!(
        json["server"]["upstream_ca"],
        serde_json::json!(f.path("ca.pem"))
    );
    let text = summary(&cfg);
    assert!(text.contains("(TLS, ALPN h2 + http/1.1; cert "), "{text}");
    assert!(
        text.contains("upstream https trusts system roots + "),
        "{text}"
    );
}

#[test]
fn absolute_paths_are_kept_and_flow_style_works() {
    let f = Files::new();
    let cert = f.path("cert.pem");
    let key = f.path("key.pem");
    let yaml = format!(
        "server: {{tls: {{cert: '{}', key: '{}'}}}}\n",
        cert.display(),
        key.display()
    );
    // Parsed as if the config lived elsewhere: absolute paths do not depend on it.
    let cfg = parse_str(Path::new("/nonexistent/routes.yaml"), &yaml).unwrap();
    assert_eq!(cfg.server.tls.unwrap().cert, cert);
}

#[test]
fn no_tls_by_default_and_summary_says_plain() {
    let f = Files::new();
    let cfg = f.parse("routes: []\n").unwrap();
    assert!(cfg.server.tls.is_none() && cfg.server.upstream_ca.is_none());
    assert!(summary(&cfg).contains("(plain HTTP/1.1 and h2c)"));
    assert!(!summary(&cfg).contains("upstream https"));
}

#[test]
fn missing_files_are_refused_at_their_value() {
    let f = Files::new();
    f.err(
        &tls("nope.pem", "key.pem"),
        3,
        11,
        "tls.cert: cannot read `",
    );
    f.err(
        &tls("cert.pem", "nope.pem"),
        4,
        10,
        "tls.key: cannot read `",
    );
    let e = f.parse(&tls("nope.pem", "key.pem")).unwrap_err();
    assert!(
        e.message
            .contains(&f.path("nope.pem").display().to_string()),
        "{e}"
    );
    f.err(
        &lines(&["server:", "  upstream_ca: nope.pem"]),
        2,
        16,
        "upstream_ca: cannot read `",
    );
}

#[test]
fn files_without_the_expected_pem_are_refused() {
    let f = Files::new();
    f.err(&tls("key.pem", "key.pem"), 3, 11, "holds no certificate");
    f.err(&tls("junk.pem", "key.pem"), 3, 11, "holds no certificate");
    f.err(&tls("cert.pem", "ca.pem"), 4, 10, "holds no private key");
    f.err(
        &lines(&["server:", "  upstream_ca: key.pem"]),
        2,
        16,
        "upstream_ca: `",
    );
}

#[test]
fn a_key_of_another_certificate_is_refused_at_the_key() {
    let f = Files::new();
    f.err(
        &tls("cert.pem", "other-key.pem"),
        4,
        10,
        "tls.key: the key does not belong to the certificate",
    );
}

#[test]
fn tls_needs_both_files_and_no_empty_path() {
    let f = Files::new();
    f.err(
        &lines(&["server:", "  tls:", "    cert: cert.pem"]),
        3,
        5,
        "tls needs both `cert: PATH`",
    );
    f.err("server: {tls: {key: key.pem}}\n", 1, 15, "tls needs both");
    f.err(&tls("''", "key.pem"), 3, 11, "tls.cert is empty");
    f.err(
        &lines(&[
            "server:",
            "  tls:",
            "    cert: cert.pem",
            "    key: key.pem",
            "    ca: ca.pem",
        ]),
        5,
        5,
        "unknown field `ca`",
    );
}
