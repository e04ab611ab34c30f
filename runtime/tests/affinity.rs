//! Engines stay inside the process's CPU mask (`affinity_`): under `taskset -c N` (a container's
//! cpuset likewise) `available_cpus()` is `[N]`, and an engine placed with `cpu_at(0)` runs on N.
//! Before, CPUs were numbered `0..available_parallelism()`, so such an engine pinned itself to
//! CPU 0, outside the mask, next to whatever else the machine ran there.

use std::process::Command;

use rixl_runtime::{available_cpus, cpu_at, EngineConfig, EnginePool};

const CHILD: &str = "RIXL_AFFINITY_CHILD";

/// Every thread's `Cpus_allowed_list` (name, list).
fn thread_masks() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let dir = t.expect("entry").path();
        let Ok(status) = std::fs::read_to_string(dir.join("status")) else {
            continue; // the thread ended
        };
        let field = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        out.push((field("Name:"), field("Cpus_allowed_list:")));
    }
    out
}

#[test]
fn affinity_an_engine_stays_inside_a_taskset_mask() {
    if let Ok(want) = std::env::var(CHILD) {
        let want: usize = want.parse().expect("a CPU");
        assert_eq!(available_cpus(), vec![want]);
        assert_eq!(cpu_at(0), want);
        assert_eq!(cpu_at(5), want);
        let mut cfg = EngineConfig::from_env();
        cfg.require_nic = false;
        let pool = EnginePool::start(&cfg, &[cpu_at(0)], 1 << 20).expect("engine starts");
        let masks = thread_masks();
        assert!(masks.len() >= 2, "the engine's thread is there: {masks:?}");
        for (name, list) in &masks {
            assert_eq!(
                list,
                &want.to_string(),
                "thread {name} left the mask: {masks:?}"
            );
        }
        println!("affinity: under taskset -c {want}: {masks:?}");
        pool.shutdown();
        return;
    }
    let cpus = available_cpus();
    let Some(&last) = cpus.last().filter(|_| cpus.len() > 1) else {
        println!("affinity: skipped, one CPU only ({cpus:?}): no narrower mask to test");
        return;
    };
    if Command::new("taskset").arg("--version").output().is_err() {
        println!("affinity: skipped, no taskset (util-linux) to narrow the mask with");
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new("taskset")
        .args(["-c", &last.to_string()])
        .arg(exe)
        .args(["--exact", "affinity_an_engine_stays_inside_a_taskset_mask"])
        .args(["--nocapture", "--test-threads=1"])
        .env(CHILD, last.to_string())
        .output()
        .expect("taskset (util-linux) runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "the child under taskset failed:\n{text}"
    );
    assert!(text.contains("affinity: under taskset"), "{text}");
    println!(
        "{}",
        text.lines()
            .find_map(|l| l.find("affinity:").map(|i| &l[i..]))
            .unwrap_or_default()
    );
}
