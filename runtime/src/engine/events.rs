//! Device async events (port up/down, queue pair, CQ and device faults), handled on the
//! engine's core. A helper thread blocks on the device's async event fd (the syscall side, as
//! the CQ's completion events are waited off the core) and hands each event to a task on the
//! core, which fails the connections it concerns at once: their transfers end with
//! [`TransferError::Device`] well inside their deadlines instead of at them.

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_lite::StreamExt;
use rixl_proto::DeviceFault;
use rixl_verbs::{AsyncEvent, Context};

use super::Inner;
use crate::error::TransferError;

/// How often the reader thread checks whether its engine stopped.
const STOP_CHECK: Duration = Duration::from_millis(200);

/// Starts reading `ctx`'s async events for the engine `inner`; the reader ends once `stop` is
/// set (engine shutdown) or the engine is gone.
pub(super) fn start(inner: &Rc<Inner>, ctx: Context, stop: Arc<AtomicBool>) {
    let (tx, mut rx) = futures_channel::mpsc::unbounded::<AsyncEvent>();
    let id = inner.id;
    let spawned = std::thread::Builder::new()
        .name(format!("rixl-events-{id}"))
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) && !tx.is_closed() {
                match ctx.next_async_event(STOP_CHECK) {
                    Ok(Some(ev)) => {
                        if tx.unbounded_send(ev).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(engine = id, error = %e, "reading device async events failed; no longer watching them");
                        return;
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(engine = id, error = %e, "cannot start the async event reader");
        return;
    }
    let weak = Rc::downgrade(inner);
    glommio::spawn_local(async move {
        while let Some(ev) = rx.next().await {
            let Some(inner) = weak.upgrade() else {
                return;
            };
            // A panic handling one event must not stop the reading of the next ones.
            if let Err(p) = crate::supervise::catching_sync(|| handle(&inner, ev)) {
                inner.note_task_panic();
                tracing::error!(engine = inner.id, panic = %p.0, "handling an async event panicked");
            }
        }
    })
    .detach();
}

/// Applies one event on the core.
fn handle(inner: &Inner, ev: AsyncEvent) {
    let port = inner.cfg.connect.port;
    inner.core.borrow_mut().counters_mut().async_events += 1;
    let (fault, conns) = match ev {
        AsyncEvent::PortActive { port: p } if p == port => {
            inner.port_up.set(true);
            tracing::info!(engine = inner.id, port, "port active");
            return;
        }
        AsyncEvent::PortError { port: p } if p == port => {
            inner.port_up.set(false);
            tracing::warn!(
                engine = inner.id,
                port,
                "port down: failing its connections"
            );
            (
                DeviceFault::PortDown { port },
                inner.core.borrow().connection_ids(),
            )
        }
        AsyncEvent::QueuePairFatal { qpn }
        | AsyncEvent::QueuePairRequestError { qpn }
        | AsyncEvent::QueuePairAccessError { qpn } => {
            let fault = match ev {
                AsyncEvent::QueuePairFatal { .. } => DeviceFault::QueuePairFatal,
                AsyncEvent::QueuePairRequestError { .. } => DeviceFault::QueuePairRequestError,
                _ => DeviceFault::QueuePairAccessError,
            };
            let conn = inner.core.borrow().conn_of_qpn(qpn);
            tracing::warn!(engine = inner.id, qpn, ?fault, "queue pair fault");
            (fault, conn.into_iter().collect())
        }
        AsyncEvent::CompletionQueueError => (
            DeviceFault::CompletionQueueError,
            inner.core.borrow().connection_ids(),
        ),
        AsyncEvent::DeviceFatal => (
            DeviceFault::DeviceFatal,
            inner.core.borrow().connection_ids(),
        ),
        other => {
            tracing::debug!(engine = inner.id, event = ?other, "async event ignored");
            return;
        }
    };
    let failed = fail(inner, &TransferError::Device(fault), conns);
    inner.core.borrow_mut().counters_mut().event_failures += failed;
}

/// Fails every live connection with `err` (a failed CQ poll, a panicked progress task);
/// returns how many were failed.
pub(super) fn fail_all(inner: &Inner, err: &TransferError) -> u64 {
    let conns = inner.core.borrow().connection_ids();
    fail(inner, err, conns)
}

/// Fails each of `conns` still live with `err`; returns how many were.
fn fail(inner: &Inner, err: &TransferError, conns: Vec<rixl_proto::ConnId>) -> u64 {
    let reason = err.to_string();
    let mut failed = 0;
    for conn in conns {
        let live = matches!(
            inner.core.borrow().state(conn),
            Some(rixl_proto::ConnState::Ready | rixl_proto::ConnState::Prepared)
        );
        if live {
            failed += 1;
            inner.fail_connection(conn, &reason, err);
        }
    }
    failed
}
