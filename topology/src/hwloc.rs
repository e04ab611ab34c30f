//! Building the [`Machine`] from hwloc (through `hwlocality`): the live machine, or an XML
//! export of another one (`lstopo --of xml --whole-io`).

use std::collections::HashMap;
use std::path::Path;

use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::{BridgeType, OSDeviceType, ObjectType};
use hwlocality::object::TopologyObject;
use hwlocality::topology::builder::TypeFilter;
use hwlocality::Topology;

use crate::model::{Bridge, Gpu, Machine, Nic, Numa, PciPlace};

/// Why a topology could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// hwloc failed (bad XML, unreadable file, ...).
    #[error("hwloc: {0}")]
    Hwloc(String),
}

fn hw<E: std::fmt::Display>(e: E) -> TopologyError {
    TopologyError::Hwloc(e.to_string())
}

/// Reads the machine this process runs on (hwloc with PCI and OS devices), adding RDMA devices
/// that only sysfs knows (software NICs such as rxe).
///
/// # Errors
/// [`TopologyError::Hwloc`] if hwloc cannot build the topology.
pub fn live(sys_root: &Path) -> Result<Machine, TopologyError> {
    let topo = Topology::builder()
        .with_io_type_filter(TypeFilter::KeepAll)
        .map_err(hw)?
        .build()
        .map_err(hw)?;
    let mut m = from_topology(&topo);
    for n in crate::sysfs::rdma_nics(sys_root) {
        if m.nic(&n.name).is_none() {
            m.nics.push(Nic {
                name: n.name,
                pci: PciPlace {
                    address: n.pci_address.unwrap_or_default(),
                    numa: n.numa_node,
                    ..PciPlace::default()
                },
            });
        }
    }
    Ok(m)
}

/// Reads a machine from an hwloc XML export.
///
/// # Errors
/// [`TopologyError::Hwloc`] for a missing or malformed file.
pub fn from_xml_file(path: &Path) -> Result<Machine, TopologyError> {
    // Read it here: hwlocality 1.0.0-alpha.13 panics (unreachable!) when hwloc cannot open it.
    let xml = std::fs::read_to_string(path)
        .map_err(|e| TopologyError::Hwloc(format!("{}: {e}", path.display())))?;
    from_xml(&xml)
}

/// Reads a machine from hwloc XML text.
///
/// # Errors
/// [`TopologyError::Hwloc`] for malformed XML.
pub fn from_xml(xml: &str) -> Result<Machine, TopologyError> {
    let topo = Topology::builder()
        .from_xml(xml)
        .map_err(hw)?
        .with_io_type_filter(TypeFilter::KeepAll)
        .map_err(hw)?
        .build()
        .map_err(hw)?;
    Ok(from_topology(&topo))
}

fn text(c: Option<&std::ffi::CStr>) -> Option<String> {
    c.map(|s| s.to_string_lossy().into_owned())
}

/// The NUMA node and package an I/O object hangs off.
fn locality(obj: &TopologyObject) -> (Option<u32>, Option<u32>) {
    let Some(anchor) = obj.first_non_io_ancestor() else {
        return (None, None);
    };
    let numa = anchor.nodeset().and_then(|ns| {
        let mut it = ns.iter_set();
        match (it.next(), it.next()) {
            (Some(n), None) => u32::try_from(usize::from(n)).ok(),
            _ => None,
        }
    });
    let package = if anchor.object_type() == ObjectType::Package {
        Some(anchor)
    } else {
        anchor.first_ancestor_with_type(ObjectType::Package)
    }
    .and_then(|p| p.os_index())
    .and_then(|i| u32::try_from(i).ok());
    (numa, package)
}

fn pci_address(obj: &TopologyObject) -> Option<String> {
    match obj.attributes()? {
        ObjectAttributes::PCIDevice(p) => Some(format!(
            "{:04x}:{:02x}:{:02x}.{:x}",
            p.domain(),
            p.bus_id(),
            p.bus_device(),
            p.function()
        )),
        _ => None,
    }
}

/// Converts an hwloc topology into the model.
pub fn from_topology(topo: &Topology) -> Machine {
    let mut m = Machine {
        host: text(topo.root_object().info("HostName")).unwrap_or_default(),
        ..Machine::default()
    };
    for n in topo.objects_with_type(ObjectType::NUMANode) {
        let Some(id) = n.os_index().and_then(|i| u32::try_from(i).ok()) else {
            continue;
        };
        let cpus = n
            .cpuset()
            .map(|cs| {
                cs.iter_set()
                    .filter_map(|c| u32::try_from(usize::from(c)).ok())
                    .collect()
            })
            .unwrap_or_default();
        let package = n
            .first_ancestor_with_type(ObjectType::Package)
            .and_then(|p| p.os_index())
            .and_then(|i| u32::try_from(i).ok());
        m.numa.push(Numa { id, cpus, package });
    }
    // Bridges, indexed by hwloc's persistent index.
    let mut index = HashMap::new();
    for b in topo.bridges() {
        index.insert(b.global_persistent_index(), m.bridges.len());
        let host = matches!(
            b.attributes(),
            Some(ObjectAttributes::Bridge(a)) if a.upstream_type() == BridgeType::Host
        );
        let (numa, package) = locality(b);
        m.bridges.push(Bridge {
            host,
            parent: None,
            numa,
            package,
        });
    }
    for b in topo.bridges() {
        let parent = b
            .parent()
            .filter(|p| p.object_type() == ObjectType::Bridge)
            .and_then(|p| index.get(&p.global_persistent_index()).copied());
        if let Some(&i) = index.get(&b.global_persistent_index()) {
            m.bridges[i].parent = parent;
        }
    }
    let mut gpus = Vec::new();
    for dev in topo.pci_devices() {
        let Some(ObjectAttributes::PCIDevice(attr)) = dev.attributes() else {
            continue;
        };
        let Some(address) = pci_address(dev) else {
            continue;
        };
        let bridges: Vec<usize> = dev
            .ancestors()
            .take_while(|a| a.object_type() == ObjectType::Bridge)
            .filter_map(|a| index.get(&a.global_persistent_index()).copied())
            .collect();
        let (numa, package) = locality(dev);
        let place = PciPlace {
            address,
            bridges,
            numa,
            package,
        };
        let osdevs: Vec<(&TopologyObject, OSDeviceType)> = dev
            .io_children()
            .filter_map(|c| match c.attributes() {
                Some(ObjectAttributes::OSDevice(o)) => Some((c, o.device_type())),
                _ => None,
            })
            .collect();
        for (o, ty) in &osdevs {
            if *ty == OSDeviceType::OpenFabrics {
                if let Some(name) = text(o.name()) {
                    m.nics.push(Nic {
                        name,
                        pci: place.clone(),
                    });
                }
            }
        }
        // NVIDIA display or 3D controllers (class 03xx) are GPUs.
        if attr.vendor_id() == 0x10de && attr.class_id() >> 8 == 0x03 {
            let name = osdevs
                .iter()
                .find_map(|(o, _)| text(o.info("GPUModel")))
                .or_else(|| text(dev.info("PCIDevice")))
                .unwrap_or_else(|| "NVIDIA GPU".into());
            gpus.push((place, name));
        }
    }
    gpus.sort_by(|a, b| a.0.address.cmp(&b.0.address));
    m.gpus = gpus
        .into_iter()
        .enumerate()
        .map(|(i, (pci, name))| Gpu {
            index: u32::try_from(i).unwrap_or(u32::MAX),
            name,
            pci,
        })
        .collect();
    m.nics.sort_by(|a, b| a.name.cmp(&b.name));
    m
}
