//! Elastic membership under load, on a real device (rxe in the guest) with a real etcd: six
//! agent processes of the `churn` example join and leave (clean shutdown and SIGKILL) while the
//! others run verified transfers. Skipped without a device (a failure under
//! `RIXL_REQUIRE_RDMA=1`). `scripts/churn SECS` runs the long version.

use rixl_testkit::{example, report, require_or_skip};

#[test]
fn churn_six_agents_join_and_leave_while_the_others_transfer_with_nothing_lost() {
    if require_or_skip("churn", || {
        rixl::verbs::DeviceList::new().and_then(|l| l.find(None).map(|_| ()))
    })
    .is_none()
    {
        return;
    }
    let out = std::process::Command::new(example("churn"))
        .args(["--secs", "20", "--members", "6", "--period-ms", "2500"])
        .output()
        .expect("run churn");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("churn summary:"))
        .unwrap_or("no summary");
    report(summary);
    if let Some(timing) = stdout
        .lines()
        .find(|l| l.starts_with("churn: verified transfers took"))
    {
        report(timing);
    }
    assert!(
        out.status.success(),
        "churn failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        summary.contains(" 0 corrupted, 0 failed to live peers"),
        "{summary}"
    );
}
