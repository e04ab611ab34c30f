//! Host-staged RDMA on real rxe: memory marked staged (host memory standing in for GPU memory
//! without GPUDirect, copied by an injected copier that sleeps per copy like a device copy
//! engine) moves through the agent's registered staging slots, the copy overlapping the wire,
//! memory bounded by the slots.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_lite::future::block_on;
use rixl::agent::{Agent, AgentConfig, AgentError, RemoteRef, Visibility, STAGE_SLOTS};
use rixl::runtime::LocalDescList;
use rixl::staging::{Copier, StagingError};
use rixl_testkit::{patterned, report, require_or_skip};

fn agent(name: &str, cpu: usize) -> Option<Agent> {
    rixl_testkit::init_logs();
    require_or_skip(name, || {
        let mut cfg = AgentConfig::default();
        cfg.cpu = rixl::runtime::cpu_at(cpu);
        Agent::new(name, cfg)
    })
}

#[test]
fn staged_writes_and_reads_go_through_bounded_slots_with_the_copy_overlapping_the_wire() {
    let Some(a) = agent("staged-a", 0) else {
        return;
    };
    let Some(b) = agent("staged-b", 1) else {
        return;
    };
    // 24 MiB + 1 KiB of "device" memory on a, in 49 scattered 512 KiB pieces (the last one
    // short): 7 chunks of 4 MiB, the last partial.
    let piece = 512u64 << 10;
    let pieces = 49u64;
    let len = (pieces - 1) * piece + 1024;
    let src = block_on(a.register(pieces as usize * piece as usize, Visibility::All)).expect("src");
    let dst = block_on(b.register(len as usize, Visibility::All)).expect("dst");
    let standin = common::StandIn::new(Duration::from_millis(2));
    // One direct WRITE first: the connection is made before the staged transfer is timed.
    let mut first = LocalDescList::new();
    first.push(src.region(), 0, 4096);
    let remote_first = [RemoteRef {
        region: dst.id(),
        offset: 0,
        len: 4096,
    }];
    let peer = {
        let addr = b.listen("127.0.0.1:0").expect("listen");
        let peer = a
            .fetch_remote_metadata(&addr.to_string())
            .expect("metadata");
        block_on(a.write(&peer, &first, &remote_first)).expect("direct warm-up");
        peer
    };
    a.set_staged(&src, true, Some(standin.clone() as Arc<dyn Copier>))
        .expect("stage");
    assert!(a.is_staged(&src));
    let data = patterned(pieces as usize * piece as usize, 31);
    src.region().write_at(0, &data).expect("fill");
    // Local pieces in a shuffled order; the remote side in stream order.
    let order: Vec<u64> = (0..pieces).map(|i| (i * 17) % pieces).collect();
    let mut local = LocalDescList::new();
    let mut expect = Vec::with_capacity(len as usize);
    for (k, &i) in order.iter().enumerate() {
        let n = if k as u64 == pieces - 1 { 1024 } else { piece };
        local.push(src.region(), i * piece, n);
        expect.extend_from_slice(&data[(i * piece) as usize..(i * piece + n) as usize]);
    }
    let remote = [RemoteRef {
        region: dst.id(),
        offset: 0,
        len,
    }];
    let st = block_on(a.write(&peer, &local, &remote)).expect("staged write");
    assert_eq!((st.bytes, st.staged_bytes), (len, len));
    let mut got = vec![0u8; len as usize];
    dst.region().read_at(0, &mut got).expect("read back");
    assert!(
        got == expect,
        "every byte of the staged WRITE arrived in order"
    );
    let w = a.staging_counters();
    assert_eq!((w.transfers, w.chunks, w.bytes), (1, 7, len));
    assert!(
        w.slots_high_water >= 2 && w.slots_high_water <= STAGE_SLOTS,
        "chunks in flight at once, bounded by the slots: {w:?}"
    );
    assert!(
        w.copy_time + w.wire_time > w.wall_time,
        "copies overlapped the wire: {w:?}"
    );
    assert_eq!(standin.copies.load(Ordering::SeqCst), pieces as usize);
    // READ back into the staged memory, changed on the peer first.
    let changed: Vec<u8> = expect.iter().map(|x| x.wrapping_add(7)).collect();
    dst.region().write_at(0, &changed).expect("change");
    let st = block_on(a.read(&peer, &local, &remote)).expect("staged read");
    assert_eq!(st.staged_bytes, len);
    for (k, &i) in order.iter().enumerate() {
        let n = if k as u64 == pieces - 1 { 1024 } else { piece } as usize;
        let mut mine = vec![0u8; n];
        src.region().read_at(i * piece, &mut mine).expect("read");
        let at = k * piece as usize;
        assert!(mine == changed[at..at + n], "piece {k} of the staged READ");
    }
    let r = a.staging_counters();
    assert_eq!((r.transfers, r.chunks), (2, 14));
    // A failing copy: a typed error, nothing hangs, and the slots come back.
    standin.fail.store(true, Ordering::SeqCst);
    let failed = block_on(a.write(&peer, &local, &remote));
    assert!(
        matches!(failed, Err(AgentError::Staging(StagingError::Closed))),
        "{failed:?}"
    );
    standin.fail.store(false, Ordering::SeqCst);
    block_on(a.write(&peer, &local, &remote)).expect("the slots came back");
    // Unmarked, the same memory goes direct again.
    a.set_staged(&src, false, None).expect("unstage");
    let st = block_on(a.write(&peer, &local, &remote)).expect("direct write");
    assert_eq!(st.staged_bytes, 0);
    assert!(matches!(
        b.set_staged(&src, true, None),
        Err(AgentError::UnknownLocalRegion(_))
    ));
    // The automatic choice: the next large transfer direct, the one after staged, both timed,
    // then the faster kept for the ones after.
    a.measure_staging(&src, Some(standin.clone() as Arc<dyn Copier>))
        .expect("arm");
    let first = block_on(a.write(&peer, &local, &remote)).expect("measured direct");
    assert_eq!(
        first.staged_bytes, 0,
        "the first measured transfer runs direct"
    );
    assert_eq!(a.staging_choice(&src), None, "not decided after one");
    let second = block_on(a.write(&peer, &local, &remote)).expect("measured staged");
    assert_eq!(second.staged_bytes, len, "the second runs staged");
    let auto = a.staging_choice(&src).expect("decided after both");
    assert_eq!(a.is_staged(&src), auto.staged_chosen, "{auto:?}");
    let third = block_on(a.write(&peer, &local, &remote)).expect("after the choice");
    assert_eq!(third.staged_bytes > 0, auto.staged_chosen);
    dst.region().read_at(0, &mut got).expect("read back");
    // The staged READ above left the peer's changed bytes in `src`.
    assert!(got == changed, "measured transfers deliver every byte");
    // Measured choice on request: one READ each way, the faster kept.
    let cal = block_on(a.calibrate_staging(&src, &peer, remote[0])).expect("calibrate");
    assert_eq!(cal.bytes, 16 << 20);
    assert!(cal.direct.is_some(), "host memory is reachable directly");
    assert_eq!(a.is_staged(&src), cal.staged_chosen);
    assert_eq!(
        cal.staged_chosen,
        cal.staged < cal.direct.expect("direct"),
        "{cal:?}"
    );
    report(&format!(
        "staged RDMA: WRITE {len} B in {} chunks, copy {:?} + wire {:?} in {:?} wall (overlap {:.2}x), slots high water {}; calibration {cal:?}; automatic {auto:?}",
        w.chunks,
        w.copy_time,
        w.wire_time,
        w.wall_time,
        (w.copy_time + w.wire_time).as_secs_f64() / w.wall_time.as_secs_f64(),
        w.slots_high_water
    ));
    a.shutdown();
    b.shutdown();
}
