//! sysfs readers.

use std::fs;
use std::path::Path;

/// An RDMA NIC (`/sys/class/infiniband/<name>`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RdmaNic {
    /// Device name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// PCI address (`0000:3b:00.0`); `None` for software devices such as rxe.
    pub pci_address: Option<String>,
    /// NUMA node of the PCI device; `None` when unknown (sysfs reports -1).
    pub numa_node: Option<u32>,
    /// Network interfaces bound to it (RoCE), from the ports' `gid_attrs/ndevs`.
    pub netdevs: Vec<String>,
    /// Number of ports.
    pub ports: u32,
}

/// A NUMA node and its CPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NumaNode {
    /// Node id.
    pub id: u32,
    /// CPUs of the node.
    pub cpus: Vec<u32>,
}

fn read_trim(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// Lists the RDMA NICs under `sys_root` (normally `/sys`). No RDMA support means an empty list.
pub fn rdma_nics(sys_root: &Path) -> Vec<RdmaNic> {
    let class = sys_root.join("class/infiniband");
    let Ok(entries) = fs::read_dir(&class) else {
        return Vec::new();
    };
    let mut nics: Vec<RdmaNic> = entries
        .flatten()
        .map(|e| {
            let dir = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            // `device` links to the PCI function for hardware NICs; rxe has none.
            let pci_address = fs::canonicalize(dir.join("device"))
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .filter(|n| n.contains(':'));
            let numa_node = read_trim(&dir.join("device/numa_node"))
                .and_then(|v| v.parse::<i64>().ok())
                .and_then(|v| u32::try_from(v).ok());
            let mut netdevs = Vec::new();
            let mut ports = 0;
            if let Ok(ps) = fs::read_dir(dir.join("ports")) {
                for p in ps.flatten() {
                    ports += 1;
                    if let Ok(ndevs) = fs::read_dir(p.path().join("gid_attrs/ndevs")) {
                        for g in ndevs.flatten() {
                            if let Some(nd) = read_trim(&g.path()).filter(|s| !s.is_empty()) {
                                if !netdevs.contains(&nd) {
                                    netdevs.push(nd);
                                }
                            }
                        }
                    }
                }
            }
            RdmaNic {
                name,
                pci_address,
                numa_node,
                netdevs,
                ports,
            }
        })
        .collect();
    nics.sort_by(|a, b| a.name.cmp(&b.name));
    nics
}

/// Parses a Linux CPU list (`0-3,8,10-11`). Malformed parts are skipped.
pub fn parse_cpu_list(s: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    if a <= b && b - a < 1 << 16 {
                        out.extend(a..=b);
                    }
                }
            }
            None => out.extend(part.parse::<u32>().ok()),
        }
    }
    out
}

/// Lists NUMA nodes under `sys_root`; a machine without NUMA information is one node 0 holding
/// the online CPUs.
pub fn numa_nodes(sys_root: &Path) -> Vec<NumaNode> {
    let mut nodes: Vec<NumaNode> = fs::read_dir(sys_root.join("devices/system/node"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let id = name.strip_prefix("node")?.parse().ok()?;
            let cpus = read_trim(&e.path().join("cpulist"))
                .map(|s| parse_cpu_list(&s))
                .unwrap_or_default();
            Some(NumaNode { id, cpus })
        })
        .collect();
    if nodes.is_empty() {
        let cpus = read_trim(&sys_root.join("devices/system/cpu/online"))
            .map(|s| parse_cpu_list(&s))
            .unwrap_or_default();
        nodes.push(NumaNode { id: 0, cpus });
    }
    nodes.sort_by_key(|n| n.id);
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("rixl-topo-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).expect("fixture root");
        root
    }

    fn write(root: &Path, rel: &str, content: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        fs::write(p, content).expect("write");
    }

    #[test]
    fn cpu_lists_parse_ranges_and_singletons() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(""), Vec::<u32>::new());
        assert_eq!(parse_cpu_list("5-2,x,7"), vec![7]);
    }

    #[test]
    fn two_socket_box_with_a_pci_nic_and_rxe() {
        let root = fixture("2s");
        write(&root, "devices/system/node/node0/cpulist", "0-15,32-47");
        write(&root, "devices/system/node/node1/cpulist", "16-31,48-63");
        // mlx5_1 on a PCI function of node 1, with a RoCE netdev.
        let pci = root.join("devices/pci0000:80/0000:81:00.0");
        write(&root, "devices/pci0000:80/0000:81:00.0/numa_node", "1\n");
        write(
            &root,
            "class/infiniband/mlx5_1/ports/1/gid_attrs/ndevs/0",
            "ens81f0\n",
        );
        write(
            &root,
            "class/infiniband/mlx5_1/ports/1/gid_attrs/ndevs/1",
            "ens81f0\n",
        );
        std::os::unix::fs::symlink(&pci, root.join("class/infiniband/mlx5_1/device"))
            .expect("symlink");
        // rxe0: no PCI device.
        write(
            &root,
            "class/infiniband/rxe0/ports/1/gid_attrs/ndevs/0",
            "d0",
        );
        let nics = rdma_nics(&root);
        assert_eq!(nics.len(), 2);
        assert_eq!(nics[0].name, "mlx5_1");
        assert_eq!(nics[0].pci_address.as_deref(), Some("0000:81:00.0"));
        assert_eq!(nics[0].numa_node, Some(1));
        assert_eq!(nics[0].netdevs, vec!["ens81f0".to_string()]);
        assert_eq!(nics[1].name, "rxe0");
        assert_eq!(
            (nics[1].pci_address.as_deref(), nics[1].numa_node),
            (None, None)
        );
        let nodes = numa_nodes(&root);
        assert_eq!(nodes.iter().map(|n| n.id).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(nodes[1].cpus.len(), 32);
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn a_machine_without_rdma_or_numa_degrades_to_a_small_model() {
        let root = fixture("bare");
        write(&root, "devices/system/cpu/online", "0-1");
        assert!(rdma_nics(&root).is_empty());
        assert_eq!(
            numa_nodes(&root),
            vec![NumaNode {
                id: 0,
                cpus: vec![0, 1]
            }]
        );
        // The real machine never panics either.
        let _ = rdma_nics(Path::new("/sys"));
        assert!(!numa_nodes(Path::new("/sys")).is_empty());
        let _ = fs::remove_dir_all(&root);
    }
}
