//! Errors of transfers: rejected descriptors, failed completions, connection and FILE-tier
//! failures. `Clone` and `PartialEq`, because a connection's failure is handed to every transfer
//! it ends: an underlying error (a refused post, an OS error) is kept as the source in a
//! [`SharedError`], shared and compared by its message.

use std::error::Error as StdError;
use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::wire::WcStatus;

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
    /// A message is longer than the receive buffers it lands in (`max_message`), or empty.
    #[error("a message of {len} bytes: messages carry 1 to {max} bytes")]
    MessageSize {
        /// The message's length.
        len: u64,
        /// The largest message (the engine's `max_message`).
        max: u64,
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
    /// The transfer could not be posted: the queue refused it, or it asked for what its
    /// operation cannot do.
    #[error("posting failed: {0}")]
    Post(#[source] PostError),
    /// The engine that owns the connection has shut down.
    #[error("the engine has shut down")]
    EngineGone,
    /// A task on the engine's core panicked while it owned this transfer (the transfer's own
    /// task, or the progress task, which fails every connection of its engine). The engine
    /// carries on: posted work drains, the memory stays registered until it has, and the
    /// next transfers run as usual (a failed connection is replaced).
    #[error("a task on the engine's core panicked: {0}")]
    EnginePanic(String),
    /// The engine's core stopped running (no heartbeat for the engine's `stall_timeout`, this
    /// long) while a call from another thread waited on it. The call gave up; its job stays
    /// queued on the core, and a transfer's is cancelled there if the core runs again (what it
    /// had posted stays in the in-flight table, with its memory, until the NIC is done).
    #[error("the engine's core stopped running (no heartbeat for {0:?})")]
    EngineStalled(Duration),
    /// A FILE-tier transfer failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// This core has no RDMA device (it serves host memory and files only).
    #[error("no RDMA device on this engine's core")]
    NoNic,
    /// The device reported a fault that no completion carries (an async event): the
    /// connection was failed at once rather than at its deadline.
    #[error("device fault: {0}")]
    Device(DeviceFault),
}

/// Why a transfer could not be posted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// The send queue refused the work requests (the verb's error, kept as the source).
    #[error("the send queue refused the work request: {0}")]
    Refused(#[source] SharedError),
    /// A READ cannot carry a notification: `notify_imm` needs a WRITE.
    #[error("notify_imm needs a WRITE")]
    NotifyOnRead,
    /// A memory-window bind completed without yielding a window.
    #[error("a bind posted no window")]
    NoWindow,
    /// The message could not be staged in the engine's send buffer.
    #[error("the message could not be staged in the send buffer: {0}")]
    Staging(#[source] SharedError),
    /// A device-to-device copy could not be planned.
    #[error("the device copy could not be planned: {0}")]
    CopyPlan(#[source] SharedError),
}

impl PostError {
    /// A refusal by the send queue, keeping `e` as the source.
    pub fn refused(e: impl StdError + Send + Sync + 'static) -> Self {
        PostError::Refused(SharedError::new(e))
    }
}

/// An error kept as a source where the error holding it must stay `Clone` (a connection's
/// failure is handed to every transfer it ends): shared, not copied into a string. Two are equal
/// when they are the same error or show the same message. It is transparent in a chain: its
/// `source` is the inner error's; reach the inner error itself with [`SharedError::get`] (and
/// `downcast_ref` on that).
#[derive(Clone)]
pub struct SharedError(Arc<dyn StdError + Send + Sync + 'static>);

impl SharedError {
    /// Wraps `e`.
    pub fn new(e: impl StdError + Send + Sync + 'static) -> Self {
        SharedError(Arc::new(e))
    }

    /// The error itself.
    pub fn get(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.0
    }
}

impl fmt::Debug for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl StdError for SharedError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.0.source()
    }
}

impl PartialEq for SharedError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for SharedError {}

/// A fault the device reported through an async event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceFault {
    /// The port the connection uses went down.
    #[error("port {port} went down")]
    PortDown {
        /// The port.
        port: u8,
    },
    /// The connection's queue pair hit a fatal error.
    #[error("queue pair fatal error")]
    QueuePairFatal,
    /// The connection's queue pair received a request it could not process.
    #[error("queue pair request error")]
    QueuePairRequestError,
    /// The connection's queue pair was denied access.
    #[error("queue pair access error")]
    QueuePairAccessError,
    /// The engine's completion queue failed.
    #[error("completion queue error")]
    CompletionQueueError,
    /// The device failed.
    #[error("device fatal error")]
    DeviceFatal,
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

/// An open registered file on an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId(pub u64);

/// Errors of the FILE tier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// The path does not exist (`FileMode::Open`) or its directory does not.
    #[error("{path}: no such file")]
    NotFound {
        /// The path.
        path: PathBuf,
    },
    /// `FileMode::CreateNew` found an existing file.
    #[error("{path}: file exists")]
    Exists {
        /// The path.
        path: PathBuf,
    },
    /// An existing file is smaller than the registration asks for.
    #[error("{path}: file holds {size} bytes but {needed} were asked for")]
    TooSmall {
        /// The path.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The registration's size.
        needed: u64,
    },
    /// The file system is full.
    #[error("{path}: no space left on the file system ({during})")]
    NoSpace {
        /// The path.
        path: PathBuf,
        /// `reserving N bytes` or `writing at OFFSET`.
        during: String,
    },
    /// A registration of zero bytes.
    #[error("{path}: a registration needs a size > 0")]
    ZeroSize {
        /// The path.
        path: PathBuf,
    },
    /// A file descriptor reaches outside the registration.
    #[error("file descriptor {index}: offset {offset} + length {len} exceeds the registered {size} bytes")]
    OutOfRange {
        /// Position in the list.
        index: usize,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Registered size.
        size: u64,
    },
    /// A write does not start and end on the O_DIRECT alignment.
    #[error("file descriptor {index}: write of {len} bytes at {offset} is not aligned to {alignment} bytes (after merging adjacent descriptors)")]
    Unaligned {
        /// Position in the list of the I/O's first descriptor.
        index: usize,
        /// Offset of the merged I/O.
        offset: u64,
        /// Length of the merged I/O.
        len: u64,
        /// Required alignment.
        alignment: u64,
    },
    /// The file was unlinked after registration: data written now would be lost on close.
    #[error("{path}: the file was deleted after it was registered")]
    Deleted {
        /// The path.
        path: PathBuf,
    },
    /// The file ended before a read did (it was truncated after registration).
    #[error("{path}: read of {expected} bytes at {offset} returned {got} (file truncated?)")]
    ShortRead {
        /// The path.
        path: PathBuf,
        /// Offset.
        offset: u64,
        /// Bytes asked for.
        expected: u64,
        /// Bytes returned.
        got: u64,
    },
    /// A write returned fewer bytes than asked.
    #[error("{path}: write of {expected} bytes at {offset} wrote {got}")]
    ShortWrite {
        /// The path.
        path: PathBuf,
        /// Offset.
        offset: u64,
        /// Bytes asked for.
        expected: u64,
        /// Bytes written.
        got: u64,
    },
    /// Another I/O error.
    #[error("{path}: {op} failed: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The operation.
        op: &'static str,
        /// The OS error kind.
        kind: io::ErrorKind,
        /// The error itself (the OS error, or the runtime's).
        #[source]
        source: SharedError,
    },
    /// The file id is unknown (never registered, or closed).
    #[error("unknown file {0:?}")]
    UnknownFile(FileId),
    /// The engine has no FILE tier (it shut down).
    #[error("the engine has shut down")]
    EngineGone,
    /// The task serving this call on the engine's core panicked; the engine carries on.
    #[error("a task on the engine's core panicked: {0}")]
    EnginePanic(String),
    /// The engine's core stopped running (no heartbeat for the engine's `stall_timeout`, this
    /// long) while a call from another thread waited on it.
    #[error("the engine's core stopped running (no heartbeat for {0:?})")]
    EngineStalled(Duration),
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;
    use crate::harness::Refused;

    #[test]
    fn post_error_keeps_the_queue_error_as_its_source() {
        let e = TransferError::Post(PostError::refused(Refused("queue full")));
        let post = e.source().expect("the post error is the source");
        let queue = post.source().expect("the queue's error is kept");
        assert_eq!(
            queue.downcast_ref::<SharedError>().map(|s| s.to_string()),
            Some("fake NIC refused: queue full".to_string())
        );
        let SharedError(inner) = queue.downcast_ref::<SharedError>().unwrap();
        assert_eq!(
            inner.downcast_ref::<Refused>(),
            Some(&Refused("queue full"))
        );
        assert_eq!(
            e.to_string(),
            "posting failed: the send queue refused the work request: fake NIC refused: queue full"
        );
        // Clones compare equal; different refusals do not.
        assert_eq!(e.clone(), e);
        assert_ne!(e, TransferError::Post(PostError::refused(Refused("other"))));
        assert_ne!(e, TransferError::Post(PostError::NotifyOnRead));
    }

    #[test]
    fn file_io_error_keeps_the_os_error() {
        let e = FileError::Io {
            path: "/x".into(),
            op: "read",
            kind: io::ErrorKind::Other,
            source: SharedError::new(io::Error::from_raw_os_error(5)),
        };
        let src = e.source().and_then(|s| s.downcast_ref::<SharedError>());
        let os = src.and_then(|s| s.get().downcast_ref::<io::Error>());
        assert_eq!(os.and_then(io::Error::raw_os_error), Some(5));
    }
}
