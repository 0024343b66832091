//! `reserve_ahead`: a strict global gcra limit whose hot keys are spent in process, from units
//! each instance reserves in Redis ahead of use (see `limit/local/deny.rs` for the in-process
//! side and `redis/lua/reserve.lua` for Redis's).
//!
//! Strictness has a price, paid in burst: a unit may be spent up to `reserve_ahead` after it
//! was taken, so every decision on the limit is made against its burst less the units of that
//! much time (`ceil(reserve_ahead / T)`, `T = period / count`). Then the units admitted in any
//! interval never exceed what the limit's own bound allows. The rules here keep the feature to
//! the one algorithm and the one kind of decision where that argument holds.

use std::time::Duration;

use super::Invalid;
use super::rate::DurationText;
use super::raw::Text;
use super::types::{AlgorithmKind, Consistency, OnLimit, Rate, Scope};
use super::validate::{Checked, at, positive_duration_or};

/// The shortest `reserve_ahead`: shorter than a Redis round trip or two, a reservation would
/// expire before much of it could be spent.
pub(super) const MIN_RESERVE_AHEAD: Duration = Duration::from_millis(1);

/// What the rest of a limit's config says, for the rules below.
pub(super) struct Around {
    pub algorithm: AlgorithmKind,
    pub scope: Scope,
    pub consistency: Consistency,
    pub on_limit: OnLimit,
    pub settles: bool,
    pub rate: Rate,
    pub burst: u64,
    pub cost: u64,
}

/// Units of burst a reservation's life costs a limit of `rate`: `ceil(ahead / T)`, `T` the
/// gcra emission interval (`ceil(period / count)` µs, as `Gcra::new` has it).
pub fn units_given_up(rate: Rate, ahead: Duration) -> u64 {
    let period = u64::try_from(rate.period.as_micros())
        .unwrap_or(u64::MAX)
        .max(1);
    let interval = period.div_ceil(rate.count.max(1)).max(1);
    let ahead = u64::try_from(ahead.as_micros()).unwrap_or(u64::MAX);
    ahead.div_ceil(interval)
}

/// `reserve_ahead`, checked against the limit around it. `None` when not written.
pub(super) fn reserve_ahead(text: Option<&Text>, l: &Around) -> Checked<Option<Duration>> {
    let Some(t) = text else { return Ok(None) };
    let refuse = |why: String| Err(Invalid::new(at(t), why));
    if l.algorithm == AlgorithmKind::Concurrency {
        return refuse(
            "reserve_ahead applies to gcra limits only (a concurrency limit's slots are leases held while their requests run)"
                .to_string(),
        );
    }
    if l.algorithm != AlgorithmKind::Gcra {
        return refuse(format!(
            "reserve_ahead applies to gcra limits only ({} is decided in Redis on every request; its decisions are batched instead)",
            l.algorithm
        ));
    }
    if l.scope != Scope::Global {
        return refuse(
            "reserve_ahead needs scope: global (a local limit is decided in process already)"
                .to_string(),
        );
    }
    if l.consistency != Consistency::Strict {
        return refuse(
            "reserve_ahead is for consistency: strict limits (an eventual limit is spent in process already)"
                .to_string(),
        );
    }
    if l.on_limit == OnLimit::Delay {
        return refuse(
            "reserve_ahead cannot be used with on_limit: delay (a delayed request takes its own place in Redis's queue): use on_limit: reject"
                .to_string(),
        );
    }
    if l.settles {
        return refuse(
            "reserve_ahead cannot be used with settle (a settlement moves the key's state in Redis after units were spent in process)"
                .to_string(),
        );
    }
    let ahead = positive_duration_or(Some(t), "reserve_ahead", MIN_RESERVE_AHEAD)?;
    if ahead < MIN_RESERVE_AHEAD {
        return refuse(format!(
            "reserve_ahead must be at least {}",
            DurationText(MIN_RESERVE_AHEAD)
        ));
    }
    let given_up = units_given_up(l.rate, ahead);
    let left = l.burst.saturating_sub(given_up);
    if left < l.cost {
        return refuse(format!(
            "reserve_ahead {} gives up {given_up} of the burst of {} (the units of {} at {}), leaving {left}, less than the cost {}: shorten reserve_ahead or raise burst",
            DurationText(ahead),
            l.burst,
            DurationText(ahead),
            l.rate,
            l.cost
        ));
    }
    Ok(Some(ahead))
}
