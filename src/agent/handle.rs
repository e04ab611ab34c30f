//! A transfer in flight as the caller holds it: a `Future`, that a plain step loop can also
//! poll with [`Transfer::status`] (vLLM's `check_xfer_state`), and cancel
//! ([`Transfer::cancel`], NIXL's `releaseXferReq`) or drop.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::runtime::TransferStats;

use super::AgentError;

/// Per-call options of a transfer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallOptions {
    /// Deadline of the whole call, a connection set-up included (`None`: the engine's
    /// `transfer_timeout`). Past it the transfer ends with
    /// [`crate::runtime::TransferError::Timeout`] (its connection is failed, and its memory
    /// kept until the flush), or with [`AgentError::ConnectTimeout`] while still connecting.
    pub timeout: Option<Duration>,
    /// A message the peer receives on its notification stream after every descriptor has
    /// completed (at most [`super::MAX_NOTIFICATION`] bytes).
    pub notification: Option<Vec<u8>>,
}

impl CallOptions {
    /// Default options.
    pub fn new() -> Self {
        Self::default()
    }

    /// With a deadline.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Options carrying `notification` alone (the shape of the calls that take one).
    pub(crate) fn notifying(notification: Option<&[u8]>) -> Self {
        CallOptions {
            notification: notification.map(<[u8]>::to_vec),
            ..CallOptions::default()
        }
    }

    /// The engine's options for a call with `deadline`: the time left to it.
    pub(crate) fn engine(&self, deadline: std::time::Instant) -> crate::runtime::TransferOptions {
        let mut o = crate::runtime::TransferOptions::default();
        o.timeout = Some(deadline.saturating_duration_since(std::time::Instant::now()));
        o
    }

    /// With a notification.
    #[must_use]
    pub fn notification(mut self, msg: impl Into<Vec<u8>>) -> Self {
        self.notification = Some(msg.into());
        self
    }
}

/// Where a [`Transfer`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransferStatus {
    /// Still running.
    Pending,
    /// Every descriptor completed (and the notification, if any, was sent).
    Done,
    /// It failed; awaiting the transfer (or [`Transfer::take_result`]) gives the error.
    Failed,
    /// [`Transfer::cancel`] stopped it.
    Cancelled,
}

type Running = Pin<Box<dyn Future<Output = Result<TransferStats, AgentError>> + Send>>;

enum State {
    Running(Running),
    Finished {
        result: Option<Result<TransferStats, AgentError>>,
        ok: bool,
    },
    Cancelled,
}

/// A READ or WRITE in flight. Await it, or poll [`Self::status`] from a loop that has no async
/// context; [`Self::cancel`] or drop it to abandon it.
///
/// Cancelling (or dropping) stops it at once on the caller's side; on the engine's core, its
/// requests not yet posted are never posted and the posted ones drain. Its memory stays
/// registered, held by the engine's in-flight table, until the NIC is done with it
/// ([`super::Registration::release`] waits for that), so abandoning a transfer never frees
/// memory the NIC may still touch, and work queued behind it does not wait for it.
#[must_use = "a transfer is cancelled when dropped"]
pub struct Transfer {
    state: State,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("status", &self.peek())
            .finish()
    }
}

impl Transfer {
    pub(crate) fn new(
        fut: impl Future<Output = Result<TransferStats, AgentError>> + Send + 'static,
    ) -> Self {
        Transfer {
            state: State::Running(Box::pin(fut)),
        }
    }

    /// A transfer that failed before it started.
    pub(crate) fn failed(e: AgentError) -> Self {
        Transfer {
            state: State::Finished {
                result: Some(Err(e)),
                ok: false,
            },
        }
    }

    fn peek(&self) -> TransferStatus {
        match &self.state {
            State::Running(_) => TransferStatus::Pending,
            State::Finished { ok: true, .. } => TransferStatus::Done,
            State::Finished { ok: false, .. } => TransferStatus::Failed,
            State::Cancelled => TransferStatus::Cancelled,
        }
    }

    fn drive(&mut self, cx: &mut Context<'_>) {
        if let State::Running(fut) = &mut self.state {
            if let Poll::Ready(r) = fut.as_mut().poll(cx) {
                let ok = r.is_ok();
                self.state = State::Finished {
                    result: Some(r),
                    ok,
                };
            }
        }
    }

    /// Advances the transfer without waiting and says where it stands. The RDMA work runs on
    /// the engine's core whether or not this is called; calling it moves the caller-side
    /// steps on (the connection on first use, the notification after the data).
    pub fn status(&mut self) -> TransferStatus {
        self.drive(&mut Context::from_waker(Waker::noop()));
        self.peek()
    }

    /// The result, once the transfer has ended (`None` while it runs, or once taken). A
    /// cancelled transfer gives [`AgentError::Cancelled`].
    pub fn take_result(&mut self) -> Option<Result<TransferStats, AgentError>> {
        self.drive(&mut Context::from_waker(Waker::noop()));
        match &mut self.state {
            State::Running(_) => None,
            State::Finished { result, .. } => result.take(),
            State::Cancelled => Some(Err(AgentError::Cancelled)),
        }
    }

    /// Abandons the transfer (see the type's docs); its status is then
    /// [`TransferStatus::Cancelled`]. Does nothing once it has ended.
    pub fn cancel(&mut self) {
        if matches!(self.state, State::Running(_)) {
            self.state = State::Cancelled;
        }
    }
}

impl Future for Transfer {
    type Output = Result<TransferStats, AgentError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        this.drive(cx);
        match &mut this.state {
            State::Running(_) => Poll::Pending,
            State::Finished { result, .. } => {
                Poll::Ready(result.take().unwrap_or(Err(AgentError::ResultTaken)))
            }
            State::Cancelled => Poll::Ready(Err(AgentError::Cancelled)),
        }
    }
}

/// A transfer is awaited on any runtime and handed between threads: checked when this compiles.
const _: fn() = || {
    fn send_unpin<T: Send + Unpin>() {}
    send_unpin::<Transfer>();
};

#[cfg(test)]
mod tests {
    use super::*;
    use futures_lite::future::block_on;

    #[test]
    fn status_polls_without_an_async_context_and_cancel_is_final() {
        let (tx, rx) = futures_channel::oneshot::channel::<()>();
        let mut t = Transfer::new(async move {
            rx.await.map_err(|_| AgentError::Cancelled)?;
            Ok(TransferStats::new(4096, 1, 1, 1))
        });
        assert_eq!(t.status(), TransferStatus::Pending);
        assert!(t.take_result().is_none());
        tx.send(()).unwrap();
        assert_eq!(t.status(), TransferStatus::Done);
        t.cancel(); // after the end: nothing
        assert_eq!(t.status(), TransferStatus::Done);
        assert_eq!(block_on(t).unwrap().bytes, 4096);

        let (_tx, rx) = futures_channel::oneshot::channel::<()>();
        let mut t = Transfer::new(async move {
            let _ = rx.await;
            Ok(TransferStats::new(0, 0, 0, 0))
        });
        assert_eq!(t.status(), TransferStatus::Pending);
        t.cancel();
        assert_eq!(t.status(), TransferStatus::Cancelled);
        assert!(matches!(t.take_result(), Some(Err(AgentError::Cancelled))));
        assert!(matches!(block_on(t), Err(AgentError::Cancelled)));

        let mut t = Transfer::failed(AgentError::UnknownPeer("x".into()));
        assert_eq!(t.status(), TransferStatus::Failed);
        assert!(matches!(block_on(&mut t), Err(AgentError::UnknownPeer(_))));
        assert!(matches!(block_on(t), Err(AgentError::ResultTaken)));
    }
}
