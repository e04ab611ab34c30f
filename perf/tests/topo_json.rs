//! `rixl topo --json` prints the choice an agent makes: for every fixture shape, its NICs per
//! memory location are the library's `Machine::nic_choice` (what `Agent::nic_choice` and a new
//! registration's binding use) among the NICs `Machine::agent_nics` opens.

use rixl::topology::{hwloc::from_xml_file, MemoryLocation};

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../topology/tests/fixtures")
        .join(name)
}

fn topo_json(args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rixl"))
        .arg("topo")
        .arg("--json")
        .args(args)
        .output()
        .expect("rixl runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|s| s.as_str().expect("string").to_string())
        .collect()
}

#[test]
fn nic_choice_rixl_topo_json_is_the_agents_choice_on_every_fixture() {
    for (name, gpus, cpu) in [
        ("dgx-h100-like.xml", None, 0),
        ("dgx-h100-like.xml", Some("5"), 9),
        ("dgx-a100-like.xml", None, 0),
        ("four-gpu-two-nic.xml", Some("3"), 0),
        ("gh200-like.xml", None, 0),
        ("two-socket-2nic.xml", None, 5),
    ] {
        let path = fixture(name);
        let m = from_xml_file(&path).expect("fixture");
        let cpu_s = cpu.to_string();
        let mut args = vec!["--xml", path.to_str().expect("utf-8"), "--cpu", &cpu_s];
        if let Some(g) = gpus {
            args.extend(["--gpus", g]);
        }
        let json = topo_json(&args);
        let gpu_list: Option<Vec<u32>> = gpus.map(|g| vec![g.parse().expect("gpu")]);
        let open = m.agent_nics(gpu_list.as_deref(), m.numa_of_cpu(cpu));
        assert_eq!(strings(&json["nics"]), open, "{name}: the NICs opened");
        assert!(!open.is_empty(), "{name}");
        let choices = json["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), m.gpus.len() + m.numa.len(), "{name}");
        for c in choices {
            let loc = match c["memory"]["gpu"].as_u64() {
                Some(g) => MemoryLocation::Gpu { index: g as u32 },
                None => MemoryLocation::Host {
                    numa: c["memory"]["numa"].as_u64().map(|n| n as u32),
                },
            };
            let lib = m.nic_choice(loc, Some(&open));
            assert_eq!(strings(&c["nics"]), lib.nics, "{name} {loc:?}");
            assert_eq!(c["relation"], lib.relation.to_string(), "{name} {loc:?}");
            assert_eq!(c["gpudirect"], lib.gpudirect(), "{name} {loc:?}");
        }
    }
    // The DGX H100-like box, for an agent serving GPU 5 on socket 1: mlx5_5 alone, PIX.
    let json = topo_json(&[
        "--xml",
        fixture("dgx-h100-like.xml").to_str().expect("utf-8"),
        "--gpus",
        "5",
        "--cpu",
        "9",
    ]);
    assert_eq!(strings(&json["nics"]), ["mlx5_5"]);
    let gpu5 = json["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .find(|c| c["memory"]["gpu"] == 5)
        .expect("GPU 5");
    assert_eq!(strings(&gpu5["nics"]), ["mlx5_5"]);
    assert_eq!(gpu5["relation"], "PIX");
}

#[test]
fn nic_choice_rixl_topo_refuses_a_malformed_topology() {
    let bad = std::env::temp_dir().join(format!("rixl-bad-topo-{}.xml", std::process::id()));
    std::fs::write(&bad, "<topology version=\"2.0\"><object").expect("write");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rixl"))
        .args(["topo", "--json", "--xml"])
        .arg(&bad)
        .output()
        .expect("rixl runs");
    let _ = std::fs::remove_file(&bad);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("rixl: hwloc"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
