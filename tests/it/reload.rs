//! Hot reload: file watch (rename-saves and symlink swaps), the admin API, state kept across
//! reloads, bad files refused with the running config kept, and 100 reloads under load.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::upstream::Upstream;
use crate::support::{Gateway, client, metric};

fn cfg(upstream: &str, rate: &str) -> String {
    format!(
        "server:
  listen: 127.0.0.1:0
  admin: 127.0.0.1:0
routes:
  - name: api
    upstream: {upstream}
    limits:
      - name: per-ip
        algorithm: fixed_window
        rate: {rate}
"
    )
}

/// Writes like an editor: a temp file renamed over the config.
fn save(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("yaml.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn wait_for(mut cond: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond().await {
        assert!(Instant::now() < deadline, "condition not met within 5 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn reloads(g: &Gateway, result: &str) -> f64 {
    let m = g.metrics().await;
    metric(
        &m,
        &format!("tollgate_config_reloads_total{{result=\"{result}\"}}"),
    )
    .unwrap_or(0.0)
}

#[tokio::test]
async fn an_edited_file_is_applied_and_a_bad_one_is_refused_with_the_old_config_kept() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), "2/1h")).await;
    let c = client();
    assert_eq!(c.get(g.url("/")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(g.url("/")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(g.url("/")).send().await.unwrap().status(), 429);

    // A changed rate takes effect for the next decision.
    save(&g.config_path, &cfg(&up.url(), "100/1h"));
    wait_for(async || reloads(&g, "success").await >= 1.0).await;
    assert_eq!(c.get(g.url("/")).send().await.unwrap().status(), 200);

    // A bad file: logged, counted, refused; the running config stays.
    save(&g.config_path, &cfg(&up.url(), "100/fortnight"));
    wait_for(async || reloads(&g, "error").await >= 1.0).await;
    assert_eq!(c.get(g.url("/")).send().await.unwrap().status(), 200);
    let running: serde_json::Value = g.admin_json("/admin/config").await;
    assert_eq!(running["routes"][0]["limits"][0]["rate"], "100/1h");
    let r = c.post(g.admin_url("/admin/reload")).send().await.unwrap();
    assert_eq!(r.status(), 422);
    let body: serde_json::Value = r.json().await.unwrap();
    let err = body["error"].as_str().unwrap();
    assert!(
        err.starts_with(&format!("{}:10:15:", g.config_path.display())),
        "{err}"
    );
}

/// An editor saving in place truncates the file and then writes it. Read in between, the
/// gateway would run an empty config (every request 404) until the write; the watcher waits
/// for the directory to be quiet, and an empty file is refused, so requests never see it.
#[tokio::test]
async fn a_save_in_place_never_runs_the_truncated_file() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), "100000/1h")).await;
    let c = client();
    let stop = Arc::new(AtomicBool::new(false));
    let probe = {
        let (c, url, stop) = (c.clone(), g.url("/"), stop.clone());
        tokio::spawn(async move {
            let mut statuses = std::collections::BTreeMap::new();
            while !stop.load(Ordering::Relaxed) {
                let s = c.get(&url).send().await.unwrap().status().as_u16();
                *statuses.entry(s).or_insert(0u32) += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            statuses
        })
    };
    let save_in_place = |text: String, pause: Duration| {
        let path = g.config_path.clone();
        async move {
            use std::io::Write;
            let mut f = std::fs::File::create(&path).unwrap();
            f.flush().unwrap();
            tokio::time::sleep(pause).await;
            f.write_all(text.as_bytes()).unwrap();
        }
    };

    // A quick save: one reload, of the whole file.
    save_in_place(cfg(&up.url(), "100001/1h"), Duration::from_millis(5)).await;
    wait_for(async || reloads(&g, "success").await >= 1.0).await;
    assert_eq!(reloads(&g, "error").await, 0.0);

    // A slow one: the empty file is read, refused and counted; the running config serves on.
    save_in_place(cfg(&up.url(), "100002/1h"), Duration::from_millis(600)).await;
    wait_for(async || reloads(&g, "success").await >= 2.0).await;
    assert_eq!(reloads(&g, "error").await, 1.0);

    stop.store(true, Ordering::Relaxed);
    let statuses = probe.await.unwrap();
    assert_eq!(
        statuses.keys().copied().collect::<Vec<_>>(),
        [200],
        "{statuses:?}"
    );
    let running: serde_json::Value = g.admin_json("/admin/config").await;
    assert_eq!(running["routes"][0]["limits"][0]["rate"], "100002/1h");
}

#[tokio::test]
async fn a_kubernetes_style_symlink_swap_is_picked_up() {
    let up = Upstream::start().await;
    let dir = support::TempDir::new();
    // /etc/config/routes.yaml -> ..data/routes.yaml, ..data -> ..v1; the update swaps ..data.
    let v1 = dir.path.join("..v1");
    let v2 = dir.path.join("..v2");
    std::fs::create_dir_all(&v1).unwrap();
    std::fs::create_dir_all(&v2).unwrap();
    std::fs::write(v1.join("routes.yaml"), cfg(&up.url(), "1/1h")).unwrap();
    std::fs::write(v2.join("routes.yaml"), cfg(&up.url(), "50/1h")).unwrap();
    std::os::unix::fs::symlink("..v1", dir.path.join("..data")).unwrap();
    let path = dir.path.join("routes.yaml");
    std::os::unix::fs::symlink("..data/routes.yaml", &path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let app = tollgate::app::App::bind(
        tollgate::config::parse_str(&path, &text).unwrap(),
        tollgate::app::Options {
            config_path: Some(path.clone()),
            listen: None,
            admin: None,
        },
        Arc::new(tollgate::limit::clock::TokioClock::new()),
    )
    .await
    .unwrap();
    let addr = app.proxy_addr();
    let shared = app.shared();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(app.run(async move {
        let _ = rx.await;
    }));
    let c = client();
    let url = format!("http://{addr}/");
    assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    assert_eq!(c.get(&url).send().await.unwrap().status(), 429);
    // Atomic swap as kubelet does it: a new link renamed over ..data.
    std::os::unix::fs::symlink("..v2", dir.path.join("..data_tmp")).unwrap();
    std::fs::rename(dir.path.join("..data_tmp"), dir.path.join("..data")).unwrap();
    wait_for(async || {
        shared.gateway.snapshot.load().config.routes[0].limits[0]
            .rate
            .count
            == 50
    })
    .await;
    assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    let _ = tx.send(());
    task.await.unwrap();
}

#[tokio::test]
async fn state_of_unchanged_limits_survives_a_reload() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), "2/1h")).await;
    let c = client();
    c.get(g.url("/")).send().await.unwrap();
    c.get(g.url("/")).send().await.unwrap();
    // Same limit, other route settings changed: the used-up budget stays used up.
    let changed = cfg(&up.url(), "2/1h").replace("    upstream:", "    timeout: 5s\n    upstream:");
    std::fs::write(&g.config_path, changed).unwrap();
    let r = c.post(g.admin_url("/admin/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(c.get(g.url("/")).send().await.unwrap().status(), 429);
}

/// A file that loads with warnings is applied, and `POST /admin/reload` names them as `check`
/// does (`PATH:LINE:COL: warning: ...`).
#[tokio::test]
async fn a_reload_answers_with_the_new_configs_warnings() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), "2/1h")).await;
    let c = client();
    let r: serde_json::Value = c
        .post(g.admin_url("/admin/reload"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r, serde_json::json!({"result": "success", "warnings": []}));
    let warned = cfg(&up.url(), "2/1h") + "        burst: 5\n";
    std::fs::write(&g.config_path, warned).unwrap();
    let r = c.post(g.admin_url("/admin/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r: serde_json::Value = r.json().await.unwrap();
    assert_eq!(r["result"], "success", "{r}");
    let w = r["warnings"].as_array().unwrap();
    assert_eq!(w.len(), 1, "{r}");
    let want = format!(
        "{}:11:16: warning: burst applies to gcra only",
        g.config_path.display()
    );
    assert!(w[0].as_str().unwrap().starts_with(&want), "{r}");
}

#[tokio::test]
async fn a_changed_listen_address_keeps_the_running_one_and_says_so_in_the_config() {
    let up = Upstream::start().await;
    let g = Gateway::start(&cfg(&up.url(), "100/1h")).await;
    let c = client();
    let before: serde_json::Value = g.admin_json("/admin/config").await;
    assert_eq!(before["server"]["listen"], g.addr.to_string());
    // Another address in the file: applied on the next restart, not by a reload.
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let moved = cfg(&up.url(), "100/1h").replace("listen: 127.0.0.1:0", &format!("listen: {free}"));
    std::fs::write(&g.config_path, moved).unwrap();
    let r = c.post(g.admin_url("/admin/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(c.get(g.url("/")).send().await.unwrap().status(), 200);
    let after: serde_json::Value = g.admin_json("/admin/config").await;
    assert_eq!(after["server"]["listen"], g.addr.to_string());
}

#[tokio::test]
async fn a_hundred_reloads_under_load_fail_no_request() {
    let up = Upstream::start().await;
    let g = Arc::new(Gateway::start(&cfg(&up.url(), "1000000/1s")).await);
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..4 {
        let (g, stop, sent, failed) = (g.clone(), stop.clone(), sent.clone(), failed.clone());
        workers.push(tokio::spawn(async move {
            let c = client();
            while !stop.load(Ordering::Relaxed) {
                let ok = matches!(c.get(g.url("/")).send().await, Ok(r) if r.status() == 200);
                sent.fetch_add(1, Ordering::Relaxed);
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let c = client();
    for i in 0..100 {
        // Alternate two valid files, so each reload really changes the running config.
        let rate = if i % 2 == 0 {
            "1000000/1s"
        } else {
            "2000000/1s"
        };
        std::fs::write(&g.config_path, cfg(&up.url(), rate)).unwrap();
        let r = c.post(g.admin_url("/admin/reload")).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    let sent = sent.load(Ordering::Relaxed);
    assert!(sent > 100, "load ran: {sent} requests");
    assert_eq!(failed.load(Ordering::Relaxed), 0, "of {sent} requests");
    assert!(reloads(&g, "success").await >= 100.0);
}
