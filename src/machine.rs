//! The machine model of this host: hwloc (PCI tree, NUMA, NICs, GPUs), sysfs (software RDMA
//! devices) and NVML (GPU-GPU NVLink/P2P links), each optional.

use std::path::Path;

use crate::topology::{GpuLink, Machine};

/// Normalises a PCI bus id (`00000000:12:00.0` from NVML) to `0000:12:00.0`.
pub fn normalize_pci(bus: &str) -> String {
    let b = bus.trim().to_ascii_lowercase();
    match b.rsplit_once(':') {
        Some((head, tail)) => {
            let (dom, bus) = head.rsplit_once(':').unwrap_or(("0", head));
            let dom = dom.trim_start_matches('0');
            format!(
                "{:0>4}:{bus}:{tail}",
                if dom.is_empty() { "0" } else { dom }
            )
        }
        None => b,
    }
}

/// Adds NVML's links to `m`, matching GPUs by PCI bus id.
pub fn add_nvml_links(m: &mut Machine, nvml: &crate::nvlink::NvmlInfo) {
    let index_of = |nvml_index: u32| {
        let bus = nvml
            .gpus
            .iter()
            .find(|g| g.0 == nvml_index)
            .map(|g| normalize_pci(&g.2))?;
        m.gpus
            .iter()
            .find(|g| g.pci.address == bus)
            .map(|g| g.index)
    };
    let mut found = Vec::new();
    for l in &nvml.links {
        let (Some(a), Some(b)) = (index_of(l.from), index_of(l.to)) else {
            continue;
        };
        if l.nvlink {
            found.push((a, b, GpuLink::NvLink(1)));
        } else if l.p2p_read {
            found.push((a, b, GpuLink::PciP2p));
        }
    }
    for (a, b, link) in found {
        m.add_gpu_link(a, b, link);
    }
}

/// Discovers this machine. hwloc failing leaves a sysfs-only model (NUMA nodes and NICs);
/// no NVML leaves GPU links empty.
pub fn discover() -> Machine {
    let sys = Path::new("/sys");
    let mut m = match crate::topology::hwloc::live(sys) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "hwloc failed; using sysfs only");
            crate::topology::Machine::from_sysfs(sys)
        }
    };
    if let Ok(nvml) = crate::nvlink::probe() {
        add_nvml_links(&mut m, &nvml);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_ids_normalise() {
        assert_eq!(normalize_pci("00000000:12:00.0"), "0000:12:00.0");
        assert_eq!(normalize_pci("0000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_pci("00000001:12:00.1"), "0001:12:00.1");
    }
}
