//! `rixl`: machine facts for rixl users.
//!
//! ```text
//! rixl info   # RDMA devices, ports, GIDs and limits; GPU backends available (CUDA, NVML)
//! rixl topo   # NUMA nodes and RDMA NICs with their PCI addresses and NUMA affinity
//! ```
#![forbid(unsafe_code)]

use std::path::Path;

use rixl::verbs::{DeviceList, LinkLayer};

fn info() -> Result<(), String> {
    println!("RDMA devices:");
    match DeviceList::new() {
        Err(e) => println!("  none: {e}"),
        Ok(list) if list.is_empty() => println!("  none: the device list is empty"),
        Ok(list) => {
            for dev in list.iter() {
                let ctx = dev.open().map_err(|e| e.to_string())?;
                let a = ctx.query_device().map_err(|e| e.to_string())?;
                println!(
                    "  {} (node GUID {:016x}): max_qp_wr {}, max_sge {}, max_sge_rd {}, max_cqe {}, max_mr_size {} MiB, rd_atom {}/{}",
                    ctx.name(),
                    a.node_guid,
                    a.max_qp_wr,
                    a.max_sge,
                    a.max_sge_rd,
                    a.max_cqe,
                    a.max_mr_size >> 20,
                    a.max_qp_rd_atom,
                    a.max_qp_init_rd_atom
                );
                for port in 1..=a.phys_port_cnt {
                    let p = ctx.query_port(port).map_err(|e| e.to_string())?;
                    let ll = match p.link_layer {
                        LinkLayer::Ethernet => "Ethernet (RoCE)",
                        LinkLayer::InfiniBand => "InfiniBand",
                        _ => "unspecified",
                    };
                    println!(
                        "    port {port}: {}, {ll}, active MTU {} B, max message {} B, lid {}",
                        if p.active { "ACTIVE" } else { "down" },
                        p.active_mtu.bytes(),
                        p.max_msg_sz,
                        p.lid
                    );
                    for i in 0..p.gid_tbl_len.min(16) {
                        match ctx.query_gid(port, i) {
                            Ok(g) if !g.is_zero() => println!("      GID[{i}] {g}"),
                            _ => {}
                        }
                    }
                }
            }
        }
    }
    println!("GPU backends:");
    match rixl::gpudirect::probe() {
        Ok(c) => {
            println!(
                "  CUDA driver {}.{}: {} GPU(s)",
                c.driver_version / 1000,
                c.driver_version % 1000 / 10,
                c.gpus.len()
            );
            for g in &c.gpus {
                println!(
                    "    GPU {} {} ({} MiB) at {}",
                    g.ordinal,
                    g.name,
                    g.total_memory >> 20,
                    g.pci_address
                );
            }
        }
        Err(e) => println!("  CUDA: {e}"),
    }
    match rixl::nvlink::probe() {
        Ok(n) => {
            let nv = n.links.iter().filter(|l| l.nvlink).count();
            println!(
                "  NVML: {} GPU(s), {nv} NVLink-connected ordered pairs",
                n.gpus.len()
            );
        }
        Err(e) => println!("  NVML: {e}"),
    }
    println!(
        "runtime: memlock limit {}, CAP_IPC_LOCK {}",
        rixl::runtime::preflight::memlock_limit()
            .map_or("unlimited".into(), |l| format!("{} KiB", l >> 10)),
        rixl::runtime::preflight::has_ipc_lock()
    );
    Ok(())
}

fn topo() -> Result<(), String> {
    let sys = Path::new("/sys");
    println!("NUMA nodes:");
    for n in rixl::topology::numa_nodes(sys) {
        println!("  node{}: {} CPUs {:?}", n.id, n.cpus.len(), n.cpus);
    }
    println!("RDMA NICs:");
    let nics = rixl::topology::rdma_nics(sys);
    if nics.is_empty() {
        println!("  none (no /sys/class/infiniband: kernel without RDMA support?)");
    }
    for nic in nics {
        println!(
            "  {:<10} PCI {:<14} NUMA {:<4} ports {} netdevs {:?}",
            nic.name,
            nic.pci_address.as_deref().unwrap_or("(software)"),
            nic.numa_node.map_or("-".into(), |n| n.to_string()),
            nic.ports,
            nic.netdevs
        );
    }
    Ok(())
}

fn main() {
    let cmd = std::env::args().nth(1).unwrap_or_default();
    let r = match cmd.as_str() {
        "info" => info(),
        "topo" => topo(),
        _ => Err("usage: rixl info | rixl topo".into()),
    };
    if let Err(e) = r {
        eprintln!("rixl: {e}");
        std::process::exit(1);
    }
}
