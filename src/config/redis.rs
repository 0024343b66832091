//! What a Redis setting may be, as config validation and the Redis store both read it: the URL
//! forms the client takes, the sentinels and master of a Sentinel setup, and the largest number
//! a Lua script decides exactly.

use fred::prelude::{Config, Server, ServerConfig};
use fred::types::config::TlsConnector;

use super::SentinelTarget;

/// Parameters and every value derived from them stay below this, so Lua's doubles (exact to
/// 2^53) hold them exactly next to a µs timestamp (~1.7e15 today): 2^50 µs is 35 years.
pub const MAX_PARAM: u64 = 1 << 50;

const REDIS_SCHEMES: [&str; 6] = [
    "redis",
    "rediss",
    "redis-cluster",
    "rediss-cluster",
    "redis-sentinel",
    "rediss-sentinel",
];

/// A Redis URL as the client will read it, or why it cannot be read. The store calls this
/// too, so a URL that `check` accepts is one `run` can use.
pub fn parse_url(url: &str) -> Result<Config, String> {
    // fred reads any scheme as a plain server; a typo like http:// must not pass.
    let scheme = url.split_once("://").map(|(scheme, _)| scheme);
    if !scheme.is_some_and(|s| REDIS_SCHEMES.contains(&s)) {
        return Err(format!(
            "expected one of {}",
            REDIS_SCHEMES.map(|s| format!("{s}://")).join(", ")
        ));
    }
    Config::from_url(url).map_err(|e| e.details().to_string())
}

/// The port of a sentinel whose URL names none: Sentinel's own default.
pub const SENTINEL_PORT: u16 = 26379;

/// One sentinel as the client reaches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SentinelNode {
    /// Host name or address, as written.
    pub host: String,
    /// [`SENTINEL_PORT`] when the URL names none.
    pub port: u16,
    /// The sentinel's ACL user, from the URL.
    pub username: Option<String>,
    /// The sentinel's password, from the URL.
    pub password: Option<String>,
    /// `rediss://`.
    pub tls: bool,
}

/// A sentinel node's URL as the client will read it: `redis://[user:pass@]host[:port]` or
/// `rediss://`, nothing after the port (a database or a query would be the master's business,
/// and the master is named apart). The store calls this too, so a URL that `check` accepts is
/// one `run` can use.
pub fn parse_sentinel_node(url: &str) -> Result<SentinelNode, String> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let tls = match scheme {
        "redis" => false,
        "rediss" => true,
        _ => return Err("expected redis:// or rediss://".to_string()),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    if !matches!(&rest[authority_end..], "" | "/") {
        return Err(
            "a sentinel node is `redis://[USER:PASSWORD@]HOST[:PORT]`, with nothing after the port (the master's database is not the sentinel's)"
                .to_string(),
        );
    }
    let authority = &rest[..authority_end];
    let host_port = authority.rsplit('@').next().unwrap_or("");
    if host_port.is_empty() || host_port.starts_with(':') {
        return Err("no host: write redis://HOST:26379".to_string());
    }
    // fred reads a sentinel's address from a sentinel URL, whose query must name a master:
    // only the address and the credentials are read from this one, the name is a placeholder.
    let config =
        Config::from_url_sentinel(&format!("{scheme}://{authority}?sentinelServiceName=_"))
            .map_err(|e| e.details().to_string())?;
    let server = match config.server {
        ServerConfig::Sentinel { hosts, .. } => hosts.into_iter().next(),
        _ => None,
    }
    .ok_or_else(|| "no sentinel address".to_string())?;
    Ok(SentinelNode {
        host: server.host.to_string(),
        port: server.port,
        username: config.username,
        password: config.password,
        tls,
    })
}

/// Why two sentinel nodes cannot be used together, if they cannot: fred authenticates to every
/// sentinel with one set of credentials and speaks one protocol to all of them.
pub fn sentinel_nodes_differ(first: &SentinelNode, other: &SentinelNode) -> Option<&'static str> {
    if first.tls != other.tls {
        Some("every sentinel node must use the same scheme (all redis:// or all rediss://)")
    } else if (&first.username, &first.password) != (&other.username, &other.password) {
        Some(
            "every sentinel node must carry the same credentials (the client authenticates to all sentinels with one user and password)",
        )
    } else {
        None
    }
}

/// The client configuration for a master named by `target`'s sentinels: the sentinels are
/// reached with the nodes' credentials, the master (whichever server it is) with `target`'s
/// `username` and `password`. With `rediss://` nodes the client speaks TLS to the sentinels and
/// to the master alike (fred has one TLS setting for both), verified against the system's
/// roots as for a `rediss://` URL.
pub fn sentinel_config(target: &SentinelTarget) -> Result<Config, String> {
    let nodes = target
        .nodes
        .iter()
        .map(|url| parse_sentinel_node(url).map_err(|why| format!("sentinel node {url:?}: {why}")))
        .collect::<Result<Vec<_>, _>>()?;
    let first = nodes
        .first()
        .ok_or_else(|| "a sentinel setup needs at least one node".to_string())?;
    if let Some(why) = nodes.iter().find_map(|n| sentinel_nodes_differ(first, n)) {
        return Err(why.to_string());
    }
    let tls = if first.tls {
        let connector = TlsConnector::default_rustls()
            .map_err(|e| format!("TLS to the sentinels: {}", e.details()))?;
        Some(connector.into())
    } else {
        None
    };
    Ok(Config {
        server: ServerConfig::Sentinel {
            hosts: nodes
                .iter()
                .map(|n| Server::new(n.host.as_str(), n.port))
                .collect(),
            service_name: target.master.clone(),
            username: first.username.clone(),
            password: first.password.clone(),
        },
        username: target.username.clone(),
        password: target.password.clone(),
        tls,
        ..Config::default()
    })
}
