//! The CUDA-IPC backend: export device memory as an IPC handle, open a peer's handle in this
//! process, and copy device-to-device on a stream, with completion observed by polling a CUDA
//! event (so the copy can be a `Future` driven by the engine's progress loop).

use std::sync::Arc;

use cudarc::driver::sys;
use rixl_gpudirect::{DeviceMemory, Gpu};

use crate::kernel::{BlockKernel, Descriptors, COPIES_PER_LAUNCH};

/// Errors of the CUDA-IPC backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// The GPU layer failed (no CUDA, allocation, ...).
    #[error(transparent)]
    Gpu(#[from] rixl_gpudirect::Error),
    /// A CUDA driver call failed.
    #[error("{call} failed: {code}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The CUresult, by name.
        code: String,
    },
    /// A range lies outside its memory.
    #[error("{side} range {offset}+{len} outside {size} bytes")]
    OutOfRange {
        /// `source` or `destination`.
        side: &'static str,
        /// Offset.
        offset: usize,
        /// Length.
        len: usize,
        /// Size of the memory.
        size: usize,
    },
    /// The copies did not finish within the transfer's deadline (they finish in the
    /// background; their memory stays alive until then).
    #[error("device copies timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// A handle of the wrong length.
    #[error("an IPC handle is 64 bytes, not {0}")]
    BadHandle(usize),
}

pub(crate) fn check(call: &'static str, rc: sys::CUresult) -> Result<(), IpcError> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(IpcError::Driver {
            call,
            code: format!("{rc:?}"),
        })
    }
}

/// An exported CUDA IPC memory handle (64 opaque bytes, sent to a peer in the same node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl IpcHandle {
    /// Exports `mem`.
    ///
    /// # Errors
    /// [`IpcError::Driver`] (e.g. memory not from `cuMemAlloc`).
    pub fn export(mem: &DeviceMemory) -> Result<IpcHandle, IpcError> {
        mem.gpu().bind()?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: the context is current and `mem` is live `cuMemAlloc` memory; `h` is a valid
        // out-pointer.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, mem.addr())
        })?;
        Ok(IpcHandle(h.reserved.map(|c| c as u8)))
    }

    /// From bytes received from a peer.
    ///
    /// # Errors
    /// [`IpcError::BadHandle`] unless exactly 64 bytes.
    pub fn from_bytes(b: &[u8]) -> Result<IpcHandle, IpcError> {
        <[u8; 64]>::try_from(b)
            .map(IpcHandle)
            .map_err(|_| IpcError::BadHandle(b.len()))
    }
}

/// Anything a copy may read or write: device memory with its GPU and length.
pub trait DeviceRange: std::fmt::Debug + Send + Sync {
    /// Device address of byte 0.
    fn device_addr(&self) -> u64;
    /// Length in bytes.
    fn device_len(&self) -> usize;
}

impl DeviceRange for DeviceMemory {
    fn device_addr(&self) -> u64 {
        self.addr()
    }
    fn device_len(&self) -> usize {
        self.len()
    }
}

/// A peer's device memory opened in this process; closed on drop.
#[derive(Debug)]
pub struct ImportedMemory {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl ImportedMemory {
    /// Opens `handle` (exported by another process on this node) in `gpu`'s context. `len` is the
    /// exported length, as the peer's metadata states it: checked against the allocation the
    /// handle opens, so a peer that states more cannot drive copies past its memory.
    ///
    /// # Errors
    /// [`IpcError::Driver`] for a stale or foreign handle (e.g. the exporter exited);
    /// [`IpcError::OutOfRange`] (`side` "imported") if `len` is 0 or exceeds the allocation
    /// from the opened address on (the handle is closed again).
    pub fn open(
        gpu: &Arc<Gpu>,
        handle: &IpcHandle,
        len: usize,
    ) -> Result<ImportedMemory, IpcError> {
        gpu.bind()?;
        let h = sys::CUipcMemHandle_st {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        // SAFETY: the context is current; `ptr` is a valid out-pointer; flag 1 is
        // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS. The driver validates the handle.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut ptr, h, 1)
        })?;
        // Closed by its drop if the stated length is refused below.
        let opened = ImportedMemory {
            gpu: Arc::clone(gpu),
            ptr,
            len,
        };
        let (mut base, mut size) = (0, 0usize);
        // SAFETY: the context is current; `base` and `size` are valid out-pointers; `ptr` was
        // just opened in this context.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        let available = (size as u64).saturating_sub(ptr - base) as usize;
        if len == 0 || len > available {
            return Err(IpcError::OutOfRange {
                side: "imported",
                offset: 0,
                len,
                size: available,
            });
        }
        Ok(opened)
    }
}

impl DeviceRange for ImportedMemory {
    fn device_addr(&self) -> u64 {
        self.ptr
    }
    fn device_len(&self) -> usize {
        self.len
    }
}

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: opened in `open`, closed once here; pending copies hold an `Arc` of this value.
        let rc = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?rc, "cuIpcCloseMemHandle failed");
        }
    }
}

/// Checks that `len` bytes at `dst_off` of `dst` and at `src_off` of `src` lie inside them.
///
/// # Errors
/// [`IpcError::OutOfRange`] naming the side.
pub fn check_ranges(
    dst: &dyn DeviceRange,
    dst_off: usize,
    src: &dyn DeviceRange,
    src_off: usize,
    len: usize,
) -> Result<(), IpcError> {
    for (side, r, off) in [("destination", dst, dst_off), ("source", src, src_off)] {
        if off.checked_add(len).is_none_or(|end| end > r.device_len()) {
            return Err(IpcError::OutOfRange {
                side,
                offset: off,
                len,
                size: r.device_len(),
            });
        }
    }
    Ok(())
}

/// A non-blocking CUDA stream for one engine's device copies.
#[derive(Debug)]
pub struct CopyStream {
    gpu: Arc<Gpu>,
    stream: sys::CUstream,
    /// The block-copy kernel, loaded on first use (`None`: the driver cannot load it).
    kernel: std::sync::OnceLock<Option<BlockKernel>>,
}

// SAFETY: the stream handle may be used from any thread with its context current (`bind`).
unsafe impl Send for CopyStream {}
// SAFETY: enqueueing on a stream from several threads is allowed by CUDA.
unsafe impl Sync for CopyStream {}

impl CopyStream {
    /// A new non-blocking stream on `gpu`.
    ///
    /// # Errors
    /// [`IpcError::Driver`].
    pub fn new(gpu: &Arc<Gpu>) -> Result<CopyStream, IpcError> {
        gpu.bind()?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: the context is current; flag 1 is CU_STREAM_NON_BLOCKING.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, 1)
        })?;
        Ok(CopyStream {
            gpu: Arc::clone(gpu),
            stream,
            kernel: std::sync::OnceLock::new(),
        })
    }

    /// The GPU the stream runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Enqueues a copy of `len` bytes from `src` at `src_off` to `dst` at `dst_off` and returns
    /// its completion. Both memories are kept alive until the copy has finished.
    ///
    /// # Errors
    /// [`IpcError::OutOfRange`] before anything is enqueued; [`IpcError::Driver`].
    pub fn copy(
        &self,
        dst: Arc<dyn DeviceRange>,
        dst_off: usize,
        src: Arc<dyn DeviceRange>,
        src_off: usize,
        len: usize,
    ) -> Result<PendingCopy, IpcError> {
        self.copy_all(vec![DeviceCopy {
            dst,
            dst_offset: dst_off,
            src,
            src_offset: src_off,
            len,
        }])
    }

    /// Enqueues every copy on the stream and returns one completion for all of them (one event
    /// after the last). Copies of up to [`KERNEL_MAX_COPY`] bytes, when there are several, go
    /// to rixl's block-copy kernel in pieces of up to 64 KiB, 4096 pieces per launch; larger ones (and all of them where the
    /// driver cannot load the kernel, see [`Self::uses_kernel`]) get a `cuMemcpyAsync` each.
    /// The copies may run in any order among themselves, so destinations must not overlap.
    /// Every range is checked before anything is enqueued; every memory is kept alive until the
    /// copies finished.
    ///
    /// # Errors
    /// As [`Self::copy_each`].
    pub fn copy_all(&self, copies: Vec<DeviceCopy>) -> Result<PendingCopy, IpcError> {
        self.enqueue(copies, true)
    }

    /// Enqueues the copies in order, one `cuMemcpyAsync` each, and returns one completion for
    /// all of them (one event after the last: the stream runs its copies in order).
    ///
    /// # Errors
    /// [`IpcError::OutOfRange`] before anything is enqueued; [`IpcError::Driver`] (copies
    /// already enqueued are waited for before the error returns, so no memory is freed under
    /// them).
    pub fn copy_each(&self, copies: Vec<DeviceCopy>) -> Result<PendingCopy, IpcError> {
        self.enqueue(copies, false)
    }

    /// Whether [`Self::copy_all`] can use the block-copy kernel on this GPU (loads it once).
    pub fn uses_kernel(&self) -> bool {
        self.kernel().is_some()
    }

    fn kernel(&self) -> Option<&BlockKernel> {
        self.kernel
            .get_or_init(|| match BlockKernel::load(&self.gpu) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::warn!(error = %e, "block-copy kernel not loaded: a cuMemcpyAsync per copy");
                    None
                }
            })
            .as_ref()
    }

    fn enqueue(&self, copies: Vec<DeviceCopy>, use_kernel: bool) -> Result<PendingCopy, IpcError> {
        for c in &copies {
            check_ranges(&*c.dst, c.dst_offset, &*c.src, c.src_offset, c.len)?;
        }
        self.gpu.bind()?;
        let mut event = std::ptr::null_mut();
        // SAFETY: context current; flag 2 is CU_EVENT_DISABLE_TIMING (cheapest to query).
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut event, 2)
        })?;
        let mut pending = PendingCopy {
            gpu: Arc::clone(&self.gpu),
            event,
            keep: Vec::with_capacity(copies.len()),
            descs: Vec::new(),
            done: false,
        };
        let fits = copies.iter().filter(|c| c.len <= KERNEL_MAX_COPY).count();
        let kernel = if use_kernel && fits > 1 {
            self.kernel()
        } else {
            None
        };
        let mut failed = None;
        let mut small: Vec<[u64; 3]> = Vec::new();
        for c in copies {
            let (dst, src) = (
                c.dst.device_addr() + c.dst_offset as u64,
                c.src.device_addr() + c.src_offset as u64,
            );
            let len = c.len;
            pending.keep.push(c);
            if kernel.is_some() && len <= KERNEL_MAX_COPY {
                push_pieces(&mut small, dst, src, len as u64);
                continue;
            }
            // SAFETY: both ranges are inside live device allocations (checked above; `pending`
            // keeps them alive until its event completes). Unified addressing lets
            // cuMemcpyAsync copy between any two device pointers.
            let rc = unsafe { sys::cuMemcpyAsync(dst, src, len, self.stream) };
            if let Err(e) = check("cuMemcpyAsync", rc) {
                failed = Some(e);
                break;
            }
        }
        if let (Some(k), None) = (kernel, &failed) {
            for chunk in small.chunks(COPIES_PER_LAUNCH) {
                // SAFETY: the context is current; every triple is a checked range of memory
                // that `pending` keeps alive until its event (recorded after this launch)
                // completes; destinations do not overlap (the caller's contract); the stream is
                // ours.
                match unsafe { k.launch(chunk, self.stream) } {
                    Ok(d) => pending.descs.push(d),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
        }
        // SAFETY: `event` was just created and `stream` is live.
        let recorded = check("cuEventRecord", unsafe {
            sys::cuEventRecord(pending.event, self.stream)
        });
        let err = match (failed, recorded) {
            (None, Ok(())) => return Ok(pending),
            (Some(e), Ok(())) => e,
            (Some(e), Err(_)) | (None, Err(e)) => {
                // No event to wait on: wait for the whole stream before the memories go.
                // SAFETY: `stream` is live; this only blocks until its work is done.
                let _ = unsafe { sys::cuStreamSynchronize(self.stream) };
                pending.done = true;
                e
            }
        };
        drop(pending); // with the event recorded, waits for what was enqueued
        Err(err)
    }
}

/// The largest copy [`CopyStream::copy_all`] gives to the block-copy kernel; larger ones use the
/// copy engines (`cuMemcpyAsync`), which reach full bandwidth on their own.
pub const KERNEL_MAX_COPY: usize = 1 << 20;

/// The kernel copies each piece of at most this many bytes with one thread block.
const KERNEL_PIECE: u64 = 64 << 10;

/// Appends the kernel's (dst, src, len) pieces of one copy: at most [`KERNEL_PIECE`] bytes each,
/// so a larger copy is spread over several SMs. Pieces start at multiples of `KERNEL_PIECE` from
/// the copy's start, so they stay 16-byte aligned when the copy is. A zero-length copy has none.
fn push_pieces(out: &mut Vec<[u64; 3]>, dst: u64, src: u64, len: u64) {
    let mut at = 0;
    while at < len {
        let n = (len - at).min(KERNEL_PIECE);
        out.push([dst + at, src + at, n]);
        at += n;
    }
}

/// One device-to-device copy for [`CopyStream::copy_all`]: `len` bytes from `src` at
/// `src_offset` to `dst` at `dst_offset`.
#[derive(Debug, Clone)]
pub struct DeviceCopy {
    /// Destination memory.
    pub dst: Arc<dyn DeviceRange>,
    /// Offset in the destination.
    pub dst_offset: usize,
    /// Source memory.
    pub src: Arc<dyn DeviceRange>,
    /// Offset in the source.
    pub src_offset: usize,
    /// Bytes.
    pub len: usize,
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        if self.kernel.get().is_some_and(Option::is_some) {
            // The kernel's module is unloaded after this: no launch of it may still run.
            // SAFETY: `stream` is live; this only blocks until its work is done.
            let _ = unsafe { sys::cuStreamSynchronize(self.stream) };
        }
        // SAFETY: created in `new`, destroyed once; pending copies finish on their own (CUDA
        // completes enqueued work of a destroyed stream) and hold their memories.
        let rc = unsafe { sys::cuStreamDestroy_v2(self.stream) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?rc, "cuStreamDestroy failed");
        }
    }
}

/// Copies in flight, completed by one event. [`Self::poll`] is cheap (`cuEventQuery`); dropping
/// it before completion waits for the copies, so their memories are never freed while the GPU
/// still uses them.
#[derive(Debug)]
pub struct PendingCopy {
    gpu: Arc<Gpu>,
    event: sys::CUevent,
    keep: Vec<DeviceCopy>,
    /// Descriptor buffers the block-copy kernel reads; back to their pool after the event.
    descs: Vec<Descriptors>,
    done: bool,
}

// SAFETY: the event handle may be queried from any thread with the context current.
unsafe impl Send for PendingCopy {}

impl PendingCopy {
    /// Whether the copy has finished.
    ///
    /// # Errors
    /// [`IpcError::Driver`] if the copy failed.
    pub fn poll(&mut self) -> Result<bool, IpcError> {
        if self.done {
            return Ok(true);
        }
        self.gpu.bind()?;
        // SAFETY: `event` is live until `Drop`.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => {
                self.done = true;
                Ok(true)
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            rc => check("cuEventQuery", rc).map(|()| false),
        }
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        if !self.done {
            // SAFETY: `event` is live; waiting keeps the memories alive until the GPU is done.
            let _ = unsafe { sys::cuEventSynchronize(self.event) };
        }
        // SAFETY: created in `CopyStream::copy`, destroyed once here.
        let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_a_copy_exactly_in_aligned_blocks_of_at_most_64_kib() {
        let p = KERNEL_PIECE;
        for len in [0, 1, 15, p - 1, p, p + 1, 3 * p, 3 * p + 17, 1 << 20] {
            let mut out = Vec::new();
            push_pieces(&mut out, 0x10_0000, 0x90_0010, len);
            assert_eq!(out.len() as u64, len.div_ceil(p), "len {len}");
            let mut at = 0;
            for &[d, s, n] in &out {
                assert!(n > 0 && n <= p, "len {len}: piece of {n}");
                assert_eq!((d, s), (0x10_0000 + at, 0x90_0010 + at), "len {len}");
                assert_eq!(at % p, 0, "pieces start on piece boundaries");
                at += n;
            }
            assert_eq!(at, len, "the pieces add up to the copy");
        }
    }
}
