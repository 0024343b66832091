//! The fields of limits that end after the response: concurrency slots (`algorithm:
//! concurrency`, with `max_in_flight`, `lease`, `retry_after`), costs settled from the
//! upstream's answer (`settle:`), and the rules that keep them apart from the rate fields.
//!
//! Kept out of `limit.rs`: a concurrency limit shares a limit's name, key, scope and shadow,
//! but none of its rate fields, and each rate field given to it (or slot field given to a rate
//! limit) is refused here with what to write instead.

use std::time::Duration;

use serde::Serialize;

use super::Invalid;
use super::rate::{DurationText, LUA_PARAM_MAX};
use super::raw::{RawLimit, RawSettle};
use super::types::{AlgorithmKind, Consistency, Rate};
use super::validate::{Checked, at, positive_duration_or};

/// Default `lease`: long enough that a renewal (once half of it has run) is rare, short enough that a
/// crashed instance's slots come back within a minute.
pub(super) const DEFAULT_LEASE: Duration = Duration::from_secs(60);
/// Default `retry_after` of a concurrency limit's 429.
pub(super) const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// The shortest `lease`: a lease is renewed once half of it has run, which must leave a Redis
/// call (its timeout) room, with margin, even on a loaded machine.
pub(super) const MIN_LEASE: Duration = Duration::from_secs(1);

/// `algorithm: concurrency`: at most `max_in_flight` requests of one key at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ConcurrencyConfig {
    /// Slots per key.
    pub max_in_flight: u64,
    /// Global: a lease not renewed for this long is free again (its instance died).
    #[serde(serialize_with = "super::types::serialize_duration")]
    pub lease: Duration,
    /// What a 429 says in `Retry-After` (no clock says when a slot frees).
    #[serde(serialize_with = "super::types::serialize_duration")]
    pub retry_after: Duration,
}

impl ConcurrencyConfig {
    /// The limit's `rate` as the code that reads one sees it: `max_in_flight` per `lease` (the
    /// algorithm's quota is the same; it is no rate, and nothing shows it as one).
    pub(super) fn as_rate(&self) -> Rate {
        Rate {
            count: self.max_in_flight,
            period: self.lease,
        }
    }
}

/// A concurrency limit's fields, or the slot fields refused on a rate limit. `None` for a rate
/// limit that gives none of them.
pub(super) fn concurrency(
    raw: &RawLimit,
    algorithm: AlgorithmKind,
    limit_at: super::Pos,
    name: &str,
) -> Checked<Option<ConcurrencyConfig>> {
    if algorithm != AlgorithmKind::Concurrency {
        let slot_field = [
            raw.max_in_flight.as_ref().map(|m| ("max_in_flight", at(m))),
            raw.lease.as_ref().map(|t| ("lease", at(t))),
            raw.retry_after.as_ref().map(|t| ("retry_after", at(t))),
        ];
        if let Some((field, pos)) = slot_field.into_iter().flatten().next() {
            return Err(Invalid::new(
                pos,
                format!(
                    "{field} applies to algorithm: concurrency only ({algorithm} limits a rate: its 429s say when the rate admits again)"
                ),
            ));
        }
        return Ok(None);
    }
    // The rate fields mean nothing to slots: each is refused where it is written.
    let not_here = |pos, field: &str, instead: &str| {
        Err(Invalid::new(
            pos,
            format!(
                "{field} does not apply to a concurrency limit, which counts requests in flight, not a rate: {instead}"
            ),
        ))
    };
    if let Some(r) = &raw.rate {
        return not_here(at(r), "rate", "remove it and set max_in_flight");
    }
    if let Some(b) = &raw.burst {
        return not_here(at(b), "burst", "max_in_flight is how many at once");
    }
    if let Some(c) = &raw.cost {
        return not_here(at(c), "cost", "every request takes one slot");
    }
    if let Some(s) = &raw.sync_interval {
        return not_here(
            at(s),
            "sync_interval",
            "slots are leases decided in Redis (or counted in this instance)",
        );
    }
    if let Some(a) = &raw.align {
        return not_here(
            at(a),
            "align",
            "slots come back when requests end, not at a window's boundary",
        );
    }
    if let Some(t) = &raw.timezone {
        return not_here(
            at(t),
            "timezone",
            "slots come back when requests end, not at a window's boundary",
        );
    }
    if let Some(o) = raw.overrides.as_ref().and_then(|o| o.first()) {
        return not_here(
            at(o),
            "overrides",
            "one max_in_flight for every key (use a second limit for other keys)",
        );
    }
    if let Some(f) = &raw.overrides_file {
        return not_here(
            at(f),
            "overrides_file",
            "one max_in_flight for every key (use a second limit for other keys)",
        );
    }
    let Some(max) = &raw.max_in_flight else {
        return Err(Invalid::new(
            limit_at,
            format!(
                "concurrency limit `{name}` has no `max_in_flight`: add e.g. `max_in_flight: 4` (requests of one key at once)"
            ),
        ));
    };
    if max.value == 0 || max.value > LUA_PARAM_MAX {
        return Err(Invalid::new(
            at(max),
            format!("max_in_flight must be between 1 and {LUA_PARAM_MAX}"),
        ));
    }
    let lease = positive_duration_or(raw.lease.as_ref(), "lease", DEFAULT_LEASE)?;
    if let Some(t) = &raw.lease
        && (lease < MIN_LEASE || lease.as_micros() > u128::from(LUA_PARAM_MAX))
    {
        return Err(Invalid::new(
            at(t),
            format!(
                "lease {} is out of range: at least {} (a lease is renewed once half of it has run, which must leave a Redis round trip room), at most 2^50 µs",
                DurationText(lease),
                DurationText(MIN_LEASE)
            ),
        ));
    }
    let retry_after =
        positive_duration_or(raw.retry_after.as_ref(), "retry_after", DEFAULT_RETRY_AFTER)?;
    Ok(Some(ConcurrencyConfig {
        max_in_flight: max.value,
        lease,
        retry_after,
    }))
}

/// A concurrency limit's `consistency`: slots cannot be counted eventually (an instance that
/// learns another's slots a `sync_interval` late admits past `max_in_flight` by what every
/// instance admitted meanwhile, with nothing to bound it by), so `eventual` is refused.
pub(super) fn slot_consistency(
    written: Option<&super::raw::Text>,
    consistency: Consistency,
    slots: Option<&ConcurrencyConfig>,
) -> Checked<()> {
    match (written, slots) {
        (Some(t), Some(_)) if consistency == Consistency::Eventual => Err(Invalid::new(
            at(t),
            "consistency: eventual cannot count slots (a request's slot must be seen by every instance while it runs): use consistency: strict",
        )),
        _ => Ok(()),
    }
}

/// `settle:`: after the response, charge what the request really cost (or give it all back).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettleConfig {
    /// The response header, or trailer, holding the true cost (a whole number).
    pub cost_header: Option<http::HeaderName>,
    /// Statuses, as inclusive ranges, that give the whole charge back.
    pub refund_status: Vec<(u16, u16)>,
}

impl SettleConfig {
    /// Whether a response with `status` gives the whole charge back.
    pub fn refunds(&self, status: u16) -> bool {
        self.refund_status
            .iter()
            .any(|&(lo, hi)| (lo..=hi).contains(&status))
    }

    /// `refund_status` as written in the config: `503`, `500-599`.
    pub fn refund_ranges(&self) -> Vec<String> {
        self.refund_status
            .iter()
            .map(|&(lo, hi)| {
                if lo == hi {
                    lo.to_string()
                } else {
                    format!("{lo}-{hi}")
                }
            })
            .collect()
    }
}

/// As the YAML writes it: `cost_header: NAME`, `refund_status: ["500-599", "429"]`.
impl Serialize for SettleConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut m = s.serialize_struct("SettleConfig", 2)?;
        match &self.cost_header {
            Some(h) => m.serialize_field("cost_header", h.as_str())?,
            None => m.skip_field("cost_header")?,
        }
        m.serialize_field("refund_status", &self.refund_ranges())?;
        m.end()
    }
}

/// A limit's `settle:`, or why it cannot settle: it must be a rate limit (any of the four
/// algorithms: each state can carry a debt, a fixed window's until its end), decided strictly
/// (an eventual limit exchanges counts between instances, and a settlement is no count).
pub(super) fn settle(
    raw: Option<serde_saphyr::Spanned<RawSettle>>,
    algorithm: AlgorithmKind,
    consistency: Consistency,
) -> Checked<Option<SettleConfig>> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let settle_at = at(&raw);
    let why_not = match algorithm {
        AlgorithmKind::Concurrency => Some(
            "a concurrency limit holds slots, not units: there is no cost to settle".to_owned(),
        ),
        _ if consistency == Consistency::Eventual => Some(
            "consistency: eventual exchanges counts, not settlements: use consistency: strict"
                .to_owned(),
        ),
        _ => None,
    };
    if let Some(why) = why_not {
        return Err(Invalid::new(settle_at, format!("settle: {why}")));
    }
    let RawSettle {
        cost_header,
        refund_status,
    } = raw.value;
    let cost_header = match cost_header {
        Some(t) => Some(
            http::HeaderName::from_bytes(t.value.trim().as_bytes()).map_err(|_| {
                Invalid::new(
                    at(&t),
                    format!("cost_header: `{}` is not a header name", t.value),
                )
            })?,
        ),
        None => None,
    };
    let mut ranges = Vec::new();
    if let Some(list) = refund_status {
        for item in list.value.items(list.referenced) {
            ranges.push(status_range(&item.value).map_err(|why| Invalid::new(at(&item), why))?);
        }
    }
    if cost_header.is_none() && ranges.is_empty() {
        return Err(Invalid::new(
            settle_at,
            "settle needs cost_header (the response header or trailer with the true cost), refund_status (statuses that give the charge back), or both",
        ));
    }
    Ok(Some(SettleConfig {
        cost_header,
        refund_status: ranges,
    }))
}

/// `429` or `500-599`.
fn status_range(text: &str) -> Result<(u16, u16), String> {
    let bad = || {
        format!(
            "refund_status: `{text}` is not a status (429) or a range of them (500-599) between 100 and 599"
        )
    };
    let code = |t: &str| {
        t.trim()
            .parse::<u16>()
            .ok()
            .filter(|c| (100..=599).contains(c))
    };
    let (lo, hi) = match text.split_once('-') {
        Some((lo, hi)) => (code(lo).ok_or_else(bad)?, code(hi).ok_or_else(bad)?),
        None => {
            let c = code(text).ok_or_else(bad)?;
            (c, c)
        }
    };
    if lo > hi {
        return Err(bad());
    }
    Ok((lo, hi))
}
