//! `rixl-proto`: rixl's transfer core without I/O.
//!
//! It holds the state machine of one engine's transfers: descriptor validation and planning
//! ([`plan`]), the in-flight table that owns what the NIC may still touch ([`inflight`]), send
//! credits ([`credits`]), deadlines ([`deadline`]), coalescing decisions and connection states
//! ([`Core`], [`Posting`]). It drives queue pairs through the small traits of [`queue`] (build and
//! post a batch, poll completions; its driver reads the clock) and never waits: `rixl-runtime` is the async glue
//! over glommio and verbs, and [`harness`] is a deterministic fake NIC with a virtual clock for
//! tests and benchmarks. Neither glommio nor ibverbs nor CUDA is in its dependency tree.
#![forbid(unsafe_code)]

pub mod conn;
pub mod core;
pub mod credits;
pub mod deadline;
pub mod desc;
pub mod error;
pub mod harness;
pub mod inbox;
pub mod inflight;
pub mod lone;
pub mod plan;
pub mod posting;
pub mod queue;
pub mod stats;
pub mod wire;

pub use crate::conn::{
    ConnParams, ConnState, COALESCE_LONELY_FLUSHES, COALESCE_MAX_WRS, COALESCE_PROBE_EVERY,
    COALESCE_SIGNAL_INTERVAL, INBOX_LIMIT,
};
pub use crate::core::{recv_wr_id, Activity, Core, CoreConfig, RECV_BIT};
pub use crate::deadline::{Deadline, Deadlines};
pub use crate::desc::{LocalDesc, Op, RegionInfo, RemoteDesc, RemoteDescList};
pub use crate::error::{
    DeviceFault, FileError, FileId, InvalidDescriptor, PostError, SharedError, TransferError,
};
pub use crate::inbox::{Delivery, HeldBuffer, Received};
pub use crate::inflight::SlotId;
pub use crate::lone::LoneTransfer;
pub use crate::plan::{Limits, Plan, PlannedWr};
pub use crate::posting::{Posting, POST_BATCH_INLINE};
pub use crate::queue::{Clock, CompletionSource, SendQueue, SystemClock};
pub use crate::stats::{
    ConnId, DescriptorRanges, EngineCounters, Message, Progress, TransferFailure, TransferOptions,
    TransferStats,
};
pub use crate::wire::{Completion, SendFlags, SendOp, Sge, WcOpcode, WcStatus};
