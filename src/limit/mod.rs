//! Deciding a request's limits: all admit, or none consumes.
//!
//! [`LimitSet::evaluate`] builds each limit's key, skips limits whose key part is absent
//! (`on_missing: skip`), decides the local ones in process ([`local::decide`]) and reports the
//! most restrictive result for the `RateLimit` fields. `shadow` limits are decided and counted
//! but never reject and never show in headers; policy after the decision lives in one place
//! ([`LimitSet::evaluate`]'s tail), where it is counted.

pub mod algorithm;
pub mod clock;
pub mod local;

use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use smallvec::SmallVec;

use crate::config::{AlgorithmKind, LimitConfig, OnLimit, Scope};
use crate::key::{KeyOutcome, KeySpec, RequestParts};
use crate::metrics::{Histogram, LimitMetrics};
use algorithm::{
    Algorithm, FixedWindow, Gcra, Micros, Quota, Rejection, SlidingLog, SlidingWindow, Snapshot,
};
use local::{LocalCheck, LocalStore};

/// One limit of a route, compiled from its config.
#[derive(Debug)]
pub struct Limit {
    pub name: Arc<str>,
    pub config: LimitConfig,
    pub key: KeySpec,
    pub algorithm: Algorithm,
    pub cost: u64,
    pub scope: Scope,
    /// 0 unless `on_limit: delay`.
    pub max_delay: Micros,
    pub shadow: bool,
    /// Kept across reloads when the limit's definition is unchanged.
    pub store: Arc<LocalStore>,
    pub metrics: LimitMetrics,
    /// The `RateLimit-Policy` item, formatted once: `"name";q=100;w=60`.
    pub policy: HeaderValue,
}

impl Limit {
    pub fn new(config: &LimitConfig, store: Arc<LocalStore>, metrics: LimitMetrics) -> Self {
        let algorithm = algorithm_for(config);
        let window = config.rate.period.as_secs().max(1);
        let policy = HeaderValue::from_str(&format!(
            "\"{}\";q={};w={}",
            config.name, config.rate.count, window
        ))
        .unwrap_or_else(|_| HeaderValue::from_static("\"limit\""));
        Self {
            name: config.name.as_str().into(),
            config: config.clone(),
            key: KeySpec {
                parts: config.key.clone(),
                on_missing: config.on_missing,
            },
            algorithm,
            cost: config.cost,
            scope: config.scope,
            max_delay: match config.on_limit {
                OnLimit::Delay => micros(config.max_delay),
                OnLimit::Reject => 0,
            },
            shadow: config.shadow,
            store,
            metrics,
            policy,
        }
    }
}

pub fn micros(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The pure algorithm a limit config asks for.
pub fn algorithm_for(config: &LimitConfig) -> Algorithm {
    let quota = Quota {
        count: config.rate.count,
        period: config.rate.period_micros().max(1),
        burst: config.burst,
    };
    match config.algorithm {
        AlgorithmKind::Gcra => Algorithm::Gcra(Gcra::new(quota)),
        AlgorithmKind::FixedWindow => Algorithm::FixedWindow(FixedWindow::new(quota)),
        AlgorithmKind::SlidingWindow => Algorithm::SlidingWindow(SlidingWindow::new(quota)),
        AlgorithmKind::SlidingLog => Algorithm::SlidingLog(SlidingLog::new(quota)),
    }
}

/// What the `RateLimit` fields report: one limit's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderInfo {
    pub limit: usize,
    pub remaining: u64,
    /// Seconds part of the `RateLimit` field (`t`).
    pub reset_after: Micros,
}

/// The outcome of a request's limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Forward (after `delay`, when a slot was reserved). `info`: most restrictive limit.
    Admit {
        delay: Duration,
        /// The limit that reserved the slot being waited for, when `delay` > 0.
        delayed_by: Option<usize>,
        info: Option<HeaderInfo>,
    },
    /// 429 from `limit` (index into the route's limits).
    Reject { limit: usize, rejection: Rejection },
    /// `on_missing: reject` and the named key part is absent.
    MissingKey { limit: usize, part: String },
}

#[derive(Debug, Default)]
pub struct LimitSet {
    pub limits: Vec<Limit>,
    /// Whether any limit can reserve (so the proxy knows to count waiters).
    pub can_delay: bool,
    pub local_duration: Option<Histogram>,
}

impl LimitSet {
    pub fn new(limits: Vec<Limit>, local_duration: Histogram) -> Self {
        let can_delay = limits.iter().any(|l| l.max_delay > 0);
        Self {
            limits,
            can_delay,
            local_duration: Some(local_duration),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// Decides every limit for this request. `allow_delay: false` turns reservations off (the
    /// route's waiter cap is full), so a request that would have waited is rejected instead.
    pub fn evaluate(&self, req: &RequestParts<'_>, now: Micros, allow_delay: bool) -> Verdict {
        if self.limits.is_empty() {
            return Verdict::Admit {
                delay: Duration::ZERO,
                delayed_by: None,
                info: None,
            };
        }
        let started = std::time::Instant::now();
        let mut keys: Vec<u8> = Vec::with_capacity(64 * self.limits.len());
        let mut spans: SmallVec<[(usize, usize, usize); 4]> = SmallVec::new();
        for (i, limit) in self.limits.iter().enumerate() {
            let start = keys.len();
            match limit.key.build(req, &mut keys) {
                KeyOutcome::Built => spans.push((i, start, keys.len())),
                KeyOutcome::Skip => {}
                KeyOutcome::Reject(part) => return Verdict::MissingKey { limit: i, part },
            }
        }
        let checks: SmallVec<[LocalCheck<'_>; 4]> = spans
            .iter()
            .map(|&(i, s, e)| {
                let l = &self.limits[i];
                LocalCheck {
                    store: &l.store,
                    algorithm: &l.algorithm,
                    key: &keys[s..e],
                    cost: l.cost,
                    max_delay: if allow_delay { l.max_delay } else { 0 },
                    shadow: l.shadow,
                }
            })
            .collect();
        let (_, verdicts) = local::decide(&checks, now);
        if let Some(h) = &self.local_duration {
            h.observe(started.elapsed());
        }
        let results: SmallVec<[(usize, local::LocalVerdict); 4]> =
            spans.iter().map(|s| s.0).zip(verdicts).collect();
        self.conclude(&results)
    }

    /// Policy after the decision, in one place: shadow rewrites a rejection into an admission,
    /// every decision is counted, and the most restrictive limit is picked for the headers.
    fn conclude(&self, results: &[(usize, local::LocalVerdict)]) -> Verdict {
        let mut worst_reject: Option<(usize, Rejection)> = None;
        for (i, v) in results {
            let l = &self.limits[*i];
            if let Err(r) = v {
                if l.shadow {
                    continue;
                }
                if worst_reject.is_none_or(|(_, w)| r.retry_after > w.retry_after) {
                    worst_reject = Some((*i, *r));
                }
            }
        }
        if let Some((limit, rejection)) = worst_reject {
            for (i, v) in results {
                let l = &self.limits[*i];
                match v {
                    Err(_) if l.shadow => {
                        l.metrics.shadow_rejected.inc();
                    }
                    Err(_) => {
                        l.metrics.rejected.inc();
                    }
                    // Admitted by this limit but not consumed: the request as a whole is rejected.
                    Ok(_) => {}
                }
            }
            return Verdict::Reject { limit, rejection };
        }
        let mut delay: Micros = 0;
        let mut delayed_by = None;
        let mut info: Option<HeaderInfo> = None;
        for (i, v) in results {
            let l = &self.limits[*i];
            match v {
                Err(_) => {
                    l.metrics.shadow_rejected.inc();
                }
                Ok((snap, d)) => {
                    if *d > 0 {
                        l.metrics.delayed.inc();
                        l.metrics.delay.observe(Duration::from_micros(*d));
                    } else {
                        l.metrics.allowed.inc();
                    }
                    if *d > delay {
                        delay = *d;
                        delayed_by = Some(*i);
                    }
                    if !l.shadow {
                        let candidate = header_info(*i, snap);
                        if info.is_none_or(|cur| {
                            (
                                candidate.remaining,
                                std::cmp::Reverse(candidate.reset_after),
                            ) < (cur.remaining, std::cmp::Reverse(cur.reset_after))
                        }) {
                            info = Some(candidate);
                        }
                    }
                }
            }
        }
        Verdict::Admit {
            delay: Duration::from_micros(delay),
            delayed_by,
            info,
        }
    }
}

fn header_info(limit: usize, s: &Snapshot) -> HeaderInfo {
    HeaderInfo {
        limit,
        remaining: s.remaining,
        reset_after: s.reset_after,
    }
}
