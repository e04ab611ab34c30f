//! Test support for rixl's RDMA integration tests (used as a dev-dependency only).
//!
//! - [`require_or_skip`]: run a test against real hardware, or print why it is skipped (to stderr,
//!   past libtest's capture). `RIXL_REQUIRE_RDMA=1` (set by the guest suite) turns a skip into a
//!   failure, so a suite can never pass by skipping.
//! - [`spawn_peer`] / [`peer_control`]: the test binary re-executes itself as a peer process (an
//!   `#[ignore]`d entry test) that connects back over TCP on loopback.
//! - [`Control`]: a length-prefixed frame channel for the two processes' handshakes and commands.
//! - [`example`]: the path of a built example binary, for tests that run one.
#![forbid(unsafe_code)]

use std::fmt::Display;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};

/// Runs `open`; on error either skips (prints the reason, returns `None`) or, when
/// `RIXL_REQUIRE_RDMA=1`, panics.
pub fn require_or_skip<T, E: Display>(
    test: &str,
    open: impl FnOnce() -> Result<T, E>,
) -> Option<T> {
    match open() {
        Ok(v) => Some(v),
        Err(e) => {
            if std::env::var("RIXL_REQUIRE_RDMA").as_deref() == Ok("1") {
                panic!("{test}: RDMA required but unavailable: {e}");
            }
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: no RDMA device ({e}); run it in the rxe guest: scripts/rdma-suite"
            );
            None
        }
    }
}

/// Sends the library's `tracing` events to stderr when `RUST_LOG` is set (for example
/// `RUST_LOG=rixl=debug scripts/rdma-suite --nocapture heal_`); once per process.
pub fn init_logs() {
    if std::env::var_os("RUST_LOG").is_some() {
        init_logs_or("off");
    }
}

/// Sends the library's `tracing` events to stderr, filtered by `RUST_LOG` or, without it, by
/// `default` (for example `rixl=warn`); once per process.
pub fn init_logs_or(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Prints injected panics (fail points, whose message starts with `failpoint`) as one line,
/// without a backtrace; other panics go to the default hook.
///
/// The panic hook runs on the panicking thread before unwinding starts. With
/// `RUST_BACKTRACE=1`, the default hook symbolizes a backtrace there: on an engine core that
/// stalls the core, and with it every transfer it owns, for as long as the symbolization takes
/// (over a second for a debug test binary in the emulated guest). The supervision tests time
/// what supervision does, not the hook; once per process.
pub fn quiet_injected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let msg = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned());
            match msg {
                Some(m) if m.starts_with("failpoint") => {
                    let thread = std::thread::current();
                    let _ = writeln!(
                        std::io::stderr(),
                        "injected panic on thread {:?}: {m}",
                        thread.name().unwrap_or("?")
                    );
                }
                _ => default(info),
            }
        }));
    });
}

/// Writes one line of `mib` MiB (in 1 MiB pieces) to `addr`, stopping when the other side
/// closes; returns the bytes written and whatever the other side answered.
pub fn send_long_line(addr: std::net::SocketAddr, mib: usize) -> (usize, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_write_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let chunk = vec![b'x'; 1 << 20];
    let mut sent = 0usize;
    for _ in 0..mib {
        if s.write_all(&chunk).is_err() {
            break;
        }
        sent += chunk.len();
    }
    let _ = s.write_all(b"\n");
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    (sent, reply)
}

/// This process's resident set size in KiB (`VmRSS`; 0 when it cannot be read).
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The non-zero hardware counters of every RDMA device's ports (rxe's retries, sequence
/// errors, RNR NAKs, ...), one `device/port/name=value` per entry, for a failure's report.
pub fn rdma_hw_counters() -> String {
    let mut out = Vec::new();
    let Ok(devices) = std::fs::read_dir("/sys/class/infiniband") else {
        return "no /sys/class/infiniband".into();
    };
    for dev in devices.flatten() {
        let Ok(ports) = std::fs::read_dir(dev.path().join("ports")) else {
            continue;
        };
        for port in ports.flatten() {
            let Ok(counters) = std::fs::read_dir(port.path().join("hw_counters")) else {
                continue;
            };
            for c in counters.flatten() {
                let v = std::fs::read_to_string(c.path()).unwrap_or_default();
                let v = v.trim();
                if !v.is_empty() && v != "0" && !v.contains(' ') {
                    out.push(format!(
                        "{}/{}/{}={v}",
                        dev.file_name().to_string_lossy(),
                        port.file_name().to_string_lossy(),
                        c.file_name().to_string_lossy()
                    ));
                }
            }
        }
    }
    out.sort();
    out.join(" ")
}

/// Every thread of this process as `/proc` shows it, one line each: its id, name, state,
/// the kernel function it waits in, and (where readable: root) its kernel stack, for the
/// report of a core that stopped running.
pub fn thread_dump() -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return vec!["no /proc/self/task".into()];
    };
    let mut out = Vec::new();
    for t in tasks.flatten() {
        let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
        let stat = read("stat");
        // The state is the first field after the parenthesised name.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("?")
            .to_string();
        let stack: Vec<String> = read("stack")
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1).map(str::to_string))
            .collect();
        out.push(format!(
            "tid {} {:?} state {state} wchan {} stack [{}]",
            t.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan").trim(),
            stack.join(" < ")
        ));
    }
    out.sort();
    out
}

/// Prints a measurement line past libtest's output capture.
pub fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A framed control channel (u32 length + bytes).
#[derive(Debug)]
pub struct Control(pub TcpStream);

impl Control {
    /// Sends one frame.
    pub fn send(&mut self, bytes: &[u8]) {
        let len = u32::try_from(bytes.len()).expect("frame too large");
        self.0.write_all(&len.to_be_bytes()).expect("control write");
        self.0.write_all(bytes).expect("control write");
    }

    /// Receives one frame.
    pub fn recv(&mut self) -> Vec<u8> {
        let mut len = [0u8; 4];
        self.0.read_exact(&mut len).expect("control read");
        let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
        self.0.read_exact(&mut buf).expect("control read");
        buf
    }

    /// Sends a UTF-8 frame.
    pub fn send_str(&mut self, s: &str) {
        self.send(s.as_bytes());
    }

    /// Receives a UTF-8 frame.
    pub fn recv_str(&mut self) -> String {
        String::from_utf8(self.recv()).expect("utf8 frame")
    }
}

/// Spawns this test binary again as the peer: it runs the ignored test `peer_test` with
/// `RIXL_PEER_PORT` and `RIXL_PEER_SCENARIO` set, and connects back to the returned channel.
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
    let (stream, _) = listener.accept().expect("peer connects back");
    stream.set_nodelay(true).ok();
    (child, Control(stream))
}

/// In the peer process: the control channel and scenario name, or `None` when this process is
/// not a peer (the entry test then returns at once).
pub fn peer_control() -> Option<(Control, String)> {
    let port: u16 = std::env::var("RIXL_PEER_PORT").ok()?.parse().ok()?;
    let scenario = std::env::var("RIXL_PEER_SCENARIO").unwrap_or_default();
    let s = TcpStream::connect(("127.0.0.1", port)).expect("connect to parent");
    s.set_nodelay(true).ok();
    Some((Control(s), scenario))
}

/// Deterministic test pattern byte for `(seed, offset)`.
pub fn pattern(seed: u64, off: usize) -> u8 {
    let x =
        (off as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xd6e8_feb8_6659_fd93);
    (x >> 29) as u8 ^ (off as u8)
}

/// Fills `buf` with the pattern of `seed`, offsets counted from `base`.
pub fn fill_from(buf: &mut [u8], seed: u64, base: usize) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(seed, base + i);
    }
}

/// Fills `buf` with the pattern of `seed`.
pub fn fill(buf: &mut [u8], seed: u64) {
    fill_from(buf, seed, 0);
}

/// `len` bytes of the pattern of `seed`.
pub fn patterned(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed);
    v
}

/// An example binary of the workspace, built next to the test binaries
/// (`target/<profile>/examples/<name>`).
///
/// # Panics
/// If it was not built (`cargo test` builds the examples of the package under test).
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("exe");
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|p| p.join("examples").join(name))
        .expect("examples dir");
    assert!(path.exists(), "build the example first: {}", path.display());
    path
}

/// Waits until something accepts TCP connections at `addr` (a server another process is
/// starting); false if nothing did within `within`.
pub fn wait_listening(addr: &str, within: std::time::Duration) -> bool {
    let t0 = std::time::Instant::now();
    while TcpStream::connect(addr).is_err() {
        if t0.elapsed() > within {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    true
}

fn block_byte(seed: u64, block: u64, i: u64) -> u8 {
    let x = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(block.wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add(i);
    (x ^ (x >> 29)) as u8
}

/// Fills `buf` (at least 16 bytes) as block `block` of an owner with `seed`, a block that
/// describes itself: its first 16 bytes hold the seed and the block index, the rest a pattern
/// of both. A reader checks it with [`block_intact`] without knowing which owner (or which
/// incarnation of it) served it.
pub fn fill_block(buf: &mut [u8], seed: u64, block: u64) {
    buf[..8].copy_from_slice(&seed.to_le_bytes());
    buf[8..16].copy_from_slice(&block.to_le_bytes());
    for (i, b) in buf.iter_mut().enumerate().skip(16) {
        *b = block_byte(seed, block, i as u64);
    }
}

/// Whether `buf` is an intact block `block` (see [`fill_block`]) of some owner; returns that
/// owner's seed.
pub fn block_intact(buf: &[u8], block: u64) -> Option<u64> {
    let seed = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?);
    let index = u64::from_le_bytes(buf.get(8..16)?.try_into().ok()?);
    (index == block
        && buf
            .iter()
            .enumerate()
            .skip(16)
            .all(|(i, &b)| b == block_byte(seed, block, i as u64)))
    .then_some(seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_by_seed_and_offset() {
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 4096];
        fill(&mut a, 1);
        fill(&mut b, 2);
        assert_ne!(a, b);
        assert!(a.windows(2).any(|w| w[0] != w[1]));
        let mut c = vec![0u8; 100];
        fill_from(&mut c, 1, 50);
        assert_eq!(&c[..], &a[50..150]);
    }
}

pub mod s3;
