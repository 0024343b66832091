//! One budget of keys for the whole process (`server.max_keys`): its default, derived from the
//! machine's memory, and its split among the in-process stores that hold per-key state.
//!
//! A client that rotates header values or IPv6 addresses makes a new key per request; without a
//! cap every store would grow with them. The operator reasons about one number for the
//! process, as about nginx's zone size, so the budget is process-wide and split here:
//!
//! - **Who shares it.** Every store that a running limit writes to: a local limit's store; a
//!   strict global limit's in-process tier and its local store (written only while Redis is
//!   down and `on_error: allow`); an eventual limit's counts. The top-keys summaries are
//!   bounded on their own (`top.rs`) and are not counted.
//! - **How it is split** ([`split`]): by demand, every second, when the sweeper has dropped the
//!   keys that are back to full. Each store is offered twice what it holds, and at least an
//!   even share of half the budget, so a quiet store has room to grow until the next split
//!   while a flooded one gets everything the others leave, never less than half the budget
//!   between them. The shares never add up to more than `max_keys` (stores that shrink are
//!   trimmed before those that grow are allowed more).
//! - **Within a store** each of its shards holds at most an even share of the store's part
//!   (see `local/sharded.rs`, which also says what is evicted first: the keys closest to full).

use std::collections::HashSet;
use std::sync::OnceLock;

use super::Limit;
use super::algorithm::{Algorithm, Micros};
use super::eventual::EventualStore;
use super::local::LocalStore;
use super::local::deny::DenyCache;
use super::local::sharded::SHARDS;

/// The most memory one key takes in a store at its cap, table slack included: an entry is one
/// 64-byte line and a table at its cap is between 1/4 and 1/2 full. The top of that range, so
/// that the default cap bounds memory rather than estimates it (keys over 16 bytes add their
/// own allocation; measured figures: docs/benchmarks.md, "Bounded memory under key floods").
pub const BYTES_PER_KEY: u64 = 256;

/// The default budget takes this fraction (1/16) of the memory the process may use: the rest
/// is for connections, buffers, and whatever else shares the machine.
pub const MEMORY_SHARE: u64 = 16;

/// The default never goes below this many keys (16 MiB of keys), however small the machine.
pub const DEFAULT_FLOOR: usize = 65_536;

/// Nor above this many (4 GiB of keys), however large: more is for an operator to ask for.
pub const DEFAULT_CEILING: usize = 16_777_216;

/// The smallest `max_keys` a config may set: sixteen keys per shard of a single store.
pub const MIN_MAX_KEYS: usize = 16 * SHARDS;

/// Memory assumed when the machine's cannot be read.
const UNKNOWN_MEMORY: u64 = 1 << 30;

/// The default `max_keys` and what it was derived from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DefaultKeys {
    /// The memory the process may use, in bytes: the cgroup's limit when there is one, else
    /// the machine's; `None` when neither could be read (1 GiB is assumed).
    pub memory: Option<u64>,
    /// The budget: [`keys_for_memory`] of it.
    pub keys: usize,
}

/// The default budget for `memory` bytes: [`MEMORY_SHARE`] of it at [`BYTES_PER_KEY`] per key,
/// between [`DEFAULT_FLOOR`] and [`DEFAULT_CEILING`].
pub fn keys_for_memory(memory: u64) -> usize {
    let keys = memory / MEMORY_SHARE / BYTES_PER_KEY;
    usize::try_from(keys)
        .unwrap_or(usize::MAX)
        .clamp(DEFAULT_FLOOR, DEFAULT_CEILING)
}

/// The default `max_keys` on this machine, read once per process.
pub fn default_max_keys() -> DefaultKeys {
    static DEFAULT: OnceLock<DefaultKeys> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        let memory = process_memory();
        DefaultKeys {
            memory,
            keys: keys_for_memory(memory.unwrap_or(UNKNOWN_MEMORY)),
        }
    })
}

/// The memory this process may use: the machine's RAM, or its cgroup's limit when lower (a
/// container's `memory.max`, v1 or v2), as sysinfo reads them.
fn process_memory() -> Option<u64> {
    use sysinfo::{MemoryRefreshKind, RefreshKind, System};
    let sys = System::new_with_specifics(
        RefreshKind::nothing().with_memory(MemoryRefreshKind::nothing().with_ram()),
    );
    let total = sys.total_memory();
    if total == 0 {
        return None;
    }
    Some(
        sys.cgroup_limits()
            .map_or(total, |c| c.total_memory.min(total)),
    )
}

/// Splits `max_keys` among stores holding `held` keys each (see the module doc): store `i` is
/// offered `max(2 × held[i], max_keys / (2 × n))`; when the offers fit, what is left is shared
/// evenly on top, otherwise they are cut to a common level (water-filling), so the stores that
/// want less than the level get what they want and the rest share what remains. The result
/// never adds up to more than `max_keys`.
pub fn split(max_keys: usize, held: &[usize]) -> Vec<usize> {
    let n = held.len();
    if n == 0 {
        return Vec::new();
    }
    let floor = max_keys / (2 * n);
    let want: Vec<usize> = held
        .iter()
        .map(|&h| h.saturating_mul(2).max(floor))
        .collect();
    let wanted = want.iter().fold(0usize, |a, &w| a.saturating_add(w));
    if wanted <= max_keys {
        let extra = (max_keys - wanted) / n;
        return want.iter().map(|&w| w + extra).collect();
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_unstable_by_key(|&i| want[i]);
    let mut alloc = vec![0; n];
    let mut left = max_keys;
    for (done, &i) in order.iter().enumerate() {
        let level = left / (n - done);
        alloc[i] = want[i].min(level);
        left -= alloc[i];
    }
    alloc
}

/// The kinds of store the budget covers, as the metrics' `store` label names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// A limit's local store: `scope: local` state, or a global limit's `on_error: allow`
    /// fallback.
    Local,
    /// The in-process tier in front of Redis.
    DenyTier,
    /// An eventual limit's counts.
    Eventual,
}

impl StoreKind {
    /// Every kind, in [`StoreKind::index`] order.
    pub const ALL: [StoreKind; 3] = [StoreKind::Local, StoreKind::DenyTier, StoreKind::Eventual];

    /// The `store` label.
    pub fn label(self) -> &'static str {
        match self {
            StoreKind::Local => "local",
            StoreKind::DenyTier => "deny_tier",
            StoreKind::Eventual => "eventual",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What one pass of [`rebalance`] found, for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyReport {
    /// Keys held after the pass, per [`StoreKind`] (by [`StoreKind::ALL`] order).
    pub held: [usize; 3],
    /// Keys evicted since the last pass, per [`StoreKind`].
    pub evicted: [u64; 3],
    /// Eventual units no sync will push since the last pass (see `eventual.rs`).
    pub lost_units: u64,
}

impl KeyReport {
    /// Keys held by every store together.
    pub fn total(&self) -> usize {
        self.held.iter().sum()
    }

    /// Keys held by stores of `kind`.
    pub fn held(&self, kind: StoreKind) -> usize {
        self.held[kind.index()]
    }

    /// Keys evicted from stores of `kind`.
    pub fn evicted(&self, kind: StoreKind) -> u64 {
        self.evicted[kind.index()]
    }
}

/// One store under the budget, with what its eviction order needs.
enum Member<'a> {
    Local(&'a LocalStore, &'a Algorithm),
    DenyTier(&'a DenyCache),
    Eventual(&'a EventualStore, &'a Algorithm),
}

impl Member<'_> {
    fn kind(&self) -> StoreKind {
        match self {
            Member::Local(..) => StoreKind::Local,
            Member::DenyTier(_) => StoreKind::DenyTier,
            Member::Eventual(..) => StoreKind::Eventual,
        }
    }

    /// The store's address: one store shared by several limits is one member.
    fn addr(&self) -> usize {
        match self {
            Member::Local(s, _) => std::ptr::from_ref(*s) as usize,
            Member::DenyTier(s) => std::ptr::from_ref(*s) as usize,
            Member::Eventual(s, _) => std::ptr::from_ref(*s) as usize,
        }
    }

    fn sweep(&self, now: Micros) -> usize {
        match self {
            Member::Local(s, _) => s.sweep(now),
            Member::DenyTier(s) => s.sweep(now),
            Member::Eventual(s, _) => s.sweep(now),
        }
    }

    fn len(&self) -> usize {
        match self {
            Member::Local(s, _) => s.len(),
            Member::DenyTier(s) => s.len(),
            Member::Eventual(s, _) => s.len(),
        }
    }

    fn budget(&self) -> usize {
        match self {
            Member::Local(s, _) => s.budget(),
            Member::DenyTier(s) => s.budget(),
            Member::Eventual(s, _) => s.budget(),
        }
    }

    fn set_budget(&self, keys: usize, now: Micros) {
        match self {
            Member::Local(s, a) => s.set_budget(keys, a, now),
            Member::DenyTier(s) => s.set_budget(keys, now),
            Member::Eventual(s, a) => s.set_budget(keys, a, now),
        }
    }

    fn take_evicted(&self) -> u64 {
        match self {
            Member::Local(s, _) => s.take_evicted(),
            Member::DenyTier(s) => s.take_evicted(),
            Member::Eventual(s, _) => s.take_evicted(),
        }
    }
}

/// The stores `limit` writes to (see the module doc).
fn members(limit: &Limit) -> impl Iterator<Item = Member<'_>> {
    let (first, second) = match &limit.eventual {
        Some(ev) => (Member::Eventual(ev, &limit.algorithm), None),
        None if limit.is_local() => (Member::Local(&limit.store, &limit.algorithm), None),
        None => (
            Member::DenyTier(&limit.deny_cache),
            Some(Member::Local(&limit.store, &limit.algorithm)),
        ),
    };
    std::iter::once(first).chain(second)
}

/// Sweeps the stores of `limits` (keys back to full are dropped), splits `max_keys` among them
/// by what each still holds ([`split`]) and caps each at its share, trimming the ones that hold
/// more. What the sweeper runs every second, and a config build once before it serves.
pub fn rebalance<'a>(
    limits: impl IntoIterator<Item = &'a Limit>,
    max_keys: usize,
    now: Micros,
) -> KeyReport {
    let mut seen = HashSet::new();
    let stores: Vec<Member<'a>> = limits
        .into_iter()
        .flat_map(members)
        .filter(|m| seen.insert(m.addr()))
        .collect();
    let held: Vec<usize> = stores.iter().map(|m| m.sweep(now)).collect();
    let shares = split(max_keys, &held);
    // Shrinking first: the stores never hold more than `max_keys` together, even between two
    // of these calls.
    for shrinking in [true, false] {
        for (m, &share) in stores.iter().zip(&shares) {
            let current = m.budget();
            if share != current && (share < current) == shrinking {
                m.set_budget(share, now);
            }
        }
    }
    let mut report = KeyReport::default();
    for m in &stores {
        let k = m.kind().index();
        report.held[k] += m.len();
        report.evicted[k] += m.take_evicted();
        if let Member::Eventual(ev, _) = m {
            report.lost_units += ev.take_lost();
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_follows_memory_between_a_floor_and_a_ceiling() {
        assert_eq!(keys_for_memory(0), DEFAULT_FLOOR);
        assert_eq!(
            keys_for_memory(256 << 20),
            DEFAULT_FLOOR,
            "256 MiB: 16 MiB of keys"
        );
        assert_eq!(
            keys_for_memory(8 << 30),
            2_097_152,
            "8 GiB: 512 MiB of keys"
        );
        assert_eq!(keys_for_memory(1 << 40), DEFAULT_CEILING);
        let d = default_max_keys();
        assert!((DEFAULT_FLOOR..=DEFAULT_CEILING).contains(&d.keys), "{d:?}");
    }

    #[test]
    fn quiet_stores_share_the_budget_evenly() {
        assert_eq!(split(1000, &[0, 0, 0, 0]), vec![250; 4]);
        assert_eq!(split(1000, &[]), Vec::<usize>::new());
        let s = split(1000, &[10, 0]);
        assert_eq!(s.iter().sum::<usize>(), 1000);
        assert!(s[0] >= 20 && s[1] >= 250, "{s:?}");
    }

    #[test]
    fn a_flooded_store_gets_what_the_others_leave_and_they_keep_room_to_grow() {
        // Store 0 is full at its share; the others hold a few keys.
        let s = split(1000, &[500, 10, 0, 40]);
        assert_eq!(s.iter().sum::<usize>(), 1000);
        // Each quiet store keeps twice what it holds, or its floor (1000 / 8).
        assert_eq!(&s[1..], &[125, 125, 125]);
        assert_eq!(s[0], 625);
        // A second flooded store: the two share what the quiet ones leave.
        let s = split(1000, &[500, 500, 0, 0]);
        assert_eq!(s, vec![375, 375, 125, 125]);
    }

    #[test]
    fn the_store_labels_are_the_metrics_ones() {
        assert_eq!(
            StoreKind::ALL.map(StoreKind::label),
            crate::metrics::KEY_STORES
        );
    }

    /// Limits `a` (local), `g` (strict global) and `e` (eventual) of one route.
    fn limits() -> Vec<Limit> {
        let yaml = "redis:\n  url: redis://127.0.0.1:1\nroutes:\n  - name: r\n    upstream: http://a:1\n    limits:\n      - {name: a, key: [ip], rate: 100/1h, scope: local}\n      - {name: g, key: [ip], rate: 100/1h}\n      - {name: e, key: [ip], rate: 100/1h, consistency: eventual}\n";
        let config = crate::config::parse_str(std::path::Path::new("t.yaml"), yaml).unwrap();
        let metrics = crate::metrics::Metrics::new();
        config.routes[0]
            .limits
            .iter()
            .map(|lc| {
                Limit::new(
                    "r",
                    lc,
                    Default::default(),
                    Default::default(),
                    None,
                    metrics.limit("r", &lc.name),
                )
            })
            .collect()
    }

    /// One process-wide budget over every store a limit writes to: a flooded local store
    /// grows, second by second, into what the quiet ones leave, the quiet ones keep room, and
    /// the stores never hold more than `max_keys` together.
    #[test]
    fn a_flooded_store_grows_into_the_budget_the_others_leave() {
        use crate::limit::local::{LocalCheck, decide};
        let limits = limits();
        let max = 64 * 64;
        let now = 10;
        let first = rebalance(&limits, max, now);
        assert_eq!(first.total(), 0);
        // Four stores: a's local store, g's tier and fallback store, e's counts.
        assert_eq!(limits[0].store.budget(), max / 4);
        assert_eq!(limits[1].deny_cache.budget(), max / 4);
        assert_eq!(limits[1].store.budget(), max / 4);
        assert_eq!(limits[2].eventual.as_ref().unwrap().budget(), max / 4);
        assert_eq!(
            limits[2].store.budget(),
            usize::MAX,
            "written by no one: not counted"
        );
        let a = &limits[0];
        let mut key = 0u64;
        let mut evicted = 0;
        for _second in 0..6 {
            for _ in 0..2 * max {
                key += 1;
                let k = format!("10.0.{key}");
                let check = LocalCheck {
                    store: &a.store,
                    algorithm: &a.algorithm,
                    key: k.as_bytes(),
                    cost: 1,
                    max_delay: 0,
                    shadow: false,
                };
                assert!(decide(&[check], now).0);
            }
            let report = rebalance(&limits, max, now);
            assert!(report.total() <= max, "{report:?}");
            evicted += report.evicted(StoreKind::Local);
        }
        // The quiet stores keep their floor, max / 8 each; the flooded one has the rest.
        assert_eq!(a.store.budget(), max - 3 * (max / 8));
        assert_eq!(evicted, key - a.store.len() as u64);
    }

    proptest::proptest! {
        /// Whatever the stores hold, the shares never add up to more than the budget, and a
        /// store gets at least what it holds when that fits beside the others' floors.
        #[test]
        fn the_shares_never_exceed_the_budget(
            max in 1usize..10_000_000,
            held in proptest::collection::vec(0usize..20_000_000, 0..40),
        ) {
            let s = split(max, &held);
            proptest::prop_assert_eq!(s.len(), held.len());
            proptest::prop_assert!(s.iter().sum::<usize>() <= max);
            // Each store gets at least its floor, and what it asked for when every offer fits.
            let n = held.len().max(1);
            let fits = held.iter().map(|&h| h.saturating_mul(2).max(max / (2 * n))).sum::<usize>() <= max;
            for (i, &h) in held.iter().enumerate() {
                proptest::prop_assert!(s[i] >= max / (2 * n));
                if fits {
                    proptest::prop_assert!(s[i] >= h.saturating_mul(2));
                }
            }
        }
    }
}
