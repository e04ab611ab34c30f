//! RC queue pair integration tests on a real RDMA device (rxe in the guest: `scripts/rdma-suite`).
//! Two processes: this test (initiator) and the same binary re-executed as the target peer.
//! On a host without RDMA every test prints why it is skipped.

mod common;

use std::time::Duration;

use common::{device_or_skip, fill, pattern, peer_control, spawn_peer, Control, Side};
use rixl_verbs::{
    AccessFlags, Context, DeviceList, Error, QueuePairCapabilities, QueuePairState, RecvBatch,
    RegisteredBuffer, SendBatch, SendFlags, SendOp, Sge, WcOpcode, WcStatus,
};

const TARGET_LEN: usize = 24 << 20;
const LOCAL_LEN: usize = 24 << 20;
const TIMEOUT: Duration = Duration::from_secs(60);

fn caps() -> QueuePairCapabilities {
    let mut c = QueuePairCapabilities::default();
    c.max_send_wr = 128;
    c.max_recv_wr = 64;
    c.max_send_sge = 4;
    c.max_recv_sge = 4;
    c.max_inline_data = 64;
    c
}

/// Remote buffer announced by the target.
#[derive(Clone, Copy)]
struct Remote {
    addr: u64,
    rkey: u32,
    len: u64,
}

/// The initiator's view of a connected pair.
struct Pair {
    side: Side,
    buf: RegisteredBuffer,
    remote: Remote,
    ctl: Control,
    child: std::process::Child,
}

impl Pair {
    fn open(ctx: &Context) -> Pair {
        let (child, mut ctl) = spawn_peer("peer_process", "target");
        let side = Side::new(ctx, 256, caps());
        let buf = RegisteredBuffer::new(&side.pd, LOCAL_LEN, AccessFlags::ALL_RDMA)
            .expect("register local buffer");
        let info = ctl.recv();
        let remote = Remote {
            addr: u64::from_be_bytes(info[0..8].try_into().expect("8")),
            rkey: u32::from_be_bytes(info[8..12].try_into().expect("4")),
            len: u64::from_be_bytes(info[12..20].try_into().expect("8")),
        };
        side.connect(&mut ctl);
        Pair {
            side,
            buf,
            remote,
            ctl,
            child,
        }
    }

    /// Both sides drop their QP and connect fresh ones (after an error completion).
    fn reconnect(&mut self) {
        self.ctl.send_str("reconnect");
        self.side.qp =
            rixl_verbs::QueuePair::new_rc(&self.side.pd, &self.side.cq, &self.side.cq, caps())
                .expect("new qp");
        drain(&self.side);
        self.side.connect(&mut self.ctl);
    }

    fn remote_bytes(&mut self, off: u64, len: usize) -> Vec<u8> {
        self.ctl.send_str(&format!("get {off} {len}"));
        self.ctl.recv()
    }

    fn post_one(&self, op: SendOp, sges: &[Sge], flags: SendFlags) {
        let mut b = SendBatch::default();
        b.push(0x51, op, sges, flags);
        // SAFETY: every entry lies in `self.buf`, which outlives the wait that follows each post.
        unsafe { self.side.qp.post_send(&mut b) }.expect("post_send");
    }

    fn finish(mut self) {
        self.ctl.send_str("quit");
        let status = self.child.wait().expect("wait peer");
        assert!(status.success(), "peer process failed: {status}");
    }
}

fn drain(side: &Side) {
    let mut buf = [rixl_verbs::WorkCompletion::default(); 16];
    while side.cq.poll(&mut buf).expect("poll") > 0 {}
}

/// Splits `[0, size)` into up to `k` uneven pieces placed at scattered local offsets (with gaps),
/// returning (local offset, len) per piece.
fn scatter(size: usize, k: usize, base: usize) -> Vec<(usize, usize)> {
    let k = k.min(size).max(1);
    let mut pieces = Vec::with_capacity(k);
    let mut left = size;
    let mut off = base;
    for i in 0..k {
        let len = if i + 1 == k {
            left
        } else {
            (left / (k - i)).max(1) + (i % 2) * (left / (3 * k)).min(left / (k - i))
        };
        let len = len.min(left - (k - i - 1));
        pieces.push((off, len));
        off += len + 4096 + 17 * i; // leave a gap so the entries are not contiguous
        left -= len;
    }
    assert_eq!(pieces.iter().map(|p| p.1).sum::<usize>(), size);
    pieces
}

fn sges(buf: &RegisteredBuffer, pieces: &[(usize, usize)]) -> Vec<Sge> {
    pieces
        .iter()
        .map(|&(off, len)| Sge {
            addr: buf.addr() + off as u64,
            length: u32::try_from(len).expect("piece fits u32"),
            lkey: buf.lkey(),
        })
        .collect()
}

const SIZES: [usize; 8] = [1, 2, 63, 4096, 65_537, 1 << 20, (3 << 20) + 5, 8 << 20];

#[test]
fn write_and_read_scattered_sge_lists_1b_to_8mib() {
    let Some(ctx) = device_or_skip("write_and_read_scattered_sge_lists_1b_to_8mib") else {
        return;
    };
    let mut p = Pair::open(&ctx);
    for (n, &size) in SIZES.iter().enumerate() {
        let pieces = scatter(size, 4, 64 * n);
        let roff = 4096 * n as u64 + 11;
        // WRITE: local scattered pieces -> one remote range; verify the peer's memory.
        let seed = 100 + n as u64;
        fill(p.buf.as_mut_slice(), seed);
        p.post_one(
            SendOp::Write {
                remote_addr: p.remote.addr + roff,
                rkey: p.remote.rkey,
            },
            &sges(&p.buf, &pieces),
            SendFlags::SIGNALED,
        );
        let wc = p.side.wait(1, TIMEOUT);
        wc[0].result().expect("write completes");
        assert_eq!(wc[0].opcode(), WcOpcode::RdmaWrite);
        let expect: Vec<u8> = pieces
            .iter()
            .flat_map(|&(off, len)| p.buf.as_slice()[off..off + len].to_vec())
            .collect();
        let got = p.remote_bytes(roff, size);
        assert!(got == expect, "WRITE of {size} B: remote bytes differ");

        // READ: one remote range (freshly patterned by the peer) -> scattered local pieces.
        let rseed = 900 + n as u64;
        p.ctl.send_str(&format!("fill {rseed}"));
        assert_eq!(p.ctl.recv_str(), "ok");
        p.buf.as_mut_slice().fill(0);
        p.post_one(
            SendOp::Read {
                remote_addr: p.remote.addr + roff,
                rkey: p.remote.rkey,
            },
            &sges(&p.buf, &pieces),
            SendFlags::SIGNALED,
        );
        let wc = p.side.wait(1, TIMEOUT);
        wc[0].result().expect("read completes");
        assert_eq!(wc[0].opcode(), WcOpcode::RdmaRead);
        let mut at = roff as usize;
        for &(off, len) in &pieces {
            let local = &p.buf.as_slice()[off..off + len];
            assert!(
                local
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == pattern(rseed, at + i)),
                "READ of {size} B: piece at {off} differs"
            );
            at += len;
        }
        // The gaps between pieces were not touched.
        if pieces.len() > 1 {
            let gap = pieces[0].0 + pieces[0].1;
            assert_eq!(p.buf.as_slice()[gap], 0, "READ wrote outside its entries");
        }
    }
    p.finish();
}

#[test]
fn send_recv_and_write_with_imm_deliver_data_and_immediates() {
    let Some(ctx) = device_or_skip("send_recv_and_write_with_imm_deliver_data_and_immediates")
    else {
        return;
    };
    let mut p = Pair::open(&ctx);
    let sizes = [1usize, 100, 4096, 65_536];
    p.ctl.send_str("recv 4 65536");
    assert_eq!(p.ctl.recv_str(), "ok");
    fill(p.buf.as_mut_slice(), 7);
    let mut b = SendBatch::default();
    let all: Vec<Vec<Sge>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| sges(&p.buf, &scatter(s, 3, i * (1 << 20))))
        .collect();
    for (i, s) in all.iter().enumerate() {
        b.push(i as u64, SendOp::Send, s, SendFlags::SIGNALED);
    }
    // SAFETY: all entries lie in `p.buf`, alive until the completions below.
    unsafe { p.side.qp.post_send(&mut b) }.expect("post sends");
    for wc in p.side.wait(sizes.len(), TIMEOUT) {
        wc.result().expect("send completes");
    }
    p.ctl.send_str(&format!("wait {}", sizes.len()));
    let report = p.ctl.recv_str();
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(lines.len(), sizes.len(), "receives: {report}");
    for (i, line) in lines.iter().enumerate() {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f[0], i.to_string(), "receive order: {report}");
        assert_eq!(f[1], "IBV_WC_SUCCESS");
        assert_eq!(f[2], "Recv");
        assert_eq!(f[3], sizes[i].to_string(), "byte_len of receive {i}");
        let expect: Vec<u8> = scatter(sizes[i], 3, i * (1 << 20))
            .iter()
            .flat_map(|&(off, len)| p.buf.as_slice()[off..off + len].to_vec())
            .collect();
        assert!(
            p.remote_bytes((i * 65_536) as u64, sizes[i]) == expect,
            "SEND {i} payload"
        );
    }

    // An inline SEND (payload copied into the WQE).
    p.ctl.send_str("recv 1 64");
    assert_eq!(p.ctl.recv_str(), "ok");
    let inline = SendFlags {
        signaled: true,
        inline: true,
        ..SendFlags::default()
    };
    p.post_one(SendOp::Send, &sges(&p.buf, &[(5, 40)]), inline);
    p.side.wait(1, TIMEOUT)[0].result().expect("inline send");
    p.ctl.send_str("wait 1");
    assert!(p.ctl.recv_str().contains("IBV_WC_SUCCESS Recv 40"));
    assert!(p.remote_bytes(0, 40) == p.buf.as_slice()[5..45]);

    // WRITE_WITH_IMM: data lands by RDMA, the immediate arrives in a receive with no entries.
    p.ctl.send_str("recv 1 0");
    assert_eq!(p.ctl.recv_str(), "ok");
    p.post_one(
        SendOp::WriteWithImm {
            remote_addr: p.remote.addr + (8 << 20),
            rkey: p.remote.rkey,
            imm: 0xdead_beef,
        },
        &sges(&p.buf, &scatter(8192, 2, 0)),
        SendFlags::SIGNALED,
    );
    p.side.wait(1, TIMEOUT)[0].result().expect("write with imm");
    p.ctl.send_str("wait 1");
    let line = p.ctl.recv_str();
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        &f[1..],
        ["IBV_WC_SUCCESS", "RecvRdmaWithImm", "8192", "0xdeadbeef"],
        "{line}"
    );
    let expect: Vec<u8> = scatter(8192, 2, 0)
        .iter()
        .flat_map(|&(off, len)| p.buf.as_slice()[off..off + len].to_vec())
        .collect();
    assert!(p.remote_bytes(8 << 20, 8192) == expect);
    p.finish();
}

#[test]
fn bad_keys_and_out_of_range_addresses_complete_with_errors() {
    let Some(ctx) = device_or_skip("bad_keys_and_out_of_range_addresses_complete_with_errors")
    else {
        return;
    };
    let mut p = Pair::open(&ctx);
    let one = sges(&p.buf, &[(0, 256)]);
    let cases: [(&str, SendOp, WcStatus); 3] = [
        (
            "wrong rkey",
            SendOp::Write {
                remote_addr: p.remote.addr,
                rkey: p.remote.rkey ^ 0x5a5a_0000,
            },
            WcStatus::RemoteAccessError,
        ),
        (
            "write past the end",
            SendOp::Write {
                remote_addr: p.remote.addr + p.remote.len - 100,
                rkey: p.remote.rkey,
            },
            WcStatus::RemoteAccessError,
        ),
        (
            "read before the start",
            SendOp::Read {
                remote_addr: p.remote.addr - 4096,
                rkey: p.remote.rkey,
            },
            WcStatus::RemoteAccessError,
        ),
    ];
    for (what, op, want) in cases {
        p.post_one(op, &one, SendFlags::SIGNALED);
        let wc = p.side.wait(1, TIMEOUT);
        assert_eq!(wc[0].status(), want, "{what}");
        match wc[0].result() {
            Err(Error::Completion { status, .. }) => assert_eq!(status, want),
            other => panic!("{what}: expected a completion error, got {other:?}"),
        }
        p.reconnect();
    }
    // A local entry under a wrong lkey is a local protection error.
    let mut bad = one.clone();
    bad[0].lkey ^= 0x0100_0000;
    p.post_one(
        SendOp::Write {
            remote_addr: p.remote.addr,
            rkey: p.remote.rkey,
        },
        &bad,
        SendFlags::SIGNALED,
    );
    let wc = p.side.wait(1, TIMEOUT);
    // Providers differ: mlx5 reports a bad lkey as LOC_PROT_ERR, rxe (kernel 6.1) as LOC_QP_OP_ERR.
    assert!(
        matches!(
            wc[0].status(),
            WcStatus::LocalProtectionError | WcStatus::LocalQpOperationError
        ),
        "bad lkey gave {}",
        wc[0].status()
    );
    p.reconnect();
    // After all that, a good write still works on the fresh connection.
    fill(p.buf.as_mut_slice(), 3);
    p.post_one(
        SendOp::Write {
            remote_addr: p.remote.addr,
            rkey: p.remote.rkey,
        },
        &one,
        SendFlags::SIGNALED,
    );
    p.side.wait(1, TIMEOUT)[0]
        .result()
        .expect("write after errors");
    assert!(p.remote_bytes(0, 256) == p.buf.as_slice()[..256]);
    p.finish();
}

#[test]
fn moving_a_queue_pair_to_error_flushes_outstanding_work() {
    let Some(ctx) = device_or_skip("moving_a_queue_pair_to_error_flushes_outstanding_work") else {
        return;
    };
    let p = Pair::open(&ctx);
    let mut r = RecvBatch::default();
    for i in 0..32u64 {
        r.push(1000 + i, &sges(&p.buf, &[(i as usize * 4096, 4096)]));
    }
    // SAFETY: receives target `p.buf`, alive until the flush completions are polled below.
    unsafe { p.side.qp.post_recv(&mut r) }.expect("post receives");
    let mut b = SendBatch::default();
    for i in 0..64u64 {
        b.push(
            i,
            SendOp::Write {
                remote_addr: p.remote.addr + i * 65_536,
                rkey: p.remote.rkey,
            },
            &sges(&p.buf, &[(i as usize * 65_536, 65_536)]),
            SendFlags::SIGNALED,
        );
    }
    // SAFETY: as above.
    unsafe { p.side.qp.post_send(&mut b) }.expect("post writes");
    p.side.qp.to_error().expect("move to error");
    assert_eq!(p.side.qp.state(), QueuePairState::Error);
    let wcs = p.side.wait(96, TIMEOUT);
    let recvs: Vec<_> = wcs.iter().filter(|w| w.wr_id() >= 1000).collect();
    assert_eq!(recvs.len(), 32);
    assert!(recvs
        .iter()
        .all(|w| w.status() == WcStatus::WorkRequestFlushError));
    let writes: Vec<_> = wcs.iter().filter(|w| w.wr_id() < 1000).collect();
    assert_eq!(writes.len(), 64);
    let flushed = writes
        .iter()
        .filter(|w| w.status() == WcStatus::WorkRequestFlushError)
        .count();
    assert!(
        writes.iter().all(|w| matches!(
            w.status(),
            WcStatus::Success | WcStatus::WorkRequestFlushError
        )),
        "writes end in success or flush"
    );
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!("flush test: {flushed}/64 writes flushed, 32/32 receives flushed\n").as_bytes(),
    );
    // Posting to a QP in error is accepted and completes flushed too (never hangs).
    let mut b = SendBatch::default();
    b.push(
        7,
        SendOp::Send,
        &sges(&p.buf, &[(0, 8)]),
        SendFlags::SIGNALED,
    );
    // SAFETY: as above.
    unsafe { p.side.qp.post_send(&mut b) }.expect("post after error");
    assert_eq!(
        p.side.wait(1, TIMEOUT)[0].status(),
        WcStatus::WorkRequestFlushError
    );
    assert!(matches!(
        p.side.qp.to_rts(0, &common::connect_options()),
        Err(Error::InvalidTransition { .. })
    ));
    p.finish();
}

#[test]
fn ten_thousand_work_requests_complete_without_cq_overflow() {
    let Some(ctx) = device_or_skip("ten_thousand_work_requests_complete_without_cq_overflow")
    else {
        return;
    };
    let mut p = Pair::open(&ctx);
    const N: usize = 10_000;
    const MSG: usize = 64;
    const SIGNAL_EVERY: usize = 16;
    const BATCH: usize = 32;
    let sq_depth = p.side.qp.capabilities().max_send_wr as usize;
    let cq_cap = p.side.cq.capacity() as usize;
    fill(p.buf.as_mut_slice(), 77);
    let mut posted = 0usize;
    let mut completed_wrs = 0usize; // WRs whose SQ slot is known free (covered by a signaled completion)
    let mut signaled_outstanding = 0usize;
    let mut signaled_seen = 0usize;
    let mut max_sq = 0usize;
    let mut max_cq = 0usize;
    let mut batch = SendBatch::with_capacity(BATCH, 1);
    let mut wcs = [rixl_verbs::WorkCompletion::default(); 32];
    let deadline = std::time::Instant::now() + TIMEOUT;
    while completed_wrs < N {
        // Post while SQ slots and CQ credits allow.
        batch.clear();
        let mut sig_in_batch = 0;
        while posted + batch.len() < N
            && batch.len() < BATCH
            && posted - completed_wrs + batch.len() < sq_depth
        {
            let i = posted + batch.len();
            let signaled = (i + 1).is_multiple_of(SIGNAL_EVERY) || i + 1 == N;
            if signaled && signaled_outstanding + sig_in_batch + 1 > cq_cap {
                break;
            }
            sig_in_batch += usize::from(signaled);
            batch.push(
                i as u64,
                SendOp::Write {
                    remote_addr: p.remote.addr + (i * MSG) as u64,
                    rkey: p.remote.rkey,
                },
                &[Sge {
                    addr: p.buf.addr() + (i * MSG) as u64,
                    length: MSG as u32,
                    lkey: p.buf.lkey(),
                }],
                SendFlags {
                    signaled,
                    ..SendFlags::default()
                },
            );
        }
        if !batch.is_empty() {
            // SAFETY: entries lie in `p.buf`, alive until every completion is reaped.
            unsafe { p.side.qp.post_send(&mut batch) }.expect("post within SQ credits");
            posted += batch.len();
            signaled_outstanding += sig_in_batch;
            max_sq = max_sq.max(posted - completed_wrs);
            max_cq = max_cq.max(signaled_outstanding);
        }
        let n = p.side.cq.poll(&mut wcs).expect("poll");
        for wc in &wcs[..n] {
            wc.result().expect("write completes");
            // A signaled completion frees its own slot and every unsignaled one before it.
            completed_wrs = completed_wrs.max(wc.wr_id() as usize + 1);
            signaled_outstanding -= 1;
            signaled_seen += 1;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "stalled at {completed_wrs}/{N}"
        );
    }
    assert_eq!(signaled_seen, N.div_ceil(SIGNAL_EVERY));
    assert!(max_sq <= sq_depth && max_cq <= cq_cap);
    let got = p.remote_bytes(0, N * MSG);
    assert!(got == p.buf.as_slice()[..N * MSG], "10 000 writes landed");
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!(
            "10k WRs: max SQ occupancy {max_sq}/{sq_depth}, max CQ occupancy {max_cq}/{cq_cap}\n"
        )
        .as_bytes(),
    );
    p.finish();
}

#[test]
fn one_request_posts_check_their_entry_and_limits_and_move_data() {
    let Some(ctx) = device_or_skip("one_request_posts_check_their_entry_and_limits_and_move_data")
    else {
        return;
    };
    let mut p = Pair::open(&ctx);
    let write = SendOp::Write {
        remote_addr: p.remote.addr,
        rkey: p.remote.rkey,
    };
    let inside = sges(&p.buf, &[(4096, 4096)])[0];
    // Refused before the NIC sees anything: an entry past the buffer, under another lkey, and
    // inline data over the queue pair's limit.
    let mut past = inside;
    past.addr = p.buf.addr() + LOCAL_LEN as u64 - 100;
    let mut foreign = inside;
    foreign.lkey ^= 0x0100_0000;
    for (what, sge) in [("past the end", past), ("another lkey", foreign)] {
        match p
            .side
            .qp
            .post_send_one_in(1, write, sge, SendFlags::SIGNALED, &p.buf)
        {
            Err(Error::InvalidArgument(_)) => {}
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    }
    let inline = SendFlags {
        inline: true,
        ..SendFlags::SIGNALED
    };
    match p.side.qp.post_send_one_in(2, write, inside, inline, &p.buf) {
        Err(Error::Limit { what, .. }) => assert!(what.contains("inline"), "{what}"),
        other => panic!("4 KiB inline: expected a limit error, got {other:?}"),
    }
    let mut buf = [rixl_verbs::WorkCompletion::default(); 4];
    assert_eq!(
        p.side.cq.poll(&mut buf).expect("poll"),
        0,
        "nothing was posted"
    );
    // A WRITE (inline, 64 B, then 4 KiB from the NIC's read) and a READ back into another place.
    fill(p.buf.as_mut_slice(), 11);
    let small = sges(&p.buf, &[(4096, 64)])[0];
    p.side
        .qp
        .post_send_one_in(3, write, small, inline, &p.buf)
        .expect("inline write");
    assert_eq!(p.side.wait(1, TIMEOUT)[0].wr_id(), 3);
    assert!(p.remote_bytes(0, 64) == p.buf.as_slice()[4096..4096 + 64]);
    p.side
        .qp
        .post_send_one_in(4, write, inside, SendFlags::SIGNALED, &p.buf)
        .expect("write");
    p.side.wait(1, TIMEOUT)[0]
        .result()
        .expect("write completes");
    assert!(p.remote_bytes(0, 4096) == p.buf.as_slice()[4096..8192]);
    let read = SendOp::Read {
        remote_addr: p.remote.addr,
        rkey: p.remote.rkey,
    };
    let back = sges(&p.buf, &[(1 << 20, 4096)])[0];
    p.side
        .qp
        .post_send_one_in(5, read, back, SendFlags::SIGNALED, &p.buf)
        .expect("read");
    p.side.wait(1, TIMEOUT)[0].result().expect("read completes");
    let b = p.buf.as_slice();
    assert!(
        b[1 << 20..(1 << 20) + 4096] == b[4096..8192],
        "READ brought back the WRITE"
    );
    p.finish();
}

#[test]
fn missing_devices_are_typed_errors() {
    match DeviceList::new() {
        Err(e) => assert!(e.is_no_device(), "unexpected error: {e}"),
        Ok(list) => {
            let err = list.find(Some("no-such-device")).expect_err("bogus name");
            assert!(matches!(
                err,
                Error::DeviceNotFound { .. } | Error::NoDevice { .. }
            ));
        }
    }
    let err = Context::open(Some("no-such-device")).expect_err("bogus name");
    assert!(
        matches!(err, Error::DeviceNotFound { .. } | Error::NoDevice { .. }),
        "{err}"
    );
}

/// The target peer: registers a buffer, announces it, connects, then serves commands.
#[test]
#[ignore = "peer process entry point; spawned by the RDMA tests"]
fn peer_process() {
    let Some((mut ctl, _scenario)) = peer_control() else {
        return;
    };
    let ctx = Context::open(std::env::var("RIXL_RDMA_DEVICE").ok().as_deref()).expect("device");
    let mut side = Side::new(&ctx, 256, caps());
    let mut buf =
        RegisteredBuffer::new(&side.pd, TARGET_LEN, AccessFlags::ALL_RDMA).expect("register");
    fill(buf.as_mut_slice(), 1);
    let mut info = Vec::new();
    info.extend_from_slice(&buf.addr().to_be_bytes());
    info.extend_from_slice(&buf.rkey().to_be_bytes());
    info.extend_from_slice(&(buf.len() as u64).to_be_bytes());
    ctl.send(&info);
    side.connect(&mut ctl);
    loop {
        let cmd = ctl.recv_str();
        let f: Vec<&str> = cmd.split_whitespace().collect();
        match f.as_slice() {
            ["quit"] => break,
            ["fill", seed] => {
                fill(buf.as_mut_slice(), seed.parse().expect("seed"));
                ctl.send_str("ok");
            }
            ["get", off, len] => {
                let (off, len): (usize, usize) =
                    (off.parse().expect("off"), len.parse().expect("len"));
                ctl.send(&buf.as_slice()[off..off + len]);
            }
            ["recv", n, size] => {
                let (n, size): (usize, usize) =
                    (n.parse().expect("n"), size.parse().expect("size"));
                let mut r = RecvBatch::default();
                for i in 0..n {
                    let sge = Sge {
                        addr: buf.addr() + (i * size) as u64,
                        length: size as u32,
                        lkey: buf.lkey(),
                    };
                    r.push(
                        i as u64,
                        if size == 0 {
                            &[]
                        } else {
                            std::slice::from_ref(&sge)
                        },
                    );
                }
                // SAFETY: receives target `buf`, which lives until this process exits.
                unsafe { side.qp.post_recv(&mut r) }.expect("post receives");
                ctl.send_str("ok");
            }
            ["wait", n] => {
                let wcs = side.wait(n.parse().expect("n"), TIMEOUT);
                let report: Vec<String> = wcs
                    .iter()
                    .map(|w| {
                        format!(
                            "{} {} {:?} {}{}",
                            w.wr_id(),
                            w.status(),
                            w.opcode(),
                            w.byte_len(),
                            w.imm_data().map(|i| format!(" {i:#x}")).unwrap_or_default()
                        )
                    })
                    .collect();
                ctl.send_str(&report.join("\n"));
            }
            ["reconnect"] => {
                side.qp = rixl_verbs::QueuePair::new_rc(&side.pd, &side.cq, &side.cq, caps())
                    .expect("new qp");
                drain(&side);
                side.connect(&mut ctl);
            }
            other => panic!("peer: unknown command {other:?}"),
        }
    }
}
