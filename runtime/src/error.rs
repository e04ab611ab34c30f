//! Errors of the runtime.

pub use rixl_proto::error::{
    DeviceFault, FileError, InvalidDescriptor, PostError, SharedError, TransferError,
};

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
    /// The engine's port is down (a port-down async event): no connection can be made until
    /// the port is active again.
    #[error("port {port} of the device is down")]
    PortDown {
        /// The port.
        port: u8,
    },
    /// A limit of the engine's configuration was reached.
    #[error("{0}")]
    Limit(String),
    /// The engine that owns the resource has shut down.
    #[error("the engine has shut down")]
    EngineGone,
    /// The task serving this call on the engine's core panicked; the engine carries on.
    #[error("a task on the engine's core panicked: {0}")]
    EnginePanic(String),
    /// The engine's core stopped running (no heartbeat for the engine's `stall_timeout`, this
    /// long) while a call from another thread waited on it, or an engine did not start within
    /// it.
    #[error("the engine's core stopped running (no heartbeat for {0:?})")]
    EngineStalled(std::time::Duration),
    /// A FILE-tier registration failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// Binding a memory window (a grant) failed on the connection.
    #[error("grant: {0}")]
    Grant(#[source] TransferError),
    /// This core has no RDMA device (it serves host memory and files only).
    #[error("no RDMA device on this engine's core")]
    NoNic,
    /// GPU memory could not be allocated or registered (no CUDA, no dma-buf/peermem, ...).
    #[error(transparent)]
    Gpu(#[from] rixl_gpudirect::Error),
}
