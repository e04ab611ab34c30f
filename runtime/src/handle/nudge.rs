//! Nudges for cores that stopped beating while parked with work to run.
//!
//! glommio 0.9.0's main loop can park its executor while a task queue is still runnable: when
//! the preemption timer has already fired by the time `run_task_queues` first checks it (the
//! core's thread was descheduled for a preemption period right after polling its rings), the
//! loop reads "ran nothing" as "nothing to run" and sleeps in `io_uring_enter`. With no timer
//! left in the wheel (the heartbeat's had just fired) and the runnable tasks' wakers already
//! spent, nothing on the core wakes it again: the core stops for good. (Fixed upstream in
//! glommio/glommio#53, not in a release on crates.io today.) In the emulated guest, with six
//! busy agents on two vCPUs, this stopped one churn member's core in one CI run.
//!
//! Any wake from another thread writes the executor's eventfd, which ends such a sleep; the
//! next turn of its loop runs the queues. So the watchdog looks at every core's beats every
//! [`CHECK`], and wakes the heartbeat task of a core silent for its grace (two beat periods and
//! a tick) from the watchdog's thread: a parked core resumes within about half a second
//! (`examples/glommio_park.rs` shows both the park and a foreign wake ending it). A
//! core that is silent because a job blocks its thread is nudged too, which costs it one
//! queued wake-up; nudges back off (after 1, 2, 4, ... silent looks).

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::bound::Liveness;

/// How often the watchdog looks at the cores' beats.
pub(super) const CHECK: Duration = Duration::from_millis(200);

/// A core as the watchdog watches its beats.
struct Watched {
    core: Weak<Liveness>,
    /// Its beats when last seen to change, and when.
    seen: u64,
    since: Instant,
    /// Looks since `since` that found it silent past its grace.
    silent: u32,
}

/// The cores the watchdog nudges.
#[derive(Default)]
pub(super) struct Cores {
    watched: Vec<Watched>,
    last: Option<Instant>,
}

impl Cores {
    /// Watches `core` from now on (until every handle to it is gone).
    pub(super) fn add(&mut self, core: &Arc<Liveness>) {
        self.watched.push(Watched {
            core: Arc::downgrade(core),
            seen: core.beats(),
            since: Instant::now(),
            silent: 0,
        });
    }

    pub(super) fn is_empty(&self) -> bool {
        self.watched.is_empty()
    }

    /// Looks at the cores if [`CHECK`] has passed since the last look; nudges those silent
    /// for their grace.
    pub(super) fn look(&mut self, now: Instant) {
        if self.last.is_some_and(|l| now.duration_since(l) < CHECK) {
            return;
        }
        self.last = Some(now);
        self.watched.retain_mut(|w| {
            let Some(core) = w.core.upgrade() else {
                return false;
            };
            let beats = core.beats();
            if beats != w.seen {
                w.seen = beats;
                w.since = now;
                w.silent = 0;
                return true;
            }
            let silence = now.duration_since(w.since);
            if silence >= core.grace() {
                w.silent = w.silent.saturating_add(1);
                if w.silent.is_power_of_two() {
                    tracing::warn!(?silence, nudges = w.silent, "an engine core has not beaten: nudged from the watchdog (a parked executor resumes; a blocked thread does not)");
                    core.nudge();
                }
            }
            true
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Wake, Waker};

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_silent_core_is_nudged_with_backoff_and_a_beating_one_never() {
        let silent = Liveness::new(Duration::from_millis(800)); // period 100 ms, grace 220 ms
        let beating = Liveness::new(Duration::from_millis(800));
        let (s_wakes, b_wakes) = (
            Arc::new(Count(AtomicUsize::new(0))),
            Arc::new(Count(AtomicUsize::new(0))),
        );
        let mut cores = Cores::default();
        cores.add(&silent);
        cores.add(&beating);
        let t0 = Instant::now();
        for i in 1..=12u32 {
            // The heartbeat registers its waker each time it is polled.
            silent.register_nudge(&Waker::from(Arc::clone(&s_wakes)));
            beating.register_nudge(&Waker::from(Arc::clone(&b_wakes)));
            beating.beat_once();
            cores.look(t0 + CHECK * i);
        }
        // Silent from the start: past its grace from the second look on, so 11 silent looks,
        // nudged at the 1st, 2nd, 4th and 8th of them.
        assert_eq!(s_wakes.0.load(Ordering::Relaxed), 4);
        assert_eq!(silent.nudges(), 4);
        assert_eq!(b_wakes.0.load(Ordering::Relaxed), 0);
        // A beat ends the silence: the next silent stretch starts its back-off again.
        silent.beat_once();
        cores.look(t0 + CHECK * 13);
        silent.register_nudge(&Waker::from(Arc::clone(&s_wakes)));
        cores.look(t0 + CHECK * 15);
        assert_eq!(s_wakes.0.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn a_core_whose_handles_are_gone_is_no_longer_watched() {
        let mut cores = Cores::default();
        cores.add(&Liveness::new(Duration::from_secs(1)));
        assert!(!cores.is_empty());
        cores.look(Instant::now());
        assert!(cores.is_empty());
    }
}
