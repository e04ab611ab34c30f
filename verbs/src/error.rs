//! Errors of the verbs layer.

use std::io;

use crate::wc::WcStatus;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can fail in the verbs layer.
///
/// One variant per failing verb carries the OS error; completion errors carry the
/// `ibv_wc_status` by name.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The kernel has no RDMA support or no RDMA device is present (on a host built without
    /// `CONFIG_INFINIBAND`, `ibv_get_device_list` fails with `ENOSYS`).
    #[error("no RDMA device available: {reason}")]
    NoDevice {
        /// Why: the OS error, or "device list is empty".
        reason: String,
    },
    /// A device was asked for by name and is not in the device list.
    #[error("RDMA device {name:?} not found (available: {available:?})")]
    DeviceNotFound {
        /// The requested name.
        name: String,
        /// The names that exist.
        available: Vec<String>,
    },
    /// A verb failed with an OS error.
    #[error("{verb} failed: {source}")]
    Verb {
        /// The C verb that failed, e.g. `ibv_reg_mr`.
        verb: &'static str,
        /// The OS error (errno) it reported.
        #[source]
        source: io::Error,
    },
    /// A work completion reported an error status.
    #[error("work request {wr_id:#x} completed with {status} (vendor error {vendor_err:#x})")]
    Completion {
        /// The failing status, by name.
        status: WcStatus,
        /// The work request id it carried.
        wr_id: u64,
        /// Provider-specific detail.
        vendor_err: u32,
    },
    /// A request exceeds a device or queue pair limit.
    #[error("{what}: {requested} exceeds the limit {limit}")]
    Limit {
        /// Which limit.
        what: &'static str,
        /// What was asked for.
        requested: u64,
        /// The device's or queue pair's limit.
        limit: u64,
    },
    /// A queue pair state transition that is not allowed from the current state.
    #[error("queue pair {qpn}: cannot move from {from:?} to {to:?}")]
    InvalidTransition {
        /// The queue pair number.
        qpn: u32,
        /// Its current state.
        from: crate::QueuePairState,
        /// The requested state.
        to: crate::QueuePairState,
    },
    /// An argument is invalid (zero length, unaligned, bad GID index, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Posting a list of work requests failed at the request with index `index`; requests before
    /// it were posted.
    #[error("{verb} failed at request {index}: {source}")]
    Post {
        /// `ibv_post_send` or `ibv_post_recv`.
        verb: &'static str,
        /// Index of the first request that was not posted.
        index: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Waiting for a completion event timed out.
    #[error("timed out waiting for a completion event")]
    Timeout,
}

impl Error {
    /// Builds [`Error::Verb`] from the current `errno`.
    pub(crate) fn last_os(verb: &'static str) -> Self {
        Error::Verb {
            verb,
            source: io::Error::last_os_error(),
        }
    }

    /// Builds [`Error::Verb`] from a verb's non-zero return value (an errno, as most verbs that
    /// return `int` do), falling back to `errno` when the value is not positive.
    pub(crate) fn from_ret(verb: &'static str, ret: i32) -> Self {
        let source = if ret > 0 {
            io::Error::from_raw_os_error(ret)
        } else {
            io::Error::last_os_error()
        };
        Error::Verb { verb, source }
    }

    /// Whether this error means "no RDMA hardware here" (so tests may skip).
    pub fn is_no_device(&self) -> bool {
        matches!(self, Error::NoDevice { .. })
    }
}
