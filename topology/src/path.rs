//! Path choice: a pure function of the machine model and the two endpoints' memory locations,
//! and per-location NIC preference lists (rails) for striping large transfers.

use crate::model::{GpuLink, Machine, Relation};

/// What memory a transfer endpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryLocation {
    /// Host DRAM on a NUMA node (`None`: unknown).
    Host {
        /// NUMA node.
        numa: Option<u32>,
    },
    /// Memory of GPU `index`.
    Gpu {
        /// GPU index (PCI-bus order).
        index: u32,
    },
}

/// Where a transfer endpoint lives.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Place {
    /// The machine (host name or any cluster-unique node id).
    pub node: String,
    /// The process.
    pub process: u32,
    /// The memory.
    pub memory: MemoryLocation,
}

/// The physical path rixl uses for a transfer, from the local endpoint's side.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Path {
    /// Same process and same device: a local copy (memcpy or cuMemcpy).
    LocalCopy,
    /// Same node, GPUs connected by NVLink or PCIe P2P (or the same GPU in another process):
    /// CUDA IPC with a device-to-device copy.
    CudaIpc {
        /// Local GPU.
        local: u32,
        /// Remote GPU.
        remote: u32,
        /// The link (`None`: the same GPU).
        link: Option<GpuLink>,
    },
    /// GPU memory registered directly with a NIC that shares its PCIe switch (GPUDirect RDMA).
    GpuDirectRdma {
        /// The NIC.
        nic: String,
        /// The GPU.
        gpu: u32,
        /// Their PCI relation ([`Relation::Pix`] or [`Relation::Pxb`]).
        relation: Relation,
    },
    /// RDMA through pinned host memory on the NIC nearest the memory (GPU memory is staged
    /// through a pinned host bounce buffer first).
    HostRdma {
        /// The NIC.
        nic: String,
        /// The GPU staged through host memory, if the memory is on a GPU.
        staged_gpu: Option<u32>,
    },
    /// No path: the endpoints are on different nodes and this machine has no RDMA NIC.
    None {
        /// Why.
        reason: String,
    },
}

/// A NIC in a preference list, with its relation to the memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rail {
    /// NIC name.
    pub nic: String,
    /// Relation to the memory.
    pub relation: Relation,
}

/// One slice of a striped transfer: `len` bytes at `offset` go over rail `rail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    /// Index into the rail list given to [`stripe`].
    pub rail: usize,
    /// Offset in the transfer.
    pub offset: u64,
    /// Length.
    pub len: u64,
}

/// GPUDirect RDMA is used when the NIC is at most this far from the GPU: within the GPU's NUMA
/// node. Across sockets (the SMP interconnect) peer-to-peer reads are slow on most CPUs, and the
/// memory is staged through pinned host memory instead.
pub const GDR_MAX_RELATION: Relation = Relation::Node;

impl Machine {
    /// Every NIC ordered by nearness to `memory`. Equally near NICs are rotated by the GPU's
    /// index, so GPUs sharing a switch prefer different NICs first.
    pub fn rails(&self, memory: MemoryLocation) -> Vec<Rail> {
        let mut rails: Vec<Rail> = self
            .nics
            .iter()
            .map(|n| Rail {
                nic: n.name.clone(),
                relation: match memory {
                    MemoryLocation::Host { numa } => self.numa_relation(n, numa),
                    MemoryLocation::Gpu { index } => self
                        .gpu(index)
                        .map_or(Relation::Unknown, |g| self.relation(&g.pci, &n.pci)),
                },
            })
            .collect();
        rails.sort_by(|a, b| a.relation.cmp(&b.relation).then_with(|| a.nic.cmp(&b.nic)));
        if let MemoryLocation::Gpu { index } = memory {
            let mut start = 0;
            while start < rails.len() {
                let rel = rails[start].relation;
                let end = start
                    + rails[start..]
                        .iter()
                        .take_while(|r| r.relation == rel)
                        .count();
                let n = end - start;
                rails[start..end].rotate_left(index as usize % n);
                start = end;
            }
        }
        rails
    }

    /// The equally nearest NICs for `memory` (the rails a large transfer is striped over).
    pub fn best_rails(&self, memory: MemoryLocation) -> Vec<Rail> {
        let all = self.rails(memory);
        let Some(best) = all.first().map(|r| r.relation) else {
            return all;
        };
        all.into_iter().filter(|r| r.relation == best).collect()
    }

    /// Chooses the path for a transfer between `local` (this side) and `remote`.
    pub fn choose_path(&self, local: &Place, remote: &Place) -> Path {
        let same_node = local.node == remote.node;
        if same_node {
            let same_process = local.process == remote.process;
            match (local.memory, remote.memory) {
                (MemoryLocation::Host { .. }, MemoryLocation::Host { .. }) if same_process => {
                    return Path::LocalCopy
                }
                (MemoryLocation::Gpu { index: a }, MemoryLocation::Gpu { index: b }) => {
                    if a == b && same_process {
                        return Path::LocalCopy;
                    }
                    if a == b {
                        return Path::CudaIpc {
                            local: a,
                            remote: b,
                            link: None,
                        };
                    }
                    if let Some(link) = self.gpu_link(a, b) {
                        return Path::CudaIpc {
                            local: a,
                            remote: b,
                            link: Some(link),
                        };
                    }
                }
                _ => {}
            }
        }
        let rails = self.rails(local.memory);
        let Some(first) = rails.first() else {
            return Path::None {
                reason: if same_node {
                    "no RDMA NIC for a transfer between processes without a GPU peer link".into()
                } else {
                    "no RDMA NIC on this machine".into()
                },
            };
        };
        match local.memory {
            MemoryLocation::Gpu { index } if first.relation <= GDR_MAX_RELATION => {
                Path::GpuDirectRdma {
                    nic: first.nic.clone(),
                    gpu: index,
                    relation: first.relation,
                }
            }
            MemoryLocation::Gpu { index } => {
                // Staged through host memory on the GPU's NUMA node.
                let numa = self.gpu(index).and_then(|g| g.pci.numa);
                let host = self.rails(MemoryLocation::Host { numa });
                Path::HostRdma {
                    nic: host
                        .first()
                        .map_or_else(|| first.nic.clone(), |r| r.nic.clone()),
                    staged_gpu: Some(index),
                }
            }
            MemoryLocation::Host { .. } => Path::HostRdma {
                nic: first.nic.clone(),
                staged_gpu: None,
            },
        }
    }
}

/// Splits `len` bytes into slices of at most `slice` bytes dealt round-robin over `rails`
/// rails (multi-rail striping). One rail, or a transfer no larger than a slice, is one slice.
pub fn stripe(len: u64, rails: usize, slice: u64) -> Vec<Slice> {
    if len == 0 || rails == 0 {
        return Vec::new();
    }
    let slice = slice.max(1);
    if rails == 1 || len <= slice {
        return vec![Slice {
            rail: 0,
            offset: 0,
            len,
        }];
    }
    let mut out = Vec::with_capacity(len.div_ceil(slice) as usize);
    let mut off = 0;
    let mut i = 0;
    while off < len {
        let n = slice.min(len - off);
        out.push(Slice {
            rail: i % rails,
            offset: off,
            len: n,
        });
        off += n;
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_cover_every_byte_once_round_robin() {
        let s = stripe(10 << 20, 4, 1 << 20);
        assert_eq!(s.len(), 10);
        assert_eq!(s.iter().map(|x| x.len).sum::<u64>(), 10 << 20);
        for (i, x) in s.iter().enumerate() {
            assert_eq!(x.rail, i % 4);
            assert_eq!(x.offset, (i as u64) << 20);
        }
        let odd = stripe((3 << 20) + 5, 2, 1 << 20);
        assert_eq!(odd.last().map(|x| x.len), Some(5));
        assert_eq!(stripe(100, 4, 1 << 20).len(), 1);
        assert_eq!(stripe(5 << 20, 1, 1 << 20).len(), 1);
        assert!(stripe(0, 4, 1).is_empty());
        assert!(stripe(10, 0, 1).is_empty());
    }
}
