//! `rixl-runtime`: thread-per-core engines that turn RDMA completions into futures.
#![forbid(unsafe_code)]

pub mod credits;
pub mod desc;
pub mod error;
pub mod file;
pub mod flag;
pub mod gpu;
pub mod inflight;
pub mod join;
pub mod plan;

pub use desc::{LocalDesc, LocalDescList, Op, Region, RemoteDesc, RemoteDescList};
pub use error::{InvalidDescriptor, RuntimeError, TransferError};
pub use file::{
    FileConfig, FileCounters, FileDesc, FileError, FileId, FileInfo, FileMode, FileSpec, FileStore,
};
pub use flag::{wait_flag, Flag};
pub mod engine;

pub use engine::{
    ConnId, Engine, EngineConfig, EngineCounters, Message, PollMode, PreparedTransfer,
    TransferOptions, TransferStats,
};
pub mod handle;
pub mod preflight;

pub use handle::{available_cpus, DeviceCopy, EngineHandle, EnginePool, DEFAULT_IO_MEMORY};
pub use join::join_all;
