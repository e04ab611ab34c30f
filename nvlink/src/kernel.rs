//! The block-copy kernel (`kernels/copy_blocks.cu`, embedded as PTX and JIT-compiled by the
//! driver): many small device copies in one launch, reading their (dst, src, len) triples from
//! pinned host memory mapped into the GPU's address space. Descriptor buffers are pooled per
//! stream and go back to the pool only when the launch that reads them has finished.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use rixl_gpudirect::{Gpu, PinnedHostMemory};

use crate::ipc::{check, IpcError};

/// The PTX, `.version 7.0` (drivers from CUDA 11.0 on), `.target sm_75`.
const PTX: &str = concat!(include_str!("../kernels/copy_blocks.ptx"), "\0");

/// Copies per descriptor buffer (and per launch): 24 bytes each, 96 KiB a buffer.
pub(crate) const COPIES_PER_LAUNCH: usize = 4096;

/// Threads per block: each block copies one descriptor at a time, its threads striding through it.
const THREADS: u32 = 512;

/// The loaded module and its function, unloaded on drop.
#[derive(Debug)]
pub(crate) struct BlockKernel {
    gpu: Arc<Gpu>,
    module: sys::CUmodule,
    function: sys::CUfunction,
    pool: Pool,
}

/// Free descriptor buffers, each with the device address a kernel reads it at (looked up once,
/// when the buffer is allocated).
type Pool = Arc<Mutex<Vec<(PinnedHostMemory, u64)>>>;

// SAFETY: module and function handles may be used from any thread with the context current
// (`bind`); the pool is behind a mutex.
unsafe impl Send for BlockKernel {}
// SAFETY: as above; launching a function from several threads is allowed by CUDA.
unsafe impl Sync for BlockKernel {}

impl BlockKernel {
    /// Loads the PTX into `gpu`'s context.
    ///
    /// # Errors
    /// [`IpcError::Driver`] when the driver cannot JIT it (too old, say).
    pub(crate) fn load(gpu: &Arc<Gpu>) -> Result<BlockKernel, IpcError> {
        gpu.bind()?;
        let mut module = std::ptr::null_mut();
        // SAFETY: the context is current; `PTX` is a NUL-terminated PTX image that lives for the
        // program; `module` is a valid out-pointer.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, PTX.as_ptr().cast())
        })?;
        let mut function = std::ptr::null_mut();
        // SAFETY: `module` was just loaded; the name is NUL-terminated; `function` is a valid
        // out-pointer.
        let rc = unsafe {
            sys::cuModuleGetFunction(&mut function, module, c"rixl_copy_blocks".as_ptr())
        };
        if let Err(e) = check("cuModuleGetFunction", rc) {
            // SAFETY: loaded above, unloaded once; nothing was launched from it.
            let _ = unsafe { sys::cuModuleUnload(module) };
            return Err(e);
        }
        Ok(BlockKernel {
            gpu: Arc::clone(gpu),
            module,
            function,
            pool: Arc::default(),
        })
    }

    /// Launches one copy of every `(dst, src, len)` in `triples` (at most
    /// [`COPIES_PER_LAUNCH`]) on `stream`, and returns the descriptor buffer the launch reads,
    /// which must be kept until the launch has finished.
    ///
    /// # Safety
    /// The context must be current; every triple must be a range inside device memory that stays
    /// allocated until the launch has finished, no two destinations may overlap, and `stream`
    /// must be a live stream of this context.
    pub(crate) unsafe fn launch(
        &self,
        triples: &[[u64; 3]],
        stream: sys::CUstream,
    ) -> Result<Descriptors, IpcError> {
        debug_assert!(!triples.is_empty() && triples.len() <= COPIES_PER_LAUNCH);
        let reused = self.pool.lock().map(|mut p| p.pop()).unwrap_or(None);
        let (mut buf, mut ptr) = match reused {
            Some(b) => b,
            None => {
                let b = PinnedHostMemory::alloc(&self.gpu, COPIES_PER_LAUNCH * 24)?;
                let ptr = b.device_ptr()?;
                (b, ptr)
            }
        };
        for (slot, t) in buf.as_mut_slice().chunks_exact_mut(24).zip(triples) {
            for (b, v) in slot.chunks_exact_mut(8).zip(t) {
                b.copy_from_slice(&v.to_ne_bytes());
            }
        }
        let descs = Descriptors {
            buf: Some((buf, ptr)),
            pool: Arc::clone(&self.pool),
        };
        let mut count = triples.len() as u32;
        let mut params = [
            (&mut ptr as *mut u64).cast::<c_void>(),
            (&mut count as *mut u32).cast::<c_void>(),
        ];
        // SAFETY: the function takes (const u64*, u32), which `params` points to; the descriptor
        // buffer is pinned, mapped host memory that `descs` keeps alive (the caller keeps it
        // until the launch finished); the ranges it names are live (caller's contract).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.function,
                count,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        Ok(descs)
    }
}

impl Drop for BlockKernel {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: loaded in `load`, unloaded once; the owning stream was synchronized before (see
        // `CopyStream`'s drop), so no launch of it is running.
        let rc = unsafe { sys::cuModuleUnload(self.module) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?rc, "cuModuleUnload failed");
        }
    }
}

/// A descriptor buffer read by a launch; back to its pool when dropped.
#[derive(Debug)]
pub(crate) struct Descriptors {
    buf: Option<(PinnedHostMemory, u64)>,
    pool: Pool,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        if let (Some(b), Ok(mut pool)) = (self.buf.take(), self.pool.lock()) {
            pool.push(b);
        }
    }
}
