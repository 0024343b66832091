//! Following a Redis Sentinel failover as soon as a sentinel announces it.
//!
//! fred asks the sentinels which server is the master whenever it (re)connects, and checks
//! that server's `ROLE`. A master that dies is therefore left by itself: its connections
//! drop, and the reconnect finds the promoted replica once Sentinel has switched. A master
//! that is demoted while alive is not: after `SENTINEL FAILOVER` (maintenance) or a partition
//! that heals, the old master stays writable until Sentinel reconfigures it as a replica, which
//! it does only after ~8 s (four `SENTINEL_PUBLISH_PERIOD`s) and only then closes its clients.
//! Decisions made there meanwhile would split the budget between two masters (instances that
//! connect afresh go to the new one) and be lost when the old master resyncs.
//!
//! Every sentinel announces a switch on its `+switch-master` channel
//! (`NAME OLD_IP OLD_PORT NEW_IP NEW_PORT`). The store subscribes to it on every configured
//! sentinel (one small connection each) and, on a switch of its master, reconnects each of its
//! connections that is not on the new master yet, until all are: fred's reconnect asks a
//! sentinel again, and one that has not heard of the switch yet sends it back to the old master,
//! so it retries.

use std::time::Duration;

use fred::prelude::{
    Builder, ClientLike, Config, ConnectionConfig, ReconnectPolicy, Server, ServerConfig,
};

use super::RedisError;

/// The channel each sentinel announces a master's switch on.
pub(super) const SWITCH_CHANNEL: &str = "+switch-master";

/// Attempts at moving every connection to the announced master before giving up on that
/// announcement (fred's reconnects then still end on the right server as Sentinel converges).
const MOVE_ATTEMPTS: u32 = 20;
/// Pause between two attempts: time for the other sentinels to hear of the switch.
const MOVE_EVERY: Duration = Duration::from_millis(250);

/// A master's address as Sentinel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Address {
    pub(super) host: String,
    pub(super) port: u16,
}

impl Address {
    /// Whether `server` is this address (the TLS name aside).
    pub(super) fn is(&self, server: &Server) -> bool {
        server.host == self.host && server.port == self.port
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// The new address in a `+switch-master` message if it is about `master`.
pub(super) fn switched_to(message: &str, master: &str) -> Option<Address> {
    let mut words = message.split_ascii_whitespace();
    if words.next()? != master {
        return None;
    }
    let (_old_host, _old_port) = (words.next()?, words.next()?);
    let host = words.next()?.to_string();
    let port = words.next()?.parse().ok()?;
    words.next().is_none().then_some(Address { host, port })
}

/// The master's name when `config` names its server through Sentinel.
pub(super) fn master_name(config: &Config) -> Option<&str> {
    match &config.server {
        ServerConfig::Sentinel { service_name, .. } => Some(service_name),
        _ => None,
    }
}

/// One client per sentinel of `config`, each connecting to that sentinel alone with the
/// sentinels' credentials, for [`SWITCH_CHANNEL`]; none for any other kind of server.
pub(super) fn watchers(
    config: &Config,
    policy: &ReconnectPolicy,
) -> Result<Vec<fred::clients::Client>, RedisError> {
    let ServerConfig::Sentinel {
        hosts,
        username,
        password,
        ..
    } = &config.server
    else {
        return Ok(Vec::new());
    };
    hosts
        .iter()
        .map(|sentinel| {
            let config = Config {
                server: ServerConfig::Centralized {
                    server: sentinel.clone(),
                },
                username: username.clone(),
                password: password.clone(),
                tls: config.tls.clone(),
                // Reconnect per policy while a sentinel is down, instead of failing for good.
                fail_fast: false,
                ..Config::default()
            };
            Builder::from_config(config)
                .with_connection_config(|c: &mut ConnectionConfig| {
                    c.connection_timeout = Duration::from_secs(1);
                    c.internal_command_timeout = Duration::from_secs(1);
                })
                .set_policy(policy.clone())
                .build()
                .map_err(|e| {
                    RedisError::Connection(format!(
                        "building the client of sentinel {sentinel}: {}",
                        e.details()
                    ))
                })
        })
        .collect()
}

/// Moves `clients` to the master at `to`: each one connected elsewhere is made to reconnect
/// (which asks a sentinel again), one after the other, until all are on `to`, the attempts run out, or
/// `superseded` says a newer switch came. Returns whether all ended on `to`.
pub(super) async fn move_to(
    clients: &[fred::clients::Client],
    to: &Address,
    superseded: impl Fn() -> bool,
) -> bool {
    for attempt in 0..MOVE_ATTEMPTS {
        if superseded() {
            return false;
        }
        let elsewhere: Vec<&fred::clients::Client> = clients
            .iter()
            .filter(|c| !c.active_connections().iter().any(|s| to.is(s)))
            .collect();
        if elsewhere.is_empty() {
            return true;
        }
        if attempt > 0 {
            tracing::debug!(
                master = %to,
                connections = elsewhere.len(),
                "redis connections not on the new master yet; reconnecting them again"
            );
        }
        // One connection at a time: while one reconnects, the pool hands new calls to the
        // others, so only the calls already queued on it wait for the reconnect.
        for client in elsewhere {
            // Bounded: a reconnect waits for fred's own reconnect loop when one is under way.
            let _ = tokio::time::timeout(Duration::from_secs(2), client.force_reconnection()).await;
        }
        tokio::time::sleep(MOVE_EVERY).await;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_message_names_the_new_master() {
        assert_eq!(
            switched_to("mymaster 10.0.0.1 6379 10.0.0.2 6380", "mymaster"),
            Some(Address {
                host: "10.0.0.2".into(),
                port: 6380
            })
        );
        assert_eq!(
            switched_to("other 10.0.0.1 6379 10.0.0.2 6380", "mymaster"),
            None
        );
        assert_eq!(
            switched_to("mymaster 10.0.0.1 6379 10.0.0.2", "mymaster"),
            None
        );
        assert_eq!(
            switched_to("mymaster 10.0.0.1 6379 10.0.0.2 port", "mymaster"),
            None
        );
        assert_eq!(
            switched_to("mymaster 10.0.0.1 6379 10.0.0.2 6380 extra", "mymaster"),
            None
        );
    }
}
