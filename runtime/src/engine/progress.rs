//! The per-core progress task: reaps completions in batches and routes them through the core
//! (which wakes the futures); busy-polls (yielding) only while work is in flight, parks when
//! nothing is, and expires deadlines.

use std::future::poll_fn;
use std::rc::Rc;
use std::task::Poll;
use std::time::{Duration, Instant};

use rixl_proto::Completion;
use rixl_verbs::WorkCompletion;

use super::nic::VerbsCq;
use super::{Inner, PollMode};
use crate::error::TransferError;
use crate::supervise::{catching, Panicked};

/// Busy mode with only receives awaited, after `recv_spin_polls` empty polls: the poll interval.
const RECV_POLL_INTERVAL: Duration = Duration::from_micros(200);

/// Event mode: the longest one wait for a completion event blocks.
const EVENT_WAIT: Duration = Duration::from_millis(20);

/// The progress task under supervision. A panic in it may have lost completions it had reaped,
/// so no transfer of the engine can be trusted to end by itself: every connection is failed
/// (their transfers end with [`TransferError::EnginePanic`] once the NIC has flushed their
/// work, and the agent replaces them on the next transfers), and the task starts again.
pub(super) async fn supervised(inner: Rc<Inner>) {
    loop {
        match catching(run(Rc::clone(&inner))).await {
            Ok(()) => return,
            Err(Panicked(msg)) => {
                let err = TransferError::EnginePanic(msg);
                let failed = super::events::fail_all(&inner, &err);
                inner.core.borrow_mut().counters_mut().progress_restarts += 1;
                tracing::error!(engine = inner.id, error = %err, connections = failed, "the progress task panicked: its connections were failed, and it starts again");
            }
        }
    }
}

async fn run(inner: Rc<Inner>) {
    let batch = inner.cfg.poll_batch.max(1);
    let mut wcs = vec![WorkCompletion::default(); batch];
    let mut out = vec![Completion::success(0, 0); batch];
    loop {
        if let Some(pump) = inner.pump.borrow().as_ref() {
            pump();
        }
        let turn = inner.core.borrow_mut().next_turn();
        // Read the clock only every few iterations (clock reads are syscalls on some clock
        // sources); event-mode iterations are slow anyway.
        let tick = turn.is_multiple_of(32) || inner.cfg.poll_mode == PollMode::Event;
        if tick {
            injected_faults(&inner);
        }
        let n = {
            let mut core = inner.core.borrow_mut();
            let mut cq = VerbsCq {
                cq: &inner.cq,
                wcs: &mut wcs,
                failed: &inner.cq_failed,
            };
            core.reap(&mut cq, &mut out)
        };
        if inner.cq_failed.replace(false) {
            let fault = TransferError::Device(rixl_proto::DeviceFault::CompletionQueueError);
            super::events::fail_all(&inner, &fault);
        }
        // On a tick, with or without completions (steady completions on one connection must
        // not hold back another's deadline): deadlines are started and checked with a clock
        // read here, never with a cached one (see `rixl_proto::deadline`).
        if tick {
            let expired = {
                let mut core = inner.core.borrow_mut();
                core.deadlines_len() > 0 && core.expire(Instant::now()) > 0
            };
            if expired {
                inner.kick_progress();
            }
        }
        if n > 0 {
            inner.quiet_polls.set(0);
            // Let the woken futures run.
            futures_lite::future::yield_now().await;
            continue;
        }
        inner
            .quiet_polls
            .set(inner.quiet_polls.get().saturating_add(1));
        let activity = {
            let mut core = inner.core.borrow_mut();
            core.counters_mut().empty_polls += 1;
            core.activity()
        };
        let idle = activity.idle;
        if idle && inner.shutdown.get() {
            tracing::info!(engine = inner.id, "progress task stopped");
            return;
        }
        if idle && !activity.waiting_recv {
            // Park until a submitter kicks us: no CPU while idle.
            {
                let mut core = inner.core.borrow_mut();
                core.counters_mut().parks += 1;
                // Idle: nothing awaits a completion (queued transfers keep their deadlines).
                core.on_park();
            }
            poll_fn(|cx| {
                if inner.kick.replace(false) {
                    Poll::Ready(())
                } else {
                    *inner.progress_waker.borrow_mut() = Some(cx.waker().clone());
                    Poll::Pending
                }
            })
            .await;
            continue;
        }
        let spin_for_recv =
            activity.waiting_recv && inner.quiet_polls.get() < inner.cfg.recv_spin_polls;
        match inner.cfg.poll_mode {
            PollMode::Busy if !idle || spin_for_recv => futures_lite::future::yield_now().await,
            _ => wait_off_core(&inner, &mut wcs, &mut out).await,
        }
    }
}

/// The progress loop's fail points (nothing without the `failpoints` feature): a panic
/// (`rixl-progress`), or every queue pair of the engine moved to ERROR as a fatal QP fault
/// would (`rixl-qp-error`, the fault trials' "QP forced to error").
fn injected_faults(inner: &Inner) {
    crate::supervise::fail_point("rixl-progress");
    if crate::supervise::fail_return("rixl-qp-error") {
        let n = super::events::fail_all(inner, &TransferError::Flushed);
        tracing::warn!(
            engine = inner.id,
            connections = n,
            "fail point: queue pairs forced to error"
        );
    }
}

/// Event mode (or only receives pending): arm the CQ, poll again (drain-after-arm), then wait
/// for the event off the core; without an event channel, a short timer instead of spinning.
async fn wait_off_core(inner: &Rc<Inner>, wcs: &mut [WorkCompletion], out: &mut [Completion]) {
    if inner.cq.req_notify(false).is_err() {
        glommio::timer::sleep(RECV_POLL_INTERVAL).await;
        return;
    }
    let n = {
        let mut cq = VerbsCq {
            cq: &inner.cq,
            wcs,
            failed: &inner.cq_failed,
        };
        cq_poll_route(inner, &mut cq, out)
    };
    if n > 0 {
        return;
    }
    inner.core.borrow_mut().counters_mut().event_waits += 1;
    let cq = inner.cq.clone();
    let _ = glommio::executor()
        .spawn_blocking(move || cq.wait_event(Some(EVENT_WAIT)))
        .await;
}

/// Polls once and routes each completion (not counted as a poll: the drain after arming).
fn cq_poll_route(inner: &Inner, cq: &mut VerbsCq<'_>, out: &mut [Completion]) -> usize {
    use rixl_proto::CompletionSource;
    let n = cq.poll(out);
    let mut core = inner.core.borrow_mut();
    for c in &out[..n] {
        core.route(c);
    }
    n
}
