//! The validated configuration the proxy runs on.
//!
//! Defaults are already applied and every cross-field rule already holds, so
//! users of these types never re-check them. They serialize to JSON for
//! `GET /admin/config`: in the YAML's own notation where there is one
//! (durations as `30s`, key parts as `header:x-user-id`), and with secrets
//! (the admin token, Redis passwords) redacted, because that endpoint's output
//! ends up in tickets and chat.

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use rustls::pki_types::CertificateDer;
use serde::{Serialize, Serializer};

pub use super::after::{ConcurrencyConfig, SettleConfig};
pub use super::overrides_file::{OverridesTable, TableEntry};
use super::rate::DurationText;
pub use super::rate::Rate;
pub use super::rejection::{Piece, RejectionConfig, Template, TemplateError};

/// A validated `routes.yaml`, defaults applied: what the gateway runs.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Config {
    /// The `server` section: listeners and process-wide settings.
    pub server: ServerConfig,
    /// `None`: no `redis` section, so every limit is local to this instance.
    pub redis: Option<RedisConfig>,
    /// Named rates that overrides and overrides files refer to (`plans:`), in file order.
    #[serde(
        serialize_with = "serialize_plans",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub plans: Vec<Plan>,
    /// Limits defined once at the top level (`limits:`) and drawn on by every route that says
    /// `- use: NAME`: one budget per key, whichever route a request takes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub limits: Vec<LimitConfig>,
    /// In file order: the first match wins.
    pub routes: Vec<RouteConfig>,
    /// Settings that load but do less than they seem to (a `burst` on a window algorithm, a
    /// `max_delay` under `on_limit: reject`...), each at its line and column with a message
    /// starting `warning:`. `check` prints them, `run` and reloads log them.
    #[serde(skip)]
    pub warnings: Vec<super::ConfigError>,
    /// The hash of the file's bytes this config was loaded from (`None`: not from a file):
    /// what the file watcher compares with first, so a save between the load and the
    /// watcher's start is not missed.
    #[serde(skip)]
    pub source_hash: Option<u64>,
}

/// What runs, not how the file put it: the warnings name its lines, so the same settings
/// saved from `/admin/config` load back equal.
impl PartialEq for Config {
    fn eq(&self, other: &Self) -> bool {
        self.server == other.server
            && self.redis == other.redis
            && self.plans == other.plans
            && self.limits == other.limits
            && self.routes == other.routes
    }
}

impl Config {
    /// The files read with the config besides it (overrides files), each once: a change to one
    /// is a change to the config.
    pub fn files_read(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = self
            .limits
            .iter()
            .chain(self.routes.iter().flat_map(|r| &r.limits))
            .filter_map(|l| l.overrides_file.as_ref().map(|f| f.path.clone()))
            .collect();
        files.sort();
        files.dedup();
        files
    }
}

/// The `server` section.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServerConfig {
    /// The proxy listener's address; default `0.0.0.0:8080`.
    pub listen: SocketAddr,
    /// The admin listener's address (`/metrics`, `/healthz`, `/readyz`, `/admin/*`); default
    /// `127.0.0.1:9090`.
    pub admin: SocketAddr,
    /// Peers whose `X-Forwarded-For` / `Forwarded` are believed.
    pub trusted_proxies: Vec<IpNet>,
    /// How long in-flight requests may run after SIGTERM.
    #[serde(serialize_with = "serialize_duration")]
    pub grace_period: Duration,
    /// Cap on delayed requests waiting per route, so `on_limit: delay` cannot
    /// pile up unbounded memory and sockets.
    pub max_waiters: usize,
    /// The most keys the in-process stores hold together (local limits' state, the tier in
    /// front of Redis, eventual counts); past it, the keys closest to full are evicted first.
    /// Default: derived from the memory the process may use (`limit::budget`).
    pub max_keys: usize,
    /// Bearer token for `/admin/*`; `None` leaves them open to whoever reaches
    /// the admin listener.
    #[serde(serialize_with = "serialize_secret")]
    pub admin_token: Option<String>,
    /// TLS on the proxy listener; `None`: plain HTTP (and h2c).
    pub tls: Option<ListenerTls>,
    /// Extra trust anchors for `https://` upstreams, on top of the system roots.
    pub upstream_ca: Option<UpstreamCa>,
    /// Put the limit key (client IP, user id...) in rejection log lines. Off by default:
    /// keys are personal data and logs travel far.
    pub log_keys: bool,
    /// Plain HTTP/1.1 connections take the fast path (`proxy::h1`); off: everything is served
    /// by hyper (the general path). An escape hatch, and the other side of an A/B comparison.
    pub fast_path: bool,
}

/// `server.tls`: the proxy listener's certificate chain and key (PEM files; relative paths are
/// relative to the config file's directory). The files are read when the config is validated,
/// so a config that exists holds a usable certificate.
#[derive(Clone, Debug, Serialize)]
pub struct ListenerTls {
    /// The certificate chain's PEM file, resolved against the config file's directory.
    #[serde(serialize_with = "serialize_path")]
    pub cert: PathBuf,
    /// The private key's PEM file, resolved against the config file's directory.
    #[serde(serialize_with = "serialize_path")]
    pub key: PathBuf,
    /// Built from the two files: the chain, its key, ALPN `h2` and `http/1.1`.
    #[serde(skip)]
    pub server_config: Arc<rustls::ServerConfig>,
}

/// Equal when they name the same files (the material is what those files held when read).
impl PartialEq for ListenerTls {
    fn eq(&self, other: &Self) -> bool {
        self.cert == other.cert && self.key == other.key
    }
}

/// `server.upstream_ca`: a PEM bundle of CA certificates trusted for `https://` upstreams in
/// addition to the system roots. Serializes as its path.
#[derive(Clone, Debug, PartialEq)]
pub struct UpstreamCa {
    /// The bundle's file, resolved against the config file's directory.
    pub path: PathBuf,
    /// Every certificate of the bundle, each checked to be usable as a trust anchor.
    pub certs: Vec<CertificateDer<'static>>,
}

impl Serialize for UpstreamCa {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        serialize_path(&self.path, s)
    }
}

/// What `/admin/config` shows instead of a secret.
pub(super) const REDACTED: &str = "<redacted>";

/// Absolute: the path was resolved against the config file's directory, so shown relative it
/// would resolve twice in a file saved from `/admin/config` next to the original.
fn serialize_path<S: Serializer>(path: &std::path::Path, s: S) -> Result<S::Ok, S::Error> {
    match std::path::absolute(path) {
        Ok(abs) => abs.serialize(s),
        Err(_) => path.serialize(s),
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from((Ipv4Addr::UNSPECIFIED, 8080)),
            admin: SocketAddr::from((Ipv4Addr::LOCALHOST, 9090)),
            trusted_proxies: Vec::new(),
            grace_period: Duration::from_secs(30),
            max_waiters: 1024,
            max_keys: crate::limit::budget::default_max_keys().keys,
            admin_token: None,
            tls: None,
            upstream_ca: None,
            log_keys: false,
            fast_path: true,
        }
    }
}

/// The `redis` section: where `global` limits keep their state.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RedisConfig {
    /// `url: ..`, `cluster: [..]` or `sentinel: {..}` right in the section, as in the YAML.
    #[serde(flatten)]
    pub target: RedisTarget,
    /// Per command: a slow Redis must not hold requests longer than this.
    #[serde(serialize_with = "serialize_duration")]
    pub timeout: Duration,
    /// What `global` limits decide when Redis does not answer; default `allow`.
    pub on_error: OnError,
    /// Redis clients in the pool, each pipelining many commands; default 2.
    pub pool_size: usize,
    /// Decisions one script call may decide: those that queued behind a call in flight on
    /// the same queue go together in the next one; default 64, 1 turns batching off.
    pub batch_max: usize,
}

/// Which Redis the global limits use. Serializes like the YAML: `{"url": ..}`,
/// `{"cluster": [..]}` or `{"sentinel": {"master": .., "nodes": [..]}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum RedisTarget {
    /// `redis://[user:pass@]host:port[/db]`; a `redis-cluster://host:port?node=h2:p2` URL
    /// selects a cluster too.
    #[serde(rename = "url")]
    Single(#[serde(serialize_with = "serialize_redis_url")] String),
    /// Seed nodes of a Redis Cluster (`redis://host:port` each); the rest is discovered.
    #[serde(rename = "cluster")]
    Cluster(#[serde(serialize_with = "serialize_redis_urls")] Vec<String>),
    /// A master that Redis Sentinel names: the sentinels say which server it is, at connect
    /// and after a failover, so a failover is followed without a restart.
    #[serde(rename = "sentinel")]
    Sentinel(SentinelTarget),
}

/// `redis.sentinel`: which master, asked of which sentinels, and the credentials of each side
/// (sentinels and Redis servers are configured apart, and often authenticate apart).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SentinelTarget {
    /// The master's name in the sentinels' configuration (`sentinel monitor NAME ...`).
    pub master: String,
    /// Sentinels, `redis://[user:pass@]host:port` (port 26379 when left out); the credentials
    /// in these URLs are the sentinels' own. Every node has the same credentials and scheme.
    #[serde(serialize_with = "serialize_redis_urls")]
    pub nodes: Vec<String>,
    /// ACL user on the master (and on a replica once promoted); `None`: `default`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Password on the master (and on a replica once promoted); `None`: no `AUTH`.
    #[serde(
        serialize_with = "serialize_secret",
        skip_serializing_if = "Option::is_none"
    )]
    pub password: Option<String>,
}

/// What a `global` limit decides when Redis does not answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Decide with the local limiter instead.
    Allow,
    /// Reply 503.
    Deny,
}

/// One entry of `routes`: which requests it takes, where it sends them and the limits they
/// must pass.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RouteConfig {
    /// Unique among the routes; the `route` label of metrics and part of its limits' Redis keys.
    pub name: String,
    /// Which requests are this route's; without `match` in the file, every request.
    #[serde(rename = "match")]
    pub matcher: RouteMatch,
    /// Balanced round-robin; never empty. Serialized as the YAML's `upstream`: one URL, or a
    /// list of them.
    #[serde(rename = "upstream", serialize_with = "serialize_upstreams")]
    pub upstreams: Vec<http::Uri>,
    /// Whole upstream exchange; past it the client gets 504.
    #[serde(serialize_with = "serialize_duration")]
    pub timeout: Duration,
    /// Forward the client's `Host` (`false`: the upstream's); default `true`.
    pub preserve_host: bool,
    /// `RateLimit` fields on admitted responses too.
    pub headers: bool,
    /// All must admit a request.
    pub limits: Vec<LimitConfig>,
    /// What a rate-limited request gets; `None`: tollgate's own 429.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rejection: Option<RejectionConfig>,
}

/// A route's `match`: path, host and methods must all hold.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RouteMatch {
    /// `path: ..` or `path_prefix: ..` right in `match`, as in the YAML.
    #[serde(flatten)]
    pub path: PathMatch,
    /// Lowercase, without a port: compare with the request's host the same way.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Uppercase; `None` matches every method.
    #[serde(
        serialize_with = "serialize_methods",
        skip_serializing_if = "Option::is_none"
    )]
    pub methods: Option<Vec<http::Method>>,
}

/// Serializes like the YAML: `{"path": ..}` or `{"path_prefix": ..}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum PathMatch {
    /// The request path must equal this.
    #[serde(rename = "path")]
    Exact(String),
    /// Without a trailing `/` (except `/` itself), so the matcher can test the
    /// segment boundary with one comparison.
    #[serde(rename = "path_prefix")]
    Prefix(String),
}

/// One entry of a route's `limits`: how its requests are keyed, counted and answered.
#[derive(Clone, Debug, PartialEq)]
pub struct LimitConfig {
    /// Unique within its route; the `limit` label of metrics, part of the Redis key, and the
    /// name in `RateLimit-Policy`.
    pub name: String,
    /// Parts joined into the client key; never empty.
    pub key: Vec<KeyPart>,
    /// Default `skip`.
    pub on_missing: OnMissing,
    /// Default `gcra`.
    pub algorithm: AlgorithmKind,
    /// `rate: COUNT/PERIOD`; how tightly any one period is bounded depends on `algorithm`.
    pub rate: Rate,
    /// gcra bucket depth; equals `rate.count` for the other algorithms.
    pub burst: u64,
    /// Default `global` when there is a `redis` section, else `local`.
    pub scope: Scope,
    /// Units one request takes; validated to be admissible at least once.
    pub cost: u64,
    /// Default `reject`.
    pub on_limit: OnLimit,
    /// Longest wait with `on_limit: delay` (0: never waits). Under `reject` it is what the file
    /// says and has no effect (the file is loaded with a warning then).
    pub max_delay: Duration,
    /// Count and report, never reject.
    pub shadow: bool,
    /// Default `strict`. `eventual` needs `scope: global`, and loads as `strict` (with a
    /// warning) where it could not keep its bound.
    pub consistency: Consistency,
    /// How often an `eventual` limit exchanges counts with Redis.
    pub sync_interval: Duration,
    /// `align: calendar` (fixed_window only): windows are the days, weeks or months of a zone,
    /// and `rate.period` their nominal length. `None`: windows aligned to the epoch.
    pub calendar: Option<super::CalendarWindows>,
    /// Other rates (or none at all) for some requests' keys: the first that matches applies.
    pub overrides: Vec<Override>,
    /// `KEY: PLAN` / `KEY: exempt` for many keys, consulted after `overrides`.
    pub overrides_file: Option<OverridesFile>,
    /// Defined in the top-level `limits:` and drawn on here by `- use: NAME`: its state is
    /// keyed without the route, so every route that uses it shares one budget per key.
    pub shared: bool,
    /// `algorithm: concurrency`: its slots (`rate` then holds `max_in_flight` per `lease`, for
    /// the code that reads a quota; it is shown as neither).
    pub concurrency: Option<ConcurrencyConfig>,
    /// `settle:`: after the response, the true cost is charged (or the charge given back).
    pub settle: Option<SettleConfig>,
    /// `reserve_ahead` (strict global gcra only): how long units an instance reserved in Redis
    /// may be spent in process; the burst every decision is made against is smaller by the
    /// units of that much time (config/reserve.rs).
    pub reserve_ahead: Option<Duration>,
}

impl LimitConfig {
    /// Whether some requests' keys may get another rate, or none (overrides, a file).
    pub fn has_overrides(&self) -> bool {
        !self.overrides.is_empty() || self.overrides_file.is_some()
    }
}

/// One named rate of `plans:`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Its name in `plans:`, as overrides and overrides files refer to it.
    pub name: String,
    /// `rate: COUNT/PERIOD`.
    pub rate: Rate,
    /// gcra bucket depth; `None`: the limit's algorithm decides (gcra: the plan's COUNT).
    pub burst: Option<u64>,
}

/// One entry of a limit's `overrides`: a condition and what a request that meets it gets.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Override {
    /// Every condition given must hold.
    pub when: When,
    /// The rate that applies instead, or none.
    #[serde(flatten)]
    pub then: OverrideRate,
}

/// An override's condition: each list given must hold (any of its items); at least one given.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct When {
    /// The client address (as the `ip` key part finds it) is in one of these networks.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ip: Vec<IpNet>,
    /// The limit's key, as `/admin/limits` shows it, is one of these.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub key: Vec<String>,
    /// Each header has exactly this value; believed only when the peer is a trusted proxy.
    #[serde(
        serialize_with = "serialize_header_conditions",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub header: Vec<(http::HeaderName, String)>,
}

/// What an override or an overrides-file entry gives a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OverrideRate {
    /// The limit does not count these requests at all.
    Exempt,
    /// This rate and burst instead of the limit's; `plan` names it when it came from `plans:`.
    Rate {
        /// The plan it came from; `None` for an inline `rate:`.
        plan: Option<String>,
        /// The rate that applies.
        rate: Rate,
        /// gcra bucket depth (for the window algorithms, the rate's count).
        burst: u64,
    },
}

/// As the YAML writes it: `exempt: true`, `plan: NAME`, or `rate:` (with `burst:`).
impl Serialize for OverrideRate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        match self {
            Self::Exempt => m.serialize_entry("exempt", &true)?,
            Self::Rate {
                plan: Some(plan), ..
            } => m.serialize_entry("plan", plan)?,
            Self::Rate {
                plan: None,
                rate,
                burst,
            } => {
                m.serialize_entry("rate", rate)?;
                m.serialize_entry("burst", burst)?;
            }
        }
        m.end()
    }
}

/// `overrides_file`: its path and what it held when the config was loaded.
#[derive(Clone, Debug)]
pub struct OverridesFile {
    /// Resolved against the config file's directory.
    pub path: PathBuf,
    /// The file's entries.
    pub table: Arc<OverridesTable>,
    /// Per plan of the config (the table's plan indexes), the rate it gives this limit; `None`
    /// for a plan no entry names (not checked against this limit, never looked up).
    pub plans: Vec<Option<OverrideRate>>,
}

/// Equal when they name the same file with the same entries (a reload that changed the file
/// builds a new snapshot; one that did not keeps comparing equal).
impl PartialEq for OverridesFile {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path
            && self.table.fingerprint() == other.table.fingerprint()
            && self.plans == other.plans
    }
}

impl Serialize for OverridesFile {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        serialize_path(&self.path, s)
    }
}

fn serialize_plans<S: Serializer>(plans: &[Plan], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    #[derive(Serialize)]
    struct Body {
        rate: Rate,
        #[serde(skip_serializing_if = "Option::is_none")]
        burst: Option<u64>,
    }
    let mut m = s.serialize_map(Some(plans.len()))?;
    for p in plans {
        m.serialize_entry(
            &p.name,
            &Body {
                rate: p.rate,
                burst: p.burst,
            },
        )?;
    }
    m.end()
}

fn serialize_header_conditions<S: Serializer>(
    headers: &[(http::HeaderName, String)],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_map(headers.iter().map(|(n, v)| (n.as_str(), v)))
}

/// Field by field as the YAML has them, so the output loads back as a routes.yaml; `burst`
/// only for gcra (on the other algorithms it is ignored, with a warning, and holds the count).
impl Serialize for LimitConfig {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let gcra = self.algorithm == AlgorithmKind::Gcra;
        if self.shared {
            // Defined in the top-level `limits:`, which `/admin/config` shows once.
            let mut m = s.serialize_struct("LimitConfig", 1)?;
            m.serialize_field("use", &self.name)?;
            return m.end();
        }
        if let Some(slots) = &self.concurrency {
            return self.serialize_slots(slots, s);
        }
        let mut m = s.serialize_struct("LimitConfig", 17)?;
        m.serialize_field("name", &self.name)?;
        m.serialize_field("key", &self.key)?;
        m.serialize_field("on_missing", &self.on_missing)?;
        m.serialize_field("algorithm", &self.algorithm)?;
        match &self.calendar {
            None => m.serialize_field("rate", &self.rate)?,
            Some(c) => m.serialize_field("rate", &format!("{}/{}", self.rate.count, c.unit))?,
        }
        if gcra {
            m.serialize_field("burst", &self.burst)?;
        } else {
            m.skip_field("burst")?;
        }
        m.serialize_field("scope", &self.scope)?;
        m.serialize_field("cost", &self.cost)?;
        m.serialize_field("on_limit", &self.on_limit)?;
        m.serialize_field("max_delay", &DurationText(self.max_delay).to_string())?;
        m.serialize_field("shadow", &self.shadow)?;
        m.serialize_field("consistency", &self.consistency)?;
        m.serialize_field(
            "sync_interval",
            &DurationText(self.sync_interval).to_string(),
        )?;
        if let Some(c) = &self.calendar {
            m.serialize_field("align", "calendar")?;
            m.serialize_field("timezone", c.zone_name())?;
        } else {
            m.skip_field("align")?;
            m.skip_field("timezone")?;
        }
        if self.overrides.is_empty() {
            m.skip_field("overrides")?;
        } else {
            m.serialize_field("overrides", &self.overrides)?;
        }
        match &self.overrides_file {
            Some(f) => m.serialize_field("overrides_file", f)?,
            None => m.skip_field("overrides_file")?,
        }
        match &self.settle {
            Some(settle) => m.serialize_field("settle", settle)?,
            None => m.skip_field("settle")?,
        }
        match self.reserve_ahead {
            Some(ahead) => m.serialize_field("reserve_ahead", &DurationText(ahead).to_string())?,
            None => m.skip_field("reserve_ahead")?,
        }
        m.end()
    }
}

impl LimitConfig {
    /// A concurrency limit as the YAML writes one: its slot fields, none of the rate's.
    fn serialize_slots<S: Serializer>(
        &self,
        slots: &ConcurrencyConfig,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut m = s.serialize_struct("LimitConfig", 9)?;
        m.serialize_field("name", &self.name)?;
        m.serialize_field("key", &self.key)?;
        m.serialize_field("on_missing", &self.on_missing)?;
        m.serialize_field("algorithm", &self.algorithm)?;
        m.serialize_field("max_in_flight", &slots.max_in_flight)?;
        m.serialize_field("lease", &DurationText(slots.lease).to_string())?;
        m.serialize_field("retry_after", &DurationText(slots.retry_after).to_string())?;
        m.serialize_field("scope", &self.scope)?;
        m.serialize_field("on_limit", &self.on_limit)?;
        m.serialize_field("shadow", &self.shadow)?;
        m.end()
    }
}

/// One part of a limit's key; written `ip`, `ip_prefix:V4,V6`, `header:NAME`, `query:NAME`,
/// `path`, `method`, `route` or `literal:TEXT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyPart {
    /// The client address: the socket peer or, when the peer is in `trusted_proxies`, the first
    /// untrusted address of `X-Forwarded-For` / `Forwarded` from the right.
    Ip,
    /// That request header's value.
    Header(http::HeaderName),
    /// That query parameter's value, decoded.
    Query(String),
    /// The request path, without the query.
    Path,
    /// The request method.
    Method,
    /// The matched route's name.
    Route,
    /// This text, the same for every request (`literal:all`: one bucket every client shares).
    Literal(String),
    /// `ip_prefix:V4,V6`: the client address (as `ip` finds it) truncated to its first `v4`
    /// bits (IPv4, IPv4-mapped IPv6 included) or `v6` bits (IPv6), in CIDR text. A client holds
    /// a whole IPv6 /64 (often a /56 or /48) and picks any address in it, so keyed by address
    /// it has 2^64 budgets; keyed by its prefix it has one.
    IpPrefix {
        /// Prefix length for IPv4 clients, `0..=32`.
        v4: u8,
        /// Prefix length for IPv6 clients, `0..=128`.
        v6: u8,
    },
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip => f.write_str("ip"),
            Self::Header(name) => write!(f, "header:{name}"),
            Self::Query(name) => write!(f, "query:{name}"),
            Self::Path => f.write_str("path"),
            Self::Method => f.write_str("method"),
            Self::Route => f.write_str("route"),
            Self::Literal(text) => write!(f, "literal:{text}"),
            Self::IpPrefix { v4, v6 } => write!(f, "ip_prefix:{v4},{v6}"),
        }
    }
}

impl Serialize for KeyPart {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

macro_rules! keyword_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant),+
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(match self { $(Self::$variant => $text),+ })
            }
        }
    };
}

keyword_enum!(
    /// What a limit does when a key part is absent from the request.
    OnMissing {
        /// The limit does not apply to this request.
        Skip = "skip",
        /// Fall back to the client IP as the whole key.
        Ip = "ip",
        /// Refuse the request.
        Reject = "reject",
    }
);

keyword_enum!(
    /// `token_bucket` and `leaky_bucket` are GCRA: same admissions, one timestamp of state.
    AlgorithmKind {
        /// One timestamp per key; at most `burst + count` in any period.
        Gcra = "gcra",
        /// One counter per aligned window; at most `count` in a window, `2 × count` across a
        /// boundary.
        FixedWindow = "fixed_window",
        /// The aligned window's count plus the previous one's, weighted by overlap: about
        /// `count` in any period.
        SlidingWindow = "sliding_window",
        /// Every admission's timestamp: never more than `count` in any period, for memory that
        /// grows with `count` per key.
        SlidingLog = "sliding_log",
        /// Not a rate: at most `max_in_flight` requests of one key at once, each holding a slot
        /// until its response has been sent.
        Concurrency = "concurrency",
    }
);

keyword_enum!(
    /// Where a limit's state is kept, and so which instances share it.
    Scope {
        /// This instance only, in memory.
        Local = "local",
        /// Shared by every instance through Redis.
        Global = "global",
    }
);

keyword_enum!(
    /// What a request over the limit gets.
    OnLimit {
        /// 429 at once.
        Reject = "reject",
        /// Wait for the reserved slot, up to `max_delay`.
        Delay = "delay",
    }
);

keyword_enum!(
    /// Where a `global` limit's decisions are made.
    Consistency {
        /// Every decision made in Redis.
        Strict = "strict",
        /// Decided locally, counts exchanged every `sync_interval`.
        Eventual = "eventual",
    }
);

pub(super) fn serialize_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&DurationText(*d))
}

fn serialize_secret<S: Serializer>(secret: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match secret {
        Some(_) => s.serialize_some(REDACTED),
        None => s.serialize_none(),
    }
}

/// As the YAML has it: a string for one upstream, a list for several; and without the `/`
/// that `http::Uri` shows for an empty path, so `http://10.0.0.5:9000` reads back as written.
fn serialize_upstreams<S: Serializer>(upstreams: &[http::Uri], s: S) -> Result<S::Ok, S::Error> {
    let text = |u: &http::Uri| {
        let t = u.to_string();
        match t.strip_suffix('/') {
            Some(bare) if u.path_and_query().is_some_and(|p| p.as_str() == "/") => bare.to_string(),
            _ => t,
        }
    };
    match upstreams {
        [one] => s.serialize_str(&text(one)),
        many => s.collect_seq(many.iter().map(text)),
    }
}

fn serialize_methods<S: Serializer>(
    methods: &Option<Vec<http::Method>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match methods {
        Some(methods) => s.serialize_some(&methods.iter().map(|m| m.as_str()).collect::<Vec<_>>()),
        None => s.serialize_none(),
    }
}

fn serialize_redis_url<S: Serializer, T: AsRef<str>>(url: &T, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_url(url.as_ref()))
}

fn serialize_redis_urls<S: Serializer>(urls: &[String], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(urls.iter().map(|u| redact_url(u)))
}

/// `redis://user:pass@host:6379/0` → `redis://<redacted>@host:6379/0`.
pub(super) fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://{REDACTED}{}", &rest[at..]),
        None => url.to_owned(),
    }
}
