//! `gpu_check` (scripts/gpu-check) runs everywhere: its stages on a machine with a CUDA driver,
//! a printed reason to skip elsewhere.

#[test]
fn the_gpu_check_runs_or_says_why_it_skips() {
    let exe = std::env::current_exe().expect("exe");
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|p| p.join("examples/gpu_check"))
        .expect("examples dir");
    let out = std::process::Command::new(&bin)
        .output()
        .expect("gpu_check runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if rixl::gpudirect::cuda_available() {
        assert!(text.contains("bytes verified"), "{text}");
    } else {
        assert!(text.contains("SKIPPED gpu_check: CUDA driver"), "{text}");
        eprintln!("{}", text.trim());
    }
}
