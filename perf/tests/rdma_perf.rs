//! `rixl-perf` end to end on a real device (rxe in the guest): server and client processes, the
//! perftest columns, sane numbers, and the nixlbench-style sweep. Skipped with a reason without a
//! device.

use std::process::{Command, Stdio};
use std::time::Duration;

const PERF: &str = env!("CARGO_BIN_EXE_rixl-perf");

fn device() -> Option<()> {
    rixl_testkit::require_or_skip("rixl-perf", || {
        rixl::verbs::DeviceList::new().and_then(|l| l.find(None).map(|_| ()))
    })
}

/// Runs a server and a client of `args` on `port`; returns the client's stdout.
fn pair(args: &[&str], port: u16) -> String {
    let port = port.to_string();
    let mut srv = Command::new(PERF)
        .args(args)
        .args(["-p", &port])
        .stdout(Stdio::null())
        .spawn()
        .expect("server");
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new(PERF)
        .args(args)
        .args(["-p", &port, "127.0.0.1"])
        .output()
        .expect("client");
    let st = srv.wait().expect("server exit");
    assert!(
        out.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(st.success(), "server failed");
    String::from_utf8(out.stdout).expect("utf8")
}

fn row(out: &str, size: &str) -> Vec<f64> {
    out.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.first() == Some(&size))
        .unwrap_or_else(|| panic!("no row for {size} in:\n{out}"))[1..]
        .iter()
        .map(|v| v.parse().expect("number"))
        .collect()
}

#[test]
fn bandwidth_tests_print_perftest_columns() {
    if device().is_none() {
        return;
    }
    for (test, port) in [("write_bw", 18601), ("read_bw", 18602), ("send_bw", 18603)] {
        let out = pair(&[test, "-s", "4096", "-n", "400", "-l", "4"], port);
        assert!(
            out.contains(" #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]"),
            "{out}"
        );
        let r = row(&out, "4096");
        assert_eq!(r[0], 400.0, "iterations");
        assert!(r[2] > 0.0 && r[1] >= r[2] && r[3] > 0.0, "{test}: {r:?}");
        rixl_testkit::report(&format!(
            "rixl-perf {test} 4096 B -l 4: {:.2} MiB/s, {:.6} Mpps",
            r[2], r[3]
        ));
    }
    let out = pair(
        &["write_bw", "-s", "65536", "-n", "100", "--report_gbits"],
        18604,
    );
    assert!(out.contains("BW average[Gb/sec]"), "{out}");
}

#[test]
fn latency_tests_print_perftest_columns_and_the_await_line() {
    if device().is_none() {
        return;
    }
    for (test, port) in [
        ("write_lat", 18611),
        ("read_lat", 18612),
        ("send_lat", 18613),
    ] {
        let out = pair(&[test, "-s", "64", "-n", "100"], port);
        assert!(
            out.contains("t_typical[usec]") && out.contains("99.9% percentile[usec]"),
            "{out}"
        );
        let r = row(&out, "64");
        // min <= typical <= max, all positive.
        assert!(r[1] > 0.0 && r[1] <= r[3] && r[3] <= r[2], "{test}: {r:?}");
        if test == "write_lat" {
            assert!(
                out.contains("# rixl: one .await of a 64 B RDMA WRITE"),
                "{out}"
            );
        }
    }
}

#[test]
fn the_sweep_reports_every_block_and_batch() {
    if device().is_none() {
        return;
    }
    let out = Command::new(PERF)
        .args([
            "sweep",
            "--max_block_size",
            "16384",
            "--max_batch_size",
            "4",
            "--num_iter",
            "20",
        ])
        .args(["--warmup_iter", "2", "--total_buffer_size", "1048576"])
        .output()
        .expect("sweep");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf8");
    assert!(
        text.contains("Block Size (B) | Batch Size | B/W (GB/Sec)"),
        "{text}"
    );
    // 3 block sizes (4K, 8K, 16K) x 3 batch sizes (1, 2, 4).
    let rows = text
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .count();
    assert_eq!(rows, 9, "{text}");
}

#[test]
fn bad_flags_are_errors() {
    let out = Command::new(PERF)
        .args(["write_bw", "--bogus"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown option --bogus"));
    let out = Command::new(PERF)
        .args(["sweep", "--max_block_size", "1"])
        .output()
        .expect("run");
    assert!(!out.status.success());
}

const RIXL: &str = env!("CARGO_BIN_EXE_rixl");

#[test]
fn rixl_info_lists_devices_ports_and_gids() {
    if device().is_none() {
        return;
    }
    let out = Command::new(RIXL).arg("info").output().expect("rixl info");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let dev = std::env::var("RIXL_RDMA_DEVICE").unwrap_or_else(|_| "rxe0".into());
    assert!(text.contains(&format!("  {dev} (node GUID")), "{text}");
    assert!(
        text.contains("port 1: ACTIVE") && text.contains("GID[1]"),
        "{text}"
    );
    assert!(text.contains("GPU backends:"), "{text}");
}

#[test]
fn rixl_topo_and_info_never_fail_without_hardware() {
    for cmd in ["topo", "info"] {
        let out = Command::new(RIXL).arg(cmd).output().expect("rixl");
        assert!(
            out.status.success(),
            "rixl {cmd}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = Command::new(RIXL).arg("topo").output().expect("rixl topo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("NUMA node(s)") && text.contains("NUMA 0: CPUs"),
        "{text}"
    );
    if device().is_some() {
        // In the guest: the software NIC is in the model and carries host memory's path.
        let dev = std::env::var("RIXL_RDMA_DEVICE").unwrap_or_else(|_| "rxe0".into());
        assert!(text.contains(&format!("RDMA on {dev}")), "{text}");
        assert!(text.contains("(software)"), "{text}");
    }
    let bad = Command::new(RIXL).arg("frobnicate").output().expect("rixl");
    assert!(!bad.status.success());
}

#[test]
fn rixl_topo_reads_an_hwloc_export_and_prints_matrix_and_paths() {
    let xml = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../topology/tests/fixtures/dgx-a100-like.xml"
    );
    let out = Command::new(RIXL)
        .args(["topo", "--xml", xml])
        .output()
        .expect("rixl topo --xml");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("8 GPU(s), 8 RDMA NIC(s)"), "{text}");
    let row = text
        .lines()
        .find(|l| l.starts_with("GPU3 "))
        .expect("GPU3 row");
    let cells: Vec<&str> = row.split_whitespace().collect();
    // GPU3's row: GPU0..GPU7 then mlx5_0..mlx5_7, NUMA, PCI.
    assert_eq!(
        &cells[1..9],
        ["NODE", "NODE", "PIX", "X", "SYS", "SYS", "SYS", "SYS"]
    );
    assert_eq!(&cells[9..13], ["NODE", "NODE", "PIX", "PIX"]);
    assert!(
        text.contains("GPU3 memory      GPUDirect RDMA on mlx5_3 (PIX)  rails [mlx5_3 mlx5_2]"),
        "{text}"
    );
    assert!(text.contains("host NUMA 1      RDMA on mlx5_4"), "{text}");
    let missing = Command::new(RIXL)
        .args(["topo", "--xml", "/nonexistent.xml"])
        .output()
        .expect("rixl");
    assert!(!missing.status.success());
}
