//! Requests waiting for a concurrency slot (`on_limit: delay` on `algorithm: concurrency`):
//! one first-come-first-served line per key, in this instance.
//!
//! A slot comes back when a request ends, at no time a clock could reserve, so a request
//! refused only for lack of a slot takes a [`Place`] in its key's line and asks for admission
//! again (the whole route's decision, so all-or-nothing holds) each time its place is woken.
//! Only the first place of a line is woken: by a slot of its key given back in this instance
//! ([`SlotQueue::wake`], from the local store's release and from a lease's release once Redis
//! has it), and when the place before it leaves (admitted, timed out, or its client gone), so
//! that the next in line looks at once. Later places sleep until they are first: a release
//! costs one decision, not one per waiter.
//!
//! Lines are keyed by the key's hash in its store (two keys that collide share a line: still
//! first come, first served, with a wasted look now and then). A line is removed when its last
//! place leaves, and places are bounded by the route's `server.max_waiters`, so the table never
//! outgrows the requests waiting now. A key nobody waits for costs a release one atomic load.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

/// How often the first waiter for a global limit's slot asks Redis again, besides being woken
/// by this instance's own releases: the longest another instance's release goes unnoticed,
/// for one decision's script call per line (not per waiter) in that time.
pub const GLOBAL_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// The lines of one concurrency limit's keys (kept in its [`LocalStore`](super::local::LocalStore),
/// so it is carried over reloads and shared by the routes of a shared limit as the slots are).
#[derive(Default)]
pub struct SlotQueue {
    /// Places in every line: read without the lock, so a release with no one waiting does
    /// nothing more.
    waiting: AtomicUsize,
    lines: Mutex<HashMap<u64, VecDeque<Waiter>>>,
    next: AtomicU64,
}

impl std::fmt::Debug for SlotQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotQueue")
            .field("waiting", &self.waiting())
            .finish()
    }
}

struct Waiter {
    id: u64,
    wake: Arc<Notify>,
}

impl SlotQueue {
    /// Places taken now, in every line.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Whether someone waits in the line of `hash`: a newcomer then queues behind them rather
    /// than taking a slot that is theirs.
    pub fn busy(&self, hash: u64) -> bool {
        self.waiting() > 0 && self.lines.lock().contains_key(&hash)
    }

    /// A place at the end of the line of `hash`. The first place of a line is woken at once
    /// (its first [`Place::turn`] returns without waiting): there is no one to wait for.
    pub fn join(&self, hash: u64) -> Place<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let wake = Arc::new(Notify::new());
        let mut lines = self.lines.lock();
        let line = lines.entry(hash).or_default();
        if line.is_empty() {
            wake.notify_one();
        }
        line.push_back(Waiter {
            id,
            wake: Arc::clone(&wake),
        });
        self.waiting.fetch_add(1, Ordering::AcqRel);
        drop(lines);
        Place {
            queue: self,
            hash,
            id,
            wake,
        }
    }

    /// A slot of the key of `hash` came back: its line's first place looks again. The wake is
    /// kept if that place is not waiting right now (it is deciding), so none is lost.
    pub fn wake(&self, hash: u64) {
        if self.waiting() == 0 {
            return;
        }
        if let Some(first) = self.lines.lock().get(&hash).and_then(VecDeque::front) {
            first.wake.notify_one();
        }
    }

    fn leave(&self, hash: u64, id: u64) {
        let mut lines = self.lines.lock();
        let Some(line) = lines.get_mut(&hash) else {
            return;
        };
        let Some(at) = line.iter().position(|w| w.id == id) else {
            return;
        };
        line.remove(at);
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        match line.front() {
            None => {
                lines.remove(&hash);
            }
            // The first place left (admitted, or gave up): the next looks at once, for the slot
            // it may have left free, or a wake meant for it.
            Some(next) if at == 0 => next.wake.notify_one(),
            Some(_) => {}
        }
    }
}

/// A request's place in its key's line; dropped, it leaves the line (the request was admitted,
/// timed out, or its client went away).
pub struct Place<'q> {
    queue: &'q SlotQueue,
    hash: u64,
    id: u64,
    wake: Arc<Notify>,
}

impl Place<'_> {
    /// Whether this place is first in its line (the one a free slot is for).
    pub fn is_first(&self) -> bool {
        self.queue
            .lines
            .lock()
            .get(&self.hash)
            .and_then(VecDeque::front)
            .is_some_and(|w| w.id == self.id)
    }

    /// Until this place is woken: it is first in line, and a slot may be free (one came back,
    /// or the place before left). Cancel-safe: dropped, it loses no wake.
    pub async fn turn(&self) {
        self.wake.notified().await;
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.queue.leave(self.hash, self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn woken(p: &Place<'_>) -> bool {
        tokio::time::timeout(Duration::from_millis(20), p.turn())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn the_first_is_woken_at_once_and_the_next_when_it_leaves() {
        let q = SlotQueue::default();
        assert!(!q.busy(7));
        let a = q.join(7);
        let b = q.join(7);
        let other = q.join(8);
        assert!(q.busy(7) && q.busy(8) && !q.busy(9));
        assert_eq!(q.waiting(), 3);
        assert!(a.is_first() && !b.is_first() && other.is_first());
        assert!(woken(&a).await, "first in line");
        assert!(woken(&other).await, "first in its own line");
        assert!(!woken(&b).await, "second in line sleeps");
        assert!(!woken(&a).await, "one wake per turn");
        q.wake(7);
        assert!(woken(&a).await, "a release wakes the first");
        assert!(!woken(&b).await);
        drop(a);
        assert!(woken(&b).await, "the next looks once the first leaves");
        drop(b);
        drop(other);
        assert_eq!(q.waiting(), 0);
        assert!(q.lines.lock().is_empty(), "empty lines are removed");
    }

    #[tokio::test]
    async fn a_wake_while_deciding_is_kept_and_a_later_place_leaving_wakes_no_one() {
        let q = SlotQueue::default();
        let a = q.join(1);
        assert!(woken(&a).await);
        let b = q.join(1);
        let c = q.join(1);
        // `a` is deciding (not waiting) when the slot comes back: the wake waits for it.
        q.wake(1);
        drop(c);
        assert!(woken(&a).await);
        assert!(!woken(&b).await, "c leaving from behind wakes no one");
        assert_eq!(q.waiting(), 2);
    }
}
