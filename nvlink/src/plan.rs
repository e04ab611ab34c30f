//! Same-node GPU transfers: whether a transfer with a peer takes CUDA IPC (same node, another
//! process, every remote piece in VRAM the peer exported, and the topology says the two GPUs are
//! peers), and the device copies it becomes. [`IpcPaths`] holds what is kept between transfers:
//! the machine model, one copy stream per local GPU and the peers' exports opened so far.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use rixl_gpudirect::Gpu;
use rixl_proto::desc::Cursor;
use rixl_proto::{LocalDesc, Op, RemoteDesc};
use rixl_topology::{Machine, MemoryLocation, Path, Place};

use crate::ipc::{CopyStream, DeviceCopy, DeviceRange, ImportedMemory, IpcError, IpcHandle};

/// A VRAM region a peer exported for CUDA IPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    /// The peer's region id.
    pub region: u64,
    /// Its device address in the peer's process.
    pub addr: u64,
    /// Its length.
    pub len: u64,
    /// The GPU it lives on (the peer's ordinal).
    pub gpu: u32,
    /// The handle to open it with.
    pub handle: IpcHandle,
}

impl Export {
    fn contains(&self, d: &RemoteDesc) -> bool {
        d.addr >= self.addr && d.addr.saturating_add(d.len) <= self.addr + self.len
    }
}

/// What a peer's metadata says about its GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerGpus {
    /// The peer's node (boot id and host name; empty: unknown).
    pub node: String,
    /// The peer's process id.
    pub process: u32,
    /// Its exported VRAM regions.
    pub exports: Vec<Export>,
}

/// A same-node GPU transfer's plan: the GPUs and the peer's exports its remote pieces use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcPlan {
    /// The local GPU.
    pub local_gpu: u32,
    /// The peer's GPU.
    pub remote_gpu: u32,
    /// The exports the remote pieces fall in (each once).
    pub exports: Vec<Export>,
}

/// Where a remote address lies in a plan's exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOffset {
    /// The export's region id.
    pub region: u64,
    /// Offset into the export.
    pub offset: u64,
}

impl IpcPlan {
    /// The export holding `addr`, and the offset into it.
    pub fn lookup(&self, addr: u64) -> Option<ExportOffset> {
        self.exports
            .iter()
            .find(|e| addr >= e.addr && addr < e.addr + e.len)
            .map(|e| ExportOffset {
                region: e.region,
                offset: addr - e.addr,
            })
    }
}

/// Why a same-node GPU transfer's copies could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CopyPlanError {
    /// A remote piece lies in no export of the plan, or a region has no memory to copy with.
    #[error("no exported or local region {region} for a piece of the transfer")]
    UnknownRegion {
        /// The region id (remote), or the index in the local list's regions.
        region: u64,
    },
    /// The local and remote pieces describe different totals.
    #[error("local pieces total {local} bytes but remote pieces total {remote}")]
    LengthMismatch {
        /// Local total.
        local: u64,
        /// Remote total.
        remote: u64,
    },
}

/// The pure part of the same-node check: `peer` is on `node` (known) in another process than
/// `process`, and every remote piece lies inside one exported region of a single GPU. The plan's
/// `local_gpu` is 0; [`IpcPaths::plan`] sets it.
pub fn plan_exports(
    node: &str,
    process: u32,
    peer: &PeerGpus,
    remote: &[RemoteDesc],
) -> Option<IpcPlan> {
    if node.is_empty() || peer.node != node || peer.process == process || peer.exports.is_empty() {
        return None;
    }
    let mut used: Vec<Export> = Vec::new();
    let mut gpu = None;
    for d in remote {
        let x = peer.exports.iter().find(|x| x.contains(d))?;
        if *gpu.get_or_insert(x.gpu) != x.gpu {
            return None;
        }
        if !used.iter().any(|e| e.region == x.region) {
            used.push(*x);
        }
    }
    Some(IpcPlan {
        local_gpu: 0,
        remote_gpu: gpu?,
        exports: used,
    })
}

/// The device copies of a same-node GPU transfer: the local and remote pieces walked side by
/// side (split where their boundaries differ), each a copy between local region `mine[i]` and
/// the peer's opened export `theirs[region]`, in `op`'s direction. Pieces that continue the
/// previous copy on both sides (consecutive KV blocks) extend it instead of adding one.
///
/// # Errors
/// [`CopyPlanError::UnknownRegion`] for a piece outside the plan's exports or a missing region,
/// [`CopyPlanError::LengthMismatch`] if the lists' totals differ.
pub fn copies(
    op: Op,
    local: &[LocalDesc],
    remote: &[RemoteDesc],
    plan: &IpcPlan,
    mine: &[Arc<dyn DeviceRange>],
    theirs: &HashMap<u64, Arc<dyn DeviceRange>>,
) -> Result<Vec<DeviceCopy>, CopyPlanError> {
    let total = |it: &mut dyn Iterator<Item = u64>| it.fold(0u64, u64::saturating_add);
    let (lt, rt) = (
        total(&mut local.iter().map(|d| d.len)),
        total(&mut remote.iter().map(|d| d.len)),
    );
    if lt != rt {
        return Err(CopyPlanError::LengthMismatch {
            local: lt,
            remote: rt,
        });
    }
    let mut out: Vec<DeviceCopy> = Vec::new();
    // (local region index, remote region id) of the last copy.
    let mut last: Option<(u32, u64)> = None;
    let (mut lc, mut rc) = (Cursor::default(), Cursor::default());
    while lc.index < local.len() && rc.index < remote.len() {
        let (l, r) = (local[lc.index], remote[rc.index]);
        let n = (l.len - lc.offset).min(r.len - rc.offset);
        let at = plan
            .lookup(r.addr + rc.offset)
            .ok_or(CopyPlanError::UnknownRegion { region: 0 })?;
        let (mine_off, their_off) = ((l.offset + lc.offset) as usize, at.offset as usize);
        let (dst_offset, src_offset) = match op {
            Op::Write => (their_off, mine_off),
            Op::Read => (mine_off, their_off),
        };
        let extends = out.last().is_some_and(|c| {
            last == Some((l.region, at.region))
                && c.dst_offset + c.len == dst_offset
                && c.src_offset + c.len == src_offset
        });
        if extends {
            if let Some(c) = out.last_mut() {
                c.len += n as usize;
            }
        } else {
            let m = Arc::clone(mine.get(l.region as usize).ok_or(
                CopyPlanError::UnknownRegion {
                    region: u64::from(l.region),
                },
            )?);
            let t = Arc::clone(
                theirs
                    .get(&at.region)
                    .ok_or(CopyPlanError::UnknownRegion { region: at.region })?,
            );
            let (dst, src) = match op {
                Op::Write => (t, m),
                Op::Read => (m, t),
            };
            out.push(DeviceCopy {
                dst,
                dst_offset,
                src,
                src_offset,
                len: n as usize,
            });
            last = Some((l.region, at.region));
        }
        lc.advance(n, l.len);
        rc.advance(n, r.len);
    }
    Ok(out)
}

/// A peer's export opened in this process.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ImportKey {
    peer: String,
    region: u64,
}

/// This process's CUDA-IPC path: the planner (with the machine model, discovered on first
/// need) and the caches of copy streams and opened exports. `Send + Sync`; its locks are taken
/// only on the same-node GPU path.
#[derive(Debug)]
pub struct IpcPaths {
    node: String,
    process: u32,
    machine: OnceLock<Machine>,
    streams: Mutex<HashMap<u32, Arc<CopyStream>>>,
    imported: Mutex<HashMap<ImportKey, Arc<ImportedMemory>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl IpcPaths {
    /// The path of this process (`process`) on `node`.
    pub fn new(node: String, process: u32) -> Self {
        IpcPaths {
            node,
            process,
            machine: OnceLock::new(),
            streams: Mutex::new(HashMap::new()),
            imported: Mutex::new(HashMap::new()),
        }
    }

    /// The plan of a transfer between local GPU `local_gpu` and `remote` in `peer`'s memory, if
    /// it takes CUDA IPC: [`plan_exports`] holds, and the topology's path choice says CUDA IPC
    /// for the two GPUs (NVLink or P2P, or the same GPU).
    pub fn plan(&self, local_gpu: u32, peer: &PeerGpus, remote: &[RemoteDesc]) -> Option<IpcPlan> {
        let plan = plan_exports(&self.node, self.process, peer, remote)?;
        let machine = self.machine.get_or_init(crate::discover_machine);
        let place = |process, index| Place {
            node: self.node.clone(),
            process,
            memory: MemoryLocation::Gpu { index },
        };
        match machine.choose_path(
            &place(self.process, local_gpu),
            &place(peer.process, plan.remote_gpu),
        ) {
            Path::CudaIpc { .. } => Some(IpcPlan { local_gpu, ..plan }),
            _ => None,
        }
    }

    /// The copy stream of local GPU `gpu`, made on first use.
    ///
    /// # Errors
    /// [`IpcError`] if the GPU cannot be opened or the stream created.
    pub fn stream(&self, gpu: u32) -> Result<Arc<CopyStream>, IpcError> {
        let mut streams = lock(&self.streams);
        if let Some(s) = streams.get(&gpu) {
            return Ok(Arc::clone(s));
        }
        let g = Gpu::open(gpu as i32).map_err(IpcError::from)?;
        let s = Arc::new(CopyStream::new(&g)?);
        streams.insert(gpu, Arc::clone(&s));
        Ok(s)
    }

    /// `peer`'s export opened in `gpu`'s context, once per peer and region.
    ///
    /// # Errors
    /// [`IpcError::Driver`] for a stale or foreign handle.
    pub fn import(
        &self,
        peer: &str,
        export: &Export,
        gpu: &Arc<Gpu>,
    ) -> Result<Arc<ImportedMemory>, IpcError> {
        let key = ImportKey {
            peer: peer.to_string(),
            region: export.region,
        };
        if let Some(m) = lock(&self.imported).get(&key) {
            return Ok(Arc::clone(m));
        }
        let m = Arc::new(ImportedMemory::open(
            gpu,
            &export.handle,
            export.len as usize,
        )?);
        lock(&self.imported).insert(key, Arc::clone(&m));
        Ok(m)
    }

    /// Forgets `peer`'s opened exports (it left or re-joined); copies in flight keep theirs.
    pub fn forget_peer(&self, peer: &str) {
        lock(&self.imported).retain(|k, _| k.peer != peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(region: u64, addr: u64, gpu: u32) -> Export {
        Export {
            region,
            addr,
            len: 1 << 20,
            gpu,
            handle: IpcHandle([region as u8; 64]),
        }
    }

    fn peer(node: &str, process: u32) -> PeerGpus {
        PeerGpus {
            node: node.into(),
            process,
            exports: vec![export(1, 0x1000_0000, 0), export(3, 0x3000_0000, 1)],
        }
    }

    fn remote(pieces: &[(u64, u64)]) -> Vec<RemoteDesc> {
        pieces
            .iter()
            .map(|&(addr, len)| RemoteDesc { addr, len, rkey: 1 })
            .collect()
    }

    #[test]
    fn same_node_other_process_exported_vram_takes_cuda_ipc() {
        let r = remote(&[(0x1000_0000, 4096), (0x1000_8000, 4096)]);
        let plan = plan_exports("boot/a", 10, &peer("boot/a", 11), &r).expect("IPC");
        assert_eq!(plan.remote_gpu, 0);
        assert_eq!(plan.exports.len(), 1);
        assert_eq!(
            plan.lookup(0x1000_8000),
            Some(ExportOffset {
                region: 1,
                offset: 0x8000
            })
        );
        assert_eq!(plan.lookup(0x2000_0000), None);
    }

    #[test]
    fn anything_else_stays_on_rdma() {
        let r = remote(&[(0x1000_0000, 4096)]);
        assert!(
            plan_exports("boot/a", 10, &peer("boot/b", 11), &r).is_none(),
            "other node"
        );
        assert!(
            plan_exports("boot/a", 10, &peer("boot/a", 10), &r).is_none(),
            "same process"
        );
        assert!(
            plan_exports("", 10, &peer("", 11), &r).is_none(),
            "unknown node"
        );
        let dram = remote(&[(0x2000_0000, 4096)]);
        assert!(
            plan_exports("boot/a", 10, &peer("boot/a", 11), &dram).is_none(),
            "not exported"
        );
        let two_gpus = remote(&[(0x1000_0000, 4096), (0x3000_0000, 4096)]);
        assert!(
            plan_exports("boot/a", 10, &peer("boot/a", 11), &two_gpus).is_none(),
            "two GPUs"
        );
        let past = remote(&[(0x1000_0000 + (1 << 20) - 10, 4096)]);
        assert!(
            plan_exports("boot/a", 10, &peer("boot/a", 11), &past).is_none(),
            "outside"
        );
    }

    #[derive(Debug)]
    struct Fake(u64);
    impl DeviceRange for Fake {
        fn device_addr(&self) -> u64 {
            self.0
        }
        fn device_len(&self) -> usize {
            1 << 20
        }
    }

    fn ld(offset: u64, len: u64) -> LocalDesc {
        LocalDesc {
            region: 0,
            offset,
            len,
        }
    }

    #[test]
    fn copies_merge_blocks_that_continue_on_both_sides_and_follow_the_direction() {
        // Blocks 0,1 continue each other on both sides; block 2 goes back (reversed order).
        let local = [ld(0, 4096), ld(4096, 4096), ld(8192, 4096)];
        let r = remote(&[
            (0x1000_0000, 4096),
            (0x1000_1000, 4096),
            (0x1000_0000 + 0x8000, 4096),
        ]);
        let plan = plan_exports("n", 1, &peer("n", 2), &r).expect("IPC");
        let mine: Vec<Arc<dyn DeviceRange>> = vec![Arc::new(Fake(0xa000))];
        let theirs: HashMap<u64, Arc<dyn DeviceRange>> =
            HashMap::from([(1, Arc::new(Fake(0xb000)) as _)]);
        let got = |op| {
            copies(op, &local, &r, &plan, &mine, &theirs)
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
    }

    #[test]
    fn pieces_of_different_boundaries_are_split_to_match() {
        // One local piece of 8 KiB against two remote pieces far apart.
        let local = [ld(0, 8192)];
        let r = remote(&[(0x1000_0000, 4096), (0x1000_8000, 4096)]);
        let plan = plan_exports("n", 1, &peer("n", 2), &r).expect("IPC");
        let mine: Vec<Arc<dyn DeviceRange>> = vec![Arc::new(Fake(0xa000))];
        let theirs: HashMap<u64, Arc<dyn DeviceRange>> =
            HashMap::from([(1, Arc::new(Fake(0xb000)) as _)]);
        let c = copies(Op::Write, &local, &r, &plan, &mine, &theirs).expect("copies");
        let got: Vec<_> = c
            .iter()
            .map(|c| (c.dst_offset, c.src_offset, c.len))
            .collect();
        assert_eq!(got, [(0, 0, 4096), (0x8000, 4096, 4096)]);
    }

    #[test]
    fn bad_pieces_are_typed_errors_not_panics() {
        let local = [ld(0, 4096), ld(4096, 4096), ld(8192, 4096)];
        let r = remote(&[(0x1000_0000, 4096)]);
        let plan = plan_exports("n", 1, &peer("n", 2), &r).expect("IPC");
        let mine: Vec<Arc<dyn DeviceRange>> = vec![Arc::new(Fake(0xa000))];
        let theirs: HashMap<u64, Arc<dyn DeviceRange>> =
            HashMap::from([(1, Arc::new(Fake(0xb000)) as _)]);
        let outside = remote(&[
            (0x2000_0000, 4096),
            (0x1000_0000, 4096),
            (0x1000_0000, 4096),
        ]);
        assert!(matches!(
            copies(Op::Read, &local, &outside, &plan, &mine, &theirs),
            Err(CopyPlanError::UnknownRegion { .. })
        ));
        assert_eq!(
            copies(Op::Read, &local, &r, &plan, &mine, &theirs).unwrap_err(),
            CopyPlanError::LengthMismatch {
                local: 12288,
                remote: 4096
            }
        );
    }
}
