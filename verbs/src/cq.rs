//! Completion queues and their completion (event) channels.

use std::fmt;
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::context::{Context, ContextInner};
use crate::error::{Error, Result};
use crate::sys;
use crate::wc::WorkCompletion;

struct ChannelInner {
    raw: NonNull<sys::ibv_comp_channel>,
    _ctx: Arc<ContextInner>,
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: the channel's only CQ is destroyed first (it holds an Arc to this value).
        let rc = unsafe { sys::ibv_destroy_comp_channel(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_comp_channel failed");
        }
    }
}

pub(crate) struct CqInner {
    pub(crate) raw: NonNull<sys::ibv_cq>,
    capacity: u32,
    unacked: AtomicU32,
    // Dropped after the CQ (field order), since the CQ references it.
    channel: Option<ChannelInner>,
    _ctx: Arc<ContextInner>,
}

// SAFETY: libibverbs CQs are thread-safe (providers lock internally); the unacked counter is atomic.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        let n = *self.unacked.get_mut();
        if n > 0 {
            // SAFETY: the CQ is live; ibv_destroy_cq blocks until every event is acked.
            unsafe { sys::ibv_ack_cq_events(self.raw.as_ptr(), n) };
        }
        // SAFETY: queue pairs using this CQ hold an Arc to it, so none is left; destroyed once.
        let rc = unsafe { sys::ibv_destroy_cq(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_cq failed");
        }
    }
}

/// A completion queue (`ibv_cq`), optionally with its own completion channel for event mode.
/// Cheap to clone; queue pairs keep it alive.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("capacity", &self.inner.capacity)
            .field("event_channel", &self.inner.channel.is_some())
            .finish()
    }
}

impl CompletionQueue {
    /// Creates a CQ with at least `capacity` entries. With `with_events`, a dedicated
    /// completion channel is created so the CQ can be waited on ([`Self::wait_event`]).
    ///
    /// # Errors
    /// [`Error::Limit`] if `capacity` exceeds the device's `max_cqe`; the failing verb's error variant otherwise.
    pub fn new(ctx: &Context, capacity: u32, with_events: bool) -> Result<Self> {
        let max = ctx.query_device()?.max_cqe;
        if capacity == 0 || capacity > max {
            return Err(Error::Limit {
                what: "completion queue entries",
                requested: u64::from(capacity),
                limit: u64::from(max),
            });
        }
        let channel = if with_events {
            // SAFETY: the context is open.
            let raw = unsafe { sys::ibv_create_comp_channel(ctx.as_raw()) };
            let raw = NonNull::new(raw).ok_or_else(|| Error::last_os(Error::CreateCompChannel))?;
            Some(ChannelInner {
                raw,
                _ctx: Arc::clone(&ctx.inner),
            })
        } else {
            None
        };
        let chan_ptr = channel
            .as_ref()
            .map_or(std::ptr::null_mut(), |c| c.raw.as_ptr());
        let cqe = i32::try_from(capacity).unwrap_or(i32::MAX);
        // SAFETY: the context is open; `chan_ptr` is null or a live channel of the same context.
        let raw =
            unsafe { sys::ibv_create_cq(ctx.as_raw(), cqe, std::ptr::null_mut(), chan_ptr, 0) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os(Error::CreateCq))?;
        // SAFETY: `raw` is the CQ just created; `cqe` is the actual size granted.
        let actual = unsafe { (*raw.as_ptr()).cqe };
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                raw,
                capacity: u32::try_from(actual).unwrap_or(capacity),
                unacked: AtomicU32::new(0),
                channel,
                _ctx: Arc::clone(&ctx.inner),
            }),
        })
    }

    /// Number of entries the CQ holds (may exceed what was asked for).
    pub fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    /// Polls up to `out.len()` completions into `out`; returns how many were written.
    ///
    /// # Errors
    /// the failing verb's error variant if `ibv_poll_cq` fails.
    #[inline]
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let n = i32::try_from(out.len()).unwrap_or(i32::MAX);
        // SAFETY: the CQ is live; `WorkCompletion` is `repr(transparent)` over `ibv_wc`, and `out`
        // has room for `n` entries.
        let got = unsafe { sys::ibv_poll_cq(self.inner.raw.as_ptr(), n, out.as_mut_ptr().cast()) };
        usize::try_from(got).map_err(|_| Error::from_ret(Error::PollCq, -got))
    }

    /// Arms the CQ: the next completion (only solicited ones with `solicited_only`) generates an
    /// event on the channel. Poll once more after arming to not miss completions that raced it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] without a channel; the failing verb's error variant if arming fails.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.inner.channel.is_none() {
            return Err(Error::InvalidArgument(
                "completion queue was created without an event channel".into(),
            ));
        }
        // SAFETY: the CQ is live.
        let rc =
            unsafe { sys::ibv_req_notify_cq(self.inner.raw.as_ptr(), i32::from(solicited_only)) };
        if rc != 0 {
            return Err(Error::from_ret(Error::ReqNotifyCq, rc));
        }
        Ok(())
    }

    /// The file descriptor of the completion channel (readable when an event is pending).
    pub fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        self.inner.channel.as_ref().map(|c| {
            // SAFETY: the channel is live for `'_` and its fd stays open while it is.
            unsafe { BorrowedFd::borrow_raw((*c.raw.as_ptr()).fd) }
        })
    }

    /// Waits up to `timeout` (forever with `None`) for a completion event, consumes it with
    /// `ibv_get_cq_event` and acknowledges it. Arm with [`Self::req_notify`] first.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no event came; [`Error::InvalidArgument`] without a channel;
    /// the failing verb's error variant if waiting fails.
    pub fn wait_event(&self, timeout: Option<Duration>) -> Result<()> {
        let chan = self.inner.channel.as_ref().ok_or_else(|| {
            Error::InvalidArgument("completion queue was created without an event channel".into())
        })?;
        // SAFETY: the channel is live.
        let fd: RawFd = unsafe { (*chan.raw.as_ptr()).fd };
        if !crate::event::wait_readable(fd, timeout)? {
            return Err(Error::Timeout);
        }
        let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is readable so this does not block; out-pointers are valid.
        let rc = unsafe { sys::ibv_get_cq_event(chan.raw.as_ptr(), &mut cq, &mut ctx) };
        if rc != 0 {
            return Err(Error::last_os(Error::GetCqEvent));
        }
        debug_assert_eq!(
            cq,
            self.inner.raw.as_ptr(),
            "dedicated channel returned another CQ"
        );
        // Acknowledge in batches: acking takes a lock in libibverbs.
        let pending = self.inner.unacked.fetch_add(1, Ordering::AcqRel) + 1;
        if pending >= 64 {
            let n = self.inner.unacked.swap(0, Ordering::AcqRel);
            if n > 0 {
                // SAFETY: `n` events of this CQ were received and not yet acked.
                unsafe { sys::ibv_ack_cq_events(self.inner.raw.as_ptr(), n) };
            }
        }
        Ok(())
    }

    /// The raw `ibv_cq`.
    pub fn as_raw(&self) -> *mut sys::ibv_cq {
        self.inner.raw.as_ptr()
    }
}
