//! Who the consumer is: `plans:`, a limit's `overrides:` and its `overrides_file:`.
//!
//! An override's rate is checked against the limit it overrides, at the override's own line:
//! a rate the limit's algorithm cannot take there (a window algorithm's period is the window,
//! a cost above the plan's capacity would never be admitted, an eventual limit syncs counts
//! under one rate) is refused where it is written, not discovered on the request path.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ipnet::IpNet;
use serde_saphyr::Spanned;

use super::Invalid;
use super::overrides_file;
use super::rate::{DurationText, LUA_PARAM_MAX, parse_plan_rate, precision_problem};
use super::raw::{RawOverride, RawPlan, RawWhen, Text};
use super::types::{
    AlgorithmKind, Consistency, Override, OverrideRate, OverridesFile, OverridesTable, Plan, Rate,
    When,
};
use super::validate::{Checked, at, items, trusted_proxy};

/// What overrides are checked against: the config's plans and whether headers can be believed.
pub(super) struct Consumers<'a> {
    pub plans: &'a [Plan],
    /// `server.trusted_proxies` is not empty: a `when.header` can ever be believed.
    pub trusted_proxies: bool,
    /// The config file's directory: an overrides file's path is relative to it.
    pub base: &'a Path,
    /// Files already read in this load: two limits naming one file share its table.
    pub files: HashMap<PathBuf, Arc<OverridesTable>>,
}

/// The limit an override belongs to, as far as its rate is concerned.
pub(super) struct Shape {
    pub name: String,
    pub algorithm: AlgorithmKind,
    pub rate: Rate,
    pub cost: u64,
    pub consistency: Consistency,
    /// Parts in the limit's key: a key text of another number of `|`-separated parts never
    /// matches.
    pub key_parts: usize,
    /// `align: calendar`: the unit its period is written in (`1mo`, not the nominal `30d`).
    pub calendar: Option<super::CalendarUnit>,
}

/// `plans:`, in the file's order of names.
pub(super) fn plans(
    raw: Option<Spanned<BTreeMap<String, Spanned<RawPlan>>>>,
) -> Checked<Vec<Plan>> {
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    let mut plans = Vec::with_capacity(raw.value.len());
    for (name, body) in raw.value {
        let body_at = at(&body);
        let ok = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !ok {
            return Err(Invalid::new(
                body_at,
                format!("plan name `{name}` may only contain letters, digits, `_`, `.` and `-`"),
            ));
        }
        if name == "exempt" {
            return Err(Invalid::new(
                body_at,
                "`exempt` cannot name a plan: in an overrides file it means \"not limited\"",
            ));
        }
        let Some(rate_text) = &body.value.rate else {
            return Err(Invalid::new(
                body_at,
                format!("plan `{name}` has no `rate`: add e.g. `rate: 600/1m`"),
            ));
        };
        let rate = parse_plan_rate(&rate_text.value).map_err(|e| Invalid::new(at(rate_text), e))?;
        let burst = match &body.value.burst {
            Some(b) => Some(burst_value(b)?),
            None => None,
        };
        plans.push(Plan { name, rate, burst });
    }
    Ok(plans)
}

fn burst_value(b: &Spanned<u64>) -> Checked<u64> {
    match b.value {
        0 => Err(Invalid::new(
            at(b),
            "burst must be at least 1 (it is how many requests gcra admits at once)",
        )),
        v if v > LUA_PARAM_MAX => Err(Invalid::new(
            at(b),
            format!(
                "burst {v} is too large: it must stay at most 2^50 ({LUA_PARAM_MAX}) because the Redis scripts compute with doubles"
            ),
        )),
        v => Ok(v),
    }
}

/// A limit's `overrides:`, in order (the first match wins).
pub(super) fn overrides(
    raw: Vec<Spanned<RawOverride>>,
    shape: &Shape,
    cx: &Consumers<'_>,
    warnings: &mut Vec<Invalid>,
) -> Checked<Vec<Override>> {
    raw.into_iter()
        .map(|o| one_override(o, shape, cx, warnings))
        .collect()
}

fn one_override(
    raw: Spanned<RawOverride>,
    shape: &Shape,
    cx: &Consumers<'_>,
    warnings: &mut Vec<Invalid>,
) -> Checked<Override> {
    let o_at = at(&raw);
    let raw = raw.value;
    let Some(when_raw) = raw.when else {
        return Err(Invalid::new(
            o_at,
            "this override has no `when`: give `when: {ip: [CIDR, ..]}`, `when: {key: [..]}` or `when: {header: {NAME: VALUE}}` (the limit's own rate is for everyone else)",
        ));
    };
    let when = when(when_raw, shape, cx, warnings)?;
    let exempt = raw.exempt.as_ref().is_some_and(|e| e.value);
    let given = [
        exempt.then_some("exempt"),
        raw.plan.as_ref().map(|_| "plan"),
        raw.rate.as_ref().map(|_| "rate"),
    ];
    let given: Vec<&str> = given.into_iter().flatten().collect();
    if given.len() != 1 {
        let why = if given.is_empty() {
            "says nothing to do".to_owned()
        } else {
            format!("gives {}", given.join(" and "))
        };
        return Err(Invalid::new(
            o_at,
            format!(
                "this override {why}: give exactly one of `plan: NAME`, `rate: COUNT/PERIOD` (with an optional `burst`) or `exempt: true`"
            ),
        ));
    }
    if let (Some(b), false) = (&raw.burst, raw.rate.is_some()) {
        return Err(Invalid::new(
            at(b),
            "burst goes with an inline `rate:`; a plan has its own burst",
        ));
    }
    let then = if exempt {
        OverrideRate::Exempt
    } else if let Some(plan_text) = &raw.plan {
        let plan = find_plan(plan_text, cx.plans)?;
        let (rate, burst) = alt_rate(shape, plan.rate, plan.burst)
            .map_err(|why| Invalid::new(at(plan_text), format!("plan `{}` {why}", plan.name)))?;
        OverrideRate::Rate {
            plan: Some(plan.name.clone()),
            rate,
            burst,
        }
    } else {
        let rate_text = raw.rate.as_ref().expect("one of the three was given");
        let rate = parse_plan_rate(&rate_text.value).map_err(|e| Invalid::new(at(rate_text), e))?;
        let burst = raw.burst.as_ref().map(burst_value).transpose()?;
        let (rate, burst) = alt_rate(shape, rate, burst)
            .map_err(|why| Invalid::new(at(rate_text), format!("rate {rate} {why}")))?;
        OverrideRate::Rate {
            plan: None,
            rate,
            burst,
        }
    };
    Ok(Override { when, then })
}

fn find_plan<'p>(t: &Text, plans: &'p [Plan]) -> Checked<&'p Plan> {
    let name = t.value.trim();
    plans.iter().find(|p| p.name == name).ok_or_else(|| {
        let known = overrides_file::known_plans(plans);
        Invalid::new(at(t), format!("`{name}` is not a plan ({known})"))
    })
}

fn when(
    raw: Spanned<RawWhen>,
    shape: &Shape,
    cx: &Consumers<'_>,
    warnings: &mut Vec<Invalid>,
) -> Checked<When> {
    let when_at = at(&raw);
    let raw = raw.value;
    let ip = match raw.ip {
        Some(list) => {
            let list_at = at(&list);
            let nets: Vec<IpNet> = items(list)
                .iter()
                .map(trusted_proxy)
                .collect::<Checked<_>>()
                .map_err(|e| {
                    Invalid::new(e.at, e.message.replace("trusted_proxies: ", "when.ip: "))
                })?;
            if nets.is_empty() {
                return Err(Invalid::new(list_at, "when.ip lists no network"));
            }
            nets
        }
        None => Vec::new(),
    };
    let key = match raw.key {
        Some(list) => {
            let list_at = at(&list);
            let keys: Vec<String> = items(list).into_iter().map(|t| t.value).collect();
            if keys.is_empty() || keys.iter().any(String::is_empty) {
                return Err(Invalid::new(
                    list_at,
                    "when.key needs at least one non-empty key (the limit's key text, as /admin/limits shows it)",
                ));
            }
            if let Some(k) = keys
                .iter()
                .find(|k| k.split('|').count() != shape.key_parts)
            {
                warnings.push(Invalid::new(
                    list_at,
                    format!(
                        "warning: when.key `{k}` has {} `|`-separated parts and limit `{}`'s key has {}: it never matches (a `|` inside a value is written %7C)",
                        k.split('|').count(),
                        shape.name,
                        shape.key_parts
                    ),
                ));
            }
            keys
        }
        None => Vec::new(),
    };
    let header = match raw.header {
        Some(map) => {
            let map_at = at(&map);
            if map.value.is_empty() {
                return Err(Invalid::new(map_at, "when.header names no header"));
            }
            if !cx.trusted_proxies {
                warnings.push(Invalid::new(
                    map_at,
                    "warning: when.header is believed only from a peer in server.trusted_proxies, which is empty: this override never applies (otherwise any client could name its own plan)",
                ));
            }
            let mut conditions = Vec::with_capacity(map.value.len());
            for (name, value) in map.value {
                let name = http::HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
                    Invalid::new(
                        at(&value),
                        format!("when.header: `{name}` is not a header name"),
                    )
                })?;
                if http::HeaderValue::from_str(&value.value).is_err() {
                    return Err(Invalid::new(
                        at(&value),
                        format!("when.header: `{}` cannot be a header value", value.value),
                    ));
                }
                conditions.push((name, value.value.trim().to_owned()));
            }
            conditions
        }
        None => Vec::new(),
    };
    if ip.is_empty() && key.is_empty() && header.is_empty() {
        return Err(Invalid::new(
            when_at,
            "when needs `ip: [CIDR, ..]`, `key: [..]` or `header: {NAME: VALUE}`",
        ));
    }
    Ok(When { ip, key, header })
}

/// An override's rate as the limit will run it, or why the limit cannot take it (words that
/// follow the rate or the plan's name).
fn alt_rate(shape: &Shape, rate: Rate, burst: Option<u64>) -> Result<(Rate, u64), String> {
    if shape.consistency == Consistency::Eventual {
        return Err(format!(
            "cannot apply to limit `{}`: consistency: eventual exchanges counts under the limit's one rate (an override may exempt; for other rates use consistency: strict)",
            shape.name
        ));
    }
    if let Some(why) = precision_problem(shape.algorithm, rate) {
        return Err(format!("cannot apply to limit `{}`: {why}", shape.name));
    }
    // A window's count belongs to its window, and a log is kept (and expires) for one period.
    let one_period = matches!(
        shape.algorithm,
        AlgorithmKind::FixedWindow | AlgorithmKind::SlidingWindow | AlgorithmKind::SlidingLog
    );
    if one_period && rate.period != shape.rate.period {
        let period = match shape.calendar {
            Some(unit) => unit.to_string(),
            None => DurationText(shape.rate.period).to_string(),
        };
        return Err(format!(
            "cannot apply to limit `{}`: {} keeps a key's state for the limit's period ({period}), so an override keeps that period and changes the count (e.g. {}/{period})",
            shape.name, shape.algorithm, rate.count,
        ));
    }
    let burst = match shape.algorithm {
        AlgorithmKind::Gcra => burst.unwrap_or(rate.count),
        _ => rate.count,
    };
    if shape.cost > burst {
        return Err(format!(
            "cannot apply to limit `{}`: its cost {} would never be admitted (at most {burst} at once)",
            shape.name, shape.cost
        ));
    }
    Ok((rate, burst))
}

/// A limit's `overrides_file:`, read now (or taken from another limit that named it), its plans
/// checked against this limit.
pub(super) fn overrides_file(
    t: &Text,
    shape: &Shape,
    cx: &mut Consumers<'_>,
    warnings: &mut Vec<Invalid>,
) -> Checked<OverridesFile> {
    let p = t.value.trim();
    if p.is_empty() {
        return Err(Invalid::new(
            at(t),
            "overrides_file is empty: give the path of a YAML file of `KEY: PLAN` lines",
        ));
    }
    let path = cx.base.join(p);
    let table = match cx.files.get(&path) {
        Some(table) => table.clone(),
        None => {
            let table = overrides_file::load(&path, cx.plans).map_err(|e| {
                Invalid::new(
                    at(t),
                    format!("cannot read the overrides file {}: {e}", path.display()),
                )
            })??;
            let table = Arc::new(table);
            cx.files.insert(path.clone(), table.clone());
            table
        }
    };
    let misshapen = table.misshapen(shape.key_parts);
    if misshapen > 0 {
        warnings.push(Invalid::new(
            at(t),
            format!(
                "warning: {misshapen} keys of {} have a number of `|`-separated parts other than limit `{}`'s key ({}): they never match (a `|` inside a value is written %7C)",
                path.display(),
                shape.name,
                shape.key_parts
            ),
        ));
    }
    let (per_plan, _exempt) = table.counts(cx.plans.len());
    let mut plans = Vec::with_capacity(cx.plans.len());
    for (plan, n) in cx.plans.iter().zip(per_plan) {
        if n == 0 {
            plans.push(None);
            continue;
        }
        let (rate, burst) = alt_rate(shape, plan.rate, plan.burst).map_err(|why| {
            Invalid::new(
                at(t),
                format!(
                    "plan `{}` (given to {n} keys in {}) {why}",
                    plan.name,
                    path.display()
                ),
            )
        })?;
        plans.push(Some(OverrideRate::Rate {
            plan: Some(plan.name.clone()),
            rate,
            burst,
        }));
    }
    Ok(OverridesFile { path, table, plans })
}
