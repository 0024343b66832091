//! What a Redis setting may be, as config validation and the Redis store both read it: the URL
//! forms the client takes, and the largest number a Lua script decides exactly.

use fred::prelude::Config;

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
