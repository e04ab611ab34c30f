//! hwloc XML topologies of real machine shapes (fixtures/gen.py; this-vm.xml is an lstopo export
//! of the development VM) loaded through hwlocality, and the paths and rails rixl picks on them.

use std::path::PathBuf;

use rixl_topology::hwloc::from_xml_file;
use rixl_topology::{GpuLink, Machine, MemoryLocation, Path, Place, Relation};

fn load(name: &str) -> Machine {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    from_xml_file(&p).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn place(process: u32, memory: MemoryLocation) -> Place {
    Place {
        node: "node-a".into(),
        process,
        memory,
    }
}

fn remote(memory: MemoryLocation) -> Place {
    Place {
        node: "node-b".into(),
        process: 1,
        memory,
    }
}

const GPU: fn(u32) -> MemoryLocation = |index| MemoryLocation::Gpu { index };
const HOST: fn(u32) -> MemoryLocation = |numa| MemoryLocation::Host { numa: Some(numa) };

#[test]
fn dgx_like_box_model() {
    let m = load("dgx-a100-like.xml");
    assert_eq!(m.host, "dgx-a100-like");
    assert_eq!(m.numa.len(), 2);
    assert_eq!(m.numa[1].cpus, (8..16).collect::<Vec<u32>>());
    assert_eq!(m.numa[1].package, Some(1));
    assert_eq!(m.gpus.len(), 8);
    assert_eq!(m.nics.len(), 8);
    assert_eq!(m.gpus[0].name, "NVIDIA A100-SXM4-80GB");
    assert_eq!(m.gpus[0].pci.address, "0000:12:00.0");
    assert_eq!(m.gpus[5].pci.numa, Some(1));
    let names: Vec<&str> = m.nics.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(
        names,
        ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    );
    // Two host bridges per socket, each with a switch: upstream port + 4 downstream ports.
    assert_eq!(m.bridges.iter().filter(|b| b.host).count(), 4);
    assert_eq!(m.bridges.len(), 4 * 6);
}

#[test]
fn dgx_like_box_pci_relations() {
    let m = load("dgx-a100-like.xml");
    let gpu = |i: u32| &m.gpu(i).unwrap().pci;
    let nic = |n: &str| &m.nic(n).unwrap().pci;
    assert_eq!(m.relation(gpu(0), gpu(0)), Relation::Same);
    assert_eq!(
        m.relation(gpu(0), nic("mlx5_0")),
        Relation::Pix,
        "same switch"
    );
    assert_eq!(m.relation(gpu(0), nic("mlx5_1")), Relation::Pix);
    assert_eq!(m.relation(gpu(0), gpu(1)), Relation::Pix);
    assert_eq!(
        m.relation(gpu(0), nic("mlx5_2")),
        Relation::Node,
        "other switch, same socket"
    );
    assert_eq!(
        m.relation(gpu(0), nic("mlx5_4")),
        Relation::Sys,
        "other socket"
    );
    assert_eq!(m.relation(gpu(7), nic("mlx5_6")), Relation::Pix);
}

#[test]
fn dgx_like_box_paths() {
    let mut m = load("dgx-a100-like.xml");
    // NVML would report NVLink (NVSwitch) between every pair on such a box.
    for a in 0..8 {
        for b in a + 1..8 {
            m.add_gpu_link(a, b, GpuLink::NvLink(12));
        }
    }
    // GPU memory to another node: GPUDirect RDMA on a NIC under the GPU's own switch, and the two
    // GPUs of a switch start from different NICs.
    for g in 0..8u32 {
        match m.choose_path(&place(1, GPU(g)), &remote(GPU(0))) {
            Path::GpuDirectRdma { nic, gpu, relation } => {
                assert_eq!(gpu, g);
                assert_eq!(nic, format!("mlx5_{g}"), "GPU {g}");
                assert_eq!(relation, Relation::Pix);
            }
            other => panic!("GPU {g}: {other:?}"),
        }
    }
    // Same node, two GPUs: CUDA IPC over NVLink, never the NIC.
    assert_eq!(
        m.choose_path(&place(1, GPU(2)), &place(2, GPU(6))),
        Path::CudaIpc {
            local: 2,
            remote: 6,
            link: Some(GpuLink::NvLink(12))
        }
    );
    // Same GPU, another process: CUDA IPC; same process: a local copy.
    assert_eq!(
        m.choose_path(&place(1, GPU(3)), &place(2, GPU(3))),
        Path::CudaIpc {
            local: 3,
            remote: 3,
            link: None
        }
    );
    assert_eq!(
        m.choose_path(&place(1, GPU(3)), &place(1, GPU(3))),
        Path::LocalCopy
    );
    assert_eq!(
        m.choose_path(&place(1, HOST(0)), &place(1, HOST(1))),
        Path::LocalCopy
    );
    // Host memory on socket 1: a NIC of socket 1.
    match m.choose_path(&place(1, HOST(1)), &remote(HOST(0))) {
        Path::HostRdma {
            nic,
            staged_gpu: None,
        } => {
            assert!(
                ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"].contains(&nic.as_str()),
                "{nic}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn dgx_like_box_rails_for_multi_rail_striping() {
    let m = load("dgx-a100-like.xml");
    let r = m.rails(GPU(1));
    assert_eq!(r.len(), 8);
    let order: Vec<(&str, Relation)> = r.iter().map(|x| (x.nic.as_str(), x.relation)).collect();
    assert_eq!(
        &order[..2],
        &[("mlx5_1", Relation::Pix), ("mlx5_0", Relation::Pix)]
    );
    assert!(order[2..4].iter().all(|x| x.1 == Relation::Node));
    assert!(order[4..].iter().all(|x| x.1 == Relation::Sys));
    let best = m.best_rails(GPU(1));
    assert_eq!(
        best.len(),
        2,
        "stripe over the two NICs of the GPU's switch"
    );
    let host = m.best_rails(HOST(0));
    let names: Vec<&str> = host.iter().map(|x| x.nic.as_str()).collect();
    assert_eq!(
        names,
        ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"],
        "socket 0's NICs"
    );
    let slices = rixl_topology::stripe(8 << 20, best.len(), 1 << 20);
    assert_eq!(slices.iter().filter(|s| s.rail == 0).count(), 4);
    assert_eq!(slices.iter().filter(|s| s.rail == 1).count(), 4);
}

#[test]
fn two_socket_box_picks_the_nic_of_the_memorys_socket() {
    let m = load("two-socket-2nic.xml");
    assert!(m.gpus.is_empty());
    assert_eq!(m.nics.len(), 2);
    assert_eq!(m.nic("mlx5_1").unwrap().pci.numa, Some(1));
    for (numa, want) in [(0, "mlx5_0"), (1, "mlx5_1")] {
        assert_eq!(
            m.choose_path(&place(1, HOST(numa)), &remote(HOST(0))),
            Path::HostRdma {
                nic: want.into(),
                staged_gpu: None
            }
        );
        let rails = m.rails(HOST(numa));
        assert_eq!(rails[0].relation, Relation::Node);
        assert_eq!(rails[1].relation, Relation::Sys);
    }
    let a = &m.nic("mlx5_0").unwrap().pci;
    let b = &m.nic("mlx5_1").unwrap().pci;
    assert_eq!(m.relation(a, b), Relation::Sys);
}

#[test]
fn this_vm_has_no_gpu_or_nic_and_degrades_cleanly() {
    let m = load("this-vm.xml");
    assert_eq!(m.numa.len(), 1);
    assert_eq!(m.numa[0].cpus, [0, 1]);
    assert!(m.gpus.is_empty());
    assert!(m.nics.is_empty(), "virtio-net is not an RDMA NIC");
    assert_eq!(m.bridges.iter().filter(|b| b.host).count(), 1);
    match m.choose_path(&place(1, HOST(0)), &remote(HOST(0))) {
        Path::None { reason } => assert!(reason.contains("no RDMA NIC"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        m.choose_path(&place(1, HOST(0)), &place(1, HOST(0))),
        Path::LocalCopy
    );
    assert!(m.rails(GPU(0)).is_empty());
}

#[test]
fn a_missing_or_malformed_file_is_an_error_not_a_panic() {
    assert!(from_xml_file(std::path::Path::new("/nonexistent/topo.xml")).is_err());
    let bad = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bad-topo.xml");
    std::fs::write(&bad, "<topology version=\"2.0\"><object type=").unwrap();
    assert!(from_xml_file(&bad).is_err());
}

#[test]
fn the_live_machine_loads() {
    let m =
        rixl_topology::hwloc::live(std::path::Path::new("/sys")).expect("hwloc reads this machine");
    assert!(!m.numa.is_empty());
    assert!(m.numa.iter().map(|n| n.cpus.len()).sum::<usize>() >= 1);
}

fn names(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn nic_choice_dgx_h100_like_box_binds_each_gpu_to_its_own_nic() {
    let m = load("dgx-h100-like.xml");
    assert_eq!((m.gpus.len(), m.nics.len(), m.numa.len()), (8, 8, 2));
    // 4 top-level switches, each with 2 second-level switches (upstream + 2 ports each).
    assert_eq!(m.bridges.iter().filter(|b| b.host).count(), 4);
    for g in 0..8u32 {
        let c = m.nic_choice(GPU(g), None);
        assert_eq!(names(&c.nics), [format!("mlx5_{g}")], "GPU {g}");
        assert_eq!(c.relation, Relation::Pix, "GPU {g}");
        assert!(c.gpudirect());
        // Its switch neighbour's NIC is one level farther (PXB): never striped with.
        let rails = m.rails(GPU(g));
        assert_eq!(rails[1].nic, format!("mlx5_{}", g ^ 1));
        assert_eq!(rails[1].relation, Relation::Pxb);
    }
    // Host memory: the 4 NICs of its socket, equally near.
    assert_eq!(
        names(&m.nic_choice(HOST(1), None).nics),
        ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    );
    // Among an agent's NICs only: GPU 2 with only mlx5_3 and mlx5_6 open takes mlx5_3 (PXB,
    // same socket) over mlx5_6 (SYS).
    let open = ["mlx5_3".to_string(), "mlx5_6".to_string()];
    let c = m.nic_choice(GPU(2), Some(&open));
    assert_eq!(
        (names(&c.nics), c.relation),
        (vec!["mlx5_3"], Relation::Pxb)
    );
    // Across sockets only: staged through host memory, not GPUDirect.
    let c = m.nic_choice(GPU(2), Some(&open[1..]));
    assert_eq!(
        (names(&c.nics), c.relation),
        (vec!["mlx5_6"], Relation::Sys)
    );
    assert!(!c.gpudirect());
    // An agent serving GPU 5 with its engine on socket 1 opens mlx5_5 only (its host memory
    // binds to it too); one serving every GPU opens all 8.
    assert_eq!(m.agent_nics(Some(&[5]), Some(1)), ["mlx5_5"]);
    assert_eq!(m.agent_nics(Some(&[5]), Some(0)), ["mlx5_0", "mlx5_5"]);
    assert_eq!(m.agent_nics(None, Some(0)).len(), 8);
    assert_eq!(m.numa_of_cpu(9), Some(1));
}

#[test]
fn nic_choice_four_gpu_two_nic_box_at_four_distances() {
    let m = load("four-gpu-two-nic.xml");
    assert_eq!((m.gpus.len(), m.nics.len()), (4, 2));
    for (g, nic, rel) in [
        (0, "mlx5_0", Relation::Pix),
        (1, "mlx5_0", Relation::Node),
        (2, "mlx5_1", Relation::Phb),
        (3, "mlx5_1", Relation::Node),
    ] {
        let c = m.nic_choice(GPU(g), None);
        assert_eq!((names(&c.nics), c.relation), (vec![nic], rel), "GPU {g}");
        assert!(c.gpudirect(), "GPU {g}: within its NUMA node");
    }
    for (numa, nic) in [(0, "mlx5_0"), (1, "mlx5_1")] {
        let c = m.nic_choice(HOST(numa), None);
        assert_eq!((names(&c.nics), c.relation), (vec![nic], Relation::Node));
    }
    // An agent with only the other socket's NIC open: SYS, staged.
    let c = m.nic_choice(GPU(0), Some(&["mlx5_1".to_string()]));
    assert_eq!((c.relation, c.gpudirect()), (Relation::Sys, false));
    assert_eq!(m.agent_nics(Some(&[1]), Some(0)), ["mlx5_0"]);
    assert_eq!(m.agent_nics(Some(&[3]), Some(0)), ["mlx5_0", "mlx5_1"]);
    assert_eq!(m.agent_nics(None, Some(1)), ["mlx5_0", "mlx5_1"]);
}

#[test]
fn nic_choice_gh200_like_node_binds_its_gpu_and_host_memory_to_its_nic() {
    let m = load("gh200-like.xml");
    assert_eq!((m.gpus.len(), m.nics.len()), (1, 1));
    assert_eq!(m.numa.len(), 2, "Grace's DRAM and the GPU's HBM");
    assert_eq!(m.gpus[0].pci.address, "0009:01:00.0");
    let c = m.nic_choice(GPU(0), None);
    assert_eq!(
        (names(&c.nics), c.relation),
        (vec!["mlx5_0"], Relation::Node)
    );
    assert!(c.gpudirect());
    assert_eq!(names(&m.nic_choice(HOST(0), None).nics), ["mlx5_0"]);
    assert_eq!(m.agent_nics(None, m.numa_of_cpu(0)), ["mlx5_0"]);
}

#[test]
fn nic_choice_software_nics_and_nic_less_machines_choose_nothing_to_open() {
    // The development VM: no NIC at all.
    let vm = load("this-vm.xml");
    assert!(vm.agent_nics(None, Some(0)).is_empty());
    let c = vm.nic_choice(GPU(0), None);
    assert!(c.nics.is_empty());
    // rxe devices the model does not place: every one ranks Unknown for GPU memory, so all
    // are kept (equally unknown), and an agent keeps its configured device.
    let open = ["rxe0".to_string(), "rxe1".to_string()];
    let c = vm.nic_choice(GPU(0), Some(&open));
    assert_eq!(
        (names(&c.nics), c.relation),
        (vec!["rxe0", "rxe1"], Relation::Unknown)
    );
    assert!(!c.gpudirect(), "unknown locality is not GPUDirect");
    // The A100-like box keeps striping over the two NICs of each GPU's switch.
    let a100 = load("dgx-a100-like.xml");
    assert_eq!(
        names(&a100.nic_choice(GPU(1), None).nics),
        ["mlx5_1", "mlx5_0"]
    );
}
