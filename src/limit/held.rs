//! What an admitted request holds until its exchange ends: its concurrency slots, each given
//! back exactly once whichever way the exchange ends, and its settlements (`settle:`), each
//! applied once the response head or trailers say what the request really cost.
//!
//! [`LimitSet::evaluate_held`](super::LimitSet::evaluate_held) returns a [`Held`] beside the
//! verdict; the codec keeps it for as long as the exchange lasts (hyper: inside the exchange's
//! end guard, in the response body; the fast codec: on the exchange's stack; an upgraded
//! connection: in its tunnel's task). Dropping it gives the slots back: a local slot under its
//! shard lock at once, a lease in Redis by one script call in the background, so the release
//! never holds up the response.
//!
//! A lease lives `lease` in Redis (on Redis's clock) unless renewed: the [`LeaseBook`] of the
//! gateway's Redis store lists the leases this instance holds and renews each halfway through
//! its life, in a background task, so a request may outlive its lease, and only a dead
//! instance's slots wait for theirs to run out.
//!
//! A settlement is applied when the response's status gives the charge back (`refund_status`),
//! when its head carries the cost header, or when its trailers do; whichever comes first. Local
//! ones under their shard lock at once, global ones by one script call in the background (none
//! when the true cost equals the estimate), so settling never holds up the response. An
//! exchange that ends with none of these (no such header or trailer, or a value that is not a
//! whole number) keeps the estimate, and is counted (`tollgate_settle_missing_total`).

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::algorithm::{Algorithm, Micros, Settlement};
use super::clock::SharedClock;
use super::local::LocalStore;
use super::redis::{GlobalLimit, MAX_PARAM, RedisError, RedisStore};
use crate::config::SettleConfig;
use crate::metrics::{RedisErrors, SettleMetrics, SlotMetrics};

/// How often the book looks for leases due for renewal. A lease is at least a second (config),
/// renewed when half of it is left: a tick of 100 ms renews it with nearly half its life to spare.
const RENEW_TICK: Duration = Duration::from_millis(100);

/// What an admitted request holds until its exchange ends. Empty for most requests (no
/// concurrency limit, no settlement): then one null word, carried and dropped for nothing,
/// which keeps the futures and answers of the request path as small as they were. What a
/// request does hold is boxed, and the box is kept for the next request of the thread rather
/// than freed (the `spare` module): a malloc and its free cost more than the slot's own work
/// (bench/instructions.sh, docs/benchmarks.md).
#[derive(Default)]
pub struct Held(Option<Box<Holding>>);

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            spare::put(h);
        }
    }
}

/// Emptied [`Holding`] boxes kept per thread for the next requests that hold something: up to
/// [`spare::KEPT`], as many as a thread's requests overlap in time (each takes one at admission
/// and puts it back when its exchange ends), beyond which a box is freed.
mod spare {
    use std::cell::RefCell;

    use super::Holding;

    /// Boxes kept per thread (each a few hundred bytes).
    pub(super) const KEPT: usize = 64;

    thread_local! {
        // Boxes, not the values: what `take` hands out is a box, allocated once.
        #[allow(clippy::vec_box, reason = "the boxes are what is reused")]
        static SPARE: RefCell<Vec<Box<Holding>>> = const { RefCell::new(Vec::new()) };
    }

    /// A box holding nothing: one of the thread's spares, or a new one.
    #[inline]
    pub(super) fn take() -> Box<Holding> {
        SPARE
            .try_with(|s| s.try_borrow_mut().ok()?.pop())
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Empties `h` (giving back what it holds) and keeps it among the thread's spares.
    #[inline]
    pub(super) fn put(mut h: Box<Holding>) {
        h.clear();
        let _ = SPARE.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut()
                && s.len() < KEPT
            {
                s.push(h);
            }
        });
    }
}

#[derive(Default)]
struct Holding {
    slots: SmallVec<[Slot; 1]>,
    settles: Vec<Settle>,
    /// The clock local settlements are applied on (the one their decision read).
    clock: Option<SharedClock>,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("slots", &self.slots())
            .field("settles", &self.0.as_ref().map_or(0, |h| h.settles.len()))
            .finish()
    }
}

impl Held {
    /// Whether nothing is held.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// Whether settlements wait for the response.
    #[inline]
    pub fn settles(&self) -> bool {
        self.0.as_ref().is_some_and(|h| !h.settles.is_empty())
    }

    /// Concurrency slots held.
    pub fn slots(&self) -> usize {
        self.0.as_ref().map_or(0, |h| h.slots.len())
    }

    #[inline]
    fn more_mut(&mut self) -> Option<&mut Holding> {
        self.0.as_deref_mut()
    }

    /// The box, taken from the thread's spare when first needed.
    fn holding(&mut self) -> &mut Holding {
        self.0.get_or_insert_with(spare::take)
    }

    /// The clock local settlements are applied on: the gateway's, which decided them.
    pub fn set_clock(&mut self, clock: SharedClock) {
        if let Some(h) = self.more_mut() {
            h.clock = Some(clock);
        }
    }

    /// The response head went out with `status` and `headers`: the settlements its status
    /// gives back, or its cost header prices, are applied now; the others wait for trailers.
    pub fn response_head(&mut self, status: u16, headers: &http::HeaderMap) {
        let Some(h) = self.more_mut() else { return };
        let now = h.now();
        h.settles.retain(|s| {
            if s.config.refunds(status) {
                s.apply(0, now);
                return false;
            }
            !s.from(headers, now)
        });
    }

    /// The response's trailers: the settlements still waiting read their cost there.
    pub fn trailers(&mut self, trailers: &http::HeaderMap) {
        let Some(h) = self.more_mut() else { return };
        let now = h.now();
        h.settles.retain(|s| !s.from(trailers, now));
    }

    /// The exchange ended: settlements that never learned their cost keep the estimate (and
    /// are counted), and the slots are given back.
    pub fn end(&mut self) {
        if let Some(h) = self.0.take() {
            for s in &h.settles {
                s.metrics.missing.inc();
            }
            spare::put(h);
        }
    }

    /// Gives every slot back now (what dropping does); pending settlements are dropped
    /// uncounted (the request was not forwarded).
    pub fn release(&mut self) {
        if let Some(h) = self.0.take() {
            spare::put(h);
        }
    }

    /// A settlement of a request charged `estimate` at `at` in a local store, for `key`
    /// decided under `algorithm`, the admission leaving the key full again at `full_at` (`at`
    /// plus its snapshot's `reset_after`).
    pub(super) fn settle_local(
        &mut self,
        config: &Arc<SettleConfig>,
        metrics: Option<&SettleMetrics>,
        store: &Arc<LocalStore>,
        algorithm: &Algorithm,
        key: &[u8],
        (estimate, at, full_at): (u64, Micros, Micros),
    ) {
        let Some(metrics) = metrics else { return };
        self.holding().settles.push(Settle {
            config: Arc::clone(config),
            metrics: metrics.clone(),
            estimate,
            at,
            full_at,
            target: Target::Local {
                store: Arc::clone(store),
                algorithm: algorithm.clone(),
                key: SmallVec::from_slice(key),
            },
        });
    }

    /// A settlement of a request charged `estimate` at `at` (Redis time) on `key` (the limit's
    /// base key) in the store of `book`, the admission leaving the key full again at `full_at`
    /// (Redis time: `at` plus its snapshot's `reset_after`).
    pub(super) fn settle_global(
        &mut self,
        config: &Arc<SettleConfig>,
        metrics: Option<&SettleMetrics>,
        book: &Arc<LeaseBook>,
        algorithm: &Algorithm,
        key: String,
        (estimate, at, full_at): (u64, Micros, Micros),
    ) {
        let Some(metrics) = metrics else { return };
        self.holding().settles.push(Settle {
            config: Arc::clone(config),
            metrics: metrics.clone(),
            estimate,
            at,
            full_at,
            target: Target::Global {
                book: Arc::clone(book),
                algorithm: algorithm.clone(),
                key,
            },
        });
    }

    /// A slot taken in `store` for `key` (a local limit, or a global one decided by its
    /// fallback while Redis could not answer).
    pub(super) fn local(
        &mut self,
        store: &Arc<LocalStore>,
        key: &[u8],
        metrics: Option<&SlotMetrics>,
    ) {
        let in_flight = metrics.map(|m| {
            m.in_flight.inc();
            m.in_flight.clone()
        });
        let slot = LocalSlot {
            store: Arc::clone(store),
            key: SmallVec::from_slice(key),
            in_flight,
        };
        self.holding().slots.push(Slot::Local(slot));
    }

    /// A lease Redis granted.
    pub(super) fn lease(&mut self, lease: Lease) {
        self.holding().slots.push(Slot::Lease(lease));
    }
}

impl Holding {
    fn now(&self) -> Micros {
        self.clock.as_ref().map_or(0, |c| c.now())
    }

    /// Gives back everything held (slots released, settlements dropped uncounted).
    fn clear(&mut self) {
        self.slots.clear();
        self.settles.clear();
        self.clock = None;
    }
}

/// One limit's settlement, waiting for the response to say what the request cost.
struct Settle {
    config: Arc<SettleConfig>,
    metrics: SettleMetrics,
    /// What the decision charged.
    estimate: u64,
    /// When (the deciding store's clock).
    at: Micros,
    /// When the admission left the key full again (the same clock): see
    /// [`Settlement::full_at`].
    full_at: Micros,
    target: Target,
}

enum Target {
    Local {
        store: Arc<LocalStore>,
        algorithm: Algorithm,
        key: SmallVec<[u8; 32]>,
    },
    Global {
        book: Arc<LeaseBook>,
        algorithm: Algorithm,
        key: String,
    },
}

impl Settle {
    /// Applies the cost `fields` carry in the cost header, if they carry it: whether this
    /// settlement is done (a value that is not a whole number is counted, and the estimate
    /// kept).
    fn from(&self, fields: &http::HeaderMap, now: Micros) -> bool {
        let Some(name) = &self.config.cost_header else {
            return false;
        };
        let Some(value) = fields.get(name) else {
            return false;
        };
        match std::str::from_utf8(value.as_bytes())
            .ok()
            .map(str::trim)
            // Digits only: `u64`'s parser also takes a leading `+`, which the docs call
            // unparsable (as any sign is).
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok())
        {
            Some(cost) => self.apply(cost, now),
            None => {
                self.metrics.missing.inc();
            }
        }
        true
    }

    /// The request really cost `cost`: the difference from the estimate, charged or given back.
    fn apply(&self, cost: u64, now: Micros) {
        let delta = cost.min(MAX_PARAM) as i64 - self.estimate.min(MAX_PARAM) as i64;
        if delta == 0 {
            return;
        }
        let settlement = Settlement {
            at: self.at,
            estimate: self.estimate,
            full_at: self.full_at,
            delta,
        };
        match &self.target {
            Target::Local {
                store,
                algorithm,
                key,
            } => {
                store.settle(algorithm, key, settlement, now);
                self.metrics.count(delta);
            }
            Target::Global {
                book,
                algorithm,
                key,
            } => {
                let Ok(rt) = tokio::runtime::Handle::try_current() else {
                    return;
                };
                let call = book
                    .store
                    .settle(key.clone(), algorithm.clone(), settlement);
                let metrics = self.metrics.clone();
                let errors = book.errors.clone();
                rt.spawn(async move {
                    match call.await {
                        Ok(_) => metrics.count(delta),
                        Err(e) => {
                            if let Some(errors) = errors {
                                errors.count(e.kind());
                            }
                            tracing::debug!(error = %e, "a settlement failed; the estimate stays charged");
                        }
                    }
                });
            }
        }
    }
}

/// A slot, given back by its own `Drop`: nothing reads it.
#[allow(dead_code, reason = "held for its Drop, which gives the slot back")]
enum Slot {
    Local(LocalSlot),
    Lease(Lease),
}

/// A slot of a local store, given back when dropped.
struct LocalSlot {
    store: Arc<LocalStore>,
    /// An IP address's text, or a short id, stays inline.
    key: SmallVec<[u8; 24]>,
    in_flight: Option<prometheus_client::metrics::gauge::Gauge>,
}

impl Drop for LocalSlot {
    fn drop(&mut self) {
        self.store.release(&self.key, 1);
        if let Some(g) = &self.in_flight {
            g.dec();
        }
    }
}

/// What the store does after a response: leases renewed and given back, costs settled. Redis
/// in the gateway. Object-safe, so what a request holds does not carry the store's type.
pub trait AfterStore: Send + Sync + 'static {
    /// Gives back `(lease set, lease id)` leases; per lease, whether it was still held.
    fn release(
        &self,
        leases: Vec<(String, u64)>,
    ) -> BoxFuture<'static, Result<Vec<bool>, RedisError>>;

    /// Renews `(lease set, lease id, lease length)` leases; per lease, whether it was renewed.
    fn renew(
        &self,
        leases: Vec<(String, u64, Micros)>,
    ) -> BoxFuture<'static, Result<Vec<bool>, RedisError>>;

    /// Applies `settlement` to `key` (a limit's base key) decided under `algorithm`.
    fn settle(
        &self,
        key: String,
        algorithm: Algorithm,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<bool, RedisError>>;
}

impl AfterStore for RedisStore {
    fn release(
        &self,
        leases: Vec<(String, u64)>,
    ) -> BoxFuture<'static, Result<Vec<bool>, RedisError>> {
        let store = self.clone();
        Box::pin(async move { store.release_leases(&leases).await })
    }

    fn renew(
        &self,
        leases: Vec<(String, u64, Micros)>,
    ) -> BoxFuture<'static, Result<Vec<bool>, RedisError>> {
        let store = self.clone();
        Box::pin(async move { store.renew_leases(&leases).await })
    }

    fn settle(
        &self,
        key: String,
        algorithm: Algorithm,
        s: Settlement,
    ) -> BoxFuture<'static, Result<bool, RedisError>> {
        let store = self.clone();
        Box::pin(async move {
            let limit = GlobalLimit {
                algorithm: &algorithm,
                key: &key,
                cost: s.estimate,
                max_delay: 0,
            };
            store.settle(&limit, s, None).await
        })
    }
}

/// The leases this instance holds in one store, renewed while their requests run; and the
/// store that settlements go to.
pub struct LeaseBook {
    store: Arc<dyn AfterStore>,
    live: Mutex<HashMap<u64, Entry>>,
    /// Lease ids: a per-book random seed hashing a counter, so two instances' ids for one key
    /// do not meet (and a restarted instance does not reuse its predecessor's).
    seed: foldhash::fast::RandomState,
    next: AtomicU64,
    errors: Option<RedisErrors>,
    /// Leases whose release failed (Redis unreachable as the request ended): given back at the
    /// next tick, until the instant they would have run out by themselves. Without this a
    /// live instance's slot would wait out its lease after a short Redis outage.
    unreleased: Mutex<Vec<(String, u64, Instant)>>,
}

impl std::fmt::Debug for LeaseBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseBook")
            .field("live", &self.live.lock().len())
            .finish()
    }
}

struct Entry {
    key: String,
    lease: Micros,
    renew_at: Instant,
    metrics: Option<SlotMetrics>,
    wake: Option<Wake>,
}

/// The line of requests waiting for a slot of a lease's key in this instance (a queueing
/// limit's, `on_limit: delay`): woken once Redis has the lease back, so its first waiter asks
/// when the slot is free there.
pub(super) struct Wake {
    /// The limit's store, whose `queue` holds the line.
    pub(super) store: Arc<LocalStore>,
    /// The key's hash there.
    pub(super) hash: u64,
}

impl Wake {
    fn wake(&self) {
        self.store.queue.wake(self.hash);
    }
}

/// Lease ids stay below 2^50, where Lua's doubles hold them exactly.
const ID_MASK: u64 = (1 << 50) - 1;

impl LeaseBook {
    /// A book over `store`; `errors` counts the failures of its calls. Its renewals start with
    /// [`LeaseBook::start_renewing`].
    pub fn new(store: Arc<dyn AfterStore>, errors: Option<RedisErrors>) -> Arc<Self> {
        Arc::new(Self {
            store,
            live: Mutex::new(HashMap::new()),
            seed: foldhash::fast::RandomState::default(),
            next: AtomicU64::new(0),
            errors,
            unreleased: Mutex::new(Vec::new()),
        })
    }

    /// Renews due leases every [`RENEW_TICK`] on the current runtime, until the book is dropped.
    pub fn start_renewing(self: &Arc<Self>) {
        let book = Arc::downgrade(self);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(renew_loop(book));
        }
    }

    /// Leases held now.
    pub fn len(&self) -> usize {
        self.live.lock().len()
    }

    /// Whether no lease is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A lease about to be asked for on `key` (the limit's lease set), `lease` µs long; `wake`:
    /// the line woken when it is given back.
    pub(super) fn pending(
        self: &Arc<Self>,
        key: String,
        lease: Micros,
        metrics: Option<&SlotMetrics>,
        wake: Option<Wake>,
    ) -> PendingLease {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // Never 0: the scripts read 0 as "no lease".
        let id = (self.seed.hash_one(n) & ID_MASK).max(1);
        PendingLease {
            id,
            key,
            lease,
            book: Arc::clone(self),
            metrics: metrics.cloned(),
            wake,
            settled: false,
        }
    }

    /// Forgets lease `id` and gives it back in Redis, in the background.
    fn release(self: &Arc<Self>, id: u64) {
        let Some(entry) = self.live.lock().remove(&id) else {
            // Renewal found it gone already (counted then): nothing to give back.
            return;
        };
        if let Some(m) = &entry.metrics {
            m.in_flight.dec();
        }
        self.send_release(entry.key, id, entry.lease, entry.metrics, entry.wake);
    }

    fn send_release(
        self: &Arc<Self>,
        key: String,
        id: u64,
        lease: Micros,
        metrics: Option<SlotMetrics>,
        wake: Option<Wake>,
    ) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime (a test deciding outside one): the lease runs out by itself.
            return;
        };
        let call = self.store.release(vec![(key.clone(), id)]);
        let errors = self.errors.clone();
        let book = Arc::downgrade(self);
        // At the latest it runs out a whole lease from now (renewed at most this long ago).
        let until = Instant::now() + Duration::from_micros(lease);
        rt.spawn(async move {
            let released = call.await;
            // Given back (or not, and then it runs out): the first waiter asks either way.
            if let Some(w) = wake {
                w.wake();
            }
            match released {
                Ok(held) => {
                    if held.first() == Some(&false)
                        && let Some(m) = metrics
                    {
                        m.expiries.inc();
                    }
                }
                Err(e) => {
                    if let Some(errors) = errors {
                        errors.count(e.kind());
                    }
                    tracing::debug!(error = %e, "releasing a concurrency lease failed; trying again");
                    if let Some(book) = book.upgrade() {
                        book.unreleased.lock().push((key, id, until));
                    }
                }
            }
        });
    }

    /// Gives back, in one call, the leases whose release failed and that have not run out by
    /// now; kept for the next tick if this call fails too.
    pub async fn release_failed(&self, now: Instant) {
        let leases: Vec<(String, u64, Instant)> = {
            let mut list = self.unreleased.lock();
            list.retain(|(.., until)| *until > now);
            std::mem::take(&mut *list)
        };
        if leases.is_empty() {
            return;
        }
        let ask = leases.iter().map(|(k, id, _)| (k.clone(), *id)).collect();
        if let Err(e) = self.store.release(ask).await {
            if let Some(errors) = &self.errors {
                errors.count(e.kind());
            }
            self.unreleased.lock().extend(leases);
        }
    }

    /// Renews every lease due at `now` in one pass: one store call (per hash slot). A lease
    /// found run out is counted and forgotten; one the call failed for is tried again at the
    /// next tick.
    pub async fn renew_due(&self, now: Instant) {
        let due: Vec<(u64, String, Micros)> = self
            .live
            .lock()
            .iter()
            .filter(|(_, e)| e.renew_at <= now)
            .map(|(id, e)| (*id, e.key.clone(), e.lease))
            .collect();
        if due.is_empty() {
            return;
        }
        let ask = due.iter().map(|(id, k, l)| (k.clone(), *id, *l)).collect();
        match self.store.renew(ask).await {
            Ok(renewed) => {
                let mut live = self.live.lock();
                for ((id, ..), ok) in due.iter().zip(renewed) {
                    let Some(e) = live.get_mut(id) else { continue };
                    if ok {
                        e.renew_at = now + half(e.lease);
                        if let Some(m) = &e.metrics {
                            m.renewals.inc();
                        }
                    } else if let Some(e) = live.remove(id)
                        && let Some(m) = e.metrics
                    {
                        // Run out before its renewal (Redis unreachable for half a lease, or the
                        // key reset): the slot is free, and this request no longer holds one.
                        m.expiries.inc();
                        m.in_flight.dec();
                    }
                }
            }
            Err(e) => {
                if let Some(errors) = &self.errors {
                    errors.count(e.kind());
                }
                tracing::debug!(error = %e, leases = due.len(), "renewing concurrency leases failed; trying again");
            }
        }
    }
}

/// Half a lease: when it is renewed.
fn half(lease: Micros) -> Duration {
    Duration::from_micros(lease / 2)
}

async fn renew_loop(book: Weak<LeaseBook>) {
    let mut tick = tokio::time::interval(RENEW_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let Some(book) = book.upgrade() else { return };
        let now = Instant::now();
        book.release_failed(now).await;
        book.renew_due(now).await;
    }
}

/// A lease asked for in a decision whose answer is not in yet. Confirmed, it becomes a
/// [`Lease`]; discarded, nothing was taken. Dropped undecided (the call failed or was given up
/// mid-flight, so Redis may have granted it or may yet), it is given back to be sure.
pub(super) struct PendingLease {
    id: u64,
    key: String,
    lease: Micros,
    book: Arc<LeaseBook>,
    metrics: Option<SlotMetrics>,
    wake: Option<Wake>,
    settled: bool,
}

impl PendingLease {
    /// The id the decision asks for it under.
    pub(super) fn id(&self) -> u64 {
        self.id
    }

    /// Redis granted it: held from now on (and renewed) until the returned lease drops.
    pub(super) fn confirm(mut self) -> Lease {
        self.settled = true;
        if let Some(m) = &self.metrics {
            m.in_flight.inc();
        }
        self.book.live.lock().insert(
            self.id,
            Entry {
                key: std::mem::take(&mut self.key),
                lease: self.lease,
                renew_at: Instant::now() + half(self.lease),
                metrics: self.metrics.take(),
                wake: self.wake.take(),
            },
        );
        Lease {
            id: self.id,
            book: Arc::clone(&self.book),
        }
    }

    /// Not granted (the request was rejected, or Redis never got the call): nothing to give back.
    pub(super) fn discard(mut self) {
        self.settled = true;
    }
}

impl Drop for PendingLease {
    fn drop(&mut self) {
        if !self.settled {
            self.book.send_release(
                std::mem::take(&mut self.key),
                self.id,
                self.lease,
                None,
                self.wake.take(),
            );
        }
    }
}

/// A lease held in Redis, renewed by its book, given back when dropped.
pub(super) struct Lease {
    id: u64,
    book: Arc<LeaseBook>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.book.release(self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    /// A store whose releases fail while `down`, and records the leases it gave back.
    #[derive(Default)]
    struct Flaky {
        down: AtomicBool,
        released: Mutex<Vec<(String, u64)>>,
    }

    impl AfterStore for Arc<Flaky> {
        fn release(
            &self,
            leases: Vec<(String, u64)>,
        ) -> BoxFuture<'static, Result<Vec<bool>, RedisError>> {
            let result = if self.down.load(Ordering::SeqCst) {
                Err(RedisError::Connection("refused".into()))
            } else {
                let n = leases.len();
                self.released.lock().extend(leases);
                Ok(vec![true; n])
            };
            Box::pin(async move { result })
        }

        fn renew(
            &self,
            leases: Vec<(String, u64, Micros)>,
        ) -> BoxFuture<'static, Result<Vec<bool>, RedisError>> {
            let n = leases.len();
            Box::pin(async move { Ok(vec![true; n]) })
        }

        fn settle(
            &self,
            _: String,
            _: Algorithm,
            _: Settlement,
        ) -> BoxFuture<'static, Result<bool, RedisError>> {
            Box::pin(async { Ok(true) })
        }
    }

    /// A release that fails (Redis unreachable as the request ends) is given back at a later
    /// tick, once Redis answers, so a live instance's slot does not wait out its lease; one
    /// whose lease has run out by then is dropped (Redis has freed it already).
    #[tokio::test]
    async fn a_failed_release_is_given_back_once_redis_answers() {
        let flaky = Arc::new(Flaky::default());
        let book = LeaseBook::new(Arc::new(Arc::clone(&flaky)), None);
        flaky.down.store(true, Ordering::SeqCst);
        let lease = book
            .pending("tg:{r/l/k}:slots".into(), 60_000_000, None, None)
            .confirm();
        let short = book
            .pending("tg:{r/l/j}:slots".into(), 1_000, None, None)
            .confirm();
        drop(lease);
        drop(short);
        // The spawned releases fail.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(flaky.released.lock().is_empty());
        assert_eq!(book.unreleased.lock().len(), 2);
        // Still down at the next tick: kept.
        book.release_failed(Instant::now()).await;
        assert_eq!(book.unreleased.lock().len(), 2);
        // Redis answers again; the 1 ms lease has run out meanwhile and is not asked for.
        flaky.down.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(5)).await;
        book.release_failed(Instant::now()).await;
        let released = flaky.released.lock().clone();
        assert_eq!(released.len(), 1);
        assert_eq!(released[0].0, "tg:{r/l/k}:slots");
        assert!(book.unreleased.lock().is_empty());
    }
}
