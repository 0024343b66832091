//! Consumers' plans on the request path: what resolving a request's key to its rate costs with
//! a 1,000,000-entry overrides file, alone and behind five inline overrides, against a limit
//! without overrides (nothing to resolve). Also prints, once, the file's load time and the
//! table's bytes per entry. Run with `cargo bench --bench overrides`; the whole-process
//! figures (RSS, reload time) come from `bench/overrides.sh`.

use std::hint::black_box;
use std::net::IpAddr;
use std::path::Path;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use http::{HeaderMap, Method, Uri};
use tollgate::config::LimitConfig;
use tollgate::key::RequestParts;
use tollgate::limit::overrides::{Overrides, compile};

/// The gateway's allocator, as in production.
#[global_allocator]
static ALLOC: tollgate::alloc::HugePages = tollgate::alloc::HugePages;

const ENTRIES: usize = 1_000_000;

/// The i-th key of the file: a key like an export's (`key-0000042-00a1b2c3d4`).
fn key(i: usize) -> String {
    format!("key-{i:07}-{:010x}", (i as u64 * 2_654_435_761) % (1 << 40))
}

/// A config whose limit `l` has an overrides file of [`ENTRIES`] keys and, when `inline`, five
/// overrides before it (none of which the benchmark's requests meet).
fn limit(dir: &Path, inline: bool) -> LimitConfig {
    let file = dir.join("consumers.yaml");
    if !file.exists() {
        let mut text = String::with_capacity(ENTRIES * 30);
        for i in 0..ENTRIES {
            text.push_str(&key(i));
            text.push_str(if i % 3 == 0 { ": exempt\n" } else { ": pro\n" });
        }
        std::fs::write(&file, text).unwrap();
    }
    let overrides = if inline {
        "        overrides:
          - when: { ip: [10.0.0.0/8] }
            exempt: true
          - when: { ip: [\"2001:db8::/32\", 192.0.2.0/24] }
            plan: pro
          - when: { key: [acme] }
            plan: pro
          - when: { key: [beta, gamma] }
            exempt: true
          - when: { header: { x-plan: pro } }
            plan: pro
"
    } else {
        ""
    };
    let yaml = format!(
        "server:
  trusted_proxies: [127.0.0.1/32]
plans:
  pro: {{ rate: 600/1m }}
routes:
  - name: r
    upstream: http://127.0.0.1:9
    limits:
      - name: l
        key: [header:x-api-key]
        rate: 60/1m
{overrides}        overrides_file: {}
",
        file.display()
    );
    let path = dir.join("routes.yaml");
    std::fs::write(&path, &yaml).unwrap();
    let started = Instant::now();
    let cfg = tollgate::config::load(&path).unwrap();
    if !inline {
        let table = &cfg.routes[0].limits[0]
            .overrides_file
            .as_ref()
            .unwrap()
            .table;
        eprintln!(
            "load: {ENTRIES} entries in {:.0} ms; table {} bytes on the heap, {:.1} bytes per entry",
            started.elapsed().as_secs_f64() * 1e3,
            table.heap_bytes(),
            table.heap_bytes() as f64 / table.len() as f64
        );
    }
    cfg.routes[0].limits[0].clone()
}

fn resolve(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("tollgate-bench-overrides-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file_only = compile(&limit(&dir, false)).1.unwrap();
    let with_inline = compile(&limit(&dir, true)).1.unwrap();
    let _ = std::fs::remove_dir_all(&dir);

    let method = Method::GET;
    let uri = Uri::from_static("/");
    let headers = HeaderMap::new();
    let parts = RequestParts {
        method: &method,
        uri: &uri,
        headers: &headers,
        client_ip: IpAddr::from([127, 0, 0, 1]),
        client_ip_text: None,
        route: "r",
        peer_trusted: true,
    };
    let hit = key(ENTRIES / 2);
    let miss = "key-9999999-ffffffffff".to_owned();
    let mut group = c.benchmark_group("overrides");
    let mut run = |id: &str, o: &Overrides, key: &str| {
        group.bench_function(id, |b| {
            b.iter(|| o.resolve(black_box(&parts), black_box(key.as_bytes())))
        });
    };
    run("file_hit", &file_only, &hit);
    run("file_miss", &file_only, &miss);
    run("five_inline_then_file_hit", &with_inline, &hit);
    run("five_inline_then_file_miss", &with_inline, &miss);
    group.finish();
}

criterion_group!(benches, resolve);
criterion_main!(benches);
