//! Device async events (`ibv_get_async_event`): port state changes and fatal errors of queue
//! pairs, completion queues and the device, which no completion reports.

use std::os::fd::RawFd;
use std::time::Duration;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::sys;

/// One async event of a device, acknowledged when it was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// A port became active (its link came up).
    PortActive {
        /// The port number.
        port: u8,
    },
    /// A port went down (link down, cable pulled, netdev down for rxe).
    PortError {
        /// The port number.
        port: u8,
    },
    /// A queue pair hit an error no work completion can report; it is in the error state.
    QueuePairFatal {
        /// Its number.
        qpn: u32,
    },
    /// A queue pair received a request it could not process (transport error on the target).
    QueuePairRequestError {
        /// Its number.
        qpn: u32,
    },
    /// A queue pair was denied access on the target side.
    QueuePairAccessError {
        /// Its number.
        qpn: u32,
    },
    /// A completion queue overran or failed: its completions can no longer be trusted.
    CompletionQueueError,
    /// The device failed: every resource on it is unusable.
    DeviceFatal,
    /// An event rixl does not act on (communication established, SQ drained, LID/GID change).
    Other {
        /// The raw `ibv_event_type`.
        code: u32,
    },
}

impl Context {
    /// Waits up to `timeout` for the device's next async event, reads it and acknowledges it.
    /// `Ok(None)` when none arrived in time.
    ///
    /// # Errors
    /// [`Error::WaitEvent`] if `poll(2)` fails, [`Error::GetAsyncEvent`] if reading fails.
    pub fn next_async_event(&self, timeout: Duration) -> Result<Option<AsyncEvent>> {
        // SAFETY: the context is open while `self` lives; its async fd stays open with it.
        let fd: RawFd = unsafe { (*self.as_raw()).async_fd };
        if !wait_readable(fd, Some(timeout))? {
            return Ok(None);
        }
        let mut ev = std::mem::MaybeUninit::<sys::ibv_async_event>::zeroed();
        // SAFETY: the fd is readable, so this does not block; `ev` is a valid out-pointer.
        let rc = unsafe { sys::ibv_get_async_event(self.as_raw(), ev.as_mut_ptr()) };
        if rc != 0 {
            return Err(Error::last_os(Error::GetAsyncEvent));
        }
        // SAFETY: `ibv_get_async_event` succeeded and filled the event.
        let mut ev = unsafe { ev.assume_init() };
        let code = ev.event_type;
        // SAFETY: the union member read is the one `event_type` names; a QP event's `qp` points
        // to a live QP until the event is acknowledged (below), which this read precedes.
        let event = unsafe {
            match code {
                sys::ibv_event_type::IBV_EVENT_PORT_ACTIVE => AsyncEvent::PortActive {
                    port: ev.element.port_num as u8,
                },
                sys::ibv_event_type::IBV_EVENT_PORT_ERR => AsyncEvent::PortError {
                    port: ev.element.port_num as u8,
                },
                sys::ibv_event_type::IBV_EVENT_QP_FATAL => AsyncEvent::QueuePairFatal {
                    qpn: (*ev.element.qp).qp_num,
                },
                sys::ibv_event_type::IBV_EVENT_QP_REQ_ERR => AsyncEvent::QueuePairRequestError {
                    qpn: (*ev.element.qp).qp_num,
                },
                sys::ibv_event_type::IBV_EVENT_QP_ACCESS_ERR => AsyncEvent::QueuePairAccessError {
                    qpn: (*ev.element.qp).qp_num,
                },
                sys::ibv_event_type::IBV_EVENT_CQ_ERR => AsyncEvent::CompletionQueueError,
                sys::ibv_event_type::IBV_EVENT_DEVICE_FATAL => AsyncEvent::DeviceFatal,
                other => AsyncEvent::Other { code: other },
            }
        };
        // SAFETY: `ev` was returned by `ibv_get_async_event` and is acknowledged once.
        unsafe { sys::ibv_ack_async_event(&mut ev) };
        Ok(Some(event))
    }
}

/// Waits until `fd` is readable, up to `timeout` (forever with `None`), retrying on `EINTR`;
/// whether it became readable (false: the time ran out).
///
/// # Errors
/// [`Error::WaitEvent`] if `poll(2)` fails.
pub(crate) fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.map_or(-1, |t| i32::try_from(t.as_millis()).unwrap_or(i32::MAX));
    loop {
        // SAFETY: `pfd` is one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc >= 0 {
            return Ok(rc > 0);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::WaitEvent(e));
        }
    }
}
