//! A [`GlobalStore`] for the orchestration tests: it decides with the pure cores on the test's
//! clock, as `decide.lua` does with their Lua mirror on Redis's; or fails as told.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::limit::GlobalStore;
use crate::limit::algorithm::{Algorithm, Micros, Snapshot};
use crate::limit::clock::{Clock, ManualClock};
use crate::limit::local::{self, LocalCheck, LocalStore};
use crate::limit::redis::{Decision, GlobalLimit, Grant, LimitVerdict, RedisError, hash_tag};

pub(super) struct FakeStore<'c> {
    clock: &'c ManualClock,
    /// One store per key, so a call's limits each lock their own (the keys of one call
    /// differ: they hold their limit's name).
    keys: Mutex<HashMap<String, Arc<LocalStore>>>,
    /// Eventual limits' window counters (`sync.lua`) and TATs (`sync_gcra.lua`).
    counters: Mutex<HashMap<String, u64>>,
    /// Every call fails with this, when set.
    fail: Mutex<Option<RedisError>>,
    /// The next `decide` waits for this before deciding: a request overtaken by another
    /// during its round trip.
    parked: Mutex<Option<oneshot::Receiver<()>>>,
    /// The next `reserve` waits for this before deciding: a reservation in flight while the
    /// clock moves on (Redis deciding later than the call was sent).
    parked_reserve: Mutex<Option<oneshot::Receiver<()>>>,
    /// The key of the `reserve` call that took `parked_reserve`.
    parked_key: Mutex<Option<String>>,
    pub(super) decides: AtomicUsize,
    pub(super) syncs: AtomicUsize,
    pub(super) resets: AtomicUsize,
    pub(super) reserves: AtomicUsize,
}

impl<'c> FakeStore<'c> {
    pub(super) fn new(clock: &'c ManualClock) -> Self {
        Self {
            clock,
            keys: Mutex::default(),
            counters: Mutex::default(),
            fail: Mutex::default(),
            parked: Mutex::default(),
            parked_reserve: Mutex::default(),
            parked_key: Mutex::default(),
            decides: AtomicUsize::new(0),
            syncs: AtomicUsize::new(0),
            resets: AtomicUsize::new(0),
            reserves: AtomicUsize::new(0),
        }
    }

    pub(super) fn fail_with(&self, e: Option<RedisError>) {
        *self.fail.lock().unwrap() = e;
    }

    /// The next `decide` answers only once `until` fires (or its sender is dropped).
    pub(super) fn park_next(&self, until: oneshot::Receiver<()>) {
        *self.parked.lock().unwrap() = Some(until);
    }

    /// The next `reserve` decides only once `until` fires (or its sender is dropped).
    pub(super) fn park_next_reserve(&self, until: oneshot::Receiver<()>) {
        *self.parked_reserve.lock().unwrap() = Some(until);
        *self.parked_key.lock().unwrap() = None;
    }

    /// The key of the `reserve` call parked since [`Self::park_next_reserve`], if one took it.
    pub(super) fn parked_reserve_key(&self) -> Option<String> {
        self.parked_key.lock().unwrap().clone()
    }

    /// Takes back a park no `reserve` call took: the calls after it are not parked.
    pub(super) fn unpark_reserve(&self) {
        self.parked_reserve.lock().unwrap().take();
    }

    /// Units left at `key` now.
    pub(super) fn remaining(&self, algorithm: &Algorithm, key: &str) -> u64 {
        let now = self.clock.now();
        self.store(key)
            .peek(algorithm, key.as_bytes(), now)
            .remaining
    }

    fn store(&self, key: &str) -> Arc<LocalStore> {
        let mut keys = self.keys.lock().unwrap();
        keys.entry(key.to_owned()).or_default().clone()
    }

    fn failure(&self) -> Result<(), RedisError> {
        self.fail.lock().unwrap().clone().map_or(Ok(()), Err)
    }
}

impl GlobalStore for FakeStore<'_> {
    async fn decide(
        &self,
        limits: &[GlobalLimit<'_>],
        shadow: &[bool],
        _leases: &[u64],
    ) -> Result<Decision, RedisError> {
        self.decides.fetch_add(1, Ordering::SeqCst);
        // Parked first: a call that fails (a timeout) takes its time too.
        let parked = self.parked.lock().unwrap().take();
        if let Some(until) = parked {
            let _ = until.await;
        }
        self.failure()?;
        let stores: Vec<Arc<LocalStore>> = limits.iter().map(|l| self.store(l.key)).collect();
        let checks: Vec<LocalCheck<'_>> = limits
            .iter()
            .zip(&stores)
            .enumerate()
            .map(|(i, (l, store))| LocalCheck {
                store,
                algorithm: l.algorithm,
                key: l.key.as_bytes(),
                cost: l.cost,
                max_delay: l.max_delay,
                shadow: shadow.get(i).copied().unwrap_or(false),
            })
            .collect();
        // All or nothing, a shadow limit's rejection blocking nothing: decide.lua's contract,
        // which `local::decide` keeps too.
        let (admitted, verdicts) = local::decide(&checks, self.clock.now());
        let per_limit = verdicts
            .into_iter()
            .map(|v| match v {
                Ok((snapshot, delay)) => LimitVerdict::Admitted { snapshot, delay },
                Err(r) => LimitVerdict::Rejected(r),
            })
            .collect();
        let at = vec![self.clock.now(); limits.len()];
        Ok(Decision {
            admitted,
            per_limit,
            at,
        })
    }

    async fn peek(&self, limit: &GlobalLimit<'_>) -> Result<Snapshot, RedisError> {
        self.failure()?;
        let now = self.clock.now();
        Ok(self
            .store(limit.key)
            .peek(limit.algorithm, limit.key.as_bytes(), now))
    }

    async fn sync_counts(
        &self,
        (curr, prev): (String, String),
        (push_curr, push_prev): (u64, u64),
        _ws: Micros,
        _life: Micros,
        _period: Micros,
    ) -> Result<(u64, u64, Micros), RedisError> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        self.failure()?;
        let mut counters = self.counters.lock().unwrap();
        *counters.entry(curr.clone()).or_default() += push_curr;
        *counters.entry(prev.clone()).or_default() += push_prev;
        Ok((counters[&curr], counters[&prev], self.clock.now()))
    }

    async fn sync_gcra(
        &self,
        key: String,
        units: u64,
        (interval, tau): (Micros, Micros),
    ) -> Result<(Micros, Micros), RedisError> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        self.failure()?;
        let now = self.clock.now();
        let mut counters = self.counters.lock().unwrap();
        let tat = counters.entry(key).or_default();
        if units > 0 {
            *tat = ((*tat).max(now) + units * interval).min(now + tau);
        }
        Ok((*tat, now))
    }

    /// reserve.lua's grant (`Gcra::grant`) on the key's store: as many units as fit now, at
    /// least the cost, at most `want`.
    async fn reserve(&self, limit: &GlobalLimit<'_>, want: u64) -> Result<Grant, RedisError> {
        self.reserves.fetch_add(1, Ordering::SeqCst);
        let parked = self.parked_reserve.lock().unwrap().take();
        if let Some(until) = parked {
            *self.parked_key.lock().unwrap() = Some(limit.key.to_owned());
            let _ = until.await;
        }
        self.failure()?;
        let now = self.clock.now();
        let store = self.store(limit.key);
        let fits = store
            .peek(limit.algorithm, limit.key.as_bytes(), now)
            .remaining;
        let units = if fits >= limit.cost {
            want.min(fits).max(limit.cost)
        } else {
            limit.cost
        };
        let check = LocalCheck {
            store: &store,
            algorithm: limit.algorithm,
            key: limit.key.as_bytes(),
            cost: units,
            max_delay: 0,
            shadow: false,
        };
        let (_, verdicts) = local::decide(&[check], now);
        let verdict = match verdicts.into_iter().next() {
            Some(Ok((snapshot, _))) => Ok((units, snapshot)),
            Some(Err(r)) => Err(r),
            None => return Err(RedisError::Protocol("no verdict".to_string())),
        };
        Ok(Grant { verdict, at: now })
    }

    /// Forgets everything held under the keys' hash tag: the fake keeps a strict limit's
    /// state under its base key, not under the suffixed keys Redis uses, so it deletes by
    /// tag (one limit's one key, as a reset asks).
    async fn reset(&self, keys: Vec<String>) -> Result<u64, RedisError> {
        self.resets.fetch_add(1, Ordering::SeqCst);
        self.failure()?;
        let tags: Vec<&str> = keys.iter().filter_map(|k| hash_tag(k)).collect();
        let gone = |k: &String| hash_tag(k).is_some_and(|t| tags.contains(&t));
        let mut n = 0;
        let mut stores = self.keys.lock().unwrap();
        let before = stores.len();
        stores.retain(|k, _| !gone(k));
        n += before - stores.len();
        let mut counters = self.counters.lock().unwrap();
        let before = counters.len();
        counters.retain(|k, _| !gone(k));
        n += before - counters.len();
        Ok(n as u64)
    }
}
