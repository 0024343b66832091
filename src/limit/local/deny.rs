//! The in-process tier in front of Redis: answers "Redis would reject this" without a round
//! trip, from what Redis itself said.
//!
//! After each Redis answer for a key, the tier records `admit_at`: the earliest local time at
//! which Redis could admit the limit's next request (every request of a limit has the same
//! cost). A rejection gives it directly (`sent + retry_after`); an admission gives it for gcra
//! (the bucket's new TAT is `now + reset_after`, so the next request fits at
//! `TAT + T·cost − τ` — this is the GCRA bucket mirroring Redis's) and for fixed_window when the
//! window is used up (its end). Until then, requests for that key are rejected locally; a flood
//! from one client costs about one Redis command per emission interval instead of one per
//! request.
//!
//! Bound: never stricter than Redis. Times are anchored at `sent`, the local time the script was
//! sent, which is no later than the moment Redis decided, so `admit_at` is never later than the
//! true one; and a limit's Redis state only moves towards "more consumed" between answers
//! (every commit consumes; nothing but time gives back). The one exception is a Cluster
//! reserve-then-refund: an answer that saw units another request reserved and then refunded can
//! make the tier stricter by at most those units — under one request's cost per racing request,
//! for at most that answer's `retry_after`.

use super::sharded::{Rank, Sharded};
use crate::limit::algorithm::{Algorithm, Micros, Rejection, Snapshot};

#[derive(Clone, Copy, Debug, Default)]
struct Deny {
    /// Earliest local time Redis could admit the next request right away.
    admit_at: Micros,
    /// When the key is back to full, for the `RateLimit` fields of a local answer.
    reset_at: Micros,
    remaining: u64,
    /// A request is asking Redis about this key now (see [`DenyCache::begin`]).
    probing: bool,
    /// The rate (`LimitRate::id`) Redis answered under: a request under another rate (the
    /// key moved to another plan, by a reload or an override on its address or headers) is
    /// never answered from this entry, only by Redis, which then replaces it.
    rate: u32,
    /// `reserve_ahead`: units reserved in Redis left to spend here, and the local time they
    /// must be spent by (their call's send time plus `reserve_ahead`, or sooner when a reload
    /// shortened it: see [`DenyCache::take`]; also the reservation's identity, for giving units
    /// back to it).
    units: u64,
    until: Micros,
    /// The last reservation's size and send time: with `units`, how the next is sized.
    granted: u64,
    granted_at: Micros,
}

impl Deny {
    /// An entry outlives what it knows by the probe window: its `admit_at` (a rejection), or
    /// its reservation's `until`.
    fn expires_at(&self) -> Micros {
        self.admit_at.max(self.until) + PROBE_WINDOW
    }
}

/// What [`DenyCache::take`] found for a request of a reserving limit.
pub enum Take<'a> {
    /// Its units were taken from this instance's reservation: the snapshot for its fields, and
    /// the reservation's identity ([`DenyCache::give_back`]).
    Spent(Snapshot, Micros),
    /// Redis refused the key's last reservation, and would refuse now.
    Refused(Rejection),
    /// Reserve in Redis (and learn the answer with [`DenyCache::granted`] or
    /// [`DenyCache::rejected`]); the others wait until the guard drops.
    Lead(ProbeGuard<'a>, crate::limit::reserve::Sizing),
    /// Another request is reserving for this key now: wait for it, then take again.
    Follow,
}

/// How long an entry outlives its `admit_at`: the window in which concurrent requests for a
/// key that just became admissible again are funnelled through one Redis call.
const PROBE_WINDOW: Micros = 1_000_000;

/// What Redis is known to reject right now, per key of one global limit: the in-process tier
/// (see the module).
#[derive(Default)]
pub struct DenyCache {
    map: Sharded<Deny>,
    /// Wakes requests waiting for a probe of any key to finish; they re-check their own.
    probe_done: tokio::sync::Notify,
}

/// What a request that the tier did not reject does next.
pub enum Probe<'a> {
    /// No recent answer for this key: ask Redis, no coordination.
    Free,
    /// This request asks Redis for the key; the others wait until the guard drops.
    Lead(ProbeGuard<'a>),
    /// Another request is asking Redis for this key right now: wait for it, then re-check.
    Follow,
}

/// Ends a probe when dropped (answer learned, error, or the request abandoned).
pub struct ProbeGuard<'a> {
    cache: &'a DenyCache,
    key: Vec<u8>,
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        let hash = self.cache.map.hash(&self.key);
        {
            let mut shard = self.cache.map.lock(hash);
            if shard.get(hash, &self.key, 0).is_none() {
                drop(shard);
                self.cache.probe_done.notify_waiters();
                return;
            }
            shard.update(
                hash,
                &self.key,
                0,
                Deny::default,
                |d, _| {
                    d.probing = false;
                    d.expires_at()
                },
                any_first,
            );
        }
        self.cache.probe_done.notify_waiters();
    }
}

impl std::fmt::Debug for DenyCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenyCache")
            .field("len", &self.map.len())
            .finish()
    }
}

impl DenyCache {
    /// The rejection to answer with, if Redis is known to reject a request for `key` under
    /// `rate` at `now`. `max_delay`: a delaying limit can still reserve from
    /// `admit_at − max_delay` on.
    pub fn check(
        &self,
        key: &[u8],
        now: Micros,
        max_delay: Micros,
        rate: u32,
    ) -> Option<Rejection> {
        let hash = self.map.hash(key);
        let shard = self.map.lock(hash);
        let d = shard.get(hash, key, now).filter(|d| d.rate == rate)?;
        // A delaying limit admits (with a wait) from `admit_at − max_delay` on: that is its
        // Retry-After, as the core's and the script's.
        let admissible_at = d.admit_at.saturating_sub(max_delay);
        (admissible_at > now).then(|| Rejection {
            retry_after: admissible_at - now,
            remaining: d.remaining,
            reset_after: d.reset_at.saturating_sub(now),
        })
    }

    /// For a key with a recent answer whose `admit_at` has passed (a hot key coming free),
    /// elects one request to ask Redis; the others follow. Without it every request in flight
    /// for a flooded key reaches Redis each time the key comes free (a herd per emission
    /// interval, one call per client connection).
    pub fn begin(&self, key: &[u8], now: Micros, rate: u32) -> Probe<'_> {
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        let Some(d) = shard
            .get(hash, key, now)
            .copied()
            .filter(|d| d.rate == rate)
        else {
            return Probe::Free;
        };
        if d.probing {
            return Probe::Follow;
        }
        shard.update(
            hash,
            key,
            now,
            || d,
            |d, _| {
                d.probing = true;
                d.expires_at()
            },
            any_first,
        );
        Probe::Lead(ProbeGuard {
            cache: self,
            key: key.to_vec(),
        })
    }

    /// Waits until a probe finishes (any key; the caller re-checks its own), at most `limit`.
    pub async fn wait_probe(&self, key: &[u8], now: Micros, limit: std::time::Duration) {
        let done = self.probe_done.notified();
        tokio::pin!(done);
        done.as_mut().enable();
        let hash = self.map.hash(key);
        let probing = self
            .map
            .lock(hash)
            .get(hash, key, now)
            .is_some_and(|d| d.probing);
        if probing {
            let _ = tokio::time::timeout(limit, done).await;
        }
    }

    /// Learns from Redis rejecting `key`'s request in a script sent at local time `sent`. A
    /// delaying limit's `retry_after` is already `max_delay` short of the slot (when a wait
    /// would be allowed): the slot itself is `max_delay` later.
    /// `rate`: the rate the request was decided under (`LimitRate::id`).
    pub fn rejected(&self, key: &[u8], sent: Micros, r: &Rejection, max_delay: Micros, rate: u32) {
        self.record(
            key,
            sent,
            Deny {
                admit_at: sent + r.retry_after + max_delay,
                reset_at: sent + r.reset_after.max(r.retry_after),
                remaining: r.remaining,
                rate,
                ..Deny::default()
            },
            max_delay,
        );
    }

    /// Learns from Redis admitting `key`'s request (of `cost`) in a script sent at `sent`,
    /// decided under `algorithm`, the rate whose id is `rate`.
    pub fn admitted(
        &self,
        key: &[u8],
        sent: Micros,
        (algorithm, rate): (&Algorithm, u32),
        cost: u64,
        s: &Snapshot,
        max_delay: Micros,
    ) {
        let admit_at = match algorithm {
            Algorithm::Gcra(g) => {
                // Redis's TAT is now_redis + reset_after >= sent + reset_after.
                let tat = sent + s.reset_after;
                (tat + g.emission_interval() * cost).saturating_sub(g.tau())
            }
            Algorithm::FixedWindow(_) if s.remaining < cost => sent + s.reset_after,
            // The sliding algorithms' next admission depends on state the answer does not
            // carry; their rejections still teach the tier.
            _ => return,
        };
        if admit_at > sent {
            self.record(
                key,
                sent,
                Deny {
                    admit_at,
                    reset_at: sent + s.reset_after,
                    remaining: s.remaining,
                    rate,
                    ..Deny::default()
                },
                max_delay,
            );
        }
    }

    /// A reserving limit's request of `cost` for `key` under `rate`, at `now`: its units taken
    /// from this instance's reservation when it has them, unspent past its `until`; else what
    /// Redis last said when it refused; else this request reserves (`Lead`, one per key at a
    /// time; the units a reservation has left that are too few or too late are dropped when
    /// the new one is learned), or waits for the one that does.
    ///
    /// `ahead` is the rate's `reserve_ahead` now (µs): a reservation is spent no later than
    /// that after its call either. A reload that shortens `reserve_ahead` keeps this tier (and
    /// the rate's id) while every instance decides against the larger burst the shorter one
    /// leaves; units reserved under the longer one, spent past the shorter, would go over the
    /// bound (`limit/reserve.rs`).
    pub fn take(&self, key: &[u8], now: Micros, rate: u32, cost: u64, ahead: Micros) -> Take<'_> {
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        let found = shard.find(hash, key);
        let current = shard
            .live_at(found, now)
            .copied()
            .filter(|d| d.rate == rate);
        let mut take = Take::Follow;
        shard.update_found(
            found,
            hash,
            key,
            now,
            || Deny {
                rate,
                ..Deny::default()
            },
            |d, _| {
                match current {
                    Some(c)
                        if c.units >= cost
                            && now < c.until.min(c.granted_at.saturating_add(ahead)) =>
                    {
                        d.units -= cost;
                        take = Take::Spent(
                            Snapshot {
                                remaining: d.units.saturating_add(d.remaining),
                                reset_after: d.reset_at.saturating_sub(now),
                            },
                            d.until,
                        );
                    }
                    Some(c) if c.admit_at > now => {
                        take = Take::Refused(Rejection {
                            retry_after: c.admit_at - now,
                            remaining: c.remaining,
                            reset_after: c.reset_at.saturating_sub(now),
                        });
                    }
                    Some(c) if c.probing => {}
                    _ => {
                        // What was said under another rate says nothing under this one.
                        let base = if current.is_some() {
                            *d
                        } else {
                            Deny::default()
                        };
                        let sizing = crate::limit::reserve::Sizing {
                            granted: base.granted,
                            spent: base.granted.saturating_sub(base.units),
                            elapsed: now.saturating_sub(base.granted_at),
                        };
                        *d = Deny {
                            probing: true,
                            rate,
                            ..base
                        };
                        take = Take::Lead(
                            ProbeGuard {
                                cache: self,
                                key: key.to_vec(),
                            },
                            sizing,
                        );
                    }
                }
                d.expires_at().max(now + PROBE_WINDOW)
            },
            any_first,
        );
        take
    }

    /// Learns a reservation Redis granted for `key` under `rate`, in a call sent at local time
    /// `sent`: `units` in all, of which the reserving request took its `cost`; the rest may be
    /// spent until `until`. `s` is the key's state in Redis after them.
    #[allow(clippy::too_many_arguments)]
    pub fn granted(
        &self,
        key: &[u8],
        sent: Micros,
        rate: u32,
        (units, cost): (u64, u64),
        s: &Snapshot,
        until: Micros,
    ) {
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        shard.update(
            hash,
            key,
            sent,
            Deny::default,
            |d, _| {
                *d = Deny {
                    admit_at: 0,
                    reset_at: sent + s.reset_after,
                    remaining: s.remaining,
                    probing: d.probing,
                    rate,
                    units: units.saturating_sub(cost),
                    until,
                    granted: units,
                    granted_at: sent,
                };
                d.expires_at()
            },
            any_first,
        );
    }

    /// Gives `units` taken from the reservation `until` (see [`Take::Spent`]) back to it: the
    /// request that took them was refused by another of its limits. Nothing when that
    /// reservation has been replaced or is past its time: its units are spent or dropped.
    pub fn give_back(&self, key: &[u8], now: Micros, rate: u32, units: u64, until: Micros) {
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        let found = shard.find(hash, key);
        let Some(d) = shard.live_at(found, now).copied() else {
            return;
        };
        if d.rate != rate || d.until != until || now >= until {
            return;
        }
        shard.update_found(
            found,
            hash,
            key,
            now,
            Deny::default,
            |d, _| {
                d.units += units;
                d.expires_at()
            },
            any_first,
        );
    }

    fn record(&self, key: &[u8], sent: Micros, d: Deny, max_delay: Micros) {
        let until = d.admit_at.saturating_sub(max_delay);
        if until <= sent {
            return;
        }
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        shard.update(
            hash,
            key,
            sent,
            || d,
            |cur, live| {
                // Answers can arrive out of order; the later admit_at is the better-informed
                // one (state only moves towards more consumed). A probe in flight stays marked.
                // An answer under another rate replaces what was said under the old one.
                if !live || d.rate != cur.rate || d.admit_at >= cur.admit_at {
                    *cur = Deny {
                        probing: live && cur.probing,
                        ..d
                    };
                }
                cur.expires_at()
            },
            any_first,
        );
    }

    /// Forgets what Redis said about `key` (the admin API's reset, after the key's Redis state
    /// was deleted): the next request for it asks Redis. Returns whether the tier held it at
    /// `now`. A probe in flight for the key ends as usual (its guard finds no entry).
    pub fn forget(&self, key: &[u8], now: Micros) -> bool {
        self.map.forget(key, now)
    }

    /// Drops every entry expired at `now` (an entry outlives its `admit_at` by a second, the probe
    /// window); returns the number kept.
    pub fn sweep(&self, now: Micros) -> usize {
        self.map.sweep(now)
    }

    /// Entries held, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no entry is held, expired ones included.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Caps the tier at `keys` entries (its share of `server.max_keys`), evicting at once the
    /// entries that expire soonest when it holds more.
    pub fn set_budget(&self, keys: usize, now: Micros) {
        self.map.set_budget(keys, now, any_first, drop);
    }

    /// The budget last set (`usize::MAX`: none).
    pub fn budget(&self) -> usize {
        self.map.budget()
    }

    /// Entries evicted to keep within the budget since the last call.
    pub fn take_evicted(&self) -> u64 {
        self.map.take_evicted()
    }
}

/// Every entry ranks alike, so a full shard evicts the one whose `admit_at` comes first: its
/// rejection would be forgotten soonest anyway. Evicting any entry is safe: the key's next
/// request asks Redis, which still decides.
fn any_first(_: &Deny) -> Rank {
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algorithm::{FixedWindow, Gcra, Quota, SlidingLog};

    const Q: Quota = Quota {
        count: 10,
        period: 1_000_000,
        burst: 2,
    };

    /// The tier never answers a key under a rate other than the one Redis answered it under
    /// (the key moved to another plan); the next answer, under the new rate, replaces the old.
    #[test]
    fn an_answer_under_another_rate_is_not_used() {
        let c = DenyCache::default();
        let r = Rejection {
            retry_after: 300,
            remaining: 0,
            reset_after: 300,
        };
        c.rejected(b"k", 1_000, &r, 0, 7);
        assert!(c.check(b"k", 1_100, 0, 7).is_some());
        assert!(c.check(b"k", 1_100, 0, 8).is_none());
        assert!(matches!(c.begin(b"k", 1_100, 8), Probe::Free));
        // An earlier admit_at under the new rate still replaces the old rate's entry.
        let short = Rejection {
            retry_after: 50,
            ..r
        };
        c.rejected(b"k", 1_100, &short, 0, 8);
        assert!(c.check(b"k", 1_120, 0, 7).is_none());
        assert_eq!(c.check(b"k", 1_120, 0, 8).unwrap().retry_after, 30);
    }

    #[test]
    fn a_rejection_is_remembered_until_retry_after() {
        let c = DenyCache::default();
        let r = Rejection {
            retry_after: 300,
            remaining: 0,
            reset_after: 500,
        };
        c.rejected(b"k", 1_000, &r, 0, 7);
        let local = c.check(b"k", 1_100, 0, 7).unwrap();
        assert_eq!(local.retry_after, 200);
        assert!(c.check(b"k", 1_299, 0, 7).is_some());
        assert!(
            c.check(b"k", 1_300, 0, 7).is_none(),
            "admit_at is when Redis admits: go ask"
        );
        assert!(c.check(b"other", 1_100, 0, 7).is_none());
        // A delaying limit may reserve max_delay before admit_at.
        assert!(c.check(b"k", 1_250, 50, 7).is_none());
        assert!(c.check(b"k", 1_249, 50, 7).is_some());
    }

    /// The tier mirrors the gcra bucket: it rejects exactly where the pure core would, given the
    /// same admissions, and never earlier.
    #[test]
    fn gcra_admission_mirrors_the_bucket() {
        let alg = Algorithm::Gcra(Gcra::new(Q));
        let c = DenyCache::default();
        let mut state = alg.new_state();
        let now = 5_000_000;
        for _ in 0..2 {
            let s = alg.check(&state, now, 1).unwrap();
            alg.commit(&mut state, now, 1);
            c.admitted(b"k", now, (&alg, 7), 1, &s, 0);
        }
        // Burst used: the core rejects until retry_after, and so does the tier.
        let r = alg.check(&state, now, 1).unwrap_err();
        let local = c.check(b"k", now, 0, 7).unwrap();
        assert_eq!(local.retry_after, r.retry_after);
        assert!(c.check(b"k", now + r.retry_after - 1, 0, 7).is_some());
        assert!(c.check(b"k", now + r.retry_after, 0, 7).is_none());
        assert!(alg.check(&state, now + r.retry_after, 1).is_ok());
    }

    /// A delaying gcra limit: the tier rejects exactly while the core's `reserve` would, and
    /// answers the same Retry-After (when the request is admitted with a wait of up to
    /// `max_delay`), whether it learned from a rejection or from admissions.
    #[test]
    fn a_delaying_limit_is_mirrored_with_the_cores_retry_after() {
        let alg = Algorithm::Gcra(Gcra::new(Q));
        let now = 5_000_000;
        let mut state = alg.new_state();
        let from_admissions = DenyCache::default();
        let max_delay = 150_000;
        while let Ok((s, _)) = alg.reserve(&state, now, 1, max_delay) {
            alg.commit(&mut state, now, 1);
            from_admissions.admitted(b"k", now, (&alg, 7), 1, &s, max_delay);
        }
        let r = alg.reserve(&state, now, 1, max_delay).unwrap_err();
        let from_rejection = DenyCache::default();
        from_rejection.rejected(b"k", now, &r, max_delay, 7);
        for c in [&from_admissions, &from_rejection] {
            assert_eq!(c.check(b"k", now, max_delay, 7), Some(r));
            let at = now + r.retry_after;
            assert!(c.check(b"k", at - 1, max_delay, 7).is_some());
            assert!(c.check(b"k", at, max_delay, 7).is_none());
            assert!(alg.reserve(&state, at, 1, max_delay).is_ok());
            assert!(alg.reserve(&state, at - 1, 1, max_delay).is_err());
        }
    }

    #[test]
    fn fixed_window_learns_from_the_last_unit_and_sliding_log_only_from_rejections() {
        let fw = Algorithm::FixedWindow(FixedWindow::new(Q));
        let c = DenyCache::default();
        let s = Snapshot {
            remaining: 0,
            reset_after: 400,
        };
        c.admitted(b"k", 100, (&fw, 7), 1, &s, 0);
        assert_eq!(c.check(b"k", 200, 0, 7).unwrap().retry_after, 300);
        let log = Algorithm::SlidingLog(SlidingLog::new(Q));
        c.admitted(b"l", 100, (&log, 7), 1, &s, 0);
        assert!(c.check(b"l", 200, 0, 7).is_none());
    }

    #[test]
    fn entries_expire_a_probe_window_after_admit_at_and_are_swept() {
        let c = DenyCache::default();
        let r = Rejection {
            retry_after: 10,
            remaining: 0,
            reset_after: 10,
        };
        c.rejected(b"k", 0, &r, 0, 7);
        assert_eq!(c.sweep(5), 1);
        // Kept past admit_at for the probe window, so a hot key's herd can be funnelled.
        assert_eq!(c.sweep(10), 1);
        assert!(c.check(b"k", 10, 0, 7).is_none());
        assert_eq!(c.sweep(10 + PROBE_WINDOW), 0);
    }

    /// Capped, the tier forgets the rejections that end soonest: a key it no longer holds is
    /// simply asked of Redis again (`check` answers nothing), and it never holds more than its
    /// budget.
    #[test]
    fn a_capped_tier_forgets_the_rejections_that_end_soonest() {
        let c = DenyCache::default();
        c.set_budget(64 * 2, 0);
        let r = |retry_after| Rejection {
            retry_after,
            remaining: 0,
            reset_after: retry_after,
        };
        for i in 0..10_000u64 {
            c.rejected(format!("k{i}").as_bytes(), 1_000, &r(1_000_000 + i), 0, 7);
            assert!(c.len() <= 64 * 2);
        }
        let held = (0..10_000u64)
            .filter(|i| c.check(format!("k{i}").as_bytes(), 1_000, 0, 7).is_some())
            .count();
        assert_eq!(held, c.len());
        assert_eq!(c.take_evicted(), 10_000 - held as u64);
        // A long rejection recorded now stays over the flood of shorter ones.
        c.rejected(b"long", 1_000, &r(60_000_000), 0, 7);
        for i in 10_000..20_000u64 {
            c.rejected(format!("k{i}").as_bytes(), 1_000, &r(1_000_000), 0, 7);
        }
        assert!(c.check(b"long", 1_000, 0, 7).is_some());
    }

    #[test]
    fn one_request_probes_a_key_that_came_free_and_the_others_follow() {
        let c = DenyCache::default();
        assert!(
            matches!(c.begin(b"cold", 0, 7), Probe::Free),
            "no recent answer: no coordination"
        );
        let r = Rejection {
            retry_after: 100,
            remaining: 0,
            reset_after: 100,
        };
        c.rejected(b"k", 1_000, &r, 0, 7);
        let lead = c.begin(b"k", 1_100, 7);
        assert!(matches!(lead, Probe::Lead(_)));
        assert!(matches!(c.begin(b"k", 1_100, 7), Probe::Follow));
        assert!(matches!(c.begin(b"k", 1_200, 7), Probe::Follow));
        // The leader's answer is learned and its guard dropped: the key is no longer probed,
        // and the followers see what it learned.
        c.rejected(b"k", 1_100, &r, 0, 7);
        drop(lead);
        assert!(c.check(b"k", 1_150, 0, 7).is_some());
        assert!(matches!(c.begin(b"k", 1_200, 7), Probe::Lead(_)));
    }

    /// `reserve_ahead`'s in-process side: one instance's reservation for a key.
    mod reservations {
        use super::*;
        use crate::limit::reserve::Sizing;

        const RATE: u32 = 7;
        /// `reserve_ahead`: 100 µs.
        const AHEAD: Micros = 100;
        const REDIS_LEFT: Snapshot = Snapshot {
            remaining: 5,
            reset_after: 400,
        };

        /// Whether a request of cost 1 took a unit at `now`, and from which reservation.
        fn spent(c: &DenyCache, now: Micros) -> Option<Micros> {
            spent_under(c, now, RATE)
        }

        fn spent_under(c: &DenyCache, now: Micros, rate: u32) -> Option<Micros> {
            match c.take(b"k", now, rate, 1, AHEAD) {
                Take::Spent(_, until) => Some(until),
                _ => None,
            }
        }

        /// The sizing a `Lead` at `now` gets (its guard dropped at once), or `None` when the
        /// take was not a `Lead`.
        fn lead(c: &DenyCache, now: Micros) -> Option<Sizing> {
            match c.take(b"k", now, RATE, 1, AHEAD) {
                Take::Lead(_, sizing) => Some(sizing),
                _ => None,
            }
        }

        /// A reservation of `units` made at `sent` by a request of cost 1 (which took one).
        fn reserve(c: &DenyCache, sent: Micros, units: u64) {
            let Take::Lead(guard, _) = c.take(b"k", sent, RATE, 1, AHEAD) else {
                panic!("not a lead at {sent}");
            };
            c.granted(b"k", sent, RATE, (units, 1), &REDIS_LEFT, sent + AHEAD);
            drop(guard);
        }

        #[test]
        fn units_are_spent_until_the_reservation_ends_and_no_later() {
            let c = DenyCache::default();
            reserve(&c, 1_000, 4);
            // 3 left: their snapshot counts them with what Redis had left.
            let Take::Spent(s, until) = c.take(b"k", 1_010, RATE, 1, AHEAD) else {
                panic!("not spent");
            };
            assert_eq!((s.remaining, s.reset_after, until), (2 + 5, 390, 1_100));
            assert_eq!(spent(&c, 1_099), Some(1_100));
            // One left, but its time is up: the next request reserves, and the unit is gone.
            assert!(lead(&c, 1_100).is_some());
            assert_eq!(spent(&c, 1_101), None);
        }

        /// A reservation made before a reload that shortened `reserve_ahead` is spent only
        /// for the new one after its call.
        #[test]
        fn units_are_spent_within_the_current_reserve_ahead_of_their_call() {
            let c = DenyCache::default();
            reserve(&c, 1_000, 4);
            let shorter = |now| matches!(c.take(b"k", now, RATE, 1, 50), Take::Spent(..));
            assert!(shorter(1_049));
            assert!(!shorter(1_050));
        }

        #[test]
        fn a_take_needs_the_whole_cost() {
            let c = DenyCache::default();
            reserve(&c, 1_000, 3);
            assert!(matches!(
                c.take(b"k", 1_010, RATE, 2, AHEAD),
                Take::Spent(..)
            ));
            // One unit left, a cost of 2: reserve again (the unit is dropped).
            assert!(matches!(
                c.take(b"k", 1_020, RATE, 2, AHEAD),
                Take::Lead(..)
            ));
        }

        #[test]
        fn units_go_back_only_to_their_reservation_and_only_in_its_time() {
            let c = DenyCache::default();
            reserve(&c, 1_000, 3);
            let first = spent(&c, 1_010).unwrap();
            // Under another rate, or to another reservation: nothing.
            c.give_back(b"k", 1_020, RATE + 1, 1, first);
            c.give_back(b"k", 1_020, RATE, 1, first + 1);
            assert_eq!(spent(&c, 1_030), Some(first));
            assert_eq!(spent(&c, 1_030), None, "only the one unit left");
            // To its own, in time: back to spend.
            c.give_back(b"k", 1_040, RATE, 1, first);
            assert_eq!(spent(&c, 1_050), Some(first));
            c.give_back(b"k", 1_060, RATE, 1, first);
            // Past its time: not given back (the sizing still counts it spent).
            c.give_back(b"k", 1_100, RATE, 1, first);
            let sizing = lead(&c, 1_100).unwrap();
            assert_eq!((sizing.granted, sizing.spent), (3, 2));
        }

        #[test]
        fn units_of_a_replaced_reservation_are_not_given_back_to_the_new_one() {
            let c = DenyCache::default();
            reserve(&c, 1_000, 1);
            let old = 1_000 + AHEAD;
            // A request took the old reservation's unit; the next reserves 2 (1 left).
            reserve(&c, 1_050, 2);
            c.give_back(b"k", 1_060, RATE, 1, old);
            assert_eq!(spent(&c, 1_070), Some(1_050 + AHEAD));
            assert_eq!(
                spent(&c, 1_070),
                None,
                "the old unit did not join the new ones"
            );
        }

        #[test]
        fn a_reservation_under_another_rate_is_never_used() {
            let c = DenyCache::default();
            reserve(&c, 1_000, 4);
            assert_eq!(spent_under(&c, 1_010, RATE + 1), None);
            // The key's rate changed: its reservation and its sizing are gone.
            let Take::Lead(guard, sizing) = c.take(b"k", 1_020, RATE + 1, 1, AHEAD) else {
                panic!("not a lead");
            };
            assert_eq!((sizing.granted, sizing.spent), (0, 0));
            drop(guard);
            assert_eq!(spent(&c, 1_030), None);
        }

        #[test]
        fn one_request_reserves_at_a_time_and_the_others_follow() {
            let c = DenyCache::default();
            let Take::Lead(guard, first) = c.take(b"k", 1_000, RATE, 1, AHEAD) else {
                panic!("not a lead");
            };
            assert_eq!(first.granted, 0, "a key's first reservation");
            assert!(matches!(c.take(b"k", 1_000, RATE, 1, AHEAD), Take::Follow));
            assert!(matches!(c.take(b"k", 1_050, RATE, 1, AHEAD), Take::Follow));
            // Another key is not held up.
            assert!(matches!(
                c.take(b"j", 1_000, RATE, 1, AHEAD),
                Take::Lead(..)
            ));
            c.granted(b"k", 1_000, RATE, (3, 1), &REDIS_LEFT, 1_000 + AHEAD);
            drop(guard);
            // The followers take from what it reserved.
            assert_eq!(spent(&c, 1_060), Some(1_100));
            assert_eq!(spent(&c, 1_060), Some(1_100));
            // Spent: the next request reserves, sized by the last reservation.
            let sizing = lead(&c, 1_070).unwrap();
            assert_eq!((sizing.granted, sizing.spent, sizing.elapsed), (3, 3, 70));
            // That lead ended without an answer (a Redis error): the key is free again.
            assert!(lead(&c, 1_080).is_some());
        }

        #[test]
        fn a_refused_reservation_refuses_until_its_retry_time() {
            let c = DenyCache::default();
            let Take::Lead(guard, _) = c.take(b"k", 1_000, RATE, 1, AHEAD) else {
                panic!("not a lead");
            };
            let r = Rejection {
                retry_after: 300,
                remaining: 0,
                reset_after: 500,
            };
            c.rejected(b"k", 1_000, &r, 0, RATE);
            drop(guard);
            let Take::Refused(local) = c.take(b"k", 1_100, RATE, 1, AHEAD) else {
                panic!("not refused");
            };
            assert_eq!(
                (local.retry_after, local.remaining, local.reset_after),
                (200, 0, 400)
            );
            assert!(matches!(
                c.take(b"k", 1_299, RATE, 1, AHEAD),
                Take::Refused(_)
            ));
            // Under another rate Redis is asked.
            assert!(matches!(
                c.take(b"k", 1_100, RATE + 1, 1, AHEAD),
                Take::Lead(..)
            ));
            let c = DenyCache::default();
            c.rejected(b"k", 1_000, &r, 0, RATE);
            assert!(lead(&c, 1_300).is_some(), "Redis admits again: reserve");
        }
    }
}
