//! Which rate a request's key gets: a limit's `overrides` and `overrides_file`, compiled.
//!
//! A limit has one or more rates ([`LimitRate`]): its own first, then one per distinct rate its
//! overrides and its file's plans give. A request's key resolves to one of them (or to
//! exempt) after the key is built and before anything is decided, so every store (local, the
//! in-process tier, Redis) decides it under the rate that applies, on the key's one state: a
//! key moved to another plan keeps its TAT or its count.
//!
//! The order is the config's: the inline overrides, first match wins, then the file. A limit
//! without either never gets here (one branch on the request path).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, LazyLock};

use http::{HeaderMap, HeaderName, HeaderValue};
use ipnet::IpNet;
use parking_lot::Mutex;

use super::algorithm::calendar::Unit;
use super::algorithm::{
    Algorithm, Calendar, Concurrency, FixedWindow, Gcra, Quota, SlidingLog, SlidingWindow,
};
use crate::config::{
    AlgorithmKind, CalendarUnit, CalendarWindows, LimitConfig, OverrideRate, OverridesTable, Rate,
    TableEntry,
};
use crate::key::RequestParts;

/// What an override gives a request: one of the limit's rates, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The limit's rate at this index of [`Limit::rates`](super::Limit) (0: its own).
    Rate(u16),
    /// The limit does not count this request (`exempt`).
    Exempt,
}

/// One rate a limit can decide a key under.
#[derive(Debug)]
pub struct LimitRate {
    /// The algorithm with this rate's quota.
    pub algorithm: Algorithm,
    /// The `RateLimit-Policy` item, formatted once: `"name";q=COUNT;w=SECONDS`.
    pub policy: HeaderValue,
    /// COUNT (the legacy `X-RateLimit-Limit`).
    pub count: u64,
    /// The same for every limit state under the same quota, process-wide (see [`rate_id`]):
    /// what the in-process tier records beside an answer, so that it never answers a key with
    /// a rate the key no longer has.
    pub id: u32,
    /// The plan it came from, for the admin API; `None` for the limit's own and inline rates.
    pub plan: Option<Arc<str>>,
    /// `reserve_ahead`: this rate's reservations, and the smaller burst its decisions are made
    /// against. `None` without `reserve_ahead`, or when the burst left would not admit one
    /// request (an override's rate is then decided per request).
    pub reserve: Option<super::reserve::Reserve>,
}

/// A limit's overrides, compiled.
#[derive(Debug)]
pub struct Overrides {
    rules: Vec<Rule>,
    file: Option<FileRates>,
    /// Some rule reads a request header: the fast HTTP/1.1 path must build the header map.
    pub reads_headers: bool,
}

#[derive(Debug)]
struct Rule {
    ip: Vec<IpNet>,
    keys: Vec<Box<[u8]>>,
    headers: Vec<(HeaderName, Box<[u8]>)>,
    then: Applied,
}

#[derive(Debug)]
struct FileRates {
    table: Arc<OverridesTable>,
    /// Per plan of the config (the table's plan indexes): the rate it gives here.
    plans: Vec<Applied>,
}

impl Overrides {
    /// The rate `req`'s `key` gets.
    #[inline]
    pub fn resolve(&self, req: &RequestParts<'_>, key: &[u8]) -> Applied {
        for r in &self.rules {
            if r.matches(req.client_ip, key, req.peer_trusted.then_some(req.headers)) {
                return r.then;
            }
        }
        self.in_file(key)
    }

    /// The rate `key` gets by its key alone (the admin API, which has no request): the rules
    /// that look only at the key, then the file.
    pub fn for_key(&self, key: &[u8]) -> Applied {
        for r in self
            .rules
            .iter()
            .filter(|r| r.ip.is_empty() && r.headers.is_empty())
        {
            if r.keys.iter().any(|k| &k[..] == key) {
                return r.then;
            }
        }
        self.in_file(key)
    }

    #[inline]
    fn in_file(&self, key: &[u8]) -> Applied {
        match &self.file {
            Some(f) => match f.table.get(key) {
                Some(TableEntry::Exempt) => Applied::Exempt,
                Some(TableEntry::Plan(p)) => f.plans.get(p).copied().unwrap_or(Applied::Rate(0)),
                None => Applied::Rate(0),
            },
            None => Applied::Rate(0),
        }
    }
}

impl Rule {
    /// Every condition given holds. `headers` is `None` when the peer is not a trusted proxy:
    /// a header condition then never holds (a client would otherwise name its own plan).
    #[inline]
    fn matches(&self, ip: IpAddr, key: &[u8], headers: Option<&HeaderMap>) -> bool {
        (self.ip.is_empty() || self.ip.iter().any(|n| n.contains(&ip)))
            && (self.keys.is_empty() || self.keys.iter().any(|k| &k[..] == key))
            && (self.headers.is_empty()
                || headers.is_some_and(|h| self.headers.iter().all(|(n, v)| only_value(h, n, v))))
    }
}

/// The header is present, and every field of that name has exactly `want` (two fields that
/// differ name no one plan).
fn only_value(headers: &HeaderMap, name: &HeaderName, want: &[u8]) -> bool {
    let mut all = headers.get_all(name).iter().peekable();
    all.peek().is_some() && all.all(|v| v.as_bytes() == want)
}

/// The limit's rates (its own first) and its compiled overrides (`None` without any).
pub fn compile(config: &LimitConfig) -> (Vec<LimitRate>, Option<Overrides>) {
    let mut rates = vec![limit_rate(config, config.rate, config.burst, None)];
    if !config.has_overrides() {
        return (rates, None);
    }
    let mut index: HashMap<(Rate, u64), u16> = HashMap::new();
    index.insert((config.rate, config.burst), 0);
    let mut applied = |then: &OverrideRate, rates: &mut Vec<LimitRate>| match then {
        OverrideRate::Exempt => Applied::Exempt,
        OverrideRate::Rate { plan, rate, burst } => {
            let next = u16::try_from(rates.len()).unwrap_or(u16::MAX);
            let i = *index.entry((*rate, *burst)).or_insert_with(|| {
                rates.push(limit_rate(config, *rate, *burst, plan.as_deref()));
                next
            });
            Applied::Rate(i)
        }
    };
    let rules = config
        .overrides
        .iter()
        .map(|o| Rule {
            ip: o.when.ip.clone(),
            keys: o
                .when
                .key
                .iter()
                .map(|k| crate::key::from_admin(k).into_boxed_slice())
                .collect(),
            headers: o
                .when
                .header
                .iter()
                .map(|(n, v)| (n.clone(), v.as_bytes().into()))
                .collect(),
            then: applied(&o.then, &mut rates),
        })
        .collect::<Vec<_>>();
    let file = config.overrides_file.as_ref().map(|f| FileRates {
        table: f.table.clone(),
        plans: f
            .plans
            .iter()
            .map(|p| match p {
                Some(then) => applied(then, &mut rates),
                // Named by no entry of the file: never looked up.
                None => Applied::Rate(0),
            })
            .collect(),
    });
    let reads_headers = rules.iter().any(|r| !r.headers.is_empty());
    (
        rates,
        Some(Overrides {
            rules,
            file,
            reads_headers,
        }),
    )
}

fn limit_rate(config: &LimitConfig, rate: Rate, burst: u64, plan: Option<&str>) -> LimitRate {
    let window = super::policy_window(rate.period);
    let policy = HeaderValue::from_str(&format!(
        "\"{}\";q={};w={}",
        config.name, rate.count, window
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("\"limit\""));
    let quota = Quota {
        count: rate.count,
        period: rate.period_micros().max(1),
        burst,
    };
    LimitRate {
        algorithm: match config.algorithm {
            AlgorithmKind::Gcra => Algorithm::Gcra(Gcra::new(quota)),
            AlgorithmKind::FixedWindow => Algorithm::FixedWindow(match &config.calendar {
                None => FixedWindow::new(quota),
                // Every rate of a calendar limit counts in its calendar windows.
                Some(c) => FixedWindow::calendar(quota, calendar_windows(c)),
            }),
            AlgorithmKind::SlidingWindow => Algorithm::SlidingWindow(SlidingWindow::new(quota)),
            AlgorithmKind::SlidingLog => Algorithm::SlidingLog(SlidingLog::new(quota)),
            AlgorithmKind::Concurrency => {
                let slots = config
                    .concurrency
                    .unwrap_or(crate::config::ConcurrencyConfig {
                        max_in_flight: rate.count,
                        lease: rate.period,
                        retry_after: rate.period,
                    });
                Algorithm::Concurrency(Concurrency::new(
                    slots.max_in_flight,
                    super::micros(slots.retry_after),
                    super::micros(slots.lease),
                ))
            }
        },
        policy,
        count: rate.count,
        id: rate_id(config.algorithm, config.calendar.as_ref(), rate, burst),
        plan: plan.map(Arc::from),
        reserve: config
            .reserve_ahead
            .filter(|_| config.algorithm == AlgorithmKind::Gcra)
            .and_then(|ahead| super::reserve::Reserve::new(quota, ahead, config.cost)),
    }
}

/// One number per distinct (algorithm, rate, burst) for the life of the process: equal
/// quotas get equal ids across reloads (so the in-process tier carried over a reload keeps
/// answering keys whose rate did not change), different ones never share one.
pub fn rate_id(
    algorithm: AlgorithmKind,
    calendar: Option<&CalendarWindows>,
    rate: Rate,
    burst: u64,
) -> u32 {
    // Calendar windows by unit and zone: a 10/1d of Berlin days is not one of UTC's.
    type Windows = Option<(CalendarUnit, String)>;
    type Quotas = HashMap<(AlgorithmKind, Windows, Rate, u64), u32>;
    static IDS: LazyLock<Mutex<Quotas>> = LazyLock::new(Mutex::default);
    let windows = calendar.map(|c| (c.unit, c.zone_name().to_owned()));
    let mut ids = IDS.lock();
    let next = u32::try_from(ids.len()).unwrap_or(u32::MAX);
    *ids.entry((algorithm, windows, rate, burst)).or_insert(next)
}

/// The window function of `align: calendar`.
fn calendar_windows(c: &CalendarWindows) -> Calendar {
    let unit = match c.unit {
        CalendarUnit::Day => Unit::Day,
        CalendarUnit::Week => Unit::Week,
        CalendarUnit::Month => Unit::Month,
    };
    Calendar::new(unit, c.timezone.clone())
}
