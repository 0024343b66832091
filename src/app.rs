//! Wiring: builds the pipeline from a config and runs the proxy listener, the admin listener
//! and the background tasks (store sweeper) until shutdown, then drains.
//!
//! The library takes its listeners' addresses and clock from the caller, so tests bind port 0
//! and run the whole gateway in process.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::net::TcpListener;

use crate::config::{self, Config, ConfigError};
use crate::connector::Connector;
use crate::limit::Limit;
use crate::limit::clock::{SharedClock, TokioClock};
use crate::metrics::Metrics;
use crate::proxy::Gateway;
use crate::snapshot::ConfigSnapshot;
use crate::state::log_warnings;
pub use crate::state::{Options, Shared};

/// How long start-up waits for a first answer from Redis before serving anyway.
const REDIS_STARTUP_WAIT: Duration = Duration::from_secs(2);

/// How often idle keys are swept out of the local stores.
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// Why the gateway could not start: [`App::from_file`] and [`App::bind`] fail with it.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The cause is the error's source, which `main` prints after it (`{:#}`).
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address that could not be bound.
        addr: SocketAddr,
        /// Why the OS refused it (address in use, permission denied...).
        source: std::io::Error,
    },
    /// What `tollgate check` says of the same addresses, rather than the second bind's
    /// "address in use", which sends an operator looking for another process.
    #[error(
        "listen {listen} and admin {admin} would bind the same port: give them different ports"
    )]
    SamePort {
        /// The proxy listener's address (`--listen`, else `server.listen`).
        listen: SocketAddr,
        /// The admin listener's address (`--admin`, else `server.admin`).
        admin: SocketAddr,
    },
    /// The config file could not be read or is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// A gateway with both listeners bound and its pipeline built, ready to [`run`](App::run).
pub struct App {
    shared: Arc<Shared>,
    proxy_listener: TcpListener,
    admin_listener: TcpListener,
}

impl App {
    /// Loads the file named in `options` and binds.
    pub async fn from_file(options: Options) -> Result<Self, AppError> {
        let path = options
            .config_path
            .clone()
            .unwrap_or_else(|| PathBuf::from("routes.yaml"));
        let cfg = config::load(&path)?;
        log_warnings(&cfg);
        let options = Options {
            config_path: Some(path),
            ..options
        };
        Self::bind(cfg, options, Arc::new(TokioClock::new())).await
    }

    /// Binds both listeners (addresses from the options, else the config) and builds the
    /// pipeline. Nothing is served until [`App::run`].
    pub async fn bind(
        mut config: Config,
        options: Options,
        clock: SharedClock,
    ) -> Result<Self, AppError> {
        let listen = options.listen.unwrap_or(config.server.listen);
        let admin = options.admin.unwrap_or(config.server.admin);
        if config::same_port(listen, admin) {
            return Err(AppError::SamePort { listen, admin });
        }
        let proxy_listener = TcpListener::bind(listen)
            .await
            .map_err(|source| AppError::Bind {
                addr: listen,
                source,
            })?;
        let admin_listener = TcpListener::bind(admin)
            .await
            .map_err(|source| AppError::Bind {
                addr: admin,
                source,
            })?;
        // The running config names the addresses really served (the command line's, port 0
        // resolved), which `/admin/config` shows and reloads keep.
        if let Ok(a) = proxy_listener.local_addr() {
            config.server.listen = a;
        }
        if let Ok(a) = admin_listener.local_addr() {
            config.server.admin = a;
        }
        let metrics = Arc::new(Metrics::new());
        // The upstream connector's trust anchors are decided at start-up (certificates are
        // re-read on reload), as TLS on the listener is.
        let connector = Connector::new(
            config
                .server
                .upstream_ca
                .as_ref()
                .map_or(&[], |ca| &ca.certs),
        );
        let snapshot = ConfigSnapshot::build(config, &metrics, &connector, None);
        snapshot.sweep(clock.now(), &metrics);
        log_key_budget(snapshot.config.server.max_keys);
        if let Some(redis) = &snapshot.redis {
            // Give the pool a moment to connect so the first requests do not meet a cold
            // connection; a Redis that is down only delays start-up by this much.
            let deadline = tokio::time::Instant::now() + REDIS_STARTUP_WAIT;
            while redis.ping().await.is_err() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let proto = if snapshot.config.server.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let gateway = Arc::new(Gateway {
            snapshot: ArcSwap::from_pointee(snapshot),
            metrics,
            clock,
            connector,
            proto,
            tunnels: Default::default(),
        });
        Ok(Self {
            shared: Arc::new(Shared::new(gateway, options)),
            proxy_listener,
            admin_listener,
        })
    }

    /// The address the proxy listener is bound to (a port 0 resolved to the port the OS chose).
    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy_listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// The address the admin listener is bound to (a port 0 resolved to the port the OS chose).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// The running gateway's state, for what the caller drives itself: `main` reloads on
    /// SIGHUP with it, tests reload and inspect through it.
    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Serves until `shutdown` resolves, then stops accepting and drains in-flight requests for
    /// up to the configured grace period.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) {
        let shared = self.shared;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        // The admin listener and the eventual syncer outlive the drain (metrics and `/readyz`
        // stay readable; units admitted during it are pushed); they stop once the proxy
        // listener is done.
        let (after_drain, drained) = tokio::sync::watch::channel(false);
        let sweeper = background("sweep", &shared, {
            let (shared, stop) = (shared.clone(), stop_rx.clone());
            move || sweep(shared.clone(), stop.clone())
        });
        let resets = background("resets", &shared, {
            let (shared, stop) = (shared.clone(), stop_rx.clone());
            move || follow_resets(shared.clone(), stop.clone())
        });
        let syncer = background("eventual_sync", &shared, {
            let (shared, stop) = (shared.clone(), drained.clone());
            move || sync_eventual(shared.clone(), stop.clone())
        });
        let watcher = shared.options.config_path.clone().map(|path| {
            background("config_watch", &shared, {
                let (shared, stop) = (shared.clone(), stop_rx.clone());
                let mut restarted = false;
                move || {
                    let run = watch(shared.clone(), path.clone(), stop.clone(), restarted);
                    restarted = true;
                    run
                }
            })
        });
        let admin = {
            let router = crate::admin::router(shared.clone());
            let mut rx = drained;
            tokio::spawn(async move {
                let stop = async move {
                    let _ = rx.wait_for(|s| *s).await;
                };
                if let Err(e) = axum::serve(self.admin_listener, router)
                    .with_graceful_shutdown(stop)
                    .await
                {
                    tracing::error!(error = %e, "admin listener failed");
                }
            })
        };
        let grace = shared.gateway.snapshot.load().config.server.grace_period;
        let left = crate::listener::serve(
            self.proxy_listener,
            shared.gateway.clone(),
            {
                let shared = shared.clone();
                async move {
                    shutdown.await;
                    shared
                        .draining
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    let _ = stop_tx.send(true);
                }
            },
            grace,
        )
        .await;
        let _ = after_drain.send(true);
        if left > 0 {
            tracing::warn!(connections = left, "exiting with connections still open");
        }
        sweeper.abort();
        resets.abort();
        // Its last pass pushes what was admitted since the previous one (bounded: a Redis that
        // does not answer costs its timeout per call, all calls at once).
        let _ = tokio::time::timeout(Duration::from_secs(2), syncer).await;
        if let Some(w) = watcher {
            w.abort();
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), admin).await;
    }
}

/// Says at start-up how many keys the in-process stores may hold, and where the number came
/// from (`tollgate check` prints the same).
fn log_key_budget(max_keys: usize) {
    let d = crate::limit::budget::default_max_keys();
    if max_keys == d.keys {
        tracing::info!(
            max_keys,
            memory_bytes = d.memory,
            "in-process key budget: server.max_keys by default, 1/{} of the memory at {} bytes per key",
            crate::limit::budget::MEMORY_SHARE,
            crate::limit::budget::BYTES_PER_KEY
        );
    } else {
        tracing::info!(max_keys, "in-process key budget: server.max_keys");
    }
}

/// Spawns a background task that `start` makes, restarted after a panic (`crate::panics`:
/// counted under `task`, logged, started again a second later), so a bug met once does not
/// silently stop limit syncs, sweeps or config reloads for the rest of the process's life.
fn background<F, Fut>(task: &'static str, shared: &Shared, start: F) -> tokio::task::JoinHandle<()>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let metrics = shared.gateway.metrics.clone();
    tokio::spawn(crate::panics::supervise(task, metrics, start))
}

/// Forgets in process the keys a reset names, wherever it was made (the admin API's `DELETE`
/// on any instance publishes it on Redis), so this instance's in-process tier does not go on
/// rejecting a key that is full again. Follows the store a reload swaps in.
async fn follow_resets(shared: Arc<Shared>, mut stop: tokio::sync::watch::Receiver<bool>) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let redis = shared.gateway.snapshot.load().redis.clone();
        let Some(redis) = redis else {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                _ = stop.wait_for(|s| *s) => return,
            }
        };
        let mut heard = redis.resets();
        loop {
            tokio::select! {
                m = heard.recv() => match m {
                    Ok(tag) => {
                        shared.forget_reset(&tag);
                    }
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "resets published faster than followed");
                    }
                    Err(RecvError::Closed) => break,
                },
                _ = tokio::time::sleep(Duration::from_secs(1)) => {
                    let now = shared.gateway.snapshot.load().redis.clone();
                    if !now.is_some_and(|r| r.same(&redis)) {
                        break;
                    }
                }
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}

/// Drops keys whose state is back to full, so memory follows active keys only.
async fn sweep(shared: Arc<Shared>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SWEEP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let rt = shared.gateway.snapshot.load_full();
        let now = shared.gateway.clock.now();
        rt.sweep(now, &shared.gateway.metrics);
    }
}

/// Reloads when the config file changes on disk. `restarted`: this watcher replaces one that
/// panicked, so it reloads once first, in case the file changed while none was watching.
async fn watch(
    shared: Arc<Shared>,
    path: PathBuf,
    mut stop: tokio::sync::watch::Receiver<bool>,
    restarted: bool,
) {
    let loaded = shared.gateway.snapshot.load().config.source_hash;
    let mut w = match crate::config::watch::ConfigWatch::new(&path, loaded) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot watch the config file; reload with SIGHUP or POST /admin/reload");
            return;
        }
    };
    if restarted {
        let _ = shared.reload().await;
    }
    loop {
        w.also_watch(&shared.gateway.snapshot.load().config.files_read());
        tokio::select! {
            _ = w.changed() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        #[cfg(feature = "panic-injection")]
        crate::panics::inject::once("config_watch", &path.to_string_lossy());
        // A refused file is logged and counted inside reload; the running config stays.
        let _ = shared.reload().await;
    }
}

/// How often the eventual-consistency syncer looks for limits whose `sync_interval` is due.
const SYNC_TICK: Duration = Duration::from_millis(5);

/// Pushes and pulls the counts of `consistency: eventual` limits, each every `sync_interval`.
async fn sync_eventual(shared: Arc<Shared>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SYNC_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // After the drain: one last pass over every eventual limit, then stop, so the units
        // admitted since the last sync are not lost with the process.
        let last = tokio::select! {
            _ = tick.tick() => false,
            _ = stop.wait_for(|s| *s) => true,
        };
        let rt = shared.gateway.snapshot.load_full();
        let Some(redis) = &rt.redis else {
            if last {
                return;
            }
            continue;
        };
        let now = shared.gateway.clock.now();
        let due = rt.distinct_limits().filter(|l| {
            l.eventual.as_ref().is_some_and(|ev| {
                let synced = ev.last_sync.load(std::sync::atomic::Ordering::Relaxed);
                last || now >= synced + l.sync_interval
            })
        });
        let jobs = due.map(|l| sync_limit(&shared, redis, l, now));
        futures_util::future::join_all(jobs).await;
        if last {
            return;
        }
    }
}

async fn sync_limit(
    shared: &Shared,
    redis: &crate::limit::redis::RedisStore,
    l: &Limit,
    now: crate::limit::algorithm::Micros,
) {
    let Some(ev) = &l.eventual else { return };
    #[cfg(feature = "panic-injection")]
    crate::panics::inject::once("eventual_sync", &l.name);
    ev.last_sync
        .store(now, std::sync::atomic::Ordering::Relaxed);
    let items = ev.due(now);
    let calls = items
        .iter()
        .map(|it| l.sync_eventual(redis, it, &*shared.gateway.clock));
    for r in futures_util::future::join_all(calls).await {
        if let Err(e) = r {
            shared.gateway.metrics.redis_error(e.kind());
        }
    }
}
