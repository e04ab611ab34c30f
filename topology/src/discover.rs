//! This host's machine model: hwloc (PCI tree, NUMA, NICs, GPUs), sysfs (software RDMA devices)
//! and GPU-GPU links found by the caller (NVML, in `rixl-nvlink`), matched by PCI bus id. Each
//! part is optional.

use std::path::Path;

use crate::model::{GpuLink, Machine};

/// A link between two GPUs named by PCI bus id (as NVML reports them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciGpuLink {
    /// PCI bus id of one GPU (any common spelling: `00000000:12:00.0`, `0000:12:00.0`).
    pub from_pci: String,
    /// PCI bus id of the other.
    pub to_pci: String,
    /// The kind of link.
    pub link: GpuLink,
}

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

impl Machine {
    /// Adds `links` between GPUs of the model, matching them by PCI bus id; links naming a GPU
    /// the model does not have are skipped.
    pub fn add_pci_gpu_links(&mut self, links: &[PciGpuLink]) {
        let index_of = |pci: &str| {
            let bus = normalize_pci(pci);
            self.gpus
                .iter()
                .find(|g| g.pci.address == bus)
                .map(|g| g.index)
        };
        let found: Vec<(u32, u32, GpuLink)> = links
            .iter()
            .filter_map(|l| Some((index_of(&l.from_pci)?, index_of(&l.to_pci)?, l.link)))
            .collect();
        for (a, b, link) in found {
            self.add_gpu_link(a, b, link);
        }
    }
}

/// Discovers this machine and adds `gpu_links`. hwloc failing leaves a sysfs-only model (NUMA
/// nodes and NICs).
pub fn discover(gpu_links: &[PciGpuLink]) -> Machine {
    let sys = Path::new("/sys");
    let mut m = match crate::hwloc::live(sys) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "hwloc failed; using sysfs only");
            Machine::from_sysfs(sys)
        }
    };
    m.add_pci_gpu_links(gpu_links);
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

    #[test]
    fn links_to_unknown_gpus_are_skipped() {
        let mut m = Machine::from_sysfs(Path::new("/nonexistent"));
        m.add_pci_gpu_links(&[PciGpuLink {
            from_pci: "0000:12:00.0".into(),
            to_pci: "0000:13:00.0".into(),
            link: GpuLink::NvLink(1),
        }]);
        assert!(m.gpu_links.is_empty());
    }
}
