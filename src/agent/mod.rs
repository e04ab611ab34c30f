//! The `Agent`: what a serving engine programs against (NIXL's northbound semantics, async and
//! typed). It owns an engine pool, memory registrations with export scoping, peers' metadata,
//! lazily made connections, and a notification stream.
//!
//! This is the first part of the agent: DRAM registrations, versioned metadata with per-peer
//! scoping, a TCP side channel (metadata fetch and connection set-up), transfers addressed by the
//! peer's region ids (validated before posting), and notifications. A central store (etcd),
//! prepared index-based requests and the VRAM/FILE kinds build on it.

pub mod etcd;
pub mod metadata;
mod sidechannel;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use futures_channel::mpsc;

use crate::runtime::{
    ConnId, EngineConfig, EngineHandle, EnginePool, FileDesc, FileError, FileInfo, FileSpec,
    LocalDescList, Message, Op, PreparedTransfer, Region, RemoteDesc, RemoteDescList, RuntimeError,
    TransferError, TransferOptions, TransferStats, DEFAULT_IO_MEMORY,
};
use metadata::{AgentMetadata, MemKind, MetadataError, RegionInfo, MAX_RAILS};

/// Errors of the agent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The engine failed to start or a control operation failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A transfer failed.
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// Metadata was rejected.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// No metadata of this peer is loaded (never loaded, or invalidated).
    #[error("unknown peer {0:?}")]
    UnknownPeer(String),
    /// The peer's metadata has no such region (or does not grant it to us).
    #[error("peer {peer:?} has no region {region} visible to us")]
    UnknownRegion {
        /// The peer.
        peer: String,
        /// The region id.
        region: u64,
    },
    /// A remote descriptor reaches outside the peer's region.
    #[error("remote descriptor {index}: offset {offset} + length {len} exceeds region {region} of {region_len} bytes")]
    RemoteOutOfRange {
        /// Position in the list.
        index: usize,
        /// Region id.
        region: u64,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Region length.
        region_len: u64,
    },
    /// The side channel failed.
    #[error("side channel: {0}")]
    SideChannel(String),
    /// An index selects no entry of a prepared list.
    #[error("index {index} is out of a prepared list of {len} entries")]
    BadIndex {
        /// The index.
        index: usize,
        /// The list's length.
        len: usize,
    },
    /// A prepared remote list was made from metadata the peer has since replaced (it re-joined).
    #[error("prepared list for {0:?} is stale: the peer's metadata changed")]
    StaleMetadata(String),
    /// A notification is larger than the engine's message size.
    #[error("notification of {0} bytes exceeds the message size")]
    NotificationTooLarge(usize),
    /// A FILE registration failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// A CUDA IPC copy (same-node GPU path) failed.
    #[error(transparent)]
    Ipc(#[from] crate::nvlink::ipc::IpcError),
}

/// Transfers of at least this many bytes are striped over the rails both agents have.
pub const STRIPE_MIN: u64 = 4 << 20;
/// Slice size of a striped transfer.
pub const STRIPE_SLICE: u64 = 1 << 20;

fn remap_rkeys(
    r: &RemoteDescList,
    rkeys: &HashMap<u32, RegionInfo>,
    rail: usize,
) -> RemoteDescList {
    r.0.iter()
        .map(|d| RemoteDesc {
            rkey: rkeys.get(&d.rkey).map_or(0, |i| i.rkey_on(rail)),
            ..*d
        })
        .collect()
}

/// What a same-node GPU transfer needs: the remote pieces and the peer's exports they fall in.
#[derive(Debug, Clone)]
struct IpcPlan {
    local_gpu: u32,
    remote_gpu: u32,
    remote: RemoteDescList,
    /// (region id, start address, length, handle) of every export the pieces use.
    exports: Vec<(u64, u64, u64, [u8; 64])>,
}

impl IpcPlan {
    /// (region id, offset in the region, handle, region length) of the piece at `addr`.
    fn lookup(&self, addr: u64) -> Option<(u64, u64, [u8; 64], u64)> {
        self.exports
            .iter()
            .find(|&&(_, a, l, _)| addr >= a && addr < a + l)
            .map(|&(id, a, l, h)| (id, addr - a, h, l))
    }
}

/// The pure part of the same-node check: same node (known), another process, and every remote
/// piece inside one exported VRAM region of a single GPU.
fn plan_ipc(
    node: &str,
    process: u32,
    md: &AgentMetadata,
    remote: &RemoteDescList,
) -> Option<IpcPlan> {
    if node.is_empty() || md.node != node || md.process == process || md.ipc.is_empty() {
        return None;
    }
    let mut exports = Vec::new();
    let mut gpu = None;
    for d in &remote.0 {
        let (x, r) = md.ipc.iter().find_map(|x| {
            md.regions
                .iter()
                .find(|r| r.id == x.region && d.addr >= r.addr && d.addr + d.len <= r.addr + r.len)
                .map(|r| (x, r))
        })?;
        if *gpu.get_or_insert(x.gpu) != x.gpu {
            return None;
        }
        if !exports
            .iter()
            .any(|e: &(u64, u64, u64, [u8; 64])| e.0 == r.id)
        {
            exports.push((r.id, r.addr, r.len, x.handle));
        }
    }
    Some(IpcPlan {
        local_gpu: 0,
        remote_gpu: gpu?,
        remote: remote.clone(),
        exports,
    })
}

/// The device copies of a same-node GPU transfer: each piece of `l`/`r` (split to match) as a
/// copy between the local region (`mine`, by index in `l`) and the peer's opened export
/// (`theirs`, by region id); pieces that continue the previous copy on both sides (consecutive
/// KV blocks) extend it instead of adding one.
fn ipc_copies(
    peer: &str,
    op: Op,
    l: &LocalDescList,
    r: &RemoteDescList,
    plan: &IpcPlan,
    mine: &[Arc<dyn crate::nvlink::ipc::DeviceRange>],
    theirs: &HashMap<u64, Arc<dyn crate::nvlink::ipc::DeviceRange>>,
) -> Result<Vec<crate::runtime::DeviceCopy>, AgentError> {
    let mut copies: Vec<crate::runtime::DeviceCopy> = Vec::new();
    // (local region index, remote region id) of the last copy.
    let mut last: Option<(u32, u64)> = None;
    let unknown = |region| AgentError::UnknownRegion {
        peer: peer.to_string(),
        region,
    };
    for (d, x) in l.descs().iter().zip(&r.0) {
        let (region_id, offset, _, _) = plan.lookup(x.addr).ok_or_else(|| unknown(0))?;
        let (mine_off, their_off) = (d.offset as usize, offset as usize);
        let (dst_offset, src_offset) = match op {
            Op::Write => (their_off, mine_off),
            Op::Read => (mine_off, their_off),
        };
        if let Some(c) = copies.last_mut() {
            if last == Some((d.region, region_id))
                && c.dst_offset + c.len == dst_offset
                && c.src_offset + c.len == src_offset
            {
                c.len += d.len as usize;
                continue;
            }
        }
        let m = Arc::clone(
            mine.get(d.region as usize)
                .ok_or_else(|| unknown(region_id))?,
        );
        let t = Arc::clone(theirs.get(&region_id).ok_or_else(|| unknown(region_id))?);
        let (dst, src) = match op {
            Op::Write => (t, m),
            Op::Read => (m, t),
        };
        copies.push(crate::runtime::DeviceCopy {
            dst,
            dst_offset,
            src,
            src_offset,
            len: d.len as usize,
        });
        last = Some((d.region, region_id));
    }
    Ok(copies)
}

/// This machine in metadata: the kernel's boot id (unique per boot) and the host name.
fn node_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}/{}", boot.trim(), host.trim())
}

/// A notification: the sending agent's name and the message.
pub type Notification = (String, Vec<u8>);

/// The notification stream (a `futures` `Stream` of [`Notification`]s).
pub type Notifications = mpsc::UnboundedReceiver<Notification>;

/// Local descriptors prepared once; requests select entries by index (NIXL's prep + make).
#[derive(Debug, Clone, Default)]
pub struct PreparedLocal {
    list: LocalDescList,
}

impl PreparedLocal {
    /// Appends `len` bytes at `offset` of `reg`.
    pub fn push(&mut self, reg: &Registration, offset: u64, len: u64) {
        self.list.push(reg.region(), offset, len);
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    fn select(&self, idx: &[usize]) -> Result<LocalDescList, AgentError> {
        let (descs, regions) = (self.list.descs(), self.list.regions());
        let mut out = LocalDescList::with_capacity(idx.len());
        for &i in idx {
            let d = descs.get(i).ok_or(AgentError::BadIndex {
                index: i,
                len: descs.len(),
            })?;
            out.push(&regions[d.region as usize], d.offset, d.len);
        }
        Ok(out)
    }
}

/// A peer's descriptors, resolved and range-checked once against its metadata.
#[derive(Debug, Clone)]
pub struct PreparedRemote {
    peer: String,
    generation: u64,
    descs: Vec<RemoteDesc>,
}

impl PreparedRemote {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.descs.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    fn select(&self, idx: &[usize]) -> Result<RemoteDescList, AgentError> {
        idx.iter()
            .map(|&i| {
                self.descs.get(i).copied().ok_or(AgentError::BadIndex {
                    index: i,
                    len: self.descs.len(),
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(RemoteDescList)
    }
}

/// A transfer with a peer checked and planned once by [`Agent::prepare_request`], posted any
/// number of times by [`Agent::post_request`] (NIXL's prepared transfer request).
#[derive(Debug)]
pub struct TransferRequest {
    peer: String,
    op: Op,
    /// The peer's metadata generation it was made from.
    generation: u64,
    /// (region id, remote key) of every peer region it uses, checked at each post.
    keys: Vec<(u64, u32)>,
    bytes: u64,
    descriptors: usize,
    path: RequestPath,
}

impl TransferRequest {
    /// The peer.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// READ or WRITE.
    pub fn op(&self) -> Op {
        self.op
    }

    /// Bytes moved by one post.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Rails one post uses (0 on the same-node GPU path).
    pub fn rails(&self) -> usize {
        match &self.path {
            RequestPath::Rdma(parts) => parts.len(),
            RequestPath::Planned { .. } => 0,
        }
    }
}

#[derive(Debug)]
enum RequestPath {
    /// RDMA: one prepared transfer per rail it uses (rail 0 alone unless striped).
    Rdma(Vec<(usize, Arc<PreparedTransfer>)>),
    /// The same-node GPU path (CUDA IPC copies), planned at each post.
    Planned {
        local: LocalDescList,
        remote: RemoteDescList,
    },
}

/// The sum of a striped transfer's per-rail results (the first error if any failed).
fn sum_stats(
    results: Vec<Result<TransferStats, TransferError>>,
) -> Result<TransferStats, AgentError> {
    let mut total = TransferStats::default();
    for r in results {
        let st = r?;
        total.bytes += st.bytes;
        total.descriptors += st.descriptors;
        total.work_requests += st.work_requests;
        total.doorbells += st.doorbells;
    }
    Ok(total)
}

/// Who may see a registration in this agent's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Visibility {
    /// Every peer.
    All,
    /// Only these agents: others never receive its key from our metadata.
    Only(Vec<String>),
}

impl Visibility {
    fn allows(&self, reader: &str) -> bool {
        match self {
            Visibility::All => true,
            Visibility::Only(names) => names.iter().any(|n| n == reader),
        }
    }
}

/// Agent configuration.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AgentConfig {
    /// The engine's configuration.
    pub engine: EngineConfig,
    /// CPU of the agent's engine.
    pub cpu: usize,
    /// glommio I/O memory of the engine's core (locked; the FILE tier stages its I/O there and
    /// falls back to the heap when it is full).
    pub io_memory: usize,
    /// RDMA devices to stripe large transfers over (multi-rail), one engine each on CPUs
    /// `cpu`, `cpu + 1`, ...; empty or one entry: a single rail on `engine.device`. Every DRAM
    /// registration is registered on each rail. Default: `RIXL_RDMA_RAILS` (comma-separated).
    pub rails: Vec<String>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            engine: EngineConfig::from_env(),
            cpu: 0,
            io_memory: DEFAULT_IO_MEMORY,
            rails: std::env::var("RIXL_RDMA_RAILS")
                .map(|v| {
                    v.split(',')
                        .filter(|s| !s.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
        }
    }
}

/// A remote descriptor in a peer's terms: `len` bytes at `offset` of its region `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRef {
    /// The peer's region id (from its metadata).
    pub region: u64,
    /// Offset into the region.
    pub offset: u64,
    /// Length.
    pub len: u64,
}

struct Reg {
    region: Region,
    /// The same memory registered on rails 1.. (multi-rail agents).
    rails: Vec<Region>,
    visibility: Visibility,
    /// CUDA IPC export of a VRAM region: (GPU ordinal, handle).
    ipc: Option<(u32, [u8; 64])>,
}

#[derive(Default)]
struct PeerState {
    metadata: Option<AgentMetadata>,
    regions: HashMap<u64, RegionInfo>,
    /// Connections by rail (rail 0 also carries notifications).
    conns: Vec<Option<ConnId>>,
    /// The peer's VRAM regions opened through CUDA IPC, by region id.
    imported: HashMap<u64, Arc<crate::nvlink::ipc::ImportedMemory>>,
}

impl PeerState {
    /// Every connection of the peer, with its rail.
    fn take_conns(&mut self) -> Vec<(usize, ConnId)> {
        self.conns
            .drain(..)
            .enumerate()
            .filter_map(|(rail, c)| c.map(|c| (rail, c)))
            .collect()
    }

    /// The connection on `rail`, if made.
    fn conn(&self, rail: usize) -> Option<ConnId> {
        self.conns.get(rail).copied().flatten()
    }

    /// Records the connection on `rail`; returns the one it replaces.
    fn set_conn(&mut self, rail: usize, conn: ConnId) -> Option<ConnId> {
        if self.conns.len() <= rail {
            self.conns.resize(rail + 1, None);
        }
        self.conns[rail].replace(conn)
    }
}

pub(crate) struct Inner {
    name: String,
    generation: u64,
    engine: EngineHandle,
    pool: Mutex<Option<EnginePool>>,
    /// Engines of rails 1.. (one per extra NIC) and their pools.
    rail_engines: Vec<EngineHandle>,
    rail_pools: Mutex<Vec<EnginePool>>,
    regs: Mutex<BTreeMap<u64, Reg>>,
    /// This machine's identity in metadata (boot id and host name).
    node: String,
    /// The machine model, discovered on first need (same-node GPU path choice).
    machine: std::sync::OnceLock<crate::topology::Machine>,
    /// CUDA streams for same-node GPU copies, by GPU ordinal.
    copy_streams: Mutex<HashMap<i32, Arc<crate::nvlink::ipc::CopyStream>>>,
    next_id: AtomicU64,
    peers: Mutex<HashMap<String, PeerState>>,
    address: Mutex<String>,
    notif_tx: mpsc::UnboundedSender<Notification>,
    notif_rx: Mutex<Option<Notifications>>,
    stopped: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
            lock(&a.regs).remove(&self.id);
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
    inner: Arc<FileRegInner>,
}

struct FileRegInner {
    info: FileInfo,
    path: std::path::PathBuf,
    engine: EngineHandle,
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
    fn id(&self) -> crate::runtime::FileId {
        self.inner.info.id
    }

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

/// The agent. `Send + Sync`; clone it freely.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.inner.name)
            .finish()
    }
}

impl Agent {
    /// Starts an agent named `name` (unique in the cluster) with its engine.
    ///
    /// # Errors
    /// [`AgentError::Runtime`] if the engine cannot start (no device, memlock, ...).
    pub fn new(name: &str, cfg: AgentConfig) -> Result<Agent, AgentError> {
        let ncpu = crate::runtime::available_cpus().len().max(1);
        let mut first = cfg.engine.clone();
        if cfg.rails.len() > 1 {
            first.device = Some(cfg.rails[0].clone());
        }
        let pool = EnginePool::start(&first, &[cfg.cpu], cfg.io_memory)?;
        let engine = pool.handles()[0].clone();
        let mut rail_pools = Vec::new();
        let mut rail_engines = Vec::new();
        for (i, dev) in cfg.rails.iter().enumerate().skip(1).take(MAX_RAILS - 1) {
            let mut c = cfg.engine.clone();
            c.device = Some(dev.clone());
            let p = EnginePool::start(&c, &[(cfg.cpu + i) % ncpu], cfg.io_memory)?;
            rail_engines.push(p.handles()[0].clone());
            rail_pools.push(p);
        }
        let (notif_tx, notif_rx) = mpsc::unbounded();
        let generation = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id());
        Ok(Agent {
            inner: Arc::new(Inner {
                name: name.to_string(),
                generation,
                engine,
                pool: Mutex::new(Some(pool)),
                rail_engines,
                rail_pools: Mutex::new(rail_pools),
                regs: Mutex::new(BTreeMap::new()),
                node: node_identity(),
                machine: std::sync::OnceLock::new(),
                copy_streams: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(1),
                peers: Mutex::new(HashMap::new()),
                address: Mutex::new(String::new()),
                notif_tx,
                notif_rx: Mutex::new(Some(notif_rx)),
                stopped: AtomicBool::new(false),
            }),
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether the agent's core has an RDMA device. Without one (`engine.require_nic = false` on
    /// a machine without RDMA) it registers host memory and files, and peers cannot reach it.
    pub fn has_nic(&self) -> bool {
        self.inner.engine.has_nic()
    }

    /// Registers a file as FILE memory (a local tier): opened with O_DIRECT on the agent's core;
    /// the create modes reserve `spec.size` bytes up front. Its descriptors are
    /// [`FileDesc`]s (offset, length) inside `spec.size`.
    ///
    /// # Errors
    /// [`AgentError::File`] (not found, exists, too small, no space, ...).
    pub async fn register_file(&self, spec: FileSpec) -> Result<FileRegistration, AgentError> {
        let path = spec.path.clone();
        let info = self.inner.engine.open_file(spec).await?;
        tracing::debug!(agent = %self.inner.name, path = %path.display(), size = info.size, "file registered");
        Ok(FileRegistration {
            inner: Arc::new(FileRegInner {
                info,
                path,
                engine: self.inner.engine.clone(),
            }),
        })
    }

    /// Copies `local` (DRAM) into the file at `file_descs` (paired in order, same total length).
    /// Adjacent file descriptors are merged into larger I/Os; writes must be aligned to
    /// [`FileRegistration::alignment`] after merging.
    ///
    /// # Errors
    /// [`AgentError::Transfer`] with an invalid descriptor or a [`FileError`] (unaligned, out of
    /// range, deleted file, no space, ...), or a timeout.
    pub async fn write_file(
        &self,
        local: &LocalDescList,
        file: &FileRegistration,
        file_descs: &[FileDesc],
    ) -> Result<TransferStats, AgentError> {
        self.transfer_file(Op::Write, local, file, file_descs, None)
            .await
    }

    /// Reads the file at `file_descs` into `local` (any alignment).
    ///
    /// # Errors
    /// As [`Self::write_file`], and [`FileError::ShortRead`] for a file truncated after it was
    /// registered.
    pub async fn read_file(
        &self,
        local: &LocalDescList,
        file: &FileRegistration,
        file_descs: &[FileDesc],
    ) -> Result<TransferStats, AgentError> {
        self.transfer_file(Op::Read, local, file, file_descs, None)
            .await
    }

    /// A FILE transfer (`Op::Write`: memory to file) with an optional deadline (default: the
    /// engine's `transfer_timeout`).
    ///
    /// # Errors
    /// As [`Self::write_file`].
    pub async fn transfer_file(
        &self,
        op: Op,
        local: &LocalDescList,
        file: &FileRegistration,
        file_descs: &[FileDesc],
        timeout: Option<std::time::Duration>,
    ) -> Result<TransferStats, AgentError> {
        Ok(file
            .inner
            .engine
            .file_transfer(file.id(), op, local.clone(), file_descs.to_vec(), timeout)
            .await?)
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
        let region = self.inner.engine.register_gpu(ordinal, len).await?;
        let ipc =
            region
                .gpu_memory()
                .and_then(|m| match crate::nvlink::ipc::IpcHandle::export(m) {
                    Ok(h) => Some((ordinal as u32, h.0)),
                    Err(e) => {
                        tracing::warn!(error = %e, "VRAM region not exported for CUDA IPC");
                        None
                    }
                });
        let reg = self.add_registration(region, visibility, Vec::new());
        if let Some(r) = lock(&self.inner.regs).get_mut(&reg.id()) {
            r.ipc = ipc;
        }
        Ok(reg)
    }

    fn add_registration(
        &self,
        region: Region,
        visibility: Visibility,
        rails: Vec<Region>,
    ) -> Registration {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.inner.regs).insert(
            id,
            Reg {
                region: region.clone(),
                rails,
                visibility,
                ipc: None,
            },
        );
        Registration {
            inner: Arc::new(RegInner {
                id,
                region,
                agent: Arc::downgrade(&self.inner),
            }),
        }
    }

    /// Registers `len` bytes of DRAM (zeroed), visible per `visibility`.
    ///
    /// # Errors
    /// [`AgentError::Runtime`] if registration fails.
    pub async fn register(
        &self,
        len: usize,
        visibility: Visibility,
    ) -> Result<Registration, AgentError> {
        if self.inner.rail_engines.is_empty() {
            let region = self.inner.engine.register(len).await?;
            return Ok(self.add_registration(region, visibility, Vec::new()));
        }
        // Multi-rail: one buffer, registered on every rail's NIC.
        let mem = Arc::new(
            crate::verbs::HostBuffer::new(len).map_err(|e| AgentError::Runtime(e.into()))?,
        );
        let region = self.inner.engine.register_shared(Arc::clone(&mem)).await?;
        let mut rails = Vec::with_capacity(self.inner.rail_engines.len());
        for e in &self.inner.rail_engines {
            rails.push(e.register_shared(Arc::clone(&mem)).await?);
        }
        Ok(self.add_registration(region, visibility, rails))
    }

    /// This agent's metadata as `reader` may see it: regions scoped to other agents are left out,
    /// so `reader` cannot obtain their keys from it.
    ///
    /// # Errors
    /// [`AgentError::Metadata`] if it exceeds the format's limits.
    pub fn local_metadata(&self, reader: &str) -> Result<Vec<u8>, AgentError> {
        Ok(self.inner.metadata_for(reader).encode()?)
    }

    /// Loads a peer's metadata blob; returns the peer's name. A blob with a new generation (the
    /// peer restarted) replaces the old one and drops the old connection.
    ///
    /// # Errors
    /// [`AgentError::Metadata`] for a truncated, forged or incompatible blob.
    pub fn load_remote_metadata(&self, blob: &[u8]) -> Result<String, AgentError> {
        let md = AgentMetadata::decode(blob)?;
        let name = md.name.clone();
        let stale = {
            let mut peers = lock(&self.inner.peers);
            let p = peers.entry(name.clone()).or_default();
            let rejoined = p
                .metadata
                .as_ref()
                .is_some_and(|m| m.generation != md.generation);
            p.regions = md.regions.iter().map(|r| (r.id, *r)).collect();
            p.metadata = Some(md);
            if rejoined {
                p.take_conns()
            } else {
                Vec::new()
            }
        };
        for (rail, c) in stale {
            let e = self.inner.rail_engine(rail).clone();
            futures_lite::future::block_on(e.close_connection(c));
        }
        tracing::debug!(agent = %self.inner.name, peer = %name, "loaded remote metadata");
        Ok(name)
    }

    /// Forgets a peer and closes its connection.
    pub async fn invalidate_remote(&self, peer: &str) {
        let conns = lock(&self.inner.peers)
            .remove(peer)
            .map(|mut p| p.take_conns())
            .unwrap_or_default();
        for (rail, c) in conns {
            self.inner.rail_engine(rail).close_connection(c).await;
        }
    }

    /// Serves this agent's metadata and connection set-up on `addr` (a TCP side channel);
    /// returns the bound address.
    ///
    /// # Errors
    /// [`AgentError::SideChannel`] if it cannot listen.
    pub fn listen(&self, addr: &str) -> Result<SocketAddr, AgentError> {
        sidechannel::listen(&self.inner, addr)
    }

    /// Fetches a peer's metadata from its side channel and loads it; returns the peer's name.
    ///
    /// # Errors
    /// [`AgentError::SideChannel`] or [`AgentError::Metadata`].
    pub fn fetch_remote_metadata(&self, addr: &str) -> Result<String, AgentError> {
        let blob = sidechannel::fetch_metadata(&self.inner.name, addr)?;
        self.load_remote_metadata(&blob)
    }

    /// Joins a central store: publishes this agent's metadata (regions visible to all) under
    /// `<namespace>/<name>` on the etcd server at `endpoint` (`host:port`), renewed on a `ttl`
    /// lease, and watches the namespace: peers that appear (or re-join with new metadata) are
    /// loaded, peers whose key disappears are invalidated. Call [`Self::listen`] first so the
    /// published metadata carries the side-channel address.
    ///
    /// # Errors
    /// [`AgentError::SideChannel`] if etcd cannot be reached.
    pub fn join_etcd(
        &self,
        endpoint: &str,
        namespace: &str,
        ttl: std::time::Duration,
    ) -> Result<(), AgentError> {
        etcd::join(&self.inner, self.clone(), endpoint, namespace, ttl)
    }

    /// Engine counters of each rail (rail 0 first).
    pub async fn rail_counters(&self) -> Vec<crate::runtime::EngineCounters> {
        let mut v = Vec::new();
        for rail in 0..=self.inner.rail_engines.len() {
            if let Ok((c, _)) = self.inner.rail_engine(rail).counters().await {
                v.push(c);
            }
        }
        v
    }

    /// Number of rails (NICs) this agent stripes over.
    pub fn rails(&self) -> usize {
        1 + self.inner.rail_engines.len()
    }

    /// Names of the peers whose metadata is loaded.
    pub fn peers(&self) -> Vec<String> {
        let mut v: Vec<String> = lock(&self.inner.peers)
            .iter()
            .filter(|(_, p)| p.metadata.is_some())
            .map(|(n, _)| n.clone())
            .collect();
        v.sort();
        v
    }

    /// RDMA WRITE of `local` to the peer's regions. Between GPU memory of two processes on one
    /// node, where the topology says so, the pieces are device copies over CUDA IPC instead.
    /// Pieces may land in any order: destinations that overlap end up with either piece's bytes
    /// (or a mix).
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`], [`AgentError::UnknownRegion`],
    /// [`AgentError::RemoteOutOfRange`] (before anything is posted), or a transfer error.
    pub async fn write(
        &self,
        peer: &str,
        local: &LocalDescList,
        remote: &[RemoteRef],
    ) -> Result<TransferStats, AgentError> {
        self.transfer(peer, Op::Write, local, remote, None).await
    }

    /// RDMA READ of the peer's regions into `local`.
    ///
    /// # Errors
    /// As [`Self::write`].
    pub async fn read(
        &self,
        peer: &str,
        local: &LocalDescList,
        remote: &[RemoteRef],
    ) -> Result<TransferStats, AgentError> {
        self.transfer(peer, Op::Read, local, remote, None).await
    }

    /// A READ or WRITE; with `notification`, the peer receives it (from its notification
    /// stream) after every descriptor of the transfer has completed.
    ///
    /// # Errors
    /// As [`Self::write`].
    pub async fn transfer(
        &self,
        peer: &str,
        op: Op,
        local: &LocalDescList,
        remote: &[RemoteRef],
        notification: Option<&[u8]>,
    ) -> Result<TransferStats, AgentError> {
        let remote = self.inner.resolve(peer, remote, None)?.0;
        self.post(peer, op, local.clone(), remote, notification)
            .await
    }

    /// Connects lazily, runs the transfer, then sends the notification (after every descriptor
    /// completed): the shared tail of [`Self::transfer`] and [`Self::transfer_indices`].
    async fn post(
        &self,
        peer: &str,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
        notification: Option<&[u8]>,
    ) -> Result<TransferStats, AgentError> {
        if let Some(plan) = self.inner.ipc_plan(peer, &local, &remote) {
            let st = self.ipc_transfer(peer, op, &local, plan).await?;
            if let Some(msg) = notification {
                let conn = sidechannel::ensure_connection(&self.inner, peer).await?;
                self.notify_on(conn, msg).await?;
            }
            return Ok(st);
        }
        let conn = sidechannel::ensure_connection(&self.inner, peer).await?;
        let rails = self.inner.shared_rails(peer);
        let st = if rails > 1 && local.total_len() >= STRIPE_MIN {
            self.striped(peer, op, &local, &remote, rails).await?
        } else {
            self.inner
                .engine
                .transfer(conn, op, local, remote, TransferOptions::default())
                .await?
        };
        if let Some(msg) = notification {
            self.notify_on(conn, msg).await?;
        }
        Ok(st)
    }

    /// The same-node GPU path: each remote piece is copied to or from the peer's VRAM opened
    /// through CUDA IPC, on a per-GPU stream, awaited through its event.
    async fn ipc_transfer(
        &self,
        peer: &str,
        op: Op,
        local: &LocalDescList,
        plan: IpcPlan,
    ) -> Result<TransferStats, AgentError> {
        use crate::nvlink::ipc::{CopyStream, DeviceRange, ImportedMemory, IpcHandle};
        let stream = {
            let mut streams = lock(&self.inner.copy_streams);
            match streams.get(&(plan.local_gpu as i32)) {
                Some(s) => Arc::clone(s),
                None => {
                    let gpu = crate::gpudirect::Gpu::open(plan.local_gpu as i32)
                        .map_err(crate::nvlink::ipc::IpcError::from)?;
                    let s = Arc::new(CopyStream::new(&gpu)?);
                    streams.insert(plan.local_gpu as i32, Arc::clone(&s));
                    s
                }
            }
        };
        let gpu = stream.gpu();
        // The peer's exports this transfer touches, opened once each (and cached per peer).
        let mut theirs: HashMap<u64, Arc<dyn DeviceRange>> = HashMap::new();
        for &(region_id, _, len, handle) in &plan.exports {
            let cached = lock(&self.inner.peers)
                .get(peer)
                .and_then(|p| p.imported.get(&region_id).cloned());
            let m = match cached {
                Some(m) => m,
                None => {
                    let m = Arc::new(ImportedMemory::open(gpu, &IpcHandle(handle), len as usize)?);
                    if let Some(p) = lock(&self.inner.peers).get_mut(peer) {
                        p.imported.insert(region_id, Arc::clone(&m));
                    }
                    m
                }
            };
            theirs.insert(region_id, m);
        }
        let (l, r) = &crate::runtime::desc::split_stream(local, &plan.remote, 1, u64::MAX)[0];
        let mine: Vec<Arc<dyn DeviceRange>> = l
            .regions()
            .iter()
            .map(|r| Arc::new(r.clone()) as Arc<dyn DeviceRange>)
            .collect();
        let copies = ipc_copies(peer, op, l, r, &plan, &mine, &theirs)?;
        let n = copies.len();
        // Enqueued from this thread, awaited on the engine's core like RDMA work.
        self.inner.engine.device_copies(stream, copies).await?;
        tracing::debug!(agent = %self.inner.name, %peer, copies = n, "CUDA IPC transfer");
        let mut st = TransferStats::default();
        st.bytes = local.total_len();
        st.descriptors = local.len();
        st.work_requests = n;
        Ok(st)
    }

    /// Stripes a transfer over `rails` rails: slices of [`STRIPE_SLICE`] bytes dealt
    /// round-robin, each rail's part on its own engine and connection, all in flight at once.
    async fn striped(
        &self,
        peer: &str,
        op: Op,
        local: &LocalDescList,
        remote: &RemoteDescList,
        rails: usize,
    ) -> Result<TransferStats, AgentError> {
        let mut futs = Vec::with_capacity(rails);
        for (rail, conn, l, r) in self.rail_parts(peer, local, remote, rails).await? {
            let engine = self.inner.rail_engine(rail).clone();
            futs.push(Box::pin(async move {
                engine
                    .transfer(conn, op, l, r, TransferOptions::default())
                    .await
            }));
        }
        tracing::debug!(agent = %self.inner.name, %peer, rails = futs.len(), bytes = local.total_len(), "striped transfer");
        let mut st = sum_stats(crate::runtime::join_all(futs).await)?;
        st.descriptors = local.len();
        Ok(st)
    }

    /// A striped transfer's parts: (rail, connection, local part on that rail's registrations,
    /// remote part with that rail's keys), connecting rails on first use. Empty parts are left
    /// out.
    async fn rail_parts(
        &self,
        peer: &str,
        local: &LocalDescList,
        remote: &RemoteDescList,
        rails: usize,
    ) -> Result<Vec<(usize, ConnId, LocalDescList, RemoteDescList)>, AgentError> {
        let parts = crate::runtime::desc::split_stream(local, remote, rails, STRIPE_SLICE);
        let rkeys = self.inner.peer_rkeys(peer)?;
        let mut out = Vec::with_capacity(rails);
        for (rail, (l, r)) in parts.into_iter().enumerate() {
            if l.is_empty() {
                continue;
            }
            let (l, r) = if rail == 0 {
                (l, r)
            } else {
                (self.inner.on_rail(&l, rail)?, remap_rkeys(&r, &rkeys, rail))
            };
            let conn = sidechannel::ensure_rail(&self.inner, peer, rail).await?;
            out.push((rail, conn, l, r));
        }
        Ok(out)
    }

    /// Checks, resolves and plans a READ or WRITE with `peer` once, for [`Self::post_request`]
    /// to post any number of times (NIXL's `createXferReq` + `postXferReq`): weights sent to
    /// the same actor every step, a fixed KV layout, a layer-by-layer stream. Validation,
    /// region lookup, the path choice, multi-rail striping and work-request planning are done
    /// here; a post only checks that the peer's metadata is still the one it was made from and
    /// rings the doorbells. Connections are made here if needed.
    ///
    /// The request keeps its local regions registered while it lives. It is bound to the
    /// peer's metadata and connections as they are now: once the peer re-joins (new metadata),
    /// drops a region it uses, or its connection fails, posting it gives a typed error
    /// ([`AgentError::StaleMetadata`], or a [`TransferError::Connection`]) and it must be
    /// prepared again.
    ///
    /// # Errors
    /// As [`Self::write`]: [`AgentError::UnknownPeer`], [`AgentError::UnknownRegion`],
    /// [`AgentError::RemoteOutOfRange`], invalid local descriptors, or a connection error.
    pub async fn prepare_request(
        &self,
        peer: &str,
        op: Op,
        local: &LocalDescList,
        remote: &[RemoteRef],
    ) -> Result<TransferRequest, AgentError> {
        let mut keys = Vec::new();
        let (remote_list, generation) = self.inner.resolve(peer, remote, Some(&mut keys))?;
        let path = if self.inner.ipc_plan(peer, local, &remote_list).is_some() {
            RequestPath::Planned {
                local: local.clone(),
                remote: remote_list,
            }
        } else {
            let rails = self.inner.shared_rails(peer);
            let parts = if rails > 1 && local.total_len() >= STRIPE_MIN {
                self.rail_parts(peer, local, &remote_list, rails).await?
            } else {
                let conn = sidechannel::ensure_connection(&self.inner, peer).await?;
                vec![(0, conn, local.clone(), remote_list)]
            };
            let mut prepared = Vec::with_capacity(parts.len());
            for (rail, conn, l, r) in parts {
                let p = self
                    .inner
                    .rail_engine(rail)
                    .prepare_transfer(conn, op, l, r)
                    .await?;
                prepared.push((rail, p));
            }
            RequestPath::Rdma(prepared)
        };
        Ok(TransferRequest {
            peer: peer.to_string(),
            op,
            generation,
            keys,
            bytes: local.total_len(),
            descriptors: local.len(),
            path,
        })
    }

    /// Posts a prepared request once more and waits for it; with `notification`, the peer
    /// receives it after every descriptor has completed (as [`Self::transfer`]).
    ///
    /// # Errors
    /// [`AgentError::StaleMetadata`] if the peer's metadata changed since the request was
    /// prepared (it re-joined, or no longer has a region the request uses: nothing is posted),
    /// [`AgentError::UnknownPeer`] if the peer was invalidated; otherwise as [`Self::transfer`].
    pub async fn post_request(
        &self,
        req: &TransferRequest,
        notification: Option<&[u8]>,
    ) -> Result<TransferStats, AgentError> {
        self.inner
            .check_keys(&req.peer, req.generation, &req.keys)?;
        let parts = match &req.path {
            RequestPath::Planned { local, remote } => {
                return self
                    .post(
                        &req.peer,
                        req.op,
                        local.clone(),
                        remote.clone(),
                        notification,
                    )
                    .await;
            }
            RequestPath::Rdma(parts) => parts,
        };
        let futs: Vec<_> = parts
            .iter()
            .map(|(rail, p)| {
                let engine = self.inner.rail_engine(*rail).clone();
                let p = Arc::clone(p);
                Box::pin(async move { engine.post(&p, TransferOptions::default()).await })
            })
            .collect();
        let mut st = sum_stats(crate::runtime::join_all(futs).await)?;
        st.descriptors = req.descriptors;
        if let Some(msg) = notification {
            let conn = sidechannel::ensure_connection(&self.inner, &req.peer).await?;
            self.notify_on(conn, msg).await?;
        }
        Ok(st)
    }

    /// Resolves and checks `remote` against `peer`'s metadata once, for index-based requests.
    ///
    /// # Errors
    /// As the checks of [`Self::write`].
    pub fn prepare_remote(
        &self,
        peer: &str,
        remote: &[RemoteRef],
    ) -> Result<PreparedRemote, AgentError> {
        let (descs, generation) = self.inner.resolve(peer, remote, None)?;
        let descs = descs.0;
        Ok(PreparedRemote {
            peer: peer.to_string(),
            generation,
            descs,
        })
    }

    /// A transfer made from index selections of prepared lists (the two selections pair up in
    /// order and must describe the same total length).
    ///
    /// # Errors
    /// [`AgentError::BadIndex`], [`AgentError::StaleMetadata`], or as [`Self::transfer`].
    pub async fn transfer_indices(
        &self,
        op: Op,
        local: &PreparedLocal,
        local_idx: &[usize],
        remote: &PreparedRemote,
        remote_idx: &[usize],
        notification: Option<&[u8]>,
    ) -> Result<TransferStats, AgentError> {
        if self.inner.peer_generation(&remote.peer)? != remote.generation {
            return Err(AgentError::StaleMetadata(remote.peer.clone()));
        }
        let l = local.select(local_idx)?;
        let r = remote.select(remote_idx)?;
        self.post(&remote.peer, op, l, r, notification).await
    }

    /// Sends a standalone notification to `peer` (NIXL's `genNotif`).
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`], [`AgentError::NotificationTooLarge`], or a transfer error.
    pub async fn notify(&self, peer: &str, msg: &[u8]) -> Result<(), AgentError> {
        let conn = sidechannel::ensure_connection(&self.inner, peer).await?;
        self.notify_on(conn, msg).await
    }

    async fn notify_on(&self, conn: ConnId, msg: &[u8]) -> Result<(), AgentError> {
        if msg.is_empty() || msg.len() > 4096 {
            return Err(AgentError::NotificationTooLarge(msg.len()));
        }
        self.inner.engine.send(conn, msg.to_vec(), None).await?;
        Ok(())
    }

    /// The stream of `(peer, message)` notifications received by this agent (taken once).
    pub fn notifications(&self) -> Option<Notifications> {
        lock(&self.inner.notif_rx).take()
    }

    /// Stops the side channel and the engine.
    pub fn shutdown(&self) {
        self.inner.stopped.store(true, Ordering::SeqCst);
        if let Some(p) = lock(&self.inner.pool).take() {
            p.shutdown();
        }
        for p in lock(&self.inner.rail_pools).drain(..) {
            p.shutdown();
        }
    }
}

impl Inner {
    fn metadata_for(&self, reader: &str) -> AgentMetadata {
        let regions = lock(&self.regs)
            .iter()
            // Host memory of a core without a NIC is not reachable by peers; GPU memory is, by
            // CUDA IPC from the same node, when it is exported.
            .filter(|(_, r)| {
                (r.region.registration().is_some() || r.ipc.is_some())
                    && r.visibility.allows(reader)
            })
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
        let ipc = lock(&self.regs)
            .iter()
            .filter(|(_, r)| r.visibility.allows(reader))
            .filter_map(|(&id, r)| {
                r.ipc.map(|(gpu, handle)| metadata::IpcExport {
                    region: id,
                    gpu,
                    handle,
                })
            })
            .collect();
        AgentMetadata {
            name: self.name.clone(),
            generation: self.generation,
            address: lock(&self.address).clone(),
            regions,
            rails: (1 + self.rail_engines.len()) as u8,
            node: self.node.clone(),
            process: std::process::id(),
            ipc,
        }
    }

    /// Whether a transfer with `peer` takes the same-node GPU path (CUDA IPC): the peer runs on
    /// this node in another process, every local region is GPU memory, every remote piece lies in
    /// a VRAM region the peer exported, and the topology's path choice says CUDA IPC for the two
    /// GPUs (NVLink or P2P, or the same GPU).
    fn ipc_plan(
        &self,
        peer: &str,
        local: &LocalDescList,
        remote: &RemoteDescList,
    ) -> Option<IpcPlan> {
        if !local.regions().iter().all(Region::is_gpu) || local.is_empty() {
            return None;
        }
        let local_gpu = local.regions()[0].gpu_memory()?.gpu().ordinal() as u32;
        let peers = lock(&self.peers);
        let md = peers.get(peer)?.metadata.as_ref()?;
        let plan = plan_ipc(&self.node, std::process::id(), md, remote)?;
        let machine = self.machine.get_or_init(crate::machine::discover);
        let place = |process, index| crate::topology::Place {
            node: self.node.clone(),
            process,
            memory: crate::topology::MemoryLocation::Gpu { index },
        };
        match machine.choose_path(
            &place(std::process::id(), local_gpu),
            &place(md.process, plan.remote_gpu),
        ) {
            crate::topology::Path::CudaIpc { .. } => Some(IpcPlan { local_gpu, ..plan }),
            _ => None,
        }
    }

    /// The engine of rail `rail` (0: the agent's engine).
    fn rail_engine(&self, rail: usize) -> &EngineHandle {
        if rail == 0 {
            &self.engine
        } else {
            self.rail_engines.get(rail - 1).unwrap_or(&self.engine)
        }
    }

    /// Rails both this agent and `peer` have.
    fn shared_rails(&self, peer: &str) -> usize {
        if self.rail_engines.is_empty() {
            // Single-rail agents take no lock for this on every transfer.
            return 1;
        }
        let theirs = lock(&self.peers)
            .get(peer)
            .and_then(|p| p.metadata.as_ref().map(|m| usize::from(m.rails.max(1))))
            .unwrap_or(1);
        (1 + self.rail_engines.len()).min(theirs)
    }

    /// The peer's regions' remote keys on every rail, keyed by the rail-0 key.
    fn peer_rkeys(&self, peer: &str) -> Result<HashMap<u32, RegionInfo>, AgentError> {
        let peers = lock(&self.peers);
        let p = peers
            .get(peer)
            .ok_or_else(|| AgentError::UnknownPeer(peer.to_string()))?;
        Ok(p.regions.values().map(|r| (r.rkey, *r)).collect())
    }

    /// `list` (built on rail-0 regions) with each region replaced by its registration on `rail`.
    fn on_rail(&self, list: &LocalDescList, rail: usize) -> Result<LocalDescList, AgentError> {
        // Map each distinct region once (the list keeps them deduplicated), then the descriptors.
        let mapped: Vec<Region> = {
            let regs = lock(&self.regs);
            list.regions()
                .iter()
                .enumerate()
                .map(|(i, r0)| {
                    regs.values()
                        .find(|g| g.region.same(r0))
                        .and_then(|g| g.rails.get(rail - 1).cloned())
                        .ok_or_else(|| {
                            let index = list
                                .descs()
                                .iter()
                                .position(|d| d.region as usize == i)
                                .unwrap_or(0);
                            AgentError::Transfer(TransferError::InvalidDescriptor(
                                crate::runtime::InvalidDescriptor::ForeignRegion { index },
                            ))
                        })
                })
                .collect::<Result<_, _>>()?
        };
        let mut out = LocalDescList::with_capacity(list.len());
        for d in list.descs() {
            out.push(&mapped[d.region as usize], d.offset, d.len);
        }
        Ok(out)
    }

    fn peer_generation(&self, peer: &str) -> Result<u64, AgentError> {
        lock(&self.peers)
            .get(peer)
            .and_then(|p| p.metadata.as_ref().map(|m| m.generation))
            .ok_or_else(|| AgentError::UnknownPeer(peer.to_string()))
    }

    /// Whether the peer's metadata is still `generation` and still grants every region of
    /// `keys` with the same key.
    fn check_keys(
        &self,
        peer: &str,
        generation: u64,
        keys: &[(u64, u32)],
    ) -> Result<(), AgentError> {
        let peers = lock(&self.peers);
        let p = peers
            .get(peer)
            .ok_or_else(|| AgentError::UnknownPeer(peer.to_string()))?;
        let same = p.metadata.as_ref().map(|m| m.generation) == Some(generation)
            && keys
                .iter()
                .all(|(id, rkey)| p.regions.get(id).map(|r| r.rkey) == Some(*rkey));
        if same {
            Ok(())
        } else {
            Err(AgentError::StaleMetadata(peer.to_string()))
        }
    }

    /// Maps a peer's region references to remote descriptors, checking ranges; also returns
    /// the peer's metadata generation and, with `keys`, collects the (id, remote key) of every
    /// region they use (for prepared requests; a plain transfer does not need them).
    fn resolve(
        &self,
        peer: &str,
        remote: &[RemoteRef],
        mut keys: Option<&mut Vec<(u64, u32)>>,
    ) -> Result<(RemoteDescList, u64), AgentError> {
        let peers = lock(&self.peers);
        let (p, generation) = peers
            .get(peer)
            .and_then(|p| p.metadata.as_ref().map(|m| (p, m.generation)))
            .ok_or_else(|| AgentError::UnknownPeer(peer.to_string()))?;
        let mut out = Vec::with_capacity(remote.len());
        for (index, r) in remote.iter().enumerate() {
            let info = p
                .regions
                .get(&r.region)
                .ok_or_else(|| AgentError::UnknownRegion {
                    peer: peer.to_string(),
                    region: r.region,
                })?;
            match r.offset.checked_add(r.len) {
                Some(end) if end <= info.len => {}
                _ => {
                    return Err(AgentError::RemoteOutOfRange {
                        index,
                        region: r.region,
                        offset: r.offset,
                        len: r.len,
                        region_len: info.len,
                    })
                }
            }
            if let Some(keys) = keys.as_deref_mut() {
                if !keys.iter().any(|k| k.0 == r.region) {
                    keys.push((r.region, info.rkey));
                }
            }
            out.push(RemoteDesc {
                addr: info.addr + r.offset,
                len: r.len,
                rkey: info.rkey,
            });
        }
        Ok((RemoteDescList(out), generation))
    }

    /// Delivers messages arriving on `conn` from `peer` to the notification stream until the
    /// connection ends.
    fn spawn_receiver(self: &Arc<Self>, peer: String, conn: ConnId) {
        let engine = self.engine.clone();
        let tx = self.notif_tx.clone();
        std::thread::spawn(move || loop {
            match futures_lite::future::block_on(engine.recv(conn)) {
                Ok(Message::Data(d, _)) => {
                    if tx.unbounded_send((peer.clone(), d)).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "notification receiver ended");
                    return;
                }
            }
        });
    }
}

/// A request is made on one thread and posted from any (an agent is shared by a serving
/// engine's threads): checked when this compiles.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<TransferRequest>();
    send_sync::<Agent>();
};

#[cfg(test)]
mod request_tests {
    use super::*;

    fn stats(bytes: u64, descriptors: usize, work_requests: usize) -> TransferStats {
        let mut st = TransferStats::default();
        st.bytes = bytes;
        st.descriptors = descriptors;
        st.work_requests = work_requests;
        st.doorbells = 1;
        st
    }

    #[test]
    fn rail_results_add_up_and_a_failed_rail_fails_the_transfer() {
        let total = sum_stats(vec![Ok(stats(3 << 20, 3, 3)), Ok(stats(2 << 20, 2, 2))])
            .expect("both rails ok");
        assert_eq!(
            (
                total.bytes,
                total.descriptors,
                total.work_requests,
                total.doorbells
            ),
            (5 << 20, 5, 5, 2)
        );
        let failed = sum_stats(vec![
            Ok(stats(1, 1, 1)),
            Err(TransferError::Timeout(std::time::Duration::from_secs(1))),
        ]);
        assert!(matches!(
            failed,
            Err(AgentError::Transfer(TransferError::Timeout(_)))
        ));
    }
}

#[cfg(test)]
mod ipc_tests {
    use super::*;
    use metadata::IpcExport;

    fn md(node: &str, process: u32) -> AgentMetadata {
        let region = |id: u64, addr: u64, kind| RegionInfo {
            id,
            addr,
            len: 1 << 20,
            rkey: 1,
            kind,
            rail_rkeys: [0; MAX_RAILS - 1],
        };
        AgentMetadata {
            name: "peer".into(),
            generation: 1,
            address: String::new(),
            regions: vec![
                region(1, 0x1000_0000, MemKind::Vram),
                region(2, 0x2000_0000, MemKind::Dram),
                region(3, 0x3000_0000, MemKind::Vram),
            ],
            rails: 1,
            node: node.into(),
            process,
            ipc: vec![
                IpcExport {
                    region: 1,
                    gpu: 0,
                    handle: [1; 64],
                },
                IpcExport {
                    region: 3,
                    gpu: 1,
                    handle: [3; 64],
                },
            ],
        }
    }

    fn remote(pieces: &[(u64, u64)]) -> RemoteDescList {
        pieces
            .iter()
            .map(|&(addr, len)| RemoteDesc { addr, len, rkey: 1 })
            .collect()
    }

    #[test]
    fn same_node_other_process_exported_vram_takes_cuda_ipc() {
        let r = remote(&[(0x1000_0000, 4096), (0x1000_8000, 4096)]);
        let plan = plan_ipc("boot/a", 10, &md("boot/a", 11), &r).expect("IPC");
        assert_eq!(plan.remote_gpu, 0);
        assert_eq!(plan.exports.len(), 1);
        assert_eq!(
            plan.lookup(0x1000_8000),
            Some((1, 0x8000, [1; 64], 1 << 20))
        );
        assert_eq!(plan.lookup(0x2000_0000), None);
    }

    #[test]
    fn anything_else_stays_on_rdma() {
        let r = remote(&[(0x1000_0000, 4096)]);
        assert!(
            plan_ipc("boot/a", 10, &md("boot/b", 11), &r).is_none(),
            "other node"
        );
        assert!(
            plan_ipc("boot/a", 10, &md("boot/a", 10), &r).is_none(),
            "same process"
        );
        assert!(plan_ipc("", 10, &md("", 11), &r).is_none(), "unknown node");
        let dram = remote(&[(0x2000_0000, 4096)]);
        assert!(
            plan_ipc("boot/a", 10, &md("boot/a", 11), &dram).is_none(),
            "DRAM"
        );
        let two_gpus = remote(&[(0x1000_0000, 4096), (0x3000_0000, 4096)]);
        assert!(
            plan_ipc("boot/a", 10, &md("boot/a", 11), &two_gpus).is_none(),
            "two GPUs"
        );
        let past = remote(&[(0x1000_0000 + (1 << 20) - 10, 4096)]);
        assert!(
            plan_ipc("boot/a", 10, &md("boot/a", 11), &past).is_none(),
            "outside"
        );
    }

    #[derive(Debug)]
    struct Fake(u64);
    impl crate::nvlink::ipc::DeviceRange for Fake {
        fn device_addr(&self) -> u64 {
            self.0
        }
        fn device_len(&self) -> usize {
            1 << 20
        }
    }

    #[test]
    fn ipc_copies_merge_blocks_that_continue_on_both_sides_and_follow_the_direction() {
        let host = Region::unregistered(1 << 16).expect("host region");
        let mut local = LocalDescList::new();
        // Blocks 0,1 continue each other on both sides; block 2 goes back (reversed order).
        local.push(&host, 0, 4096);
        local.push(&host, 4096, 4096);
        local.push(&host, 8192, 4096);
        let r = remote(&[
            (0x1000_0000, 4096),
            (0x1000_1000, 4096),
            (0x1000_0000 + 0x8000, 4096),
        ]);
        let plan = plan_ipc("n", 1, &md("n", 2), &r).expect("IPC");
        let mine: Vec<Arc<dyn crate::nvlink::ipc::DeviceRange>> = vec![Arc::new(Fake(0xa000))];
        let theirs: HashMap<u64, Arc<dyn crate::nvlink::ipc::DeviceRange>> =
            HashMap::from([(1, Arc::new(Fake(0xb000)) as _)]);
        let got = |op| {
            ipc_copies("p", op, &local, &r, &plan, &mine, &theirs)
                .expect("copies")
                .iter()
                .map(|c| {
                    (
                        c.dst.device_addr(),
                        c.dst_offset,
                        c.src.device_addr(),
                        c.src_offset,
                        c.len,
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            got(Op::Write),
            [
                (0xb000, 0, 0xa000, 0, 8192),
                (0xb000, 0x8000, 0xa000, 8192, 4096)
            ]
        );
        assert_eq!(
            got(Op::Read),
            [
                (0xa000, 0, 0xb000, 0, 8192),
                (0xa000, 8192, 0xb000, 0x8000, 4096)
            ]
        );
        // A piece outside every export is a typed error, not a panic.
        let outside = remote(&[
            (0x2000_0000, 4096),
            (0x1000_0000, 4096),
            (0x1000_0000, 4096),
        ]);
        assert!(matches!(
            ipc_copies("p", Op::Read, &local, &outside, &plan, &mine, &theirs),
            Err(AgentError::UnknownRegion { .. })
        ));
    }
}
