//! The text `tollgate check` prints: what will run, on one screen.
//!
//! Defaults are spelled out, because "what did I get by leaving it out" is the
//! usual question, and each limit ends with its admission bound in words, so a
//! reader can tell what a rate means without knowing the algorithm.

use std::fmt::Write as _;

use super::calendar::{CalendarUnit, CalendarWindows};
use super::rate::DurationText;
use super::types::{
    AlgorithmKind, Config, Consistency, KeyPart, LimitConfig, OnError, OnLimit, OverrideRate,
    PathMatch, RedisTarget, RouteConfig, Scope, redact_url,
};

/// What `tollgate check` prints for `cfg`: listeners, Redis (credentials redacted), and each
/// route and limit with its defaults spelled out and its admission bound in words; a calendar
/// limit with its window now.
pub fn summary(cfg: &Config) -> String {
    summary_at(cfg, jiff::Timestamp::now())
}

/// [`summary`] with calendar windows shown as they are at `now`.
pub(super) fn summary_at(cfg: &Config, now: jiff::Timestamp) -> String {
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
                RedisTarget::Sentinel(s) => format!(
                    "sentinel master {} via {}{}",
                    s.master,
                    s.nodes
                        .iter()
                        .map(|u| redact_url(u))
                        .collect::<Vec<_>>()
                        .join(", "),
                    match (&s.username, &s.password) {
                        (Some(user), Some(_)) => format!(" (master as user {user}, password set)"),
                        (None, Some(_)) => " (master password set)".to_string(),
                        _ => String::new(),
                    }
                ),
            };
            let on_error = match r.on_error {
                OnError::Allow => "allow: fall back to the local limit",
                OnError::Deny => "deny: reply 503",
            };
            let _ = writeln!(
                out,
                "redis    {target}; timeout {}, pool {}, batch_max {}, on_error {on_error}",
                DurationText(r.timeout),
                r.pool_size,
                r.batch_max
            );
        }
    }
    if !cfg.plans.is_empty() {
        let plans: Vec<String> = cfg
            .plans
            .iter()
            .map(|p| match p.burst {
                Some(b) => format!("{} {} burst {b}", p.name, p.rate),
                None => format!("{} {}", p.name, p.rate),
            })
            .collect();
        let _ = writeln!(out, "plans    {}", plans.join(", "));
    }
    if !cfg.limits.is_empty() {
        let _ = writeln!(
            out,
            "shared   {} limit{} (one budget per key across the routes that use them)",
            cfg.limits.len(),
            if cfg.limits.len() == 1 { "" } else { "s" }
        );
        for limit in &cfg.limits {
            let users: Vec<&str> = cfg
                .routes
                .iter()
                .filter(|r| r.limits.iter().any(|l| l.shared && l.name == limit.name))
                .map(|r| r.name.as_str())
                .collect();
            let used = if users.is_empty() {
                "used by no route".to_owned()
            } else {
                format!("used by {}", users.join(", "))
            };
            write_limit(&mut out, limit, Some(&used), now);
        }
    }
    if cfg.routes.is_empty() {
        let _ = writeln!(out, "routes   none: every request gets 404");
    } else {
        let _ = writeln!(out, "routes   {} (first match wins)", cfg.routes.len());
    }
    for route in &cfg.routes {
        write_route(&mut out, route, now);
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

fn write_route(out: &mut String, route: &RouteConfig, now: jiff::Timestamp) {
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
        if limit.shared {
            let _ = writeln!(
                out,
                "  limit {}: shared (top-level limits; one budget per key with every route that uses it)",
                limit.name
            );
        } else {
            write_limit(out, limit, None, now);
        }
    }
}

/// One limit's lines; `used` says which routes draw on a shared one; a calendar limit's
/// current window is shown as it is at `now`.
fn write_limit(out: &mut String, l: &LimitConfig, used: Option<&str>, now: jiff::Timestamp) {
    if let Some(slots) = &l.concurrency {
        write_slots(out, l, slots, used);
        return;
    }
    let mut algo = match &l.calendar {
        None => format!("{} {}", l.algorithm, l.rate),
        Some(c) => format!(
            "{} {}/{}, calendar {}s in {}",
            l.algorithm,
            l.rate.count,
            c.unit,
            c.unit.noun(),
            c.zone_name()
        ),
    };
    if l.algorithm == AlgorithmKind::Gcra {
        let _ = write!(algo, " burst {}", l.burst);
    }
    if let Some(ahead) = l.reserve_ahead {
        let given_up = super::reserve::units_given_up(l.rate, ahead);
        let _ = write!(
            algo,
            " (reserve_ahead {}: decided against burst {}, units spent in process up to {} after Redis granted them)",
            DurationText(ahead),
            l.burst.saturating_sub(given_up),
            DurationText(ahead)
        );
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
        enforcement(l),
    );
    let _ = writeln!(out, "    {}", admission_bound(l));
    if let Some(settle) = &l.settle {
        let _ = writeln!(out, "    {}", settle_line(settle));
    }
    if let Some(c) = &l.calendar {
        let _ = writeln!(out, "    {}", current_window(c, now));
    }
    if let Some(used) = used {
        let _ = writeln!(out, "    {used}");
    }
    for o in &l.overrides {
        let mut when = Vec::new();
        if !o.when.ip.is_empty() {
            when.push(format!("ip in {}", join(&o.when.ip, ", ")));
        }
        if !o.when.key.is_empty() {
            when.push(format!("key {}", o.when.key.join(" or ")));
        }
        for (name, value) in &o.when.header {
            when.push(format!("{name}: {value} (from trusted proxies only)"));
        }
        let _ = writeln!(
            out,
            "    override when {}: {}",
            when.join(" and "),
            override_rate(&o.then, l)
        );
    }
    if let Some(f) = &l.overrides_file {
        let (per_plan, exempt) = f.table.counts(f.plans.len());
        let mut given: Vec<String> = f
            .plans
            .iter()
            .zip(per_plan)
            .filter_map(|(p, n)| Some(format!("{n} {}", override_rate(p.as_ref()?, l))))
            .collect();
        if exempt > 0 {
            given.push(format!("{exempt} exempt"));
        }
        let n = f.table.len();
        let _ = writeln!(
            out,
            "    overrides file {}: {n} key{}{}; consulted after the overrides, reloaded when it changes",
            f.path.display(),
            if n == 1 { "" } else { "s" },
            if given.is_empty() {
                String::new()
            } else {
                format!(" ({})", given.join(", "))
            },
        );
    }
}

/// A concurrency limit's lines: its slots, and what a crashed instance costs.
fn write_slots(
    out: &mut String,
    l: &LimitConfig,
    slots: &crate::config::ConcurrencyConfig,
    used: Option<&str>,
) {
    let can_be_missing = l
        .key
        .iter()
        .any(|p| matches!(p, KeyPart::Header(_) | KeyPart::Query(_)));
    let on_missing = if can_be_missing {
        format!(" (if missing: {})", l.on_missing)
    } else {
        String::new()
    };
    let refused = match l.on_limit {
        OnLimit::Delay if !l.max_delay.is_zero() => format!(
            "waits for a slot up to {} (first come, first served), then 429 with Retry-After {}",
            DurationText(l.max_delay),
            DurationText(slots.retry_after)
        ),
        _ => format!("429 with Retry-After {}", DurationText(slots.retry_after)),
    };
    let _ = writeln!(
        out,
        "  limit {}: key {}{on_missing}, concurrency, max_in_flight {}, {}, {refused}, {}",
        l.name,
        join(&l.key, "+"),
        slots.max_in_flight,
        l.scope,
        enforcement(l),
    );
    let per = match l.scope {
        Scope::Global => format!(
            "across every instance; a slot is a lease in Redis: an instance that dies gives its slots back after {} (its live requests renew theirs)",
            DurationText(slots.lease)
        ),
        Scope::Local => "on each instance".to_owned(),
    };
    let shadow = if l.shadow {
        "not enforced (shadow); would allow "
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "    {shadow}at most {} of one key in flight at once, {per}",
        match slots.max_in_flight {
            1 => "1 request".to_owned(),
            n => format!("{n} requests"),
        }
    );
    if l.on_limit == OnLimit::Delay && !l.max_delay.is_zero() && l.scope == Scope::Global {
        let _ = writeln!(
            out,
            "    a waiter sees this instance's slots come back at once, other instances' within {} (its line's first waiter asks Redis again)",
            DurationText(crate::limit::queue::GLOBAL_POLL)
        );
    }
    if let Some(used) = used {
        let _ = writeln!(out, "    {used}");
    }
}

/// What a limit's `settle:` does, in words.
fn settle_line(s: &crate::config::SettleConfig) -> String {
    let mut parts = Vec::new();
    if let Some(h) = &s.cost_header {
        parts.push(format!(
            "charges the true cost from response header or trailer {h} (the key may go into debt; missing: the estimate stays)"
        ));
    }
    if !s.refund_status.is_empty() {
        let ranges = s.refund_ranges();
        parts.push(format!(
            "gives the charge back on status {}",
            ranges.join(", ")
        ));
    }
    format!("settles after the response: {}", parts.join("; "))
}

/// What an override gives, in words.
fn override_rate(then: &OverrideRate, l: &LimitConfig) -> String {
    match then {
        OverrideRate::Exempt => "exempt (not counted)".to_owned(),
        OverrideRate::Rate { plan, rate, burst } => {
            let quota = match &l.calendar {
                _ if l.algorithm == AlgorithmKind::Gcra => format!("{rate} burst {burst}"),
                // The limit's calendar unit: 1mo, not its nominal 30d.
                Some(c) => format!("{}/{}", rate.count, c.unit),
                None => rate.to_string(),
            };
            match plan {
                Some(p) => format!("plan {p} ({quota})"),
                None => format!("rate {quota}"),
            }
        }
    }
}

/// The calendar window holding `now`, in the zone's civil time: when the budget was last full
/// and when it is full again.
fn current_window(c: &CalendarWindows, now: jiff::Timestamp) -> String {
    use crate::limit::algorithm::{Calendar, calendar::Unit};
    let unit = match c.unit {
        CalendarUnit::Day => Unit::Day,
        CalendarUnit::Week => Unit::Week,
        CalendarUnit::Month => Unit::Month,
    };
    let micros = u64::try_from(now.as_microsecond()).unwrap_or(0);
    let (start, end) = Calendar::new(unit, c.timezone.clone()).window_at(micros);
    let civil = |t: u64| {
        i64::try_from(t)
            .ok()
            .and_then(|t| jiff::Timestamp::from_microsecond(t).ok())
            .map_or_else(
                || "?".to_owned(),
                |t| {
                    t.to_zoned_datetime(c.timezone.clone())
                        .strftime("%Y-%m-%d %H:%M %Z")
                        .to_string()
                },
            )
    };
    format!(
        "current window {} to {} ({}); the next starts at {}",
        civil(start),
        civil(end),
        span_text(end - start),
        match c.unit {
            CalendarUnit::Day => "local midnight",
            CalendarUnit::Week => "Monday 00:00",
            CalendarUnit::Month => "00:00 on the 1st",
        }
    )
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
        AlgorithmKind::FixedWindow if l.calendar.is_some() => {
            let total = count.saturating_mul(2);
            let (noun, zone) = l
                .calendar
                .as_ref()
                .map_or(("day", "UTC"), |c| (c.unit.noun(), c.zone_name()));
            let changes = if noun == "day" {
                "a day is 23 or 25 hours where the zone changes its clocks".to_owned()
            } else {
                format!("a {noun} holding a clock change is an hour shorter or longer")
            };
            (
                total,
                format!(
                    "at most {count}{} per calendar {noun} ({zone} civil time: {changes}); {total} across a window boundary (2 × {count})",
                    unit_word(l.cost)
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
        // Written by `write_slots`; no rate to bound.
        AlgorithmKind::Concurrency => (count, format!("at most {count} in flight at once")),
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

/// A window's length as a person says it: `23 h`, `7 days 1 h`, `31 days`, `23 h 30 min`.
fn span_text(micros: u64) -> String {
    let minutes = micros / 60_000_000;
    let (days, hours, mins) = (minutes / 1440, minutes / 60 % 24, minutes % 60);
    let mut parts = Vec::new();
    if days <= 1 {
        if days * 24 + hours > 0 {
            parts.push(format!("{} h", days * 24 + hours));
        }
    } else {
        parts.push(format!("{days} days"));
        if hours > 0 {
            parts.push(format!("{hours} h"));
        }
    }
    if mins > 0 || parts.is_empty() {
        parts.push(format!("{mins} min"));
    }
    parts.join(" ")
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

/// Whether a limit rejects, as the summary says it.
fn enforcement(l: &LimitConfig) -> &'static str {
    if l.shadow {
        "shadow (never rejects)"
    } else {
        "enforced"
    }
}
