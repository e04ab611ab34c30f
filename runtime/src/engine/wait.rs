//! The completion side of a transfer: the guard that detaches a slot whose future went away, the
//! future's own reap of the CQ (with buffers the engine keeps), and the wait for a slot's result.

use std::future::poll_fn;
use std::rc::Rc;
use std::task::Poll;

use rixl_proto::{Completion, Core, Posting};
use rixl_verbs::WorkCompletion;

use super::nic::{VerbsCq, VerbsQueue};
use super::Inner;
use crate::error::TransferError;
use crate::probe::{self, Point};

/// Completions a waiting future reaps at once.
const REAP_NOW_BATCH: usize = 8;

/// Detaches a slot when the transfer future goes away before taking its result.
pub(super) struct SlotGuard {
    pub(super) inner: Rc<Inner>,
    pub(super) posting: Posting,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if !self.posting.finished() {
            let slot = self.posting.slot();
            let released = self.inner.core.borrow_mut().detach(slot);
            tracing::debug!(
                slot = slot.key,
                released,
                "transfer future dropped; slot detached"
            );
        }
    }
}

/// The completion buffers a future's own reap fills.
pub(super) struct ReapBuffers {
    wcs: [WorkCompletion; REAP_NOW_BATCH],
    out: [Completion; REAP_NOW_BATCH],
}

impl Default for ReapBuffers {
    fn default() -> Self {
        ReapBuffers {
            wcs: [WorkCompletion::default(); REAP_NOW_BATCH],
            out: [Completion::success(0, 0); REAP_NOW_BATCH],
        }
    }
}

/// Polls the CQ up to `polls` times (at least once), routing what it reaps, until `done` is
/// ready after a reap; stops early if the CQ poll failed (the progress task fails the engine's
/// connections then). The completion buffers are the engine's, not the calling future's
/// (which every `.await` moves).
pub(super) fn reap_until<T>(
    inner: &Inner,
    core: &mut Core<VerbsQueue>,
    polls: u32,
    done: impl FnMut(&mut Core<VerbsQueue>) -> Poll<T>,
) -> Poll<T> {
    match inner.reap_buffers.try_borrow_mut() {
        Ok(mut b) => {
            let ReapBuffers { wcs, out } = &mut *b;
            reap_into(inner, core, polls, done, wcs, out)
        }
        // Not reentered today; if it ever is, the inner reap fills buffers of its own.
        Err(_) => {
            let mut b = ReapBuffers::default();
            reap_into(inner, core, polls, done, &mut b.wcs, &mut b.out)
        }
    }
}

/// [`reap_until`] with its buffers.
#[inline(always)]
fn reap_into<T>(
    inner: &Inner,
    core: &mut Core<VerbsQueue>,
    polls: u32,
    mut done: impl FnMut(&mut Core<VerbsQueue>) -> Poll<T>,
    wcs: &mut [WorkCompletion],
    out: &mut [Completion],
) -> Poll<T> {
    for poll in 0..polls.max(1) {
        // A pause only between two polls: none after the last, so a future that polls once
        // and waits (others in flight) pays none. (Emulated CPUs leave their translated code
        // on every PAUSE.)
        if poll > 0 {
            std::hint::spin_loop();
        }
        let mut cq = VerbsCq {
            cq: &inner.cq,
            wcs: &mut *wcs,
            failed: &inner.cq_failed,
        };
        if core.reap(&mut cq, out) > 0 {
            inner.quiet_polls.set(0);
            if let Poll::Ready(r) = done(core) {
                return Poll::Ready(r);
            }
        }
        if inner.cq_failed.get() {
            break;
        }
    }
    Poll::Pending
}

/// Waits for the slot of `guard` to complete and takes its result. A future that finds its own
/// completion in the CQ ends without a round trip through the progress task (on a fast device
/// the completion often arrives before the future first waits); the waker is registered only
/// after that reap, so such a future does not wake itself.
///
/// The completion mode follows from what is in flight: a transfer alone on its engine (a
/// request-response loop, a lone small READ) polls the CQ itself for up to
/// [`EngineConfig::spin_polls`](super::EngineConfig::spin_polls) polls before it waits, as
/// perftest's loop does, so its completion costs no wake-up and no executor turn; with other
/// transfers in flight it polls once and leaves the rest to the progress task, which serves
/// them all.
pub(super) async fn wait_slot(guard: &mut SlotGuard) -> Result<(), TransferError> {
    // The guard's two fields borrowed apart (no clone of the engine's `Rc` per wait).
    let SlotGuard { inner, posting } = guard;
    let inner: &Inner = inner;
    let r = poll_fn(|cx| {
        let mut core = inner.core.borrow_mut();
        if let Poll::Ready(r) = core.try_finish(posting) {
            return Poll::Ready(r);
        }
        // A queued transfer's flush is a task that has not run yet when it first waits:
        // spinning for it would only delay it (after the flush, the flush's own reap or the
        // progress task completes it).
        let polls = if core.inflight_len() <= 1 && !posting.queued() {
            inner.cfg.spin_polls
        } else {
            1
        };
        let reaped = reap_until(inner, &mut core, polls, |c| c.try_finish(posting));
        probe::stamp(Point::Reaped);
        if reaped.is_ready() {
            return reaped;
        }
        core.poll_finish(posting, cx)
    })
    .await;
    probe::stamp(Point::Finished);
    r
}
