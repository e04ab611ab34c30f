//! Errors of the verbs layer.

use std::io;

use rixl_proto::wire::WcStatus;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can fail in the verbs layer.
///
/// One variant per failing verb, each with the OS error; completion errors carry the
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
    /// `ibv_get_device_list` failed (with the OS error).
    #[error("ibv_get_device_list failed: {0}")]
    GetDeviceList(#[source] io::Error),
    /// `ibv_open_device` failed (with the OS error).
    #[error("ibv_open_device failed: {0}")]
    OpenDevice(#[source] io::Error),
    /// `ibv_query_device` failed (with the OS error).
    #[error("ibv_query_device failed: {0}")]
    QueryDevice(#[source] io::Error),
    /// `ibv_query_port` failed (with the OS error).
    #[error("ibv_query_port failed: {0}")]
    QueryPort(#[source] io::Error),
    /// `ibv_query_gid` failed (with the OS error).
    #[error("ibv_query_gid failed: {0}")]
    QueryGid(#[source] io::Error),
    /// `ibv_alloc_pd` failed (with the OS error).
    #[error("ibv_alloc_pd failed: {0}")]
    AllocPd(#[source] io::Error),
    /// `ibv_alloc_mw` failed (with the OS error): no memory-window support, or no resources.
    #[error("ibv_alloc_mw failed: {0}")]
    AllocMw(#[source] io::Error),
    /// `ibv_reg_mr` failed (with the OS error).
    #[error("ibv_reg_mr failed: {0}")]
    RegisterMemory(#[source] io::Error),
    /// `ibv_create_comp_channel` failed (with the OS error).
    #[error("ibv_create_comp_channel failed: {0}")]
    CreateCompChannel(#[source] io::Error),
    /// `ibv_create_cq` failed (with the OS error).
    #[error("ibv_create_cq failed: {0}")]
    CreateCq(#[source] io::Error),
    /// `ibv_poll_cq` failed (with the OS error).
    #[error("ibv_poll_cq failed: {0}")]
    PollCq(#[source] io::Error),
    /// `ibv_req_notify_cq` failed (with the OS error).
    #[error("ibv_req_notify_cq failed: {0}")]
    ReqNotifyCq(#[source] io::Error),
    /// `poll(2) on the completion channel` failed (with the OS error).
    #[error("poll(2) on the completion channel failed: {0}")]
    WaitEvent(#[source] io::Error),
    /// `ibv_get_cq_event` failed (with the OS error).
    #[error("ibv_get_cq_event failed: {0}")]
    GetCqEvent(#[source] io::Error),
    /// `ibv_get_async_event` failed (with the OS error).
    #[error("ibv_get_async_event failed: {0}")]
    GetAsyncEvent(#[source] io::Error),
    /// `ibv_create_qp` failed (with the OS error).
    #[error("ibv_create_qp failed: {0}")]
    CreateQp(#[source] io::Error),
    /// `ibv_modify_qp` failed (with the OS error).
    #[error("ibv_modify_qp failed: {0}")]
    ModifyQp(#[source] io::Error),
    /// `allocating a buffer` failed (with the OS error).
    #[error("allocating a buffer failed: {0}")]
    OutOfMemory(#[source] io::Error),
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
    /// `ibv_post_send` failed at the request with index `index`; requests before it were posted.
    #[error("ibv_post_send failed at request {index}: {source}")]
    PostSend {
        /// Index of the first request that was not posted.
        index: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_recv` failed at the request with index `index`; requests before it were posted.
    #[error("ibv_post_recv failed at request {index}: {source}")]
    PostRecv {
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
    /// The error of a verb that failed with the current `errno`.
    pub(crate) fn last_os(verb: fn(io::Error) -> Error) -> Self {
        verb(io::Error::last_os_error())
    }

    /// The error of a verb from its non-zero return value (an errno, as most verbs that return
    /// `int` do), falling back to `errno` when the value is not positive.
    pub(crate) fn from_ret(verb: fn(io::Error) -> Error, ret: i32) -> Self {
        verb(if ret > 0 {
            io::Error::from_raw_os_error(ret)
        } else {
            io::Error::last_os_error()
        })
    }

    /// Whether this error means "no RDMA hardware here" (so tests may skip).
    pub fn is_no_device(&self) -> bool {
        matches!(self, Error::NoDevice { .. })
    }
}
