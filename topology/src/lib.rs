//! `rixl-topology`: the machine model rixl chooses paths from.
//!
//! First piece: RDMA NICs and NUMA nodes read from sysfs (`/sys/class/infiniband`,
//! `/sys/devices/system/node`). Every reader takes the sysfs root so fixtures can stand in for
//! other machines; anything missing degrades to a smaller model, never a panic.
#![forbid(unsafe_code)]

mod sysfs;

pub use sysfs::{numa_nodes, parse_cpu_list, rdma_nics, NumaNode, RdmaNic};
