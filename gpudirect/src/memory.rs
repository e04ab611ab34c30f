//! GPU contexts, device memory and pinned host memory through the CUDA driver API.

use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use crate::{cuda_available, driver, Error};

pub(crate) fn check(call: &'static str, rc: sys::CUresult) -> Result<(), Error> {
    rc.result().map_err(driver(call))
}

/// A GPU's primary context, retained for the life of this value (and of every allocation made
/// in it, which hold an `Arc`).
#[derive(Debug)]
pub struct Gpu {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be used from any thread (each thread makes it current with
// `bind` before use); the handle itself is immutable here.
unsafe impl Send for Gpu {}
// SAFETY: as above; no method mutates `self`.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Retains GPU `ordinal`'s primary context.
    ///
    /// # Errors
    /// [`Error::NoCuda`] without a driver; [`Error::Driver`] for a bad ordinal or a failing call.
    pub fn open(ordinal: i32) -> Result<Arc<Gpu>, Error> {
        if !cuda_available() {
            return Err(Error::NoCuda);
        }
        cudarc::driver::result::init().map_err(driver("cuInit"))?;
        let dev = cudarc::driver::result::device::get(ordinal).map_err(driver("cuDeviceGet"))?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the driver is initialised and `dev` valid; `ctx` is a valid out-pointer.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        Ok(Arc::new(Gpu { ordinal, dev, ctx }))
    }

    /// Makes the context current on the calling thread.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn bind(&self) -> Result<(), Error> {
        // SAFETY: `ctx` is a retained primary context, alive while `self` is.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The raw context.
    pub fn as_raw(&self) -> sys::CUcontext {
        self.ctx
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: retained in `open`, released exactly once here; allocations keep `self` alive,
        // so none outlives the context.
        let rc = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?rc, "cuDevicePrimaryCtxRelease failed");
        }
    }
}

/// Granularity of device allocations, so the whole allocation can be exported as a dma-buf
/// (which needs host-page-aligned ranges).
pub const DEVICE_ALIGN: usize = 2 << 20;

/// Device memory: allocated here (`cuMemAlloc`, freed on drop), or a range of the caller's own
/// allocation ([`DeviceMemory::from_cuda_slice`], [`DeviceMemory::from_raw`]).
pub struct DeviceMemory {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// The whole allocation the range lies in (what a dma-buf export covers).
    base: sys::CUdeviceptr,
    allocated: usize,
    owner: Owner,
}

/// What keeps a [`DeviceMemory`] valid.
enum Owner {
    /// Allocated by [`DeviceMemory::alloc`], freed on drop.
    Allocated,
    /// The caller's allocation, owned from now on and dropped with this value (a cudarc
    /// `CudaSlice`, which frees it, or the memory this is a slice of).
    Caller(#[allow(dead_code)] Box<dyn std::any::Any + Send + Sync>),
    /// The caller's allocation under its promise ([`DeviceMemory::from_raw`]).
    Borrowed,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("gpu", &self.gpu.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("allocated_here", &matches!(self.owner, Owner::Allocated))
            .finish()
    }
}

/// Checks that `len` bytes at `ptr` lie inside one allocation of the current context; returns
/// the allocation (base, size).
fn allocation_of(ptr: sys::CUdeviceptr, len: usize) -> Result<(sys::CUdeviceptr, usize), Error> {
    if len == 0 {
        return Err(Error::InvalidArgument("device range of 0 bytes".into()));
    }
    let (mut base, mut size) = (0, 0usize);
    // SAFETY: the caller made the context current; `base` and `size` are valid out-pointers.
    check("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    match (ptr - base).checked_add(len as u64) {
        Some(end) if end <= size as u64 => Ok((base, size)),
        _ => Err(Error::OutsideAllocation {
            ptr,
            len,
            base,
            size,
        }),
    }
}

impl DeviceMemory {
    /// Allocates `len` bytes on `gpu` (rounded up to [`DEVICE_ALIGN`] internally).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero length; [`Error::Driver`] (out of memory, ...).
    pub fn alloc(gpu: &Arc<Gpu>, len: usize) -> Result<DeviceMemory, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "device allocation of 0 bytes".into(),
            ));
        }
        let allocated = len.div_ceil(DEVICE_ALIGN) * DEVICE_ALIGN;
        gpu.bind()?;
        let mut ptr = 0;
        // SAFETY: the context is current; `ptr` is a valid out-pointer.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, allocated)
        })?;
        Ok(DeviceMemory {
            gpu: Arc::clone(gpu),
            ptr,
            len,
            base: ptr,
            allocated,
            owner: Owner::Allocated,
        })
    }

    /// The caller's device memory from cudarc (its allocator's `CudaSlice<u8>`), owned from now
    /// on: freed by cudarc when this value is dropped. Work queued on the slice's stream is
    /// waited for first, so a transfer never races the engine's own kernels that wrote it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty slice, [`Error::Driver`] for a failing call.
    pub fn from_cuda_slice(slice: cudarc::driver::CudaSlice<u8>) -> Result<DeviceMemory, Error> {
        use cudarc::driver::DevicePtr;
        let gpu = Gpu::open(slice.ordinal() as i32)?;
        let stream = Arc::clone(slice.stream());
        let ptr = {
            let (ptr, _read) = slice.device_ptr(&stream);
            ptr
        };
        stream
            .synchronize()
            .map_err(crate::driver("cuStreamSynchronize"))?;
        gpu.bind()?;
        let len = slice.len();
        let (base, allocated) = allocation_of(ptr, len)?;
        Ok(DeviceMemory {
            gpu,
            ptr,
            len,
            base,
            allocated,
            owner: Owner::Caller(Box::new(slice)),
        })
    }

    /// `len` bytes at device address `ptr` on `gpu`, from the caller's own allocator (a
    /// `CUdeviceptr`, possibly inside a larger allocation: checked with
    /// `cuMemGetAddressRange`).
    ///
    /// # Safety
    /// The allocation must stay allocated (not freed, not unmapped) until this value **and**
    /// every registration made from it have been dropped or released, and no transfer or peer
    /// may still reach it: for an agent registration, until `release().await` has resolved.
    /// While it is registered, the NIC, CUDA IPC peers and copies may read and write it at any
    /// time.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero length, [`Error::OutsideAllocation`] for a range
    /// that leaves the allocation, [`Error::Driver`] for an address the driver does not know.
    pub unsafe fn from_raw(
        gpu: &Arc<Gpu>,
        ptr: sys::CUdeviceptr,
        len: usize,
    ) -> Result<DeviceMemory, Error> {
        gpu.bind()?;
        let (base, allocated) = allocation_of(ptr, len)?;
        Ok(DeviceMemory {
            gpu: Arc::clone(gpu),
            ptr,
            len,
            base,
            allocated,
            owner: Owner::Borrowed,
        })
    }

    /// `len` bytes at `offset` of `parent`, as memory of its own that keeps `parent` alive (a
    /// registration of a range inside a larger allocation, such as one layer of a KV pool).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty range or one outside `parent`.
    pub fn slice_of(
        parent: &Arc<DeviceMemory>,
        offset: usize,
        len: usize,
    ) -> Result<DeviceMemory, Error> {
        parent.range(offset, len)?;
        if len == 0 {
            return Err(Error::InvalidArgument("device range of 0 bytes".into()));
        }
        Ok(DeviceMemory {
            gpu: Arc::clone(&parent.gpu),
            ptr: parent.ptr + offset as u64,
            len,
            base: parent.base,
            allocated: parent.allocated,
            owner: Owner::Caller(Box::new(Arc::clone(parent))),
        })
    }

    /// Where the range starts inside the allocation a dma-buf export covers.
    pub fn dmabuf_offset(&self) -> u64 {
        self.ptr - self.base
    }

    /// Device address (unified addressing: also the RDMA iova of a registration).
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Usable length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn range(&self, offset: usize, len: usize) -> Result<(), Error> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "range {offset}+{len} outside {} bytes of device memory",
                self.len
            ))),
        }
    }

    /// Copies `src` to the device at `offset` (synchronous).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] outside the allocation; [`Error::Driver`].
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), Error> {
        self.range(offset, src.len())?;
        self.gpu.bind()?;
        // SAFETY: the destination range lies inside the live allocation (checked) and `src` is a
        // valid host slice of that length.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, src.as_ptr().cast(), src.len())
        })
    }

    /// Copies device bytes at `offset` into `dst` (synchronous).
    ///
    /// # Errors
    /// As [`Self::write`].
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), Error> {
        self.range(offset, dst.len())?;
        self.gpu.bind()?;
        // SAFETY: the source range lies inside the live allocation (checked) and `dst` is a valid
        // mutable host slice of that length.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + offset as u64, dst.len())
        })
    }

    /// Copies `len` device bytes at `offset` into host buffer `dst` at `dst_offset`, with one
    /// synchronous `cuMemcpyDtoH` (a staging copy into pinned or NIC-registered memory).
    ///
    /// # Errors
    /// As [`Self::write`], and [`Error::InvalidArgument`] outside `dst`.
    pub fn read_into(
        &self,
        offset: usize,
        dst: &rixl_verbs::HostBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), Error> {
        self.range(offset, len)?;
        host_range(dst, dst_offset, len)?;
        self.gpu.bind()?;
        // SAFETY: the source range lies inside the live allocation and the destination range
        // inside `dst`'s (both checked); `dst` is borrowed for the call, so it stays mapped.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(
                dst.as_ptr().add(dst_offset).cast(),
                self.ptr + offset as u64,
                len,
            )
        })
    }

    /// Copies `len` bytes at `src_offset` of host buffer `src` to the device at `offset`, with
    /// one synchronous `cuMemcpyHtoD`.
    ///
    /// # Errors
    /// As [`Self::read_into`].
    pub fn write_from(
        &self,
        offset: usize,
        src: &rixl_verbs::HostBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<(), Error> {
        self.range(offset, len)?;
        host_range(src, src_offset, len)?;
        self.gpu.bind()?;
        // SAFETY: as in `read_into`, with source and destination swapped.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(
                self.ptr + offset as u64,
                src.as_ptr().add(src_offset).cast(),
                len,
            )
        })
    }

    /// Copies all of `src` (same length or shorter) to the start of `self`, synchronously
    /// (`cuMemcpyDtoD`, the plain CUDA baseline).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `src` is longer; [`Error::Driver`].
    pub fn copy_from(&self, src: &DeviceMemory) -> Result<(), Error> {
        self.range(0, src.len)?;
        self.gpu.bind()?;
        // SAFETY: both are live allocations and the length fits both (checked).
        check("cuMemcpyDtoD", unsafe {
            sys::cuMemcpyDtoD_v2(self.ptr, src.ptr, src.len)
        })?;
        // SAFETY: the context is current; the null stream orders after the copy.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Sets every byte to `value`, and returns once it is done (a device memset may return
    /// before it completes, and copies on a non-blocking stream do not wait for it).
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn fill(&self, value: u8) -> Result<(), Error> {
        self.gpu.bind()?;
        // SAFETY: the whole allocation is live device memory of `allocated` bytes.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.ptr, value, self.allocated)
        })?;
        // SAFETY: the context is current; this waits for the memset.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Exports the allocation as a dma-buf file descriptor (for `ibv_reg_dmabuf_mr`).
    ///
    /// # Errors
    /// [`Error::Driver`] when the driver or GPU has no dma-buf support.
    pub fn export_dmabuf(&self) -> Result<OwnedFd, Error> {
        self.gpu.bind()?;
        let mut fd: i32 = -1;
        // SAFETY: the range is the whole allocation the memory lies in (cuMemAlloc allocations
        // are page aligned); `fd` is a valid out-pointer for an int, as the DMA_BUF_FD handle
        // type requires.
        check("cuMemGetHandleForAddressRange", unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast::<c_void>(),
                self.base,
                self.allocated,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        if fd < 0 {
            return Err(Error::InvalidArgument(
                "driver returned no dma-buf fd".into(),
            ));
        }
        // SAFETY: the driver returned a fresh descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if !matches!(self.owner, Owner::Allocated) {
            // The caller's allocation: freed by its owner (dropped after this), or by the caller.
            return;
        }
        let _ = self.gpu.bind();
        // SAFETY: allocated in `alloc`, freed once here; registrations and copies that use it
        // hold this value (or an `Arc` of it), so none is outstanding.
        let rc = unsafe { sys::cuMemFree_v2(self.ptr) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?rc, "cuMemFree failed");
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`, portable), for staging and fast host<->device
/// copies; freed on drop.
#[derive(Debug)]
pub struct PinnedHostMemory {
    gpu: Arc<Gpu>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the value owns the allocation; access goes through `&self`/`&mut self` slices.
unsafe impl Send for PinnedHostMemory {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for PinnedHostMemory {}

impl PinnedHostMemory {
    /// Allocates `len` bytes of pinned host memory.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero length; [`Error::Driver`].
    pub fn alloc(gpu: &Arc<Gpu>, len: usize) -> Result<PinnedHostMemory, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "pinned allocation of 0 bytes".into(),
            ));
        }
        gpu.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: the context is current; `p` is a valid out-pointer. Flag 1 is PORTABLE.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, len, 1)
        })?;
        // SAFETY: `p` is a fresh allocation of `len` bytes; zeroing initialises every byte.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        Ok(PinnedHostMemory {
            gpu: Arc::clone(gpu),
            ptr: p.cast(),
            len,
        })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live, initialised (zeroed in `alloc`) allocation of `len` bytes
        // owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Host address.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// The address a kernel uses to read this memory (pinned host memory is mapped into the
    /// GPU's address space; with unified addressing it equals [`Self::addr`]).
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn device_ptr(&self) -> Result<u64, Error> {
        self.gpu.bind()?;
        let mut dptr = 0;
        // SAFETY: the context is current; `ptr` is a live `cuMemHostAlloc` allocation; `dptr` is
        // a valid out-pointer; flags must be 0.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, self.ptr.cast(), 0)
        })?;
        Ok(dptr)
    }
}

impl Drop for PinnedHostMemory {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: allocated by `cuMemHostAlloc` in `alloc`, freed once here.
        let rc = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?rc, "cuMemFreeHost failed");
        }
    }
}

/// Checks that `offset..offset + len` lies inside `buf`.
fn host_range(buf: &rixl_verbs::HostBuffer, offset: usize, len: usize) -> Result<(), Error> {
    match offset.checked_add(len) {
        Some(end) if end <= buf.len() => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "range {offset}+{len} outside {} bytes of host memory",
            buf.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn caller_ranges_are_checked_against_their_allocation() {
        let gpu = match Gpu::open(0) {
            Ok(g) => g,
            Err(e) => {
                assert!(matches!(e, Error::NoCuda | Error::Driver { .. }), "{e}");
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED caller_ranges_are_checked_against_their_allocation: no GPU ({e})"
                );
                return;
            }
        };
        let pool = Arc::new(DeviceMemory::alloc(&gpu, 4 << 20).expect("alloc"));
        let pattern: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
        pool.write(1 << 20, &pattern).expect("write");
        // SAFETY: the range lies inside `pool`, which outlives `inner`.
        let inner = unsafe { DeviceMemory::from_raw(&gpu, pool.addr() + (1 << 20), 1 << 20) }
            .expect("a range inside the allocation");
        assert_eq!(inner.dmabuf_offset(), 1 << 20);
        let mut back = vec![0u8; 1 << 20];
        inner.read(0, &mut back).expect("read");
        assert!(back == pattern);
        // Borrowed memory: dropping it does not free the pool.
        drop(inner);
        // SAFETY: refused before the range is used.
        let outside = unsafe { DeviceMemory::from_raw(&gpu, pool.addr() + (1 << 20), 8 << 20) };
        assert!(
            matches!(outside, Err(Error::OutsideAllocation { .. })),
            "{outside:?}"
        );
        // SAFETY: refused before the range is used.
        let empty = unsafe { DeviceMemory::from_raw(&gpu, pool.addr(), 0) };
        assert!(matches!(empty, Err(Error::InvalidArgument(_))));
        let layer = DeviceMemory::slice_of(&pool, 1 << 20, 1 << 20).expect("slice");
        layer.read(0, &mut back).expect("read");
        assert!(back == pattern);
        assert!(DeviceMemory::slice_of(&pool, 3 << 20, 2 << 20).is_err());
        // A cudarc allocation, owned from now on.
        let ctx = cudarc::driver::CudaContext::new(0).expect("context");
        let slice = ctx
            .default_stream()
            .alloc_zeros::<u8>(1 << 20)
            .expect("cudarc alloc");
        let mem = DeviceMemory::from_cuda_slice(slice).expect("from cudarc");
        mem.write(0, &pattern).expect("write");
        mem.read(0, &mut back).expect("read");
        assert!(back == pattern);
        assert_eq!(mem.dmabuf_offset(), 0);
    }
}
