//! `consistency: eventual`: global limits decided in process, with counts exchanged with Redis
//! every `sync_interval` instead of a round trip per request.
//!
//! Each instance keeps, per key, the window totals it last learned from Redis and the units it
//! admitted itself since its last push. A decision feeds "learned total + own unpushed units"
//! to the same pure window core a strict limit uses (`fixed_window` or `sliding_window`), so
//! the arithmetic is the one the rest of tollgate is tested on. Every `sync_interval` each key
//! touched since the last sync is pushed and pulled in one script call (`sync.lua`: INCRBY the
//! window counter, read the totals), so Redis sees about (active keys ÷ `sync_interval`)
//! commands per second whatever the request rate.
//!
//! gcra has no windows to sum: each instance keeps its own view of the key's TAT (the TAT
//! learned at the last sync, with the units admitted here since on top, by the same pure gcra
//! core) and a sync adds its unpushed units to the TAT in Redis (`sync_gcra.lua`: the TAT moves
//! on from max(TAT, now) by T per unit, on the key strict decisions use) and learns the result.
//!
//! Windows are aligned to Redis's clock (the offset to it is learned from every sync reply), so
//! all instances count into the same window counters.
//!
//! Bound: for keys every instance already syncs, an instance can only be unaware of what the
//! others admitted since their last push, so with N instances the total admitted in a window is
//! at most `COUNT` plus what the other N − 1 instances admit within one `sync_interval`. A key an
//! instance does not hold (never seen), or holds with totals older than `sync_interval` + the
//! Redis timeout (it was idle here: keys in use are synced every interval), is learned from
//! Redis before its next decision there (one round trip, `sync.lua` with nothing to push), so a client
//! moving between instances finds its count, not a fresh budget. If that pull fails (Redis
//! down), the key is decided from this instance's own counts until a sync succeeds: the
//! ceiling is then N × `COUNT` (see docs/algorithms.md).
//!
//! A failed sync loses nothing: the unpushed units stay and are pushed by the next sync that
//! succeeds; meanwhile each instance keeps deciding with what it knows. A sync that was written
//! but timed out (Redis stalled) is not pushed again: Redis runs it once it catches up.
//!
//! **Bounded.** The store holds at most its share of `server.max_keys` ([`EventualStore::set_budget`]).
//! A full shard evicts first the keys with nothing to push (Redis holds all they know), the one
//! with the most units left first; a key with units not yet pushed is evicted only when every
//! candidate has some, and then its units are not lost: they wait in a queue of evicted keys
//! that the next sync pushes (push only: the key is not learned back). That queue is bounded
//! too ([`EventualStore::leftover_cap`]); units that find it full are dropped and counted
//! ([`EventualStore::take_lost`]), never silently.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use super::algorithm::{
    Algorithm, GcraState, Micros, Rejection, SlidingState, Snapshot, State, WindowState,
};
use super::local::sharded::{Evicted, Rank, Shard, Sharded};
use parking_lot::{Mutex, MutexGuard};

/// Ranks at and above this are keys with nothing to push, evicted before any key that has.
const SYNCED: Rank = 1 << 62;

/// The fewest evicted keys whose units the queue keeps for the next sync, whatever the budget.
const LEFTOVERS_MIN: usize = 1024;

/// How close a key's counts are to full, for eviction (see the module doc): keys with nothing
/// to push and no pull in flight first, each band by the units the limit has left at `now`
/// (Redis time).
fn rank(algorithm: &Algorithm, now: Micros) -> impl Fn(&Counts) -> Rank + '_ {
    move |c| {
        let p = period(algorithm);
        let mut rolled = *c;
        rolled.roll(now - now % p, p);
        let left = algorithm
            .peek(&rolled.state(algorithm), now)
            .remaining
            .min(SYNCED - 1);
        if c.own_curr == 0 && c.own_prev == 0 && c.lead == 0 {
            SYNCED + left
        } else {
            left
        }
    }
}

/// Evicted keys' units waiting for the next sync, and the units that found the queue full.
#[derive(Default)]
struct Leftovers {
    items: Mutex<Vec<SyncItem>>,
    /// Units dropped since [`EventualStore::take_lost`] last asked.
    lost: AtomicU64,
}

impl Leftovers {
    /// Keeps an evicted key's unpushed units for the next sync, when it has any; at most `cap`
    /// keys wait.
    fn keep(&self, e: Evicted<Counts>, cap: usize) {
        let c = e.value;
        if c.own_curr == 0 && c.own_prev == 0 {
            return;
        }
        self.push(
            SyncItem {
                key: e.key.to_vec(),
                ws: c.ws,
                push_curr: c.own_curr,
                push_prev: c.own_prev,
                evicted: true,
            },
            cap,
        );
    }

    fn push(&self, item: SyncItem, cap: usize) {
        let mut items = self.items.lock();
        if items.len() < cap {
            items.push(item);
        } else {
            drop(items);
            self.lost
                .fetch_add(item.push_curr + item.push_prev, Ordering::Relaxed);
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    /// Start of the window the counts below belong to (Redis time).
    ws: Micros,
    /// Totals learned from Redis for window `ws` and the one before.
    known_curr: u64,
    known_prev: u64,
    /// Units admitted here and not yet pushed, for window `ws` and the one before.
    own_curr: u64,
    own_prev: u64,
    /// Decided on since the last sync: due for a push/pull.
    touched: bool,
    /// Non-zero while a request is learning the totals from Redis (its lead's token); the
    /// others wait for it.
    lead: u32,
    /// gcra (which has no windows; `own_curr` holds its unpushed units and `ws` the window of
    /// its last decision): this instance's TAT, in Redis time: the TAT learned at the last
    /// sync with the units admitted here since then on top. 0 for the window algorithms.
    tat: Micros,
    /// When the totals were last learned from Redis (Redis time; 0: never). A key this
    /// instance holds but has not synced for a while (it was idle here) is learned again
    /// before its next decision: meanwhile the other instances may have admitted any amount.
    synced: Micros,
    /// When a request or a sync last began to pull the totals (Redis time; 0: never),
    /// whether or not it got them.
    tried: Micros,
}

impl Counts {
    /// Moves the counts to window `w`: the current window becomes the previous one, or both
    /// are forgotten when more than a window has passed (no decision reads them any more).
    fn roll(&mut self, w: Micros, period: Micros) {
        // An older window (a decision made with a time read before another's) is read as the
        // current one: rolling back would drop units not pushed yet.
        if w <= self.ws {
            return;
        }
        if w == self.ws + period {
            self.known_prev = self.known_curr;
            self.own_prev = self.own_curr;
        } else {
            self.known_prev = 0;
            self.own_prev = 0;
        }
        self.ws = w;
        self.known_curr = 0;
        self.own_curr = 0;
    }

    /// Until when the entry is kept: while a decision still reads its windows' counters, and
    /// for gcra at least until its TAT is reached (the bucket is full again).
    fn expires(&self, period: Micros) -> Micros {
        (self.ws + 2 * period).max(self.tat)
    }

    /// Whether the totals were learned from Redis, or a pull of them tried, within
    /// `fresh_for` of `now`.
    fn fresh(&self, now: Micros, fresh_for: Micros) -> bool {
        let last = self.synced.max(self.tried);
        last != 0 && now.saturating_sub(last) <= fresh_for
    }

    /// Takes `cost` units at `now` (0: only marks the key for the next sync).
    fn charge(&mut self, algorithm: &Algorithm, now: Micros, cost: u64) {
        let p = period(algorithm);
        let w = now - now % p;
        if let Algorithm::Gcra(g) = algorithm {
            // No windows: the units go on this instance's TAT now, and on Redis's at the next
            // sync.
            self.ws = self.ws.max(w);
            let mut s = GcraState { tat: self.tat };
            g.commit(&mut s, now, cost);
            self.tat = s.tat;
        } else {
            self.roll(w, p);
        }
        self.own_curr += cost;
        self.touched = true;
    }

    /// The algorithm state these counts stand for.
    fn state(&self, algorithm: &Algorithm) -> State {
        match algorithm {
            Algorithm::Gcra(_) => State::Gcra(GcraState { tat: self.tat }),
            Algorithm::SlidingWindow(_) => State::SlidingWindow(SlidingState {
                start: self.ws,
                curr: self.known_curr + self.own_curr,
                prev: self.known_prev + self.own_prev,
            }),
            _ => State::FixedWindow(WindowState {
                start: self.ws,
                count: self.known_curr + self.own_curr,
            }),
        }
    }
}

/// One key's push/pull, as taken by [`EventualStore::due`].
#[derive(Clone, Debug)]
pub struct SyncItem {
    /// The key, as the limit's store holds it (without the Redis prefix).
    pub key: Vec<u8>,
    /// Start of the window the units below belong to, or whose totals are pulled (Redis time;
    /// gcra: the window of the key's last decision).
    pub ws: Micros,
    /// Units admitted here in window `ws` and not pushed yet (gcra: all its unpushed units).
    pub push_curr: u64,
    /// Units admitted here in the window before `ws` and not pushed yet (gcra: none).
    pub push_prev: u64,
    /// The key was evicted: its units are pushed, and nothing is learned back (the key is not
    /// held again for it).
    pub evicted: bool,
}

impl SyncItem {
    /// Nothing to push: learns the totals of window `ws` only.
    pub fn pull(key: &[u8], ws: Micros) -> Self {
        Self {
            key: key.to_vec(),
            ws,
            push_curr: 0,
            push_prev: 0,
            evicted: false,
        }
    }
}

/// What a request does about an eventual key before deciding on it.
pub enum Learn<'a> {
    /// This instance holds the key's counts: decide.
    Known,
    /// The key is new here: this request learns its totals; the others wait until the guard
    /// drops.
    Lead(LearnGuard<'a>),
    /// Another request is learning the key's totals now: wait for it.
    Follow,
}

/// Ends a learning pull when dropped (learned, failed, or the request abandoned): the key is
/// then decided on what the instance knows, and the waiting requests are woken.
pub struct LearnGuard<'a> {
    store: &'a EventualStore,
    key: Vec<u8>,
    period: Micros,
    /// Ends only this lead: after it outlived its wait another request may lead.
    token: u32,
    /// When the pull was begun (Redis time).
    started: Micros,
}

impl LearnGuard<'_> {
    /// The key being learned.
    pub fn key(&self) -> &[u8] {
        &self.key
    }
}

impl Drop for LearnGuard<'_> {
    fn drop(&mut self) {
        let hash = self.store.map.hash(&self.key);
        {
            let mut shard = self.store.map.lock(hash);
            if shard
                .get(hash, &self.key, 0)
                .is_some_and(|c| c.lead == self.token)
            {
                let period = self.period;
                let started = self.started;
                // In place (the key is held): nothing is inserted, so nothing is evicted.
                let _ = shard.update(
                    hash,
                    &self.key,
                    0,
                    Counts::default,
                    |c, _| {
                        c.lead = 0;
                        // Learned or not (Redis down), the next pull waits `fresh_for`: an
                        // outage costs one attempt per key and interval, not one per request.
                        c.tried = c.tried.max(started);
                        c.expires(period)
                    },
                    |_| 0,
                );
            }
        }
        self.store.learned.notify_waiters();
    }
}

/// One eventual limit's per-key counts on this instance, and this instance's offset to
/// Redis's clock.
#[derive(Default)]
pub struct EventualStore {
    map: Sharded<Counts>,
    /// Wakes requests waiting for a key's totals (any key; they re-check their own).
    learned: tokio::sync::Notify,
    /// The last lead token handed out.
    leads: std::sync::atomic::AtomicU32,
    /// Redis time − local time (µs), learned from sync replies.
    offset: AtomicI64,
    offset_known: std::sync::atomic::AtomicBool,
    /// Local time of the last sync.
    pub last_sync: AtomicU64,
    /// Evicted keys' units for the next sync.
    leftovers: Leftovers,
}

impl std::fmt::Debug for EventualStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventualStore")
            .field("len", &self.map.len())
            .finish()
    }
}

/// One key's counts under its shard's lock, from the check to the charge: requests for the
/// key deciding at the same instant on this instance cannot each pass on the same units. A
/// request with local limits too keeps this while they decide (eventual locks are always taken
/// before local ones, each kind in store-address order, so two requests cannot deadlock).
pub struct Held<'a> {
    store: &'a EventualStore,
    shard: MutexGuard<'a, Shard<Counts>>,
    hash: u64,
    key: &'a [u8],
    /// Redis time, taken once: check and charge see the same instant.
    now: Micros,
    period: Micros,
}

impl Held<'_> {
    /// What the limit answers now, charging nothing.
    pub fn check(&self, algorithm: &Algorithm, cost: u64) -> Result<Snapshot, Rejection> {
        algorithm.check(&self.state(algorithm), self.now, cost)
    }

    /// The key's counts rolled to the current window, as algorithm state.
    fn state(&self, algorithm: &Algorithm) -> State {
        let (now, p) = (self.now, self.period);
        let mut c = self
            .shard
            .get(self.hash, self.key, now)
            .copied()
            .unwrap_or_default();
        c.roll(now - now % p, p);
        c.state(algorithm)
    }

    /// Charges `cost` units (0 for a rejection, which still marks the key for the next sync:
    /// it needs fresh totals).
    pub fn charge(&mut self, algorithm: &Algorithm, cost: u64) {
        let (now, p) = (self.now, self.period);
        let evicted = self.shard.update(
            self.hash,
            self.key,
            now,
            || Counts {
                ws: now - now % p,
                ..Counts::default()
            },
            |c, _| {
                c.charge(algorithm, now, cost);
                c.expires(p)
            },
            rank(algorithm, now),
        );
        self.store.keep(evicted);
    }
}

fn period(algorithm: &Algorithm) -> Micros {
    algorithm.quota().period
}

impl EventualStore {
    /// Redis time now, from the local clock and the learned offset. Before the first sync the
    /// offset comes from the wall clock (Redis's `TIME` is wall-clock time too).
    pub fn redis_now(&self, local_now: Micros) -> Micros {
        if !self.offset_known.load(Ordering::Relaxed) {
            let wall = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as i64);
            let _ = self.offset.compare_exchange(
                0,
                wall - local_now as i64,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        (local_now as i64 + self.offset.load(Ordering::Relaxed)).max(0) as Micros
    }

    /// Whether this instance holds counts for `key` learned from Redis within `fresh_for`
    /// (a key in use here is synced every `sync_interval`, so it stays fresh), so a decision
    /// can go on what it holds.
    pub fn knows(&self, key: &[u8], local_now: Micros, fresh_for: Micros) -> bool {
        let now = self.redis_now(local_now);
        let hash = self.map.hash(key);
        self.map
            .lock(hash)
            .get(hash, key, now)
            .is_some_and(|c| c.lead == 0 && c.fresh(now, fresh_for))
    }

    /// For a key this instance does not hold, or holds with totals older than `fresh_for`,
    /// elects one request to learn its totals from Redis; concurrent requests for it follow, so
    /// a burst on such a key costs one round trip, not one per request. A lead that never ends
    /// (its request hung) stops blocking others after `wait`.
    pub fn begin_learn(
        &self,
        algorithm: &Algorithm,
        key: &[u8],
        local_now: Micros,
        wait: Micros,
        fresh_for: Micros,
    ) -> Learn<'_> {
        let now = self.redis_now(local_now);
        let p = period(algorithm);
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        match shard.get(hash, key, now) {
            Some(c) if c.lead != 0 => return Learn::Follow,
            Some(c) if c.fresh(now, fresh_for) => return Learn::Known,
            _ => {}
        }
        let token = self
            .leads
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(1)
            .max(1);
        let evicted = shard.update(
            hash,
            key,
            now,
            || Counts {
                ws: now - now % p,
                lead: token,
                ..Counts::default()
            },
            // A stale key keeps its counts (units not pushed yet among them) and its lifetime.
            |c, live| {
                c.lead = token;
                let lead_ends = now + wait.max(1);
                if live {
                    c.expires(p).max(lead_ends)
                } else {
                    lead_ends
                }
            },
            rank(algorithm, now),
        );
        drop(shard);
        self.keep(evicted);
        Learn::Lead(LearnGuard {
            store: self,
            key: key.to_vec(),
            period: p,
            token,
            started: now,
        })
    }

    /// Waits until `key` is no longer being learned, or until local time `deadline`.
    pub async fn wait_learned(
        &self,
        key: &[u8],
        clock: &dyn super::clock::Clock,
        deadline: Micros,
    ) {
        loop {
            let done = self.learned.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            let now = clock.now();
            // Learned, or the lead gone (entry expired): either way, decide now.
            let hash = self.map.hash(key);
            let learning = self
                .map
                .lock(hash)
                .get(hash, key, self.redis_now(now))
                .is_some_and(|c| c.lead != 0);
            if now >= deadline || !learning {
                return;
            }
            let left = std::time::Duration::from_micros(deadline - now);
            if tokio::time::timeout(left, done).await.is_err() {
                return;
            }
        }
    }

    /// The start of the window `local_now` falls in (Redis time).
    pub fn window(&self, algorithm: &Algorithm, local_now: Micros) -> Micros {
        let now = self.redis_now(local_now);
        now - now % period(algorithm)
    }

    /// The key's state as this instance decides it now (learned totals plus its own unpushed
    /// units), for the admin API.
    pub fn peek(&self, algorithm: &Algorithm, key: &[u8], local_now: Micros) -> Snapshot {
        let held = self.hold(algorithm, key, local_now);
        algorithm.peek(&held.state(algorithm), held.now)
    }

    /// Charges `cost` to `key` (after every limit of the request admitted).
    pub fn commit(&self, algorithm: &Algorithm, key: &[u8], local_now: Micros, cost: u64) {
        self.hold(algorithm, key, local_now).charge(algorithm, cost);
    }

    /// Checks and, when admitted, charges under one take of the key's lock, so requests
    /// deciding at the same instant cannot each pass on the same units.
    pub fn decide(
        &self,
        algorithm: &Algorithm,
        key: &[u8],
        local_now: Micros,
        cost: u64,
    ) -> Result<Snapshot, Rejection> {
        let mut held = self.hold(algorithm, key, local_now);
        let v = held.check(algorithm, cost);
        // A rejection is charged nothing but marks the key: it needs fresh totals.
        held.charge(algorithm, if v.is_ok() { cost } else { 0 });
        v
    }

    /// Locks `key`'s counts for a check and a charge that the request's other limits decide
    /// between (see [`Held`]).
    pub fn hold<'a>(&'a self, algorithm: &Algorithm, key: &'a [u8], local_now: Micros) -> Held<'a> {
        let now = self.redis_now(local_now);
        let hash = self.map.hash(key);
        Held {
            store: self,
            shard: self.map.lock(hash),
            hash,
            key,
            now,
            period: period(algorithm),
        }
    }

    /// The keys due for a push/pull, marking them untouched; first the evicted keys' units
    /// waiting to be pushed.
    pub fn due(&self, local_now: Micros) -> Vec<SyncItem> {
        let now = self.redis_now(local_now);
        let mut out = std::mem::take(&mut *self.leftovers.items.lock());
        self.map.for_each_live(now, |key, c| {
            if c.touched || c.own_curr > 0 || c.own_prev > 0 {
                c.touched = false;
                // Being synced: its totals come with this sync, so no request needs to pull
                // them meanwhile (nor, Redis down, to wait for a pull that cannot answer).
                c.tried = c.tried.max(now);
                out.push(SyncItem {
                    key: key.to_vec(),
                    ws: c.ws,
                    push_curr: c.own_curr,
                    push_prev: c.own_prev,
                    evicted: false,
                });
            }
        });
        out
    }

    /// Applies a sync reply: the pushed units are now part of the totals.
    pub fn apply(
        &self,
        algorithm: &Algorithm,
        item: &SyncItem,
        totals: (u64, u64),
        server_now: Micros,
        sent: Micros,
        received: Micros,
    ) {
        self.learn_clock(server_now, sent, received);
        if item.evicted {
            // Pushed: the key is not held again for it.
            return;
        }
        let p = period(algorithm);
        let hash = self.map.hash(&item.key);
        let mut shard = self.map.lock(hash);
        let evicted = shard.update(
            hash,
            &item.key,
            server_now,
            || Counts {
                ws: item.ws,
                ..Counts::default()
            },
            |c, _| {
                c.lead = 0;
                c.synced = server_now.max(1);
                if let Algorithm::Gcra(g) = algorithm {
                    // totals.0 is Redis's TAT with this push in it. Units admitted here since
                    // the push was taken go back on top, as sync_gcra.lua would charge them
                    // (capped as it caps them, at now + tau); and a TAT is never moved back
                    // (that would give budget back).
                    c.own_curr -= item.push_curr.min(c.own_curr);
                    let learned = if c.own_curr > 0 {
                        (totals.0.max(server_now)
                            + c.own_curr.saturating_mul(g.emission_interval()))
                        .min(server_now + g.tau())
                    } else {
                        totals.0
                    };
                    c.tat = c.tat.max(learned);
                    return c.expires(p);
                }
                if c.ws < item.ws {
                    // A key learned again after an idle spell: its counts move to the window
                    // the pull read, as its next decision would move them.
                    c.roll(item.ws, p);
                }
                if c.ws == item.ws {
                    c.known_curr = totals.0;
                    c.known_prev = totals.1;
                    c.own_curr -= item.push_curr.min(c.own_curr);
                    c.own_prev -= item.push_prev.min(c.own_prev);
                } else if c.ws == item.ws + p {
                    // The window rolled while the sync was in flight.
                    c.known_prev = totals.0;
                    c.own_prev -= item.push_curr.min(c.own_prev);
                }
                c.expires(p)
            },
            rank(algorithm, server_now),
        );
        drop(shard);
        self.keep(evicted);
    }

    /// Learns the offset to Redis's clock from a reply that read it at `server_now`, sent and
    /// received at those local times.
    fn learn_clock(&self, server_now: Micros, sent: Micros, received: Micros) {
        // Redis read its clock somewhere in the round trip: take the middle.
        let local_mid = sent + (received.saturating_sub(sent)) / 2;
        self.offset
            .store(server_now as i64 - local_mid as i64, Ordering::Relaxed);
        self.offset_known.store(true, Ordering::Relaxed);
    }

    /// A sync written to Redis whose answer did not come in time (Redis stalled): Redis runs
    /// it when it catches up, so its units are taken as pushed, into the totals this instance
    /// knows, and not pushed again (that counted them twice). The key is due again next time,
    /// for the real totals. Should the call never run (Redis lost it with everything else in a
    /// crash), those units are missing from Redis: the others may admit that many more.
    pub fn pushed_unanswered(&self, algorithm: &Algorithm, item: &SyncItem, local_now: Micros) {
        let p = period(algorithm);
        self.due_again(algorithm, item, local_now, |c| {
            if matches!(algorithm, Algorithm::Gcra(_)) {
                // The TAT here already holds these units; only the push is done.
                c.own_curr -= item.push_curr.min(c.own_curr);
            } else if c.ws == item.ws {
                let (curr, prev) = (
                    item.push_curr.min(c.own_curr),
                    item.push_prev.min(c.own_prev),
                );
                c.own_curr -= curr;
                c.known_curr += curr;
                c.own_prev -= prev;
                c.known_prev += prev;
            } else if c.ws == item.ws + p {
                let curr = item.push_curr.min(c.own_prev);
                c.own_prev -= curr;
                c.known_prev += curr;
            }
        });
    }

    /// A failed sync: the key is due again next time (its units were not taken off); an
    /// evicted key's units wait in the queue again.
    pub fn retry(&self, algorithm: &Algorithm, item: &SyncItem, local_now: Micros) {
        if item.evicted {
            self.leftovers.push(item.clone(), self.leftover_cap());
            return;
        }
        self.due_again(algorithm, item, local_now, |_| {});
    }

    /// Marks a synced key (when still live) due for the next sync, after `f` on its counts.
    fn due_again(
        &self,
        algorithm: &Algorithm,
        item: &SyncItem,
        local_now: Micros,
        f: impl FnOnce(&mut Counts),
    ) {
        let now = self.redis_now(local_now);
        let p = period(algorithm);
        let hash = self.map.hash(&item.key);
        let mut shard = self.map.lock(hash);
        // A key evicted meanwhile is not held again (its default counts expire at once).
        let evicted = shard.update(
            hash,
            &item.key,
            now,
            Counts::default,
            |c, live| {
                if live {
                    c.touched = true;
                    f(c);
                }
                c.expires(p)
            },
            rank(algorithm, now),
        );
        drop(shard);
        self.keep(evicted);
    }

    /// Forgets `key`'s counts (the admin API's reset, after its Redis counters were deleted):
    /// its unpushed units are dropped with it, and the next request learns the key from Redis
    /// again. Returns whether the store held it at `local_now`.
    pub fn forget(&self, key: &[u8], local_now: Micros) -> bool {
        self.map.forget(key, self.redis_now(local_now))
    }

    /// Drops every key that no decision reads any more (its windows past and, for gcra, its TAT
    /// reached); returns the number kept.
    pub fn sweep(&self, local_now: Micros) -> usize {
        self.map.sweep(self.redis_now(local_now))
    }

    /// Keys held, those no decision reads any more but not yet swept included.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Caps the store at `keys` keys (its share of `server.max_keys`), evicting at once the
    /// keys closest to full when it holds more (see the module doc); their unpushed units wait
    /// for the next sync.
    pub fn set_budget(&self, keys: usize, algorithm: &Algorithm, local_now: Micros) {
        let now = self.redis_now(local_now);
        let cap = Self::leftover_cap_of(keys);
        self.map.set_budget(keys, now, rank(algorithm, now), |e| {
            self.leftovers.keep(e, cap)
        });
    }

    /// The budget last set (`usize::MAX`: none).
    pub fn budget(&self) -> usize {
        self.map.budget()
    }

    /// Keys evicted to keep within the budget since the last call.
    pub fn take_evicted(&self) -> u64 {
        self.map.take_evicted()
    }

    /// Units admitted here that no sync will push, since the last call: their key was evicted
    /// while the queue of evicted keys' units was full.
    pub fn take_lost(&self) -> u64 {
        self.leftovers.lost.swap(0, Ordering::Relaxed)
    }

    /// How many evicted keys' units may wait for the next sync: an eighth of the budget, and
    /// at least [`LEFTOVERS_MIN`].
    pub fn leftover_cap(&self) -> usize {
        Self::leftover_cap_of(self.budget())
    }

    fn leftover_cap_of(budget: usize) -> usize {
        (budget / 8).max(LEFTOVERS_MIN)
    }

    /// An evicted key's unpushed units, into the queue for the next sync.
    fn keep(&self, evicted: Option<Evicted<Counts>>) {
        if let Some(e) = evicted {
            self.leftovers.keep(e, self.leftover_cap());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algorithm::{FixedWindow, Gcra, Quota};

    fn ten_per_second() -> Algorithm {
        Algorithm::FixedWindow(FixedWindow::new(Quota {
            count: 10,
            period: 1_000_000,
            burst: 10,
        }))
    }

    #[test]
    fn one_request_learns_a_new_key_and_the_others_follow() {
        let alg = ten_per_second();
        let ev = EventualStore::default();
        let now = 5_000_000;
        // Redis's clock as a first sync reply sets it: 0.2 s into a window, so the steps below
        // (up to 0.1 s) stay in one window whatever the wall clock says.
        ev.apply(
            &alg,
            &SyncItem::pull(b"clock", 0),
            (0, 0),
            7_000_200_000,
            now,
            now,
        );
        assert_eq!(ev.redis_now(now), 7_000_200_000);
        assert!(!ev.knows(b"k", now, 100_000));
        let lead = ev.begin_learn(&alg, b"k", now, 50_000, 100_000);
        assert!(matches!(lead, Learn::Lead(_)));
        assert!(matches!(
            ev.begin_learn(&alg, b"k", now, 50_000, 100_000),
            Learn::Follow
        ));
        assert!(
            !ev.knows(b"k", now, 100_000),
            "not decided on while being learned"
        );
        // Learned: the totals are what the instance decides with.
        let item = SyncItem::pull(b"k", ev.window(&alg, now));
        let server_now = ev.redis_now(now);
        ev.apply(&alg, &item, (7, 0), server_now, now, now);
        drop(lead);
        assert!(ev.knows(b"k", now, 100_000));
        assert!(matches!(
            ev.begin_learn(&alg, b"k", now, 50_000, 100_000),
            Learn::Known
        ));
        assert_eq!(ev.peek(&alg, b"k", now).remaining, 3);
        // Not synced for longer than `fresh_for` (idle here): learned again, its counts kept
        // meanwhile, and the new totals are what it then decides with.
        assert!(ev.knows(b"k", now + 100_000, 100_000));
        let later = now + 100_001;
        assert!(!ev.knows(b"k", later, 100_000));
        let lead = ev.begin_learn(&alg, b"k", later, 50_000, 100_000);
        assert!(matches!(lead, Learn::Lead(_)));
        assert_eq!(ev.peek(&alg, b"k", later).remaining, 3);
        let item = SyncItem::pull(b"k", ev.window(&alg, later));
        ev.apply(&alg, &item, (9, 0), ev.redis_now(later), later, later);
        drop(lead);
        assert!(ev.knows(b"k", later, 100_000));
        assert_eq!(ev.peek(&alg, b"k", later).remaining, 1);
        // A lead dropped without an answer (Redis down) leaves the key decided on own counts;
        // it is tried again only once `fresh_for` has passed (one attempt per interval in an
        // outage, not one per request).
        let lead = ev.begin_learn(&alg, b"j", now, 50_000, 100_000);
        drop(lead);
        assert!(ev.knows(b"j", now + 100_000, 100_000));
        assert!(!ev.knows(b"j", now + 100_001, 100_000));
        assert_eq!(ev.peek(&alg, b"j", now).remaining, 10);
        // A lead that outlived its wait ends only itself, not the lead that took over.
        let stale = ev.begin_learn(&alg, b"m", now, 50_000, 100_000);
        let later = now + 60_000;
        let current = ev.begin_learn(&alg, b"m", later, 50_000, 100_000);
        assert!(matches!(current, Learn::Lead(_)));
        drop(stale);
        assert!(matches!(
            ev.begin_learn(&alg, b"m", later, 50_000, 100_000),
            Learn::Follow
        ));
        drop(current);
        assert!(ev.knows(b"m", later, 100_000));
    }

    /// A key learned again after more than a window of idleness: its counts move to the
    /// window the pull read.
    #[test]
    fn a_key_learned_again_in_a_later_window_takes_that_windows_totals() {
        let alg = ten_per_second();
        let ev = EventualStore::default();
        let now = 5_000_000;
        let lead = ev.begin_learn(&alg, b"k", now, 50_000, 100_000);
        ev.apply(
            &alg,
            &SyncItem::pull(b"k", ev.window(&alg, now)),
            (7, 0),
            ev.redis_now(now),
            now,
            now,
        );
        drop(lead);
        let next = now + 1_000_000;
        let lead = ev.begin_learn(&alg, b"k", next, 50_000, 100_000);
        assert!(matches!(lead, Learn::Lead(_)));
        ev.apply(
            &alg,
            &SyncItem::pull(b"k", ev.window(&alg, next)),
            (4, 7),
            ev.redis_now(next),
            next,
            next,
        );
        drop(lead);
        assert_eq!(ev.peek(&alg, b"k", next).remaining, 6);
    }

    /// gcra: units admitted while a sync is in flight stay on top of the TAT Redis returns, and
    /// a sync never moves the TAT back.
    #[test]
    fn a_gcra_sync_keeps_the_units_admitted_meanwhile() {
        let g = Gcra::new(Quota {
            count: 10,
            period: 1_000_000,
            burst: 10,
        });
        let t = g.emission_interval();
        let alg = Algorithm::Gcra(g);
        let ev = EventualStore::default();
        let now = 5_000_000;
        let server = ev.redis_now(now);
        for _ in 0..3 {
            ev.commit(&alg, b"k", now, 1);
        }
        assert_eq!(ev.peek(&alg, b"k", now).remaining, 7);
        let items = ev.due(now);
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].push_curr, 3);
        // One more while the push is in flight; Redis adds another instance's 2 units too.
        ev.commit(&alg, b"k", now, 1);
        let redis_tat = server + 5 * t;
        ev.apply(&alg, &items[0], (redis_tat, 0), server, now, now);
        assert_eq!(ev.peek(&alg, b"k", now).remaining, 4, "5 in Redis + 1 here");
        assert!(
            ev.due(now).iter().all(|i| i.push_curr == 1),
            "the 1 is pushed next"
        );
        // A TAT behind this instance's own (Redis lost the key) does not give budget back.
        let items = ev.due(now);
        ev.apply(&alg, &items[0], (0, 0), server, now, now);
        assert_eq!(ev.peek(&alg, b"k", now).remaining, 4);
    }

    /// Evicting a key with units not pushed yet loses none: they wait for the next sync (push
    /// only), and once the queue of them is full, what no sync will push is counted. Every
    /// unit admitted is accounted for, one way or the other.
    #[test]
    fn an_evicted_keys_unpushed_units_are_pushed_or_counted() {
        let alg = Algorithm::FixedWindow(FixedWindow::new(Quota {
            count: 10,
            period: 3_600_000_000,
            burst: 10,
        }));
        let ev = EventualStore::default();
        let now = 5_000_000;
        // One key per shard.
        ev.set_budget(64, &alg, now);
        let flood = 3_000u64;
        for i in 0..flood {
            ev.commit(&alg, format!("k{i}").as_bytes(), now, 1);
            assert!(ev.len() <= 64);
        }
        let items = ev.due(now);
        let evicted: Vec<_> = items.iter().filter(|i| i.evicted).collect();
        assert_eq!(evicted.len(), ev.leftover_cap(), "the queue filled up");
        let pushed: u64 = items.iter().map(|i| i.push_curr + i.push_prev).sum();
        assert_eq!(pushed + ev.take_lost(), flood);
        assert_eq!(ev.take_evicted(), flood - ev.len() as u64);
        // Pushed, an evicted key is not held again.
        let server = ev.redis_now(now);
        for item in &items {
            ev.apply(&alg, item, (1, 0), server, now, now);
        }
        assert!(ev.len() <= 64);
        assert!(
            ev.due(now).iter().all(|i| !i.evicted),
            "the queue was taken"
        );
    }

    /// A full shard evicts keys with nothing to push (and no pull in flight) before any key
    /// with units to push, and within each kind the key with the most units left first.
    #[test]
    fn synced_keys_rank_before_keys_with_units_to_push() {
        let alg = ten_per_second();
        let now = 5_000_000;
        let r = rank(&alg, now);
        let synced = |count| Counts {
            ws: now - now % 1_000_000,
            known_curr: count,
            ..Counts::default()
        };
        let unpushed = |count| Counts {
            own_curr: count,
            ..synced(0)
        };
        let learning = Counts {
            lead: 7,
            ..synced(0)
        };
        // Synced and nearly empty still goes before unpushed and nearly full.
        assert!(r(&synced(9)) > r(&unpushed(1)));
        assert!(r(&synced(9)) > r(&learning));
        assert!(
            r(&synced(1)) > r(&synced(9)),
            "more units left: closer to full"
        );
        assert!(r(&unpushed(1)) > r(&unpushed(9)));
        // Counts of a past window are full again whatever they held.
        let old = Counts {
            ws: now - now % 1_000_000 - 2_000_000,
            known_curr: 10,
            ..Counts::default()
        };
        assert_eq!(r(&old), r(&synced(0)));
    }

    /// Two threads deciding on one key at once never admit more than the bucket holds.
    #[test]
    fn simultaneous_decisions_on_one_key_never_share_units() {
        let alg = Algorithm::Gcra(Gcra::new(Quota {
            count: 10,
            period: 86_400_000_000,
            burst: 10,
        }));
        let ev = EventualStore::default();
        let admitted = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..2_000 {
                        if ev.decide(&alg, b"k", 5_000_000, 1).is_ok() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.into_inner(), 10);
        assert_eq!(ev.due(5_000_000)[0].push_curr, 10);
    }
}
