//! Deciding a request that has strict global limits: the [`GlobalStore`] seam in front of
//! Redis, and the steps of [`LimitSet::evaluate_global`] around it.
//!
//! The steps, cheapest first, each a function: [`LimitSet::probe_tier`] (what Redis is known to
//! reject now), [`LimitSet::check_in_process`] (local and eventual limits, checked but not
//! charged), [`LimitSet::ask_global`] (every global limit in one call, all or nothing),
//! [`LimitSet::learn`] (the answers, into the in-process tier), [`LimitSet::on_store_error`]
//! (`on_error`: 503, or the global limits decided on their local stores), then
//! [`LimitSet::commit_in_process`] (local and eventual limits checked again and charged, each
//! check and its charge under one lock) and [`LimitSet::conclude`] (shadow, counting, headers).
//!
//! [`RedisStore`] is the store in the gateway; the orchestration tests (`limit/tests/`) put a
//! fake on the test's clock in its place.

use std::future::Future;
use std::time::Duration;

use smallvec::SmallVec;

use super::algorithm::{Micros, Rejection, Snapshot};
use super::held::{Held, PendingLease};
use super::local::deny::{Probe, ProbeGuard, Take};
use super::redis::{Decision, GlobalLimit, Grant, LimitVerdict, RedisError, RedisStore};
use super::reserve::Reserve;
use super::{Context, Limit, LimitSet, Results, Span, Verdict, micros, warn_deny};
use crate::config::OnError;

/// The shared store of strict global limits (and of eventual limits' counts): what
/// [`LimitSet::evaluate`] and [`Limit::sync_eventual`] ask of Redis.
///
/// The futures are `Send`: the gateway's connection tasks hold them across awaits. Callers take
/// the store as a type parameter rather than `&dyn GlobalStore` (see [`Context`]), so these are
/// `impl Future` methods, not boxed ones.
pub trait GlobalStore: Sync {
    /// Decides all of a request's global limits in one step: every limit is checked, and they
    /// are charged only if every enforced one admits. `shadow[i]` marks a shadow limit: decided
    /// with the others and charged with them when it admits, its rejection stops nothing.
    /// `Decision::admitted` is about the enforced limits; `per_limit` follows `limits`. No
    /// limits: admitted, without asking anything.
    /// `leases[i]` (missing: 0) is the lease id a concurrency limit's slot is taken under.
    fn decide(
        &self,
        limits: &[GlobalLimit<'_>],
        shadow: &[bool],
        leases: &[u64],
    ) -> impl Future<Output = Result<Decision, RedisError>> + Send;

    /// One limit's state now, charging nothing (the admin API).
    fn peek(
        &self,
        limit: &GlobalLimit<'_>,
    ) -> impl Future<Output = Result<Snapshot, RedisError>> + Send;

    /// An eventual window limit's sync: adds `push` to the counters of window `ws` and of the
    /// one before it (`keys`), and returns their totals and the store's time. A counter written
    /// expires `life` after its window's start.
    fn sync_counts(
        &self,
        keys: (String, String),
        push: (u64, u64),
        ws: Micros,
        life: Micros,
        period: Micros,
    ) -> impl Future<Output = Result<(u64, u64, Micros), RedisError>> + Send;

    /// An eventual gcra limit's sync: adds `units` to the TAT at `key` (`interval` each, the
    /// TAT capped at now + `tau`), and returns the TAT and the store's time.
    fn sync_gcra(
        &self,
        key: String,
        units: u64,
        interval_tau: (Micros, Micros),
    ) -> impl Future<Output = Result<(Micros, Micros), RedisError>> + Send;

    /// A reservation of at least `limit.cost` and up to `want` units of a gcra `limit` (its
    /// burst already the reserving rate's smaller one): as many as fit now, or the rejection a
    /// decision of `limit.cost` would get (see `Gcra::grant`).
    fn reserve(
        &self,
        limit: &GlobalLimit<'_>,
        want: u64,
    ) -> impl Future<Output = Result<Grant, RedisError>> + Send;

    /// Deletes `keys` in one step (the admin API's reset: one key's state of one limit, all
    /// in one hash slot) and returns how many existed. The next decision on them finds the
    /// key full.
    fn reset(&self, keys: Vec<String>) -> impl Future<Output = Result<u64, RedisError>> + Send;
}

/// The gateway's store: each method is [`RedisStore`]'s own of the same name (`decide` is
/// [`RedisStore::decide_leasing`] on Redis's clock). Implemented here rather than in
/// `redis/` so that the Redis client knows nothing of the orchestration it serves.
impl GlobalStore for RedisStore {
    fn decide(
        &self,
        limits: &[GlobalLimit<'_>],
        shadow: &[bool],
        leases: &[u64],
    ) -> impl Future<Output = Result<Decision, RedisError>> + Send {
        self.decide_leasing(limits, shadow, leases, None)
    }

    fn peek(
        &self,
        limit: &GlobalLimit<'_>,
    ) -> impl Future<Output = Result<Snapshot, RedisError>> + Send {
        RedisStore::peek(self, limit)
    }

    fn sync_counts(
        &self,
        keys: (String, String),
        push: (u64, u64),
        ws: Micros,
        life: Micros,
        period: Micros,
    ) -> impl Future<Output = Result<(u64, u64, Micros), RedisError>> + Send {
        RedisStore::sync_counts(self, keys, push, ws, life, period)
    }

    fn sync_gcra(
        &self,
        key: String,
        units: u64,
        interval_tau: (Micros, Micros),
    ) -> impl Future<Output = Result<(Micros, Micros), RedisError>> + Send {
        RedisStore::sync_gcra(self, key, units, interval_tau)
    }

    fn reserve(
        &self,
        limit: &GlobalLimit<'_>,
        want: u64,
    ) -> impl Future<Output = Result<Grant, RedisError>> + Send {
        RedisStore::reserve(self, limit, want, None)
    }

    fn reset(&self, keys: Vec<String>) -> impl Future<Output = Result<u64, RedisError>> + Send {
        RedisStore::reset(self, keys)
    }
}

/// What the in-process tier left to the global store.
struct Probed<'s> {
    /// The global limits to ask about.
    to_store: SmallVec<[Span; 4]>,
    /// Keys this request asks about for others waiting on the answer: they wake when these
    /// drop, after the answer has been learned.
    _leads: SmallVec<[ProbeGuard<'s>; 2]>,
    /// The local time the store is asked at, no later than the moment it decides: what the
    /// tier learns is anchored here.
    sent: Micros,
}

/// What a reserving limit's key gave a request.
enum Reserved {
    /// Its units, from a reservation: the snapshot for its fields and the reservation's
    /// identity.
    Spent(Snapshot, Micros),
    /// Redis refused the key's reservation.
    Refused(Rejection),
    /// No reservation could be made (Redis answered with an error, or the wait for another
    /// request's ran out): decide it per request.
    Ask,
    /// Redis did not answer the reservation (a timeout, a lost connection, the breaker
    /// open): asking it again per request would make the request wait out a second
    /// `redis.timeout`, so `on_error` decides at once.
    Outage(RedisError),
}

/// The in-process tier's answer for one key.
enum Tier<'s> {
    /// Redis is known to reject it now.
    Known(Rejection),
    /// Ask the store; with a guard when other requests wait for this one's answer.
    Ask(Option<ProbeGuard<'s>>),
}

impl LimitSet {
    /// Decides a request with at least one strict global limit (see the module doc).
    pub(super) async fn evaluate_global<G: GlobalStore>(
        &self,
        keys: &[u8],
        spans: &[Span],
        cx: &Context<'_, G>,
        started: std::time::Instant,
        held: &mut Held,
    ) -> Verdict {
        let mut results = Results::new();
        let (probed, local) = if let Some((sp @ (i, s, e, r), reserve)) = self.reserving(spans) {
            // Checked first, so that a request refused in process takes nothing reserved: units
            // given back to a reservation are still spent in Redis's eyes once it ends.
            let local = if self.has_in_process(spans) {
                match self.check_in_process(keys, spans, cx, started, &mut results) {
                    Ok(local) => local,
                    Err(rejected) => return rejected,
                }
            } else {
                SmallVec::new()
            };
            let l = &self.limits[i];
            match self.reserved(l, reserve, &keys[s..e], r, cx).await {
                Reserved::Spent(snapshot, until) => {
                    results.push((i, Ok((snapshot, 0))));
                    let verdict = self.answer_in_process(keys, spans, cx, started, results, held);
                    if !matches!(verdict, Verdict::Admit { .. }) {
                        // A local limit refused at its charge after all (a race with another
                        // request): the units go back to the reservation they came from.
                        let now = cx.clock.now();
                        l.deny_cache
                            .give_back(&keys[s..e], now, l.rate(r).id, l.cost, until);
                    }
                    return verdict;
                }
                Reserved::Refused(rejection) if !l.shadow => {
                    return self.conclude(&[(i, Err(rejection))], cx);
                }
                Reserved::Refused(rejection) => {
                    results.push((i, Err(rejection)));
                    return self.answer_in_process(keys, spans, cx, started, results, held);
                }
                // No call made, so no lease asked for: `on_error` decides, as for a failed call
                // (a shadow limit's failure is counted and the request goes on without it).
                Reserved::Outage(e) if l.shadow => {
                    cx.metrics.redis_error(e.kind());
                    return self.answer_in_process(keys, spans, cx, started, results, held);
                }
                Reserved::Outage(e) => {
                    return self.on_store_error(e, keys, spans, &[sp], cx, results, held);
                }
                // Decided per request, against the same smaller burst.
                Reserved::Ask => {
                    let mut to_store = SmallVec::new();
                    to_store.push(sp);
                    let probed = Probed {
                        to_store,
                        _leads: SmallVec::new(),
                        sent: cx.now,
                    };
                    (probed, local)
                }
            }
        } else {
            let probed = match self
                .probe_tier(keys, spans, cx, started, &mut results)
                .await
            {
                Ok(probed) => probed,
                Err(known) => return known,
            };
            if probed.to_store.is_empty() {
                // Every global limit was a shadow one the tier answered: no call.
                return self.answer_in_process(keys, spans, cx, started, results, held);
            }
            let local = match self.check_in_process(keys, spans, cx, started, &mut results) {
                Ok(local) => local,
                Err(rejected) => return rejected,
            };
            (probed, local)
        };
        let leases = self.pending_leases(keys, &probed.to_store, cx);
        let answer = self.ask_global(keys, &probed.to_store, &leases, cx).await;
        self.tiers.global_duration.observe(started.elapsed());
        let decision = match answer {
            Ok(decision) => decision,
            Err(e) => {
                if e == RedisError::Unavailable {
                    // Not asked at all: no lease can have been taken.
                    leases.into_iter().flatten().for_each(PendingLease::discard);
                }
                // Otherwise the call may have run (or may yet): dropped, the leases are given
                // back to be sure.
                return self.on_store_error(e, keys, spans, &probed.to_store, cx, results, held);
            }
        };
        self.tiers.redis.inc();
        let admitted = decision.admitted;
        for (lease, v) in leases.into_iter().zip(&decision.per_limit) {
            match lease {
                Some(lease) if admitted && v.is_admitted() => held.lease(lease.confirm()),
                Some(lease) => lease.discard(),
                None => {}
            }
        }
        if admitted && self.settles {
            self.hold_settlements(keys, &probed.to_store, &decision, cx, held);
        }
        self.learn(keys, &probed, decision, cx, &mut results);
        if admitted {
            // Should a local limit reject here after all, the verdict is a rejection and
            // `finish` gives back the leases just granted.
            self.commit_in_process(keys, spans, cx, Limit::is_local, &mut results, held);
        } else {
            // Nothing was charged: the local limits report what they answered before.
            results.extend(self.local_indexes(spans).zip(local));
        }
        self.conclude(&results, cx)
    }

    /// Step 1, the in-process tier: an enforced limit's key that Redis is known to reject now
    /// answers the request at once (`Err`); a shadow one's goes into `results` and is not
    /// asked about. The others are left to the store.
    async fn probe_tier<'s, G: GlobalStore>(
        &'s self,
        keys: &[u8],
        spans: &[Span],
        cx: &Context<'_, G>,
        started: std::time::Instant,
        results: &mut Results,
    ) -> Result<Probed<'s>, Verdict> {
        let mut probed = Probed {
            to_store: SmallVec::new(),
            _leads: SmallVec::new(),
            sent: cx.now,
        };
        for &(i, s, e, r) in spans.iter().filter(|s| self.limits[s.0].is_global()) {
            let l = &self.limits[i];
            if l.slots().is_some() {
                // A slot frees when a request ends, not at a time the tier could remember:
                // Redis decides every one.
                probed.to_store.push((i, s, e, r));
                continue;
            }
            match self
                .probe_key(l, &keys[s..e], l.rate(r).id, cx, &mut probed.sent)
                .await
            {
                Tier::Known(r) if !l.shadow => {
                    self.tiers.in_process.inc();
                    self.tiers.in_process_duration.observe(started.elapsed());
                    // The 429 names the refusing limit with the longest wait: the request's
                    // other enforced global limits that the tier knows Redis refuses too are
                    // weighed with it (looked up only: no probe is started or waited for).
                    let mut known: Results = SmallVec::new();
                    known.push((i, Err(r)));
                    for &(j, s, e, r) in spans.iter().filter(|sp| {
                        let o = &self.limits[sp.0];
                        sp.0 != i && o.is_global() && !o.shadow && o.slots().is_none()
                    }) {
                        let o = &self.limits[j];
                        let max_delay = o.delay_allowed(cx.allow_delay);
                        if let Some(r) =
                            o.deny_cache
                                .check(&keys[s..e], probed.sent, max_delay, o.rate(r).id)
                        {
                            known.push((j, Err(r)));
                        }
                    }
                    return Err(self.conclude(&known, cx));
                }
                Tier::Known(r) => results.push((i, Err(r))),
                Tier::Ask(lead) => {
                    probed.to_store.push((i, s, e, r));
                    probed._leads.extend(lead);
                }
            }
        }
        Ok(probed)
    }

    /// The request's one strict global limit, when it reserves (`reserve_ahead`). A request
    /// with another strict global limit beside it is decided per request, all its global limits
    /// in one call: a refusal by one then takes nothing from the other, where units taken from a
    /// reservation and given back would still be spent in Redis's eyes once it ends.
    fn reserving(&self, spans: &[Span]) -> Option<(Span, &Reserve)> {
        let mut global = spans.iter().filter(|s| self.limits[s.0].is_global());
        match (global.next(), global.next()) {
            (Some(&sp), None) => Some((sp, self.limits[sp.0].rate(sp.3).reserve.as_ref()?)),
            _ => None,
        }
    }

    /// Whether any of the request's limits is decided in process (local or eventual).
    fn has_in_process(&self, spans: &[Span]) -> bool {
        spans.iter().any(|s| !self.limits[s.0].is_global())
    }

    /// The end of a request whose global limits were all answered in process (`results`): no
    /// call; its local and eventual limits, if any, are checked again and charged.
    fn answer_in_process<G>(
        &self,
        keys: &[u8],
        spans: &[Span],
        cx: &Context<'_, G>,
        started: std::time::Instant,
        mut results: Results,
        held: &mut Held,
    ) -> Verdict {
        if self.has_in_process(spans)
            && !self.commit_in_process(keys, spans, cx, Limit::is_local, &mut results, held)
        {
            self.count_local(started);
        }
        self.conclude(&results, cx)
    }

    /// A reserving limit's key (`reserve_ahead`): the request's units from this instance's
    /// reservation, or from a new one this request makes in Redis (one request per key at a
    /// time; the others wait for it, within `probe_wait`). `Ask` when none could be made: the
    /// request is then decided in Redis with its other global limits.
    async fn reserved<G: GlobalStore>(
        &self,
        l: &Limit,
        reserve: &Reserve,
        key: &[u8],
        r: u16,
        cx: &Context<'_, G>,
    ) -> Reserved {
        let rate = l.rate(r).id;
        let deadline = cx.now + micros(cx.probe_wait);
        let mut now = cx.now;
        loop {
            match l.deny_cache.take(key, now, rate, l.cost, reserve.ahead) {
                Take::Spent(snapshot, until) => {
                    // Only here: the request that made the reservation counts as `redis`.
                    self.tiers.reserved.inc();
                    return Reserved::Spent(snapshot, until);
                }
                Take::Refused(rejection) => {
                    self.tiers.in_process.inc();
                    return Reserved::Refused(rejection);
                }
                Take::Follow if now < deadline => {
                    let left = Duration::from_micros(deadline - now);
                    l.deny_cache.wait_probe(key, now, left).await;
                    now = cx.clock.now();
                }
                Take::Follow => return Reserved::Ask,
                Take::Lead(_lead, sizing) => {
                    let Some(store) = cx.redis else {
                        return Reserved::Ask;
                    };
                    let redis_key = l.redis_key(key);
                    let limit = GlobalLimit {
                        algorithm: &reserve.algorithm,
                        key: &redis_key,
                        cost: l.cost,
                        max_delay: 0,
                    };
                    let sent = cx.clock.now();
                    let want = reserve.want(l.cost, sizing);
                    // Boxed where it is made, as the batcher's calls are: a Redis call's
                    // future is large, and every request's decision would carry it.
                    return match Box::pin(store.reserve(&limit, want)).await {
                        Ok(Grant {
                            verdict: Ok((units, snapshot)),
                            ..
                        }) => {
                            self.tiers.redis.inc();
                            let until = sent + reserve.ahead;
                            l.deny_cache.granted(
                                key,
                                sent,
                                rate,
                                (units, l.cost),
                                &snapshot,
                                until,
                            );
                            Reserved::Spent(
                                Snapshot {
                                    remaining: snapshot.remaining + (units - l.cost),
                                    ..snapshot
                                },
                                until,
                            )
                        }
                        Ok(Grant {
                            verdict: Err(rejection),
                            ..
                        }) => {
                            self.tiers.redis.inc();
                            l.deny_cache.rejected(key, sent, &rejection, 0, rate);
                            Reserved::Refused(rejection)
                        }
                        // Counted where `on_error` decides, or by the per-request call that
                        // follows, which meets the same Redis.
                        Err(e) if e.is_outage() || e == RedisError::Unavailable => {
                            Reserved::Outage(e)
                        }
                        Err(_) => Reserved::Ask,
                    };
                }
            }
        }
    }

    /// The in-process tier for one key, at `now` (moved on by any wait). For a hot key that
    /// just came free, one request asks Redis and the others wait for its answer. The waiting
    /// is bounded in total by `probe_wait`, not per wake: a leader's answer can free the key
    /// again a moment later (its request reached Redis a hair before its slot), and the
    /// followers must then elect a new leader, not all go.
    async fn probe_key<'s, G>(
        &self,
        l: &'s Limit,
        key: &[u8],
        rate: u32,
        cx: &Context<'_, G>,
        now: &mut Micros,
    ) -> Tier<'s> {
        if !self.tier_enabled {
            return Tier::Ask(None);
        }
        let deadline = cx.now + micros(cx.probe_wait);
        loop {
            if let Some(r) = l
                .deny_cache
                .check(key, *now, l.delay_allowed(cx.allow_delay), rate)
            {
                return Tier::Known(r);
            }
            if *now >= deadline {
                return Tier::Ask(None);
            }
            match l.deny_cache.begin(key, *now, rate) {
                Probe::Free => return Tier::Ask(None),
                Probe::Lead(guard) => return Tier::Ask(Some(guard)),
                Probe::Follow => {
                    let left = Duration::from_micros(deadline - *now);
                    l.deny_cache.wait_probe(key, *now, left).await;
                    *now = cx.clock.now();
                }
            }
        }
    }

    /// Step 2: the local and eventual limits, checked but not charged, so that a rejection
    /// there costs no round trip (`Err`: the request's answer). `Ok`: the local verdicts; the
    /// eventual ones are in `results`. Both are checked again as they are charged.
    fn check_in_process<G>(
        &self,
        keys: &[u8],
        spans: &[Span],
        cx: &Context<'_, G>,
        started: std::time::Instant,
        results: &mut Results,
    ) -> Result<SmallVec<[super::LocalVerdict; 4]>, Verdict> {
        let checks = self.local_checks(keys, spans, cx, Limit::is_local);
        let (local_ok, local) = super::local::check(&checks, cx.now);
        let eventual = self.check_eventual(keys, spans, cx);
        let eventual_ok = eventual
            .iter()
            .all(|(i, v)| v.is_ok() || self.limits[*i].shadow);
        results.extend(eventual);
        if local_ok && eventual_ok {
            return Ok(local);
        }
        results.extend(self.local_indexes(spans).zip(local));
        self.count_local(started);
        Err(self.conclude(results, cx))
    }

    /// Step 3: every global limit the tier left, in one call; the store charges them only if
    /// every enforced one admits, and a shadow limit's rejection blocks nothing. A shadow
    /// limit never changes what the client gets: when the call fails with no enforced limit in
    /// it, the failure is counted and the shadow limits are left undecided (no 503, no
    /// fallback charge).
    async fn ask_global<G: GlobalStore>(
        &self,
        keys: &[u8],
        to_store: &[Span],
        leases: &[Option<PendingLease>],
        cx: &Context<'_, G>,
    ) -> Result<Decision, RedisError> {
        let redis_keys: SmallVec<[String; 4]> = to_store
            .iter()
            .map(|&(i, s, e, _)| self.limits[i].redis_key(&keys[s..e]))
            .collect();
        let limits: SmallVec<[GlobalLimit<'_>; 4]> = to_store
            .iter()
            .zip(&redis_keys)
            .map(|(&(i, _, _, r), key)| {
                let l = &self.limits[i];
                let rate = l.rate(r);
                GlobalLimit {
                    // A reserving rate's per-request decisions use its smaller burst, as its
                    // reservations do: the bound holds only if every decision does.
                    algorithm: rate
                        .reserve
                        .as_ref()
                        .map_or(&rate.algorithm, |reserve| &reserve.algorithm),
                    key,
                    cost: l.cost,
                    max_delay: l.delay_allowed(cx.allow_delay),
                }
            })
            .collect();
        let shadow: SmallVec<[bool; 4]> =
            to_store.iter().map(|s| self.limits[s.0].shadow).collect();
        let Some(store) = cx.redis else {
            return Err(RedisError::Unavailable);
        };
        let ids: SmallVec<[u64; 4]> = leases
            .iter()
            .map(|p| p.as_ref().map_or(0, PendingLease::id))
            .collect();
        if cx.leases.is_none() && to_store.iter().any(|s| self.limits[s.0].slots().is_some()) {
            // No book to hold leases in: as if Redis could not answer (`on_error` decides).
            return Err(RedisError::Unavailable);
        }
        // Boxed where it is made: the call's future is most of this decision's size, and a
        // request answered in process (reservations) would otherwise carry and copy it.
        match Box::pin(store.decide(&limits, &shadow, &ids)).await {
            Err(e) if !shadow.contains(&false) => {
                cx.metrics.redis_error(e.kind());
                Ok(Decision {
                    admitted: true,
                    per_limit: Vec::new(),
                    at: Vec::new(),
                })
            }
            other => other,
        }
    }

    /// The settlements of the global limits that settle and were charged by `decision`, into
    /// `held`, each at the instant Redis charged it, and with the instant (Redis's clock) its
    /// admission left the key full again: that instant plus the admitted snapshot's
    /// `reset_after` (gcra: the TAT the admission stored, which a charge starts from).
    fn hold_settlements<G>(
        &self,
        keys: &[u8],
        to_store: &[Span],
        decision: &Decision,
        cx: &Context<'_, G>,
        held: &mut Held,
    ) {
        let Some(book) = cx.leases else { return };
        for (j, &(i, s, e, r)) in to_store.iter().enumerate() {
            let l = &self.limits[i];
            let (Some(settle), Some(LimitVerdict::Admitted { snapshot, .. })) =
                (&l.settle, decision.per_limit.get(j))
            else {
                continue;
            };
            let at = decision.at.get(j).copied().unwrap_or(0);
            held.settle_global(
                settle,
                l.metrics.settle.as_ref(),
                book,
                &l.rate(r).algorithm,
                l.redis_key(&keys[s..e]),
                (l.cost, at, at.saturating_add(snapshot.reset_after)),
            );
        }
    }

    /// A lease to ask for per concurrency limit of `to_store` (in its order; `None` for the
    /// rate limits), in the book of `cx`.
    fn pending_leases<G>(
        &self,
        keys: &[u8],
        to_store: &[Span],
        cx: &Context<'_, G>,
    ) -> SmallVec<[Option<PendingLease>; 4]> {
        if !self.has_after {
            return SmallVec::new();
        }
        let Some(book) = cx.leases else {
            return SmallVec::new();
        };
        to_store
            .iter()
            .map(|&(i, s, e, r)| {
                let l = &self.limits[i];
                let slots = l.slots()?;
                let key = super::redis::redis_keys(&l.redis_key(&keys[s..e]), &l.rate(r).algorithm)
                    .swap_remove(0);
                let wake = (self.queue == Some(i)).then(|| super::held::Wake {
                    store: std::sync::Arc::clone(&l.store),
                    hash: l.store.key_hash(&keys[s..e]),
                });
                Some(book.pending(key, slots.lease(), l.metrics.slots.as_ref(), wake))
            })
            .collect()
    }

    /// Step 4: the store's verdicts into `results`, and into the in-process tier what they say
    /// about the next request: a rejection until its `retry_after`; an admission only when the
    /// request was charged (shadow limits too), for only then is there a new state to learn.
    fn learn<G>(
        &self,
        keys: &[u8],
        probed: &Probed<'_>,
        decision: Decision,
        cx: &Context<'_, G>,
        results: &mut Results,
    ) {
        let charged = decision.admitted;
        for (&(i, s, e, r), v) in probed.to_store.iter().zip(decision.per_limit) {
            let l = &self.limits[i];
            let rate = l.rate(r);
            let (key, max_delay) = (&keys[s..e], l.delay_allowed(cx.allow_delay));
            let tier = self.tier_enabled && l.slots().is_none();
            let v = match v {
                LimitVerdict::Admitted { snapshot, delay } => {
                    if tier && charged {
                        let applied = (&rate.algorithm, rate.id);
                        l.deny_cache.admitted(
                            key,
                            probed.sent,
                            applied,
                            l.cost,
                            &snapshot,
                            max_delay,
                        );
                    }
                    Ok((snapshot, delay))
                }
                LimitVerdict::Rejected(r) => {
                    if tier {
                        l.deny_cache
                            .rejected(key, probed.sent, &r, max_delay, rate.id);
                    }
                    Err(r)
                }
            };
            results.push((i, v));
        }
    }

    /// `redis.on_error`, when the store could not answer: `deny` answers 503 naming an enforced
    /// limit (only their calls fail here); `allow` decides the global limits on their local
    /// stores (same quota, per instance), with the local and eventual limits, and counts it.
    #[allow(clippy::too_many_arguments)]
    fn on_store_error<G>(
        &self,
        e: RedisError,
        keys: &[u8],
        spans: &[Span],
        to_store: &[Span],
        cx: &Context<'_, G>,
        mut results: Results,
        held: &mut Held,
    ) -> Verdict {
        cx.metrics.redis_error(e.kind());
        if cx.on_error == OnError::Deny {
            warn_deny(cx.now, &e);
            let enforced = to_store.iter().find(|s| !self.limits[s.0].shadow);
            return Verdict::Unavailable {
                limit: enforced.map_or(0, |s| s.0),
            };
        }
        self.tiers.fallback.inc();
        let asked = |l: &Limit| to_store.iter().any(|s| std::ptr::eq(&self.limits[s.0], l));
        let in_fallback = |l: &Limit| l.is_local() || asked(l);
        self.commit_in_process(keys, spans, cx, in_fallback, &mut results, held);
        for &(i, ..) in to_store {
            self.limits[i].metrics.fallback.inc();
        }
        self.conclude(&results, cx)
    }
}
