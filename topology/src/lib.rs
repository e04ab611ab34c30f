//! `rixl-topology`: the machine model rixl chooses paths from.
//!
//! - [`Machine`]: NUMA nodes, PCI bridges, GPUs, RDMA NICs and GPU-GPU links, read from hwloc
//!   ([`hwloc::live`], or [`hwloc::from_xml_file`] for other machines' exports) plus sysfs for
//!   software RDMA devices; GPU links found by NVML are added by PCI bus id ([`discover`],
//!   [`Machine::add_pci_gpu_links`]).
//! - [`Machine::relation`]: the PCI relationship of two devices (`nvidia-smi topo -m`'s legend).
//! - [`Machine::choose_path`]: local copy, CUDA IPC, GPUDirect RDMA or host-staged RDMA, as a
//!   pure function of the model and the two endpoints; [`Machine::rails`] and [`stripe`] for
//!   multi-rail striping.
//! - [`Machine::nic_choice`]: the NICs memory is bound to (nearest, equally near only), and
//!   [`Machine::agent_nics`]: the NICs an agent opens.
//!
//! Anything missing (no hwloc I/O discovery, no GPU, no NIC) gives a smaller model, never a panic.
#![forbid(unsafe_code)]

mod choice;
mod discover;
pub mod hwloc;
mod model;
mod path;
mod sysfs;

pub use choice::{reaches_directly, NicChoice};
pub use discover::{discover, normalize_pci, PciGpuLink};
pub use hwloc::TopologyError;
pub use model::{Bridge, Gpu, GpuLink, Machine, Nic, Numa, PciPlace, Relation};
pub use path::{stripe, MemoryLocation, Path, Place, Rail, Slice, GDR_MAX_RELATION};
pub use sysfs::{numa_nodes, parse_cpu_list, rdma_nics, NumaNode, RdmaNic};
