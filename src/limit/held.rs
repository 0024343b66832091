//! What an admitted request holds until its exchange ends: its concurrency slots, each given
//! back exactly once, whichever way the exchange ends.
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

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::algorithm::{Algorithm, Concurrency, Micros};
use super::local::LocalStore;
use super::redis::{RedisError, RedisStore};
use crate::metrics::{RedisErrors, SlotMetrics};

/// How often the book looks for leases due for renewal. A lease is at least a second (config),
/// renewed when half of it is left: a tick of 100 ms renews it with nearly half its life to spare.
const RENEW_TICK: Duration = Duration::from_millis(100);

/// What an admitted request holds until its exchange ends. Empty for most requests (no
/// concurrency limit), and then free to carry around.
#[derive(Default)]
pub struct Held {
    slots: SmallVec<[Slot; 1]>,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl Held {
    /// Whether nothing is held.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Concurrency slots held.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// A slot taken in `store` for `key` at `now` (a local limit, or a global one decided by its
    /// fallback while Redis could not answer).
    pub(super) fn local(
        &mut self,
        store: &Arc<LocalStore>,
        slots: &Concurrency,
        key: &[u8],
        now: Micros,
        metrics: Option<&SlotMetrics>,
    ) {
        let in_flight = metrics.map(|m| {
            m.in_flight.inc();
            m.in_flight.clone()
        });
        self.slots.push(Slot::Local(LocalSlot {
            store: Arc::clone(store),
            slots: slots.clone(),
            key: SmallVec::from_slice(key),
            now,
            in_flight,
        }));
    }

    /// A lease Redis granted.
    pub(super) fn lease(&mut self, lease: Lease) {
        self.slots.push(Slot::Lease(lease));
    }

    /// Gives every slot back now (what dropping does).
    pub fn release(&mut self) {
        self.slots.clear();
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
    slots: Concurrency,
    key: SmallVec<[u8; 32]>,
    /// When it was taken: time enough for the release (slots do not expire).
    now: Micros,
    in_flight: Option<prometheus_client::metrics::gauge::Gauge>,
}

impl Drop for LocalSlot {
    fn drop(&mut self) {
        let alg = Algorithm::Concurrency(self.slots.clone());
        self.store.release(&alg, &self.key, 1, self.now);
        if let Some(g) = &self.in_flight {
            g.dec();
        }
    }
}

/// Where leases are taken, renewed and given back: Redis in the gateway, a fake in tests.
/// Object-safe, so a held lease does not carry the store's type.
pub trait LeaseStore: Send + Sync + 'static {
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
}

impl LeaseStore for RedisStore {
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
}

/// The leases this instance holds in one store, renewed while their requests run.
pub struct LeaseBook {
    store: Arc<dyn LeaseStore>,
    live: Mutex<HashMap<u64, Entry>>,
    /// Lease ids: a per-book random seed hashing a counter, so two instances' ids for one key
    /// do not meet (and a restarted instance does not reuse its predecessor's).
    seed: foldhash::fast::RandomState,
    next: AtomicU64,
    errors: Option<RedisErrors>,
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
}

/// Lease ids stay below 2^50, where Lua's doubles hold them exactly.
const ID_MASK: u64 = (1 << 50) - 1;

impl LeaseBook {
    /// A book over `store`; `errors` counts the failures of its calls. Its renewals start with
    /// [`LeaseBook::start_renewing`].
    pub fn new(store: Arc<dyn LeaseStore>, errors: Option<RedisErrors>) -> Arc<Self> {
        Arc::new(Self {
            store,
            live: Mutex::new(HashMap::new()),
            seed: foldhash::fast::RandomState::default(),
            next: AtomicU64::new(0),
            errors,
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

    /// A lease about to be asked for on `key` (the limit's lease set), `lease` µs long.
    pub(super) fn pending(
        self: &Arc<Self>,
        key: String,
        lease: Micros,
        metrics: Option<&SlotMetrics>,
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
            settled: false,
        }
    }

    /// Forgets lease `id` and gives it back in Redis, in the background.
    fn release(&self, id: u64) {
        let Some(entry) = self.live.lock().remove(&id) else {
            // Renewal found it gone already (counted then): nothing to give back.
            return;
        };
        if let Some(m) = &entry.metrics {
            m.in_flight.dec();
        }
        self.send_release(entry.key, id, entry.metrics);
    }

    fn send_release(&self, key: String, id: u64, metrics: Option<SlotMetrics>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime (a test deciding outside one): the lease runs out by itself.
            return;
        };
        let call = self.store.release(vec![(key, id)]);
        let errors = self.errors.clone();
        rt.spawn(async move {
            match call.await {
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
                    tracing::debug!(error = %e, "releasing a concurrency lease failed; it runs out by itself");
                }
            }
        });
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
        book.renew_due(Instant::now()).await;
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
            self.book
                .send_release(std::mem::take(&mut self.key), self.id, None);
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
