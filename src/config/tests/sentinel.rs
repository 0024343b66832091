//! `redis.sentinel`: the third way to name Redis, what it refuses and where, and how `check`
//! and `/admin/config` show it.

use super::super::redis::sentinel_config;
use super::super::{RedisTarget, SentinelTarget, summary};
use super::{assert_err, lines, ok};

fn sentinel(block: &[&str]) -> String {
    let mut all = vec!["redis:", "  sentinel:"];
    all.extend(block);
    all.push("routes: []");
    lines(&all)
}

#[test]
fn a_master_behind_sentinels() {
    let yaml = sentinel(&[
        "    master: mymaster",
        "    nodes: [redis://10.0.0.1:26379, 'redis://s2', 'redis://s3:26380/']",
        "    username: app",
        "    password: s3cret",
    ]);
    let cfg = ok(&yaml);
    let target = SentinelTarget {
        master: "mymaster".into(),
        nodes: vec![
            "redis://10.0.0.1:26379".into(),
            "redis://s2".into(),
            "redis://s3:26380/".into(),
        ],
        username: Some("app".into()),
        password: Some("s3cret".into()),
    };
    assert_eq!(
        cfg.redis.as_ref().unwrap().target,
        RedisTarget::Sentinel(target.clone())
    );
    // What the store connects with: the sentinels at their ports (26379 when left out), the
    // master's credentials apart from theirs.
    let fred = sentinel_config(&target).unwrap();
    let fred::prelude::ServerConfig::Sentinel {
        hosts,
        service_name,
        username,
        password,
    } = fred.server
    else {
        panic!("not a sentinel config: {:?}", fred.server)
    };
    let hosts: Vec<(String, u16)> = hosts.iter().map(|s| (s.host.to_string(), s.port)).collect();
    assert_eq!(
        hosts,
        [
            ("10.0.0.1".to_string(), 26379),
            ("s2".to_string(), 26379),
            ("s3".to_string(), 26380)
        ]
    );
    assert_eq!(service_name, "mymaster");
    assert_eq!((username, password), (None, None));
    assert_eq!(fred.username.as_deref(), Some("app"));
    assert_eq!(fred.password.as_deref(), Some("s3cret"));
}

#[test]
fn sentinel_credentials_come_from_the_node_urls() {
    let yaml = sentinel(&[
        "    master: m",
        "    nodes: ['redis://:sentpw@s1:26379', 'redis://:sentpw@s2:26379']",
    ]);
    let Some(RedisTarget::Sentinel(target)) = ok(&yaml).redis.map(|r| r.target) else {
        panic!("not a sentinel target")
    };
    let fred = sentinel_config(&target).unwrap();
    let fred::prelude::ServerConfig::Sentinel { password, .. } = &fred.server else {
        panic!("not a sentinel config")
    };
    assert_eq!(password.as_deref(), Some("sentpw"));
    assert_eq!(
        fred.password, None,
        "the master's password is not the sentinels'"
    );
}

#[test]
fn two_ways_of_naming_redis_are_refused_at_the_second() {
    let yaml = lines(&[
        "redis:",
        "  url: redis://a:6379",
        "  sentinel: {master: m, nodes: [redis://s:26379]}",
    ]);
    assert_err(&yaml, 3, 13, "redis has both `url` and `sentinel`");
    let yaml = lines(&[
        "redis:",
        "  sentinel: {master: m, nodes: [redis://s:26379]}",
        "  cluster: [redis://b:7000]",
    ]);
    assert_err(&yaml, 3, 12, "redis has both `sentinel` and `cluster`");
}

#[test]
fn a_sentinel_block_needs_a_master_and_nodes() {
    let yaml = sentinel(&["    nodes: [redis://s:26379]"]);
    assert_err(&yaml, 3, 5, "sentinel needs `master: NAME`");
    let yaml = sentinel(&["    master: m"]);
    assert_err(&yaml, 3, 5, "sentinel needs `nodes:");
    let yaml = sentinel(&["    master: m", "    nodes: []"]);
    assert_err(&yaml, 4, 12, "sentinel lists no node");
    let yaml = sentinel(&["    master: 'my master'", "    nodes: [redis://s]"]);
    assert_err(&yaml, 3, 13, "visible ASCII without spaces");
    let yaml = sentinel(&["    master: m", "    nodes: [redis://s]", "    mastr: x"]);
    assert_err(&yaml, 5, 5, "unknown field `mastr`");
}

#[test]
fn a_node_url_that_does_not_parse_is_refused_at_the_node() {
    for (node, why) in [
        ("http://s:26379", "expected redis:// or rediss://"),
        ("s:26379", "expected redis:// or rediss://"),
        ("redis://s:99999", "InvalidPort"),
        ("redis://[bad", "InvalidIpv6Address"),
        ("redis://s:26379/0", "nothing after the port"),
        ("redis://s:26379?x=1", "nothing after the port"),
        ("redis://:26379", "no host"),
    ] {
        let yaml = sentinel(&[
            "    master: m",
            "    nodes:",
            "      - redis://ok:26379",
            &format!("      - \"{node}\""),
        ]);
        assert_err(&yaml, 6, 9, why);
    }
}

#[test]
fn nodes_with_different_credentials_or_schemes_are_refused() {
    let yaml = sentinel(&[
        "    master: m",
        "    nodes: ['redis://:a@s1', 'redis://:b@s2']",
    ]);
    assert_err(&yaml, 4, 30, "same credentials");
    let yaml = sentinel(&["    master: m", "    nodes: ['redis://s1', 'rediss://s2']"]);
    assert_err(&yaml, 4, 27, "same scheme");
}

#[test]
fn a_master_username_needs_a_password() {
    let yaml = sentinel(&[
        "    master: m",
        "    nodes: [redis://s]",
        "    username: app",
    ]);
    assert_err(&yaml, 5, 15, "username without a password");
    let yaml = sentinel(&[
        "    master: m",
        "    nodes: [redis://s]",
        "    password: ''",
    ]);
    assert_err(&yaml, 5, 15, "empty");
}

#[test]
fn check_and_admin_config_show_the_master_and_nodes_without_secrets() {
    let yaml = sentinel(&[
        "    master: mymaster",
        "    nodes: ['redis://:sentpw@s1:26379', 'redis://:sentpw@s2:26379']",
        "    password: masterpw",
    ]);
    let cfg = ok(&yaml);
    let text = summary(&cfg);
    assert!(
        text.contains(
            "redis    sentinel master mymaster via redis://<redacted>@s1:26379, redis://<redacted>@s2:26379 (master password set); timeout 50ms"
        ),
        "{text}"
    );
    assert!(!text.contains("pw"), "{text}");
    let json = serde_json::to_value(&cfg).unwrap();
    assert_eq!(
        json["redis"]["sentinel"],
        serde_json::json!({
            "master": "mymaster",
            "nodes": ["redis://<redacted>@s1:26379", "redis://<redacted>@s2:26379"],
            "password": "<redacted>",
        })
    );
    // Saved as a file, the placeholders are refused where they stand.
    let e = super::parse(&json.to_string()).unwrap_err();
    assert!(e.message.contains("placeholder"), "{e}");
    // Without secrets it loads back to itself.
    let plain = ok(&sentinel(&[
        "    master: mymaster",
        "    nodes: [redis://s1:26379]",
    ]));
    let json = serde_json::to_string(&plain).unwrap();
    assert_eq!(super::parse(&json).unwrap(), plain);
}
