//! `rixl-runtime`: thread-per-core engines that turn RDMA completions into futures.
#![forbid(unsafe_code)]

pub mod desc;
pub mod error;
pub mod inflight;
pub mod plan;

pub use desc::{LocalDesc, LocalDescList, Op, Region, RemoteDesc, RemoteDescList};
pub use error::{InvalidDescriptor, RuntimeError, TransferError};
