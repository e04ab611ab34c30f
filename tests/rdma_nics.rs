//! NIC binding on real rxe (two rails in the guest): registrations go on the NICs the topology
//! says are nearest their memory, host memory standing in for a GPU's; the agent's choice and
//! `rixl topo --json`'s agree.
//!
//! The guest's rxe devices have no PCI place, so the topology is a fixture
//! (`four-gpu-two-nic.xml`: GPU0 and mlx5_0 under one switch, GPU2 and mlx5_1 on one root
//! complex of the other socket) with its two NICs renamed to the guest's rails.

use std::sync::Arc;

use futures_lite::future::block_on;
use rixl::agent::{Agent, AgentConfig, AgentError, Bind, RemoteRef, Visibility};
use rixl::runtime::LocalDescList;
use rixl::topology::{Machine, MemoryLocation, Relation};
use rixl_testkit::{fill, report, require_or_skip};

const GPU: fn(u32) -> MemoryLocation = |index| MemoryLocation::Gpu { index };

fn guest_rails(test: &str) -> Option<Vec<String>> {
    require_or_skip(test, || {
        rixl::verbs::DeviceList::new().and_then(|l| l.find(None).map(|_| ()))
    })?;
    match std::env::var("RIXL_GUEST_RAILS") {
        Ok(r) => Some(r.split(',').map(String::from).collect()),
        Err(_) => {
            eprintln!(
                "SKIPPED {test}: needs two RDMA devices (RIXL_GUEST_RAILS, set by the rxe guest)"
            );
            None
        }
    }
}

/// The four-GPU, two-NIC fixture with its NICs named as the guest's rails.
fn fixture(rails: &[String]) -> Machine {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/topology/tests/fixtures/four-gpu-two-nic.xml"
    );
    let mut m = rixl::topology::hwloc::from_xml_file(std::path::Path::new(path)).expect("fixture");
    for (nic, name) in m.nics.iter_mut().zip(rails) {
        nic.name = name.clone();
    }
    m
}

fn agent(name: &str, cpu: usize, rails: &[String], topology: Option<Machine>) -> Agent {
    rixl_testkit::init_logs();
    let mut cfg = AgentConfig::default();
    cfg.rails = rails.to_vec();
    cfg.cpu = rixl::runtime::cpu_at(cpu);
    cfg.topology = topology.map(Arc::new);
    Agent::new(name, cfg).expect("two-rail agent")
}

/// Work requests each rail carried during `f`.
fn per_rail(agent: &Agent, f: impl FnOnce()) -> Vec<u64> {
    let before = block_on(agent.rail_counters());
    f();
    let after = block_on(agent.rail_counters());
    after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.work_requests - b.work_requests)
        .collect()
}

#[test]
fn vram_rails_memory_standing_in_for_a_gpus_goes_on_that_gpus_nic() {
    let Some(rails) = guest_rails("vram_rails_memory_standing_in_for_a_gpus_goes_on_that_gpus_nic")
    else {
        return;
    };
    let a = agent("nics-a", 0, &rails, Some(fixture(&rails)));
    let b = agent("nics-b", 1, &rails, Some(fixture(&rails)));
    assert_eq!(a.nics(), rails.as_slice());
    let len = 8usize << 20;
    let src = block_on(a.register(len, Visibility::All)).expect("register");
    let dst = block_on(b.register(len, Visibility::All)).expect("register");
    // Host memory of NUMA node 0 (the engine CPU's in the fixture): socket 0's NIC.
    let host = b.binding(&dst).expect("bound");
    assert_eq!(host.nics, [rails[0].clone()]);
    assert_eq!(host.relation, Relation::Node);
    // Both stand in for GPU 2's memory: its NIC is the second rail (PHB).
    for (agent, reg) in [(&a, &src), (&b, &dst)] {
        let bound = agent.bind(reg, Bind::Location(GPU(2))).expect("bind");
        assert_eq!(bound.rails, [1]);
        assert_eq!((bound.relation, bound.overridden), (Relation::Phb, true));
    }
    let mut data = vec![0u8; len];
    let addr = a.listen("127.0.0.1:0").expect("listen");
    let peer = b
        .fetch_remote_metadata(&addr.to_string())
        .expect("metadata");
    let mut local = LocalDescList::new();
    local.push(dst.region(), 0, len as u64);
    let remote = [RemoteRef {
        region: src.id(),
        offset: 0,
        len: len as u64,
    }];
    let mut got = vec![0u8; len];
    let mut read_and_check = |seed: u64| {
        fill(&mut data, seed);
        src.region().write_at(0, &data).expect("fill");
        let rails = per_rail(&b, || {
            block_on(b.read(&peer, &local, &remote)).expect("read");
        });
        dst.region().read_at(0, &mut got).expect("read back");
        assert!(got == data, "seed {seed}: every byte arrived");
        rails
    };
    let gpu2 = read_and_check(1);
    assert_eq!(
        gpu2[0], 0,
        "8 MiB of GPU 2's memory never touches rail 0: {gpu2:?}"
    );
    assert!(gpu2[1] > 0, "{gpu2:?}");
    // Local memory standing in for GPU 0 (rail 0), the peer's still GPU 2's: no common rail,
    // so the local NIC (the peer's memory is registered there too).
    assert_eq!(
        b.bind(&dst, Bind::Location(GPU(0))).expect("bind").rails,
        [0]
    );
    let split = read_and_check(2);
    assert!(split[0] > 0 && split[1] == 0, "{split:?}");
    // Both bound to both NICs by name: striped over both.
    a.bind(&src, Bind::Nics(rails.clone())).expect("bind");
    let both = b
        .bind(&dst, Bind::Nics(vec![rails[1].clone(), rails[0].clone()]))
        .expect("bind");
    assert_eq!(both.rails, [1, 0]);
    let peer = b
        .fetch_remote_metadata(&addr.to_string())
        .expect("metadata again");
    assert_eq!(peer, "nics-a");
    let striped = read_and_check(3);
    assert!(striped.iter().all(|&n| n > 0), "{striped:?}");
    // A small transfer goes on the preferred NIC alone (rail 1 here).
    let mut small = LocalDescList::new();
    small.push(dst.region(), 0, 65536);
    let one = per_rail(&b, || {
        block_on(b.read(
            &peer,
            &small,
            &[RemoteRef {
                region: src.id(),
                offset: 0,
                len: 65536,
            }],
        ))
        .expect("small read");
    });
    assert!(one[0] == 0 && one[1] > 0, "{one:?}");
    // Bad input: a NIC the agent did not open, no NIC, another agent's registration.
    assert!(matches!(
        b.bind(&dst, Bind::Nics(vec!["mlx5_9".into()])),
        Err(AgentError::UnknownNic { nic, .. }) if nic == "mlx5_9"
    ));
    assert!(matches!(
        b.bind(&dst, Bind::Nics(Vec::new())),
        Err(AgentError::UnknownNic { .. })
    ));
    assert_eq!(b.binding(&dst).expect("bound").rails, [1, 0], "unchanged");
    // Another agent's registration (the same id names another region here).
    assert_eq!(src.id(), dst.id());
    assert!(matches!(
        b.bind(&src, Bind::Auto),
        Err(AgentError::UnknownLocalRegion(_))
    ));
    assert_eq!(b.binding(&src), None);
    report(&format!(
        "NIC binding on two rxe rails: GPU 2 stand-in {gpu2:?}, GPU 0 -> GPU 2 {split:?}, both NICs {striped:?}, 64 KiB {one:?} work requests per rail"
    ));
    a.shutdown();
    b.shutdown();
}

#[test]
fn nic_choice_agent_and_rixl_topo_json_agree_on_the_live_machine() {
    let Some(rails) = guest_rails("nic_choice_agent_and_rixl_topo_json_agree_on_the_live_machine")
    else {
        return;
    };
    let a = agent("nics-live", 0, &rails, None);
    let exe = std::env::current_exe().expect("exe");
    let rixl = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("rixl"))
        .expect("target dir");
    let out = std::process::Command::new(&rixl)
        .args(["topo", "--json", "--nics", &rails.join(",")])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", rixl.display()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let choices = json["choices"].as_array().expect("choices");
    assert!(!choices.is_empty());
    for c in choices {
        let loc = if let Some(g) = c["memory"]["gpu"].as_u64() {
            GPU(g as u32)
        } else {
            MemoryLocation::Host {
                numa: c["memory"]["numa"].as_u64().map(|n| n as u32),
            }
        };
        let mine = a.nic_choice(loc);
        let theirs: Vec<String> = c["nics"]
            .as_array()
            .expect("nics")
            .iter()
            .map(|n| n.as_str().expect("name").to_string())
            .collect();
        assert_eq!(mine.nics, theirs, "{loc:?}");
        assert_eq!(mine.relation.to_string(), c["relation"], "{loc:?}");
    }
    // And what a new registration is bound to is that choice.
    let reg = block_on(a.register(1 << 20, Visibility::All)).expect("register");
    let bound = a.binding(&reg).expect("bound");
    assert_eq!(bound.nics, a.nic_choice(bound.location).nics);
    report(&format!(
        "live machine: agent and rixl topo --json agree on {} locations; host memory bound to {:?}",
        choices.len(),
        bound.nics
    ));
    a.shutdown();
}
