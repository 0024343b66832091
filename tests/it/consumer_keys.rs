//! Keys and answers by consumer: `ip_prefix` keys on real sockets (IPv6 clients presented
//! through a trusted proxy's `X-Forwarded-For`), local and global.

use std::sync::OnceLock;

use crate::support::redis::RedisServer;
use crate::support::upstream::Upstream;
use crate::support::{Gateway, client};

fn shared_redis() -> &'static RedisServer {
    static R: OnceLock<RedisServer> = OnceLock::new();
    R.get_or_init(RedisServer::start)
}

/// One route `name` to `up` behind a trusted loopback proxy, with `limits` (and `redis`, for
/// global ones).
fn config(name: &str, up: &Upstream, redis: Option<&RedisServer>, limits: &str) -> String {
    let redis = redis.map_or(String::new(), |r| {
        format!(
            "redis:\n  url: {}\n  timeout: 2s\n  on_error: deny\n",
            r.url()
        )
    });
    format!(
        "server:\n  listen: 127.0.0.1:0\n  admin: 127.0.0.1:0\n  trusted_proxies: [127.0.0.0/8]\n{redis}routes:\n  - name: {name}\n    upstream: {}\n    limits:\n{limits}",
        up.url()
    )
}

/// Two addresses in one /64 draw on one budget; an address in the next /64 has its own; IPv4
/// clients are keyed by their /24. The same with the state in process and in Redis.
#[tokio::test]
async fn addresses_in_one_prefix_share_a_budget() {
    let up = Upstream::start().await;
    for (name, scope, redis) in [
        ("prefix-local", "local", None),
        ("prefix-global", "global", Some(shared_redis())),
    ] {
        let limits = format!(
            "      - name: per-net\n        key: [\"ip_prefix:24,64\"]\n        rate: 2/1h\n        scope: {scope}\n"
        );
        let g = Gateway::start(&config(name, &up, redis, &limits)).await;
        let c = client();
        let send = |xff: &'static str| {
            let req = c.get(g.url("/")).header("x-forwarded-for", xff).send();
            async move { req.await.unwrap() }
        };
        assert_eq!(send("2001:db8:1:2::1").await.status(), 200, "{scope}");
        let r = send("2001:db8:1:2:ffff:ffff:ffff:ffff").await;
        assert_eq!(r.status(), 200, "{scope}");
        assert_eq!(
            r.headers()["ratelimit"],
            "\"per-net\";r=0;t=3600",
            "{scope}"
        );
        // A third address of the same /64: the budget is spent.
        let r = send("2001:db8:1:2:abcd::9").await;
        assert_eq!(r.status(), 429, "{scope}");
        assert!(r.headers().contains_key("retry-after"), "{scope}");
        // The next /64 is another client.
        assert_eq!(send("2001:db8:1:3::1").await.status(), 200, "{scope}");
        // IPv4 by /24, and an IPv4-mapped address is the same client.
        assert_eq!(send("198.51.100.1").await.status(), 200, "{scope}");
        assert_eq!(send("::ffff:198.51.100.200").await.status(), 200, "{scope}");
        assert_eq!(send("198.51.100.77").await.status(), 429, "{scope}");
        assert_eq!(send("198.51.101.1").await.status(), 200, "{scope}");
        // The admin API shows the key in CIDR form.
        let s = g
            .admin_json(&format!(
                "/admin/limits/{name}/per-net?key=2001:db8:1:2::/64"
            ))
            .await;
        assert_eq!(s["remaining"], 0, "{scope}: {s}");
        g.stop().await;
    }
}
