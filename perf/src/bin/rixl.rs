//! `rixl`: machine facts for rixl users.
//!
//! ```text
//! rixl info   # RDMA devices, ports, GIDs and limits; GPU backends available (CUDA, NVML)
//! rixl topo   # GPU/NIC/NUMA matrix (like `nvidia-smi topo -m`) and the path rixl picks per memory
//! rixl topo --xml FILE   # the same for another machine's hwloc XML export
//! rixl topo --json [--nics mlx5_0,mlx5_1] [--gpus 0,1] [--cpu N]
//!             # the NICs an agent opens and binds each memory location to, as JSON
//! ```
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use clap::Parser;

use rixl::topology::{GpuLink, Machine, MemoryLocation, Path as TopoPath, PciPlace, Place};
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

fn topo(args: &TopoArgs) -> Result<(), String> {
    let m = match (&args.xml, std::env::var_os("RIXL_TOPOLOGY_XML")) {
        (Some(f), _) => rixl::topology::hwloc::from_xml_file(f).map_err(|e| e.to_string())?,
        (None, Some(f)) => {
            rixl::topology::hwloc::from_xml_file(Path::new(&f)).map_err(|e| e.to_string())?
        }
        (None, None) => rixl::nvlink::discover_machine(),
    };
    if args.json {
        println!("{}", choice_json(&m, args));
    } else {
        print!("{}", topo_report(&m));
    }
    Ok(())
}

/// What an agent on `m` opens and binds each memory location to (`Agent::nics`,
/// `Agent::nic_choice`), as JSON.
fn choice_json(m: &Machine, args: &TopoArgs) -> serde_json::Value {
    let numa = m.numa_of_cpu(args.cpu);
    let nics: Vec<String> = if args.nics.is_empty() {
        m.agent_nics(args.gpus.as_deref().filter(|g| !g.is_empty()), numa)
    } else {
        args.nics.clone()
    };
    let mut locations: Vec<MemoryLocation> = m
        .gpus
        .iter()
        .map(|g| MemoryLocation::Gpu { index: g.index })
        .collect();
    locations.extend(
        m.numa
            .iter()
            .map(|n| MemoryLocation::Host { numa: Some(n.id) }),
    );
    if m.numa.is_empty() {
        locations.push(MemoryLocation::Host { numa: None });
    }
    let choices: Vec<serde_json::Value> = locations
        .into_iter()
        .map(|loc| {
            let c = m.nic_choice(loc, Some(&nics));
            let memory = match loc {
                MemoryLocation::Gpu { index } => serde_json::json!({ "gpu": index }),
                MemoryLocation::Host { numa } => serde_json::json!({ "numa": numa }),
            };
            serde_json::json!({
                "memory": memory,
                "nics": c.nics,
                "relation": c.relation.to_string(),
                "gpudirect": c.gpudirect(),
            })
        })
        .collect();
    serde_json::json!({
        "machine": m.host,
        "nics": nics,
        "choices": choices,
    })
}

/// `nvidia-smi topo -m`-style matrix of GPUs and NICs, then the path rixl picks for each memory
/// location (to another node, and between GPUs of this node).
fn topo_report(m: &Machine) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "machine {}: {} NUMA node(s), {} GPU(s), {} RDMA NIC(s), {} PCI bridge(s)",
        if m.host.is_empty() { "?" } else { &m.host },
        m.numa.len(),
        m.gpus.len(),
        m.nics.len(),
        m.bridges.len()
    );
    for n in &m.numa {
        let _ = writeln!(o, "  NUMA {}: CPUs {}", n.id, cpu_ranges(&n.cpus));
    }
    let devs: Vec<(String, &PciPlace)> = m
        .gpus
        .iter()
        .map(|g| (format!("GPU{}", g.index), &g.pci))
        .chain(m.nics.iter().map(|n| (n.name.clone(), &n.pci)))
        .collect();
    if devs.is_empty() {
        let _ = writeln!(
            o,
            "no GPUs or RDMA NICs: transfers to other nodes have no path"
        );
        return o;
    }
    let w = devs.iter().map(|d| d.0.len()).max().unwrap_or(4).max(5) + 1;
    let _ = write!(o, "\n{:w$}", "");
    for (name, _) in &devs {
        let _ = write!(o, "{name:>w$}");
    }
    let _ = writeln!(o, "  {:>6}  PCI", "NUMA");
    for (i, (name, a)) in devs.iter().enumerate() {
        let _ = write!(o, "{name:w$}");
        for (j, (_, b)) in devs.iter().enumerate() {
            let cell = match (m.gpus.get(i), m.gpus.get(j)) {
                (Some(x), Some(y)) if i != j => match m.gpu_link(x.index, y.index) {
                    Some(GpuLink::NvLink(n)) => format!("NV{n}"),
                    _ => m.relation(a, b).to_string(),
                },
                _ => m.relation(a, b).to_string(),
            };
            let _ = write!(o, "{cell:>w$}");
        }
        let _ = writeln!(
            o,
            "  {:>6}  {}",
            a.numa.map_or("-".into(), |n| n.to_string()),
            if a.address.is_empty() {
                "(software)"
            } else {
                &a.address
            }
        );
    }
    let _ = writeln!(
        o,
        "\nLegend: X same, NV# NVLink, PIX one PCIe switch, PXB several PCIe bridges, PHB host bridge, NODE across host bridges in a NUMA node, SYS across NUMA nodes, ? unknown"
    );
    let me = |memory| Place {
        node: "this".into(),
        process: 1,
        memory,
    };
    let other = |memory| Place {
        node: "other".into(),
        process: 1,
        memory,
    };
    let _ = writeln!(o, "\nPaths rixl picks (memory here -> a peer on another node), and the rails it stripes over:");
    let mut locations: Vec<(String, MemoryLocation)> = m
        .gpus
        .iter()
        .map(|g| {
            (
                format!("GPU{} memory", g.index),
                MemoryLocation::Gpu { index: g.index },
            )
        })
        .collect();
    for n in &m.numa {
        locations.push((
            format!("host NUMA {}", n.id),
            MemoryLocation::Host { numa: Some(n.id) },
        ));
    }
    if m.numa.is_empty() {
        locations.push(("host memory".into(), MemoryLocation::Host { numa: None }));
    }
    for (label, loc) in &locations {
        let path = m.choose_path(&me(*loc), &other(MemoryLocation::Host { numa: None }));
        let rails: Vec<String> = m.best_rails(*loc).into_iter().map(|r| r.nic).collect();
        let _ = writeln!(
            o,
            "  {label:<16} {}  rails [{}]",
            describe(&path),
            rails.join(" ")
        );
    }
    if m.gpus.len() > 1 {
        let _ = writeln!(o, "\nBetween GPUs of this node (two processes):");
        if m.gpu_links.is_empty() {
            let _ = writeln!(
                o,
                "  (no NVML: GPU peer links unknown, so GPU pairs go through a NIC)"
            );
        }
        for a in &m.gpus {
            for b in m.gpus.iter().filter(|b| b.index > a.index) {
                let p = Place {
                    node: "this".into(),
                    process: 2,
                    memory: MemoryLocation::Gpu { index: b.index },
                };
                let path = m.choose_path(&me(MemoryLocation::Gpu { index: a.index }), &p);
                let _ = writeln!(o, "  GPU{} -> GPU{}: {}", a.index, b.index, describe(&path));
            }
        }
    }
    o
}

fn describe(p: &TopoPath) -> String {
    match p {
        TopoPath::LocalCopy => "local copy".into(),
        TopoPath::CudaIpc { link, .. } => match link {
            Some(GpuLink::NvLink(n)) => format!("CUDA IPC over NVLink (x{n})"),
            Some(GpuLink::PciP2p) => "CUDA IPC over PCIe P2P".into(),
            _ => "CUDA IPC (same GPU)".into(),
        },
        TopoPath::GpuDirectRdma { nic, relation, .. } => {
            format!("GPUDirect RDMA on {nic} ({relation})")
        }
        TopoPath::HostRdma {
            nic,
            staged_gpu: Some(_),
        } => {
            format!("RDMA on {nic} through a pinned host bounce")
        }
        TopoPath::HostRdma { nic, .. } => format!("RDMA on {nic}"),
        TopoPath::None { reason } => format!("no path: {reason}"),
        other => format!("{other:?}"),
    }
}

fn cpu_ranges(cpus: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// `rixl info` | `rixl topo [--xml FILE]`.
#[derive(Debug, Parser)]
#[command(name = "rixl", about = "Machine facts for rixl users")]
enum Cli {
    /// RDMA devices, ports, GIDs and limits; GPU backends available (CUDA, NVML)
    Info,
    /// GPU/NIC/NUMA matrix (like `nvidia-smi topo -m`) and the path rixl picks per memory
    Topo(TopoArgs),
}

#[derive(Debug, clap::Args)]
struct TopoArgs {
    /// Report another machine from its hwloc XML export (`lstopo machine.xml`; also
    /// `RIXL_TOPOLOGY_XML`)
    #[arg(long, value_name = "HWLOC-XML")]
    xml: Option<PathBuf>,
    /// Print, as JSON, the NICs an agent opens and the NICs it binds each GPU's and NUMA
    /// node's memory to
    #[arg(long)]
    json: bool,
    /// The NICs the agent has open (default: those it would choose itself)
    #[arg(long, value_delimiter = ',')]
    nics: Vec<String>,
    /// The GPUs the agent serves, PCI-bus order (default: every GPU)
    #[arg(long, value_delimiter = ',')]
    gpus: Option<Vec<u32>>,
    /// The agent's engine CPU (its NUMA node's NICs are opened)
    #[arg(long, default_value_t = 0)]
    cpu: u32,
}

fn main() {
    let r = match Cli::parse() {
        Cli::Info => info(),
        Cli::Topo(args) => topo(&args),
    };
    if let Err(e) = r {
        eprintln!("rixl: {e}");
        std::process::exit(1);
    }
}
