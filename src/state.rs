//! The running gateway's shared state, as the admin API, the signal handlers, the file
//! watcher and the background tasks see it: reload, readiness, one key's state.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::Mutex;

use crate::config::{self, Config, ConfigError, OnError, Scope};
use crate::limit::algorithm::Snapshot;
use crate::limit::redis::GlobalLimit;
use crate::limit::top::Top;
use crate::limit::{Limit, Reset, ResetError};
use crate::proxy::Gateway;
use crate::snapshot::ConfigSnapshot;

/// Options from the command line that override the file.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// The file to reload from (`None`: the config was given in memory; reload is refused).
    pub config_path: Option<PathBuf>,
    /// `--listen`: the proxy listener's address instead of `server.listen`.
    pub listen: Option<SocketAddr>,
    /// `--admin`: the admin listener's address instead of `server.admin`.
    pub admin: Option<SocketAddr>,
}

/// The listeners stay bound where they are across a reload (moving them takes a restart, as
/// turning TLS on or off does): a changed address in the file is reported, and the new config
/// keeps naming the addresses really served.
fn keep_listeners(cfg: &mut Config, running: &Config, options: &Options) {
    for (what, new, old, overridden) in [
        (
            "server.listen",
            &mut cfg.server.listen,
            running.server.listen,
            options.listen.is_some(),
        ),
        (
            "server.admin",
            &mut cfg.server.admin,
            running.server.admin,
            options.admin.is_some(),
        ),
    ] {
        // Port 0 (any free port) was resolved at start-up; it is no change.
        let same = *new == old || (new.port() == 0 && new.ip() == old.ip());
        if !same && !overridden {
            tracing::warn!(
                setting = what,
                file = %new,
                serving = %old,
                "the listener address changed in the file; it takes a restart, until then the old address is served"
            );
        }
        *new = old;
    }
}

/// State shared by the proxy, the admin API and the background tasks.
pub struct Shared {
    /// What the proxy serves with: the config snapshot a reload swaps, the metrics, the clock
    /// and the upstream connector.
    pub gateway: Arc<Gateway>,
    /// What the gateway was started with; reloads read `config_path`.
    pub options: Options,
    /// Serialises reloads (file watcher, SIGHUP and the admin API may race).
    reload_lock: Mutex<()>,
    /// Set on SIGTERM/SIGINT: `/readyz` answers 503 while in-flight requests finish, so a load
    /// balancer stops sending here; the admin listener itself stays up until the drain ends.
    pub draining: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// The state of a gateway started with `options`.
    pub fn new(gateway: Arc<Gateway>, options: Options) -> Self {
        Self {
            gateway,
            options,
            reload_lock: Mutex::new(()),
            draining: Default::default(),
        }
    }

    /// Reads the file again, builds a new snapshot aside and swaps it in; on error the running
    /// config stays and the failure is counted.
    pub async fn reload(&self) -> Result<(), ConfigError> {
        let _guard = self.reload_lock.lock().await;
        let Some(path) = &self.options.config_path else {
            return Err(ConfigError {
                path: PathBuf::from("<memory>"),
                line: 0,
                column: 0,
                message: "no config file to reload from".into(),
            });
        };
        let result = config::load(path);
        match result {
            Ok(mut cfg) => {
                log_warnings(&cfg);
                let old = self.gateway.snapshot.load_full();
                keep_listeners(&mut cfg, &old.config, &self.options);
                let rt = ConfigSnapshot::build(
                    cfg,
                    &self.gateway.metrics,
                    &self.gateway.connector,
                    Some(&old),
                );
                // Capped before it serves: the reload may have lowered server.max_keys.
                rt.sweep(self.gateway.clock.now(), &self.gateway.metrics);
                if rt.config.server.max_keys != old.config.server.max_keys {
                    tracing::info!(
                        max_keys = rt.config.server.max_keys,
                        was = old.config.server.max_keys,
                        "in-process key budget changed"
                    );
                }
                self.gateway.snapshot.store(Arc::new(rt));
                self.gateway.metrics.reload(true);
                tracing::info!(path = %path.display(), "config reloaded");
                Ok(())
            }
            Err(e) => {
                self.gateway.metrics.reload(false);
                tracing::error!(error = %e, "config reload refused; the running config stays");
                Err(e)
            }
        }
    }

    /// Ready when a config is loaded and, with `redis` set, Redis answers or `on_error: allow`
    /// lets the gateway decide without it.
    pub async fn readiness(&self) -> (bool, serde_json::Value) {
        let rt = self.gateway.snapshot.load_full();
        let up = match &rt.redis {
            // One PING within the command timeout: the probe answers what is true now, not
            // what the breaker concluded from the last requests.
            Some(r) => r.ping().await.is_ok(),
            None => false,
        };
        let (ready, redis) = match (&rt.config.redis, up) {
            (None, _) => (true, "not configured"),
            (Some(_), true) => (true, "up"),
            (Some(_), false) => (rt.on_error == OnError::Allow, "down"),
        };
        let draining = self.draining.load(std::sync::atomic::Ordering::Relaxed);
        let ready = ready && !draining;
        (
            ready,
            serde_json::json!({"ready": ready, "routes": rt.routes.len(), "redis": redis, "on_error": rt.on_error, "draining": draining}),
        )
    }

    /// One key's state under `rate` (an index into [`Limit::rates`]), from the store that
    /// holds it: Redis for global limits (the local fallback store when Redis cannot answer),
    /// the local store otherwise; and that store's name.
    pub async fn peek(&self, limit: &Limit, rate: u16, key: &[u8]) -> (Snapshot, &'static str) {
        let rated = limit.rate(rate);
        let algorithm = &rated.algorithm;
        let now = self.gateway.clock.now();
        let rt = self.gateway.snapshot.load_full();
        // An eventual limit is decided here, on counts synced with Redis: its state is this
        // instance's view of them (what Redis holds may be ahead by the others' unsynced units).
        if let Some(ev) = &limit.eventual {
            return (ev.peek(&limit.algorithm, key, now), "eventual");
        }
        if limit.scope == Scope::Global
            && let Some(redis) = &rt.redis
        {
            let redis_key = limit.redis_key(key);
            // A reserving rate's key is decided against its smaller burst (`reserve_ahead`):
            // what it can still grant is measured against that one too.
            let g = GlobalLimit {
                algorithm: rated
                    .reserve
                    .as_ref()
                    .map_or(algorithm, |reserve| &reserve.algorithm),
                key: &redis_key,
                cost: limit.cost,
                max_delay: limit.max_delay,
            };
            match redis.peek(&g).await {
                Ok(s) => return (s, "redis"),
                Err(e) => {
                    tracing::warn!(error = %e, "redis peek failed; showing the fallback store")
                }
            }
        }
        let store = if limit.scope == Scope::Global {
            "local_fallback"
        } else {
            "local"
        };
        (limit.store.peek(algorithm, key, now), store)
    }
}

impl Shared {
    /// Forgets one key of `limit` in this instance and, for a global limit, in Redis: the key
    /// is full again (see [`Limit::reset`]). `Err` when Redis did not confirm; what this
    /// instance held is forgotten either way.
    pub async fn reset(&self, limit: &Limit, key: &[u8]) -> Result<Reset, ResetError> {
        let rt = self.gateway.snapshot.load_full();
        let now = self.gateway.clock.now();
        let result = limit.reset(key, rt.redis.as_ref(), now).await;
        match &result {
            Ok(r) => tracing::info!(
                limit = %limit.name,
                redis_deleted = r.redis_deleted,
                "key reset by the admin API"
            ),
            Err(e) => tracing::warn!(limit = %limit.name, error = %e, "key reset by the admin API"),
        }
        result
    }

    /// Forgets in process the key a reset published on Redis names (`tag`: `ROUTE/LIMIT/KEY`,
    /// see [`crate::limit::redis::RedisStore::reset`]), in whichever global limit it names;
    /// whether one did.
    pub fn forget_reset(&self, tag: &str) -> bool {
        let rt = self.gateway.snapshot.load_full();
        let now = self.gateway.clock.now();
        let mut found = false;
        for l in rt.routes.iter().flat_map(|r| r.limits.limits.iter()) {
            if let Some(key) = l.reset_key_of(tag) {
                l.forget_in_process(key, now);
                found = true;
            }
        }
        found
    }

    /// The `n` keys `limit` rejected most on this instance in the last minute.
    pub fn top(&self, limit: &Limit, n: usize) -> Top {
        limit.top.top(n, self.gateway.clock.now())
    }
}

/// A config's warnings (settings that load but do less than they seem to), one event each.
pub(crate) fn log_warnings(cfg: &config::Config) {
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
}
