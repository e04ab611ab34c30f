//! Errors of the runtime.

use std::time::Duration;

use rixl_verbs::WcStatus;

/// Why a descriptor list was rejected before anything was posted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidDescriptor {
    /// A list is empty.
    #[error("the {side} descriptor list is empty")]
    Empty {
        /// `local` or `remote`.
        side: &'static str,
    },
    /// A descriptor has length zero.
    #[error("{side} descriptor {index} has length zero")]
    ZeroLength {
        /// `local` or `remote`.
        side: &'static str,
        /// Position in its list.
        index: usize,
    },
    /// A local descriptor reaches outside its registered region.
    #[error("local descriptor {index}: offset {offset} + length {len} exceeds the registered region of {region_len} bytes")]
    OutOfRange {
        /// Position in the list.
        index: usize,
        /// Offset into the region.
        offset: u64,
        /// Length.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// An address + length overflows 64 bits.
    #[error("{side} descriptor {index}: address + length overflows")]
    Overflow {
        /// `local` or `remote`.
        side: &'static str,
        /// Position in its list.
        index: usize,
    },
    /// The lists describe different total lengths.
    #[error("local descriptors total {local} bytes but remote descriptors total {remote}")]
    LengthMismatch {
        /// Local total.
        local: u64,
        /// Remote total.
        remote: u64,
    },
    /// A local region belongs to another engine (another protection domain).
    #[error("local descriptor {index} uses memory registered with another engine")]
    ForeignRegion {
        /// Position in the list.
        index: usize,
    },
    /// An offset is not a multiple of what the access needs (an 8-byte flag: 8).
    #[error("offset {offset} is not a multiple of {align}")]
    Misaligned {
        /// The offset.
        offset: u64,
        /// The alignment needed.
        align: u64,
    },
    /// The operation needs host memory the CPU can read, and the region is GPU memory.
    #[error("the region is GPU memory; this needs host memory")]
    NotHostMemory,
    /// A local region is host memory not registered with a NIC (a core without one).
    #[error("local descriptor {index} uses host memory that is not registered with a NIC")]
    NotRegistered {
        /// Position in the list.
        index: usize,
    },
}

/// Why a transfer failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The descriptors were rejected before posting; nothing was sent.
    #[error("invalid descriptor: {0}")]
    InvalidDescriptor(#[from] InvalidDescriptor),
    /// The peer refused access (bad rkey, address outside its region, missing rights).
    #[error("remote access error ({status})")]
    RemoteAccess {
        /// The completion status.
        status: WcStatus,
    },
    /// The peer stopped answering (transport or RNR retries exceeded): it is dead or unreachable.
    #[error("remote disconnected ({status})")]
    RemoteDisconnect {
        /// The completion status.
        status: WcStatus,
    },
    /// The work was flushed because the connection failed (by another transfer's error, a
    /// timeout, or an explicit abort).
    #[error("flushed: the connection failed before this transfer completed")]
    Flushed,
    /// No completion within the transfer's deadline; the connection is failed so the NIC stops
    /// touching the memory.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// Another completion error.
    #[error("completion error ({status})")]
    Completion {
        /// The completion status.
        status: WcStatus,
    },
    /// The connection is unknown or already failed.
    #[error("connection {0} is not usable: {1}")]
    Connection(u32, String),
    /// A verb failed while posting.
    #[error("posting failed: {0}")]
    Post(String),
    /// The engine that owns the connection has shut down.
    #[error("the engine has shut down")]
    EngineGone,
    /// A FILE-tier transfer failed.
    #[error(transparent)]
    File(#[from] crate::file::FileError),
    /// This core has no RDMA device (it serves host memory and files only).
    #[error("no RDMA device on this engine's core")]
    NoNic,
}

impl TransferError {
    /// Maps an error completion status to the transfer error users see.
    pub fn from_status(status: WcStatus) -> Self {
        match status {
            WcStatus::RemoteAccessError
            | WcStatus::RemoteInvalidRequestError
            | WcStatus::RemoteInvalidRdRequest
            | WcStatus::RemoteOperationError => TransferError::RemoteAccess { status },
            WcStatus::RetryExceededError | WcStatus::RnrRetryExceededError => {
                TransferError::RemoteDisconnect { status }
            }
            WcStatus::WorkRequestFlushError => TransferError::Flushed,
            status => TransferError::Completion { status },
        }
    }
}

/// Why an engine could not start or a control operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// The verbs layer failed (no device, registration, QP creation, ...).
    #[error(transparent)]
    Verbs(#[from] rixl_verbs::Error),
    /// The locked-memory limit is too small for the executors' io_uring rings.
    #[error("RLIMIT_MEMLOCK is {limit} bytes and the process lacks CAP_IPC_LOCK; {needed} bytes are needed (raise `ulimit -l` or LimitMEMLOCK)")]
    MemlockTooLow {
        /// The soft limit.
        limit: u64,
        /// What the engines need.
        needed: u64,
    },
    /// io_uring is disabled on this kernel (`kernel.io_uring_disabled`).
    #[error("io_uring is disabled (kernel.io_uring_disabled = {0})")]
    IoUringDisabled(u32),
    /// glommio could not start an executor.
    #[error("executor failed to start: {0}")]
    Executor(String),
    /// The connection id is unknown.
    #[error("unknown connection {0}")]
    UnknownConnection(u32),
    /// A limit of the engine's configuration was reached.
    #[error("{0}")]
    Limit(String),
    /// The engine that owns the resource has shut down.
    #[error("the engine has shut down")]
    EngineGone,
    /// A FILE-tier registration failed.
    #[error(transparent)]
    File(#[from] crate::file::FileError),
    /// This core has no RDMA device (it serves host memory and files only).
    #[error("no RDMA device on this engine's core")]
    NoNic,
    /// GPU memory could not be allocated or registered (no CUDA, no dma-buf/peermem, ...).
    #[error(transparent)]
    Gpu(#[from] rixl_gpudirect::Error),
}
