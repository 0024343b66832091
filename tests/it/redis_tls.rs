//! `rediss://` speaks TLS, whichever way Redis is named: one server (`url`) or a master behind
//! Sentinel (`sentinel.nodes`), the sentinels and the master both over TLS. Certificates are
//! verified against the system's roots, which the gateway (a child process here) is pointed at
//! with `SSL_CERT_FILE`: the test CA trusted, decisions are made in Redis; another CA trusted,
//! Redis cannot be used and `on_error: deny` answers 503.

use crate::support::process::Proc;
use crate::support::redis::{RedisSentinel, RedisServer, RedisTls};
use crate::support::tls::Pki;
use crate::support::upstream::Upstream;
use crate::support::{TempDir, client};

fn yaml(target: &str, timeout: &str, upstream: &str) -> String {
    format!(
        "server:\n  listen: 127.0.0.1:PROXY_PORT\n  admin: 127.0.0.1:ADMIN_PORT\nredis:\n  {target}\n  timeout: {timeout}\n  on_error: deny\nroutes:\n  - name: tls\n    upstream: {upstream}\n    limits:\n      - name: l\n        key: [literal:k]\n        algorithm: sliding_log\n        rate: 3/1d\n"
    )
}

async fn statuses(p: &Proc, n: usize) -> Vec<u16> {
    let c = client();
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(
            c.get(format!("{}/", p.proxy))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_speaks_tls_to_a_server_and_to_sentinels_and_their_master() {
    let dir = TempDir::new();
    let pki = Pki::new().write(&dir.path);
    let tls = RedisTls {
        ca: pki.ca.clone(),
        cert: pki.cert,
        key: pki.key,
    };
    let other = TempDir::new();
    let other_ca = Pki::named("another CA").write(&other.path).ca;
    let server = RedisServer::start_tls(&tls, &[]);
    let setup = RedisSentinel::start_tls("tls", &tls);
    assert!(setup.sentinel_urls()[0].starts_with("rediss://"));
    let up = Upstream::start().await;
    let cases = [
        (
            format!("url: rediss://127.0.0.1:{}", server.tls_port().unwrap()),
            &server,
        ),
        (setup.yaml(), setup.server(setup.master_port())),
    ];
    for (target, redis) in cases {
        let ca = pki.ca.to_str().unwrap();
        let config = yaml(&target, "2s", &up.url());
        let trusted = Proc::start(&config, &[], &[("SSL_CERT_FILE", ca)], false).await;
        assert_eq!(
            statuses(&trusted, 5).await,
            [200, 200, 200, 429, 429],
            "{target}"
        );
        // The budget lives in that Redis, reached only over its TLS port.
        let keys = redis.cli(&["--scan", "--pattern", "tg:{tls/l/k}*"]);
        assert!(!keys.is_empty(), "{target}: no keys");
        redis.cli(&["DEL", "tg:{tls/l/k}:log", "tg:{tls/l/k}:log:meta"]);

        let untrusted = other_ca.to_str().unwrap();
        let config = yaml(&target, "200ms", &up.url());
        let refused = Proc::start(&config, &[], &[("SSL_CERT_FILE", untrusted)], false).await;
        assert_eq!(
            statuses(&refused, 2).await,
            [503, 503],
            "{target}: a certificate from an untrusted CA"
        );
    }
}
