//! Memory of a key flood against `server.max_keys`: drives one local store as the request path
//! does (`local::decide`, the gateway's allocator), with KEYS distinct keys one request each,
//! and prints the process's resident memory, the keys held, the evictions and the time per
//! decision below and at the cap.
//!
//!   cargo bench --bench keymem -- --keys 10000000                     # the default cap
//!   cargo bench --bench keymem -- --keys 10000000 --max-keys 1000000
//!   cargo bench --bench keymem -- --keys 1000000 --max-keys none      # no cap, for comparison
//!
//! Run without `--bench` (as `cargo test --all-targets` does) and without `--keys`, it floods
//! 20,000 keys against a cap of 1,024 and checks that every key is held or was evicted.
//!
//! One run per process, so each figure starts from the same empty heap. Results and the runs
//! that produced them: docs/benchmarks.md, "Bounded memory under key floods".

use std::net::IpAddr;
use std::time::Instant;

use tollgate::key::{IP_TEXT_MAX, ip_text};
use tollgate::limit::algorithm::{Algorithm, Gcra, Micros, Quota};
use tollgate::limit::budget::{BYTES_PER_KEY, default_max_keys};
use tollgate::limit::local::{self, LocalCheck, LocalStore};

#[global_allocator]
static ALLOC: tollgate::alloc::HugePages = tollgate::alloc::HugePages;

/// `VmRSS` and `VmHWM` of this process, in bytes.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// Key `i` as the gateway builds an `ip` key: IPv4 text (up to 15 bytes: inside the entry), or
/// with `--v6` the full 39-byte text of a rotated IPv6 address (no zero group to compress), which
/// spills out of the entry into its own allocation, as a flood of IPv6 clients' keys does.
fn decide(store: &LocalStore, alg: &Algorithm, i: u64, v6: bool, now: Micros) -> bool {
    let mut buf = [0; IP_TEXT_MAX];
    let ip = if v6 {
        let g = |shift: u32| 0x1000 | ((i >> shift) as u16 & 0x0fff);
        IpAddr::from([0x2001, 0xdb8, 0x85a3, 0x8a2e, g(36), g(24), g(12), g(0)])
    } else {
        IpAddr::from([
            10 + (i >> 24) as u8,
            (i >> 16) as u8,
            (i >> 8) as u8,
            i as u8,
        ])
    };
    let check = [LocalCheck {
        store,
        algorithm: alg,
        key: ip_text(ip, &mut buf),
        cost: 1,
        max_delay: 0,
        shadow: false,
    }];
    local::decide(&check, now).0
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this without it: then, unless
    // told otherwise, a quick smoke run against a small cap instead of ten million keys.
    let bench = args.iter().any(|a| a == "--bench");
    let mut keys: u64 = if bench { 10_000_000 } else { 20_000 };
    let mut max_keys = Some(if bench {
        default_max_keys().keys
    } else {
        1_024
    });
    let mut v6 = false;
    let mut args = args.into_iter();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--keys" => keys = args.next().and_then(|v| v.parse().ok()).expect("--keys N"),
            "--max-keys" => {
                max_keys = match args.next().as_deref() {
                    Some("none") => None,
                    Some("default") => Some(default_max_keys().keys),
                    Some(n) => Some(n.parse().expect("--max-keys N|default|none")),
                    None => panic!("--max-keys N|default|none"),
                }
            }
            "--v6" => v6 = true,
            _ => {}
        }
    }
    // An hour's budget: no key comes back to full during the run, so every key is held until
    // the cap makes room.
    let alg = Algorithm::Gcra(Gcra::new(Quota {
        count: 100,
        period: 3_600_000_000,
        burst: 100,
    }));
    let store = LocalStore::new();
    if let Some(m) = max_keys {
        store.set_budget(m, &alg, 1);
    }
    let (before, _) = rss();
    let mut below: Option<(u64, f64)> = None;
    let started = Instant::now();
    let mut at_cap_from = None;
    for i in 0..keys {
        if at_cap_from.is_none() && max_keys.is_some_and(|m| i as usize >= m) {
            let ns = started.elapsed().as_nanos() as f64 / i as f64;
            below = Some((i, ns));
            at_cap_from = Some((i, Instant::now()));
        }
        assert!(decide(&store, &alg, i, v6, 1 + i));
    }
    let elapsed = started.elapsed();
    let (after, peak) = rss();
    let held = store.len() as u64;
    let evicted = store.take_evicted();
    assert_eq!(held + evicted, keys, "every key is held or was evicted");
    assert!(max_keys.is_none_or(|m| held <= m as u64), "{held} held");
    println!(
        "keys {keys} ({}), max_keys {}",
        if v6 {
            "IPv6 text, 39 bytes"
        } else {
            "IPv4 text"
        },
        max_keys.map_or("none".to_owned(), |m| m.to_string())
    );
    println!("held {held}, evicted {evicted}");
    println!(
        "rss {:.1} MiB (store {:.1} MiB over {:.1} MiB at start), peak {:.1} MiB",
        mib(after),
        mib(after.saturating_sub(before)),
        mib(before),
        mib(peak)
    );
    println!(
        "bytes per held key {:.0} (the default assumes {BYTES_PER_KEY})",
        after.saturating_sub(before) as f64 / held.max(1) as f64
    );
    match (below, at_cap_from) {
        (Some((n, ns)), Some((from, t))) => {
            let churn = t.elapsed().as_nanos() as f64 / (keys - from) as f64;
            println!("ns per new key: {ns:.0} below the cap ({n} keys), {churn:.0} at the cap");
        }
        _ => println!(
            "ns per new key: {:.0}",
            elapsed.as_nanos() as f64 / keys as f64
        ),
    }
}
