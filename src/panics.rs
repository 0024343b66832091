//! What a panic does in tollgate: it ends the one thing it happened in, is logged once at error
//! level, and is counted in `tollgate_panics_total{task}`; the process goes on serving.
//!
//! A panic is a bug, but a gateway that enforces limits must not lose every connection of a
//! worker to one bad request. tokio already keeps a panicking task from taking other tasks with
//! it, but then the panic is only printed by the panic hook, and the task's `JoinHandle` (the
//! listener drops it) would have been the only place to see it. So the places that own
//! something catch it themselves, with what they know about it:
//!
//! - one request's phases, on either codec ([`catch`] around them): answered `500` with
//!   `Connection: close` when nothing of the response has gone out yet, else the connection is
//!   closed (HTTP/1.1) or the stream reset (HTTP/2), never ended as if complete;
//! - one client connection (the listener's [`catch`] around each): closed;
//! - the background tasks ([`supervise`]): restarted after [`RESTART_AFTER`].
//!
//! The binary installs [`install_hook`]: a panic inside one of those catches is logged once, by
//! the code that caught it (with the peer, route and what became of the connection), with the
//! hook's file, line and backtrace; any other panic (a thread or a library's task tollgate does
//! not own) is logged by the hook itself and counted under `task="other"`.
//!
//! This needs panics to unwind (Rust's default; `panic = "abort"` in a profile would turn every
//! panic back into a process exit).

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::Duration;

use crate::metrics::Metrics;

/// A background task that panicked is started again after this long: soon enough that a limit
/// sync or the config watcher is not missed for long, late enough that a panic on every start
/// costs one log line a second, not a busy loop.
pub const RESTART_AFTER: Duration = Duration::from_secs(1);

thread_local! {
    /// How many [`catch`] scopes are polling on this thread: when above 0 the hook leaves the
    /// log line to the code that catches.
    static CATCHING: Cell<u32> = const { Cell::new(0) };
    /// What the hook saw of the last panic caught on this thread (the payload does not carry
    /// its location).
    static ORIGIN: RefCell<Option<Origin>> = const { RefCell::new(None) };
}

/// Process-wide: where the hook counts the panics nothing else caught.
static UNCAUGHT: OnceLock<Arc<Metrics>> = OnceLock::new();

/// Where a panic happened, as the hook saw it.
#[derive(Debug)]
struct Origin {
    location: String,
    /// Only when `RUST_BACKTRACE` asks for one, as Rust's own hook does.
    backtrace: Option<String>,
}

/// A panic caught: its message, and where it happened when the hook was installed.
#[derive(Debug)]
pub struct Panic {
    /// The panic's message (`"(not a string)"` for another payload).
    pub message: String,
    /// `file:line:column`, when [`install_hook`] is in place.
    pub location: Option<String>,
    /// The backtrace, when [`install_hook`] is in place and `RUST_BACKTRACE` is set.
    pub backtrace: Option<String>,
}

impl Panic {
    #[cold]
    #[inline(never)]
    fn from_payload(payload: &(dyn Any + Send)) -> Self {
        let origin = ORIGIN.with(|o| o.borrow_mut().take());
        Self {
            message: message_of(payload).to_owned(),
            location: origin.as_ref().map(|o| o.location.clone()),
            backtrace: origin.and_then(|o| o.backtrace),
        }
    }

    /// The location for a log field: `?` when not known.
    pub fn location(&self) -> &str {
        self.location.as_deref().unwrap_or("?")
    }
}

impl fmt::Display for Panic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(l) = &self.location {
            write!(f, " (at {l})")?;
        }
        Ok(())
    }
}

fn message_of(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(not a string)"
    }
}

/// Marks this thread as inside a catch for as long as it lives.
struct Scope;

impl Scope {
    #[inline]
    fn enter() -> Self {
        CATCHING.with(|c| c.set(c.get() + 1));
        Scope
    }
}

impl Drop for Scope {
    #[inline]
    fn drop(&mut self) {
        CATCHING.with(|c| c.set(c.get() - 1));
    }
}

/// Runs `f`, catching a panic in it.
#[inline]
pub(crate) fn catch_now<R>(f: impl FnOnce() -> R) -> Result<R, Panic> {
    let _scope = Scope::enter();
    std::panic::catch_unwind(AssertUnwindSafe(f)).map_err(|p| Panic::from_payload(&*p))
}

/// Runs `fut`, catching a panic in any of its polls; after one it is dropped, never polled
/// again.
///
/// `AssertUnwindSafe`: what the future borrows or owns may be left half-updated by the panic.
/// The callers only answer, close or drop afterwards; none reuses that state for another
/// request.
pub(crate) async fn catch<F: Future>(fut: F) -> Result<F::Output, Panic> {
    catch_pinned(pin!(fut)).await
}

/// [`catch`] for a future pinned where it was made (`std::pin::pin!`), on the request path: a
/// future passed by value to an async fn is copied into that fn's state, and a request's
/// phases make a future of a few kilobytes.
#[inline]
pub(crate) fn catch_pinned<F: Future>(
    mut fut: Pin<&mut F>,
) -> impl Future<Output = Result<F::Output, Panic>> + '_ {
    std::future::poll_fn(move |cx| match catch_now(|| fut.as_mut().poll(cx)) {
        Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
        Ok(Poll::Pending) => Poll::Pending,
        Err(p) => Poll::Ready(Err(p)),
    })
}

/// Runs the background task `start` makes until it returns; one that panics is counted under
/// `task`, logged, and started again after [`RESTART_AFTER`] (its state lives in the shared
/// gateway, not in the task, so a new one carries on). A panic on every start repeats the log
/// line and the count each second: the alert to raise, with the process still serving.
pub(crate) async fn supervise<F, Fut>(task: &'static str, metrics: Arc<Metrics>, mut start: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        match catch(start()).await {
            Ok(()) => return,
            Err(p) => {
                metrics.panicked(task);
                tracing::error!(
                    task,
                    panic = %p.message,
                    location = p.location(),
                    backtrace = p.backtrace.as_deref(),
                    restart_in = ?RESTART_AFTER,
                    "background task panicked: restarting it"
                );
                tokio::time::sleep(RESTART_AFTER).await;
            }
        }
    }
}

/// Installs tollgate's panic hook for the process (the binary does, before anything runs; the
/// library's tests keep Rust's own, which the test harness captures). Inside a catch it only
/// notes the location (and backtrace) for the line the catching code logs; elsewhere it logs
/// the panic through `tracing` at error level, so it reaches the same place in the same format
/// (JSON too) as every other line, and counts it once [`count_uncaught_in`] named the metrics.
pub fn install_hook() {
    std::panic::set_hook(Box::new(|info| {
        let location = info
            .location()
            .map_or_else(|| "?".to_owned(), ToString::to_string);
        let backtrace = std::backtrace::Backtrace::capture();
        let backtrace = (backtrace.status() == std::backtrace::BacktraceStatus::Captured)
            .then(|| backtrace.to_string());
        if CATCHING.with(Cell::get) > 0 {
            ORIGIN.with(|o| {
                *o.borrow_mut() = Some(Origin {
                    location,
                    backtrace,
                })
            });
            return;
        }
        if let Some(m) = UNCAUGHT.get() {
            m.panicked("other");
        }
        let thread = std::thread::current();
        tracing::error!(
            panic = %message_of(info.payload()),
            location,
            thread = thread.name().unwrap_or("?"),
            backtrace = backtrace.as_deref(),
            "panic outside the request, connection and background-task catches"
        );
    }));
}

/// Panics the hook logs (outside every catch) are counted in these metrics, as
/// `tollgate_panics_total{task="other"}`. The first call wins.
pub fn count_uncaught_in(metrics: Arc<Metrics>) {
    let _ = UNCAUGHT.set(metrics);
}

/// Test builds only (the `panic-injection` cargo feature, which only this package's tests turn
/// on, through its dev-dependency on itself): panics on purpose at chosen points, so the tests
/// can show what a panic does there. Not compiled into any other build.
#[cfg(feature = "panic-injection")]
pub(crate) mod inject {
    /// In a request's phases (admission), on both codecs: a request whose path starts with
    /// this panics before anything of its response is sent.
    pub(crate) const REQUEST_PATH: &str = "/panic-injection/request";
    /// In a response body on its way to the client, on both codecs: body bytes holding this
    /// panic after the response head went out.
    pub(crate) const BODY_MARK: &[u8] = b"panic-injection:body";

    /// Panics for a request to [`REQUEST_PATH`].
    pub(crate) fn request(path: &str) {
        if path.starts_with(REQUEST_PATH) {
            panic!("injected panic in a request's phases ({path})");
        }
    }

    /// Panics on body bytes that hold [`BODY_MARK`].
    pub(crate) fn body(bytes: &[u8]) {
        if bytes.windows(BODY_MARK.len()).any(|w| w == BODY_MARK) {
            panic!("injected panic in a response body");
        }
    }

    /// Panics the first time (per process) it is called for a `subject` holding
    /// `panic-injection`: a background task that restarts then runs clean.
    pub(crate) fn once(task: &str, subject: &str) {
        static FIRED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
        if !subject.contains("panic-injection") {
            return;
        }
        let key = format!("{task} {subject}");
        let mut fired = FIRED.lock().unwrap_or_else(|e| e.into_inner());
        if !fired.contains(&key) {
            fired.push(key);
            drop(fired);
            panic!("injected panic in the {task} task ({subject})");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_future_gives_its_message_and_the_catch_ends() {
        let caught = catch(async {
            tokio::task::yield_now().await;
            panic!("boom {}", 7);
        })
        .await;
        let p: Panic = caught.expect_err("the panic is caught");
        assert_eq!(p.message, "boom 7");
        assert_eq!(
            CATCHING.with(Cell::get),
            0,
            "the scope is left after the panic"
        );
        assert_eq!(catch(async { 5 }).await.unwrap(), 5);
    }

    #[test]
    fn catch_now_gives_the_value_or_the_panic() {
        assert_eq!(catch_now(|| 1 + 1).unwrap(), 2);
        let p = catch_now(|| -> u8 { std::panic::panic_any(42u32) }).unwrap_err();
        assert_eq!(p.message, "(not a string)");
        assert_eq!(CATCHING.with(Cell::get), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_background_task_that_panics_is_counted_and_started_again() {
        let metrics = Arc::new(Metrics::new());
        let mut starts = 0;
        let t0 = tokio::time::Instant::now();
        supervise("sweep", metrics.clone(), || {
            starts += 1;
            let n = starts;
            async move {
                if n < 3 {
                    panic!("start {n}");
                }
            }
        })
        .await;
        assert_eq!(starts, 3, "started until it returned");
        assert_eq!(t0.elapsed(), RESTART_AFTER * 2, "after a pause each time");
        let text = metrics.encode(crate::metrics::Format::Text);
        assert!(
            text.contains("tollgate_panics_total{task=\"sweep\"} 2"),
            "{text}"
        );
    }
}
