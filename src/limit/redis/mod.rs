//! The Redis tier of `scope: global` limits: one Lua script decides all of a request's
//! global limits atomically, on Redis's clock, so every gateway instance sees one state.
//!
//! # Guarantees
//!
//! - **Single Redis**: all of a request's limits go into ONE `EVALSHA` of `decide.lua`, which
//!   checks every limit and commits only if all admit. A rejected request writes nothing.
//! - **Redis Cluster**: one script call may only touch keys of one hash slot. Limits whose
//!   keys share a slot (same `{tag}`) still go into one call. Limits on different slots are
//!   decided by one call per slot, concurrently; if any rejects, the slots that admitted are
//!   refunded (`refund.lua`). This reserve-then-refund never over-admits: units are taken
//!   before the request is admitted and only given back after it was rejected. The cost is
//!   that for the round trip between the two calls another request may see those units as
//!   taken and be rejected although, in the end, nothing consumed them. Refunds never leave a
//!   limit laxer than if the request had not come: gcra keeps back the part of the emission
//!   that elapsed between commit and refund (an RTT's worth, usually a fraction of a unit),
//!   the others are exact. A refund that fails (Redis gone mid-request) leaves the units
//!   taken until the key expires, which again only errs towards limiting.
//! - **Redis Sentinel**: everything above runs on the master the sentinels name; fred asks
//!   them at every (re)connect, and the store moves its connections to a new master as soon as
//!   a sentinel announces a failover (see `sentinel.rs`). During the failover Redis is down,
//!   as below.
//! - **Time** is the Redis server's (`TIME` inside the script); on a cluster, each slot's
//!   node's clock.
//! - **Memory**: every written key expires once its state is back to full.
//! - **Failure**: every call is bounded by the configured timeout. After
//!   [`BREAKER_THRESHOLD`] consecutive timeouts or connection errors the circuit breaker
//!   opens and [`RedisStore::decide`] answers [`RedisError::Unavailable`] at once; a
//!   background PING every [`PROBE_EVERY`] closes it as soon as Redis answers, so decisions
//!   return to Redis within about a second of it coming back. The caller applies `on_error`.
//! - **Scripts** are functions of one library (`FCALL`, Redis ≥ 7), loaded on every primary
//!   at connect, whose name carries a digest of its code so that two tollgate versions can
//!   share a Redis during a rollout; on an older Redis they are sent by SHA (`EVALSHA`). After
//!   a Redis restart, `FUNCTION FLUSH`, `SCRIPT FLUSH` or a failover to a node without them,
//!   the `Function not found` or `NOSCRIPT` reply triggers a reload and one retry,
//!   transparently.
//!
//! A command that timed out on our side may still run on Redis later (nothing can recall a
//! command already written); it then consumes units of a request that was answered by the
//! fallback. fred may send a call again after its connection dropped mid-flight (3 attempts,
//! which Cluster redirections need too), within its timeout: a decision can then be charged
//! twice, never skipped. A call fred timed out it never writes or resends afterwards.

mod batch;
mod breaker;
mod error;
mod script;
mod sentinel;

pub use crate::config::redis::{MAX_PARAM, parse_url};
pub use batch::{BatchStats, DEFAULT_BATCH_MAX, MAX_BATCH_ARGS};
pub use breaker::{Breaker, Health, Transition};
pub use error::RedisError;
pub use script::{
    DECIDE_LUA, DECIDE_MANY_LUA, LIBRARY_LUA, Library, PEEK_LUA, REFUND_LUA, RESERVE_LUA,
    ScriptPath, check_params, hash_tag, library, redis_keys,
};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use fred::interfaces::{EventInterface, KeysInterface, PubsubInterface};
use fred::prelude::{
    Builder, ClientLike, Config, ConnectionConfig, PerformanceConfig, Pool, ReconnectPolicy,
    ServerConfig,
};
use fred::types::config::UnresponsiveConfig;
use tokio::task::JoinSet;

use crate::limit::algorithm::{Algorithm, Micros, Rejection, Settlement, Snapshot};
use batch::{Batcher, Enqueued, Pending};
use script::{Call, DecideReply, Scripts};

/// The channel resets are published on (see [`RedisStore::reset`]).
pub const RESET_CHANNEL: &str = "tollgate:reset";

/// Resets heard but not yet handled before the oldest are dropped (a receiver that lags
/// misses them; they are rare, an operator's).
const RESETS_QUEUED: usize = 1024;

/// Consecutive outage failures that open the breaker.
pub const BREAKER_THRESHOLD: u32 = 3;
/// How often the background probe PINGs while the breaker is open (or Redis never answered).
pub const PROBE_EVERY: Duration = Duration::from_millis(250);
/// Default number of connections; fred pipelines many requests on each.
pub const DEFAULT_POOL_SIZE: usize = 2;
/// Default per-command timeout (the config's `redis.timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
/// Commands fred may queue per connection while (re)connecting; beyond it a call fails at
/// once instead of piling up behind a dead Redis.
const MAX_QUEUED_COMMANDS: usize = 1024;
/// How much longer the bound on a call waits than fred's own per-command timeout.
const OUTER_SLACK: Duration = Duration::from_millis(5);
/// How long a connection whose task ended waits before it is started again.
const RESTART_AFTER: Duration = Duration::from_millis(100);
/// The probe loop's tick; [`PROBE_EVERY`] is enforced by the breaker.
const PROBE_TICK: Duration = Duration::from_millis(50);

/// How to reach Redis: the config's `redis` section as the store needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisSettings {
    /// Which Redis: one server, a Cluster, or a master named by Sentinel.
    pub target: RedisTarget,
    /// Bound on every call (`redis.timeout`).
    pub timeout: Duration,
    /// Connections in the pool (`redis.pool_size`, default [`DEFAULT_POOL_SIZE`]).
    pub pool_size: usize,
    /// Decisions one call may decide (`redis.batch_max`, default [`DEFAULT_BATCH_MAX`]): the
    /// requests that queued behind a call in flight go together in the next. 1: no
    /// batching, every decision its own call at once (as before batching).
    pub batch_max: usize,
}

impl RedisSettings {
    /// Settings for `target` with the default timeout and pool size.
    pub fn new(target: RedisTarget) -> Self {
        Self {
            target,
            timeout: DEFAULT_TIMEOUT,
            pool_size: DEFAULT_POOL_SIZE,
            batch_max: DEFAULT_BATCH_MAX,
        }
    }
}

/// Which Redis: the config's own type, so the file's choice reaches the store unconverted.
pub use crate::config::RedisTarget;

/// One of a request's global limits, as the store needs it.
#[derive(Clone, Copy, Debug)]
pub struct GlobalLimit<'a> {
    /// The limit's algorithm.
    pub algorithm: &'a Algorithm,
    /// Base key, already holding the hash tag, e.g. `tg:{users/per-user/alice}`; the store
    /// appends a per-algorithm suffix (see [`redis_keys`]).
    pub key: &'a str,
    /// Units the request takes.
    pub cost: u64,
    /// gcra with `on_limit: delay`: admit with a delay up to this; 0 = no reservation.
    pub max_delay: Micros,
}

/// One global limit's answer from Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitVerdict {
    /// For a request rejected by another limit this is what this limit would have
    /// answered; nothing was consumed.
    Admitted {
        /// The key's state once the request is charged, for the `RateLimit` fields.
        snapshot: Snapshot,
        /// Microseconds to wait for the reserved slot (gcra `on_limit: delay`); 0 when admitted at
        /// once.
        delay: Micros,
    },
    /// Over the limit: this request took nothing from it.
    Rejected(Rejection),
}

impl LimitVerdict {
    /// Whether this limit admitted.
    pub fn is_admitted(&self) -> bool {
        matches!(self, LimitVerdict::Admitted { .. })
    }
}

/// One request of [`RedisStore::decide_batch`]: what [`RedisStore::decide_leasing`] takes.
#[derive(Clone, Debug, Default)]
pub struct BatchRequest<'a> {
    /// The request's global limits.
    pub limits: Vec<GlobalLimit<'a>>,
    /// `shadow[i]` (missing: false) marks a shadow limit.
    pub shadow: Vec<bool>,
    /// `leases[i]` (missing: 0): a concurrency limit's lease id.
    pub leases: Vec<u64>,
    /// Replaces the server clock for this request (tests only).
    pub now_override: Option<Micros>,
}

/// Redis's answer to a reservation ([`RedisStore::reserve`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Units granted (at least the cost), with the key's state after them; or the rejection
    /// a decision of the cost would have had.
    pub verdict: Result<(u64, Snapshot), Rejection>,
    /// The instant (Redis's clock) of the grant.
    pub at: Micros,
}

/// Redis's answer for all of a request's global limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Every limit admitted, and every one was charged.
    pub admitted: bool,
    /// Same order as the input.
    pub per_limit: Vec<LimitVerdict>,
    /// Per limit, the instant (Redis's clock) it was decided and charged at: what a
    /// settlement of its cost names. Empty when nothing was decided.
    pub at: Vec<Micros>,
}

/// Shared handle on the Redis tier; clones share the pool, scripts and breaker.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("cluster", &self.inner.cluster)
            .field("timeout", &self.inner.timeout)
            .field("scripts", &self.inner.scripts.path())
            .field("health", &self.inner.breaker().health())
            .finish()
    }
}

struct Inner {
    pool: Pool,
    cluster: bool,
    timeout: Duration,
    scripts: Scripts,
    /// The decide queues (see [`batch`]); `None` with `batch_max: 1`.
    batcher: Option<Batcher>,
    /// On a single Redis (or Sentinel's master), the number of queues the hash slots are
    /// folded into: one per pool connection.
    queues: u16,
    breaker: Mutex<Breaker>,
    shut_down: AtomicBool,
    /// Subscribed to [`RESET_CHANNEL`]: resets sent by any instance.
    subscriber: fred::clients::Client,
    /// What the subscriber hears, for [`RedisStore::resets`].
    resets: tokio::sync::broadcast::Sender<String>,
    /// With `redis.sentinel`: one client per sentinel, subscribed to its announcements of a
    /// failover (see [`sentinel`]); none otherwise.
    watchers: Vec<fred::clients::Client>,
}

impl Inner {
    fn breaker(&self) -> MutexGuard<'_, Breaker> {
        // The breaker holds no invariant a panic elsewhere could break.
        self.breaker
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn record(&self, result: Result<(), &RedisError>) {
        let now = Instant::now();
        let transition = match result {
            Ok(()) | Err(RedisError::Script(_)) => self.breaker().record_success(now),
            Err(e) if e.is_outage() => self.breaker().record_failure(now),
            Err(_) => None,
        };
        match transition {
            Some(Transition::Opened) => tracing::warn!(
                threshold = BREAKER_THRESHOLD,
                "redis circuit breaker opened; global limits use the on_error fallback"
            ),
            Some(Transition::Closed { after }) if !after.is_zero() => {
                tracing::info!(
                    down_ms = after.as_millis() as u64,
                    "redis is back; circuit breaker closed"
                )
            }
            _ => {}
        }
    }

    /// One script call, bounded by the timeout and counted by the breaker.
    async fn eval(
        &self,
        call: Call,
        keys: Vec<String>,
        args: Vec<i64>,
    ) -> Result<Vec<i64>, RedisError> {
        let client = self.pool.next_connected();
        let call = async {
            // Connecting (at startup, or right after Redis came back): wait for it within
            // the same timeout rather than fail a request Redis could answer in time.
            if !client.is_connected() {
                client.wait_for_connect().await?;
            }
            self.scripts.run(client, call, keys, args).await
        };
        // A hair longer than fred's own timeout (the same `timeout`, started a moment later),
        // so that fred's fires first: it marks the command timed out, and fred then never
        // writes it if it is still queued, nor sends it again after a reconnect.
        let result = match tokio::time::timeout(self.timeout + OUTER_SLACK, call).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(RedisError::from(e)),
            Err(_) => Err(timed_out(client)),
        };
        self.record(result.as_ref().map(|_| ()));
        if let Err(e @ RedisError::Script(_)) = &result {
            warn_script_error(e);
        }
        result
    }

    async fn ping(&self) -> Result<(), RedisError> {
        let client = self.pool.next_connected();
        let call = async {
            if !client.is_connected() {
                client.wait_for_connect().await?;
            }
            client.ping::<()>(None).await
        };
        let result = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(RedisError::from(e)),
            Err(_) => Err(timed_out(client)),
        };
        self.record(result.as_ref().copied());
        result
    }

    /// One `DEL` of `keys` within the timeout, whatever the breaker says (an operator's
    /// reset is worth a try); its outcome feeds the breaker. The number of keys that existed.
    async fn del(&self, keys: Vec<String>) -> Result<u64, RedisError> {
        let client = self.pool.next_connected();
        let call = async {
            if !client.is_connected() {
                client.wait_for_connect().await?;
            }
            client.del::<u64, _>(keys).await
        };
        let result = match tokio::time::timeout(self.timeout + OUTER_SLACK, call).await {
            Ok(Ok(n)) => Ok(n),
            Ok(Err(e)) => Err(RedisError::from(e)),
            Err(_) => Err(timed_out(client)),
        };
        self.record(result.as_ref().map(|_| ()));
        result
    }

    /// One decision (decide.lua's KEYS and ARGV) through its queue (see [`batch`]): at once,
    /// in this task, when no call is in flight on the queue; otherwise it waits, and goes in
    /// the queue's next call with every decision queued meanwhile. Once enqueued a decision is
    /// made and charged whether or not its caller still waits for the answer, as a call already
    /// written would be: a caller that goes away does not hold up the queue.
    async fn decide_queued(
        self: &Arc<Self>,
        keys: Vec<String>,
        args: Vec<i64>,
    ) -> Result<Vec<i64>, RedisError> {
        // The calls are boxed where they are made: a Redis call's future (fred's, the
        // timeout, the reload) is large, and the request's whole decision, boxed by the
        // caller, would otherwise carry it and be copied with it, although a queued
        // decision never makes one.
        let Some(batcher) = &self.batcher else {
            return Box::pin(self.eval(Call::Decide, keys, args)).await;
        };
        let queue = self.queue_of(&keys);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let pending = Pending {
            keys,
            args,
            reply: tx,
        };
        match batcher.enqueue(queue, pending) {
            Enqueued::Lead(p) => {
                // The queue is this call's until it returns; should this task be dropped
                // before, the guard hands what queued behind it to a task of its own.
                let mut lead = Lead {
                    inner: self,
                    queue,
                    done: false,
                };
                batcher.count_call(1);
                let reply = Box::pin(self.eval(Call::Decide, p.keys, p.args)).await;
                lead.hand_over();
                reply
            }
            // Bounded as the calls are: the one in flight, then the one that carries this
            // decision, each within the timeout. Past that the answer is a timeout, as a call's
            // would be (the decision may still be made, as a timed-out call may still run).
            Enqueued::Queued => {
                match tokio::time::timeout(2 * (self.timeout + OUTER_SLACK), rx).await {
                    Ok(Ok(reply)) => reply,
                    Ok(Err(_)) => Err(RedisError::Protocol(
                        "a batched decision got no answer".to_string(),
                    )),
                    Err(_) => Err(RedisError::Timeout),
                }
            }
        }
    }

    /// The queue of a decision whose first key is `keys[0]`: its hash slot on a Cluster; on a
    /// single Redis the slot folded into [`Inner::queues`], so a key always has the same queue.
    fn queue_of(&self, keys: &[String]) -> u16 {
        let slot = keys
            .first()
            .map_or(0, |k| fred::util::redis_keyslot(k.as_bytes()));
        if self.cluster {
            slot
        } else {
            slot % self.queues.max(1)
        }
    }

    /// One call deciding `batch`, in order: `decide` for one decision, `decide_many` for more;
    /// each decision gets its own reply, or the call's error.
    async fn run_batch(&self, mut batch: Vec<Pending>) {
        if let Err(e) = self.check_breaker() {
            batch::answer(batch, Err(e));
            return;
        }
        if let Some(batcher) = &self.batcher {
            batcher.count_call(batch.len());
        }
        if batch.len() == 1
            && let Some(p) = batch.pop()
        {
            let reply = self.eval(Call::Decide, p.keys, p.args).await;
            let _ = p.reply.send(reply);
            return;
        }
        let (keys, args) = batch::many_call(&batch);
        let reply = self.eval(Call::DecideMany, keys, args).await;
        batch::answer(batch, reply);
    }

    fn check_breaker(&self) -> Result<(), RedisError> {
        if self.breaker().allows_requests() {
            Ok(())
        } else {
            Err(RedisError::Unavailable)
        }
    }
}

/// A queue's first call, run by the request that found the queue idle. When it returns, or
/// if that request is dropped before, what queued behind it goes on in a task of its own
/// ([`drive`]), so no decision waits on a caller that left.
struct Lead<'a> {
    inner: &'a Arc<Inner>,
    queue: u16,
    done: bool,
}

impl Lead<'_> {
    fn hand_over(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let Some(batcher) = &self.inner.batcher else {
            return;
        };
        let batch = batcher.next(self.queue);
        if !batch.is_empty() {
            tokio::spawn(drive(Arc::clone(self.inner), self.queue, batch));
        }
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        self.hand_over();
    }
}

/// Runs `queue`'s calls one after another until nothing waits on it: each call decides what
/// queued while the one before was in flight.
async fn drive(inner: Arc<Inner>, queue: u16, mut batch: Vec<Pending>) {
    // Should a call panic, the queue must not stay "in flight" with nobody to drain it.
    struct Drained<'a> {
        inner: &'a Inner,
        queue: u16,
        done: bool,
    }
    impl Drop for Drained<'_> {
        fn drop(&mut self) {
            if !self.done
                && let Some(batcher) = &self.inner.batcher
            {
                batcher.abandon(
                    self.queue,
                    RedisError::Protocol("a batch of decisions was lost".to_string()),
                );
            }
        }
    }
    let mut drained = Drained {
        inner: &inner,
        queue,
        done: false,
    };
    while !batch.is_empty() {
        inner.run_batch(batch).await;
        batch = match &inner.batcher {
            Some(batcher) => batcher.next(queue),
            None => Vec::new(),
        };
    }
    drained.done = true;
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Without a QUIT fred's connection tasks would keep reconnecting forever.
        if !self.shut_down.swap(true, Ordering::SeqCst)
            && let Ok(handle) = tokio::runtime::Handle::try_current()
        {
            let pool = self.pool.clone();
            let subscriber = self.subscriber.clone();
            let watchers = self.watchers.clone();
            handle.spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(1), pool.quit()).await;
                let _ = tokio::time::timeout(Duration::from_secs(1), subscriber.quit()).await;
                quit_all(&watchers).await;
            });
        }
    }
}

/// Logs a script's error reply at most once a second: a bad deployment or an instance whose
/// clock is more than a calendar window from Redis's fails every call, and `on_error` answers
/// each of them (each is counted in `tollgate_redis_errors_total{kind="script"}`).
fn warn_script_error(e: &RedisError) {
    use std::sync::atomic::AtomicU64;
    static LAST_SECOND: AtomicU64 = AtomicU64::new(u64::MAX);
    let second = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST_SECOND.swap(second, Ordering::Relaxed) != second {
        tracing::warn!(error = %e, "redis script failed; on_error decides (logged once a second)");
    }
}

/// A command that ran out of time: a `timeout` when the connection was up (Redis slow), a
/// `connection` error when it never was (Redis down or restarting), so the metric tells the two
/// apart.
fn timed_out(client: &fred::clients::Client) -> RedisError {
    if client.is_connected() {
        RedisError::Timeout
    } else {
        RedisError::Connection("not connected to redis within the timeout".into())
    }
}

fn fred_config(target: &RedisTarget) -> Result<Config, RedisError> {
    let parse = |url: &str| {
        parse_url(url)
            .map_err(|why| RedisError::Connection(format!("invalid redis url {url:?}: {why}")))
    };
    match target {
        RedisTarget::Single(url) => parse(url),
        RedisTarget::Cluster(urls) => {
            let first = urls.first().ok_or_else(|| {
                RedisError::Connection("a redis cluster needs at least one node".to_string())
            })?;
            // Credentials, TLS and the like come from the first URL; hosts from all of them.
            let mut config = parse(first)?;
            let mut hosts = Vec::new();
            for url in urls {
                match parse(url)?.server {
                    ServerConfig::Centralized { server } => {
                        hosts.push((server.host.to_string(), server.port))
                    }
                    ServerConfig::Clustered { hosts: seeds, .. } => {
                        hosts.extend(seeds.into_iter().map(|s| (s.host.to_string(), s.port)))
                    }
                    _ => {
                        return Err(RedisError::Connection(format!(
                            "{url:?} is not a redis node URL"
                        )));
                    }
                }
            }
            config.server = ServerConfig::new_clustered(hosts);
            Ok(config)
        }
        RedisTarget::Sentinel(target) => crate::config::redis::sentinel_config(target)
            .map_err(|why| RedisError::Connection(format!("invalid redis sentinel setup: {why}"))),
    }
}

/// Closes `clients` (sentinel watchers), each within a second.
async fn quit_all(clients: &[fred::clients::Client]) {
    let quits = clients
        .iter()
        .map(|c| tokio::time::timeout(Duration::from_secs(1), c.quit()));
    futures_util::future::join_all(quits).await;
}

impl RedisStore {
    /// Builds the pool and starts connecting in the background: never blocks, and succeeds
    /// while Redis is down (the breaker then opens and the probe waits for Redis). Fails
    /// only on a bad URL or outside a Tokio runtime.
    pub fn connect(settings: RedisSettings) -> Result<Self, RedisError> {
        Self::connect_with(settings, ScriptPath::Functions)
    }

    /// [`RedisStore::connect`] with the way scripts reach Redis chosen: `Evalsha` keeps a
    /// Redis ≥ 7 on the path older servers take (tests run both; an escape hatch).
    pub fn connect_with(settings: RedisSettings, path: ScriptPath) -> Result<Self, RedisError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            RedisError::Connection("RedisStore::connect needs a Tokio runtime".to_string())
        })?;
        let mut config = fred_config(&settings.target)?;
        // Reconnect per policy from the very first attempt instead of failing init().
        config.fail_fast = false;
        let cluster = config.server.is_clustered();
        let timeout = settings.timeout.max(Duration::from_millis(1));
        // Short backoff ceiling: decisions come back to Redis within ~1 s of it returning.
        let mut policy = ReconnectPolicy::new_exponential(0, 10, 400, 2);
        policy.set_jitter(20);
        // A sentinel that is down is asked again every 2 s at most: it only brings news.
        let mut watch_policy = ReconnectPolicy::new_exponential(0, 100, 2_000, 2);
        watch_policy.set_jitter(100);
        let watchers = sentinel::watchers(&config, &watch_policy)?;
        let master = sentinel::master_name(&config).map(str::to_owned);
        // Its own connection: a RESP2 connection that subscribed runs nothing else.
        let subscriber = Builder::from_config(config.clone())
            .with_connection_config(|c: &mut ConnectionConfig| {
                c.connection_timeout = Duration::from_secs(1);
                c.internal_command_timeout = Duration::from_secs(1);
            })
            .set_policy(policy.clone())
            .build()
            .map_err(|e| {
                RedisError::Connection(format!("building the redis subscriber: {}", e.details()))
            })?;
        let pool = Builder::from_config(config)
            .with_connection_config(|c: &mut ConnectionConfig| {
                c.connection_timeout = Duration::from_secs(1);
                c.internal_command_timeout = Duration::from_secs(1);
                // fred counts every write of a command as an attempt, a redirected one too: at
                // 1, a call after a slot changed owner (`MOVED`) failed, and one to a slot
                // mid-move (`ASK`) ended the connection's task. One redirection is followed
                // (`MOVED`: fred refreshes its slot map, then resends); fred 10.1 resends an
                // `ASK`ed command to the old owner, so the second `ASK` answers that call with
                // an error (`redirect`, the on_error fallback) instead of spending the
                // attempts and ending the task. The price of 3 attempts: a call whose
                // connection dropped mid-flight may be sent again before it times out (a
                // request charged twice, never one admitted over the limit).
                c.max_command_attempts = 3;
                c.max_redirections = 1;
                c.max_command_buffer_len = MAX_QUEUED_COMMANDS;
                c.unresponsive = UnresponsiveConfig {
                    max_timeout: Some(Duration::from_secs(2).max(timeout * 4)),
                    interval: Duration::from_millis(500),
                };
            })
            .with_performance_config(|p: &mut PerformanceConfig| {
                p.default_command_timeout = timeout
            })
            .set_policy(policy)
            .build_pool(settings.pool_size.max(1))
            .map_err(|e| {
                RedisError::Connection(format!("building the redis pool: {}", e.details()))
            })?;
        let inner = Arc::new(Inner {
            pool,
            cluster,
            timeout,
            scripts: Scripts::new(path),
            batcher: (settings.batch_max > 1).then(|| Batcher::new(settings.batch_max)),
            queues: u16::try_from(settings.pool_size.clamp(1, 64)).unwrap_or(1),
            breaker: Mutex::new(Breaker::new(BREAKER_THRESHOLD, PROBE_EVERY)),
            shut_down: AtomicBool::new(false),
            subscriber: subscriber.clone(),
            resets: tokio::sync::broadcast::channel(RESETS_QUEUED).0,
            watchers,
        });
        let logged = Arc::new(Mutex::new(BTreeMap::new()));
        for client in inner.pool.clients() {
            runtime.spawn(supervise(client.clone(), Arc::downgrade(&inner)));
            runtime.spawn(log_connection_errors(client.error_rx(), logged.clone()));
        }
        runtime.spawn(supervise(subscriber.clone(), Arc::downgrade(&inner)));
        let resets = inner.resets.clone();
        runtime.spawn(listen(
            subscriber,
            RESET_CHANNEL,
            move |tag| {
                let _ = resets.send(tag);
            },
            Arc::downgrade(&inner),
        ));
        if let Some(master) = master {
            let (announce, announced) = tokio::sync::watch::channel(None);
            for watcher in &inner.watchers {
                runtime.spawn(supervise(watcher.clone(), Arc::downgrade(&inner)));
                runtime.spawn(log_connection_errors(watcher.error_rx(), logged.clone()));
                let (announce, master) = (announce.clone(), master.clone());
                runtime.spawn(listen(
                    watcher.clone(),
                    sentinel::SWITCH_CHANNEL,
                    move |message| {
                        if let Some(to) = sentinel::switched_to(&message, &master) {
                            announce.send_if_modified(|now| {
                                let new = now.as_ref() != Some(&to);
                                *now = Some(to);
                                new
                            });
                        }
                    },
                    Arc::downgrade(&inner),
                ));
            }
            runtime.spawn(follow_switches(announced, Arc::downgrade(&inner)));
        }
        runtime.spawn(probe_loop(Arc::downgrade(&inner)));
        if path == ScriptPath::Functions {
            runtime.spawn(load_library(Arc::downgrade(&inner)));
        }
        Ok(Self { inner })
    }

    /// Decides all of a request's global limits: checked together, charged only if all
    /// admit. `now_override` replaces the server clock (tests only).
    pub async fn decide(
        &self,
        limits: &[GlobalLimit<'_>],
        now_override: Option<Micros>,
    ) -> Result<Decision, RedisError> {
        self.decide_with_shadows(limits, &[], now_override).await
    }

    /// [`RedisStore::decide`] where `shadow[i]` marks a shadow limit: decided in the same call,
    /// its rejection stops nothing, and it is charged (when it admits) exactly when the
    /// enforced limits are. `Decision::admitted` is about the enforced limits.
    pub async fn decide_with_shadows(
        &self,
        limits: &[GlobalLimit<'_>],
        shadow: &[bool],
        now_override: Option<Micros>,
    ) -> Result<Decision, RedisError> {
        self.decide_leasing(limits, shadow, &[], now_override).await
    }

    /// [`RedisStore::decide_with_shadows`] where `leases[i]` (missing: 0) is the lease id a
    /// concurrency limit's slot is taken under, when the request is admitted: what
    /// [`RedisStore::release_leases`] later gives back. A concurrency limit's rejection says
    /// its own `retry_after`.
    pub async fn decide_leasing(
        &self,
        limits: &[GlobalLimit<'_>],
        shadow: &[bool],
        leases: &[u64],
        now_override: Option<Micros>,
    ) -> Result<Decision, RedisError> {
        let instance_now = script::instance_now(now_override);
        self.decide_seen_from(limits, shadow, leases, now_override, instance_now)
            .await
    }

    /// [`RedisStore::decide_leasing`] with the calendar windows sent around `instance_now`
    /// rather than this instance's clock: what an instance whose clock is that far from Redis's
    /// sends (tests of the skew the scripts absorb; Redis's clock decides the window).
    pub async fn decide_seen_from(
        &self,
        limits: &[GlobalLimit<'_>],
        shadow: &[bool],
        leases: &[u64],
        now_override: Option<Micros>,
        instance_now: Micros,
    ) -> Result<Decision, RedisError> {
        if limits.is_empty() {
            return Ok(Decision {
                admitted: true,
                per_limit: Vec::new(),
                at: Vec::new(),
            });
        }
        self.inner.check_breaker()?;
        let groups = self.groups(limits);
        let mut decision = if groups.len() == 1 {
            let all: Vec<&GlobalLimit<'_>> = limits.iter().collect();
            let (keys, args) =
                script::decide_call(&all, shadow, leases, now_override, instance_now)?;
            let reply = self.inner.decide_queued(keys, args).await?;
            let reply = script::decode_decide(&reply, limits.len(), shadow)?;
            Decision {
                admitted: reply.admitted,
                at: vec![reply.now; reply.per_limit.len()],
                per_limit: reply.per_limit,
            }
        } else {
            // Boxed: a rare path (a Cluster request over several slots) whose future would
            // otherwise make every decision's larger.
            Box::pin(self.decide_split(limits, shadow, leases, groups, now_override, instance_now))
                .await?
        };
        for (l, v) in limits.iter().zip(&mut decision.per_limit) {
            if let (Algorithm::Concurrency(c), LimitVerdict::Rejected(r)) = (l.algorithm, v) {
                r.retry_after = c.retry_after();
            }
        }
        Ok(decision)
    }

    /// Decides `requests` in one `decide_many` call, in order, each as [`RedisStore::decide_seen_from`]
    /// would decide it alone at that point (the queues do this for requests that arrive while
    /// a call is in flight; this picks the batch, for tests and tools). Every request's keys
    /// must share one hash slot on a Cluster. Calendar windows are sent around each request's
    /// `now_override`, or this instance's clock.
    pub async fn decide_batch(
        &self,
        requests: &[BatchRequest<'_>],
    ) -> Result<Vec<Decision>, RedisError> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        self.inner.check_breaker()?;
        let mut batch = Vec::with_capacity(requests.len());
        let mut replies = Vec::with_capacity(requests.len());
        for r in requests {
            let all: Vec<&GlobalLimit<'_>> = r.limits.iter().collect();
            let instance_now = script::instance_now(r.now_override);
            let (keys, args) =
                script::decide_call(&all, &r.shadow, &r.leases, r.now_override, instance_now)?;
            let (tx, rx) = tokio::sync::oneshot::channel();
            batch.push(Pending {
                keys,
                args,
                reply: tx,
            });
            replies.push(rx);
        }
        let (keys, args) = batch::many_call(&batch);
        let reply = self.inner.eval(Call::DecideMany, keys, args).await;
        batch::answer(batch, reply);
        let mut out = Vec::with_capacity(requests.len());
        for (r, rx) in requests.iter().zip(replies) {
            let reply = rx.await.map_err(|_| {
                RedisError::Protocol("a batched decision got no answer".to_string())
            })??;
            let reply = script::decode_decide(&reply, r.limits.len(), &r.shadow)?;
            let mut decision = Decision {
                admitted: reply.admitted,
                at: vec![reply.now; reply.per_limit.len()],
                per_limit: reply.per_limit,
            };
            for (l, v) in r.limits.iter().zip(&mut decision.per_limit) {
                if let (Algorithm::Concurrency(c), LimitVerdict::Rejected(rej)) = (l.algorithm, v) {
                    rej.retry_after = c.retry_after();
                }
            }
            out.push(decision);
        }
        Ok(out)
    }

    /// Gives back concurrency leases (`(lease set, lease id)`) whose requests ended, one
    /// script call per hash slot: per lease, whether it was still held (`false`: it had run out
    /// before, or its key was reset). Fails fast while the breaker is open (the lease then runs
    /// out by itself).
    pub async fn release_leases(&self, leases: &[(String, u64)]) -> Result<Vec<bool>, RedisError> {
        self.inner.check_breaker()?;
        let mut held = vec![false; leases.len()];
        for group in self.lease_groups(leases.iter().map(|(k, _)| k.as_str())) {
            let part: Vec<(String, u64)> = group.iter().map(|&i| leases[i].clone()).collect();
            let (keys, args) = script::release_call(&part, None)?;
            let reply = self.inner.eval(Call::Release, keys, args).await?;
            for (i, f) in group.iter().zip(script::decode_flags(&reply, part.len())?) {
                held[*i] = f;
            }
        }
        Ok(held)
    }

    /// Renews leases (`(lease set, lease id, lease length µs)`) whose requests still run, one
    /// script call per hash slot: per lease, whether it was renewed (`false`: it had already
    /// run out, and its slot is free).
    pub async fn renew_leases(
        &self,
        leases: &[(String, u64, Micros)],
    ) -> Result<Vec<bool>, RedisError> {
        self.inner.check_breaker()?;
        let mut renewed = vec![false; leases.len()];
        for group in self.lease_groups(leases.iter().map(|(k, ..)| k.as_str())) {
            let part: Vec<(String, u64, Micros)> =
                group.iter().map(|&i| leases[i].clone()).collect();
            let (keys, args) = script::renew_call(&part, None)?;
            let reply = self.inner.eval(Call::Renew, keys, args).await?;
            for (i, f) in group.iter().zip(script::decode_flags(&reply, part.len())?) {
                renewed[*i] = f;
            }
        }
        Ok(renewed)
    }

    /// After a response: the request `s` names (charged `s.estimate` on `limit`'s key at
    /// `s.at`, the instant its decision returned, which left the key full again at
    /// `s.full_at`) really cost `s.delta` more (or less), charged or given back in one script
    /// call (any rate algorithm; the key may go into debt). `limit.cost` is not read: the
    /// estimate is the settlement's. Whether the state changed.
    pub async fn settle(
        &self,
        limit: &GlobalLimit<'_>,
        s: Settlement,
        now_override: Option<Micros>,
    ) -> Result<bool, RedisError> {
        self.settle_seen_from(limit, s, now_override, script::instance_now(now_override))
            .await
    }

    /// [`RedisStore::settle`] with calendar windows sent around `instance_now` rather than this
    /// instance's clock (tests of the skew the script absorbs, as
    /// [`RedisStore::decide_seen_from`]).
    pub async fn settle_seen_from(
        &self,
        limit: &GlobalLimit<'_>,
        s: Settlement,
        now_override: Option<Micros>,
        instance_now: Micros,
    ) -> Result<bool, RedisError> {
        self.inner.check_breaker()?;
        let (keys, args) = script::settle_call(limit, s, now_override, instance_now)?;
        let reply = self.inner.eval(Call::Settle, keys, args).await?;
        Ok(reply.first() == Some(&1))
    }

    /// Indices of `keys` per script call: one group on a single Redis, one per hash slot on a
    /// cluster.
    fn lease_groups<'k>(&self, keys: impl Iterator<Item = &'k str>) -> Vec<Vec<usize>> {
        let mut by_slot: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for (i, key) in keys.enumerate() {
            let slot = if self.inner.cluster {
                fred::util::redis_keyslot(key.as_bytes())
            } else {
                0
            };
            by_slot.entry(slot).or_default().push(i);
        }
        by_slot.into_values().collect()
    }

    /// Indices of `limits` per script call: one group on a single Redis, one per hash slot
    /// on a cluster.
    fn groups(&self, limits: &[GlobalLimit<'_>]) -> Vec<Vec<usize>> {
        if !self.inner.cluster {
            return vec![(0..limits.len()).collect()];
        }
        let mut by_slot: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for (i, limit) in limits.iter().enumerate() {
            let keys = redis_keys(limit.key, limit.algorithm);
            let slot = keys
                .first()
                .map_or(0, |k| fred::util::redis_keyslot(k.as_bytes()));
            by_slot.entry(slot).or_default().push(i);
        }
        by_slot.into_values().collect()
    }

    /// The cluster path for limits on several slots: one call per slot, then refunds if any
    /// rejected. Runs in its own task so that a caller giving up (client gone) cannot
    /// interrupt it between a commit and its refund.
    async fn decide_split(
        &self,
        limits: &[GlobalLimit<'_>],
        shadow: &[bool],
        leases: &[u64],
        groups: Vec<Vec<usize>>,
        now_override: Option<Micros>,
        instance_now: Micros,
    ) -> Result<Decision, RedisError> {
        // Owned copies for the task; a refund needs each limit's keys and arguments again.
        let mut calls = Vec::with_capacity(groups.len());
        for group in &groups {
            let members: Vec<&GlobalLimit<'_>> = group.iter().map(|&i| &limits[i]).collect();
            let flags: Vec<bool> = group
                .iter()
                .map(|&i| shadow.get(i).copied().unwrap_or(false))
                .collect();
            let ids: Vec<u64> = group
                .iter()
                .map(|&i| leases.get(i).copied().unwrap_or(0))
                .collect();
            let decide = script::decide_call(&members, &flags, &ids, now_override, instance_now)?;
            let decide = (decide, flags);
            let refunds: Vec<(Algorithm, String, u64, Micros, u64)> = members
                .iter()
                .zip(&ids)
                .map(|(l, &id)| {
                    (
                        l.algorithm.clone(),
                        l.key.to_string(),
                        l.cost,
                        l.max_delay,
                        id,
                    )
                })
                .collect();
            calls.push((decide, refunds));
        }
        let inner = Arc::clone(&self.inner);
        let task = tokio::spawn(async move {
            let mut set = JoinSet::new();
            for (g, (((keys, args), _), _)) in calls.iter().enumerate() {
                let inner = Arc::clone(&inner);
                let (keys, args) = (keys.clone(), args.clone());
                set.spawn(async move { (g, inner.decide_queued(keys, args).await) });
            }
            let mut replies: Vec<Option<Result<DecideReply, RedisError>>> = vec![None; calls.len()];
            while let Some(joined) = set.join_next().await {
                if let Ok((g, reply)) = joined {
                    let n = calls[g].1.len();
                    let flags = &calls[g].0.1;
                    replies[g] = Some(reply.and_then(|r| script::decode_decide(&r, n, flags)));
                }
            }
            let all_admitted = replies
                .iter()
                .all(|r| matches!(r, Some(Ok(d)) if d.admitted));
            if !all_admitted {
                // Give back what the admitting slots took.
                let mut refunds = JoinSet::new();
                for (g, reply) in replies.iter().enumerate() {
                    let Some(Ok(reply)) = reply else { continue };
                    if !reply.admitted {
                        continue;
                    }
                    // What this slot committed: its limits that admitted (a shadow limit
                    // that rejected took nothing).
                    let committed = calls[g]
                        .1
                        .iter()
                        .zip(&reply.per_limit)
                        .filter(|(_, v)| v.is_admitted())
                        .map(|(l, _)| l.clone());
                    for (algorithm, key, cost, max_delay, lease) in committed {
                        let inner = Arc::clone(&inner);
                        let at = reply.now;
                        refunds.spawn(async move {
                            let limit = GlobalLimit {
                                algorithm: &algorithm,
                                key: &key,
                                cost,
                                max_delay,
                            };
                            let result = match script::refund_call(&limit, at, lease, now_override) {
                                Ok((keys, args)) => inner.eval(Call::Refund, keys, args).await.map(|_| ()),
                                Err(e) => Err(e),
                            };
                            if let Err(e) = result {
                                tracing::warn!(error = %e, kind = e.kind(), "redis refund failed; units stay taken until the key expires");
                            }
                        });
                    }
                }
                while refunds.join_next().await.is_some() {}
            }
            replies
        });
        let replies = task
            .await
            .map_err(|e| RedisError::Protocol(format!("decision task failed: {e}")))?;

        let mut per_limit: Vec<Option<LimitVerdict>> = vec![None; limits.len()];
        let mut at = vec![0; limits.len()];
        for (group, reply) in groups.iter().zip(replies) {
            let reply = reply.unwrap_or_else(|| {
                Err(RedisError::Protocol(
                    "decision task lost a reply".to_string(),
                ))
            })?;
            for (&i, verdict) in group.iter().zip(reply.per_limit) {
                per_limit[i] = Some(verdict);
                at[i] = reply.now;
            }
        }
        let per_limit: Vec<LimitVerdict> = per_limit
            .into_iter()
            .map(|v| v.ok_or_else(|| RedisError::Protocol("a limit got no verdict".to_string())))
            .collect::<Result<_, _>>()?;
        Ok(Decision {
            admitted: per_limit
                .iter()
                .enumerate()
                .all(|(i, v)| v.is_admitted() || shadow.get(i).copied().unwrap_or(false)),
            per_limit,
            at,
        })
    }

    /// Current state of one limit's key on the server clock, read-only (admin API).
    pub async fn peek(&self, limit: &GlobalLimit<'_>) -> Result<Snapshot, RedisError> {
        self.peek_at(limit, None)
            .await
            .map(|(snapshot, _)| snapshot)
    }

    /// [`RedisStore::peek`] with a clock override (tests), also returning the instant read.
    pub async fn peek_at(
        &self,
        limit: &GlobalLimit<'_>,
        now_override: Option<Micros>,
    ) -> Result<(Snapshot, Micros), RedisError> {
        self.inner.check_breaker()?;
        let (keys, args) = script::peek_call(limit, now_override)?;
        let reply = self.inner.eval(Call::Peek, keys, args).await?;
        script::decode_peek(&reply)
    }

    /// Gives back `limit`'s units taken by a decision at `committed_at` (the cluster path
    /// does this itself; exposed for tests and tools). `Ok(false)`: nothing left to give back.
    pub async fn refund(
        &self,
        limit: &GlobalLimit<'_>,
        committed_at: Micros,
        now_override: Option<Micros>,
    ) -> Result<bool, RedisError> {
        self.inner.check_breaker()?;
        let (keys, args) = script::refund_call(limit, committed_at, 0, now_override)?;
        let reply = self.inner.eval(Call::Refund, keys, args).await?;
        Ok(reply.first() == Some(&1))
    }

    /// Eventual consistency: adds this instance's unpushed counts to the window counters
    /// `curr_key` (window `ws`) and `prev_key` (`ws` − period) and returns their totals and the
    /// server time, in one script call (both keys share the limit's hash tag). A counter
    /// written expires `life` after its window's start (Redis time): when no decision reads it.
    pub async fn sync_counts(
        &self,
        (curr_key, prev_key): (String, String),
        (push_curr, push_prev): (u64, u64),
        ws: Micros,
        life: Micros,
        period: Micros,
    ) -> Result<(u64, u64, Micros), RedisError> {
        self.inner.check_breaker()?;
        let arg = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let reply = self
            .inner
            .eval(
                Call::Sync,
                vec![curr_key, prev_key],
                vec![
                    arg(push_curr),
                    arg(push_prev),
                    arg(ws),
                    arg(life),
                    arg(period),
                ],
            )
            .await?;
        match reply[..] {
            [c, p, now] => Ok((
                u64::try_from(c).unwrap_or(0),
                u64::try_from(p).unwrap_or(0),
                u64::try_from(now).unwrap_or(0),
            )),
            _ => Err(RedisError::Protocol(format!("sync reply {reply:?}"))),
        }
    }

    /// Eventual consistency for a gcra limit (`sync_gcra.lua`): adds `units` admitted on this
    /// instance to the shared TAT at `key` (one emission `interval` each) and returns the TAT
    /// and the server time. The TAT is capped at now + `tau`, where no admission can leave it.
    pub async fn sync_gcra(
        &self,
        key: String,
        units: u64,
        (interval, tau): (Micros, Micros),
    ) -> Result<(Micros, Micros), RedisError> {
        self.inner.check_breaker()?;
        let arg = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let reply = self
            .inner
            .eval(
                Call::SyncGcra,
                vec![key],
                vec![arg(units), arg(interval), arg(tau)],
            )
            .await?;
        match reply[..] {
            [tat, now] => Ok((
                u64::try_from(tat).unwrap_or(0),
                u64::try_from(now).unwrap_or(0),
            )),
            _ => Err(RedisError::Protocol(format!("sync reply {reply:?}"))),
        }
    }

    /// A reservation (reserve.lua, see `Gcra::grant`): at least `limit.cost` units of
    /// `limit` (a gcra limit, its burst already reduced by what a reservation may outlive) and
    /// up to `want`, as many as fit now, for this instance to spend in process.
    pub async fn reserve(
        &self,
        limit: &GlobalLimit<'_>,
        want: u64,
        now_override: Option<Micros>,
    ) -> Result<Grant, RedisError> {
        self.inner.check_breaker()?;
        let (keys, args) = script::reserve_call(limit, want, now_override)?;
        let reply = self.inner.eval(Call::Reserve, keys, args).await?;
        let num = |v: i64| u64::try_from(v).unwrap_or(0);
        match reply[..] {
            [granted, remaining, reset_after, retry_after, at] => Ok(Grant {
                verdict: if granted > 0 {
                    Ok((
                        num(granted),
                        Snapshot {
                            remaining: num(remaining),
                            reset_after: num(reset_after),
                        },
                    ))
                } else {
                    Err(Rejection {
                        retry_after: num(retry_after).max(1),
                        remaining: num(remaining),
                        reset_after: num(reset_after),
                    })
                },
                at: num(at),
            }),
            _ => Err(RedisError::Protocol(format!("reserve reply {reply:?}"))),
        }
    }

    /// Deletes `keys` in one `DEL` (the admin API's reset of one key of a limit) and returns
    /// how many existed. The keys must share a hash slot on a Cluster: one limit's keys for one
    /// key do (see [`redis_keys`]). Sent even while the breaker is open, like [`Self::ping`].
    ///
    /// Once deleted, the keys' hash tag is published on [`RESET_CHANNEL`], so every instance
    /// forgets the key in process too (its in-process tier would otherwise go on rejecting it
    /// from what Redis said before); best effort: a publish that fails is logged, the reset
    /// stands.
    pub async fn reset(&self, keys: Vec<String>) -> Result<u64, RedisError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let tag = hash_tag(&keys[0]).map(str::to_owned);
        let deleted = self.inner.del(keys).await?;
        let Some(tag) = tag else {
            // Not a limit's keys (those always have a tag): nobody to tell.
            return Ok(deleted);
        };
        let client = self.inner.pool.next_connected();
        let publish = client.publish::<i64, _, _>(RESET_CHANNEL, tag);
        match tokio::time::timeout(self.inner.timeout + OUTER_SLACK, publish).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(error = %RedisError::from(e), "publishing a reset"),
            Err(_) => tracing::warn!("publishing a reset: no answer within the timeout"),
        }
        Ok(deleted)
    }

    /// The breaker lets requests through: Redis answered last time, or has not failed yet.
    pub fn is_available(&self) -> bool {
        self.inner.breaker().allows_requests()
    }

    /// The circuit breaker's state.
    pub fn health(&self) -> Health {
        self.inner.breaker().health()
    }

    /// What the decide queues did since the store started (all zero with `batch_max: 1`).
    pub fn batch_stats(&self) -> BatchStats {
        self.inner
            .batcher
            .as_ref()
            .map_or_else(BatchStats::default, Batcher::stats)
    }

    /// Whether the store talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.cluster
    }

    /// `Functions` until Redis has shown it has none; then `Evalsha`.
    pub fn script_path(&self) -> ScriptPath {
        self.inner.scripts.path()
    }

    /// One PING within the timeout, whatever the breaker says; its outcome feeds the breaker.
    pub async fn ping(&self) -> Result<(), RedisError> {
        self.inner.ping().await
    }

    /// Stops the probe and closes the connections. Calls after it fail.
    pub async fn shutdown(&self) {
        self.inner.shut_down.store(true, Ordering::SeqCst);
        let _ = tokio::time::timeout(Duration::from_secs(1), self.inner.pool.quit()).await;
        let _ = tokio::time::timeout(Duration::from_secs(1), self.inner.subscriber.quit()).await;
        quit_all(&self.inner.watchers).await;
    }

    /// The resets any instance sends from now on (this one's too): each the hash tag of the
    /// key that was reset (`ROUTE/LIMIT/KEY`, see [`RedisStore::reset`]).
    pub fn resets(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.inner.resets.subscribe()
    }

    /// Whether `other` is a clone of this store (same pool): a reload kept it.
    pub fn same(&self, other: &RedisStore) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// Subscribes `client` to `channel` once it is connected, again after every reconnection (a
/// new connection has no subscriptions), and passes every message on to `heard`, until the
/// store is dropped or shut down.
async fn listen(
    client: fred::clients::Client,
    channel: &'static str,
    mut heard: impl FnMut(String) + Send + 'static,
    inner: Weak<Inner>,
) {
    use tokio::sync::broadcast::error::RecvError;
    let mut messages = client.message_rx();
    let mut reconnects = client.reconnect_rx();
    let stopped = || {
        inner
            .upgrade()
            .is_none_or(|i| i.shut_down.load(Ordering::SeqCst))
    };
    // The first connection may not be up yet: `reconnect_rx` reports it too.
    if client.is_connected() {
        let _ = client.subscribe(channel).await;
    }
    loop {
        tokio::select! {
            m = messages.recv() => match m {
                Ok(m) => {
                    if let Some(text) = m.value.as_string() {
                        heard(text);
                    }
                }
                Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => return,
            },
            r = reconnects.recv() => match r {
                Ok(_) | Err(RecvError::Lagged(_)) => {
                    if stopped() {
                        return;
                    }
                    if let Err(e) = client.subscribe(channel).await {
                        tracing::warn!(error = %RedisError::from(e), channel, "subscribing");
                    }
                }
                Err(RecvError::Closed) => return,
            },
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if stopped() {
                    return;
                }
            }
        }
    }
}

/// Moves the store's connections (pool and subscriber) to each master the sentinels announce
/// (see [`sentinel`]), until the store is dropped or every watcher has ended.
async fn follow_switches(
    mut announced: tokio::sync::watch::Receiver<Option<sentinel::Address>>,
    inner: Weak<Inner>,
) {
    while announced.changed().await.is_ok() {
        let Some(to) = announced.borrow_and_update().clone() else {
            continue;
        };
        let clients = {
            let Some(inner) = inner.upgrade() else { return };
            if inner.shut_down.load(Ordering::SeqCst) {
                return;
            }
            let mut clients = inner.pool.clients().to_vec();
            clients.push(inner.subscriber.clone());
            clients
        };
        tracing::warn!(master = %to, "redis sentinel switched the master; moving to it");
        let moved = sentinel::move_to(&clients, &to, || {
            announced.has_changed().unwrap_or(true)
                || inner
                    .upgrade()
                    .is_none_or(|i| i.shut_down.load(Ordering::SeqCst))
        })
        .await;
        if moved {
            tracing::info!(master = %to, "every redis connection is on the new master");
            // Close the breaker now rather than at the next probe: decisions return at once.
            if let Some(inner) = inner.upgrade() {
                let _ = inner.ping().await;
            }
        } else if !announced.has_changed().unwrap_or(true) {
            tracing::warn!(
                master = %to,
                "not every redis connection reached the announced master; they follow what the sentinels answer at their next reconnect"
            );
        }
    }
}

/// Runs one pool connection's task, and starts it again when it ends while the store is in
/// use. fred's task reconnects by itself after a dropped connection, but ends for good on an
/// error inside its command loop (a redirection it could not follow was one): its connection
/// would then take every later call and answer none of them, a timeout each, until restart.
/// Restarts back off from [`RESTART_AFTER`] to 5 s, so a task that keeps ending costs a log
/// line every few seconds, not ten a second.
async fn supervise(client: fred::clients::Client, inner: Weak<Inner>) {
    let stopped = || {
        inner
            .upgrade()
            .is_none_or(|i| i.shut_down.load(Ordering::SeqCst))
    };
    let mut wait = RESTART_AFTER;
    loop {
        let task = client.connect();
        if stopped() {
            // Shut down between the last check and this start: the QUIT may have gone to the
            // task that ended, so this one must be stopped here or it reconnects forever.
            let _ = tokio::time::timeout(Duration::from_secs(1), client.quit()).await;
            return;
        }
        let started = Instant::now();
        let ended = task.await;
        if stopped() {
            return;
        }
        if started.elapsed() > Duration::from_secs(30) {
            wait = RESTART_AFTER;
        }
        tracing::warn!(
            outcome = ?ended,
            restart_in_ms = wait.as_millis() as u64,
            "a redis connection's task ended; starting it again"
        );
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(5));
    }
}

/// fred tells why a connection failed (refused, `WRONGPASS`, a TLS error...) only on its
/// error channel: without this, a wrong password reads as Redis being down (the breaker
/// opens, `kind="unavailable"`). One warning per cause across the pool's clients (`logged`,
/// shared: cause → when last logged), repeated at most every [`ERROR_LOG_EVERY`] while it
/// lasts, so reconnect loops, or several nodes failing differently, do not flood the log.
/// Ends when the client is dropped.
async fn log_connection_errors(
    mut errors: tokio::sync::broadcast::Receiver<(
        fred::error::Error,
        Option<fred::types::config::Server>,
    )>,
    logged: Arc<Mutex<BTreeMap<String, Instant>>>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        match errors.recv().await {
            Ok((error, server)) => {
                let text = error.to_string();
                let now = Instant::now();
                {
                    let mut logged = logged.lock().unwrap_or_else(|p| p.into_inner());
                    // Causes not seen for a while are forgotten, so the map stays small.
                    logged.retain(|_, at| now.duration_since(*at) < ERROR_LOG_EVERY);
                    if logged.contains_key(&text) {
                        continue;
                    }
                    logged.insert(text.clone(), now);
                }
                match server {
                    Some(server) => {
                        tracing::warn!(%server, error = %text, "redis connection failed")
                    }
                    None => tracing::warn!(error = %text, "redis connection failed"),
                }
            }
            Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => return,
        }
    }
}

/// How often one unchanged connection error is logged again.
const ERROR_LOG_EVERY: Duration = Duration::from_secs(30);

/// Loads the function library on every primary as soon as Redis answers, so that the first
/// decisions do not each find the function missing and load it; finds out on the way whether
/// the server has functions at all. Tries again while Redis cannot be reached, and gives up on
/// any other error: calls then load the library themselves, and report what fails.
async fn load_library(inner: Weak<Inner>) {
    loop {
        let Some(inner) = inner.upgrade() else { return };
        if inner.shut_down.load(Ordering::SeqCst) {
            return;
        }
        let client = inner.pool.next_connected();
        let attempt = async {
            client.wait_for_connect().await?;
            inner.scripts.load_library(client).await
        };
        let error = match tokio::time::timeout(Duration::from_secs(1), attempt).await {
            Ok(Ok(true)) => {
                tracing::debug!(library = %library().name, "redis function library loaded");
                return;
            }
            Ok(Ok(false)) => return,
            Ok(Err(e)) => RedisError::from(e),
            Err(_) => RedisError::Timeout,
        };
        if !error.is_outage() {
            tracing::warn!(error = %error, "loading the redis function library failed");
            return;
        }
        drop(inner);
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

/// PINGs while the breaker is open or Redis never answered. Holds only a weak reference,
/// so it ends with the last [`RedisStore`] clone (or at shutdown).
async fn probe_loop(inner: Weak<Inner>) {
    let mut tick = tokio::time::interval(PROBE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        if inner.shut_down.load(Ordering::SeqCst) {
            return;
        }
        let due = inner.breaker().probe_due(Instant::now());
        if due {
            let _ = inner.ping().await;
        }
    }
}
