//! This agent's memory: registrations (DRAM on every rail, VRAM exported for CUDA IPC, files),
//! the table peers' metadata is made from, and the metadata itself as one reader may see it.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use crate::nvlink::ipc::IpcHandle;
use crate::runtime::{FileInfo, FileSpec, LocalDescList, RailKeys, Region, TransferError};

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
#[derive(Debug)]
pub(crate) struct Reg {
    pub region: Region,
    /// The same memory registered on rails 1.. (multi-rail agents).
    pub rails: Vec<Region>,
    pub visibility: Visibility,
    pub export: Option<VramExport>,
}

/// Registrations by id.
pub(crate) type Registrations = BTreeMap<u64, Arc<Reg>>;

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
            a.regs.update(|regs| regs.remove(&self.id));
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
}

/// A registered file (FILE memory, a local tier). The file is closed when the last handle is
/// dropped and no transfer uses it any more.
#[derive(Clone)]
pub struct FileRegistration {
    pub(crate) inner: Arc<FileRegInner>,
}

pub(crate) struct FileRegInner {
    pub info: FileInfo,
    pub path: std::path::PathBuf,
    pub engine: crate::runtime::EngineHandle,
}

impl Drop for FileRegInner {
    fn drop(&mut self) {
        self.engine.close_file(self.info.id);
    }
}

impl std::fmt::Debug for FileRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileRegistration")
            .field("path", &self.inner.path)
            .field("info", &self.inner.info)
            .finish()
    }
}

impl FileRegistration {
    /// Registered size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.info.size
    }

    /// Writes must start and end on multiples of this (the device's O_DIRECT block size).
    pub fn alignment(&self) -> u64 {
        self.inner.info.alignment
    }

    /// Whether I/O bypasses the page cache (false on tmpfs).
    pub fn direct(&self) -> bool {
        self.inner.info.direct
    }

    /// The path.
    pub fn path(&self) -> &std::path::Path {
        &self.inner.path
    }
}

impl Agent {
    /// Registers a file as FILE memory (a local tier): opened with O_DIRECT on the agent's core;
    /// the create modes reserve `spec.size` bytes up front. Its descriptors are
    /// [`FileDesc`](crate::runtime::FileDesc)s (offset, length) inside `spec.size`.
    ///
    /// # Errors
    /// [`AgentError::File`] (not found, exists, too small, no space, ...).
    pub async fn register_file(&self, spec: FileSpec) -> Result<FileRegistration, AgentError> {
        let path = spec.path.clone();
        let engine = self.inner.rails.engine(0);
        let info = engine.open_file(spec).await?;
        tracing::debug!(agent = %self.inner.name, path = %path.display(), size = info.size, "file registered");
        Ok(FileRegistration {
            inner: Arc::new(FileRegInner {
                info,
                path,
                engine: engine.clone(),
            }),
        })
    }

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
        let region = self
            .inner
            .rails
            .engine(0)
            .register_gpu(ordinal, len)
            .await?;
        let export =
            region
                .gpu_memory()
                .and_then(|m| match crate::nvlink::ipc::IpcHandle::export(m) {
                    Ok(handle) => Some(VramExport {
                        gpu: ordinal as u32,
                        handle,
                    }),
                    Err(e) => {
                        tracing::warn!(error = %e, "VRAM region not exported for CUDA IPC");
                        None
                    }
                });
        Ok(self.add_registration(Reg {
            region,
            rails: Vec::new(),
            visibility,
            export,
        }))
    }

    /// Registers `len` bytes of DRAM (zeroed), visible per `visibility`.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), rixl::agent::AgentError> {
    /// use rixl::agent::{Agent, AgentConfig, Visibility};
    /// let agent = Agent::new("decode", AgentConfig::default())?;
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
        Registration {
            inner: Arc::new(RegInner {
                id,
                region,
                agent: Arc::downgrade(&self.inner),
            }),
        }
    }

    /// This agent's metadata as `reader` may see it: regions scoped to other agents are left out,
    /// so `reader` cannot obtain their keys from it.
    ///
    /// # Errors
    /// [`AgentError::Metadata`] if it exceeds the format's limits.
    pub fn local_metadata(&self, reader: &str) -> Result<Vec<u8>, AgentError> {
        Ok(self.inner.metadata_for(reader).encode()?)
    }
}

impl Inner {
    /// This agent's metadata as `reader` may see it.
    pub(crate) fn metadata_for(&self, reader: &str) -> AgentMetadata {
        let regs = self.regs.load();
        let visible = || regs.iter().filter(|(_, r)| r.visibility.allows(reader));
        let regions = visible()
            // Host memory of a core without a NIC is not reachable by peers; GPU memory is, by
            // CUDA IPC from the same node, when it is exported.
            .filter(|(_, r)| r.region.registration().is_some() || r.export.is_some())
            .map(|(&id, r)| {
                let mut rail_rkeys = [0u32; MAX_RAILS - 1];
                for (k, x) in rail_rkeys.iter_mut().zip(&r.rails) {
                    *k = x.rkey();
                }
                RegionInfo {
                    id,
                    addr: r.region.addr(),
                    len: r.region.len(),
                    rkey: r.region.rkey(),
                    kind: if r.region.is_gpu() {
                        MemKind::Vram
                    } else {
                        MemKind::Dram
                    },
                    rail_rkeys,
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
        }
    }
}

/// How memory is named on rails other than 0: this agent's registrations of the same memory
/// there, and the peer's keys for its regions there.
pub(crate) struct RailMap<'a> {
    pub regs: &'a Registrations,
    /// The peer's regions by their rail-0 key.
    pub peer_by_rkey: &'a std::collections::HashMap<u32, RegionInfo>,
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
        self.peer_by_rkey.get(&rkey).map_or(0, |i| i.rkey_on(rail))
    }
}
