//! Memory regions: caller memory registered with the NIC, and owned registered buffers.

use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::BitOr;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::host::HostBuffer;
use crate::pd::ProtectionDomain;
use crate::sys;

/// Access rights of a memory region.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// The NIC may write the region locally (needed for RECV and READ targets).
    pub const LOCAL_WRITE: Self = Self(sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE);
    /// Peers may RDMA WRITE into the region.
    pub const REMOTE_WRITE: Self = Self(sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE);
    /// Peers may RDMA READ from the region.
    pub const REMOTE_READ: Self = Self(sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ);
    /// Peers may run atomics on the region.
    pub const REMOTE_ATOMIC: Self = Self(sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC);
    /// Memory windows may be bound to the region ([`crate::MemoryWindow`]): the grants of
    /// its windows, not the region's own rkey, then decide what peers reach.
    pub const MW_BIND: Self = Self(sys::ibv_access_flags::IBV_ACCESS_MW_BIND);
    /// Allow relaxed PCIe ordering (faster on some platforms).
    pub const RELAXED_ORDERING: Self = Self(sys::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING);
    /// Local write plus remote read and write: what a transfer buffer usually needs.
    pub const ALL_RDMA: Self = Self(
        sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ,
    );

    /// The raw `ibv_access_flags` bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Whether all of `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for AccessFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl fmt::Debug for AccessFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::LOCAL_WRITE, "LOCAL_WRITE"),
            (Self::REMOTE_WRITE, "REMOTE_WRITE"),
            (Self::REMOTE_READ, "REMOTE_READ"),
            (Self::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
            (Self::MW_BIND, "MW_BIND"),
            (Self::RELAXED_ORDERING, "RELAXED_ORDERING"),
        ];
        let set: Vec<_> = names
            .iter()
            .filter(|(f, _)| self.contains(*f))
            .map(|(_, n)| *n)
            .collect();
        write!(f, "AccessFlags({})", set.join("|"))
    }
}

/// A registered memory region (`ibv_mr`). It keeps its protection domain alive; it does **not**
/// own the memory it covers (see [`RegisteredBuffer`] for that).
pub struct MemoryRegion {
    raw: NonNull<sys::ibv_mr>,
    addr: u64,
    len: usize,
    lkey: u32,
    rkey: u32,
    _pd: ProtectionDomain,
}

// SAFETY: an `ibv_mr` is an immutable handle after registration; deregistration is thread-safe.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above; `&MemoryRegion` only reads the cached keys.
unsafe impl Sync for MemoryRegion {}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey))
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .finish()
    }
}

impl MemoryRegion {
    /// Registers `len` bytes at `addr` with the NIC (`ibv_reg_mr`, iova = `addr`).
    ///
    /// # Safety
    /// `addr..addr+len` must be memory of this process that stays allocated (not freed, not
    /// unmapped) until this region is dropped **and** every work request that references it, locally
    /// or through its rkey, has completed or been flushed. While the NIC may write it (local or
    /// remote write access), the caller must not hold Rust references to it that assume no
    /// concurrent modification.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero length; the failing verb's error variant if registration fails (e.g.
    /// `ENOMEM` when the memlock limit is too small, `EFAULT` for an unmapped range).
    pub unsafe fn register_raw(
        pd: &ProtectionDomain,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Self> {
        if len == 0 || addr.is_null() {
            return Err(Error::InvalidArgument(
                "memory region must be non-null and non-empty".into(),
            ));
        }
        // SAFETY: the PD is live; the caller guarantees the range is valid for the region's
        // lifetime (see `# Safety`).
        let raw = unsafe {
            sys::ibv_reg_mr_iova2(pd.as_raw(), addr.cast(), len, addr as u64, access.bits())
        };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os(Error::RegisterMemory))?;
        // SAFETY: `raw` was just returned by a successful registration and is not shared yet.
        let (lkey, rkey) = unsafe { ((*raw.as_ptr()).lkey, (*raw.as_ptr()).rkey) };
        tracing::debug!(
            addr = addr as u64,
            len,
            lkey,
            rkey,
            ?access,
            "registered memory region"
        );
        Ok(MemoryRegion {
            raw,
            addr: addr as u64,
            len,
            lkey,
            rkey,
            _pd: pd.clone(),
        })
    }

    /// Registers `len` bytes at `offset` of a dma-buf (`ibv_reg_dmabuf_mr`), addressed by peers
    /// at `iova`: how GPU memory exported by the CUDA driver (`cuMemGetHandleForAddressRange`) is
    /// registered for GPUDirect RDMA without nvidia-peermem.
    ///
    /// # Safety
    /// The memory behind `fd` must stay allocated until this region is dropped **and** every work
    /// request that references it has completed or been flushed (the exporter may keep its pages
    /// pinned only while the memory exists). `fd` itself may be closed after this returns.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero length; [`Error::RegisterMemory`] if the kernel or
    /// provider refuses (no dma-buf support: `EOPNOTSUPP`/`ENOSYS`).
    pub unsafe fn register_dmabuf(
        pd: &ProtectionDomain,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<Self> {
        use std::os::fd::AsRawFd;
        if len == 0 {
            return Err(Error::InvalidArgument(
                "dma-buf region must be non-empty".into(),
            ));
        }
        // SAFETY: the PD is live and `fd` is an open descriptor for the call's duration; the
        // caller guarantees the exported memory outlives the region (see `# Safety`).
        let raw = unsafe {
            sys::ibv_reg_dmabuf_mr(
                pd.as_raw(),
                offset,
                len,
                iova,
                fd.as_raw_fd(),
                access.bits() as i32,
            )
        };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os(Error::RegisterMemory))?;
        // SAFETY: `raw` was just returned by a successful registration and is not shared yet.
        let (lkey, rkey) = unsafe { ((*raw.as_ptr()).lkey, (*raw.as_ptr()).rkey) };
        tracing::debug!(iova, len, lkey, rkey, "registered dma-buf memory region");
        Ok(MemoryRegion {
            raw,
            addr: iova,
            len,
            lkey,
            rkey,
            _pd: pd.clone(),
        })
    }

    /// Start address (also the iova used by remote peers).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never true for a registered region).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Local key, for scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// Remote key, for peers' RDMA READ/WRITE.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Whether `[addr, addr+len)` lies inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len as u64)
    }

    /// The raw `ibv_mr`.
    pub fn as_raw(&self) -> *mut sys::ibv_mr {
        self.raw.as_ptr()
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: the region was registered by us and is deregistered exactly once; the PD is kept
        // alive by `_pd`.
        let rc = unsafe { sys::ibv_dereg_mr(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, addr = self.addr, "ibv_dereg_mr failed");
        }
    }
}

/// Memory that owns its NIC registration: what the checked posting methods
/// ([`crate::QueuePair::post_send_in`]) accept.
///
/// # Safety
/// Implementors must deregister [`Self::memory_region`] before the memory it covers is freed or
/// unmapped, so the NIC can never reach freed memory through it.
pub unsafe trait OwnedRegistration {
    /// The registration.
    fn memory_region(&self) -> &MemoryRegion;
}

// SAFETY: forwards to `T`, which upholds the contract.
unsafe impl<T: OwnedRegistration + ?Sized> OwnedRegistration for &T {
    fn memory_region(&self) -> &MemoryRegion {
        (**self).memory_region()
    }
}

/// Memory `M` and its NIC registration, owned together: the region is deregistered before `M`
/// is dropped, so the NIC never reaches freed memory. [`RegisteredBuffer`] (owned host memory),
/// [`SharedRegistration`] (host memory shared by several NICs) and the GPU crate's registration
/// are this type.
pub struct Registered<M> {
    // Deregistered explicitly in `Drop`, before `mem` (a later field) is dropped.
    mr: ManuallyDrop<MemoryRegion>,
    mem: M,
}

/// Page-aligned, zero-initialised heap memory registered with the NIC, owned by this value.
/// Keep it alive while work requests that reference it are outstanding (the runtime's in-flight
/// table does this).
pub type RegisteredBuffer = Registered<HostBuffer>;

/// Host memory shared by several registrations (one per NIC/protection domain: multi-rail).
/// Each deregisters before it drops its handle on the memory, which is freed with the last one.
pub type SharedRegistration = Registered<std::sync::Arc<HostBuffer>>;

impl<M> fmt::Debug for Registered<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registered").field("mr", &self.mr).finish()
    }
}

impl<M> Registered<M> {
    /// Pairs a registration with the memory it covers.
    ///
    /// # Safety
    /// `mr` must cover memory that `mem` owns or keeps alive, so that dropping `mem` (which
    /// happens after `mr` is deregistered) is the earliest the memory can be freed.
    pub unsafe fn from_parts(mr: MemoryRegion, mem: M) -> Self {
        Registered {
            mr: ManuallyDrop::new(mr),
            mem,
        }
    }

    /// The memory region.
    pub fn region(&self) -> &MemoryRegion {
        &self.mr
    }

    /// The registered memory.
    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// Start address (the iova).
    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mr.len()
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

impl<M> Drop for Registered<M> {
    fn drop(&mut self) {
        // SAFETY: `mr` is dropped exactly once, here, and never used again; `mem` is dropped
        // after this returns (field drop), when the NIC can no longer address it.
        unsafe { ManuallyDrop::drop(&mut self.mr) };
    }
}

// SAFETY: `Drop` deregisters before `mem`, which owns or keeps alive the covered memory
// (`from_parts`' contract), is dropped.
unsafe impl<M> OwnedRegistration for Registered<M> {
    fn memory_region(&self) -> &MemoryRegion {
        &self.mr
    }
}

/// Host memory a [`Registered`] can own or keep alive: a [`HostBuffer`], or an `Arc` of one
/// shared by several NICs.
pub trait HostMemory {
    /// The buffer.
    fn host(&self) -> &HostBuffer;
}

impl HostMemory for HostBuffer {
    fn host(&self) -> &HostBuffer {
        self
    }
}

impl HostMemory for std::sync::Arc<HostBuffer> {
    fn host(&self) -> &HostBuffer {
        self
    }
}

impl<M: HostMemory> Registered<M> {
    /// Registers host memory this value will own or keep alive.
    ///
    /// # Errors
    /// [`Error::RegisterMemory`] if registration fails.
    pub fn register(pd: &ProtectionDomain, mem: M, access: AccessFlags) -> Result<Self> {
        let (ptr, len) = (mem.host().as_ptr(), mem.host().len());
        // SAFETY: `mem` owns or keeps alive the buffer and is dropped only after the region is
        // deregistered (see `Drop`).
        let mr = unsafe { MemoryRegion::register_raw(pd, ptr, len, access) }?;
        // SAFETY: `mr` covers exactly the buffer `mem` keeps alive.
        Ok(unsafe { Self::from_parts(mr, mem) })
    }

    /// The contents. Do not rely on them while a transfer (or a peer with remote write access)
    /// may be writing the buffer.
    pub fn as_slice(&self) -> &[u8] {
        self.mem.host().as_slice()
    }

    /// See [`HostBuffer::write_at`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the range is outside the buffer.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.mem.host().write_at(offset, src)
    }

    /// See [`HostBuffer::read_at`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the range is outside the buffer.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.mem.host().read_at(offset, dst)
    }

    /// Raw pointer to the start.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem.host().as_ptr()
    }
}

impl RegisteredBuffer {
    /// Allocates `len` zeroed bytes (page aligned) and registers them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero length, the failing verb's error variant if allocation or registration
    /// fails.
    pub fn new(pd: &ProtectionDomain, len: usize, access: AccessFlags) -> Result<Self> {
        Self::register(pd, HostBuffer::new(len)?, access)
    }

    /// The contents, mutably. Do not write while a transfer may be reading the buffer.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem.as_mut_slice()
    }
}
