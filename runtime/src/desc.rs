//! Registered regions and descriptor lists.

use std::fmt;
use std::sync::Arc;

use rixl_gpudirect::GpuRegistration;
use rixl_verbs::{HostBuffer, OwnedRegistration, RegisteredBuffer};

/// Memory owned by an engine. Cheap to clone; the memory stays allocated (and registered) until
/// the last clone is dropped **and** no in-flight transfer uses it (the in-flight table holds
/// clones).
///
/// On a core with a NIC the memory is registered with it (RDMA and local tiers can use it); on a
/// core without one it is plain page-aligned host memory that only local tiers (files) use.
#[derive(Clone)]
pub struct Region {
    inner: Arc<RegionInner>,
}

enum Memory {
    Nic(RegisteredBuffer),
    Host(HostBuffer),
    Gpu(GpuRegistration),
}

struct RegionInner {
    mem: Memory,
    engine: u64,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("nic", &self.nic_buffer().is_some())
            .finish()
    }
}

impl Region {
    pub(crate) fn new(buf: RegisteredBuffer, engine: u64) -> Self {
        Region {
            inner: Arc::new(RegionInner {
                mem: Memory::Nic(buf),
                engine,
            }),
        }
    }

    pub(crate) fn gpu(reg: GpuRegistration, engine: u64) -> Self {
        Region {
            inner: Arc::new(RegionInner {
                mem: Memory::Gpu(reg),
                engine,
            }),
        }
    }

    pub(crate) fn host(buf: HostBuffer, engine: u64) -> Self {
        Region {
            inner: Arc::new(RegionInner {
                mem: Memory::Host(buf),
                engine,
            }),
        }
    }

    /// `len` bytes of zeroed, page-aligned host memory registered with no NIC: for local tiers
    /// (files) on any core. RDMA transfers refuse it ([`crate::InvalidDescriptor::NotRegistered`]).
    ///
    /// # Errors
    /// If `len` is zero or the allocation fails.
    pub fn unregistered(len: usize) -> Result<Region, rixl_verbs::Error> {
        Ok(Region::host(
            HostBuffer::new(len)?,
            crate::engine::next_engine_id(),
        ))
    }

    fn host_memory(&self) -> Option<&HostBuffer> {
        match &self.inner.mem {
            Memory::Nic(b) => Some(b.memory()),
            Memory::Host(b) => Some(b),
            Memory::Gpu(_) => None,
        }
    }

    /// The NIC registration of host memory, if the memory is host memory registered with a NIC.
    pub fn nic_buffer(&self) -> Option<&RegisteredBuffer> {
        match &self.inner.mem {
            Memory::Nic(b) => Some(b),
            Memory::Host(_) | Memory::Gpu(_) => None,
        }
    }

    /// The GPU registration, if this is GPU memory (GPUDirect RDMA).
    pub fn gpu_registration(&self) -> Option<&GpuRegistration> {
        match &self.inner.mem {
            Memory::Gpu(g) => Some(g),
            _ => None,
        }
    }

    /// The NIC registration of any memory kind (host or GPU), for posting work requests.
    pub fn registration(&self) -> Option<&dyn OwnedRegistration> {
        match &self.inner.mem {
            Memory::Nic(b) => Some(b),
            Memory::Gpu(g) => Some(g),
            Memory::Host(_) => None,
        }
    }

    /// The NIC registration as a slice (empty for host memory), for the verbs layer's checked
    /// posting: an SGE into host memory is then refused, never posted.
    pub(crate) fn nic_slice(&self) -> &[RegisteredBuffer] {
        match &self.inner.mem {
            Memory::Nic(b) => std::slice::from_ref(b),
            Memory::Host(_) | Memory::Gpu(_) => &[],
        }
    }

    /// Start address (the iova peers use; the device address for GPU memory).
    pub fn addr(&self) -> u64 {
        match &self.inner.mem {
            Memory::Gpu(g) => g.addr(),
            _ => self.host_memory().map_or(0, HostBuffer::addr),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match &self.inner.mem {
            Memory::Gpu(g) => g.len() as u64,
            _ => self.host_memory().map_or(0, |h| h.len() as u64),
        }
    }

    /// Whether this is GPU memory.
    pub fn is_gpu(&self) -> bool {
        matches!(self.inner.mem, Memory::Gpu(_))
    }

    /// Whether the region is empty (never).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Local key (0 for memory not registered with a NIC).
    pub fn lkey(&self) -> u32 {
        self.registration().map_or(0, |r| r.memory_region().lkey())
    }

    /// Remote key, to give to peers that may access this region (0 for memory not registered
    /// with a NIC, which peers cannot reach).
    pub fn rkey(&self) -> u32 {
        self.registration().map_or(0, |r| r.memory_region().rkey())
    }

    /// A remote descriptor for `len` bytes at `offset`, as a peer would use it.
    pub fn remote(&self, offset: u64, len: u64) -> RemoteDesc {
        RemoteDesc {
            addr: self.addr().wrapping_add(offset),
            len,
            rkey: self.rkey(),
        }
    }

    /// Copies `src` into the region at `offset`.
    ///
    /// # Errors
    /// If the range is outside the region.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), rixl_verbs::Error> {
        let off = usize::try_from(offset).unwrap_or(usize::MAX);
        match &self.inner.mem {
            Memory::Gpu(g) => g.memory().write(off, src).map_err(gpu_err),
            _ => self.host_memory().map_or(Ok(()), |h| h.write_at(off, src)),
        }
    }

    /// Copies bytes at `offset` out of the region.
    ///
    /// # Errors
    /// If the range is outside the region.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), rixl_verbs::Error> {
        let off = usize::try_from(offset).unwrap_or(usize::MAX);
        match &self.inner.mem {
            Memory::Gpu(g) => g.memory().read(off, dst).map_err(gpu_err),
            _ => self.host_memory().map_or(Ok(()), |h| h.read_at(off, dst)),
        }
    }

    /// Id of the engine (protection domain) this region belongs to.
    pub fn engine_id(&self) -> u64 {
        self.inner.engine
    }

    /// Whether two handles are the same registration.
    pub fn same(&self, other: &Region) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Number of live handles (including those held by in-flight transfers).
    pub fn handle_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }
}

fn gpu_err(e: rixl_gpudirect::Error) -> rixl_verbs::Error {
    rixl_verbs::Error::InvalidArgument(format!("GPU copy: {e}"))
}

/// One local descriptor: `len` bytes at `offset` of region number `region` of its list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalDesc {
    /// Index into the list's regions.
    pub region: u32,
    /// Offset into the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A list of local descriptors over one or more registered regions.
#[derive(Debug, Clone, Default)]
pub struct LocalDescList {
    regions: Vec<Region>,
    descs: Vec<LocalDesc>,
}

impl LocalDescList {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty list with room for `n` descriptors.
    pub fn with_capacity(n: usize) -> Self {
        LocalDescList {
            regions: Vec::with_capacity(1),
            descs: Vec::with_capacity(n),
        }
    }

    /// Appends `len` bytes at `offset` of `region`. Ranges are validated when the transfer is made.
    pub fn push(&mut self, region: &Region, offset: u64, len: u64) {
        let idx = match self.regions.iter().rposition(|r| r.same(region)) {
            Some(i) => i,
            None => {
                self.regions.push(region.clone());
                self.regions.len() - 1
            }
        };
        self.descs.push(LocalDesc {
            region: u32::try_from(idx).unwrap_or(u32::MAX),
            offset,
            len,
        });
    }

    /// The descriptors.
    pub fn descs(&self) -> &[LocalDesc] {
        &self.descs
    }

    /// The regions the descriptors refer to.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.descs.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    /// Sum of the lengths (saturating).
    pub fn total_len(&self) -> u64 {
        self.descs.iter().fold(0u64, |a, d| a.saturating_add(d.len))
    }
}

/// One remote descriptor: `len` bytes at the peer's `addr`, accessible under `rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteDesc {
    /// Remote start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

/// A list of remote descriptors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoteDescList(pub Vec<RemoteDesc>);

impl RemoteDescList {
    /// Sum of the lengths (saturating).
    pub fn total_len(&self) -> u64 {
        self.0.iter().fold(0u64, |a, d| a.saturating_add(d.len))
    }
}

impl FromIterator<RemoteDesc> for RemoteDescList {
    fn from_iter<I: IntoIterator<Item = RemoteDesc>>(iter: I) -> Self {
        RemoteDescList(iter.into_iter().collect())
    }
}

/// Direction of a one-sided transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Local → remote (RDMA WRITE).
    Write,
    /// Remote → local (RDMA READ).
    Read,
}
