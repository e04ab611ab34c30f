//! `rixl-verbs`: rixl's own safe layer over libibverbs (no UCX).
//!
//! The FFI comes from an in-tree bindgen run (`wrap_static_fns`, so the static-inline hot-path
//! verbs `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq` and `ibv_req_notify_cq` are real
//! symbols compiled with `cc`); it builds with libclang 14 and 19. This is the only crate of the
//! workspace that touches ibverbs.
//!
//! Grants enforced by the NIC: a [`MemoryWindow`] (type 2) bound on one queue pair with
//! [`QueuePair::post_bind_window`] lets only that queue pair's peer reach part of a region, with
//! the access it was bound with, until [`QueuePair::post_invalidate`].
//!
//! RAII types keep their parents alive: a [`QueuePair`] holds its [`ProtectionDomain`] and
//! [`CompletionQueue`]s, which hold their [`Context`]. Every raw handle is reachable through
//! `as_raw()`.

mod context;
mod cq;
mod device;
mod error;
mod event;
mod host;
mod mr;
mod mw;
mod pd;
mod qp;
mod sys;
mod wc;
mod wr;

/// The generated bindings, for `as_raw()` users.
pub mod ffi {
    pub use crate::sys::*;
}

pub use context::{Context, DeviceAttributes, Gid, LinkLayer, Mtu, PortAttributes};
pub use cq::CompletionQueue;
pub use device::{Device, DeviceList};
pub use error::{Error, Result};
pub use event::AsyncEvent;
pub use host::{HostBuffer, BUFFER_ALIGN};
/// The memory-map crate whose [`memmap2::MmapMut`] [`HostBuffer::from_mmap`] takes.
pub use memmap2;
pub use mr::{
    AccessFlags, HostMemory, MemoryRegion, OwnedRegistration, Registered, RegisteredBuffer,
    SharedRegistration,
};
pub use mw::{BoundWindow, MemoryWindow};
pub use pd::ProtectionDomain;
pub use qp::{ConnectOptions, Endpoint, QueuePair, QueuePairCapabilities, QueuePairState};
pub use wc::{WcOpcode, WcStatus, WorkCompletion};
pub use wr::{RecvBatch, SendBatch, SendFlags, SendOp, Sge};
