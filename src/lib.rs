//! `rixl`: async data movement for LLM inference clusters.
//!
//! The [`agent::Agent`] is what a serving engine programs against; the workspace crates are
//! re-exported for lower-level use.
#![forbid(unsafe_code)]

pub mod agent;
mod transport;

pub use rixl_gpudirect as gpudirect;
pub use rixl_nvlink as nvlink;
pub use rixl_runtime as runtime;
pub use rixl_topology as topology;
pub use rixl_verbs as verbs;
