//! Coalescing and batching of decisions: while a decide call is in flight on a queue, the
//! decisions that arrive for that queue wait, and the next call decides all of them, in
//! arrival order, in one `decide_many` (see `lua/decide_many.lua`). A decision that finds its
//! queue idle goes at once, alone, as a plain `decide`: a lone request pays no wait.
//!
//! This module owns the queues and the wire layout of a batch; [`RedisStore`](super::RedisStore)
//! runs the calls. One queue per hash slot on a Cluster (a script call may touch one slot
//! only); on a single Redis the slots are folded into as many queues as the pool has
//! connections, so that many keys share a call.
//!
//! Exactness: a queue has at most one call in flight, and each call decides its requests in
//! the order they queued, each exactly as `decide.lua` would have decided it alone at that
//! point. Every request is decided once, after every request queued before it on its queue,
//! so the admissions are those of the same requests decided one at a time in that order.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::oneshot;

use super::RedisError;
use super::script::{ARGS_PER_LIMIT, DECIDE_HEADER, REPLY_HEADER, REPLY_PER_LIMIT};

/// Default bound on the decisions of one call (`redis.batch_max`).
pub const DEFAULT_BATCH_MAX: usize = 64;
/// Bound on the ARGV values of one call (about 10 per one-limit decision): what Redis holds
/// in memory for the call, and how long it runs, stay small. A single decision larger than
/// this still goes, alone.
pub const MAX_BATCH_ARGS: usize = 4096;

/// One request's decision, as `decide.lua` takes it, waiting for its answer.
#[derive(Debug)]
pub(super) struct Pending {
    /// decide.lua's KEYS for this request.
    pub keys: Vec<String>,
    /// decide.lua's ARGV for this request (now override, TTL floor, n, the limits).
    pub args: Vec<i64>,
    /// Where its reply (decide.lua's, 2 + 4n values) goes.
    pub reply: oneshot::Sender<Result<Vec<i64>, RedisError>>,
}

impl Pending {
    /// The number of limits, as the ARGV says.
    fn limits(&self) -> usize {
        self.args
            .get(DECIDE_HEADER - 1)
            .map_or(0, |&n| usize::try_from(n).unwrap_or(0))
    }
}

/// What [`Batcher::enqueue`] made of a decision.
#[derive(Debug)]
pub(super) enum Enqueued {
    /// The queue was idle: the caller runs this decision now, then [`Batcher::next`] until the
    /// queue is drained.
    Lead(Pending),
    /// A call is in flight on the queue: the answer comes on the decision's channel.
    Queued,
}

/// Counters of what the batcher did since start, for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Decide calls sent (`decide` for one decision, `decide_many` for more).
    pub calls: u64,
    /// Decisions those calls made.
    pub decisions: u64,
    /// Decisions that waited behind a call in flight rather than going at once.
    pub queued: u64,
}

/// The queues, and the bound on a call.
#[derive(Debug)]
pub(super) struct Batcher {
    /// Per queue with a call in flight, the decisions waiting for the next call; a queue
    /// without a call in flight has no entry.
    queues: Mutex<HashMap<u16, VecDeque<Pending>>>,
    max_decisions: usize,
    calls: AtomicU64,
    decisions: AtomicU64,
    queued: AtomicU64,
}

impl Batcher {
    /// A batcher deciding at most `max_decisions` (at least 1) requests per call.
    pub(super) fn new(max_decisions: usize) -> Self {
        Self {
            queues: Mutex::new(HashMap::new()),
            max_decisions: max_decisions.max(1),
            calls: AtomicU64::new(0),
            decisions: AtomicU64::new(0),
            queued: AtomicU64::new(0),
        }
    }

    fn queues(&self) -> std::sync::MutexGuard<'_, HashMap<u16, VecDeque<Pending>>> {
        // The map holds no invariant a panic elsewhere could break: a queue whose driver
        // panicked keeps its entry, and its decisions time out (their callers stop waiting).
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Puts `pending` on `queue`: it leads (the queue was idle and is now in flight) or waits.
    pub(super) fn enqueue(&self, queue: u16, pending: Pending) -> Enqueued {
        let mut queues = self.queues();
        match queues.get_mut(&queue) {
            Some(waiting) => {
                waiting.push_back(pending);
                self.queued.fetch_add(1, Ordering::Relaxed);
                Enqueued::Queued
            }
            None => {
                queues.insert(queue, VecDeque::new());
                Enqueued::Lead(pending)
            }
        }
    }

    /// After a call on `queue` returned: the decisions for the next call, oldest first, within
    /// the bounds; empty when none waits, and the queue is then idle again.
    pub(super) fn next(&self, queue: u16) -> Vec<Pending> {
        let mut queues = self.queues();
        let Some(waiting) = queues.get_mut(&queue) else {
            return Vec::new();
        };
        let mut batch = Vec::new();
        let mut args = 1;
        while let Some(p) = waiting.front() {
            let fits = batch.len() < self.max_decisions && args + p.args.len() <= MAX_BATCH_ARGS;
            if !batch.is_empty() && !fits {
                break;
            }
            args += p.args.len();
            batch.extend(waiting.pop_front());
        }
        if batch.is_empty() {
            queues.remove(&queue);
        }
        batch
    }

    /// `queue`'s driver ended without draining it (a panic): the queue is idle again, and
    /// every decision waiting on it gets `error` rather than waiting for a call that will not
    /// come.
    pub(super) fn abandon(&self, queue: u16, error: RedisError) {
        let waiting = self.queues().remove(&queue).unwrap_or_default();
        for p in waiting {
            let _ = p.reply.send(Err(error.clone()));
        }
    }

    /// Counts one call of `decisions`.
    pub(super) fn count_call(&self, decisions: usize) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.decisions
            .fetch_add(decisions as u64, Ordering::Relaxed);
    }

    /// What the batcher did so far.
    pub(super) fn stats(&self) -> BatchStats {
        BatchStats {
            calls: self.calls.load(Ordering::Relaxed),
            decisions: self.decisions.load(Ordering::Relaxed),
            queued: self.queued.load(Ordering::Relaxed),
        }
    }
}

/// The ARGV values of one limit of a decide.lua ARGV starting at `at`: 7, or 11 for a
/// calendar fixed_window (code 5: four window bounds more). See `lua/lib.lua`.
fn limit_len(args: &[i64], at: usize) -> usize {
    match args.get(at) {
        Some(5) => ARGS_PER_LIMIT + 4 + 1,
        _ => ARGS_PER_LIMIT + 1,
    }
}

/// KEYS and ARGV of one `decide_many` call deciding `batch` in order (layout at the top of
/// `lua/decide_many.lua`): each distinct limit sent once as a spec, each distinct request
/// header and list of specs once as a shape, then one shape number per request. A batch on
/// one limit (a hot key, or many keys of one limit) is then 2 values per request, not 10.
pub(super) fn many_call(batch: &[Pending]) -> (Vec<String>, Vec<i64>) {
    let keys = batch.iter().flat_map(|p| p.keys.iter().cloned()).collect();
    let mut specs: Vec<&[i64]> = Vec::new();
    let mut spec_of: HashMap<(&[i64], usize), usize> = HashMap::new();
    let mut shapes: Vec<Vec<i64>> = Vec::new();
    let mut shape_of: HashMap<Vec<i64>, usize> = HashMap::new();
    let mut order = Vec::with_capacity(batch.len());
    for p in batch {
        let a = &p.args;
        let n = p.limits();
        let mut shape = Vec::with_capacity(DECIDE_HEADER + n);
        shape.extend_from_slice(&a[..DECIDE_HEADER.min(a.len())]);
        let mut at = DECIDE_HEADER;
        let mut seen: Vec<&[i64]> = Vec::with_capacity(n);
        for _ in 0..n {
            let end = (at + limit_len(a, at)).min(a.len());
            let limit = &a[at..end];
            // The same spec twice in one request (two limits alike in every value) gets a
            // second spec: the script gives each spec of a request its own keys.
            let twice = seen.iter().filter(|s| **s == limit).count();
            seen.push(limit);
            let next = specs.len();
            let spec = *spec_of.entry((limit, twice)).or_insert(next);
            if spec == next {
                specs.push(limit);
            }
            shape.push(spec as i64 + 1);
            at = end;
        }
        let next = shapes.len();
        let number = *shape_of.entry(shape.clone()).or_insert(next);
        if number == next {
            shapes.push(shape);
        }
        order.push(number as i64 + 1);
    }
    let mut args = Vec::with_capacity(
        3 + specs.iter().map(|s| s.len()).sum::<usize>()
            + shapes.iter().map(Vec::len).sum::<usize>()
            + order.len(),
    );
    args.push(batch.len() as i64);
    args.push(specs.len() as i64);
    for spec in &specs {
        args.extend_from_slice(spec);
    }
    args.push(shapes.len() as i64);
    for shape in &shapes {
        args.extend_from_slice(shape);
    }
    args.extend(order);
    (keys, args)
}

/// Per limit of a decide.lua ARGV, whether it is a shadow limit (its segment's last value).
fn shadows(args: &[i64], n: usize) -> Vec<bool> {
    let mut out = Vec::with_capacity(n);
    let mut at = DECIDE_HEADER;
    for _ in 0..n {
        let end = at + limit_len(args, at);
        out.push(args.get(end - 1) == Some(&1));
        at = end;
    }
    out
}

/// Sends each decision of `batch` its part of `reply` (decide_many's: the server clock's
/// reading, then 4 values per limit), as decide.lua's reply (all_admitted and now in front), or
/// every one the error.
pub(super) fn answer(batch: Vec<Pending>, reply: Result<Vec<i64>, RedisError>) {
    let reply = reply.and_then(|r| {
        let want: usize = 1 + batch
            .iter()
            .map(|p| REPLY_PER_LIMIT * p.limits())
            .sum::<usize>();
        if r.len() == want {
            Ok(r)
        } else {
            Err(RedisError::Protocol(format!(
                "decide_many returned {} values for {want}",
                r.len()
            )))
        }
    });
    match reply {
        Ok(values) => {
            let server_now = values[0];
            let mut at = 1;
            for p in batch {
                let n = p.limits();
                let verdicts = &values[at..at + REPLY_PER_LIMIT * n];
                at += REPLY_PER_LIMIT * n;
                let now = match p.args.first() {
                    Some(&now) if now >= 0 => now,
                    _ => server_now,
                };
                let shadow = shadows(&p.args, n);
                let all = verdicts
                    .chunks_exact(REPLY_PER_LIMIT)
                    .zip(&shadow)
                    .all(|(v, &shadow)| v[0] == 1 || shadow);
                let mut one = Vec::with_capacity(REPLY_HEADER + verdicts.len());
                one.extend([i64::from(all), now]);
                one.extend_from_slice(verdicts);
                // A caller that went away is not waiting: its decision stands (see RedisStore).
                let _ = p.reply.send(Ok(one));
            }
        }
        Err(e) => {
            for p in batch {
                let _ = p.reply.send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(
        n: i64,
        limit_args: usize,
    ) -> (Pending, oneshot::Receiver<Result<Vec<i64>, RedisError>>) {
        let (tx, rx) = oneshot::channel();
        let mut args = vec![-1, 1, n];
        args.extend(std::iter::repeat_n(0, limit_args));
        (
            Pending {
                keys: vec![format!("k{n}")],
                args,
                reply: tx,
            },
            rx,
        )
    }

    #[test]
    fn a_lone_decision_leads_and_later_ones_wait_in_order() {
        let b = Batcher::new(2);
        assert!(matches!(b.enqueue(7, pending(1, 7).0), Enqueued::Lead(_)));
        // Another queue is independent.
        assert!(matches!(b.enqueue(8, pending(1, 7).0), Enqueued::Lead(_)));
        for _ in 0..3 {
            assert!(matches!(b.enqueue(7, pending(1, 7).0), Enqueued::Queued));
        }
        assert_eq!(b.next(7).len(), 2, "bounded by max_decisions");
        assert_eq!(b.next(7).len(), 1);
        assert!(b.next(7).is_empty());
        // Drained: idle again, the next decision leads.
        assert!(matches!(b.enqueue(7, pending(1, 7).0), Enqueued::Lead(_)));
        assert_eq!(b.stats().queued, 3);
    }

    #[test]
    fn an_abandoned_queue_answers_its_waiters_and_is_idle_again() {
        let b = Batcher::new(8);
        let _ = b.enqueue(3, pending(1, 7).0);
        let (p, rx) = pending(1, 7);
        assert!(matches!(b.enqueue(3, p), Enqueued::Queued));
        b.abandon(3, RedisError::Timeout);
        assert_eq!(rx.blocking_recv().unwrap(), Err(RedisError::Timeout));
        assert!(matches!(b.enqueue(3, pending(1, 7).0), Enqueued::Lead(_)));
    }

    #[test]
    fn a_call_is_bounded_by_its_arguments_but_one_decision_always_goes() {
        let b = Batcher::new(1000);
        let _ = b.enqueue(1, pending(1, 7).0);
        let _ = b.enqueue(1, pending(1, MAX_BATCH_ARGS).0);
        let _ = b.enqueue(1, pending(1, MAX_BATCH_ARGS / 2).0);
        let _ = b.enqueue(1, pending(1, MAX_BATCH_ARGS / 3).0);
        assert_eq!(b.next(1).len(), 1, "too large for a batch, goes alone");
        assert_eq!(b.next(1).len(), 2);
        assert!(b.next(1).is_empty());
    }

    #[test]
    fn many_call_concatenates_and_answer_splits() {
        let (a, ra) = pending(1, 7);
        let (c, rc) = pending(2, 14);
        let batch = vec![a, c];
        let (keys, args) = many_call(&batch);
        assert_eq!(keys, ["k1", "k2"]);
        // m, 1 spec (every limit of these is seven zeros; the second request has it twice,
        // so a second spec), 2 shapes, 2 shape numbers.
        assert_eq!(
            args,
            [
                2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, -1, 1, 1, 1, -1, 1, 2, 1, 2, 1,
                2
            ]
        );
        // The clock read, then 4 values per limit: the first request's limit rejected (an
        // enforced one: zeros), the second's two admitted.
        let reply = vec![99, 0, 5, 6, 7, 1, 0, 0, 0, 1, 3, 2, 1];
        answer(batch, Ok(reply));
        assert_eq!(ra.blocking_recv().unwrap().unwrap(), [0, 99, 0, 5, 6, 7]);
        assert_eq!(
            rc.blocking_recv().unwrap().unwrap(),
            [1, 99, 1, 0, 0, 0, 1, 3, 2, 1]
        );

        let (a, ra) = pending(1, 7);
        answer(vec![a], Ok(vec![1, 2, 3]));
        assert!(matches!(
            ra.blocking_recv().unwrap(),
            Err(RedisError::Protocol(_))
        ));
    }
}
