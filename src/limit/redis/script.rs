//! The wire format between [`RedisStore`](super::RedisStore) and the Lua scripts: script
//! sources, the function library, key names, ARGV encoding and reply decoding. The layouts are
//! documented at the top of `lua/decide.lua`, `lua/refund.lua` and `lua/peek.lua`; this file is
//! their only Rust counterpart.

use crate::config::redis::MAX_PARAM;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, Ordering};

use fred::clients::Client;
use fred::error::Error as FredError;
use fred::interfaces::FunctionInterface;
use fred::types::scripts::Script;
use fred::types::{MultipleKeys, MultipleValues};

use super::{GlobalLimit, LimitVerdict, RedisError};
use crate::limit::algorithm::{Algorithm, Micros, Rejection, Settlement, Snapshot};

/// `gcra.lua` (helpers and the gcra arithmetic) and `lib.lua` (the four algorithms) followed
/// by one entry point: each script is self-contained on the server, with a single copy of the
/// arithmetic in the repository. decide.lua has `decide_gcra.lua` in front of `lib.lua`: Redis
/// runs a script's whole body on every call, and a decision on gcra limits only, answered
/// there, skips building the library (what that saves Redis: `CALLGRIND=1 bench/script.sh`,
/// runs in docs/benchmarks.md).
pub const DECIDE_LUA: &str = concat!(
    include_str!("lua/gcra.lua"),
    "\n",
    include_str!("lua/decide_gcra.lua"),
    "\n",
    include_str!("lua/lib.lua"),
    "\n",
    include_str!("lua/decide.lua")
);
/// `decide_many.lua` as sent: several requests' decisions in one call (the batcher's), each
/// decided as `decide.lua` would decide it alone.
pub const DECIDE_MANY_LUA: &str = concat!(
    include_str!("lua/gcra.lua"),
    "\n",
    include_str!("lua/lib.lua"),
    "\n",
    include_str!("lua/decide_many.lua")
);
/// `refund.lua` as sent: gives back one limit's units an earlier decide call took (Cluster
/// only, when another slot's call rejected the request).
pub const REFUND_LUA: &str = concat!(
    include_str!("lua/gcra.lua"),
    "\n",
    include_str!("lua/lib.lua"),
    "\n",
    include_str!("lua/refund.lua")
);
/// `peek.lua` as sent: one limit's key state, read-only, for the admin API.
pub const PEEK_LUA: &str = concat!(
    include_str!("lua/gcra.lua"),
    "\n",
    include_str!("lua/lib.lua"),
    "\n",
    include_str!("lua/peek.lua")
);

/// `release.lua` as sent: gives back concurrency leases whose requests ended.
pub(super) const RELEASE_LUA: &str = concat!(
    include_str!("lua/gcra.lua"),
    "\n",
    include_str!("lua/release.lua")
);
/// `renew.lua` as sent: moves on the expiry of leases whose requests still run.
pub(super) const RENEW_LUA: &str = concat!(
    include_str!("lua/gcra.lua"),
    "\n",
    include_str!("lua/renew.lua")
);

/// `settle.lua` as sent: charges or gives back what a request really cost, after its response.
pub(super) const SETTLE_LUA: &str = concat!(
    include_str!("lua/gcra.lua"),
    "\n",
    include_str!("lua/lib.lua"),
    "\n",
    include_str!("lua/settle.lua")
);

/// `reserve.lua` as sent: a reservation of units on one gcra key (`reserve_ahead`).
pub const RESERVE_LUA: &str = concat!(
    include_str!("lua/gcra.lua"),
    "\n",
    include_str!("lua/reserve.lua")
);

/// Eventual-consistency push/pull of one key's window counters (standalone: no shared math).
pub(super) const SYNC_LUA: &str = include_str!("lua/sync.lua");
/// The same for a gcra key: adds this instance's units to the shared TAT.
pub(super) const SYNC_GCRA_LUA: &str = include_str!("lua/sync_gcra.lua");

/// Values per limit in ARGV: algo, count, period, burst, cost, max_delay (calendar windows
/// add their 4 bounds).
pub(super) const ARGS_PER_LIMIT: usize = 6;
/// ARGV values before the first limit of decide.lua: now override, TTL floor, n.
pub(super) const DECIDE_HEADER: usize = 3;
/// decide.lua's reply: all_admitted and now, then 4 values per limit.
pub(super) const REPLY_HEADER: usize = 2;
pub(super) const REPLY_PER_LIMIT: usize = 4;

/// ARGV value meaning "use the server's clock".
const SERVER_CLOCK: i64 = -1;

/// library.lua, the function library's skeleton: each `--@ <file>` line stands for that file.
pub const LIBRARY_LUA: &str = include_str!("lua/library.lua");

/// The files library.lua includes, by the name its `--@` lines give.
const LIBRARY_PARTS: [(&str, &str); 13] = [
    ("gcra.lua", include_str!("lua/gcra.lua")),
    ("lib.lua", include_str!("lua/lib.lua")),
    ("decide_gcra.lua", include_str!("lua/decide_gcra.lua")),
    ("decide.lua", include_str!("lua/decide.lua")),
    ("decide_many.lua", include_str!("lua/decide_many.lua")),
    ("refund.lua", include_str!("lua/refund.lua")),
    ("peek.lua", include_str!("lua/peek.lua")),
    ("sync.lua", include_str!("lua/sync.lua")),
    ("sync_gcra.lua", include_str!("lua/sync_gcra.lua")),
    ("release.lua", include_str!("lua/release.lua")),
    ("renew.lua", include_str!("lua/renew.lua")),
    ("settle.lua", include_str!("lua/settle.lua")),
    ("reserve.lua", include_str!("lua/reserve.lua")),
];

/// The function library as loaded with `FUNCTION LOAD`: its name carries a digest of its code,
/// so a tollgate whose Lua differs loads a library of another name instead of replacing the
/// one the instances of the previous version still call (see library.lua).
#[derive(Debug)]
pub struct Library {
    /// `tollgate_v` and 12 hex digits of the SHA-1 of the expanded code.
    pub name: String,
    /// What `FUNCTION LOAD` gets: the `#!lua name=` line, `local LIB = '<name>'`, the code.
    pub source: String,
    /// Function names, in [`Call`] order.
    functions: [String; 10],
}

/// library.lua with its `--@` lines replaced by the files they name. bench/library_lua.sh does
/// the same with awk, byte for byte: every line ends with "\n", an included file's last line
/// too.
fn expand_library(skeleton: &str, parts: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(64 * 1024);
    for line in skeleton.lines() {
        match line.strip_prefix("--@ ") {
            Some(file) => {
                let (_, text) = parts
                    .iter()
                    .find(|(name, _)| *name == file.trim())
                    .unwrap_or_else(|| panic!("library.lua includes unknown file {file:?}"));
                out.push_str(text);
                if !text.ends_with('\n') {
                    out.push('\n');
                }
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

impl Library {
    fn build() -> Self {
        let code = expand_library(LIBRARY_LUA, &LIBRARY_PARTS);
        let name = format!("tollgate_v{}", &fred::util::sha1_hash(&code)[..12]);
        let source = format!("#!lua name={name}\nlocal LIB = '{name}'\n{code}");
        let functions = Call::ALL.map(|call| format!("{name}_{}", call.function()));
        Self {
            name,
            source,
            functions,
        }
    }

    /// The name `FCALL` calls `call` by.
    pub fn function(&self, call: Call) -> &str {
        &self.functions[call as usize]
    }
}

/// The library this build loads; assembled once.
pub fn library() -> &'static Library {
    static LIBRARY: LazyLock<Library> = LazyLock::new(Library::build);
    &LIBRARY
}

/// The scripts' entry points, each an EVALSHA script and a function of the library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Decide = 0,
    Refund = 1,
    Peek = 2,
    Sync = 3,
    SyncGcra = 4,
    Release = 5,
    Renew = 6,
    Settle = 7,
    DecideMany = 8,
    Reserve = 9,
}

impl Call {
    const ALL: [Call; 10] = [
        Call::Decide,
        Call::Refund,
        Call::Peek,
        Call::Sync,
        Call::SyncGcra,
        Call::Release,
        Call::Renew,
        Call::Settle,
        Call::DecideMany,
        Call::Reserve,
    ];

    /// The function's name in library.lua, after the library's name and `_`.
    fn function(self) -> &'static str {
        match self {
            Call::Decide => "decide",
            Call::Refund => "refund",
            Call::Peek => "peek",
            Call::Sync => "sync",
            Call::SyncGcra => "sync_gcra",
            Call::Release => "release",
            Call::Renew => "renew",
            Call::Settle => "settle",
            Call::DecideMany => "decide_many",
            Call::Reserve => "reserve",
        }
    }
}

/// How the scripts reach Redis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScriptPath {
    /// `FCALL` of the function library, loaded once per primary, where the server has
    /// functions (Redis ≥ 7); `EVALSHA` from the first sign that it has not.
    #[default]
    Functions,
    /// `EVALSHA` only: every call also runs the helpers' top level (see [`DECIDE_LUA`]).
    Evalsha,
}

/// Both ways of running each entry point, and which one this store uses.
#[derive(Debug)]
pub(super) struct Scripts {
    decide: Script,
    refund: Script,
    peek: Script,
    sync: Script,
    sync_gcra: Script,
    release: Script,
    renew: Script,
    settle: Script,
    decide_many: Script,
    reserve: Script,
    library: &'static Library,
    /// Set when forced to, or once Redis turned `FCALL` or `FUNCTION LOAD` down as unknown (or
    /// not permitted): from then on every call is an EVALSHA, which every Redis has.
    evalsha_only: AtomicBool,
}

/// An error reply saying this server (or this user) cannot use functions at all: Redis < 7
/// (`unknown command`), or an ACL without FCALL / FUNCTION.
fn functions_unsupported(e: &FredError) -> bool {
    let details = e.details();
    details.starts_with("ERR unknown command") || details.starts_with("NOPERM")
}

/// The error reply of an `FCALL` to a function the node does not have: never loaded there,
/// or gone with `FUNCTION FLUSH`, a restart without persistence, a failover to a node that
/// never got it, a new Cluster node.
fn function_missing(e: &FredError) -> bool {
    e.details().starts_with("ERR Function not found")
}

/// `FUNCTION LOAD`'s reply when a library of that name is there: this very code, since the
/// name is its digest, loaded by another instance or an earlier connection.
fn library_exists(e: &FredError) -> bool {
    let details = e.details();
    details.starts_with("ERR Library") && details.ends_with("already exists")
}

impl Scripts {
    pub(super) fn new(path: ScriptPath) -> Self {
        Self {
            decide: Script::from_lua(DECIDE_LUA),
            refund: Script::from_lua(REFUND_LUA),
            peek: Script::from_lua(PEEK_LUA),
            sync: Script::from_lua(SYNC_LUA),
            sync_gcra: Script::from_lua(SYNC_GCRA_LUA),
            release: Script::from_lua(RELEASE_LUA),
            renew: Script::from_lua(RENEW_LUA),
            settle: Script::from_lua(SETTLE_LUA),
            decide_many: Script::from_lua(DECIDE_MANY_LUA),
            reserve: Script::from_lua(RESERVE_LUA),
            library: library(),
            evalsha_only: AtomicBool::new(path == ScriptPath::Evalsha),
        }
    }

    pub(super) fn path(&self) -> ScriptPath {
        if self.evalsha_only.load(Ordering::Relaxed) {
            ScriptPath::Evalsha
        } else {
            ScriptPath::Functions
        }
    }

    fn script(&self, call: Call) -> &Script {
        match call {
            Call::Decide => &self.decide,
            Call::Refund => &self.refund,
            Call::Peek => &self.peek,
            Call::Sync => &self.sync,
            Call::SyncGcra => &self.sync_gcra,
            Call::Release => &self.release,
            Call::Renew => &self.renew,
            Call::Settle => &self.settle,
            Call::DecideMany => &self.decide_many,
            Call::Reserve => &self.reserve,
        }
    }

    fn fall_back(&self, why: &FredError) {
        if !self.evalsha_only.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                reply = why.details(),
                "redis has no functions for tollgate; scripts go by EVALSHA"
            );
        }
    }

    /// `FUNCTION LOAD` of the library on every primary (one on a single Redis). Without
    /// REPLACE: a library of this name already there is this code, and Redis answers so before
    /// compiling anything, so a fleet starting up compiles it once per node, not once per
    /// instance, and nothing of another version is ever replaced. `Ok(false)`: the server has
    /// no functions, and this store now uses EVALSHA.
    pub(super) async fn load_library(&self, client: &Client) -> Result<bool, FredError> {
        if self.evalsha_only.load(Ordering::Relaxed) {
            return Ok(false);
        }
        match client
            .function_load_cluster::<fred::types::Value, _>(false, self.library.source.as_str())
            .await
        {
            Ok(_) => Ok(true),
            // On a cluster, some primaries may have had it and others not: fred sends the load
            // to every one of them and answers with one of their errors.
            Err(e) if library_exists(&e) => Ok(true),
            Err(e) if functions_unsupported(&e) => {
                self.fall_back(&e);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Runs `call`: an `FCALL` of the library's function, which is loaded again and called
    /// once more if the node has lost it (as EVALSHA does after `NOSCRIPT`); an EVALSHA when
    /// the server has no functions or the store was told to use EVALSHA. A call Redis turned
    /// down as unknown or missing never ran, so calling again cannot charge twice.
    pub(super) async fn run(
        &self,
        client: &Client,
        call: Call,
        keys: Vec<String>,
        args: Vec<i64>,
    ) -> Result<Vec<i64>, FredError> {
        let keys = MultipleKeys::from(keys);
        let args = MultipleValues::try_from(args)?;
        if !self.evalsha_only.load(Ordering::Relaxed) {
            let function = self.library.function(call);
            match client
                .fcall::<Vec<i64>, _, _, _>(function, keys.clone(), args.clone())
                .await
            {
                Err(e) if function_missing(&e) => {
                    if self.load_library(client).await? {
                        return client.fcall(function, keys, args).await;
                    }
                }
                Err(e) if functions_unsupported(&e) => self.fall_back(&e),
                result => return result,
            }
        }
        self.script(call)
            .evalsha_with_reload(client, keys, args)
            .await
    }
}

fn algo_code(algorithm: &Algorithm) -> i64 {
    match algorithm {
        Algorithm::Gcra(_) => 1,
        Algorithm::FixedWindow(f) if f.calendar_windows().is_some() => 5,
        Algorithm::FixedWindow(_) => 2,
        Algorithm::SlidingWindow(_) => 3,
        Algorithm::SlidingLog(_) => 4,
        Algorithm::Concurrency(_) => 6,
    }
}

/// Suffix per algorithm: a limit whose algorithm changes on reload starts from fresh keys
/// instead of misreading (or hitting WRONGTYPE on) the old algorithm's state.
fn suffixes(algorithm: &Algorithm) -> &'static [&'static str] {
    match algorithm {
        Algorithm::Gcra(_) => &[":gcra"],
        Algorithm::FixedWindow(_) => &[":fw"],
        Algorithm::SlidingWindow(_) => &[":sw"],
        Algorithm::SlidingLog(_) => &[":log", ":log:meta"],
        Algorithm::Concurrency(_) => &[":slots"],
    }
}

/// The part of `key` Redis Cluster hashes: the first non-empty `{...}`, else the whole key.
pub fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let len = key[open + 1..].find('}')?;
    (len > 0).then(|| &key[open + 1..open + 1 + len])
}

/// The Redis keys one limit's state lives in. They always share one hash tag (the base key's,
/// or the whole base key wrapped in `{}` when it has none), so a limit never spans slots.
pub fn redis_keys(base: &str, algorithm: &Algorithm) -> Vec<String> {
    let tagged = if hash_tag(base).is_some() {
        base.to_string()
    } else {
        format!("{{{base}}}")
    };
    suffixes(algorithm)
        .iter()
        .map(|suffix| format!("{tagged}{suffix}"))
        .collect()
}

/// Whether a limit can be decided in Lua exactly as in Rust (see [`MAX_PARAM`]). Config
/// validation calls this for `scope: global` limits; [`RedisStore`](super::RedisStore)
/// refuses a decision that fails it rather than decide it wrongly.
pub fn check_params(algorithm: &Algorithm, cost: u64, max_delay: Micros) -> Result<(), String> {
    let q = algorithm.quota();
    let named = [
        ("count", q.count),
        ("period (µs)", q.period),
        ("burst", q.burst),
        ("cost", cost),
        ("max_delay (µs)", max_delay),
    ];
    for (name, value) in named {
        if value > MAX_PARAM {
            return Err(format!(
                "{name} {value} is above {MAX_PARAM}, too large for a global limit"
            ));
        }
    }
    if q.count == 0 || q.period == 0 {
        return Err("count and period must be positive".to_string());
    }
    if let Algorithm::Gcra(g) = algorithm {
        let ahead = g.tau().max(g.emission_interval().saturating_mul(cost));
        if ahead > MAX_PARAM {
            return Err(format!(
                "burst × period / count is {ahead} µs, above {MAX_PARAM}, too large for a global limit"
            ));
        }
    }
    Ok(())
}

/// Appends one limit's 6 ARGV values, and for calendar windows the 4 bounds around
/// `instance_now` (this instance's estimate of Redis's clock), from which the script takes the
/// window that holds its own `TIME`. `lease` is a concurrency limit's lease id (in the `burst`
/// place, which concurrency has no use for), ignored for the other algorithms.
fn push_limit(
    args: &mut Vec<i64>,
    limit: &GlobalLimit<'_>,
    lease: u64,
    instance_now: Micros,
) -> Result<(), RedisError> {
    check_params(limit.algorithm, limit.cost, limit.max_delay).map_err(RedisError::Script)?;
    let q = limit.algorithm.quota();
    let burst = if limit.algorithm.is_concurrency() {
        lease.min(MAX_PARAM)
    } else {
        q.burst
    };
    // check_params bounds every value by 2^50, so the casts are lossless.
    args.extend([
        algo_code(limit.algorithm),
        q.count as i64,
        q.period as i64,
        burst as i64,
        limit.cost as i64,
        limit.max_delay as i64,
    ]);
    if let Algorithm::FixedWindow(f) = limit.algorithm
        && let Some(calendar) = f.calendar_windows()
    {
        let b = calendar.bounds(instance_now);
        for bound in [b.prev, b.start, b.end, b.next] {
            args.push(now_arg(Some(bound))?);
        }
    }
    Ok(())
}

/// This instance's estimate of Redis's clock: the wall clock (both are NTP's, as a rule), or
/// the override a test gives Redis.
pub(super) fn instance_now(now_override: Option<Micros>) -> Micros {
    now_override.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    })
}

fn now_arg(now_override: Option<Micros>) -> Result<i64, RedisError> {
    match now_override {
        None => Ok(SERVER_CLOCK),
        Some(now) if now <= MAX_PARAM * 8 => Ok(now as i64),
        Some(now) => Err(RedisError::Script(format!(
            "now override {now} out of range"
        ))),
    }
}

/// A test timeline does not follow the wall clock the TTLs run on, so keys written with an
/// overridden `now` are kept a day instead of expiring mid-test.
fn ttl_floor_ms(now_override: Option<Micros>) -> i64 {
    match now_override {
        None => 1,
        Some(_) => 86_400_000,
    }
}

/// KEYS and ARGV of one decide.lua call over `limits`; `shadow[i]` (missing: false) marks a
/// shadow limit, whose rejection does not stop the others; `leases[i]` (missing: 0) is a
/// concurrency limit's lease id. Calendar windows are sent around `instance_now`.
pub(super) fn decide_call(
    limits: &[&GlobalLimit<'_>],
    shadow: &[bool],
    leases: &[u64],
    now_override: Option<Micros>,
    instance_now: Micros,
) -> Result<(Vec<String>, Vec<i64>), RedisError> {
    let mut keys = Vec::with_capacity(limits.len() * 2);
    let mut args = Vec::with_capacity(DECIDE_HEADER + limits.len() * (ARGS_PER_LIMIT + 1));
    args.extend([
        now_arg(now_override)?,
        ttl_floor_ms(now_override),
        limits.len() as i64,
    ]);
    for (i, limit) in limits.iter().enumerate() {
        keys.extend(redis_keys(limit.key, limit.algorithm));
        push_limit(
            &mut args,
            limit,
            leases.get(i).copied().unwrap_or(0),
            instance_now,
        )?;
        args.push(i64::from(shadow.get(i).copied().unwrap_or(false)));
    }
    Ok((keys, args))
}

/// KEYS and ARGV of one reserve.lua call: at least `limit.cost` units and up to `want` of
/// `limit`, whose algorithm must be gcra (the reserving limit's, its burst already reduced).
pub(super) fn reserve_call(
    limit: &GlobalLimit<'_>,
    want: u64,
    now_override: Option<Micros>,
) -> Result<(Vec<String>, Vec<i64>), RedisError> {
    check_params(limit.algorithm, limit.cost, 0).map_err(RedisError::Script)?;
    let Algorithm::Gcra(g) = limit.algorithm else {
        return Err(RedisError::Script(
            "only a gcra limit reserves units ahead".to_string(),
        ));
    };
    let q = g.quota();
    // check_params bounds every value by 2^50, so the casts are lossless.
    let args = vec![
        now_arg(now_override)?,
        ttl_floor_ms(now_override),
        q.count as i64,
        q.period as i64,
        q.burst as i64,
        limit.cost as i64,
        want.clamp(limit.cost, MAX_PARAM) as i64,
    ];
    Ok((redis_keys(limit.key, limit.algorithm), args))
}

/// KEYS and ARGV of one refund.lua call undoing `limit`'s commit taken at `committed_at`
/// (for a concurrency limit, removing lease `lease`).
pub(super) fn refund_call(
    limit: &GlobalLimit<'_>,
    committed_at: Micros,
    lease: u64,
    now_override: Option<Micros>,
) -> Result<(Vec<String>, Vec<i64>), RedisError> {
    let mut args = vec![
        now_arg(now_override)?,
        ttl_floor_ms(now_override),
        now_arg(Some(committed_at))?,
    ];
    // Around the commit's own instant (Redis's clock): the window its units were taken in.
    push_limit(&mut args, limit, lease, committed_at)?;
    Ok((redis_keys(limit.key, limit.algorithm), args))
}

/// KEYS and ARGV of one peek.lua call.
pub(super) fn peek_call(
    limit: &GlobalLimit<'_>,
    now_override: Option<Micros>,
) -> Result<(Vec<String>, Vec<i64>), RedisError> {
    let mut args = vec![now_arg(now_override)?];
    push_limit(&mut args, limit, 0, instance_now(now_override))?;
    Ok((redis_keys(limit.key, limit.algorithm), args))
}

/// KEYS and ARGV of one release.lua call: each `(lease set, lease id)`.
pub(super) fn release_call(
    leases: &[(String, u64)],
    now_override: Option<Micros>,
) -> Result<(Vec<String>, Vec<i64>), RedisError> {
    let mut args = Vec::with_capacity(1 + leases.len());
    args.push(now_arg(now_override)?);
    args.extend(leases.iter().map(|(_, id)| (*id).min(MAX_PARAM) as i64));
    Ok((leases.iter().map(|(k, _)| k.clone()).collect(), args))
}

/// KEYS and ARGV of one renew.lua call: each `(lease set, lease id, lease length)`.
pub(super) fn renew_call(
    leases: &[(String, u64, Micros)],
    now_override: Option<Micros>,
) -> Result<(Vec<String>, Vec<i64>), RedisError> {
    let mut args = Vec::with_capacity(2 + 2 * leases.len());
    args.extend([now_arg(now_override)?, ttl_floor_ms(now_override)]);
    for (_, id, lease) in leases {
        args.extend([(*id).min(MAX_PARAM) as i64, (*lease).min(MAX_PARAM) as i64]);
    }
    Ok((leases.iter().map(|(k, ..)| k.clone()).collect(), args))
}

/// KEYS and ARGV of one settle.lua call: the request `s` names, charged `s.estimate` (sent as
/// the limit's cost) on `limit`'s key at `s.at`, really cost `s.delta` more (or less, when
/// negative). Calendar windows are sent around `instance_now`, as for a decision (not around
/// `at`, as a refund's are): a settlement writes the window holding Redis's clock now, and
/// tells the admission's window from it by `at` alone (the same window, or an earlier one).
pub(super) fn settle_call(
    limit: &GlobalLimit<'_>,
    s: Settlement,
    now_override: Option<Micros>,
    instance_now: Micros,
) -> Result<(Vec<String>, Vec<i64>), RedisError> {
    let bound = MAX_PARAM as i64;
    let mut args = vec![
        now_arg(now_override)?,
        ttl_floor_ms(now_override),
        now_arg(Some(s.at))?,
        s.delta.clamp(-bound, bound),
        // Within the scripts' exact range (as an instant is): only a debt beyond any real one
        // could reach it.
        s.full_at.min(MAX_PARAM * 8) as i64,
    ];
    let limit = GlobalLimit {
        cost: s.estimate,
        ..*limit
    };
    push_limit(&mut args, &limit, 0, instance_now)?;
    Ok((redis_keys(limit.key, limit.algorithm), args))
}

/// release.lua's or renew.lua's reply: one flag per lease.
pub(super) fn decode_flags(reply: &[i64], n: usize) -> Result<Vec<bool>, RedisError> {
    if reply.len() != n {
        return Err(RedisError::Protocol(format!(
            "{} lease flags for {n} leases",
            reply.len()
        )));
    }
    reply.iter().map(|&v| flag(v, "lease")).collect()
}

/// decide.lua's reply for `n` limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct DecideReply {
    pub admitted: bool,
    /// The instant (server clock, or the override) the decision was taken at.
    pub now: Micros,
    pub per_limit: Vec<LimitVerdict>,
}

fn unsigned(v: i64, what: &str) -> Result<u64, RedisError> {
    u64::try_from(v).map_err(|_| RedisError::Protocol(format!("negative {what}: {v}")))
}

fn flag(v: i64, what: &str) -> Result<bool, RedisError> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(RedisError::Protocol(format!(
            "{what} is {v}, expected 0 or 1"
        ))),
    }
}

/// decide.lua's reply for `n` limits, `shadow[i]` (missing: false) marking the shadow ones,
/// whose verdicts do not count towards `all_admitted`.
pub(super) fn decode_decide(
    reply: &[i64],
    n: usize,
    shadow: &[bool],
) -> Result<DecideReply, RedisError> {
    if reply.len() != REPLY_HEADER + REPLY_PER_LIMIT * n {
        return Err(RedisError::Protocol(format!(
            "decide returned {} values for {n} limits",
            reply.len()
        )));
    }
    let admitted = flag(reply[0], "all_admitted")?;
    let now = unsigned(reply[1], "now")?;
    let per_limit = reply[REPLY_HEADER..]
        .chunks_exact(REPLY_PER_LIMIT)
        .map(|v| {
            let remaining = unsigned(v[1], "remaining")?;
            let reset_after = unsigned(v[2], "reset_after")?;
            let wait = unsigned(v[3], "retry_after/delay")?;
            Ok(if flag(v[0], "admitted")? {
                LimitVerdict::Admitted {
                    snapshot: Snapshot {
                        remaining,
                        reset_after,
                    },
                    delay: wait,
                }
            } else {
                LimitVerdict::Rejected(Rejection {
                    retry_after: wait,
                    remaining,
                    reset_after,
                })
            })
        })
        .collect::<Result<Vec<_>, RedisError>>()?;
    let enforced_admitted = per_limit
        .iter()
        .enumerate()
        .all(|(i, v)| v.is_admitted() || shadow.get(i).copied().unwrap_or(false));
    if admitted != enforced_admitted {
        return Err(RedisError::Protocol(
            "all_admitted disagrees with the per-limit verdicts".to_string(),
        ));
    }
    Ok(DecideReply {
        admitted,
        now,
        per_limit,
    })
}

/// peek.lua's reply: the snapshot and the instant it describes.
pub(super) fn decode_peek(reply: &[i64]) -> Result<(Snapshot, Micros), RedisError> {
    match reply {
        &[remaining, reset_after, now] => Ok((
            Snapshot {
                remaining: unsigned(remaining, "remaining")?,
                reset_after: unsigned(reset_after, "reset_after")?,
            },
            unsigned(now, "now")?,
        )),
        _ => Err(RedisError::Protocol(format!(
            "peek returned {} values, expected 3",
            reply.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algorithm::{Gcra, Quota, SlidingLog, SlidingWindow};

    fn quota(count: u64, period: Micros) -> Quota {
        Quota {
            count,
            period,
            burst: count,
        }
    }

    #[test]
    fn the_library_holds_every_part_and_is_named_by_its_code() {
        let lib = library();
        let code = expand_library(LIBRARY_LUA, &LIBRARY_PARTS);
        assert!(!code.lines().any(|l| l.starts_with("--@")));
        for (name, text) in LIBRARY_PARTS {
            assert!(code.contains(text), "{name} missing from the library");
        }
        assert_eq!(lib.name.len(), "tollgate_v".len() + 12);
        assert_eq!(
            lib.source,
            format!("#!lua name={0}\nlocal LIB = '{0}'\n{code}", lib.name)
        );
        for call in Call::ALL {
            let function = lib.function(call);
            assert_eq!(function, format!("{}_{}", lib.name, call.function()));
            assert!(
                code.contains(&format!("LIB .. '_{}'", call.function())),
                "{function} not registered"
            );
        }
        // One byte of difference, another library: versions never replace each other.
        let other = expand_library(&format!("{LIBRARY_LUA} "), &LIBRARY_PARTS);
        assert_ne!(
            fred::util::sha1_hash(&other)[..12],
            fred::util::sha1_hash(&code)[..12]
        );
    }

    #[test]
    fn error_replies_are_told_apart() {
        use fred::error::ErrorKind;
        let reply = |text: &str| FredError::new(ErrorKind::Unknown, text.to_string());
        // Redis 7.0 and 6.2 spell an unknown command differently.
        for text in [
            "ERR unknown command 'fcall', with args beginning with: 'x' '0' ",
            "ERR unknown command `FUNCTION`, with args beginning with: `LOAD`, ",
            "NOPERM this user has no permissions to run the 'fcall' command",
        ] {
            assert!(functions_unsupported(&reply(text)), "{text}");
            assert!(!function_missing(&reply(text)) && !library_exists(&reply(text)));
        }
        assert!(function_missing(&reply("ERR Function not found")));
        assert!(library_exists(&reply(
            "ERR Library 'tollgate_v0123456789ab' already exists"
        )));
        for text in [
            "ERR Error running script (call to f_x): @user_script:1: boom",
            "NOSCRIPT No matching script. Please use EVAL.",
            "ERR Error registering functions: ERR Function x already exists",
        ] {
            let e = reply(text);
            assert!(
                !functions_unsupported(&e) && !function_missing(&e) && !library_exists(&e),
                "{text}"
            );
        }
    }

    #[test]
    fn keys_share_the_base_tag_or_get_one() {
        let log = Algorithm::SlidingLog(SlidingLog::new(quota(5, 1000)));
        assert_eq!(
            redis_keys("tg:{users/per-user/alice}", &log),
            [
                "tg:{users/per-user/alice}:log",
                "tg:{users/per-user/alice}:log:meta"
            ]
        );
        assert_eq!(
            redis_keys("plain", &log),
            ["{plain}:log", "{plain}:log:meta"]
        );
        // "{}" is no tag: Redis would hash the whole key.
        assert_eq!(
            redis_keys("a{}b", &Algorithm::Gcra(Gcra::new(quota(5, 1000)))),
            ["{a{}b}:gcra"]
        );
        assert_eq!(hash_tag("x{a}{b}"), Some("a"));
        assert_eq!(hash_tag("x{a"), None);
    }

    #[test]
    fn params_out_of_lua_range_are_refused() {
        let ok = Algorithm::SlidingWindow(SlidingWindow::new(quota(10_000_000, 86_400_000_000)));
        assert_eq!(check_params(&ok, 1, 0), Ok(()));
        let huge = Algorithm::SlidingWindow(SlidingWindow::new(quota(5, MAX_PARAM + 1)));
        assert!(check_params(&huge, 1, 0).is_err());
        let deep = Algorithm::Gcra(Gcra::new(Quota {
            count: 1,
            period: 1 << 40,
            burst: 1 << 20,
        }));
        assert!(check_params(&deep, 1, 0).is_err());
    }

    #[test]
    fn decide_layout_round_trips() {
        let g = Algorithm::Gcra(Gcra::new(Quota {
            count: 10,
            period: 1_000_000,
            burst: 5,
        }));
        let l = SlidingLog::new(quota(3, 1000));
        let l = Algorithm::SlidingLog(l);
        let a = GlobalLimit {
            algorithm: &g,
            key: "tg:{r/a/x}",
            cost: 2,
            max_delay: 7,
        };
        let b = GlobalLimit {
            algorithm: &l,
            key: "tg:{r/b/x}",
            cost: 1,
            max_delay: 0,
        };
        let (keys, args) = decide_call(&[&a, &b], &[false, true], &[], Some(42), 42).unwrap();
        assert_eq!(
            keys,
            ["tg:{r/a/x}:gcra", "tg:{r/b/x}:log", "tg:{r/b/x}:log:meta"]
        );
        assert_eq!(
            args,
            [
                42, 86_400_000, 2, 1, 10, 1_000_000, 5, 2, 7, 0, 4, 3, 1000, 3, 1, 0, 1
            ]
        );
        assert_eq!(
            decide_call(&[&a], &[], &[], None, 0).unwrap().1[..2],
            [-1, 1]
        );

        let reply = [0, 99, 1, 3, 400, 0, 0, 0, 1000, 250];
        let d = decode_decide(&reply, 2, &[]).unwrap();
        assert!(!d.admitted);
        assert_eq!(d.now, 99);
        assert_eq!(
            d.per_limit,
            [
                LimitVerdict::Admitted {
                    snapshot: Snapshot {
                        remaining: 3,
                        reset_after: 400
                    },
                    delay: 0
                },
                LimitVerdict::Rejected(Rejection {
                    retry_after: 250,
                    remaining: 0,
                    reset_after: 1000
                })
            ]
        );
        assert!(decode_decide(&reply, 1, &[]).is_err());
        assert!(
            decode_decide(&[1, 99, 0, 0, 0, 1], 1, &[]).is_err(),
            "flag disagrees"
        );
        assert!(decode_decide(&[1, 99, 1, -1, 0, 0], 1, &[]).is_err());
        // A shadow limit's rejection leaves all_admitted set.
        assert!(
            decode_decide(&[1, 99, 0, 0, 0, 1], 1, &[true])
                .unwrap()
                .admitted
        );
        assert_eq!(
            decode_peek(&[2, 5, 9]).unwrap(),
            (
                Snapshot {
                    remaining: 2,
                    reset_after: 5
                },
                9
            )
        );
    }
}
