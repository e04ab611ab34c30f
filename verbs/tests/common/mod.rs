//! Shared pieces of the RDMA integration tests: device discovery with honest skipping, a peer
//! process (this same test binary re-executed), and a tiny framed TCP control channel.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rixl_verbs::{
    CompletionQueue, ConnectOptions, Context, Endpoint, ProtectionDomain, QueuePair,
    QueuePairCapabilities, WorkCompletion,
};

/// Opens the RDMA device for a test, or explains on stderr why the test is skipped. When
/// `RIXL_REQUIRE_RDMA=1` (the guest suite sets it) a missing device fails the test instead.
pub fn device_or_skip(test: &str) -> Option<Context> {
    let name = std::env::var("RIXL_RDMA_DEVICE").ok();
    match Context::open(name.as_deref()) {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            if std::env::var("RIXL_REQUIRE_RDMA").as_deref() == Ok("1") {
                panic!("{test}: RDMA required but unavailable: {e}");
            }
            // Written straight to stderr so libtest's capture does not hide it.
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: no RDMA device ({e}); run it in the rxe guest: scripts/rdma-suite"
            );
            None
        }
    }
}

/// Connection options from the environment (`RIXL_GID_INDEX`, default 1 = RoCEv2 IPv4 on rxe).
pub fn connect_options() -> ConnectOptions {
    let mut o = ConnectOptions::default();
    o.gid_index = std::env::var("RIXL_GID_INDEX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    // Fail fast on a dead peer in tests: 4.096 µs × 2^12 ≈ 17 ms per retry.
    o.timeout = 12;
    o.retry_cnt = 3;
    o
}

/// A framed control channel (u32 length + bytes).
pub struct Control(pub TcpStream);

impl Control {
    pub fn send(&mut self, bytes: &[u8]) {
        let len = u32::try_from(bytes.len()).expect("frame too large");
        self.0.write_all(&len.to_be_bytes()).expect("control write");
        self.0.write_all(bytes).expect("control write");
    }

    pub fn recv(&mut self) -> Vec<u8> {
        let mut len = [0u8; 4];
        self.0.read_exact(&mut len).expect("control read");
        let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
        self.0.read_exact(&mut buf).expect("control read");
        buf
    }

    pub fn send_str(&mut self, s: &str) {
        self.send(s.as_bytes());
    }

    pub fn recv_str(&mut self) -> String {
        String::from_utf8(self.recv()).expect("utf8 frame")
    }
}

/// Spawns this test binary again as the peer: it runs the ignored test `peer_test` with
/// `RIXL_PEER_PORT` set, and connects back to the returned listener.
pub fn spawn_peer(peer_test: &str, scenario: &str) -> (Child, Control) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind control listener");
    let port = listener.local_addr().expect("addr").port();
    let exe = std::env::current_exe().expect("current exe");
    let child = Command::new(exe)
        .args([
            peer_test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("RIXL_PEER_PORT", port.to_string())
        .env("RIXL_PEER_SCENARIO", scenario)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn peer process");
    listener.set_nonblocking(false).expect("blocking listener");
    let (stream, _) = listener.accept().expect("peer connects back");
    stream.set_nodelay(true).ok();
    (child, Control(stream))
}

/// In the peer process: the control channel to the parent, or `None` when this process is not a
/// peer (the peer entry test then returns at once).
pub fn peer_control() -> Option<(Control, String)> {
    let port: u16 = std::env::var("RIXL_PEER_PORT").ok()?.parse().ok()?;
    let scenario = std::env::var("RIXL_PEER_SCENARIO").unwrap_or_default();
    let s = TcpStream::connect(("127.0.0.1", port)).expect("connect to parent");
    s.set_nodelay(true).ok();
    Some((Control(s), scenario))
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

/// Deterministic test pattern byte for `(seed, offset)`.
pub fn pattern(seed: u64, off: usize) -> u8 {
    let x =
        (off as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xd6e8_feb8_6659_fd93);
    (x >> 29) as u8 ^ (off as u8)
}

pub fn fill(buf: &mut [u8], seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(seed, i);
    }
}
