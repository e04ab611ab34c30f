//! Caller-side bounds on the wait for an engine core's reply.
//!
//! A transfer's deadline is enforced by its engine's progress loop, and many calls have no
//! deadline of their own; all of them rely on the core running. A core that stops running (a
//! job that blocks its thread, a reactor that never wakes) would hang every caller waiting on
//! it. So each core beats: a task of its own bumps its [`Liveness`] every
//! [`Liveness::period`], and a call from another thread that waits for its reply ends with the
//! typed `EngineStalled` once the core has not beaten for `EngineConfig::stall_timeout`. A call
//! that merely takes long on a running core (a large registration on the blocking pool, a
//! receive nobody sends to, a close waiting for the NIC) is never cut short. The call's job
//! stays on the core and ends there when the core runs again (a transfer's is cancelled like a
//! dropped future: its slot is detached, and the in-flight table keeps its memory until the
//! NIC is done).
//!
//! A call with a deadline of its own (a transfer) is bounded more tightly once that deadline
//! has passed: a running core ends such a call itself, so from then on the core may go without
//! a beat for only [`Liveness::grace`] (a few beats) before the call ends with
//! `EngineStalled`. A transfer's deadline holds, within that grace, even on a stalled core.
//!
//! The bounds are kept by one watchdog thread per process that ticks every [`TICK`] while any is
//! armed and sleeps otherwise. A call arms its bound only once it waits: not at a first poll
//! that finds its reply, and not while the reply spin polls (see [`deferring`]). Arming takes
//! no lock and no clock read (an allocation and a push onto a lock-free queue; the watchdog
//! counts its ticks).

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use atomic_waker::AtomicWaker;
use futures_lite::future::poll_fn;

use super::nudge;

/// The watchdog's resolution.
const TICK: Duration = Duration::from_millis(20);

/// The shortest stall bound (a smaller `stall_timeout` is raised to it).
const MIN_STALL: Duration = Duration::from_millis(100);

/// The longest time between two beats (a timer wake-up of an idle core, five a second).
const MAX_PERIOD: Duration = Duration::from_millis(200);

/// A core's sign of life: its beats, and how long without one makes it stalled.
#[derive(Debug)]
pub(crate) struct Liveness {
    beats: AtomicU64,
    /// The heartbeat task's waker, for the watchdog's nudges (see [`super::nudge`]).
    nudge: AtomicWaker,
    /// Nudges sent.
    nudges: AtomicU64,
    /// `beats + 1` as they stood when a bound found the core stalled (0: never): until the
    /// core beats again, further calls to it end at once instead of waiting out a bound each.
    stalled_at: AtomicU64,
    stall: Duration,
}

impl Liveness {
    pub(crate) fn new(stall: Duration) -> Arc<Liveness> {
        Arc::new(Liveness {
            beats: AtomicU64::new(0),
            nudge: AtomicWaker::new(),
            nudges: AtomicU64::new(0),
            stalled_at: AtomicU64::new(0),
            stall: stall.max(MIN_STALL),
        })
    }

    /// Whether a bound found the core stalled and it has not beaten since.
    fn known_stalled(&self) -> bool {
        self.stalled_at.load(Ordering::Relaxed) == self.beats.load(Ordering::Relaxed) + 1
    }

    /// How often the core beats: an eighth of the stall bound (12.5 ms at the least), at most
    /// every [`MAX_PERIOD`].
    pub(crate) fn period(&self) -> Duration {
        (self.stall / 8).min(MAX_PERIOD)
    }

    /// How long a core may go without a beat once a call's own deadline has passed: two beat
    /// periods and a tick.
    pub(crate) fn grace(&self) -> Duration {
        self.period() * 2 + TICK
    }

    /// The core's heartbeat task (spawned on the core for as long as it serves). Each poll
    /// leaves its waker for the watchdog's nudges.
    pub(crate) async fn beat(self: Arc<Self>) {
        loop {
            let mut sleep = std::pin::pin!(glommio::timer::sleep(self.period()));
            poll_fn(|cx| {
                self.nudge.register(cx.waker());
                sleep.as_mut().poll(cx)
            })
            .await;
            self.beat_once();
        }
    }

    /// One beat.
    pub(super) fn beat_once(&self) {
        self.beats.fetch_add(1, Ordering::Relaxed);
    }

    /// The beats so far.
    pub(super) fn beats(&self) -> u64 {
        self.beats.load(Ordering::Relaxed)
    }

    /// Leaves `waker` to be woken by the next nudge.
    #[cfg(test)]
    pub(super) fn register_nudge(&self, waker: &std::task::Waker) {
        self.nudge.register(waker);
    }

    /// Wakes the heartbeat task from this (another) thread: that wakes a parked executor.
    pub(super) fn nudge(&self) {
        self.nudges.fetch_add(1, Ordering::Relaxed);
        self.nudge.wake();
    }

    /// Nudges sent to this core.
    pub(crate) fn nudges(&self) -> u64 {
        self.nudges.load(Ordering::Relaxed)
    }

    /// Watchdog ticks in the stall bound.
    fn stall_ticks(&self) -> u64 {
        ticks(self.stall)
    }
}

/// Watchdog ticks in `d`, rounded up.
fn ticks(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(TICK.as_nanos())).unwrap_or(u64::MAX)
}

/// One armed bound, shared by the waiting call and the watchdog.
#[derive(Debug)]
struct Armed {
    core: Arc<Liveness>,
    fired: AtomicBool,
    /// It fired with the grace bound, past the call's deadline (set before `fired`).
    late: AtomicBool,
    waker: AtomicWaker,
}

impl Armed {
    /// How long the core went without a beat when this bound fired.
    fn silence(&self) -> Duration {
        if self.late.load(Ordering::Relaxed) {
            self.core.grace()
        } else {
            self.core.stall
        }
    }
}

/// A bound as the watchdog keeps it (only its thread reads or writes `seen` and `due`).
struct Watched {
    armed: Arc<Armed>,
    /// The core's beats when last looked at.
    seen: u64,
    /// The watchdog tick at which to look again.
    due: u64,
    /// The tick at which the call's own deadline has passed and, from then on, the next look
    /// with the grace bound (`u64::MAX`: no deadline).
    late: u64,
    /// The core's beats at the last look with the grace bound (`None`: none yet).
    late_seen: Option<u64>,
}

impl Watched {
    /// A look at the call past its deadline: whether the core has gone a whole grace without a
    /// beat (a running core would have ended the call by now).
    fn stalled_past_deadline(&mut self, tick: u64, beats: u64) -> bool {
        if self.late > tick {
            return false;
        }
        let core = &self.armed.core;
        self.late = tick.saturating_add(ticks(core.grace()));
        self.late_seen.replace(beats) == Some(beats)
    }
}

/// What the watchdog is sent.
enum Watch {
    /// A call's bound.
    Arm(Watched),
    /// A core to nudge when it stops beating.
    Core(Arc<Liveness>),
}

#[derive(Debug)]
struct Watchdog {
    /// Ticks since the watchdog started (it stands still while nothing is armed).
    now: Arc<AtomicU64>,
    arm: mpsc::Sender<Watch>,
}

fn watchdog() -> &'static Watchdog {
    static WATCHDOG: OnceLock<Watchdog> = OnceLock::new();
    WATCHDOG.get_or_init(|| {
        let now = Arc::new(AtomicU64::new(0));
        let (arm, armed) = mpsc::channel();
        let ticks = Arc::clone(&now);
        // If the thread cannot start, bounds never fire: calls wait as they would without one.
        if let Err(e) = std::thread::Builder::new()
            .name("rixl-watchdog".into())
            .spawn(move || {
                off_the_engine_cores();
                watch(&ticks, armed)
            })
        {
            tracing::error!(error = %e, "the watchdog thread could not start: calls to engine cores are not bounded");
        }
        Watchdog { now, arm }
    })
}

/// A thread inherits its creator's CPU affinity, and the first call to arm a bound may come
/// from an engine's core, pinned to its CPU: the watchdog widens its own affinity to the
/// process's CPUs so its ticks do not land on that core.
fn off_the_engine_cores() {
    let mut set = nix::sched::CpuSet::new();
    for &cpu in crate::pool::available_cpus() {
        let _ = set.set(cpu);
    }
    if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set) {
        tracing::debug!(error = %e, "the watchdog keeps its creator's CPU affinity");
    }
}

/// Starts nudging `core` when it stops beating (see [`nudge`]).
pub(crate) fn watch_core(core: &Arc<Liveness>) {
    let _ = watchdog().arm.send(Watch::Core(Arc::clone(core)));
}

/// The watchdog's loop: each tick, takes the newly armed bounds, drops those whose call has
/// ended, and looks at those due: a core that beat since the last look gets another stall
/// bound; one that did not has stalled, and its call is woken to end. With nothing armed, it
/// only looks at the cores' beats every [`nudge::CHECK`] (or sleeps until something is sent,
/// with no core to look at).
fn watch(now: &AtomicU64, armed: mpsc::Receiver<Watch>) {
    let mut live: Vec<Watched> = Vec::new();
    let mut cores = nudge::Cores::default();
    let take = |m: Watch, live: &mut Vec<Watched>, cores: &mut nudge::Cores| match m {
        Watch::Arm(w) => live.push(w),
        Watch::Core(c) => cores.add(&c),
    };
    loop {
        if live.is_empty() {
            // The clock stands still meanwhile; a bound armed now counts from where it stands.
            let m = if cores.is_empty() {
                armed.recv().ok()
            } else {
                match armed.recv_timeout(nudge::CHECK) {
                    Ok(m) => Some(m),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        cores.look(Instant::now());
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => None,
                }
            };
            match m {
                Some(m) => take(m, &mut live, &mut cores),
                None => return,
            }
            if live.is_empty() {
                continue;
            }
        }
        std::thread::sleep(TICK);
        let tick = now.fetch_add(1, Ordering::Relaxed) + 1;
        while let Ok(m) = armed.try_recv() {
            take(m, &mut live, &mut cores);
        }
        cores.look(Instant::now());
        live.retain_mut(|w| {
            let a = &w.armed;
            if Arc::strong_count(a) == 1 {
                return false;
            }
            if w.due > tick && w.late > tick {
                return true;
            }
            let beats = a.core.beats.load(Ordering::Relaxed);
            if w.stalled_past_deadline(tick, beats) {
                // Not marked stalled for other calls: only this call's deadline is past.
                let a = &w.armed;
                a.late.store(true, Ordering::Relaxed);
                a.fired.store(true, Ordering::Release);
                a.waker.wake();
                return false;
            }
            if w.due > tick {
                return true;
            }
            let a = &w.armed;
            if std::mem::replace(&mut w.seen, beats) != beats {
                w.due = tick.saturating_add(a.core.stall_ticks());
                return true;
            }
            a.core
                .stalled_at
                .store(beats.saturating_add(1), Ordering::Relaxed);
            a.fired.store(true, Ordering::Release);
            a.waker.wake();
            false
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

/// The core did not beat for this long while the call waited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stalled(pub(crate) Duration);

/// The bound of one call's wait: the core it waits on, and the call's own deadline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bound<'a> {
    pub(crate) core: &'a Arc<Liveness>,
    /// The call's deadline, from when it started (`None`: it has none of its own). The
    /// bound counts it from its first wait, a reply spin after the start.
    pub(crate) deadline: Option<Duration>,
}

/// Awaits `fut`, the reply of a call to the core `bound.core` beats for (`None`: without a
/// bound); once it has had to wait (its first poll outside a reply spin found it pending), it
/// ends with [`Stalled`] if the core stops beating for its stall bound, or, once the call's
/// deadline has passed, for [`Liveness::grace`].
pub(crate) async fn bounded<F: Future>(
    fut: F,
    bound: Option<Bound<'_>>,
) -> Result<F::Output, Stalled> {
    let mut fut = std::pin::pin!(fut);
    let mut armed: Option<Arc<Armed>> = None;
    poll_fn(move |cx| poll_bounded(fut.as_mut(), bound, &mut armed, cx)).await
}

fn poll_bounded<F: Future>(
    fut: Pin<&mut F>,
    bound: Option<Bound<'_>>,
    armed: &mut Option<Arc<Armed>>,
    cx: &mut Context<'_>,
) -> Poll<Result<F::Output, Stalled>> {
    if let Poll::Ready(v) = fut.poll(cx) {
        return Poll::Ready(Ok(v));
    }
    let Some(bound) = bound else {
        return Poll::Pending;
    };
    let core = bound.core;
    if armed.is_none() {
        if DEFER.with(Cell::get) {
            return Poll::Pending;
        }
        if core.known_stalled() {
            return Poll::Ready(Err(Stalled(core.stall)));
        }
        *armed = arm(core, bound.deadline);
    }
    if let Some(a) = armed {
        a.waker.register(cx.waker());
        if a.fired.load(Ordering::Acquire) {
            return Poll::Ready(Err(Stalled(a.silence())));
        }
    }
    Poll::Pending
}

/// Arms a bound on `core` from now, for a call whose own deadline is `deadline` from now
/// (`None` if the watchdog is gone).
fn arm(core: &Arc<Liveness>, deadline: Option<Duration>) -> Option<Arc<Armed>> {
    let w = watchdog();
    let a = Arc::new(Armed {
        core: Arc::clone(core),
        fired: AtomicBool::new(false),
        late: AtomicBool::new(false),
        waker: AtomicWaker::new(),
    });
    let now = w.now.load(Ordering::Relaxed);
    let watched = Watched {
        armed: Arc::clone(&a),
        seen: core.beats.load(Ordering::Relaxed),
        due: now.saturating_add(core.stall_ticks()).saturating_add(1),
        late: deadline.map_or(u64::MAX, |d| now.saturating_add(ticks(d)).saturating_add(1)),
        late_seen: None,
    };
    w.arm.send(Watch::Arm(watched)).ok()?;
    Some(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_lite::future::{block_on, pending, ready};

    /// Beats `core` `n` times, every 10 ms, from a thread of its own (as the core's task
    /// would); the flag is set once the beats have stopped.
    fn beat_for(core: &Arc<Liveness>, n: u32) -> (std::thread::JoinHandle<()>, Arc<AtomicBool>) {
        let beating = Arc::clone(core);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let beater = std::thread::spawn(move || {
            for _ in 0..n {
                std::thread::sleep(Duration::from_millis(10));
                beating.beat_once();
            }
            stopped.store(true, Ordering::Release);
        });
        (beater, stop)
    }

    /// A bound on `core` for a call without a deadline of its own.
    fn waiting_on(core: &Arc<Liveness>) -> Option<Bound<'_>> {
        Some(Bound {
            core,
            deadline: None,
        })
    }

    #[test]
    fn past_its_deadline_a_call_to_a_silent_core_ends_after_the_grace_not_the_stall_bound() {
        let core = Liveness::new(Duration::from_secs(30));
        let bound = Bound {
            core: &core,
            deadline: Some(Duration::from_millis(100)),
        };
        let t0 = std::time::Instant::now();
        let r = block_on(bounded(pending::<()>(), Some(bound)));
        let took = t0.elapsed();
        assert_eq!(r, Err(Stalled(core.grace())));
        // The deadline, then at most two looks a grace apart (and the watchdog's ticks).
        assert!(took >= Duration::from_millis(100), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        // Only this call's deadline passed: other calls to the core still wait.
        assert!(!core.known_stalled());
    }

    #[test]
    fn past_its_deadline_a_call_to_a_beating_core_waits_until_the_beats_stop() {
        let core = Liveness::new(Duration::from_secs(30));
        // Beats for 1.2 s, over twice the grace, long past the call's 50 ms deadline.
        let (beater, stop) = beat_for(&core, 120);
        let bound = Bound {
            core: &core,
            deadline: Some(Duration::from_millis(50)),
        };
        let r = block_on(bounded(pending::<()>(), Some(bound)));
        assert_eq!(r, Err(Stalled(core.grace())));
        assert!(
            stop.load(Ordering::Acquire),
            "the grace bound fired only once the beats had stopped"
        );
        beater.join().unwrap();
    }

    #[test]
    fn a_reply_that_never_comes_from_a_core_that_never_beats_ends_stalled() {
        let core = Liveness::new(MIN_STALL);
        let r = block_on(bounded(pending::<()>(), waiting_on(&core)));
        assert_eq!(r, Err(Stalled(MIN_STALL)));
    }

    #[test]
    fn once_found_stalled_a_core_fails_calls_at_once_until_it_beats_again() {
        let core = Liveness::new(MIN_STALL);
        let r = block_on(bounded(pending::<()>(), waiting_on(&core)));
        assert_eq!(r, Err(Stalled(MIN_STALL)));
        // The next call to the same silent core ends at its first wait, with nothing armed.
        let mut fut = std::pin::pin!(pending::<()>());
        let mut armed = None;
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert_eq!(
            poll_bounded(fut.as_mut(), waiting_on(&core), &mut armed, &mut cx),
            Poll::Ready(Err(Stalled(MIN_STALL)))
        );
        assert!(armed.is_none());
        // A beat: the core runs again, and calls wait (and arm) as before.
        core.beats.fetch_add(1, Ordering::Relaxed);
        assert!(poll_bounded(fut.as_mut(), waiting_on(&core), &mut armed, &mut cx).is_pending());
        assert!(armed.is_some());
    }

    #[test]
    fn a_core_that_beats_keeps_a_long_call_waiting() {
        let core = Liveness::new(MIN_STALL);
        // Beats for 400 ms, over six stall bounds.
        let (beater, stop) = beat_for(&core, 40);
        let r = block_on(bounded(pending::<()>(), waiting_on(&core)));
        assert_eq!(r, Err(Stalled(MIN_STALL)));
        assert!(
            stop.load(Ordering::Acquire),
            "the bound fired only once the beats had stopped"
        );
        beater.join().unwrap();
    }

    #[test]
    fn a_ready_reply_arms_nothing_and_no_bound_waits_on() {
        let core = Liveness::new(MIN_STALL);
        assert_eq!(block_on(bounded(ready(7), waiting_on(&core))), Ok(7));
        // Without a bound a pending future stays pending, with nothing armed.
        let mut fut = std::pin::pin!(pending::<()>());
        let mut armed = None;
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(poll_bounded(fut.as_mut(), None, &mut armed, &mut cx).is_pending());
        assert!(armed.is_none());
    }

    #[test]
    fn polls_inside_a_reply_spin_arm_nothing_and_the_next_poll_arms() {
        let core = Liveness::new(Duration::from_secs(5));
        let mut fut = std::pin::pin!(pending::<()>());
        let mut armed = None;
        let mut cx = Context::from_waker(std::task::Waker::noop());
        deferring(|| {
            for _ in 0..3 {
                assert!(
                    poll_bounded(fut.as_mut(), waiting_on(&core), &mut armed, &mut cx).is_pending()
                );
            }
        });
        assert!(armed.is_none(), "a spinning call arms no bound");
        assert!(poll_bounded(fut.as_mut(), waiting_on(&core), &mut armed, &mut cx).is_pending());
        assert!(armed.is_some(), "a waiting call arms its bound");
        // Nested spins restore the outer state.
        deferring(|| deferring(|| ()));
        assert!(!DEFER.with(Cell::get));
    }

    #[test]
    fn the_heartbeat_period_is_an_eighth_of_the_bound_within_limits() {
        assert_eq!(Liveness::new(Duration::from_secs(60)).period(), MAX_PERIOD);
        assert_eq!(
            Liveness::new(Duration::from_secs(60)).grace(),
            MAX_PERIOD * 2 + TICK
        );
        assert_eq!(
            Liveness::new(Duration::from_secs(1)).period(),
            Duration::from_millis(125)
        );
        // A bound under MIN_STALL is raised to it.
        assert_eq!(
            Liveness::new(Duration::ZERO).period(),
            Duration::from_micros(12_500)
        );
    }
}
