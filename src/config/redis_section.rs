//! The `redis` section: which Redis (one server, a Redis Cluster, or a master named by Redis
//! Sentinel), how long a command may take, and what global limits decide without it.

use std::time::Duration;

use serde_saphyr::Spanned;

use super::Invalid;
use super::raw::{RawRedis, RawSentinel, Text};
use super::redis::{parse_sentinel_node, sentinel_nodes_differ};
use super::types::{OnError, RedisConfig, RedisTarget, SentinelTarget};
use super::validate::{Checked, at, items, keyword, positive_duration_or, redacted, usize_of};

pub(super) fn redis(raw: Spanned<RawRedis>) -> Checked<RedisConfig> {
    let redis_at = at(&raw);
    let raw = raw.value;
    // Where each way of naming Redis is given: two of them are one too many.
    let mut given: Vec<(&str, super::Pos)> = [
        raw.url.as_ref().map(|t| ("url", at(t))),
        raw.cluster.as_ref().map(|t| ("cluster", at(t))),
        raw.sentinel.as_ref().map(|t| ("sentinel", at(t))),
    ]
    .into_iter()
    .flatten()
    .collect();
    given.sort_by_key(|(_, pos)| (pos.line, pos.column));
    if let [(first, _), (second, second_at), ..] = given[..] {
        return Err(Invalid::new(
            second_at,
            format!(
                "redis has both `{first}` and `{second}`: set `url` for one server, `cluster` for a Redis Cluster or `sentinel` for a master behind Redis Sentinel, not both"
            ),
        ));
    }
    let target = if let Some(url) = raw.url {
        RedisTarget::Single(redis_url(&url)?)
    } else if let Some(list) = raw.cluster {
        let list_at = at(&list);
        let nodes = items(list);
        if nodes.is_empty() {
            return Err(Invalid::new(
                list_at,
                "cluster lists no node: give at least one redis://HOST:PORT",
            ));
        }
        RedisTarget::Cluster(nodes.iter().map(redis_url).collect::<Checked<_>>()?)
    } else if let Some(sentinel) = raw.sentinel {
        RedisTarget::Sentinel(sentinel_target(sentinel)?)
    } else {
        return Err(Invalid::new(
            redis_at,
            "redis needs `url: redis://HOST:PORT` or `cluster: [redis://HOST:PORT, ...]` or `sentinel: {master: NAME, nodes: [redis://HOST:26379, ...]}`; remove the section to keep every limit local",
        ));
    };
    let on_error = match &raw.on_error {
        Some(t) => keyword(
            t,
            "on_error",
            &[("allow", OnError::Allow), ("deny", OnError::Deny)],
        )?,
        None => OnError::Allow,
    };
    let pool_size = match raw.pool_size {
        Some(n) if n.value == 0 => {
            return Err(Invalid::new(at(&n), "pool_size must be at least 1"));
        }
        Some(n) => usize_of(&n)?,
        None => 2,
    };
    let batch_max = match raw.batch_max {
        Some(n) if n.value == 0 || n.value > MAX_BATCH_MAX => {
            return Err(Invalid::new(
                at(&n),
                format!(
                    "batch_max must be between 1 (no batching) and {MAX_BATCH_MAX}, got {}",
                    n.value
                ),
            ));
        }
        Some(n) => usize_of(&n)?,
        None => crate::limit::redis::DEFAULT_BATCH_MAX,
    };
    Ok(RedisConfig {
        target,
        timeout: positive_duration_or(raw.timeout.as_ref(), "timeout", Duration::from_millis(50))?,
        on_error,
        pool_size,
        batch_max,
    })
}

/// The largest `batch_max`: a call's arguments are bounded anyway (`MAX_BATCH_ARGS`), and
/// one call of more decisions holds Redis (and every other client of it) longer.
const MAX_BATCH_MAX: u64 = 1024;

fn redis_url(t: &Text) -> Checked<String> {
    if t.value.contains(super::types::REDACTED) {
        return Err(redacted(t));
    }
    let url = t.value.trim();
    let host = url
        .strip_prefix("redis://")
        .or_else(|| url.strip_prefix("rediss://"));
    let Some(rest) = host else {
        return Err(Invalid::new(
            at(t),
            format!("redis URL `{url}` must start with redis:// or rediss:// (TLS)"),
        ));
    };
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let host_port = authority.rsplit('@').next().unwrap_or("");
    if host_port.is_empty() || host_port.starts_with(':') {
        return Err(Invalid::new(
            at(t),
            format!("redis URL `{url}` has no host: write redis://HOST:PORT"),
        ));
    }
    if let Err(why) = super::redis::parse_url(url) {
        return Err(Invalid::new(
            at(t),
            format!("redis URL `{url}` does not parse: {why}"),
        ));
    }
    Ok(url.to_owned())
}

/// `sentinel: {master, nodes, username, password}`: every node a sentinel URL the client reads,
/// all with one scheme and one set of credentials (the client has one for all sentinels).
fn sentinel_target(raw: Spanned<RawSentinel>) -> Checked<SentinelTarget> {
    let sentinel_at = at(&raw);
    let raw = raw.value;
    let Some(master) = raw.master else {
        return Err(Invalid::new(
            sentinel_at,
            "sentinel needs `master: NAME`, the name the sentinels monitor it under (`sentinel monitor NAME ...`)",
        ));
    };
    let name = master.value.trim();
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Invalid::new(
            at(&master),
            "sentinel master must be the name the sentinels monitor, visible ASCII without spaces",
        ));
    }
    let Some(list) = raw.nodes else {
        return Err(Invalid::new(
            sentinel_at,
            "sentinel needs `nodes: [redis://HOST:26379, ...]`, the sentinels to ask for the master",
        ));
    };
    let list_at = at(&list);
    let nodes = items(list);
    if nodes.is_empty() {
        return Err(Invalid::new(
            list_at,
            "sentinel lists no node: give at least one redis://HOST:26379",
        ));
    }
    let mut first = None;
    let mut urls = Vec::with_capacity(nodes.len());
    for node in &nodes {
        if node.value.contains(super::types::REDACTED) {
            return Err(redacted(node));
        }
        let url = node.value.trim();
        let parsed = parse_sentinel_node(url).map_err(|why| {
            Invalid::new(
                at(node),
                format!("sentinel node `{url}` does not parse: {why}"),
            )
        })?;
        match &first {
            None => first = Some(parsed),
            Some(first) => {
                if let Some(why) = sentinel_nodes_differ(first, &parsed) {
                    return Err(Invalid::new(
                        at(node),
                        format!("sentinel node `{url}`: {why}"),
                    ));
                }
            }
        }
        urls.push(url.to_owned());
    }
    let secret = |t: Option<Text>| -> Checked<Option<String>> {
        match t {
            Some(t) if t.value.contains(super::types::REDACTED) => Err(redacted(&t)),
            Some(t) if t.value.is_empty() => Err(Invalid::new(
                at(&t),
                "empty: remove the field for a master without authentication",
            )),
            Some(t) => Ok(Some(t.value)),
            None => Ok(None),
        }
    };
    let username_at = raw.username.as_ref().map(at);
    let username = secret(raw.username)?;
    let password = secret(raw.password)?;
    if let (Some(at), None) = (username_at, &password) {
        return Err(Invalid::new(
            at,
            "sentinel username without a password: the master is authenticated with both (`AUTH USER PASSWORD`), or neither",
        ));
    }
    Ok(SentinelTarget {
        master: name.to_owned(),
        nodes: urls,
        username,
        password,
    })
}
