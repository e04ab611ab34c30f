//! This agent's memory: registrations (DRAM and VRAM on every rail, each bound to its nearest
//! NICs; VRAM exported for CUDA IPC; files),
//! the table peers' metadata is made from, and the metadata itself as one reader may see it.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use crate::nvlink::ipc::IpcHandle;
use crate::runtime::{
    LocalDescList, RailKeys, Region, RuntimeError, SharedMr, TransferError, WeakMr,
};
use crate::verbs::HostBuffer;

use super::cache::{IntervalCache, Lookup, Span};

use super::config::Visibility;
use super::metadata::{AgentMetadata, IpcExport, MemKind, RegionInfo, MAX_RAILS};
use super::snapshot::lock;
use super::{Agent, AgentError, Inner};

/// A VRAM registration's CUDA IPC export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct VramExport {
    /// The GPU's ordinal.
    pub gpu: u32,
    /// The handle peers open it with.
    pub handle: IpcHandle,
}

/// One registration as the agent keeps it.
#[derive(Debug, Clone)]
pub(crate) struct Reg {
    pub region: Region,
    /// The same memory registered on rails 1.. (multi-rail agents).
    pub rails: Vec<Region>,
    pub visibility: Visibility,
    pub export: Option<VramExport>,
    /// The NICs its transfers prefer.
    pub binding: super::nics::NicBinding,
    /// Its transfers go through host memory, copied by this ([`Agent::set_staged`]).
    pub staged: Option<super::staged::StagedCopier>,
}

/// Registrations by id.
pub(crate) type Registrations = BTreeMap<u64, Arc<Reg>>;

/// The registration cache with its counters.
#[derive(Debug, Default)]
pub(crate) struct MrCache {
    /// Each entry: the memory region on every rail (rail 0 first).
    index: IntervalCache<Vec<WeakMr>>,
    counters: RegistrationCounters,
}

/// How the registration cache has served [`Agent::register_host`] (counted per memory region:
/// one per rail).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegistrationCounters {
    /// Memory regions made (`ibv_reg_mr`, pinning the pages).
    pub made: u64,
    /// Registrations served by a live memory region that contained them.
    pub reused: u64,
    /// Registrations refused because they partly overlap a live one.
    pub overlaps: u64,
}

/// A live registration as [`Agent::query_memory`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryInfo {
    /// The registration's id (the region peers address).
    pub id: u64,
    /// DRAM or VRAM.
    pub kind: MemKind,
    /// Start of the registration.
    pub addr: u64,
    /// Its length.
    pub len: u64,
    /// Where the queried range starts inside it.
    pub offset: u64,
    /// Rails (NICs) it is registered on.
    pub rails: usize,
    /// Whether it is registered with a NIC (peers can reach it by RDMA).
    pub nic: bool,
    /// Whether its memory region also serves other registrations (the registration cache).
    pub shared: bool,
    /// Whether it is exported for CUDA IPC.
    pub cuda_ipc: bool,
}

/// What [`Registration::release`] found once it resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Released {
    /// Whether the memory regions the registration used are deregistered. False when another
    /// live registration (the cache) still uses them: the memory stays pinned until that one
    /// is released too.
    pub deregistered: bool,
}

/// A registration: memory of this agent, visible to peers as region `id()`. The memory stays
/// registered while any handle or in-flight transfer uses it.
#[derive(Clone)]
pub struct Registration {
    inner: Arc<RegInner>,
}

struct RegInner {
    id: u64,
    region: Region,
    agent: Weak<Inner>,
}

impl Drop for RegInner {
    fn drop(&mut self) {
        if let Some(a) = self.agent.upgrade() {
            let measuring = lock(&a.auto_stage).remove(&self.id);
            if measuring.is_some_and(|m| m.undecided()) {
                a.auto_pending
                    .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            }
            a.regs.update(|regs| {
                if regs.remove(&self.id).is_some_and(|r| r.staged.is_some()) {
                    a.staged_regs
                        .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                }
            });
            // Its windows keep the memory registered: they go now.
            a.grants.revoke_region(self.id, None);
            a.metadata_changed();
        }
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.inner.id)
            .field("region", &self.inner.region)
            .finish()
    }
}

impl Registration {
    /// The id peers use to address it.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The registered region (for local descriptor lists and data access).
    pub fn region(&self) -> &Region {
        &self.inner.region
    }

    /// Whether it is a registration of the agent `agent`.
    pub(crate) fn belongs_to(&self, agent: &Arc<Inner>) -> bool {
        std::ptr::eq(self.inner.agent.as_ptr(), Arc::as_ptr(agent))
    }

    /// Releases the registration: peers can no longer address it (it leaves this agent's
    /// metadata at once) and the future resolves when nothing uses it any more and its memory
    /// regions are deregistered, so the owner of the memory may free it (memory the
    /// registration owns is freed by then).
    ///
    /// It waits for every in-flight transfer that uses the memory (posted work drains; the NIC
    /// is done with it when this resolves), and for every other handle on it: clones of this
    /// handle, descriptor lists and prepared requests naming it. Dropping a registration
    /// without releasing it is safe too: its memory stays registered until the last in-flight
    /// use ends.
    pub async fn release(self) -> Released {
        let mut regions = vec![self.inner.region.clone()];
        if let Some(agent) = self.inner.agent.upgrade() {
            if let Some(reg) = agent.regs.load().get(&self.inner.id) {
                regions.extend(reg.rails.iter().cloned());
            }
        }
        let mrs: Vec<WeakMr> = regions
            .iter()
            .filter_map(|r| r.shared_mr().map(SharedMr::downgrade))
            .collect();
        let waits: Vec<_> = regions.iter().map(Region::released).collect();
        drop(regions);
        drop(self);
        for w in waits {
            w.await;
        }
        Released {
            deregistered: mrs.iter().all(|m| m.upgrade().is_none()),
        }
    }
}

impl Agent {
    /// Registers `len` bytes of memory on GPU `ordinal`, visible per `visibility`, and exports
    /// it for CUDA IPC. With a NIC it is registered for GPUDirect RDMA (dma-buf first,
    /// nvidia-peermem second): peers RDMA-READ/WRITE it directly, with no host bounce. Peers on
    /// the same node reach it by CUDA IPC when the topology says the GPUs are peers.
    ///
    /// # Errors
    /// [`AgentError::Runtime`] with `Gpu(NoCuda)` without a driver, or the registration
    /// failure of both GPUDirect paths.
    pub async fn register_vram(
        &self,
        ordinal: i32,
        len: usize,
        visibility: Visibility,
    ) -> Result<Registration, AgentError> {
        let engine = self.inner.rails.engine(0);
        match engine.register_gpu(ordinal, len).await {
            Ok(region) => self.add_vram(region, visibility).await,
            Err(RuntimeError::Gpu(e @ crate::gpudirect::Error::Register { .. })) => {
                let region = engine.gpu_unregistered(ordinal, len).await?;
                self.add_staged_vram(region, visibility, &e).await
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Registers GPU memory the caller already owns (its allocator's), visible per
    /// `visibility`: a cudarc `CudaSlice` ([`DeviceMemory::from_cuda_slice`], owned from now
    /// on) or a raw device pointer with its GPU (the `unsafe` [`DeviceMemory::from_raw`], also a
    /// range inside a larger allocation, checked with `cuMemGetAddressRange`). Registered for
    /// GPUDirect RDMA as [`Self::register_vram`] is, and exported for CUDA IPC when it starts
    /// at its allocation's base (an IPC handle names a whole allocation).
    ///
    /// [`DeviceMemory::from_cuda_slice`]: crate::gpudirect::DeviceMemory::from_cuda_slice
    /// [`DeviceMemory::from_raw`]: crate::gpudirect::DeviceMemory::from_raw
    ///
    /// # Errors
    /// [`AgentError::Runtime`] with the registration failure of both GPUDirect paths.
    pub async fn register_device(
        &self,
        mem: crate::gpudirect::DeviceMemory,
        visibility: Visibility,
    ) -> Result<Registration, AgentError> {
        let engine = self.inner.rails.engine(0);
        if !engine.has_nic() {
            let region = engine.register_device(mem).await?;
            return self.add_vram(region, visibility).await;
        }
        let mem = Arc::new(mem);
        match engine.register_device_shared(Arc::clone(&mem)).await {
            Ok(region) => self.add_vram(region, visibility).await,
            Err(RuntimeError::Gpu(e @ crate::gpudirect::Error::Register { .. })) => {
                // The failed attempt dropped its handle: the memory is the caller's again.
                let mem = Arc::try_unwrap(mem).map_err(|_| {
                    AgentError::Runtime(RuntimeError::Gpu(
                        crate::gpudirect::Error::InvalidArgument(
                            "GPU memory still shared after a failed registration".into(),
                        ),
                    ))
                })?;
                let region = engine.device_unregistered(mem);
                self.add_staged_vram(region, visibility, &e).await
            }
            Err(e) => Err(e.into()),
        }
    }

    /// GPU memory the NIC refused (no GPUDirect RDMA: neither dma-buf nor nvidia-peermem): kept
    /// without a NIC registration and staged through host memory ([`Agent::set_staged`]).
    async fn add_staged_vram(
        &self,
        region: Region,
        visibility: Visibility,
        refused: &crate::gpudirect::Error,
    ) -> Result<Registration, AgentError> {
        tracing::warn!(agent = %self.inner.name, error = %refused, "GPUDirect RDMA unavailable: GPU memory staged through host memory");
        let reg = self.add_vram(region, visibility).await?;
        self.set_staged(&reg, true, None)?;
        Ok(reg)
    }

    /// A VRAM region registered, with its CUDA IPC export when it can have one, and the same
    /// memory registered with every other rail's NIC (a transfer on any rail names it there).
    async fn add_vram(
        &self,
        region: Region,
        visibility: Visibility,
    ) -> Result<Registration, AgentError> {
        let mut rails = Vec::new();
        if let Some(g) = region.gpu_registration() {
            let mem = g.shared_memory();
            for e in &self.inner.rails.engines()[1..] {
                rails.push(e.register_device_shared(Arc::clone(&mem)).await?);
            }
        }
        let export = region
            .gpu_memory()
            .filter(|m| m.dmabuf_offset() == 0)
            .and_then(|m| match crate::nvlink::ipc::IpcHandle::export(m) {
                Ok(handle) => Some(VramExport {
                    gpu: m.gpu().ordinal() as u32,
                    handle,
                }),
                Err(e) => {
                    tracing::warn!(error = %e, "VRAM region not exported for CUDA IPC");
                    None
                }
            });
        let binding = self.inner.bind_new(&region);
        let measure = region.registration().is_some() && !binding.gpudirect();
        if measure {
            tracing::info!(agent = %self.inner.name, nics = ?binding.nics, relation = %binding.relation, "GPU memory is across sockets from its NIC (or its locality is unknown): staging through host memory is measured against direct on its first transfers");
        }
        let reg = self.add_registration(Reg {
            binding,
            staged: None,
            region,
            rails,
            visibility,
            export,
        });
        if measure {
            self.inner.arm_auto_stage(reg.id(), None);
        }
        Ok(reg)
    }

    /// Registers host memory the caller already owns (a serving engine's KV cache or weights),
    /// visible per `visibility`; peers address it as region `id()`, offsets from its start.
    ///
    /// `mem` is [`HostBuffer::from_vec`], [`HostBuffer::from_boxed`], [`HostBuffer::from_mmap`]
    /// (a shared-memory file or huge pages too), [`HostBuffer::from_static`], or, for memory
    /// known only by address and length (NIXL's `registerMem`), the `unsafe`
    /// [`HostBuffer::from_raw`], whose contract is that the range stays mapped until
    /// [`Registration::release`] has resolved.
    ///
    /// **Registration cache.** A range equal to, or inside, a live registration reuses its
    /// memory regions (no pages are pinned again; [`Self::registration_counters`] count made
    /// and reused regions). A range that partly overlaps a live registration is refused
    /// ([`AgentError::OverlappingRegistration`]); one that contains live registrations gets its
    /// own. The cache keeps nothing alive: a memory region is deregistered with the last
    /// registration (and in-flight transfer) that uses it.
    ///
    /// ```no_run
    /// # async fn f(agent: &rixl::agent::Agent) -> Result<(), rixl::agent::AgentError> {
    /// use rixl::agent::Visibility;
    /// use rixl::verbs::{memmap2::MmapMut, HostBuffer};
    /// // The engine's own paged KV cache: one anonymous map, registered once.
    /// let kv = MmapMut::map_anon(64 << 20).expect("map");
    /// let mem = HostBuffer::from_mmap(kv).expect("non-empty");
    /// let reg = agent.register_host(mem, Visibility::All).await?;
    /// // ... transfers ...
    /// reg.release().await; // the map is unmapped once the NIC is done with it
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`AgentError::BadMemory`] if the NIC refuses the range (unmapped or read-only memory),
    /// [`AgentError::OverlappingRegistration`], or [`AgentError::Runtime`].
    pub async fn register_host(
        &self,
        mem: HostBuffer,
        visibility: Visibility,
    ) -> Result<Registration, AgentError> {
        let engines = self.inner.rails.engines();
        if !engines[0].has_nic() {
            let region = engines[0].unregistered(mem);
            return Ok(self.add_registration(Reg {
                binding: self.inner.bind_new(&region),
                staged: None,
                region,
                rails: Vec::new(),
                visibility,
                export: None,
            }));
        }
        let span = Span::new(mem.addr(), mem.len() as u64);
        let (addr, len) = (mem.addr(), mem.len() as u64);
        let mem = Arc::new(mem);
        let mrs = match self.inner.cached_mrs(span, engines.len())? {
            Some(mrs) => mrs,
            None => {
                let mut mrs = Vec::with_capacity(engines.len());
                for e in engines {
                    let mr = e
                        .register_mr(Arc::clone(&mem))
                        .await
                        .map_err(|e| registration_error(addr, len, e))?;
                    mrs.push(mr);
                }
                let mut cache = lock(&self.inner.cache);
                cache.counters.made += mrs.len() as u64;
                cache
                    .index
                    .insert(span, mrs.iter().map(SharedMr::downgrade).collect());
                mrs
            }
        };
        let mut regions = Vec::with_capacity(mrs.len());
        for mr in &mrs {
            let view = HostBuffer::slice_of(&mem, 0, len as usize)
                .map_err(|e| AgentError::Runtime(e.into()))?;
            regions.push(
                mr.view(view)
                    .map_err(|e| AgentError::Transfer(TransferError::InvalidDescriptor(e)))?,
            );
        }
        let region = regions.remove(0);
        Ok(self.add_registration(Reg {
            binding: self.inner.bind_new(&region),
            staged: None,
            region,
            rails: regions,
            visibility,
            export: None,
        }))
    }

    /// What this agent has registered at `addr..addr+len` (NIXL's `queryMem`): the live
    /// registration that contains the range, or `None`. With nested registrations, the one that
    /// starts closest below `addr`.
    pub fn query_memory(&self, addr: u64, len: u64) -> Option<MemoryInfo> {
        let end = addr.checked_add(len)?;
        let regs = self.inner.regs.load();
        regs.iter()
            .filter(|(_, r)| r.region.addr() <= addr && end <= r.region.addr() + r.region.len())
            .max_by_key(|(_, r)| r.region.addr())
            .map(|(&id, r)| MemoryInfo {
                id,
                kind: if r.region.is_gpu() {
                    MemKind::Vram
                } else {
                    MemKind::Dram
                },
                addr: r.region.addr(),
                len: r.region.len(),
                offset: addr - r.region.addr(),
                rails: 1 + r.rails.len(),
                nic: r.region.registration().is_some(),
                shared: r.region.shared_mr().is_some_and(|m| m.regions() > 1),
                cuda_ipc: r.export.is_some(),
            })
    }

    /// The registration cache's counters.
    pub fn registration_counters(&self) -> RegistrationCounters {
        lock(&self.inner.cache).counters
    }

    /// Registers `len` bytes of DRAM (zeroed), visible per `visibility`.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), rixl::agent::AgentError> {
    /// use rixl::agent::{Agent, AgentConfig, Visibility};
    /// // The key the cluster's agents share (also read from RIXL_CLUSTER_KEY by default).
    /// let key = rixl::agent::ClusterKey::from_hex(&std::env::var("MY_CLUSTER_KEY").unwrap())?;
    /// let agent = Agent::new("decode", AgentConfig::default().with_cluster_key(key))?;
    /// // The KV cache, visible only to the prefill agent.
    /// let kv = agent.register(64 << 20, Visibility::Only(vec!["prefill".into()])).await?;
    /// println!("peers address it as region {}", kv.id());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`AgentError::Runtime`] if registration fails.
    pub async fn register(
        &self,
        len: usize,
        visibility: Visibility,
    ) -> Result<Registration, AgentError> {
        let engines = self.inner.rails.engines();
        if engines.len() == 1 {
            let region = engines[0].register(len).await?;
            return Ok(self.add_registration(Reg {
                binding: self.inner.bind_new(&region),
                staged: None,
                region,
                rails: Vec::new(),
                visibility,
                export: None,
            }));
        }
        // Multi-rail: one buffer, registered on every rail's NIC.
        let mem = Arc::new(
            crate::verbs::HostBuffer::new(len).map_err(|e| AgentError::Runtime(e.into()))?,
        );
        let region = engines[0].register_shared(Arc::clone(&mem)).await?;
        let mut rails = Vec::with_capacity(engines.len() - 1);
        for e in &engines[1..] {
            rails.push(e.register_shared(Arc::clone(&mem)).await?);
        }
        Ok(self.add_registration(Reg {
            binding: self.inner.bind_new(&region),
            staged: None,
            region,
            rails,
            visibility,
            export: None,
        }))
    }

    fn add_registration(&self, reg: Reg) -> Registration {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let region = reg.region.clone();
        self.inner
            .regs
            .update(|regs| regs.insert(id, Arc::new(reg)));
        self.inner.metadata_changed();
        Registration {
            inner: Arc::new(RegInner {
                id,
                region,
                agent: Arc::downgrade(&self.inner),
            }),
        }
    }

    /// Partial metadata for `reader` (NIXL's `getLocalPartialMD`): only `regions` (with the
    /// side-channel address and identity), and `removed`, regions released since. Loaded by a
    /// peer that already holds this agent's metadata of the same generation, it is merged (the
    /// regions are added or replaced, the removed ones forgotten); otherwise it is all the peer
    /// knows of this agent. After a new registration, send the new region's id alone.
    ///
    /// # Errors
    /// [`AgentError::UnknownLocalRegion`] if a region of `regions` is not registered, not
    /// reachable by peers, or not visible to `reader`; [`AgentError::Metadata`] past the
    /// format's limits.
    pub fn local_partial_metadata(
        &self,
        reader: &str,
        regions: &[u64],
        removed: &[u64],
    ) -> Result<Vec<u8>, AgentError> {
        let md = self
            .inner
            .metadata_of(reader, Some(regions), removed.to_vec());
        if let Some(&missing) = regions
            .iter()
            .find(|id| !md.regions.iter().any(|r| r.id == **id))
        {
            return Err(AgentError::UnknownLocalRegion(missing));
        }
        Ok(md.encode(&self.inner.identity.key)?)
    }

    /// This agent's metadata as `reader` may see it: regions scoped to other agents are left out,
    /// so `reader` cannot obtain their keys from it.
    ///
    /// # Errors
    /// [`AgentError::Metadata`] if it exceeds the format's limits.
    pub fn local_metadata(&self, reader: &str) -> Result<Vec<u8>, AgentError> {
        Ok(self
            .inner
            .metadata_for(reader)
            .encode(&self.inner.identity.key)?)
    }
}

/// A refused registration of caller memory as the agent reports it.
fn registration_error(addr: u64, len: u64, e: RuntimeError) -> AgentError {
    match e {
        RuntimeError::Verbs(crate::verbs::Error::RegisterMemory(source)) => {
            AgentError::BadMemory { addr, len, source }
        }
        e => AgentError::Runtime(e),
    }
}

impl Inner {
    /// The live memory regions (one per rail, `rails` of them) that contain `span`, counted as
    /// reused; `None` if a registration must be made.
    fn cached_mrs(&self, span: Span, rails: usize) -> Result<Option<Vec<SharedMr>>, AgentError> {
        let mut cache = lock(&self.cache);
        let alive =
            |mrs: &Vec<WeakMr>| mrs.len() == rails && mrs.iter().all(|m| m.upgrade().is_some());
        match cache.index.find(span, alive) {
            Lookup::Hit(weak) => {
                let mrs: Option<Vec<SharedMr>> = weak.iter().map(WeakMr::upgrade).collect();
                let Some(mrs) = mrs else { return Ok(None) };
                cache.counters.reused += mrs.len() as u64;
                Ok(Some(mrs))
            }
            Lookup::Overlap(s) => {
                cache.counters.overlaps += 1;
                Err(AgentError::OverlappingRegistration {
                    addr: span.start,
                    len: span.end - span.start,
                    existing: s.start,
                    existing_len: s.end - s.start,
                })
            }
            Lookup::Miss => Ok(None),
        }
    }

    /// This agent's metadata as `reader` may see it.
    pub(crate) fn metadata_for(&self, reader: &str) -> AgentMetadata {
        self.metadata_of(reader, None, Vec::new())
    }

    /// This agent's metadata as `reader` may see it: every region, or (partial metadata) only
    /// those in `only`, with `removed` named as released.
    pub(crate) fn metadata_of(
        &self,
        reader: &str,
        only: Option<&[u64]>,
        removed: Vec<u64>,
    ) -> AgentMetadata {
        let regs = self.regs.load();
        let visible = || {
            regs.iter().filter(|(id, r)| {
                r.visibility.allows(reader) && only.is_none_or(|o| o.contains(id))
            })
        };
        let regions = visible()
            // Host memory of a core without a NIC is not reachable by peers; GPU memory is, by
            // CUDA IPC from the same node, when it is exported.
            .filter(|(_, r)| r.region.registration().is_some() || r.export.is_some())
            .map(|(&id, r)| {
                let mut rail_rkeys = [0u32; MAX_RAILS - 1];
                // With NIC grants the keys only name the region (a registration without
                // remote access has rkey 0 on some devices, and regions served by one cached
                // registration share its key): its id names it, unique among live regions.
                let rkey = if self.nic_grants {
                    id as u32
                } else {
                    for (k, x) in rail_rkeys.iter_mut().zip(&r.rails) {
                        *k = x.rkey();
                    }
                    r.region.rkey()
                };
                RegionInfo {
                    id,
                    addr: r.region.addr(),
                    len: r.region.len(),
                    rkey,
                    kind: if r.region.is_gpu() {
                        MemKind::Vram
                    } else {
                        MemKind::Dram
                    },
                    rail_rkeys,
                    // Memory without a NIC registration (GPU memory the NIC refused) is
                    // reachable by CUDA IPC only: bound to no rail.
                    bound: if r.region.registration().is_some() {
                        r.binding.mask()
                    } else {
                        0
                    },
                }
            })
            .collect();
        let ipc = visible()
            .filter_map(|(&id, r)| {
                r.export.map(|x| IpcExport {
                    region: id,
                    gpu: x.gpu,
                    handle: x.handle.0,
                })
            })
            .collect();
        AgentMetadata {
            name: self.name.clone(),
            generation: self.generation,
            address: lock(&self.address).clone(),
            regions,
            rails: self.rails.len() as u8,
            node: self.node.clone(),
            process: std::process::id(),
            ipc,
            partial: only.is_some(),
            removed,
            grants: self.nic_grants,
            nic: self.rails.engine(0).has_nic(),
        }
    }
}

/// How memory is named on rails other than 0: this agent's registrations of the same memory
/// there, and the peer's keys for its regions there.
pub(crate) struct RailMap<'a> {
    pub regs: &'a Registrations,
    /// The peer's regions by their rail-0 key.
    pub peer_by_rkey: &'a std::collections::HashMap<u32, RegionInfo>,
    /// The peer grants its regions per connection: every rail's part keeps the rail-0 keys,
    /// which name regions, until it is put on its connection's grant keys.
    pub grants: bool,
}

impl RailKeys for RailMap<'_> {
    fn local_on(&self, list: &LocalDescList, rail: usize) -> Result<LocalDescList, TransferError> {
        // Map each distinct region once (the list keeps them deduplicated), then the descriptors.
        let mapped: Vec<Region> = list
            .regions()
            .iter()
            .enumerate()
            .map(|(i, r0)| {
                self.regs
                    .values()
                    .find(|g| g.region.same(r0))
                    .and_then(|g| g.rails.get(rail - 1).cloned())
                    .ok_or_else(|| {
                        let index = list
                            .descs()
                            .iter()
                            .position(|d| d.region as usize == i)
                            .unwrap_or(0);
                        TransferError::InvalidDescriptor(
                            crate::runtime::InvalidDescriptor::ForeignRegion { index },
                        )
                    })
            })
            .collect::<Result<_, _>>()?;
        let mut out = LocalDescList::with_capacity(list.len());
        for d in list.descs() {
            out.push(&mapped[d.region as usize], d.offset, d.len);
        }
        Ok(out)
    }

    fn rkey_on(&self, rkey: u32, rail: usize) -> u32 {
        if self.grants {
            return rkey;
        }
        self.peer_by_rkey.get(&rkey).map_or(0, |i| i.rkey_on(rail))
    }
}
