#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The examples of `docs/using.md`, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/using.md")]
pub struct UsingDoctests;

pub mod agent;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod object;
pub mod staging;
pub mod tier;
mod transport;

/// The ibverbs layer (`rixl-verbs`): devices, protection domains, memory regions, queue pairs.
pub use rixl_verbs as verbs;

/// The sans-IO transfer core (`rixl-proto`): planning, the in-flight table, credits, deadlines.
pub use rixl_proto as proto;

/// The thread-per-core engines (`rixl-runtime`): RDMA transfers as futures, the FILE tier.
pub use rixl_runtime as runtime;

/// The machine model and path choice (`rixl-topology`).
pub use rixl_topology as topology;

/// GPU memory and GPUDirect RDMA registration (`rixl-gpudirect`).
pub use rixl_gpudirect as gpudirect;

/// NVML probing and the CUDA IPC path (`rixl-nvlink`).
pub use rixl_nvlink as nvlink;
