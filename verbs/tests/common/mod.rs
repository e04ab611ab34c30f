//! Verbs-level pieces of the RDMA integration tests (generic ones live in `rixl-testkit`).
#![allow(dead_code, unused_imports)]

use std::time::{Duration, Instant};

pub use rixl_testkit::{fill, pattern, peer_control, spawn_peer, Control};

use rixl_verbs::{
    CompletionQueue, ConnectOptions, Context, Endpoint, ProtectionDomain, QueuePair,
    QueuePairCapabilities, WorkCompletion,
};

/// Opens the RDMA device for a test, or explains why the test is skipped.
pub fn device_or_skip(test: &str) -> Option<Context> {
    let name = std::env::var("RIXL_RDMA_DEVICE").ok();
    rixl_testkit::require_or_skip(test, || Context::open(name.as_deref()))
}

/// Connection options from the environment (`RIXL_GID_INDEX`, default 1 = RoCEv2 IPv4 on rxe).
pub fn connect_options() -> ConnectOptions {
    let mut o = ConnectOptions::default();
    o.gid_index = std::env::var("RIXL_GID_INDEX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    // Fail fast on a dead peer in tests: 4.096 µs × 2^14 ≈ 67 ms per retry (2^12 was too short
    // for the emulated guest: a NAK for a bad rkey once came later than 4 x 17 ms).
    o.timeout = 14;
    o.retry_cnt = 3;
    o
}

/// One side of an RC connection: PD, CQ (send and receive share it), QP.
pub struct Side {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    pub psn: u32,
}

impl Side {
    pub fn new(ctx: &Context, cq_entries: u32, caps: QueuePairCapabilities) -> Side {
        let pd = ProtectionDomain::new(ctx).expect("alloc pd");
        let cq = CompletionQueue::new(ctx, cq_entries, false).expect("create cq");
        let qp = QueuePair::new_rc(&pd, &cq, &cq, caps).expect("create qp");
        let psn = (std::process::id() * 7919) & 0x00ff_ffff;
        Side {
            ctx: ctx.clone(),
            pd,
            cq,
            qp,
            psn,
        }
    }

    /// Exchanges endpoints over `ctl` and connects.
    pub fn connect(&self, ctl: &mut Control) {
        let opts = connect_options();
        let local = self.qp.endpoint(&opts, self.psn).expect("local endpoint");
        ctl.send(&local.to_bytes());
        let remote = Endpoint::from_bytes(&ctl.recv()).expect("remote endpoint");
        self.qp
            .connect(&remote, self.psn, &opts)
            .expect("connect queue pair");
    }

    /// Polls until `n` completions arrived (or `timeout`), returning them.
    pub fn wait(&self, n: usize, timeout: Duration) -> Vec<WorkCompletion> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(n);
        let mut buf = [WorkCompletion::default(); 32];
        while out.len() < n {
            let got = self.cq.poll(&mut buf).expect("poll cq");
            out.extend_from_slice(&buf[..got]);
            if got == 0 {
                assert!(
                    Instant::now() < deadline,
                    "timed out with {}/{} completions",
                    out.len(),
                    n
                );
                std::thread::yield_now();
            }
        }
        out
    }
}
