//! Real `redis-server` processes for integration tests: a single server, a 3-primary cluster,
//! and a master with a replica behind Redis Sentinel, each on free loopback ports, killed on
//! drop.
//!
//! Only `std`: every test binary can `#[path]`-include this file without extra dev-deps.
//! A server kept in a `static` (shared by the tests of one binary) is never dropped, so each
//! server process gets a tiny `sh` watchdog that kills it once the test process is gone;
//! nothing outlives `cargo test`, even after a panic or a Ctrl-C.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// `cmdstat_<cmd>`'s `calls` and `failed_calls` in an `INFO commandstats` answer (0 when the
/// command never ran). A first `NOSCRIPT`, answered by loading the script, is a failed call.
pub fn command_calls(stats: &str, cmd: &str) -> (u64, u64) {
    let prefix = format!("cmdstat_{cmd}:");
    let line = stats.lines().find(|l| l.starts_with(&prefix)).unwrap_or("");
    let field = |name: &str| -> u64 {
        line.split([':', ','])
            .find_map(|kv| kv.strip_prefix(name)?.parse().ok())
            .unwrap_or(0)
    };
    (field("calls="), field("failed_calls="))
}

const NOT_FOUND: &str = "redis-server not found: install it with `apt-get install -y redis-server` (the README's test command does this)";

/// How long a fresh server may take to answer PING; generous for a loaded CI machine.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// A standalone `redis-server` on `127.0.0.1`, without persistence.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    extra: Vec<String>,
    /// `--requirepass`, which [`RedisServer::cli`] authenticates with.
    password: Option<String>,
    /// `--tls-port`, beside the plain port the tests' `redis-cli` uses.
    tls_port: Option<u16>,
}

/// PEM files for a Redis speaking TLS: its certificate chain and key, and the CA that signed
/// them (which also verifies the TLS connections a replica or a sentinel makes).
#[derive(Clone, Debug)]
pub struct RedisTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl RedisTls {
    /// `redis-server` arguments for a TLS port (clients need no certificate); replication
    /// goes over TLS too.
    fn args(&self, tls_port: u16) -> Vec<String> {
        [
            "--tls-port",
            &tls_port.to_string(),
            "--tls-cert-file",
            &self.cert.display().to_string(),
            "--tls-key-file",
            &self.key.display().to_string(),
            "--tls-ca-cert-file",
            &self.ca.display().to_string(),
            "--tls-auth-clients",
            "no",
            "--tls-replication",
            "yes",
        ]
        .map(String::from)
        .to_vec()
    }
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Like [`RedisServer::start`] with extra `--name value` arguments for `redis-server`.
    pub fn start_with(extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let value_of = |flag: &str| {
            extra
                .windows(2)
                .find(|w| w[0] == flag)
                .map(|w| w[1].clone())
        };
        let password = value_of("--requirepass");
        let tls_port = value_of("--tls-port").and_then(|p| p.parse().ok());
        // A port picked free can be taken by another test binary before redis binds it:
        // try a few ports rather than failing the test.
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port();
            let dir = temp_dir("single", port);
            match spawn_server(port, &dir, &extra) {
                Ok(child) => {
                    return Self {
                        port,
                        dir,
                        child: Some(child),
                        extra,
                        password,
                        tls_port,
                    };
                }
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    last_error = e;
                }
            }
        }
        panic!("could not start redis-server: {last_error}");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Like [`RedisServer::start_with`], also listening with TLS on a port of its own.
    pub fn start_tls(tls: &RedisTls, extra: &[&str]) -> Self {
        let mut args = tls.args(free_port());
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::start_with(&args)
    }

    /// What the server logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }

    /// The TLS port, when the server has one.
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// The port replicas and sentinels know the server by: its TLS port when it has one.
    pub fn announced_port(&self) -> u16 {
        self.tls_port.unwrap_or(self.port)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills the server abruptly (SIGKILL), as a crash or a network cut looks to clients.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open and commands sent meanwhile are run
    /// when it resumes, as with a Redis stalled by a long command or a fork.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Lets a paused server run again (SIGCONT).
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, name: &str) {
        let pid = self.child.as_ref().expect("redis-server is running").id();
        let status = std::process::Command::new("kill")
            .args([&format!("-{name}"), &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{name} {pid}");
    }

    /// Starts the server again on the same port, with an empty dataset.
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            // Sockets of the killed server can hold the port for a moment.
            match spawn_server(self.port, &self.dir, &self.extra) {
                Ok(child) => {
                    self.child = Some(child);
                    return;
                }
                Err(e) if Instant::now() > deadline => {
                    panic!("could not restart redis-server on port {}: {e}", self.port)
                }
                Err(_) => sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Runs `redis-cli` against this server and returns its stdout, trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        cli_as(self.port, self.password.as_deref(), args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three primaries with all 16384 slots assigned and no replicas.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<ClusterNode>,
}

#[derive(Debug)]
struct ClusterNode {
    port: u16,
    dir: PathBuf,
    child: Child,
}

impl RedisCluster {
    pub fn start() -> Self {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            nodes.push(start_cluster_node());
        }
        let cluster = Self { nodes };
        let mut create = vec!["--cluster".to_string(), "create".to_string()];
        create.extend(
            cluster
                .nodes
                .iter()
                .map(|n| format!("127.0.0.1:{}", n.port)),
        );
        create.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
        let create: Vec<&str> = create.iter().map(String::as_str).collect();
        let out = run_cli(cluster.nodes[0].port, false, &create);
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_until_ok();
        cluster
    }

    fn wait_until_ok(&self) {
        let deadline = Instant::now() + START_TIMEOUT;
        for node in &self.nodes {
            loop {
                let info = cli(node.port, false, &["cluster", "info"]);
                // Every node must also know the whole slot map, or a client that
                // bootstraps from it gets a partial view.
                let nodes = cli(node.port, false, &["cluster", "nodes"]);
                let known = nodes.lines().filter(|l| l.contains("master")).count();
                if info.contains("cluster_state:ok") && known == self.nodes.len() {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster node {} not ok: {info}",
                    node.port
                );
                sleep(Duration::from_millis(50));
            }
        }
    }

    /// `redis://` URLs of the primaries, in start order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// Index (into [`RedisCluster::urls`]) of the primary that owns `key`'s slot.
    pub fn node_for_key(&self, key: &str) -> usize {
        let slot: u16 = cli(self.nodes[0].port, false, &["cluster", "keyslot", key])
            .parse()
            .expect("CLUSTER KEYSLOT answers an integer");
        let owner = slot_owner(&cli(self.nodes[0].port, false, &["cluster", "nodes"]), slot)
            .unwrap_or_else(|| panic!("no primary owns slot {slot}"));
        self.nodes
            .iter()
            .position(|n| n.port == owner)
            .unwrap_or_else(|| panic!("slot {slot} owned by unknown port {owner}"))
    }

    /// Runs `redis-cli -c` (following redirections) starting at the first node.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.nodes[0].port, true, args)
    }

    /// Runs `redis-cli` against one node, without following redirections.
    pub fn cli_node(&self, node: usize, args: &[&str]) -> String {
        cli(self.nodes[node].port, false, args)
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.child.kill();
            let _ = node.child.wait();
            let _ = std::fs::remove_dir_all(&node.dir);
        }
    }
}

/// A master, one replica of it and `n` sentinels watching them (quorum 1), each on a free port,
/// killed on drop. Failure is declared after [`RedisSentinel::DOWN_AFTER`] without an answer, so
/// a killed master is replaced within about two seconds.
#[derive(Debug)]
pub struct RedisSentinel {
    name: String,
    /// The sentinels' `requirepass`.
    sentinel_password: Option<String>,
    /// The data servers by port: the first master and its replica, whatever their roles now.
    servers: Vec<RedisServer>,
    sentinels: Vec<SentinelProcess>,
}

#[derive(Debug)]
struct SentinelProcess {
    port: u16,
    /// Where clients reach it over TLS (the plain `port` stays, for the tests' `redis-cli`).
    tls_port: Option<u16>,
    dir: PathBuf,
    child: Child,
}

impl RedisSentinel {
    /// `down-after-milliseconds`: how long a master may stay silent before it is declared down.
    pub const DOWN_AFTER: Duration = Duration::from_millis(800);

    /// A master named `name`, its replica and one sentinel, ready: the sentinel knows the
    /// replica and the replica is in sync, so a failover can start at once.
    pub fn start(name: &str) -> Self {
        Self::start_with_sentinels(name, 1)
    }

    /// As [`RedisSentinel::start`] with `n` sentinels, which also know each other.
    pub fn start_with_sentinels(name: &str, n: usize) -> Self {
        Self::start_with(name, n, None, None, None)
    }

    /// As [`RedisSentinel::start`], every process also speaking TLS (the data servers replicate
    /// over it, the sentinel watches them over it and announces their TLS ports).
    pub fn start_tls(name: &str, tls: &RedisTls) -> Self {
        Self::start_with(name, 1, None, None, Some(tls))
    }

    /// As [`RedisSentinel::start`], with `requirepass` on the master and replica
    /// (`master_password`) and on the sentinel (`sentinel_password`); the sentinel
    /// authenticates to the servers with theirs (`sentinel auth-pass`).
    pub fn start_with_auth(name: &str, master_password: &str, sentinel_password: &str) -> Self {
        Self::start_with(
            name,
            1,
            Some(master_password),
            Some(sentinel_password),
            None,
        )
    }

    fn start_with(
        name: &str,
        n: usize,
        master_password: Option<&str>,
        sentinel_password: Option<&str>,
        tls: Option<&RedisTls>,
    ) -> Self {
        // `masterauth` too: a demoted master syncs from the new one with it. A replica syncs
        // at once, not after the default 5 s wait for more replicas to share the transfer.
        let mut args = vec!["--repl-diskless-sync-delay", "0"];
        if let Some(pw) = master_password {
            args.extend(["--requirepass", pw, "--masterauth", pw]);
        }
        let start = |extra: &[&str]| match tls {
            Some(tls) => RedisServer::start_tls(tls, extra),
            None => RedisServer::start_with(extra),
        };
        let master = start(&args);
        let master_port = master.announced_port().to_string();
        let mut replica_args = vec!["--replicaof", "127.0.0.1", &master_port];
        replica_args.extend(&args);
        let replica = start(&replica_args);
        let (master_port, replica_port) = (master.announced_port(), replica.announced_port());
        let mut conf = String::new();
        if let Some(pw) = master_password {
            conf += &format!("sentinel auth-pass {name} {pw}\n");
        }
        if let Some(pw) = sentinel_password {
            conf += &format!("requirepass {pw}\n");
        }
        let sentinels = (0..n)
            .map(|_| {
                let tls = tls.map(|tls| (free_port(), tls));
                let mut conf = conf.clone();
                if let Some((tls_port, tls)) = tls {
                    // The same settings as the servers' arguments, as config lines.
                    for pair in tls.args(tls_port).chunks(2) {
                        conf += &format!("{} {}\n", pair[0].trim_start_matches("--"), pair[1]);
                    }
                }
                start_sentinel(name, master_port, &conf, tls.map(|(p, _)| p))
            })
            .collect();
        let setup = Self {
            name: name.to_string(),
            sentinel_password: sentinel_password.map(str::to_owned),
            sentinels,
            servers: vec![master, replica],
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let in_sync = setup
                .server(replica_port)
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up");
            let known = setup.sentinels.iter().all(|s| {
                // Sentinel knows the replica by the port it announces (its TLS one, with TLS).
                let replicas = setup.sentinel_cli(s.port, &["SENTINEL", "REPLICAS", name]);
                let peers = setup.sentinel_cli(s.port, &["SENTINEL", "SENTINELS", name]);
                replicas.contains(&replica_port.to_string())
                    && !replicas.contains("disconnected")
                    && !replicas.contains("s_down")
                    && peers.matches("127.0.0.1").count() == n - 1
            });
            if in_sync && known {
                return setup;
            }
            assert!(
                Instant::now() < deadline,
                "sentinel setup not ready: replica in sync {in_sync}, sentinels know all {known}"
            );
            sleep(Duration::from_millis(20));
        }
    }

    fn sentinel_cli(&self, port: u16, args: &[&str]) -> String {
        cli_as(port, self.sentinel_password.as_deref(), args)
    }

    /// The name the sentinels monitor the master under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// URLs of the sentinels: `rediss://` to their TLS ports when they have them.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| match s.tls_port {
                Some(port) => format!("rediss://127.0.0.1:{port}"),
                None => format!("redis://127.0.0.1:{}", s.port),
            })
            .collect()
    }

    /// The `redis` section's target, as YAML: `sentinel: {master: .., nodes: [..]}`.
    pub fn yaml(&self) -> String {
        format!(
            "sentinel: {{ master: {}, nodes: [{}] }}",
            self.name,
            self.sentinel_urls().join(", ")
        )
    }

    /// The master's port as the first sentinel reports it now.
    pub fn master_port(&self) -> u16 {
        let answer = self.sentinel_cli(
            self.sentinels[0].port,
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", &self.name],
        );
        answer
            .lines()
            .nth(1)
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("sentinel does not name the master: {answer:?}"))
    }

    /// The master's port as each sentinel reports it now (`None`: no answer).
    pub fn named_masters(&self) -> Vec<Option<u16>> {
        self.sentinels
            .iter()
            .map(|s| {
                self.sentinel_cli(s.port, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", &self.name])
                    .lines()
                    .nth(1)
                    .and_then(|p| p.trim().parse().ok())
            })
            .collect()
    }

    /// Every process's log, for a failure message: the sentinels', then the data servers'.
    pub fn logs(&self) -> String {
        let sentinels = self.sentinels.iter().map(|s| {
            let log = std::fs::read_to_string(s.dir.join("sentinel.log")).unwrap_or_default();
            format!("--- sentinel {} ---\n{log}", s.port)
        });
        let servers = self
            .servers
            .iter()
            .map(|s| format!("--- server {} ---\n{}", s.port(), s.log()));
        sentinels.chain(servers).collect::<Vec<_>>().join("\n")
    }

    /// The data server on `port`, plain or TLS (the first master or its replica).
    pub fn server(&self, port: u16) -> &RedisServer {
        self.servers
            .iter()
            .find(|s| s.port() == port || s.tls_port() == Some(port))
            .unwrap_or_else(|| panic!("no server on port {port}"))
    }

    /// The port of the other data server: the replica while no failover happened.
    pub fn replica_port(&self) -> u16 {
        let master = self.master_port();
        self.servers
            .iter()
            .map(RedisServer::announced_port)
            .find(|p| *p != master)
            .expect("two data servers")
    }

    /// Kills the current master abruptly (SIGKILL); returns its port.
    pub fn kill_master(&mut self) -> u16 {
        let port = self.master_port();
        self.servers
            .iter_mut()
            .find(|s| s.announced_port() == port)
            .unwrap_or_else(|| panic!("no server on port {port}"))
            .stop();
        port
    }

    /// `SENTINEL FAILOVER`: the replica is promoted while the master is alive.
    pub fn failover(&self) {
        let answer = self.sentinel_cli(
            self.sentinels[0].port,
            &["SENTINEL", "FAILOVER", &self.name],
        );
        assert_eq!(answer, "OK", "SENTINEL FAILOVER");
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        for s in &mut self.sentinels {
            let _ = s.child.kill();
            let _ = s.child.wait();
            let _ = std::fs::remove_dir_all(&s.dir);
        }
    }
}

/// A sentinel monitoring `name` at `master_port`, with `conf` appended to its configuration.
fn start_sentinel(
    name: &str,
    master_port: u16,
    conf: &str,
    tls_port: Option<u16>,
) -> SentinelProcess {
    let mut last_error = String::new();
    for _ in 0..5 {
        let port = free_port();
        let dir = sentinel_dir(port);
        match spawn_sentinel(port, &dir, name, master_port, conf) {
            Ok(child) => {
                return SentinelProcess {
                    port,
                    tls_port,
                    dir,
                    child,
                };
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                last_error = e;
            }
        }
    }
    panic!("could not start a sentinel: {last_error}");
}

/// `redis-server sentinel.conf --sentinel`: Sentinel reads its monitors from a file it may
/// rewrite, so each sentinel gets one of its own.
fn spawn_sentinel(
    port: u16,
    dir: &Path,
    name: &str,
    master_port: u16,
    extra_conf: &str,
) -> Result<Child, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let log = dir.join("sentinel.log");
    let conf = dir.join("sentinel.conf");
    let down_after = RedisSentinel::DOWN_AFTER.as_millis();
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\nlogfile {log}\n\
             sentinel monitor {name} 127.0.0.1 {master_port} 1\n\
             sentinel down-after-milliseconds {name} {down_after}\n\
             sentinel failover-timeout {name} 4000\n{extra_conf}",
            dir = dir.display(),
            log = log.display(),
        ),
    )
    .map_err(|e| format!("writing {}: {e}", conf.display()))?;
    let child = Command::new(redis_binary("redis-server"))
        .arg(&conf)
        .arg("--sentinel")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("spawning redis-server --sentinel: {e}"))?;
    watchdog(child.id(), dir);
    answering(child, port, &log, "sentinel")
}

fn start_cluster_node() -> ClusterNode {
    let mut last_error = String::new();
    for _ in 0..5 {
        let port = free_port();
        // The bus port must be free too; the default (port + 10000) can exceed 65535 for
        // ephemeral ports, so pick it explicitly.
        let bus = free_port();
        let dir = temp_dir("cluster", port);
        let extra: Vec<String> = [
            "--cluster-enabled",
            "yes",
            "--cluster-port",
            &bus.to_string(),
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        match spawn_server(port, &dir, &extra) {
            Ok(child) => return ClusterNode { port, dir, child },
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                last_error = e;
            }
        }
    }
    panic!("could not start a cluster node: {last_error}");
}

/// Port of the primary serving `slot`, from `CLUSTER NODES` output.
fn slot_owner(nodes: &str, slot: u16) -> Option<u16> {
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 9 || !fields[2].contains("master") {
            continue;
        }
        // "127.0.0.1:30001@40001" or, with a hostname, "127.0.0.1:30001@40001,host".
        let port = fields[1]
            .split('@')
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())?;
        for range in &fields[8..] {
            if range.starts_with('[') {
                continue; // a slot being migrated or imported
            }
            let (lo, hi) = match range.split_once('-') {
                Some((lo, hi)) => (lo.parse().ok()?, hi.parse().ok()?),
                None => {
                    let s = range.parse().ok()?;
                    (s, s)
                }
            };
            if (lo..=hi).contains(&slot) {
                return Some(port);
            }
        }
    }
    None
}

fn redis_binary(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            if name == "redis-server" {
                panic!("{NOT_FOUND}")
            } else {
                panic!("{name} not found on PATH (it ships with redis-server: `apt-get install -y redis-server`)")
            }
        })
}

/// Spawns `redis-server` and waits for PONG; `Err` if it exits first (port taken) or stays
/// silent.
fn spawn_server(port: u16, dir: &Path, extra: &[String]) -> Result<Child, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let log = dir.join("redis.log");
    let child = Command::new(redis_binary("redis-server"))
        .args(["--port", &port.to_string()])
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        .args(["--daemonize", "no"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(&log)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("spawning redis-server: {e}"))?;
    watchdog(child.id(), dir);
    answering(child, port, &log, "redis-server")
}

/// `child` once it answers PING on `port`; its log (`log`) in the error if it exits first, or
/// killed if it does not answer within [`START_TIMEOUT`].
fn answering(mut child: Child, port: u16, log: &Path, what: &str) -> Result<Child, String> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if ping(port) {
            return Ok(child);
        }
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            return Err(format!("{what} exited with {status} on port {port}: {log}"));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{what} on port {port} did not answer PING"));
        }
        sleep(Duration::from_millis(10));
    }
}

/// Kills `pid` (and removes `dir`) once this test process has exited.
fn watchdog(pid: u32, dir: &Path) {
    let script = format!(
        "while kill -0 {me} 2>/dev/null && kill -0 {pid} 2>/dev/null; do sleep 0.5; done; \
         if ! kill -0 {me} 2>/dev/null; then kill -9 {pid} 2>/dev/null; rm -rf '{dir}'; fi",
        me = std::process::id(),
        dir = dir.display(),
    );
    let _ = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
}

/// One RESP PING over a fresh connection; a server that asks for a password first is up too.
fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect((Ipv4Addr::LOCALHOST, port)) else {
        return false;
    };
    let timeout = Some(Duration::from_millis(500));
    if stream.set_read_timeout(timeout).is_err() || stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    matches!(stream.read_exact(&mut buf), Ok(()) if &buf == b"+PONG\r\n" || &buf == b"-NOAUTH")
}

fn run_cli(port: u16, follow: bool, args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(redis_binary("redis-cli"));
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()]);
    if follow {
        cmd.arg("-c");
    }
    cmd.args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running redis-cli: {e}"))
}

fn cli(port: u16, follow: bool, args: &[&str]) -> String {
    let out = run_cli(port, follow, args);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `redis-cli` against one server, authenticated with `password` when there is one.
fn cli_as(port: u16, password: Option<&str>, args: &[&str]) -> String {
    let Some(password) = password else {
        return cli(port, false, args);
    };
    let out = Command::new(redis_binary("redis-cli"))
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .env("REDISCLI_AUTH", password)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running redis-cli: {e}"));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port: {e}"))
}

fn temp_dir(kind: &str, port: u16) -> PathBuf {
    temp_dir_in(&std::env::temp_dir(), kind, port)
}

/// A sentinel's directory: in memory (`/dev/shm`) where there is one. A sentinel saves its
/// config with `fsync` as a failover starts; on a disk busy with builds that took seconds,
/// long enough for the sentinel to think its clock jumped and stop acting for 30 s (TILT mode).
fn sentinel_dir(port: u16) -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        temp_dir_in(shm, "sentinel", port)
    } else {
        temp_dir("sentinel", port)
    }
}

fn temp_dir_in(base: &Path, kind: &str, port: u16) -> PathBuf {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    base.join(format!(
        "tollgate-redis-{kind}-{}-{port}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ))
}
