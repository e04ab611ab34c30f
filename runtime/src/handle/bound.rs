//! Caller-side bounds on the wait for an engine core's reply.
//!
//! A transfer's deadline is enforced by its engine's progress loop, and a control call has no
//! deadline of its own; both rely on the core running. A core that stops running (a job that
//! blocks its thread, a reactor that never wakes) would hang every caller waiting on it. So a
//! call from another thread also bounds its wait on the caller's side: once its reply is not
//! there at the first look, it arms a bound, and past it the call ends with the typed
//! `EngineStalled` error. Its job stays on the core and ends there when the core runs again (a
//! transfer's slot is detached then; the in-flight table keeps its memory until the NIC is done).
//!
//! The bounds are kept by one watchdog thread per process that ticks every [`TICK`] while any is
//! armed. Arming one takes no lock (an allocation and a push onto a lock-free queue) and, while
//! the watchdog ticks, no system call, so a call that waits pays a few atomics. A reply caught by the reply spin arms nothing: the spin
//! defers arming (see [`deferring`]).

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use atomic_waker::AtomicWaker;
use futures_channel::mpsc;
use futures_lite::future::poll_fn;

/// The watchdog's resolution: a bound fires between `bound` and `bound + 2 * TICK` after it was
/// armed.
pub(crate) const TICK: Duration = Duration::from_millis(20);

/// One armed bound, shared by the waiting call and the watchdog.
#[derive(Debug)]
struct Armed {
    /// The watchdog tick at which it fires.
    due: u64,
    fired: AtomicBool,
    waker: AtomicWaker,
}

#[derive(Debug)]
struct Watchdog {
    /// Ticks since the watchdog started.
    now: Arc<AtomicU64>,
    arm: mpsc::UnboundedSender<Arc<Armed>>,
}

fn watchdog() -> &'static Watchdog {
    static WATCHDOG: OnceLock<Watchdog> = OnceLock::new();
    WATCHDOG.get_or_init(|| {
        let now = Arc::new(AtomicU64::new(0));
        let (arm, armed) = mpsc::unbounded();
        let ticks = Arc::clone(&now);
        // If the thread cannot start, bounds never fire: calls wait as they would without one.
        if let Err(e) = std::thread::Builder::new()
            .name("rixl-watchdog".into())
            .spawn(move || watch(&ticks, armed))
        {
            tracing::error!(error = %e, "the watchdog thread could not start: calls to engine cores are not bounded");
        }
        Watchdog { now, arm }
    })
}

/// The watchdog's loop: each tick, takes the newly armed bounds, fires those due and drops
/// those whose call has ended; with none left, it sleeps until the next is armed.
fn watch(now: &AtomicU64, mut armed: mpsc::UnboundedReceiver<Arc<Armed>>) {
    let mut live: Vec<Arc<Armed>> = Vec::new();
    loop {
        if live.is_empty() {
            // Nothing to watch: sleep until something is armed. The clock stands still
            // meanwhile, and a bound armed now counts from where it stands.
            match futures_lite::future::block_on(futures_lite::StreamExt::next(&mut armed)) {
                Some(a) => live.push(a),
                None => return,
            }
        }
        std::thread::sleep(TICK);
        let tick = now.fetch_add(1, Ordering::Relaxed) + 1;
        while let Ok(a) = armed.try_recv() {
            live.push(a);
        }
        live.retain(|a| {
            if Arc::strong_count(a) == 1 {
                return false;
            }
            if a.due <= tick {
                a.fired.store(true, Ordering::Release);
                a.waker.wake();
                return false;
            }
            true
        });
    }
}

thread_local! {
    /// Set while a reply spin polls: the call is not waiting yet, so it arms no bound.
    static DEFER: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (a reply spin's polls) with arming deferred.
pub(crate) fn deferring<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            DEFER.with(|d| d.set(self.0));
        }
    }
    let _reset = Reset(DEFER.with(|d| d.replace(true)));
    f()
}

/// The bound's wait ran out: the core did not answer within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stalled(pub(crate) Duration);

/// Awaits `fut`; once it has had to wait (its first poll outside a reply spin found it
/// pending), for at most `bound` more (`None`: without a bound).
pub(crate) async fn bounded<F: Future>(
    fut: F,
    bound: Option<Duration>,
) -> Result<F::Output, Stalled> {
    let mut fut = std::pin::pin!(fut);
    let mut armed: Option<Arc<Armed>> = None;
    poll_fn(move |cx| poll_bounded(fut.as_mut(), bound, &mut armed, cx)).await
}

fn poll_bounded<F: Future>(
    fut: Pin<&mut F>,
    bound: Option<Duration>,
    armed: &mut Option<Arc<Armed>>,
    cx: &mut Context<'_>,
) -> Poll<Result<F::Output, Stalled>> {
    if let Poll::Ready(v) = fut.poll(cx) {
        return Poll::Ready(Ok(v));
    }
    let Some(bound) = bound else {
        return Poll::Pending;
    };
    if armed.is_none() {
        if DEFER.with(Cell::get) {
            return Poll::Pending;
        }
        *armed = arm(bound);
    }
    if let Some(a) = armed {
        a.waker.register(cx.waker());
        if a.fired.load(Ordering::Acquire) {
            return Poll::Ready(Err(Stalled(bound)));
        }
    }
    Poll::Pending
}

/// Arms a bound of `bound` from now (`None` if the watchdog is gone).
fn arm(bound: Duration) -> Option<Arc<Armed>> {
    let w = watchdog();
    let ticks = bound.as_nanos().div_ceil(TICK.as_nanos());
    let ticks = u64::try_from(ticks).unwrap_or(u64::MAX);
    let a = Arc::new(Armed {
        due: w
            .now
            .load(Ordering::Relaxed)
            .saturating_add(ticks)
            .saturating_add(1),
        fired: AtomicBool::new(false),
        waker: AtomicWaker::new(),
    });
    w.arm.unbounded_send(Arc::clone(&a)).ok()?;
    Some(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_lite::future::{block_on, pending, ready};

    #[test]
    fn a_reply_that_never_comes_ends_stalled_after_its_bound() {
        let bound = Duration::from_millis(60);
        let r = block_on(bounded(pending::<()>(), Some(bound)));
        assert_eq!(r, Err(Stalled(bound)));
    }

    #[test]
    fn a_ready_reply_arms_nothing_and_no_bound_waits_on() {
        assert_eq!(block_on(bounded(ready(7), Some(Duration::ZERO))), Ok(7));
        // Without a bound a pending future stays pending, with nothing armed.
        let mut fut = std::pin::pin!(pending::<()>());
        let mut armed = None;
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(poll_bounded(fut.as_mut(), None, &mut armed, &mut cx).is_pending());
        assert!(armed.is_none());
    }

    #[test]
    fn polls_inside_a_reply_spin_arm_nothing_and_the_next_poll_arms() {
        let mut fut = std::pin::pin!(pending::<()>());
        let mut armed = None;
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let bound = Some(Duration::from_secs(5));
        deferring(|| {
            for _ in 0..3 {
                assert!(poll_bounded(fut.as_mut(), bound, &mut armed, &mut cx).is_pending());
            }
        });
        assert!(armed.is_none(), "a spinning call arms no bound");
        assert!(poll_bounded(fut.as_mut(), bound, &mut armed, &mut cx).is_pending());
        assert!(armed.is_some(), "a waiting call arms its bound");
        // Nested spins restore the outer state.
        deferring(|| deferring(|| ()));
        assert!(!DEFER.with(Cell::get));
    }
}
