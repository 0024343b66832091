//! The Redis tier's error type, and how fred's errors map onto it.
//!
//! The split that matters to callers is "Redis is unhealthy" ([`RedisError::Timeout`],
//! [`RedisError::Connection`], [`RedisError::Unavailable`]: fall back per `on_error`, and
//! count towards the circuit breaker) versus "Redis answered but the answer is wrong"
//! ([`RedisError::Script`], [`RedisError::Protocol`]: a bug or a bad deployment, which a retry
//! will not fix). [`RedisError::Redirect`] (a Cluster slot being moved) falls back too, but
//! only for that slot's keys, and does not count towards the breaker.

use fred::error::{Error as FredError, ErrorKind};

/// Why a Redis call gave no usable answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RedisError {
    /// No answer within `redis.timeout` (default 50 ms); the command, once written, may still
    /// run on Redis.
    #[error("redis did not answer within the timeout")]
    Timeout,
    /// The circuit breaker is open: Redis failed repeatedly and was not asked at all.
    #[error("redis unavailable (circuit breaker open)")]
    Unavailable,
    /// The connection failed, or Redis replied that it cannot serve now (`LOADING`, `BUSY`,
    /// `READONLY`, ...).
    #[error("redis connection error: {0}")]
    Connection(String),
    /// The command is wrong: Redis answered it with an error (a failing script, say), or its
    /// parameters were refused before sending. A bug or a bad deployment; a retry will not help.
    #[error("redis script error: {0}")]
    Script(String),
    /// A reply of the wrong shape, or one that cannot be decoded.
    #[error("unexpected redis reply: {0}")]
    Protocol(String),
    /// A Cluster redirection the client did not follow: a key in a slot that is moving
    /// between nodes (fred sends the command after `ASKING` to the slot's old owner again).
    /// Redis is up; only that slot's keys are affected, until the move ends.
    #[error("redis cluster redirection not followed: {0}")]
    Redirect(String),
}

/// Error replies that mean "this Redis cannot serve right now" rather than "the command is
/// wrong"; fred files them all under `Unknown`.
const OUTAGE_REPLIES: &[&str] = &[
    "LOADING",
    "BUSY",
    "MASTERDOWN",
    "READONLY",
    "CLUSTERDOWN",
    "OOM",
];

impl RedisError {
    /// The `kind` label of `tollgate_redis_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            RedisError::Timeout => "timeout",
            RedisError::Unavailable => "unavailable",
            RedisError::Connection(_) => "connection",
            RedisError::Script(_) => "script",
            RedisError::Protocol(_) => "protocol",
            RedisError::Redirect(_) => "redirect",
        }
    }

    /// Whether this failure says Redis is unhealthy, so it counts towards opening the
    /// circuit breaker. A script error proves Redis answered.
    pub fn is_outage(&self) -> bool {
        matches!(self, RedisError::Timeout | RedisError::Connection(_))
    }
}

impl From<FredError> for RedisError {
    fn from(e: FredError) -> Self {
        let details = e.details().to_string();
        match e.kind() {
            ErrorKind::Timeout => RedisError::Timeout,
            ErrorKind::Protocol | ErrorKind::Parse => RedisError::Protocol(details),
            kind @ (ErrorKind::Unknown
            | ErrorKind::InvalidArgument
            | ErrorKind::InvalidCommand
            | ErrorKind::NotFound) => {
                let code = details.split_whitespace().next().unwrap_or("");
                let redis_reply = !code.is_empty() && code.bytes().all(|b| b.is_ascii_uppercase());
                if OUTAGE_REPLIES.contains(&code) {
                    RedisError::Connection(details)
                } else if code == "TRYAGAIN" {
                    // A call on several keys of a slot being moved, some moved and some not:
                    // the slot's move, like an unfollowed ASK, not Redis being down.
                    RedisError::Redirect(details)
                } else if redis_reply || *kind != ErrorKind::Unknown {
                    RedisError::Script(details)
                } else {
                    // fred's own failures ("Failed to route command.") share the kind of
                    // Redis's error replies but are about the connection.
                    RedisError::Connection(details)
                }
            }
            ErrorKind::Routing if details.contains("redirections") => RedisError::Redirect(details),
            // IO, Canceled, Backpressure, Cluster, Routing, Auth, Config, Url, Tls, ...:
            // Redis cannot be used as configured right now.
            _ => RedisError::Connection(format!("{:?}: {details}", e.kind())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fred_errors_map_to_kinds() {
        let cases = [
            (FredError::new(ErrorKind::Timeout, "t"), "timeout"),
            (FredError::new(ErrorKind::IO, "reset"), "connection"),
            (
                FredError::new(ErrorKind::Backpressure, "full"),
                "connection",
            ),
            (
                FredError::new(ErrorKind::Unknown, "LOADING Redis is loading"),
                "connection",
            ),
            (
                FredError::new(ErrorKind::Unknown, "ERR Error running script"),
                "script",
            ),
            (
                FredError::new(ErrorKind::Parse, "not an integer"),
                "protocol",
            ),
            (
                FredError::new(ErrorKind::Routing, "Too many redirections."),
                "redirect",
            ),
            (
                FredError::new(
                    ErrorKind::Unknown,
                    "TRYAGAIN Multiple keys during rehashing",
                ),
                "redirect",
            ),
            (
                FredError::new(ErrorKind::Routing, "Max attempts reached."),
                "connection",
            ),
        ];
        for (fred, kind) in cases {
            let e = RedisError::from(fred);
            assert_eq!(e.kind(), kind, "{e}");
            assert_eq!(e.is_outage(), kind == "timeout" || kind == "connection");
        }
        assert!(!RedisError::Unavailable.is_outage());
    }
}
