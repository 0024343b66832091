//! Bounded memory under key floods (`server.max_keys`): a client rotating its key through a
//! real gateway makes the in-process stores evict, never past the cap, never an honest client's
//! state first, and every eviction is counted in `/metrics` (which promtool accepts); `tollgate
//! check` says what the cap is and refuses a bad one at its line and column.

use std::process::Command;
use std::sync::OnceLock;

use futures_util::StreamExt;

use crate::support::redis::RedisServer;
use crate::support::upstream::Upstream;
use crate::support::{Gateway, TempDir, client, metric};

const MAX_KEYS: usize = 1024;

/// Distinct keys the flood sends, one request each: nearly five times the cap.
const FLOOD: usize = 5_000;

fn shared_redis() -> &'static RedisServer {
    static R: OnceLock<RedisServer> = OnceLock::new();
    R.get_or_init(RedisServer::start)
}

/// One route `flood` keyed by `x-user`, 10 per hour (an hour: nothing comes back to full while
/// the test runs), in `scope`.
fn config(up: &Upstream, redis: Option<&RedisServer>, scope: &str) -> String {
    let redis = redis.map_or(String::new(), |r| {
        format!("redis:\n  url: {}\n  timeout: 2s\n", r.url())
    });
    format!(
        "server:\n  max_keys: {MAX_KEYS}\n{redis}routes:\n  - name: flood\n    upstream: {}\n    limits:\n      - name: per-user\n        key: [header:x-user]\n        rate: 10/1h\n        scope: {scope}\n",
        up.url()
    )
}

/// The status of one request as `user`.
async fn send(g: &Gateway, c: &reqwest::Client, user: &str) -> u16 {
    c.get(g.url("/"))
        .header("x-user", user)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// [`FLOOD`] distinct users (`prefix-N`), one request each, eight at a time; every one admitted.
async fn flood(g: &Gateway, c: &reqwest::Client, prefix: &str) {
    let statuses: Vec<u16> = futures_util::stream::iter(0..FLOOD)
        .map(|i| {
            let user = format!("{prefix}-{i}");
            async move { send(g, c, &user).await }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert!(
        statuses.iter().all(|&s| s == 200),
        "a fresh key is admitted"
    );
}

/// `/metrics` once the sweeper has reported what `pred` waits for (it runs every second).
async fn metrics_when(g: &Gateway, pred: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let text = g.metrics().await;
        if pred(&text) {
            return text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "metrics never showed it:\n{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

fn series(text: &str, name: &str, store: &str) -> f64 {
    metric(text, &format!("{name}{{store=\"{store}\"}}"))
        .unwrap_or_else(|| panic!("no {name}{{store=\"{store}\"}}:\n{text}"))
}

/// `promtool check metrics` (its linter) on a scrape.
fn promtool_accepts(text: &str) {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool not found: apt-get install -y prometheus");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A local limit: the honest client took 9 of its 10 units before the flood; after five times
/// the cap in fresh keys it has exactly one left, as it would without the flood. The store never
/// held more than the cap, and every key it does not hold was counted as evicted.
#[tokio::test]
async fn a_flood_of_fresh_keys_past_max_keys_never_resets_an_honest_client() {
    let up = Upstream::start().await;
    // Frozen time: no key comes back to full, so every key not held was evicted.
    let (g, _clock) = Gateway::start_manual(&config(&up, None, "local")).await;
    let c = client();
    for _ in 0..9 {
        assert_eq!(send(&g, &c, "alice").await, 200);
    }
    flood(&g, &c, "flood").await;
    assert_eq!(send(&g, &c, "alice").await, 200, "her tenth unit");
    assert_eq!(
        send(&g, &c, "alice").await,
        429,
        "her state survived the flood"
    );

    // Every key is held or was evicted, once a sweep after the flood has counted them.
    let text = metrics_when(&g, |t| {
        let held = series(t, "tollgate_limit_keys", "local");
        assert!(held <= MAX_KEYS as f64, "{held} held");
        held + series(t, "tollgate_limit_keys_evicted_total", "local") == (FLOOD + 1) as f64
    })
    .await;
    let held = series(&text, "tollgate_limit_keys", "local");
    assert!(held > (MAX_KEYS / 2) as f64, "{held}");
    assert_eq!(series(&text, "tollgate_limit_keys", "deny_tier"), 0.0);
    assert_eq!(
        metric(&text, "tollgate_limit_keys_max"),
        Some(MAX_KEYS as f64)
    );
    assert_eq!(metric(&text, "tollgate_local_keys"), Some(held));
    assert!(!text.contains("flood-"), "no label holds a client key");
    promtool_accepts(&text);
    g.stop().await;
}

/// A strict global limit: Redis decides, so the honest client stays limited whatever the
/// in-process tier forgets; the flood's keys (each learned by the tier, since a 1-unit burst
/// is used up by one request) make the tier evict, counted as `store="deny_tier"`, and it never
/// holds more than the cap.
#[tokio::test]
async fn a_flood_through_a_global_limit_evicts_from_the_tier_and_redis_still_decides() {
    let up = Upstream::start().await;
    let redis = shared_redis();
    let yaml = config(&up, Some(redis), "global").replace("rate: 10/1h", "rate: 1/1h");
    let g = Gateway::start(&yaml).await;
    let c = client();
    assert_eq!(send(&g, &c, "bob").await, 200);
    assert_eq!(send(&g, &c, "bob").await, 429);
    flood(&g, &c, "global-flood").await;
    assert_eq!(send(&g, &c, "bob").await, 429, "Redis still rejects him");
    // The tier learned every flood key's used-up burst (and bob's, once or twice: evicted, his
    // last request learned it again); those it no longer holds were evicted (none has expired
    // within the hour), once a sweep has counted them.
    let text = metrics_when(&g, |t| {
        let held = series(t, "tollgate_limit_keys", "deny_tier");
        assert!(held <= MAX_KEYS as f64, "{held} held");
        held + series(t, "tollgate_limit_keys_evicted_total", "deny_tier") >= (FLOOD + 1) as f64
    })
    .await;
    promtool_accepts(&text);
    g.stop().await;
}

/// `tollgate check` states the cap and where it came from, and refuses one too small at its
/// line and column.
#[test]
fn check_shows_the_cap_and_refuses_a_bad_one() {
    let dir = TempDir::new();
    let path = dir.path.join("routes.yaml");
    let run = |yaml: &str| {
        std::fs::write(&path, yaml).unwrap();
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["check", "--config", path.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let out = run("server:\n  max_keys: 200000\nroutes: []\n");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("keys     at most 200,000 held in process (max_keys; about 48.8 MiB"),
        "{stdout}"
    );
    let out = run("routes: []\n");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("(default: 1/16 of "), "{stdout}");
    let out = run("server:\n  max_keys: 10\nroutes: []\n");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "{}:2:13: max_keys 10 is too small",
            path.display()
        )),
        "{stderr}"
    );
}
