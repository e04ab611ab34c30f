//! `rixl`: async data movement for LLM inference clusters.
//!
//! This facade re-exports the workspace crates; the `Agent` API builds on the runtime.
#![forbid(unsafe_code)]

pub use rixl_gpudirect as gpudirect;
pub use rixl_nvlink as nvlink;
pub use rixl_runtime as runtime;
pub use rixl_topology as topology;
pub use rixl_verbs as verbs;
