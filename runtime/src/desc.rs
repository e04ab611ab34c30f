//! Registered regions and descriptor lists.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use futures_channel::oneshot;
use rixl_gpudirect::GpuRegistration;
use rixl_verbs::{HostBuffer, OwnedRegistration, RegisteredBuffer, SharedRegistration};

pub use rixl_proto::desc::{Cursor, LocalDesc, Op, RegionInfo, RemoteDesc, RemoteDescList};

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
    Shared(SharedRegistration),
    /// GPU memory not registered with a NIC (a core without one): CUDA IPC and copies only.
    Device(rixl_gpudirect::DeviceMemory),
    /// A range of host memory inside a registration shared with other regions (the agent's
    /// registration cache): `view` is this region's memory, `mr` the registration covering it.
    Cached {
        mr: SharedMr,
        view: HostBuffer,
    },
}

struct RegionInner {
    // Dropped first: the memory is deregistered (and, if owned, freed) before `released` wakes
    // whoever waits for the region to go.
    mem: Memory,
    engine: u64,
    /// What a transfer needs of it, read from `mem` once when it is made (the memory and its
    /// registration never change): a small transfer reads these instead of matching on `mem`
    /// four times.
    facts: Facts,
    /// Resolved (by being dropped) once the last handle is gone and the memory deregistered.
    released: Mutex<Vec<oneshot::Sender<()>>>,
}

/// Host memory registered once with one engine's NIC and shared by the [`Region`]s of several
/// registrations ([`SharedMr::view`]): the agent's registration cache. The registration lives
/// while any region made from it does (the cache itself holds a [`WeakMr`]).
#[derive(Clone)]
pub struct SharedMr {
    inner: Arc<SharedMrInner>,
}

struct SharedMrInner {
    reg: SharedRegistration,
    engine: u64,
}

/// A [`SharedMr`] that does not keep the registration alive.
#[derive(Clone, Debug)]
pub struct WeakMr(Weak<SharedMrInner>);

impl WeakMr {
    /// The registration, if a region still uses it.
    pub fn upgrade(&self) -> Option<SharedMr> {
        self.0.upgrade().map(|inner| SharedMr { inner })
    }
}

impl fmt::Debug for SharedMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedMr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("engine", &self.inner.engine)
            .finish()
    }
}

impl SharedMr {
    pub(crate) fn new(reg: SharedRegistration, engine: u64) -> Self {
        SharedMr {
            inner: Arc::new(SharedMrInner { reg, engine }),
        }
    }

    /// Start address of the registered range.
    pub fn addr(&self) -> u64 {
        self.inner.reg.addr()
    }

    /// Length of the registered range.
    pub fn len(&self) -> u64 {
        self.inner.reg.len() as u64
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The engine (protection domain) it is registered with.
    pub fn engine_id(&self) -> u64 {
        self.inner.engine
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.inner.reg.rkey()
    }

    /// Whether `addr..addr+len` lies inside the registered range.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        self.inner.reg.region().contains(addr, len)
    }

    /// Regions using this registration (views, and handles on it such as this one).
    pub fn regions(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// A handle that does not keep the registration alive.
    pub fn downgrade(&self) -> WeakMr {
        WeakMr(Arc::downgrade(&self.inner))
    }

    /// A region of its own for `view`, memory inside the registered range, using this
    /// registration (no new one is made).
    ///
    /// # Errors
    /// [`InvalidDescriptor::ForeignRegion`] if `view` is not inside the registered range.
    pub fn view(&self, view: HostBuffer) -> Result<Region, crate::InvalidDescriptor> {
        if !self.covers(view.addr(), view.len() as u64) {
            return Err(crate::InvalidDescriptor::ForeignRegion { index: 0 });
        }
        let engine = self.inner.engine;
        Ok(Region::with(
            Memory::Cached {
                mr: self.clone(),
                view,
            },
            engine,
        ))
    }
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

impl RegionInner {
    fn registration(&self) -> Option<&dyn OwnedRegistration> {
        match &self.mem {
            Memory::Nic(b) => Some(b),
            Memory::Gpu(g) => Some(g),
            Memory::Shared(r) => Some(r),
            Memory::Cached { mr, .. } => Some(&mr.inner.reg),
            Memory::Host(_) | Memory::Device(_) => None,
        }
    }

    /// Start address: the device address for GPU memory, else the host buffer's.
    fn mem_addr(&self) -> u64 {
        match &self.mem {
            Memory::Gpu(g) => g.memory().addr(),
            Memory::Device(d) => d.addr(),
            Memory::Nic(b) => b.memory().addr(),
            Memory::Host(b) => b.addr(),
            Memory::Shared(r) => r.memory().addr(),
            Memory::Cached { view, .. } => view.addr(),
        }
    }

    fn mem_len(&self) -> u64 {
        match &self.mem {
            Memory::Gpu(g) => g.memory().len() as u64,
            Memory::Device(d) => d.len() as u64,
            Memory::Nic(b) => b.memory().len() as u64,
            Memory::Host(b) => b.len() as u64,
            Memory::Shared(r) => r.memory().len() as u64,
            Memory::Cached { view, .. } => view.len() as u64,
        }
    }
}

/// A region's address, length, local key and kind, as the planner needs them.
#[derive(Debug, Clone, Copy)]
struct Facts {
    addr: u64,
    len: u64,
    lkey: u32,
    registered: bool,
    gpu: bool,
}

impl Region {
    fn with(mem: Memory, engine: u64) -> Self {
        let mut region = RegionInner {
            mem,
            engine,
            facts: Facts {
                addr: 0,
                len: 0,
                lkey: 0,
                registered: false,
                gpu: false,
            },
            released: Mutex::new(Vec::new()),
        };
        region.facts = Facts {
            addr: region.mem_addr(),
            len: region.mem_len(),
            lkey: region
                .registration()
                .map_or(0, |r| r.memory_region().lkey()),
            registered: region.registration().is_some(),
            gpu: matches!(region.mem, Memory::Gpu(_) | Memory::Device(_)),
        };
        Region {
            inner: Arc::new(region),
        }
    }

    /// What the transfer core needs to plan with it, if it is registered with a NIC (`None`:
    /// host or device memory no NIC can reach).
    #[inline]
    pub(crate) fn plan_info(&self) -> Option<rixl_proto::RegionInfo> {
        let f = &self.inner.facts;
        f.registered.then_some(rixl_proto::RegionInfo {
            addr: f.addr,
            len: f.len,
            lkey: f.lkey,
            host: !f.gpu,
        })
    }

    /// Resolves once the last handle on this region (descriptor lists and in-flight transfers
    /// included) is gone and its memory deregistered (and freed, if the region owned it).
    pub fn released(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (tx, rx) = oneshot::channel();
        if let Ok(mut w) = self.inner.released.lock() {
            w.push(tx);
        }
        async move {
            // The sender is dropped (never used) with the region.
            let _ = rx.await;
        }
    }

    /// The shared registration this region is a view of, if it is one.
    pub fn shared_mr(&self) -> Option<&SharedMr> {
        match &self.inner.mem {
            Memory::Cached { mr, .. } => Some(mr),
            _ => None,
        }
    }

    pub(crate) fn new(buf: RegisteredBuffer, engine: u64) -> Self {
        Self::with(Memory::Nic(buf), engine)
    }

    pub(crate) fn gpu(reg: GpuRegistration, engine: u64) -> Self {
        Self::with(Memory::Gpu(reg), engine)
    }

    pub(crate) fn shared(reg: SharedRegistration, engine: u64) -> Self {
        Self::with(Memory::Shared(reg), engine)
    }

    pub(crate) fn device(mem: rixl_gpudirect::DeviceMemory, engine: u64) -> Self {
        Self::with(Memory::Device(mem), engine)
    }

    pub(crate) fn host(buf: HostBuffer, engine: u64) -> Self {
        Self::with(Memory::Host(buf), engine)
    }

    /// `len` bytes of zeroed, page-aligned host memory registered with no NIC: for local tiers
    /// (files) on any core. RDMA transfers refuse it ([`crate::InvalidDescriptor::NotRegistered`]).
    ///
    /// # Errors
    /// If `len` is zero or the allocation fails.
    pub fn unregistered(len: usize) -> Result<Region, rixl_verbs::Error> {
        Ok(Region::host(
            HostBuffer::new(len)?,
            crate::id::next_engine_id(),
        ))
    }

    pub(crate) fn host_memory(&self) -> Option<&HostBuffer> {
        match &self.inner.mem {
            Memory::Nic(b) => Some(b.memory()),
            Memory::Host(b) => Some(b),
            Memory::Shared(r) => Some(r.memory()),
            Memory::Cached { view, .. } => Some(view),
            Memory::Gpu(_) | Memory::Device(_) => None,
        }
    }

    /// The NIC registration of host memory, if the memory is host memory registered with a NIC.
    pub fn nic_buffer(&self) -> Option<&RegisteredBuffer> {
        match &self.inner.mem {
            Memory::Nic(b) => Some(b),
            Memory::Host(_)
            | Memory::Gpu(_)
            | Memory::Shared(_)
            | Memory::Device(_)
            | Memory::Cached { .. } => None,
        }
    }

    /// The GPU memory, if this is GPU memory (registered with a NIC or not).
    pub fn gpu_memory(&self) -> Option<&rixl_gpudirect::DeviceMemory> {
        match &self.inner.mem {
            Memory::Gpu(g) => Some(g.memory()),
            Memory::Device(d) => Some(d),
            _ => None,
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
        self.inner.registration()
    }

    /// The NIC registration as a slice (empty for host memory), for the verbs layer's checked
    /// posting: an SGE into host memory is then refused, never posted.
    pub(crate) fn nic_slice(&self) -> &[RegisteredBuffer] {
        match &self.inner.mem {
            Memory::Nic(b) => std::slice::from_ref(b),
            Memory::Host(_)
            | Memory::Gpu(_)
            | Memory::Shared(_)
            | Memory::Device(_)
            | Memory::Cached { .. } => &[],
        }
    }

    /// Start address (the iova peers use; the device address for GPU memory).
    pub fn addr(&self) -> u64 {
        self.inner.facts.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.facts.len
    }

    /// Whether this is GPU memory.
    pub fn is_gpu(&self) -> bool {
        self.inner.facts.gpu
    }

    /// Whether the region is empty (never).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Local key (0 for memory not registered with a NIC).
    pub fn lkey(&self) -> u32 {
        self.inner.facts.lkey
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
        match self.gpu_memory() {
            Some(g) => g.write(off, src).map_err(gpu_err),
            None => self.host_memory().map_or(Ok(()), |h| h.write_at(off, src)),
        }
    }

    /// Copies `len` bytes at `offset` of this region into `dst` at `dst_offset`, with one copy:
    /// `cuMemcpy` between GPU and host memory, `memcpy` between host memories (a staging copy
    /// into or out of a bounce buffer).
    ///
    /// # Errors
    /// If a range is outside its region, for two GPU regions, or the driver's error.
    pub fn copy_to(
        &self,
        offset: u64,
        dst: &Region,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), rixl_verbs::Error> {
        let big = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let (off, dst_off, n) = (big(offset), big(dst_offset), big(len));
        match (
            self.gpu_memory(),
            dst.gpu_memory(),
            self.host_memory(),
            dst.host_memory(),
        ) {
            (Some(g), None, _, Some(h)) => g.read_into(off, h, dst_off, n).map_err(gpu_err),
            (None, Some(g), Some(h), _) => g.write_from(dst_off, h, off, n).map_err(gpu_err),
            (None, None, Some(a), Some(b)) => a.copy_to(off, b, dst_off, n),
            _ => Err(rixl_verbs::Error::InvalidArgument(
                "a staging copy needs host memory on one side".into(),
            )),
        }
    }

    /// Copies bytes at `offset` out of the region.
    ///
    /// # Errors
    /// If the range is outside the region.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), rixl_verbs::Error> {
        let off = usize::try_from(offset).unwrap_or(usize::MAX);
        match self.gpu_memory() {
            Some(g) => g.read(off, dst).map_err(gpu_err),
            None => self.host_memory().map_or(Ok(()), |h| h.read_at(off, dst)),
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

/// A GPU region is device memory a CUDA copy may read or write (a host region has no device
/// range: length 0, so every copy range check refuses it).
impl rixl_nvlink::ipc::DeviceRange for Region {
    fn device_addr(&self) -> u64 {
        self.addr()
    }
    fn device_len(&self) -> usize {
        if self.is_gpu() {
            self.len() as usize
        } else {
            0
        }
    }
}

fn gpu_err(e: rixl_gpudirect::Error) -> rixl_verbs::Error {
    rixl_verbs::Error::InvalidArgument(format!("GPU copy: {e}"))
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

    /// Where each descriptor starts in the list's byte stream (its bytes read in order).
    pub fn stream_starts(&self) -> Vec<u64> {
        self.descs
            .iter()
            .scan(0u64, |acc, d| {
                let start = *acc;
                *acc += d.len;
                Some(start)
            })
            .collect()
    }

    /// The `(region index, offset, len)` pieces of stream bytes `start..start+len`, given
    /// `starts` from [`Self::stream_starts`].
    pub fn stream_pieces(&self, starts: &[u64], start: u64, len: u64) -> Vec<(usize, u64, u64)> {
        // The last descriptor whose stream start is <= start.
        let mut i = starts.partition_point(|&s| s <= start).saturating_sub(1);
        let (mut pos, end) = (start, start + len);
        let mut out = Vec::new();
        while pos < end && i < self.descs.len() {
            let d = self.descs[i];
            let within = pos - starts[i];
            let take = (d.len - within).min(end - pos);
            out.push((d.region as usize, d.offset + within, take));
            pos += take;
            i += 1;
        }
        out
    }
}

/// Splits a transfer's byte stream (the local and remote lists read in order) into slices of
/// `slice` bytes dealt round-robin over `parts` parts (multi-rail striping). Part `i` gets the
/// local and remote pieces of its slices, in stream order, against the same regions and keys as
/// the input (callers map them to each rail's registration). Lists of different totals are
/// split up to the shorter one (validation rejects them later anyway).
pub fn split_stream(
    local: &LocalDescList,
    remote: &RemoteDescList,
    parts: usize,
    slice: u64,
) -> Vec<(LocalDescList, RemoteDescList)> {
    let parts = parts.max(1);
    let slice = slice.max(1);
    let mut out: Vec<(LocalDescList, RemoteDescList)> = (0..parts)
        .map(|_| (LocalDescList::new(), RemoteDescList::default()))
        .collect();
    let (ld, regions) = (local.descs(), local.regions());
    let rd = &remote.0;
    let (mut lc, mut rc) = (Cursor::default(), Cursor::default());
    let mut pos = 0u64;
    while lc.index < ld.len() && rc.index < rd.len() {
        let (l, r) = (ld[lc.index], rd[rc.index]);
        let in_slice = slice - pos % slice;
        let n = (l.len - lc.offset).min(r.len - rc.offset).min(in_slice);
        if n > 0 {
            let part = ((pos / slice) as usize) % parts;
            let (pl, pr) = &mut out[part];
            pl.push(&regions[l.region as usize], l.offset + lc.offset, n);
            pr.0.push(RemoteDesc {
                addr: r.addr + rc.offset,
                len: n,
                rkey: r.rkey,
            });
            pos += n;
        }
        // A zero-length descriptor is stepped over (validation reports it).
        lc.advance(n, l.len);
        rc.advance(n, r.len);
    }
    out
}

#[cfg(test)]
mod split_tests {
    use super::*;

    #[test]
    fn every_byte_goes_to_exactly_one_part_in_order() {
        let a = Region::unregistered(1 << 20).unwrap();
        let b = Region::unregistered(1 << 20).unwrap();
        let mut local = LocalDescList::new();
        // Uneven local pieces over two regions; remote pieces of another granularity.
        local.push(&a, 0, 300_000);
        local.push(&b, 4096, 700_000);
        local.push(&a, 500_000, 48_576);
        let remote = RemoteDescList(
            (0..8)
                .map(|i| RemoteDesc {
                    addr: 0x10_0000 * (i + 1),
                    len: 131_072,
                    rkey: 7,
                })
                .collect(),
        );
        let parts = split_stream(&local, &remote, 3, 100_000);
        assert_eq!(parts.len(), 3);
        let total: u64 = parts.iter().map(|p| p.0.total_len()).sum();
        assert_eq!(total, 1 << 20);
        for (l, r) in &parts {
            assert_eq!(l.total_len(), r.total_len());
            assert!(l.descs().iter().all(|d| d.len <= 100_000));
        }
        // Re-assemble the stream from the slices in order and compare the (local, remote)
        // address pairing at sampled byte positions with the original lists.
        fn segments(l: &LocalDescList, r: &RemoteDescList) -> Vec<(u64, u64, u64)> {
            let split = split_stream(l, r, 1, u64::MAX);
            let (l, r) = &split[0];
            l.descs()
                .iter()
                .zip(&r.0)
                .map(|(d, x)| {
                    (
                        l.regions()[d.region as usize].addr() + d.offset,
                        x.addr,
                        d.len,
                    )
                })
                .collect()
        }
        let original = segments(&local, &remote);
        type Cursor = (Vec<(u64, u64, u64)>, usize, u64);
        let mut cursors: Vec<Cursor> = parts
            .iter()
            .map(|(l, r)| {
                let segs = l
                    .descs()
                    .iter()
                    .zip(&r.0)
                    .map(|(d, x)| {
                        (
                            l.regions()[d.region as usize].addr() + d.offset,
                            x.addr,
                            d.len,
                        )
                    })
                    .collect();
                (segs, 0, 0)
            })
            .collect();
        let mut rebuilt = Vec::new();
        let mut k = 0;
        while rebuilt.iter().map(|s: &(u64, u64, u64)| s.2).sum::<u64>() < (1 << 20) {
            let (segs, i, off) = &mut cursors[k % 3];
            let mut want = 100_000u64;
            while want > 0 && *i < segs.len() {
                let (la, ra, n) = segs[*i];
                let take = (n - *off).min(want);
                rebuilt.push((la + *off, ra + *off, take));
                *off += take;
                want -= take;
                if *off == n {
                    *i += 1;
                    *off = 0;
                }
            }
            k += 1;
        }
        let at = |segs: &[(u64, u64, u64)], mut p: u64| {
            for &(la, ra, n) in segs {
                if p < n {
                    return (la + p, ra + p);
                }
                p -= n;
            }
            panic!("position past the end");
        };
        for p in (0..(1u64 << 20)).step_by(997) {
            assert_eq!(at(&rebuilt, p), at(&original, p), "byte {p}");
        }
        // Slice k (100 000 bytes) went to part k % 3.
        assert_eq!(parts[0].0.total_len(), 400_000);
        assert_eq!(parts[1].0.total_len(), 300_000 + 48_576);
        assert_eq!(parts[2].0.total_len(), 300_000);
        // The first slice starts at the first byte of both lists.
        assert_eq!(parts[0].1 .0[0].addr, 0x10_0000);
        assert_eq!(parts[0].0.descs()[0].offset, 0);
        // One part is the identity.
        let one = split_stream(&local, &remote, 1, 1 << 40);
        assert_eq!(one[0].0.len(), 10);
        assert_eq!(one[0].0.total_len(), 1 << 20);
    }
}
