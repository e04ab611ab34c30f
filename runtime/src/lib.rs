//! `rixl-runtime`: thread-per-core glommio engines over verbs, the async glue around the sans-IO
//! transfer core of `rixl-proto`, plus the FILE tier and GPU copy futures.
#![forbid(unsafe_code)]

pub mod desc;
pub mod engine;
pub mod error;
pub mod file;
pub mod flag;
pub mod gpu;
pub mod handle;
mod id;
pub mod join;
pub mod pool;
pub mod preflight;
pub mod probe;
pub mod rails;
mod supervise;

pub use desc::{
    split_stream, LocalDesc, LocalDescList, Op, Region, RemoteDesc, RemoteDescList, SharedMr,
    WeakMr,
};
pub use engine::{
    Access, ConnId, DescriptorRanges, Engine, EngineConfig, EngineCounters, Grant, GrantSpec,
    Message, PollMode, PreparedTransfer, Progress, Received, TransferFailure, TransferOptions,
    TransferStats,
};
pub use error::{
    DeviceFault, InvalidDescriptor, PostError, RuntimeError, SharedError, TransferError,
};
pub use file::{
    FileConfig, FileCounters, FileDesc, FileError, FileId, FileInfo, FileMode, FileSpec, FileStore,
};
pub use flag::{wait_flag, Flag};
pub use handle::{DeviceCopy, EngineHandle, HandOffCounters};
pub use join::join_all;
pub use pool::{available_cpus, cpu_after, cpu_at, EnginePool, DEFAULT_IO_MEMORY};
pub use rails::{
    lanes, PreparedPart, RailKeys, RailPart, RailSlice, Rails, STRIPE_MIN, STRIPE_SLICE,
};
