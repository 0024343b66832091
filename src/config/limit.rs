//! One `limits:` entry: defaults and the rules that tie its fields together.
//!
//! The cross-field rules exist because each refused combination would run but
//! not do what it says: a cost no bucket can hold never admits, `delay` on an
//! algorithm that cannot reserve a future slot cannot wait, `eventual` without
//! a shared store has nothing to be eventually consistent with. Combinations that
//! run and do something well defined, only less than they seem to (a `burst` on a
//! window algorithm, a `max_delay` without `delay`), load with a warning instead.

use std::collections::HashMap;
use std::time::Duration;

use serde_saphyr::Spanned;

use super::Invalid;
use super::consumers::{Consumers, Shape};
use super::rate::{DurationText, LUA_PARAM_MAX, precision_problem};
use super::raw::{RawLimit, Text};
use super::types::{
    AlgorithmKind, Consistency, KeyPart, LimitConfig, OnLimit, OnMissing, Rate, Scope,
};
use super::validate::{Checked, at, duration_or, items, keyword, name, positive_duration_or};

pub(super) fn limit(
    raw: Spanned<RawLimit>,
    has_redis: bool,
    route: &str,
    seen: &mut HashMap<String, u64>,
    consumers: &mut Consumers<'_>,
    warnings: &mut Vec<Invalid>,
) -> Checked<LimitConfig> {
    let limit_at = at(&raw);
    let mut raw = raw.value;
    if let Some(u) = &raw.use_ {
        return Err(Invalid::new(
            at(u),
            "`use:` draws on a top-level limit and takes no other field, and not inside the top-level `limits:` itself",
        ));
    }
    let name = name(raw.name.take(), limit_at, seen, Some(route))?;

    let algorithm = match &raw.algorithm {
        Some(t) => keyword(
            t,
            "algorithm",
            &[
                ("gcra", AlgorithmKind::Gcra),
                ("token_bucket", AlgorithmKind::Gcra),
                ("leaky_bucket", AlgorithmKind::Gcra),
                ("fixed_window", AlgorithmKind::FixedWindow),
                ("sliding_window", AlgorithmKind::SlidingWindow),
                ("sliding_log", AlgorithmKind::SlidingLog),
                ("concurrency", AlgorithmKind::Concurrency),
            ],
        )?,
        None => AlgorithmKind::Gcra,
    };
    // A concurrency limit has slots instead of a rate (config/after.rs).
    let slots = super::after::concurrency(&raw, algorithm, limit_at, &name)?;
    let (rate, calendar) = match &slots {
        Some(slots) => (slots.as_rate(), None),
        None => {
            let Some(rate_text) = &raw.rate else {
                return Err(Invalid::new(
                    limit_at,
                    format!("limit `{name}` has no `rate`: add e.g. `rate: 100/1m` (COUNT/PERIOD)"),
                ));
            };
            let (rate, calendar) = super::calendar::rate_and_windows(
                rate_text,
                raw.align.as_ref(),
                raw.timezone.as_ref(),
                algorithm,
            )?;
            check_precision(algorithm, rate, rate_text)?;
            (rate, calendar)
        }
    };
    let key = match raw.key {
        Some(list) => {
            let list_at = at(&list);
            let parts = items(list)
                .iter()
                .map(key_part)
                .collect::<Checked<Vec<_>>>()?;
            if parts.is_empty() {
                return Err(Invalid::new(
                    list_at,
                    "key is empty: list at least one part (use `literal:all` for one bucket shared by every client)",
                ));
            }
            parts
        }
        None => vec![KeyPart::Ip],
    };
    let on_missing = match &raw.on_missing {
        Some(t) => keyword(
            t,
            "on_missing",
            &[
                ("skip", OnMissing::Skip),
                ("ip", OnMissing::Ip),
                ("reject", OnMissing::Reject),
            ],
        )?,
        None => OnMissing::Skip,
    };

    let burst = match raw.burst {
        // The spec calls burst "gcra only"; a shared limit block that carries one into a
        // window algorithm still means the rate, so it loads, and says so.
        Some(b) if algorithm != AlgorithmKind::Gcra => {
            warnings.push(Invalid::new(
                at(&b),
                format!(
                    "warning: burst applies to gcra only and is ignored: {algorithm} admits at most the rate's count per period"
                ),
            ));
            rate.count
        }
        Some(b) if b.value == 0 => {
            return Err(Invalid::new(
                at(&b),
                "burst must be at least 1 (it is how many requests gcra admits at once)",
            ));
        }
        // The same bound as the rate's: the scripts compute with doubles, and the local gcra
        // turns burst × emission interval into microseconds, which must not overflow.
        Some(b) if b.value > LUA_PARAM_MAX => {
            return Err(Invalid::new(
                at(&b),
                format!(
                    "burst {} is too large: it must stay at most 2^50 ({LUA_PARAM_MAX}) because the Redis scripts compute with doubles",
                    b.value
                ),
            ));
        }
        Some(b) => b.value,
        None => rate.count,
    };

    let scope = match &raw.scope {
        Some(t) => {
            let scope = keyword(
                t,
                "scope",
                &[("local", Scope::Local), ("global", Scope::Global)],
            )?;
            if scope == Scope::Global && !has_redis {
                return Err(Invalid::new(
                    at(t),
                    "scope: global needs a `redis` section (global limits are shared through Redis): add one, or use scope: local",
                ));
            }
            scope
        }
        None if has_redis => Scope::Global,
        None => Scope::Local,
    };

    let cost = match raw.cost {
        Some(c) => {
            if c.value == 0 {
                return Err(Invalid::new(at(&c), "cost must be at least 1"));
            }
            let capacity = if algorithm == AlgorithmKind::Gcra {
                burst
            } else {
                rate.count
            };
            if c.value > capacity {
                return Err(Invalid::new(
                    at(&c),
                    format!(
                        "cost {} can never be admitted: the limit admits at most {capacity} at once",
                        c.value
                    ),
                ));
            }
            c.value
        }
        None => 1,
    };

    let (on_limit, max_delay) = delay(
        raw.on_limit.as_ref(),
        raw.max_delay.as_ref(),
        algorithm,
        warnings,
    )?;

    let consistency = match &raw.consistency {
        Some(t) => {
            let consistency = keyword(
                t,
                "consistency",
                &[
                    ("strict", Consistency::Strict),
                    ("eventual", Consistency::Eventual),
                ],
            )?;
            if consistency == Consistency::Eventual && scope != Scope::Global {
                return Err(Invalid::new(
                    at(t),
                    "eventual needs a shared store: use scope: global (with a `redis` section)",
                ));
            }
            // Eventual promises a bound (COUNT plus what the other instances admit in one
            // interval); deciding every request in Redis keeps it exactly, so a limit eventual
            // cannot serve loads as strict rather than being refused.
            let strict_because = match consistency {
                Consistency::Eventual if algorithm == AlgorithmKind::SlidingLog => {
                    Some("an exact log cannot be merged from counts")
                }
                Consistency::Eventual if on_limit == OnLimit::Delay && !max_delay.is_zero() => {
                    Some("a reserved slot must be taken where every instance sees it")
                }
                // The counts exchanged are keyed by epoch windows of one length; a quota of a
                // day or a month is rarely hot enough per key to need them.
                Consistency::Eventual if calendar.is_some() => {
                    Some("calendar windows are decided in Redis on its clock")
                }
                _ => None,
            };
            match strict_because {
                Some(why) => {
                    warnings.push(Invalid::new(
                        at(t),
                        format!(
                            "warning: consistency: eventual is decided as strict for this limit ({why}): every decision goes to Redis"
                        ),
                    ));
                    Consistency::Strict
                }
                None => consistency,
            }
        }
        None => Consistency::Strict,
    };
    super::after::slot_consistency(raw.consistency.as_ref(), consistency, slots.as_ref())?;
    let sync_interval = positive_duration_or(
        raw.sync_interval.as_ref(),
        "sync_interval",
        Duration::from_millis(100),
    )?;

    let shape = Shape {
        name: name.clone(),
        algorithm,
        rate,
        cost,
        consistency,
        key_parts: key.len(),
        calendar: calendar.as_ref().map(|c| c.unit),
    };
    let settle = super::after::settle(raw.settle.take(), algorithm, consistency)?;
    let reserve_ahead = super::reserve::reserve_ahead(
        raw.reserve_ahead.as_ref(),
        &super::reserve::Around {
            algorithm,
            scope,
            consistency,
            on_limit,
            settles: settle.is_some(),
            rate,
            burst,
            cost,
        },
    )?;
    let overrides = match raw.overrides {
        Some(list) => super::consumers::overrides(list, &shape, consumers, warnings)?,
        None => Vec::new(),
    };
    let overrides_file = raw
        .overrides_file
        .as_ref()
        .map(|t| super::consumers::overrides_file(t, &shape, consumers, warnings))
        .transpose()?;

    Ok(LimitConfig {
        name,
        key,
        on_missing,
        algorithm,
        rate,
        burst,
        scope,
        cost,
        on_limit,
        max_delay,
        shadow: raw.shadow.unwrap_or(false),
        consistency,
        sync_interval,
        calendar,
        overrides,
        overrides_file,
        shared: false,
        concurrency: slots,
        settle,
        reserve_ahead,
    })
}

/// Rates that are valid arithmetic but beyond what the limiters represent.
fn check_precision(algorithm: AlgorithmKind, rate: Rate, rate_text: &Text) -> Checked<()> {
    match precision_problem(algorithm, rate) {
        Some(why) => Err(Invalid::new(at(rate_text), why)),
        None => Ok(()),
    }
}

fn delay(
    on_limit: Option<&Text>,
    max_delay_text: Option<&Text>,
    algorithm: AlgorithmKind,
    warnings: &mut Vec<Invalid>,
) -> Checked<(OnLimit, Duration)> {
    let max_delay = duration_or(max_delay_text, "max_delay", Duration::ZERO)?;
    let Some(t) = on_limit else {
        reject_only(max_delay_text, max_delay, warnings);
        return Ok((OnLimit::Reject, max_delay));
    };
    let on_limit = keyword(
        t,
        "on_limit",
        &[("reject", OnLimit::Reject), ("delay", OnLimit::Delay)],
    )?;
    if on_limit == OnLimit::Reject {
        reject_only(max_delay_text, max_delay, warnings);
        return Ok((OnLimit::Reject, max_delay));
    }
    // gcra reserves a future time; a concurrency limit queues for a slot (first come, first
    // served, up to max_delay). A window or log has neither.
    if !matches!(algorithm, AlgorithmKind::Gcra | AlgorithmKind::Concurrency) {
        return Err(Invalid::new(
            at(t),
            format!(
                "on_limit: delay needs an algorithm that can reserve: gcra ({algorithm} cannot promise a future slot), or a concurrency limit, which queues for a slot"
            ),
        ));
    }
    if max_delay.is_zero() {
        // The spec's default max_delay is 0s, and "a wait longer than max_delay is rejected":
        // well defined (every request that would wait is rejected), but surely not meant.
        warnings.push(Invalid::new(
            max_delay_text.map_or_else(|| at(t), at),
            "warning: on_limit: delay with max_delay 0 never waits: a request that would wait is rejected (set max_delay, e.g. 500ms)",
        ));
    }
    Ok((OnLimit::Delay, max_delay))
}

/// A non-zero max_delay under `reject` is almost surely a forgotten `on_limit: delay`: it
/// loads (it has no effect), and says so.
fn reject_only(max_delay_text: Option<&Text>, max_delay: Duration, warnings: &mut Vec<Invalid>) {
    if let Some(m) = max_delay_text.filter(|_| !max_delay.is_zero()) {
        warnings.push(Invalid::new(
            at(m),
            format!(
                "warning: max_delay {} has no effect with on_limit: reject (add on_limit: delay to wait)",
                DurationText(max_delay)
            ),
        ));
    }
}

fn key_part(t: &Text) -> Checked<KeyPart> {
    let s = t.value.trim();
    let bad = |why: String| Invalid::new(at(t), why);
    let part = match s {
        "ip" => KeyPart::Ip,
        "path" => KeyPart::Path,
        "method" => KeyPart::Method,
        "route" => KeyPart::Route,
        _ => match s.split_once(':') {
            Some(("header", h)) => KeyPart::Header(
                http::HeaderName::from_bytes(h.trim().as_bytes())
                    .map_err(|_| bad(format!("key part `{s}`: `{h}` is not a header name")))?,
            ),
            Some(("query", q)) if !q.trim().is_empty() => KeyPart::Query(q.trim().to_owned()),
            Some(("literal", l)) if !l.is_empty() => KeyPart::Literal(l.to_owned()),
            Some(("ip_prefix", lengths)) => ip_prefix(lengths).map_err(|why| {
                bad(format!(
                    "key part `{s}`: {why} (write ip_prefix:V4,V6, e.g. \"ip_prefix:32,64\": V4 in 0..=32, V6 in 0..=128)"
                ))
            })?,
            _ => {
                return Err(bad(format!(
                    "`{s}` is not a key part: use ip | ip_prefix:V4,V6 | header:NAME | query:NAME | path | method | route | literal:TEXT"
                )));
            }
        },
    };
    Ok(part)
}

/// The lengths of `ip_prefix:V4,V6`; both are needed, since a limit keyed by prefix sees
/// clients of both families (a dual-stack listener, or `X-Forwarded-For` from a proxy).
fn ip_prefix(lengths: &str) -> Result<KeyPart, String> {
    let Some((v4, v6)) = lengths.split_once(',') else {
        return Err("give both prefix lengths, IPv4 and IPv6".to_owned());
    };
    let length = |text: &str, family: &str, max: u8| {
        let text = text.trim();
        match text.parse::<u8>() {
            Ok(n) if n <= max => Ok(n),
            _ => Err(format!("`{text}` is not an {family} prefix length")),
        }
    };
    Ok(KeyPart::IpPrefix {
        v4: length(v4, "IPv4", 32)?,
        v6: length(v6, "IPv6", 128)?,
    })
}
