//! The text `tollgate check` prints: what will run, on one screen.
//!
//! Defaults are spelled out, because "what did I get by leaving it out" is the
//! usual question, and each limit ends with its admission bound in words, so a
//! reader can tell what a rate means without knowing the algorithm.

use std::fmt::Write as _;

use super::rate::DurationText;
use super::types::{
    AlgorithmKind, Config, Consistency, KeyPart, LimitConfig, OnError, OnLimit, PathMatch,
    RedisTarget, RouteConfig, Scope, redact_url,
};

/// What `tollgate check` prints for `cfg`: listeners, Redis (credentials redacted), and each
/// route and limit with its defaults spelled out and its admission bound in words.
pub fn summary(cfg: &Config) -> String {
    let mut out = String::new();
    let s = &cfg.server;
    let token = if s.admin_token.is_some() {
        "bearer token required"
    } else {
        "no admin_token: open to whoever reaches it"
    };
    let proxies = if s.trusted_proxies.is_empty() {
        "none".to_owned()
    } else {
        join(&s.trusted_proxies, ", ")
    };
    match &s.tls {
        None => {
            let _ = writeln!(out, "listen   {} (plain HTTP/1.1 and h2c)", s.listen);
        }
        Some(tls) => {
            let _ = writeln!(
                out,
                "listen   {} (TLS, ALPN h2 + http/1.1; cert {}, key {})",
                s.listen,
                tls.cert.display(),
                tls.key.display()
            );
        }
    }
    let _ = writeln!(out, "admin    {} ({token})", s.admin);
    let _ = writeln!(
        out,
        "server   trusted proxies: {proxies}; grace period {}; at most {} delayed requests waiting per route",
        DurationText(s.grace_period),
        s.max_waiters
    );
    let _ = writeln!(out, "keys     {}", key_budget(s.max_keys));
    let upstream_trust = match &s.upstream_ca {
        None => "system roots".to_owned(),
        Some(ca) => format!(
            "system roots + {} ({} certificate{})",
            ca.path.display(),
            ca.certs.len(),
            if ca.certs.len() == 1 { "" } else { "s" }
        ),
    };
    if cfg
        .routes
        .iter()
        .flat_map(|r| &r.upstreams)
        .any(|u| u.scheme_str() == Some("https"))
        || s.upstream_ca.is_some()
    {
        let _ = writeln!(out, "upstream https trusts {upstream_trust}");
    }
    match &cfg.redis {
        None => {
            let _ = writeln!(out, "redis    none: all limits local");
        }
        Some(r) => {
            let target = match &r.target {
                RedisTarget::Single(url) => redact_url(url),
                RedisTarget::Cluster(nodes) => format!(
                    "cluster {}",
                    nodes
                        .iter()
                        .map(|u| redact_url(u))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            let on_error = match r.on_error {
                OnError::Allow => "allow: fall back to the local limit",
                OnError::Deny => "deny: reply 503",
            };
            let _ = writeln!(
                out,
                "redis    {target}; timeout {}, pool {}, on_error {on_error}",
                DurationText(r.timeout),
                r.pool_size
            );
        }
    }
    if cfg.routes.is_empty() {
        let _ = writeln!(out, "routes   none: every request gets 404");
    } else {
        let _ = writeln!(out, "routes   {} (first match wins)", cfg.routes.len());
    }
    for route in &cfg.routes {
        write_route(&mut out, route);
    }
    out
}

/// The key budget in words: how many, where the number came from, and what happens past it.
fn key_budget(max_keys: usize) -> String {
    use crate::limit::budget::{BYTES_PER_KEY, MEMORY_SHARE, default_max_keys};
    let d = default_max_keys();
    let source = if max_keys == d.keys {
        match d.memory {
            Some(m) => format!(
                "default: 1/{MEMORY_SHARE} of {} memory at {BYTES_PER_KEY} B per key",
                mib(m)
            ),
            None => "default: memory unknown, taken as 1 GiB".to_owned(),
        }
    } else {
        format!(
            "max_keys; about {} at {BYTES_PER_KEY} B per key",
            mib(max_keys as u64 * BYTES_PER_KEY)
        )
    };
    format!(
        "at most {} held in process ({source}); past it the keys closest to full go first",
        thousands(max_keys as u64)
    )
}

/// `bytes` as MiB or GiB, one decimal.
fn mib(bytes: u64) -> String {
    let mib = bytes as f64 / f64::from(1 << 20);
    if mib >= 1024.0 {
        format!("{:.1} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

/// `n` with a comma every three digits.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn write_route(out: &mut String, route: &RouteConfig) {
    let m = &route.matcher;
    let path = match &m.path {
        PathMatch::Exact(p) => format!("path {p}"),
        PathMatch::Prefix(p) => format!("path_prefix {p}"),
    };
    let host = m
        .host
        .as_deref()
        .map_or_else(|| "any host".to_owned(), |h| format!("host {h}"));
    let methods = m.methods.as_ref().map_or_else(
        || "any method".to_owned(),
        |ms| format!("methods {}", join(ms, "|")),
    );
    let upstreams: Vec<String> = route
        .upstreams
        .iter()
        .map(|u| {
            let s = u.to_string();
            match s.strip_suffix('/') {
                Some(base) if u.path() == "/" => base.to_owned(),
                _ => s,
            }
        })
        .collect();
    let mut extras = vec![format!("timeout {}", DurationText(route.timeout))];
    if !route.preserve_host {
        extras.push("Host rewritten to the upstream's".to_owned());
    }
    if !route.headers {
        extras.push("no RateLimit headers on admitted responses".to_owned());
    }
    let balance = if upstreams.len() > 1 {
        " (round-robin)"
    } else {
        ""
    };
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "route {}: {path}, {host}, {methods} -> {}{balance}; {}",
        route.name,
        upstreams.join(", "),
        extras.join(", ")
    );
    if let Some(r) = &route.rejection {
        let _ = writeln!(
            out,
            "  rejected with {} {}, body {:?}{}",
            r.status.as_u16(),
            r.content_type.to_str().unwrap_or(""),
            r.body.source(),
            if r.legacy_headers {
                "; X-RateLimit-* fields too"
            } else {
                ""
            }
        );
    }
    if route.limits.is_empty() {
        let _ = writeln!(out, "  no limits");
    }
    for limit in &route.limits {
        write_limit(out, limit);
    }
}

fn write_limit(out: &mut String, l: &LimitConfig) {
    let mut algo = format!("{} {}", l.algorithm, l.rate);
    if l.algorithm == AlgorithmKind::Gcra {
        let _ = write!(algo, " burst {}", l.burst);
    }
    let on_limit = match l.on_limit {
        OnLimit::Reject => "reject".to_owned(),
        OnLimit::Delay if l.max_delay.is_zero() => "delay (max_delay 0s: never waits)".to_owned(),
        OnLimit::Delay => format!("delay up to {}", DurationText(l.max_delay)),
    };
    let consistency = match l.consistency {
        Consistency::Strict => "strict".to_owned(),
        Consistency::Eventual => format!("eventual (sync {})", DurationText(l.sync_interval)),
    };
    // Only headers and query parameters can be absent from a request.
    let can_be_missing = l
        .key
        .iter()
        .any(|p| matches!(p, KeyPart::Header(_) | KeyPart::Query(_)));
    let on_missing = if can_be_missing {
        format!(" (if missing: {})", l.on_missing)
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "  limit {}: key {}{on_missing}, {algo}, {}, cost {}, {on_limit}, {}, {consistency}",
        l.name,
        join(&l.key, "+"),
        l.scope,
        l.cost,
        if l.shadow {
            "shadow (never rejects)"
        } else {
            "enforced"
        },
    );
    let _ = writeln!(out, "    {}", admission_bound(l));
}

/// The spec's upper bound on admissions in any interval of one period, per key.
fn admission_bound(l: &LimitConfig) -> String {
    let count = l.rate.count;
    let period = DurationText(l.rate.period);
    let (units, mut text) = match l.algorithm {
        AlgorithmKind::Gcra => {
            let total = l.burst.saturating_add(count);
            (
                total,
                format!(
                    "at most {total}{} per {period} (burst {} + {count})",
                    unit_word(l.cost),
                    l.burst
                ),
            )
        }
        AlgorithmKind::FixedWindow => {
            let total = count.saturating_mul(2);
            (
                total,
                format!(
                    "at most {count}{} per {period} window; {total} in any {period} across a window boundary (2 × {count})",
                    unit_word(l.cost)
                ),
            )
        }
        AlgorithmKind::SlidingWindow => (
            count,
            format!(
                "about {count}{} in any {period} (sliding-window approximation)",
                unit_word(l.cost)
            ),
        ),
        AlgorithmKind::SlidingLog => (
            count,
            format!(
                "at most {count}{} in any {period} (exact log)",
                unit_word(l.cost)
            ),
        ),
    };
    if l.cost > 1 {
        let _ = write!(
            text,
            ", i.e. {} requests of cost {}",
            units / l.cost,
            l.cost
        );
    }
    if l.consistency == Consistency::Eventual {
        let _ = write!(
            text,
            ", plus what other instances admit within one sync_interval ({})",
            DurationText(l.sync_interval)
        );
    }
    if l.scope == Scope::Local {
        text.push_str(", on each instance");
    }
    if l.shadow {
        text = format!("not enforced (shadow); would allow {text}");
    }
    text
}

fn unit_word(cost: u64) -> &'static str {
    if cost > 1 { " units" } else { "" }
}

fn join<T: std::fmt::Display>(items: &[T], sep: &str) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(sep)
}
