//! Keys and answers by consumer: `ip_prefix` keys on real sockets (IPv6 clients presented
//! through a trusted proxy's `X-Forwarded-For`), and routes' own `rejection:` answers with
//! their legacy `X-RateLimit-*` fields, the same from both codecs; local and global.

use std::sync::OnceLock;

use crate::support::redis::RedisServer;
use crate::support::upstream::Upstream;
use crate::support::{Gateway, client};
use tollgate::limit::clock::ManualClock;

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

/// Two routes with their own rejections: a problem+json 429 with legacy fields, and a
/// text/plain 503 without. `scope` and `redis` as the limits need.
fn rejections(up: &Upstream, scope: &str, redis: Option<&RedisServer>, prefix: &str) -> String {
    let redis = redis.map_or(String::new(), |r| {
        format!(
            "redis:\n  url: {}\n  timeout: 2s\n  on_error: deny\n",
            r.url()
        )
    });
    format!(
        r#"server:
  listen: 127.0.0.1:0
  admin: 127.0.0.1:0
{redis}routes:
  - name: {prefix}json
    match:
      path_prefix: /json
    upstream: {up}
    rejection:
      status: 429
      content_type: application/problem+json
      body: '{{"type":"slow","route":"{{route}}","limit":"{{limit}}","retry_after":{{retry_after}},"ms":{{retry_after_ms}},"braces":"{{{{}}}}"}}'
      legacy_headers: true
    limits:
      - name: per-ip
        rate: 2/1h
        scope: {scope}
  - name: {prefix}text
    match:
      path_prefix: /text
    upstream: {up}
    rejection:
      status: 503
      content_type: text/plain; charset=utf-8
      body: "busy: {{route}}/{{limit}}, retry in {{retry_after}}s\n"
    limits:
      - name: per-ip
        rate: 1/1h
        scope: {scope}
"#,
        up = up.url()
    )
}

/// What a client sees of one answer, for comparing the codecs'.
#[derive(Debug, PartialEq)]
struct Seen {
    status: u16,
    fields: Vec<(&'static str, Option<String>)>,
    body: String,
}

impl Seen {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.as_deref())
    }
}

async fn seen(g: &Gateway, path: &str) -> Seen {
    let r = client().get(g.url(path)).send().await.unwrap();
    let status = r.status().as_u16();
    let fields = [
        "content-type",
        "retry-after",
        "ratelimit-policy",
        "ratelimit",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ]
    .into_iter()
    .map(|n| {
        let v = r.headers().get(n).map(|v| v.to_str().unwrap().to_owned());
        (n, v)
    })
    .collect();
    let mut body = r.text().await.unwrap();
    if status == 200 {
        // The upstream's echo names its own connection: not what is compared.
        body.clear();
    }
    Seen {
        status,
        fields,
        body,
    }
}

/// The fast codec and hyper give one answer, field for field and byte for byte, on a clock
/// that does not move: status, content type, body, `Retry-After`, the IETF fields, and the
/// legacy ones on 429s and admitted responses alike.
#[tokio::test]
async fn custom_rejections_are_the_same_from_both_codecs() {
    let up = Upstream::start().await;
    let yaml = rejections(&up, "local", None, "");
    let mut answers = Vec::new();
    for yaml in [
        yaml.clone(),
        yaml.replace(
            "  admin: 127.0.0.1:0\n",
            "  admin: 127.0.0.1:0\n  fast_path: false\n",
        ),
    ] {
        let clock = std::sync::Arc::new(ManualClock::new(1_000_000_000_000));
        let g = Gateway::start_with_clock(&yaml, clock).await;
        let mut seq = Vec::new();
        for path in ["/json", "/json", "/json", "/text", "/text"] {
            seq.push(seen(&g, path).await);
        }
        answers.push(seq);
        g.stop().await;
    }
    assert_eq!(answers[0], answers[1], "the fast codec's, then hyper's");
    let a = &answers[0];
    // Admitted: legacy fields beside the IETF ones.
    assert_eq!(a[0].status, 200);
    assert_eq!(a[0].field("ratelimit"), Some("\"per-ip\";r=1;t=1800"));
    assert_eq!(a[0].field("x-ratelimit-limit"), Some("2"));
    assert_eq!(a[0].field("x-ratelimit-remaining"), Some("1"));
    assert_eq!(a[0].field("x-ratelimit-reset"), Some("1800"));
    assert_eq!(a[1].field("x-ratelimit-remaining"), Some("0"));
    assert_eq!(a[1].field("x-ratelimit-reset"), Some("3600"));
    // The custom 429.
    let r = &a[2];
    assert_eq!(r.status, 429);
    assert_eq!(r.field("content-type"), Some("application/problem+json"));
    assert_eq!(r.field("retry-after"), Some("1800"));
    assert_eq!(r.field("ratelimit-policy"), Some("\"per-ip\";q=2;w=3600"));
    assert_eq!(r.field("ratelimit"), Some("\"per-ip\";r=0;t=1800"));
    assert_eq!(r.field("x-ratelimit-limit"), Some("2"));
    assert_eq!(r.field("x-ratelimit-remaining"), Some("0"));
    assert_eq!(r.field("x-ratelimit-reset"), Some("3600"));
    assert_eq!(
        r.body,
        r#"{"type":"slow","route":"json","limit":"per-ip","retry_after":1800,"ms":1800000,"braces":"{}"}"#
    );
    // The custom 503, in plain text, without legacy fields.
    assert_eq!(a[3].status, 200);
    assert_eq!(a[3].field("x-ratelimit-limit"), None);
    let r = &a[4];
    assert_eq!(r.status, 503);
    assert_eq!(r.field("content-type"), Some("text/plain; charset=utf-8"));
    assert_eq!(r.field("retry-after"), Some("3600"));
    assert_eq!(r.field("ratelimit"), Some("\"per-ip\";r=0;t=3600"));
    assert_eq!(r.field("x-ratelimit-limit"), None);
    assert_eq!(r.body, "busy: text/per-ip, retry in 3600s\n");
}

/// The same answers with the limits in Redis (whose clock moves: the waits are compared with
/// a second's slack, the rest exactly), from both codecs.
#[tokio::test]
async fn custom_rejections_of_global_limits() {
    let up = Upstream::start().await;
    let redis = shared_redis();
    for (n, fast) in [(0, true), (1, false)] {
        let mut yaml = rejections(&up, "global", Some(redis), &format!("rej{n}-"));
        if !fast {
            yaml = yaml.replace(
                "  admin: 127.0.0.1:0\n",
                "  admin: 127.0.0.1:0\n  fast_path: false\n",
            );
        }
        let g = Gateway::start(&yaml).await;
        let a0 = seen(&g, "/json").await;
        assert_eq!(a0.status, 200, "fast {fast}");
        assert_eq!(a0.field("x-ratelimit-limit"), Some("2"), "fast {fast}");
        assert_eq!(a0.field("x-ratelimit-remaining"), Some("1"), "fast {fast}");
        seen(&g, "/json").await;
        let r = seen(&g, "/json").await;
        assert_eq!(r.status, 429, "fast {fast}");
        assert_eq!(r.field("content-type"), Some("application/problem+json"));
        assert_eq!(r.field("x-ratelimit-limit"), Some("2"), "fast {fast}");
        assert_eq!(r.field("x-ratelimit-remaining"), Some("0"), "fast {fast}");
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["route"], format!("rej{n}-json"));
        assert_eq!(v["limit"], "per-ip");
        let secs = v["retry_after"].as_u64().unwrap();
        assert!((1799..=1800).contains(&secs), "{v}");
        assert_eq!(r.field("retry-after"), Some(secs.to_string().as_str()));
        seen(&g, "/text").await;
        let r = seen(&g, "/text").await;
        assert_eq!(r.status, 503, "fast {fast}");
        assert!(
            r.body
                .starts_with(&format!("busy: rej{n}-text/per-ip, retry in ")),
            "{}",
            r.body
        );
        g.stop().await;
    }
}
