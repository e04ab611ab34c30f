//! The machine model: NUMA nodes, PCI bridges, GPUs, RDMA NICs and GPU-GPU links, and the PCI
//! relationship of any two devices.

use std::fmt;

/// A PCI bridge: a host bridge (root complex) or a PCI-to-PCI bridge (a switch port).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Bridge {
    /// Whether it is a host bridge.
    pub host: bool,
    /// Parent bridge (index into [`Machine::bridges`]); `None` for host bridges.
    pub parent: Option<usize>,
    /// NUMA node the bridge hangs off, when known.
    pub numa: Option<u32>,
    /// Socket (package) it hangs off, when known.
    pub package: Option<u32>,
}

/// Where a PCI device sits.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PciPlace {
    /// PCI address, `dddd:bb:dd.f`.
    pub address: String,
    /// Its bridges, nearest first (the last is the host bridge).
    pub bridges: Vec<usize>,
    /// NUMA node, when known.
    pub numa: Option<u32>,
    /// Socket (package), when known.
    pub package: Option<u32>,
}

/// A GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Gpu {
    /// Index in PCI-bus order (CUDA's order with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, NVML's order).
    pub index: u32,
    /// Model name, when known.
    pub name: String,
    /// PCI place.
    pub pci: PciPlace,
}

/// An RDMA NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Nic {
    /// Verbs device name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// PCI place (`address` empty and no bridges for software devices such as rxe).
    pub pci: PciPlace,
}

/// A NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Numa {
    /// OS index.
    pub id: u32,
    /// Its CPUs (OS indexes).
    pub cpus: Vec<u32>,
    /// Socket (package), when known.
    pub package: Option<u32>,
}

/// A direct GPU-GPU link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuLink {
    /// NVLink with this many links.
    NvLink(u32),
    /// PCIe peer-to-peer (no NVLink).
    PciP2p,
}

/// How two PCI devices are connected, closest first (`nvidia-smi topo -m`'s legend).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Relation {
    /// The same device.
    Same,
    /// Through at most one PCIe switch (both under one switch).
    Pix,
    /// Through several PCIe bridges, without the host bridge.
    Pxb,
    /// Through one host bridge (root complex).
    Phb,
    /// Across host bridges within one NUMA node.
    Node,
    /// Across NUMA nodes or sockets (the SMP interconnect).
    Sys,
    /// Unknown (a device without PCI information, e.g. a software NIC).
    Unknown,
}

impl fmt::Display for Relation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Relation::Same => "X",
            Relation::Pix => "PIX",
            Relation::Pxb => "PXB",
            Relation::Phb => "PHB",
            Relation::Node => "NODE",
            Relation::Sys => "SYS",
            Relation::Unknown => "?",
        })
    }
}

/// The machine.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Machine {
    /// Host name, when known.
    pub host: String,
    /// NUMA nodes.
    pub numa: Vec<Numa>,
    /// PCI bridges.
    pub bridges: Vec<Bridge>,
    /// GPUs, by index.
    pub gpus: Vec<Gpu>,
    /// RDMA NICs.
    pub nics: Vec<Nic>,
    /// Direct GPU-GPU links `(a, b, link)` with `a < b` (from NVML).
    pub gpu_links: Vec<(u32, u32, GpuLink)>,
}

impl Machine {
    /// A model from sysfs only (NUMA nodes and RDMA NICs with their NUMA node; no PCI tree, so
    /// relations between devices are by NUMA node).
    pub fn from_sysfs(sys_root: &std::path::Path) -> Machine {
        Machine {
            numa: crate::sysfs::numa_nodes(sys_root)
                .into_iter()
                .map(|n| Numa {
                    id: n.id,
                    cpus: n.cpus,
                    package: None,
                })
                .collect(),
            nics: crate::sysfs::rdma_nics(sys_root)
                .into_iter()
                .map(|n| Nic {
                    name: n.name,
                    pci: PciPlace {
                        address: n.pci_address.unwrap_or_default(),
                        numa: n.numa_node,
                        ..PciPlace::default()
                    },
                })
                .collect(),
            ..Machine::default()
        }
    }

    /// The NIC named `name`.
    pub fn nic(&self, name: &str) -> Option<&Nic> {
        self.nics.iter().find(|n| n.name == name)
    }

    /// The GPU with index `i`.
    pub fn gpu(&self, i: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.index == i)
    }

    /// The direct link between two GPUs, if any.
    pub fn gpu_link(&self, a: u32, b: u32) -> Option<GpuLink> {
        let (a, b) = (a.min(b), a.max(b));
        self.gpu_links
            .iter()
            .find(|&&(x, y, _)| x == a && y == b)
            .map(|&(_, _, l)| l)
    }

    /// Records a GPU-GPU link (NVML's answer for a pair).
    pub fn add_gpu_link(&mut self, a: u32, b: u32, link: GpuLink) {
        let (a, b) = (a.min(b), a.max(b));
        self.gpu_links.retain(|&(x, y, _)| (x, y) != (a, b));
        self.gpu_links.push((a, b, link));
    }

    /// The PCI relationship of two devices.
    pub fn relation(&self, a: &PciPlace, b: &PciPlace) -> Relation {
        if a.address.is_empty() || b.address.is_empty() {
            return Relation::Unknown;
        }
        if a.address == b.address {
            return Relation::Same;
        }
        // The lowest common bridge.
        let common = a
            .bridges
            .iter()
            .enumerate()
            .find_map(|(i, br)| b.bridges.iter().position(|x| x == br).map(|j| (i, j, *br)));
        match common {
            Some((i, j, br)) => {
                if self.bridges.get(br).is_some_and(|x| x.host) {
                    Relation::Phb
                } else if i <= 1 && j <= 1 {
                    // Directly under the common bridge or under one of its (switch) ports.
                    Relation::Pix
                } else {
                    Relation::Pxb
                }
            }
            None => match (a.numa, b.numa) {
                (Some(x), Some(y)) if x == y => Relation::Node,
                (Some(_), Some(_)) => Relation::Sys,
                _ => match (a.package, b.package) {
                    (Some(x), Some(y)) if x == y => Relation::Node,
                    (Some(_), Some(_)) => Relation::Sys,
                    _ => Relation::Unknown,
                },
            },
        }
    }

    /// How a NIC relates to host memory on NUMA node `numa`: `Node` when they share the NUMA
    /// node (or the machine has only one, or locality is unknown on a one-node machine), `Sys`
    /// across nodes, `Unknown` when either side has no locality on a multi-node machine.
    pub fn numa_relation(&self, nic: &Nic, numa: Option<u32>) -> Relation {
        match (nic.pci.numa, numa) {
            (Some(a), Some(b)) if a == b => Relation::Node,
            (Some(_), Some(_)) => Relation::Sys,
            _ if self.numa.len() <= 1 => Relation::Node,
            _ => Relation::Unknown,
        }
    }
}
