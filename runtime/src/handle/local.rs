//! Calls made from a task on the engine's own core. Such a call needs no hand-off: its job is
//! started right there, on this executor, instead of going over the core's channel (which
//! wakes the serving task through glommio's cross-thread path and answers through a oneshot
//! woken from another thread). A serving engine whose step loop runs on the engine's core
//! ([`EngineHandle::run_on_core`], `Agent::run_on_core`) pays for a transfer only what the
//! engine's own path costs.

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::Poll;
use std::time::Instant;

use super::serve::{run_job, Inbox};
use super::{EngineHandle, Job, Lost, Served};
use crate::error::RuntimeError;

thread_local! {
    /// The core this thread serves, while its serving task runs.
    static HERE: RefCell<Option<Here>> = const { RefCell::new(None) };
}

struct Here {
    served: Served,
    inbox: Rc<Inbox>,
}

/// How an engine handle's calls reached the core.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HandOffCounters {
    /// Calls made on the engine's own core: started there, with no hand-off.
    pub on_core: u64,
    /// Calls sent to the core from another thread.
    pub sent: u64,
    /// Of the sent calls, those the core's serving task found by looking (while it spun for
    /// the next call, or right after the last one) rather than by being woken for them: they
    /// cost no turn of the core's reactor.
    pub taken_without_wake: u64,
    /// Calls whose caller polled for the reply (`EngineConfig::reply_spin`) before waiting.
    pub reply_spins: u64,
    /// Of those, the ones whose reply came within the spin: no wake-up was needed.
    pub replies_caught: u64,
}

impl std::ops::AddAssign for HandOffCounters {
    fn add_assign(&mut self, o: HandOffCounters) {
        self.on_core += o.on_core;
        self.sent += o.sent;
        self.taken_without_wake += o.taken_without_wake;
        self.reply_spins += o.reply_spins;
        self.replies_caught += o.replies_caught;
    }
}

/// The counters behind [`HandOffCounters`], shared by a handle's clones.
#[derive(Debug, Default)]
pub(super) struct HandOffs {
    on_core: AtomicU64,
    sent: AtomicU64,
    taken_without_wake: AtomicU64,
    reply_spins: AtomicU64,
    replies_caught: AtomicU64,
    /// Reply spins in a row that ended without the reply.
    reply_misses: AtomicU32,
    /// Calls that could have spun, for the probes.
    reply_calls: AtomicU32,
}

/// Reply spins in a row that may miss before callers stop spinning (and only probe).
const REPLY_SPIN_MISSES: u32 = 8;

/// While callers do not spin, every this many calls spins once to see if replies come
/// quickly again.
const REPLY_SPIN_PROBE_EVERY: u32 = 64;

impl HandOffs {
    /// Whether a caller spins for its reply: while recent spins caught their replies, and
    /// as a probe every [`REPLY_SPIN_PROBE_EVERY`] calls once they stopped doing so (replies
    /// slower than the spin, such as an emulated NIC's, or a CPU shared with the core).
    fn spin_for_reply(&self) -> bool {
        let calls = self.reply_calls.fetch_add(1, Ordering::Relaxed);
        self.reply_misses.load(Ordering::Relaxed) < REPLY_SPIN_MISSES
            || calls.is_multiple_of(REPLY_SPIN_PROBE_EVERY)
    }

    /// How a reply spin ended.
    fn spun(&self, caught: bool) {
        self.reply_spins.fetch_add(1, Ordering::Relaxed);
        if caught {
            self.replies_caught.fetch_add(1, Ordering::Relaxed);
            self.reply_misses.store(0, Ordering::Relaxed);
        } else {
            let _ = self
                .reply_misses
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                    Some(m.saturating_add(1))
                });
        }
    }

    /// The serving task found a sent call without waiting for it.
    pub(super) fn note_taken_without_wake(&self) {
        self.taken_without_wake.fetch_add(1, Ordering::Relaxed);
    }
}

/// While alive, this thread is the core of the engine `served` serves: calls to its handle
/// from here start their jobs at once. Dropped when the serving task ends.
pub(super) struct OnCore;

impl OnCore {
    pub(super) fn enter(served: &Served, inbox: &Rc<Inbox>) -> OnCore {
        HERE.with(|h| {
            *h.borrow_mut() = Some(Here {
                served: served.clone(),
                inbox: Rc::clone(inbox),
            })
        });
        OnCore
    }
}

impl Drop for OnCore {
    fn drop(&mut self) {
        // At thread exit the slot may already be gone: nothing is left to clear then.
        let _ = HERE.try_with(|h| h.borrow_mut().take());
    }
}

/// What the core serves, when this thread is engine `id`'s core and it still takes calls (not
/// shutting down).
fn served_here(id: u64) -> Option<Served> {
    HERE.try_with(|h| match &*h.borrow() {
        Some(here) if here.served.id == id && !here.inbox.stopping.get() => {
            Some(here.served.clone())
        }
        _ => None,
    })
    .ok()
    .flatten()
}

impl EngineHandle {
    /// Starts `job` on the engine's core: at once when called there (`Ok(false)`), else sent
    /// over the core's channel (`Ok(true)`: the caller then bounds its wait by the core's
    /// heartbeat, see [`super::bound`]; a task on the core itself stops with the core).
    pub(super) fn start(&self, job: Job) -> Result<bool, Lost> {
        if let Some(served) = served_here(self.id) {
            self.hand_offs.on_core.fetch_add(1, Ordering::Relaxed);
            run_job(&served, job);
            return Ok(false);
        }
        self.hand_offs.sent.fetch_add(1, Ordering::Relaxed);
        self.tx
            .unbounded_send(super::Command::Run(job))
            .map(|()| true)
            .map_err(|_| Lost::Gone)
    }

    /// How this handle's calls (and its clones') reached the core so far.
    pub fn hand_off_counters(&self) -> HandOffCounters {
        HandOffCounters {
            on_core: self.hand_offs.on_core.load(Ordering::Relaxed),
            sent: self.hand_offs.sent.load(Ordering::Relaxed),
            taken_without_wake: self.hand_offs.taken_without_wake.load(Ordering::Relaxed),
            reply_spins: self.hand_offs.reply_spins.load(Ordering::Relaxed),
            replies_caught: self.hand_offs.replies_caught.load(Ordering::Relaxed),
        }
    }

    /// Runs `f`'s future as a task on the engine's core and returns its output. Calls that
    /// task makes to this engine (through any clone of this handle, or an agent transfer on
    /// this engine's rail) start on the core without the cross-thread hand-off. Dropping the
    /// returned future cancels the task at its next turn (the transfers it had started are
    /// detached: the in-flight table keeps their memory until the NIC is done). Called on the
    /// core itself, the task is spawned there directly.
    ///
    /// # Errors
    /// [`RuntimeError::EngineGone`] when the engine has shut down (`f` is dropped unrun) and
    /// [`RuntimeError::EnginePanic`] when the task panicked (contained: the core keeps
    /// serving).
    pub async fn run_on_core<T, F, Fut>(&self, f: F) -> Result<T, RuntimeError>
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T> + 'static,
    {
        self.on_core_or_cancel(false, None, move |_| f())
            .await
            .map_err(RuntimeError::from)
    }
}

/// Polls of a spinning caller between two clock reads.
const POLLS_PER_CLOCK_READ: u32 = 32;

/// Whether this thread is an engine's core (its serving task is running here).
fn on_an_engine_core() -> bool {
    HERE.try_with(|h| h.borrow().is_some()).unwrap_or(false)
}

impl EngineHandle {
    /// Awaits `call` (this handle's reply, or several calls' joined), polling it in a loop
    /// for up to `EngineConfig::reply_spin` when its first poll finds it pending, so a reply
    /// that comes back within that costs the caller no wake-up. A spin pays when its reply
    /// came within twice the window (the clock is read every [`POLLS_PER_CLOCK_READ`]
    /// polls). Not on an engine core (the reply may need this very thread), and only while
    /// such spins pay (see
    /// [`HandOffs::spin_for_reply`]). Polling again is harmless: the futures here only
    /// re-register their waker.
    pub(crate) async fn spin_for_reply<F: Future>(&self, call: F) -> F::Output {
        let mut call = std::pin::pin!(call);
        let mut first = true;
        std::future::poll_fn(move |cx| {
            if !std::mem::take(&mut first)
                || self.reply_spin.is_zero()
                || on_an_engine_core()
                || !self.hand_offs.spin_for_reply()
            {
                return call.as_mut().poll(cx);
            }
            // The call does not wait while it spins: it arms no bound (see `bound`).
            let spun = super::bound::deferring(|| {
                if let Poll::Ready(v) = call.as_mut().poll(cx) {
                    return Some(v);
                }
                let start = Instant::now();
                loop {
                    for _ in 0..POLLS_PER_CLOCK_READ {
                        std::hint::spin_loop();
                        if let Poll::Ready(v) = call.as_mut().poll(cx) {
                            // A reply caught only after the window (this thread was taken off
                            // its CPU mid-spin, or shares it with the core) did not pay: it
                            // counts as a miss.
                            self.hand_offs
                                .spun(start.elapsed() <= self.reply_spin.saturating_mul(2));
                            return Some(v);
                        }
                    }
                    if start.elapsed() >= self.reply_spin {
                        self.hand_offs.spun(false);
                        return None;
                    }
                }
            });
            match spun {
                Some(v) => Poll::Ready(v),
                // Now it waits: this poll arms its bounds.
                None => call.as_mut().poll(cx),
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_spins_stop_after_misses_in_a_row_and_a_caught_probe_restarts_them() {
        let h = HandOffs::default();
        // Spins while they catch their replies.
        for _ in 0..100 {
            assert!(h.spin_for_reply());
            h.spun(true);
        }
        // After REPLY_SPIN_MISSES misses in a row, only every REPLY_SPIN_PROBE_EVERY-th call.
        for _ in 0..REPLY_SPIN_MISSES {
            assert!(h.spin_for_reply());
            h.spun(false);
        }
        let spun: u32 = (0..REPLY_SPIN_PROBE_EVERY * 4)
            .map(|_| {
                let s = h.spin_for_reply();
                if s {
                    h.spun(false);
                }
                u32::from(s)
            })
            .sum();
        assert_eq!(spun, 4);
        // A probe that catches its reply: callers spin again.
        while !h.spin_for_reply() {}
        h.spun(true);
        assert!(h.spin_for_reply());
        let c = (
            h.reply_spins.load(Ordering::Relaxed),
            h.replies_caught.load(Ordering::Relaxed),
        );
        assert_eq!(c, (100 + u64::from(REPLY_SPIN_MISSES) + 4 + 1, 101));
    }
}
