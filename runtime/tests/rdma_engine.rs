//! Runtime integration tests on a real RDMA device (rxe in the guest: `scripts/rdma-suite`).
//! Two processes: this test drives engines; the same binary re-executed is the peer, which runs
//! its own engine and serves commands over a control channel. Without a device every test prints
//! why it is skipped.

use std::time::{Duration, Instant};

use futures_lite::future::{block_on, poll_once};
use glommio::{LocalExecutorBuilder, Placement};
use rixl_runtime::{
    ConnId, Engine, EngineConfig, EngineHandle, EnginePool, InvalidDescriptor, LocalDescList,
    Message, Op, Received, Region, RemoteDesc, RemoteDescList, TransferError, TransferOptions,
    DEFAULT_IO_MEMORY,
};
use rixl_testkit::{fill, pattern, peer_control, report, require_or_skip, spawn_peer, Control};
use rixl_verbs::{Endpoint, WcStatus};

const REGION: usize = 64 << 20;
const SLOT: u64 = 512;
const SLOTS: u64 = (REGION as u64) / SLOT;
const BLOCK: u64 = 256;

/// Scattered, never-adjacent slot of descriptor `i` (odd multipliers permute 2^17 slots).
fn local_slot(i: u64) -> u64 {
    (i.wrapping_mul(7919) + 3) % SLOTS
}
fn remote_slot(i: u64) -> u64 {
    (i.wrapping_mul(104_729) + 13) % SLOTS
}

fn fnv(h: u64, data: &[u8]) -> u64 {
    data.iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Checksum of the blocks of descriptors `0..n` read through `read(offset, buf)`.
fn blocks_sum(n: u64, slot: fn(u64) -> u64, mut read: impl FnMut(u64, &mut [u8])) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325;
    let mut buf = vec![0u8; BLOCK as usize];
    for i in 0..n {
        read(slot(i) * SLOT, &mut buf);
        h = fnv(h, &buf);
    }
    h
}

fn config() -> EngineConfig {
    let mut c = EngineConfig::from_env();
    c.timing = true;
    c
}

fn start_pool(test: &str, cfg: &EngineConfig, cpus: &[usize]) -> Option<EnginePool> {
    require_or_skip(test, || EnginePool::start(cfg, cpus, DEFAULT_IO_MEMORY))
}

/// One engine on CPU 0 connected to a fresh peer process (or `None`: skipped).
fn connected_pool(
    test: &str,
    cfg: &EngineConfig,
) -> Option<(EnginePool, EngineHandle, Peer, ConnId)> {
    let pool = start_pool(test, cfg, &[0])?;
    let h = pool.handles()[0].clone();
    let mut peer = Peer::spawn("target");
    let conn = peer.connect(&h);
    Some((pool, h, peer, conn))
}

/// The peer process as seen from the test.
struct Peer {
    child: std::process::Child,
    ctl: Control,
    addr: u64,
    rkey: u32,
    len: u64,
}

impl Peer {
    fn spawn(scenario: &str) -> Peer {
        let (child, mut ctl) = spawn_peer("peer_process", scenario);
        let info = ctl.recv();
        Peer {
            child,
            ctl,
            addr: u64::from_be_bytes(info[0..8].try_into().expect("8")),
            rkey: u32::from_be_bytes(info[8..12].try_into().expect("4")),
            len: u64::from_be_bytes(info[12..20].try_into().expect("8")),
        }
    }

    /// Opens a connection between `engine` and the peer's engine.
    fn connect(&mut self, engine: &EngineHandle) -> ConnId {
        self.ctl.send_str("connect");
        let theirs = Endpoint::from_bytes(&self.ctl.recv()).expect("peer endpoint");
        let (conn, mine) = block_on(engine.prepare_connection()).expect("prepare");
        self.ctl.send(&mine.to_bytes());
        block_on(engine.complete_connection(conn, theirs)).expect("complete");
        assert_eq!(self.ctl.recv_str(), "ok");
        conn
    }

    fn remote(&self, offset: u64, len: u64) -> RemoteDesc {
        RemoteDesc {
            addr: self.addr + offset,
            len,
            rkey: self.rkey,
        }
    }

    fn cmd(&mut self, c: &str) -> String {
        self.ctl.send_str(c);
        self.ctl.recv_str()
    }

    /// Kills the peer abruptly: its queue pairs vanish with the process.
    fn kill(mut self) {
        self.ctl.send_str("exit");
        let _ = self.child.wait();
    }

    fn finish(mut self) {
        self.ctl.send_str("quit");
        let st = self.child.wait().expect("wait peer");
        assert!(st.success(), "peer failed: {st}");
    }
}

fn scattered_lists(region: &Region, peer: &Peer, n: u64) -> (LocalDescList, RemoteDescList) {
    let mut local = LocalDescList::with_capacity(n as usize);
    let mut remote = Vec::with_capacity(n as usize);
    for i in 0..n {
        local.push(region, local_slot(i) * SLOT, BLOCK);
        remote.push(peer.remote(remote_slot(i) * SLOT, BLOCK));
    }
    (local, RemoteDescList(remote))
}

fn region_sum(region: &Region, n: u64, slot: fn(u64) -> u64) -> u64 {
    blocks_sum(n, slot, |off, buf| {
        region.read_at(off, buf).expect("read region")
    })
}

#[test]
fn scattered_write_and_read_of_1_100_10k_100k_descriptors() {
    let cfg = config();
    let Some((pool, h, mut peer, conn)) = connected_pool(
        "scattered_write_and_read_of_1_100_10k_100k_descriptors",
        &cfg,
    ) else {
        return;
    };
    let h = &h;
    let region = block_on(h.register(REGION)).expect("register");
    for n in [1u64, 100, 10_000, 100_000] {
        // WRITE: scattered local blocks -> scattered remote blocks.
        let mut data = vec![0u8; REGION];
        fill(&mut data, n);
        region.write_at(0, &data).expect("fill");
        let (local, remote) = scattered_lists(&region, &peer, n);
        let st = block_on(h.write(conn, local.clone(), remote.clone())).expect("write");
        assert_eq!(st.bytes, n * BLOCK);
        assert_eq!(st.descriptors, n as usize);
        let want = region_sum(&region, n, local_slot);
        let got: u64 = peer.cmd(&format!("sum {n}")).parse().expect("sum");
        assert_eq!(got, want, "WRITE of {n} descriptors: remote blocks differ");
        // READ: the peer's freshly patterned blocks -> local blocks.
        assert_eq!(peer.cmd(&format!("fill {}", n + 7)), "ok");
        region.write_at(0, &vec![0u8; REGION]).expect("zero");
        let st = block_on(h.read(conn, local, remote)).expect("read");
        assert_eq!(st.bytes, n * BLOCK);
        for i in (0..n).step_by(((n / 997) as usize).max(1)) {
            let mut b = vec![0u8; BLOCK as usize];
            region
                .read_at(local_slot(i) * SLOT, &mut b)
                .expect("read back");
            let base = (remote_slot(i) * SLOT) as usize;
            assert!(
                b.iter()
                    .enumerate()
                    .all(|(k, &x)| x == pattern(n + 7, base + k)),
                "READ of {n} descriptors: block {i} differs"
            );
        }
        let want: u64 = peer.cmd(&format!("sum {n}")).parse().expect("sum");
        assert_eq!(
            region_sum(&region, n, local_slot),
            want,
            "READ of {n}: checksum"
        );
        let submit = st.prepare + st.post;
        report(&format!(
            "scattered READ {n:>6} descriptors: {} WRs, {} doorbells, prepare {:?}, post {:?}, total {:?}, {:.0} descriptors/s submitted",
            st.work_requests,
            st.doorbells,
            st.prepare,
            st.post,
            st.total,
            n as f64 / submit.as_secs_f64()
        ));
    }
    let (c, inflight) = block_on(h.counters()).expect("counters");
    assert_eq!(inflight, 0);
    report(&format!("engine counters: {c:?}"));
    peer.finish();
    pool.shutdown();
}

/// `n` concurrent single-descriptor WRITEs (block `i`: local slot `i` to remote slot `i`).
fn one_block_writes(
    h: &EngineHandle,
    conn: ConnId,
    region: &Region,
    peer: &Peer,
    n: u64,
) -> Vec<Result<rixl_runtime::TransferStats, TransferError>> {
    let futs: Vec<_> = (0..n)
        .map(|i| {
            let mut l = LocalDescList::new();
            l.push(region, local_slot(i) * SLOT, BLOCK);
            let r = RemoteDescList(vec![peer.remote(remote_slot(i) * SLOT, BLOCK)]);
            Box::pin(h.write(conn, l, r))
        })
        .collect();
    block_on(rixl_runtime::join_all(futs))
}

#[test]
fn concurrent_small_transfers_share_doorbells_and_completions() {
    if !have_device("concurrent_small_transfers_share_doorbells_and_completions") {
        return;
    }
    let mut data = vec![0u8; REGION];
    fill(&mut data, 77);
    let data = std::sync::Arc::new(data);
    let d2 = std::sync::Arc::clone(&data);
    // One descriptor per future, all started by tasks of the engine's core in one tick, like a
    // decode step's block writes.
    on_executor(move || {
        Box::pin(async move {
            let mut cfg = config();
            cfg.coalesce = true;
            let engine = Engine::open(cfg).await.expect("engine");
            let mut peer = Peer::spawn("target");
            let conn = connect_local(&engine, &mut peer).await;
            let region = engine.register(REGION).await.expect("register");
            region.write_at(0, &d2).expect("fill");
            let n = 2000u64;
            let before = engine.counters();
            let tasks: Vec<_> = (0..n)
                .map(|i| {
                    let (e, region) = (engine.clone(), region.clone());
                    let r = RemoteDescList(vec![peer.remote(remote_slot(i) * SLOT, BLOCK)]);
                    glommio::spawn_local(async move {
                        let mut l = LocalDescList::new();
                        l.push(&region, local_slot(i) * SLOT, BLOCK);
                        e.write(conn, &l, &r).await
                    })
                })
                .collect();
            for t in tasks {
                assert_eq!(t.await.expect("write").bytes, BLOCK);
            }
            let after = engine.counters();
            assert_eq!(engine.inflight(), 0);
            let want = region_sum(&region, n, local_slot);
            let got: u64 = peer.cmd(&format!("sum {n}")).parse().expect("sum");
            assert_eq!(got, want, "every block landed");
            let doorbells = after.doorbells - before.doorbells;
            let completions = after.completions - before.completions;
            report(&format!(
                "{n} concurrent 1-descriptor WRITEs: {doorbells} doorbells, {completions} completions, {} queued for a shared doorbell",
                after.queued - before.queued
            ));
            assert_eq!(after.work_requests - before.work_requests, n);
            // One flush per tick posts up to `post_batch` (64) requests per doorbell and signals
            // every 8th: at least 16 requests per doorbell and 4 per completion.
            assert!(doorbells * 16 <= n, "doorbells were shared: {doorbells}");
            assert!(completions * 4 <= n, "signals were shared: {completions}");
            // A lone transfer (the first of its progress turn) is posted at once, not queued
            // for the end of the turn.
            glommio::timer::sleep(std::time::Duration::from_millis(5)).await;
            let before = engine.counters();
            let mut l = LocalDescList::new();
            l.push(&region, 0, BLOCK);
            let r = RemoteDescList(vec![peer.remote(0, BLOCK)]);
            engine.write(conn, &l, &r).await.expect("lone write");
            let after = engine.counters();
            assert_eq!(
                (
                    after.queued - before.queued,
                    after.doorbells - before.doorbells
                ),
                (0, 1),
                "a lone transfer is posted at once"
            );
            peer.finish();
            engine.shutdown().await;
        })
    });
    // The same with coalescing off (through a handle): one doorbell per transfer.
    let mut off = config();
    off.coalesce = false;
    let Some((pool, h, mut peer, conn)) = connected_pool("coalescing off", &off) else {
        return;
    };
    let region = block_on(h.register(REGION)).expect("register");
    region.write_at(0, &data[..]).expect("fill");
    for r in one_block_writes(&h, conn, &region, &peer, 200) {
        r.expect("write");
    }
    let (c, _) = block_on(h.counters()).expect("counters");
    assert_eq!(c.doorbells, 200);
    let got: u64 = peer.cmd("sum 200").parse().expect("sum");
    assert_eq!(got, region_sum(&region, 200, local_slot));
    peer.finish();
    pool.shutdown();
}

#[test]
fn many_tasks_on_many_threads_share_two_engines() {
    let cfg = config();
    let Some(pool) = start_pool(
        "many_tasks_on_many_threads_share_two_engines",
        &cfg,
        &[0, 1],
    ) else {
        return;
    };
    let mut peer = Peer::spawn("target");
    let engines: Vec<(EngineHandle, ConnId, Region)> = pool
        .handles()
        .iter()
        .map(|h| {
            let conn = peer.connect(h);
            let region = block_on(h.register(8 << 20)).expect("register");
            (h.clone(), conn, region)
        })
        .collect();
    const THREADS: u64 = 8;
    const ROUNDS: u64 = 10;
    const DESCS: u64 = 16;
    let remote_base = |t: u64| t * (1 << 20);
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (h, conn, region) = engines[(t % 2) as usize].clone();
            let (addr, rkey) = (peer.addr, peer.rkey);
            std::thread::spawn(move || {
                let local_base = (t / 2) * (1 << 20);
                let mut data = vec![0u8; 1 << 20];
                fill(&mut data, 1000 + t);
                region.write_at(local_base, &data).expect("fill");
                // Many concurrent tasks on this thread's executor-less side: all futures at once.
                let futs: Vec<_> = (0..ROUNDS)
                    .map(|r| {
                        let mut local = LocalDescList::new();
                        let mut remote = Vec::new();
                        for d in 0..DESCS {
                            let off = (r * DESCS + d) * 4096;
                            local.push(&region, local_base + off, 1024);
                            remote.push(RemoteDesc {
                                addr: addr + remote_base(t) + off,
                                len: 1024,
                                rkey,
                            });
                        }
                        h.write(conn, local, RemoteDescList(remote))
                    })
                    .collect();
                for f in futs {
                    block_on(f).expect("concurrent write");
                }
            })
        })
        .collect();
    for th in threads {
        th.join().expect("thread");
    }
    for t in 0..THREADS {
        let mut data = vec![0u8; 1 << 20];
        fill(&mut data, 1000 + t);
        let mut want = 0xcbf2_9ce4_8422_2325u64;
        for k in 0..ROUNDS * DESCS {
            want = fnv(want, &data[(k * 4096) as usize..(k * 4096 + 1024) as usize]);
        }
        let got: u64 = peer
            .cmd(&format!(
                "strided {} {} 4096 1024",
                remote_base(t),
                ROUNDS * DESCS
            ))
            .parse()
            .expect("sum");
        assert_eq!(got, want, "thread {t}'s writes");
    }
    for (h, ..) in &engines {
        let (c, inflight) = block_on(h.counters()).expect("counters");
        assert_eq!(inflight, 0);
        assert!(c.transfers_ok >= THREADS / 2 * ROUNDS, "{c:?}");
    }
    peer.finish();
    pool.shutdown();
}

/// Runs `body` on a fresh glommio executor (for tests that need the `!Send` engine itself).
fn on_executor(
    body: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>> + Send + 'static,
) {
    LocalExecutorBuilder::new(Placement::Unbound)
        .io_memory(DEFAULT_IO_MEMORY)
        .spawn(body)
        .expect("executor")
        .join()
        .expect("executor thread");
}

/// Whether an RDMA device can be opened; prints why `test` skips otherwise.
fn have_device(test: &str) -> bool {
    require_or_skip(test, || {
        rixl_verbs::DeviceList::new().and_then(|l| l.find(None).map(|_| ()))
    })
    .is_some()
}

/// An engine of [`config`] connected to a freshly spawned peer process.
async fn engine_with_peer() -> (Engine, Peer, ConnId) {
    let engine = Engine::open(config()).await.expect("engine");
    let mut peer = Peer::spawn("target");
    let conn = connect_local(&engine, &mut peer).await;
    (engine, peer, conn)
}

async fn connect_local(engine: &Engine, peer: &mut Peer) -> ConnId {
    peer.ctl.send_str("connect");
    let theirs = Endpoint::from_bytes(&peer.ctl.recv()).expect("peer endpoint");
    let (conn, mine) = engine.prepare_connection().await.expect("prepare");
    peer.ctl.send(&mine.to_bytes());
    engine
        .complete_connection(conn, theirs)
        .await
        .expect("complete");
    assert_eq!(peer.ctl.recv_str(), "ok");
    conn
}

async fn settle(engine: &Engine, until: impl Fn(&Engine) -> bool) {
    let t0 = Instant::now();
    while !until(engine) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "engine did not settle: {engine:?}"
        );
        glommio::timer::sleep(Duration::from_millis(5)).await;
    }
}

#[test]
fn dropped_or_forgotten_futures_never_free_memory_in_flight() {
    if !have_device("dropped_or_forgotten_futures_never_free_memory_in_flight") {
        return;
    }
    on_executor(|| {
        Box::pin(async {
            let (engine, peer, conn) = engine_with_peer().await;
            let region = engine.register(16 << 20).await.expect("register");
            let mut data = vec![0u8; 16 << 20];
            fill(&mut data, 42);
            region.write_at(0, &data).expect("fill");
            let before = region.handle_count();

            // 4096 scattered 4 KiB blocks: more work requests than the send queue holds, so the
            // first poll posts part of them and waits for credits.
            let mut local = LocalDescList::new();
            let mut remote = Vec::new();
            for i in 0..4096u64 {
                local.push(&region, i * 4096, 4096);
                remote.push(peer.remote(((i * 7) % 4096) * 4096 + 1, 4096));
            }
            let remote = RemoteDescList(remote);
            let mut fut = Box::pin(engine.write(conn, &local, &remote));
            assert!(
                poll_once(&mut fut).await.is_none(),
                "still in flight after one poll"
            );
            let posted = engine.counters().work_requests;
            assert!(posted > 0, "the first poll posted work");
            drop(fut);
            drop(local);
            // The detached slot keeps the region registered while the NIC works.
            assert_eq!(engine.inflight(), 1);
            assert!(region.handle_count() > before - 1, "slot holds the region");
            drop(region);
            settle(&engine, |e| e.inflight() == 0).await;
            assert_eq!(
                engine.counters().work_requests,
                posted,
                "nothing posted after the drop"
            );
            report(&format!("dropped future: {posted} WRs were in flight; slot released after their completions"));

            // mem::forget: the slot stays attached (a leak, never a free) and the engine works on.
            // Again 4096 scattered blocks, which the planner cannot merge: more work requests
            // than the send queue holds, so the transfer is still posting after one poll.
            // (Contiguous blocks merge into a few large WRITEs, which rxe can finish before the
            // first poll returns, since futures reap the CQ themselves.)
            let region = engine.register(16 << 20).await.expect("register");
            let mut local = LocalDescList::new();
            let mut remote = Vec::new();
            for i in 0..4096u64 {
                local.push(&region, i * 4096, 4096);
                remote.push(peer.remote(((i * 7) % 4096) * 4096, 4096));
            }
            let remote = RemoteDescList(remote);
            let mut fut = Box::pin(engine.write(conn, &local, &remote));
            assert!(poll_once(&mut fut).await.is_none());
            std::mem::forget(fut);
            let held = region.handle_count();
            glommio::timer::sleep(Duration::from_millis(200)).await;
            assert_eq!(
                engine.inflight(),
                1,
                "forgotten transfer's slot is still there"
            );
            assert_eq!(region.handle_count(), held, "and still holds its memory");
            let st = engine
                .write(conn, &local, &remote)
                .await
                .expect("engine still works");
            assert_eq!(st.bytes, 16 << 20);
            peer.finish();
        })
    });
}

#[test]
fn prepared_transfers_repost_the_same_blocks_and_refuse_stale_use() {
    if !have_device("prepared_transfers_repost_the_same_blocks_and_refuse_stale_use") {
        return;
    }
    on_executor(|| {
        Box::pin(async {
            let (engine, mut peer, conn) = engine_with_peer().await;
            let region = engine.register(REGION).await.expect("register");
            let n = 1000u64;
            let (local, remote) = scattered_lists(&region, &peer, n);
            let write = engine
                .prepare(conn, Op::Write, &local, &remote)
                .expect("prepare write");
            let read = engine
                .prepare(conn, Op::Read, &local, &remote)
                .expect("prepare read");
            assert_eq!(write.bytes(), n * BLOCK);
            assert_eq!(write.work_requests(), n as usize, "scattered: one WR each");
            // The prepared transfers keep the region registered on their own.
            drop(local);
            let held = region.handle_count();
            assert!(held >= 3, "region, two prepared transfers: {held}");

            // Re-post the same WRITE with new contents each round; every block is checked.
            let plans_before = engine.counters().work_requests;
            for round in 0..3u64 {
                let mut data = vec![0u8; REGION];
                fill(&mut data, 300 + round);
                region.write_at(0, &data).expect("fill");
                let st = engine
                    .post(&write, TransferOptions::default())
                    .await
                    .expect("post write");
                assert_eq!((st.bytes, st.descriptors), (n * BLOCK, n as usize));
                let got: u64 = peer.cmd(&format!("sum {n}")).parse().expect("sum");
                assert_eq!(got, region_sum(&region, n, local_slot), "round {round}");
            }
            assert_eq!(engine.counters().work_requests - plans_before, 3 * n);
            // The prepared READ brings the peer's new pattern back.
            assert_eq!(peer.cmd("fill 911"), "ok");
            region.write_at(0, &vec![0u8; REGION]).expect("zero");
            engine
                .post(&read, TransferOptions::default())
                .await
                .expect("post read");
            let want: u64 = peer.cmd(&format!("sum {n}")).parse().expect("sum");
            assert_eq!(region_sum(&region, n, local_slot), want, "prepared READ");

            // Typed errors, never a post: a READ with an immediate, bad descriptors at
            // preparation, another engine, a closed connection, a reused connection id.
            let mut imm = TransferOptions::default();
            imm.notify_imm = Some(7);
            assert!(matches!(
                engine.post(&read, imm).await,
                Err(TransferError::Post(_))
            ));
            let mut bad = LocalDescList::new();
            bad.push(&region, REGION as u64 - 10, 100);
            let r = engine.prepare(
                conn,
                Op::Write,
                &bad,
                &RemoteDescList(vec![peer.remote(0, 100)]),
            );
            assert!(
                matches!(
                    r,
                    Err(TransferError::InvalidDescriptor(
                        InvalidDescriptor::OutOfRange { .. }
                    ))
                ),
                "{r:?}"
            );
            drop(bad);
            let other = Engine::open(config()).await.expect("second engine");
            let r = other.post(&write, TransferOptions::default()).await;
            assert!(
                matches!(
                    r,
                    Err(TransferError::InvalidDescriptor(
                        InvalidDescriptor::ForeignRegion { .. }
                    ))
                ),
                "{r:?}"
            );
            other.shutdown().await;
            let posted = engine.counters().work_requests;
            engine.close_connection(conn).await;
            let r = engine.post(&write, TransferOptions::default()).await;
            assert!(matches!(r, Err(TransferError::Connection(..))), "{r:?}");
            let again = connect_local(&engine, &mut peer).await;
            if again == conn {
                let r = engine.post(&write, TransferOptions::default()).await;
                assert!(matches!(r, Err(TransferError::Connection(..))), "{r:?}");
            }
            assert_eq!(
                engine.counters().work_requests,
                posted,
                "nothing was posted"
            );
            report(&format!(
                "prepared: 3 re-posts of {n} scattered blocks verified; new connection id reused: {}",
                again == conn
            ));
            drop((write, read));
            assert_eq!(
                region.handle_count(),
                held - 2,
                "dropping them releases the region"
            );
            peer.finish();
        })
    });
}

#[test]
fn prepared_single_descriptor_transfers_post_alone_queued_and_with_a_notification() {
    if !have_device(
        "prepared_single_descriptor_transfers_post_alone_queued_and_with_a_notification",
    ) {
        return;
    }
    on_executor(|| {
        Box::pin(async {
            let (engine, mut peer, conn) = engine_with_peer().await;
            let region = engine.register(REGION).await.expect("register");
            let (local, remote) = scattered_lists(&region, &peer, 1);
            let write = engine
                .prepare(conn, Op::Write, &local, &remote)
                .expect("prepare write");
            let read = engine
                .prepare(conn, Op::Read, &local, &remote)
                .expect("prepare read");
            assert_eq!((write.bytes(), write.work_requests()), (BLOCK, 1));

            // Many at once from tasks of the core (one tick; first, while the connection's
            // coalescing has learned nothing): all but the first are queued for a shared
            // doorbell, as unprepared transfers of that shape are, and all complete.
            let write = std::rc::Rc::new(write);
            let before = engine.counters();
            let n = 64u64;
            let tasks: Vec<_> = (0..n)
                .map(|_| {
                    let (e, w) = (engine.clone(), std::rc::Rc::clone(&write));
                    glommio::spawn_local(
                        async move { e.post(&w, TransferOptions::default()).await },
                    )
                })
                .collect();
            for t in tasks {
                assert_eq!(t.await.expect("queued post").bytes, BLOCK);
            }
            let after = engine.counters();
            assert_eq!(after.work_requests - before.work_requests, n);
            assert!(
                after.queued - before.queued >= n / 2,
                "queued for a shared doorbell: {}",
                after.queued - before.queued
            );
            assert!(
                after.doorbells - before.doorbells < n / 2,
                "doorbells shared: {}",
                after.doorbells - before.doorbells
            );
            assert_eq!(engine.inflight(), 0);
            let (queued, doorbells) = (
                after.queued - before.queued,
                after.doorbells - before.doorbells,
            );

            // Alone: the first of its progress turn (the sleep lets the turn pass), posted at
            // once with its own doorbell, never queued; every round lands.
            for round in 0..20u64 {
                glommio::timer::sleep(Duration::from_millis(2)).await;
                let mut block = vec![0u8; BLOCK as usize];
                fill(&mut block, 500 + round);
                region.write_at(local_slot(0) * SLOT, &block).expect("fill");
                let before = engine.counters();
                let st = engine
                    .post(&write, TransferOptions::default())
                    .await
                    .expect("post write");
                let after = engine.counters();
                assert_eq!((st.bytes, st.descriptors, st.work_requests), (BLOCK, 1, 1));
                assert_eq!(
                    (
                        after.queued - before.queued,
                        after.doorbells - before.doorbells,
                        after.work_requests - before.work_requests
                    ),
                    (0, 1, 1),
                    "round {round}: a lone prepared WRITE is posted at once"
                );
                let got: u64 = peer.cmd("sum 1").parse().expect("sum");
                assert_eq!(got, region_sum(&region, 1, local_slot), "round {round}");
            }

            // With a notification: the peer's receive completion carries the immediate.
            let mut imm = TransferOptions::default();
            imm.notify_imm = Some(0xbeef);
            engine.post(&write, imm).await.expect("post write+imm");
            assert_eq!(peer.cmd("recv 1"), "imm 0xbeef");

            // The prepared READ of the one block brings the peer's new pattern back.
            assert_eq!(peer.cmd("fill 913"), "ok");
            region.write_at(0, &vec![0u8; REGION]).expect("zero");
            let st = engine
                .post(&read, TransferOptions::default())
                .await
                .expect("post read");
            assert_eq!((st.bytes, st.work_requests), (BLOCK, 1));
            let want: u64 = peer.cmd("sum 1").parse().expect("sum");
            assert_eq!(region_sum(&region, 1, local_slot), want, "prepared READ");
            // A READ cannot carry a notification: a typed error, nothing posted.
            let posted = engine.counters().work_requests;
            let mut imm = TransferOptions::default();
            imm.notify_imm = Some(1);
            let r = engine.post(&read, imm).await;
            assert!(
                matches!(
                    r,
                    Err(TransferError::Post(rixl_runtime::PostError::NotifyOnRead))
                ),
                "{r:?}"
            );
            assert_eq!(engine.counters().work_requests, posted);
            report(&format!(
                "prepared one-descriptor transfers: {n} at once ({queued} queued, {doorbells} doorbells), 20 alone, 1 notified, 1 READ"
            ));
            peer.finish();
        })
    });
}

#[test]
fn prepared_transfers_through_a_handle_repost_from_another_thread() {
    let cfg = config();
    let Some((pool, h, mut peer, conn)) = connected_pool(
        "prepared_transfers_through_a_handle_repost_from_another_thread",
        &cfg,
    ) else {
        return;
    };
    let region = block_on(h.register(REGION)).expect("register");
    let n = 200u64;
    let (local, remote) = scattered_lists(&region, &peer, n);
    let write = block_on(h.prepare_transfer(conn, Op::Write, local, remote)).expect("prepare");
    assert_eq!(write.bytes(), n * BLOCK);
    // Posted from two threads in turn; each round's contents land whole.
    for round in 0..2u64 {
        let mut data = vec![0u8; REGION];
        fill(&mut data, 500 + round);
        region.write_at(0, &data).expect("fill");
        let (h2, w2) = (h.clone(), std::sync::Arc::clone(&write));
        let st = std::thread::spawn(move || block_on(h2.post(&w2, TransferOptions::default())))
            .join()
            .expect("poster thread")
            .expect("post");
        assert_eq!(st.bytes, n * BLOCK);
        let got: u64 = peer.cmd(&format!("sum {n}")).parse().expect("sum");
        assert_eq!(got, region_sum(&region, n, local_slot), "round {round}");
    }
    block_on(h.close_connection(conn));
    let r = block_on(h.post(&write, TransferOptions::default()));
    assert!(matches!(r, Err(TransferError::Connection(..))), "{r:?}");
    peer.finish();
    pool.shutdown();
}

#[test]
fn a_stalled_peer_ends_in_the_timeout_error_not_a_hang() {
    let mut cfg = config();
    cfg.connect.timeout = 20; // ~4.3 s per transport retry: the transfer deadline comes first
    cfg.connect.retry_cnt = 7;
    cfg.transfer_timeout = Duration::from_secs(1);
    let Some((pool, h, peer, conn)) =
        connected_pool("a_stalled_peer_ends_in_the_timeout_error_not_a_hang", &cfg)
    else {
        return;
    };
    let h = &h;
    let region = block_on(h.register(1 << 20)).expect("register");
    let mut local = LocalDescList::new();
    local.push(&region, 0, 1 << 20);
    let remote = RemoteDescList(vec![peer.remote(0, 1 << 20)]);
    block_on(h.write(conn, local.clone(), remote.clone())).expect("write while the peer lives");
    // 2048 scattered 256 B blocks: more work requests than the send queue holds (512), so the
    // transfer is still posting, waiting for send credits, when its deadline passes.
    let mut scattered = LocalDescList::new();
    let mut targets = Vec::new();
    for i in 0..2048u64 {
        scattered.push(&region, i * 512, 256);
        targets.push(peer.remote(i * 512, 256));
    }
    peer.kill();
    let t0 = Instant::now();
    let r = block_on(h.write(conn, scattered, RemoteDescList(targets)));
    let took = t0.elapsed();
    assert_eq!(r, Err(TransferError::Timeout(Duration::from_secs(1))));
    assert!(took < Duration::from_secs(4), "timed out after {took:?}");
    let r = block_on(h.write(conn, local, remote));
    assert!(matches!(r, Err(TransferError::Connection(..))), "{r:?}");
    // The failed connection's work is flushed and its slot released.
    let t0 = Instant::now();
    while block_on(h.counters()).expect("counters").1 != 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "slots not released");
        std::thread::sleep(Duration::from_millis(10));
    }
    report(&format!("stalled peer: Timeout after {took:?}"));
    pool.shutdown();
}

#[test]
fn a_dead_peer_gives_remote_disconnect() {
    let mut cfg = config();
    cfg.connect.timeout = 10; // ~4 ms per retry
    cfg.connect.retry_cnt = 2;
    cfg.transfer_timeout = Duration::from_secs(20);
    let Some((pool, h, peer, conn)) = connected_pool("a_dead_peer_gives_remote_disconnect", &cfg)
    else {
        return;
    };
    let h = &h;
    let region = block_on(h.register(1 << 20)).expect("register");
    let mut local = LocalDescList::new();
    local.push(&region, 0, 65536);
    let remote = RemoteDescList(vec![peer.remote(0, 65536)]);
    block_on(h.write(conn, local.clone(), remote.clone())).expect("write while the peer lives");
    peer.kill();
    let t0 = Instant::now();
    let r = block_on(h.write(conn, local, remote));
    assert!(
        matches!(
            r,
            Err(TransferError::RemoteDisconnect {
                status: WcStatus::RetryExceededError
            })
        ),
        "{r:?}"
    );
    report(&format!(
        "dead peer: RemoteDisconnect after {:?}",
        t0.elapsed()
    ));
    pool.shutdown();
}

#[test]
fn messages_and_write_notifications_reach_the_peer() {
    let cfg = config();
    let Some((pool, h, mut peer, conn)) =
        connected_pool("messages_and_write_notifications_reach_the_peer", &cfg)
    else {
        return;
    };
    let h = &h;
    block_on(h.send(conn, b"x".to_vec(), None)).expect("send 1");
    block_on(h.send(conn, vec![7u8; 100], Some(0x1234))).expect("send 2");
    block_on(h.send(conn, vec![9u8; 4096], None)).expect("send 3");
    assert_eq!(
        peer.cmd("recv 3"),
        "data 1 120 none|data 100 7 0x1234|data 4096 9 none",
        "first byte of each message reported by the peer"
    );
    let too_big = block_on(h.send(conn, vec![0u8; 4097], None));
    assert!(matches!(too_big, Err(TransferError::InvalidDescriptor(_))));
    // A WRITE whose last request carries an immediate: the peer learns the data has landed.
    let region = block_on(h.register(1 << 20)).expect("register");
    let mut data = vec![0u8; 1 << 20];
    fill(&mut data, 77);
    region.write_at(0, &data).expect("fill");
    let mut local = LocalDescList::new();
    let mut remote = Vec::new();
    for i in 0..64u64 {
        local.push(&region, i * 16384, 8192);
        remote.push(peer.remote(i * 8192, 8192));
    }
    // Zero-copy from the registered region through the handle: data[0] is 77's pattern.
    block_on(h.send_from(conn, region.clone(), 16384, 300, Some(5))).expect("send_from");
    assert_eq!(
        peer.cmd("recv 1"),
        format!("data 300 {} 0x5", data[16384]),
        "a zero-copy message from the region"
    );
    let mut opts = TransferOptions::default();
    opts.notify_imm = Some(0xfeed);
    block_on(h.transfer(conn, Op::Write, local, RemoteDescList(remote), opts)).expect("write+imm");
    assert_eq!(peer.cmd("recv 1"), "imm 0xfeed");
    let mut want = 0xcbf2_9ce4_8422_2325u64;
    for i in 0..64usize {
        want = fnv(want, &data[i * 16384..i * 16384 + 8192]);
    }
    let got: u64 = peer.cmd("strided 0 64 8192 8192").parse().expect("sum");
    assert_eq!(got, want);
    peer.finish();
    pool.shutdown();
}

#[test]
fn bad_descriptors_are_typed_errors_and_nothing_is_posted() {
    let cfg = config();
    let Some(pool) = start_pool(
        "bad_descriptors_are_typed_errors_and_nothing_is_posted",
        &cfg,
        &[0, 1],
    ) else {
        return;
    };
    let h = &pool.handles()[0];
    let other = &pool.handles()[1];
    let mut peer = Peer::spawn("target");
    let conn = peer.connect(h);
    let region = block_on(h.register(4096)).expect("register");
    let foreign = block_on(other.register(4096)).expect("register on the other engine");
    let one = |r: &Region, off, len| {
        let mut l = LocalDescList::new();
        l.push(r, off, len);
        l
    };
    let remote = |len| RemoteDescList(vec![peer.remote(0, len)]);
    let before = block_on(h.counters()).expect("counters").0.work_requests;
    let cases: Vec<(&str, LocalDescList, RemoteDescList)> = vec![
        ("out of range", one(&region, 4000, 200), remote(200)),
        ("zero length", one(&region, 0, 0), remote(0)),
        ("length mismatch", one(&region, 0, 100), remote(101)),
        ("foreign region", one(&foreign, 0, 100), remote(100)),
        ("empty", LocalDescList::new(), remote(8)),
        (
            "overflow",
            one(&region, 0, 16),
            RemoteDescList(vec![RemoteDesc {
                addr: u64::MAX - 8,
                len: 16,
                rkey: 1,
            }]),
        ),
    ];
    for (what, l, r) in cases {
        match block_on(h.write(conn, l, r)) {
            Err(TransferError::InvalidDescriptor(d)) => report(&format!("{what}: {d}")),
            other => panic!("{what}: expected InvalidDescriptor, got {other:?}"),
        }
    }
    assert_eq!(
        block_on(h.counters()).expect("counters").0.work_requests,
        before,
        "nothing posted"
    );
    assert!(matches!(
        block_on(h.write(conn, one(&region, 4000, 200), remote(200))),
        Err(TransferError::InvalidDescriptor(
            InvalidDescriptor::OutOfRange { index: 0, .. }
        ))
    ));
    // A forged rkey passes local validation and fails at the peer's NIC.
    let forged = RemoteDescList(vec![RemoteDesc {
        addr: peer.addr,
        len: 64,
        rkey: peer.rkey ^ 0x77_0000,
    }]);
    let r = block_on(h.write(conn, one(&region, 0, 64), forged));
    assert!(
        matches!(r, Err(TransferError::RemoteAccess { .. })),
        "{r:?}"
    );
    // ... and fails the connection (the QP is in error): later transfers say so at once.
    let r = block_on(h.write(conn, one(&region, 0, 64), remote(64)));
    assert!(matches!(r, Err(TransferError::Connection(..))), "{r:?}");
    let _ = peer.len;
    peer.finish();
    pool.shutdown();
}

#[test]
fn event_mode_engines_complete_transfers_without_spinning() {
    let mut cfg = config();
    cfg.poll_mode = rixl_runtime::PollMode::Event;
    let Some((pool, h, mut peer, conn)) = connected_pool(
        "event_mode_engines_complete_transfers_without_spinning",
        &cfg,
    ) else {
        return;
    };
    let h = &h;
    let region = block_on(h.register(REGION)).expect("register");
    let mut data = vec![0u8; REGION];
    fill(&mut data, 5);
    region.write_at(0, &data).expect("fill");
    for round in 0..3u64 {
        let (local, remote) = scattered_lists(&region, &peer, 2000 + round);
        block_on(h.write(conn, local, remote)).expect("write in event mode");
        let want = region_sum(&region, 2000 + round, local_slot);
        let got: u64 = peer
            .cmd(&format!("sum {}", 2000 + round))
            .parse()
            .expect("sum");
        assert_eq!(got, want);
    }
    // Waiting for a message that arrives later: the engine sleeps on the completion channel.
    let before = block_on(h.counters()).expect("counters").0.event_waits;
    // The clock starts before the command, so the peer's 300 ms sleep lies inside it.
    let t0 = Instant::now();
    assert_eq!(peer.cmd("send_later 300 hello"), "ok");
    let msg = block_on(h.recv(conn)).expect("recv in event mode");
    assert_eq!(msg, Message::Data(b"hello".to_vec(), None));
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "the message came early: {:?}",
        t0.elapsed()
    );
    let (c, inflight) = block_on(h.counters()).expect("counters");
    assert_eq!(inflight, 0);
    assert!(
        c.event_waits > before,
        "event mode waited for completion events: {c:?}"
    );
    report(&format!("event mode counters: {c:?}"));
    peer.finish();
    pool.shutdown();
}

/// Two engines of this process on the same device, connected to each other.
async fn engine_pair(cfg: &EngineConfig) -> (Engine, Engine, ConnId, ConnId) {
    let a = Engine::open(cfg.clone()).await.expect("engine a");
    let b = Engine::open(cfg.clone()).await.expect("engine b");
    let (ca, ea) = a.prepare_connection().await.expect("prepare a");
    let (cb, eb) = b.prepare_connection().await.expect("prepare b");
    a.complete_connection(ca, eb).await.expect("complete a");
    b.complete_connection(cb, ea).await.expect("complete b");
    (a, b, ca, cb)
}

#[test]
fn flags_written_by_rdma_signal_arrival_and_small_inline_writes_land_intact() {
    if !have_device("flags_written_by_rdma_signal_arrival_and_small_inline_writes_land_intact") {
        return;
    }
    on_executor(|| {
        Box::pin(async {
            let cfg = config();
            assert_eq!(cfg.max_inline, 220, "inline writes are on by default");
            let (a, b, ca, cb) = engine_pair(&cfg).await;
            let (ra, rb) = (
                a.register(1 << 20).await.expect("register a"),
                b.register(1 << 20).await.expect("register b"),
            );
            let mut data = vec![0u8; 1 << 20];
            fill(&mut data, 31);
            ra.write_at(0, &data).expect("fill");

            // Small WRITEs (inline up to 220 bytes, then not) land byte for byte.
            let sizes = [1u64, 2, 63, 64, 200, 220, 221, 4096];
            let mut off = 0u64;
            for &n in &sizes {
                let mut l = LocalDescList::new();
                l.push(&ra, off, n);
                let r = RemoteDescList(vec![rb.remote(off + 7, n)]);
                a.write(ca, &l, &r).await.expect("small write");
                let mut got = vec![0u8; n as usize];
                rb.read_at(off + 7, &mut got).expect("read");
                assert_eq!(got, &data[off as usize..(off + n) as usize], "{n} bytes");
                off += 8192;
            }

            // Data then a flag word, one WRITE each on one connection: once the flag is seen,
            // the data is there.
            let flag_at = (1 << 20) - 8;
            for round in 1..=20u64 {
                let len = 64 << 10;
                let base = round * 4096;
                let mut l = LocalDescList::new();
                l.push(&ra, base, len);
                ra.write_at(flag_at, &round.to_ne_bytes()).expect("flag");
                let mut f = LocalDescList::new();
                f.push(&ra, flag_at, 8);
                let (rd, rf) = (
                    RemoteDescList(vec![rb.remote(0, len)]),
                    RemoteDescList(vec![rb.remote(flag_at, 8)]),
                );
                let (w1, w2) = (a.write(ca, &l, &rd), a.write(ca, &f, &rf));
                let waiter = rixl_runtime::wait_flag(
                    &rb,
                    flag_at,
                    rixl_runtime::Flag::Word(round),
                    Duration::from_secs(10),
                );
                let ((r1, r2), seen) =
                    futures_lite::future::zip(futures_lite::future::zip(w1, w2), waiter).await;
                r1.expect("data write");
                r2.expect("flag write");
                seen.expect("flag seen");
                let mut got = vec![0u8; len as usize];
                rb.read_at(0, &mut got).expect("read");
                assert_eq!(
                    got,
                    &data[base as usize..(base + len) as usize],
                    "round {round}"
                );
            }

            // Ping-pong on flag bytes, as rixl-perf write_lat runs it, each side in its own task.
            const ROUNDS: u64 = 200;
            let back = ra.remote(300, 1);
            let pong = {
                let (b, rb) = (b.clone(), rb.clone());
                glommio::spawn_local(async move {
                    let mut l = LocalDescList::new();
                    l.push(&rb, 100, 1);
                    for i in 0..ROUNDS {
                        let v = (i % 255) as u8 + 1;
                        rixl_runtime::wait_flag(
                            &rb,
                            200,
                            rixl_runtime::Flag::Byte(v),
                            Duration::from_secs(10),
                        )
                        .await
                        .expect("ping");
                        rb.write_at(100, &[v]).expect("pong byte");
                        b.write(cb, &l, &RemoteDescList(vec![back]))
                            .await
                            .expect("pong");
                    }
                })
            };
            let mut l = LocalDescList::new();
            l.push(&ra, 100, 1);
            let t0 = Instant::now();
            for i in 0..ROUNDS {
                let v = (i % 255) as u8 + 1;
                ra.write_at(100, &[v]).expect("ping byte");
                a.write(ca, &l, &RemoteDescList(vec![rb.remote(200, 1)]))
                    .await
                    .expect("ping");
                rixl_runtime::wait_flag(
                    &ra,
                    300,
                    rixl_runtime::Flag::Byte(v),
                    Duration::from_secs(10),
                )
                .await
                .expect("pong");
            }
            pong.await;
            report(&format!(
                "{ROUNDS} flag ping-pong rounds in {:?}",
                t0.elapsed()
            ));

            // A flag that never comes is a timeout, not a hang; bad offsets are typed.
            let t = Instant::now();
            let r = rixl_runtime::wait_flag(
                &ra,
                8,
                rixl_runtime::Flag::Word(u64::MAX),
                Duration::from_millis(50),
            )
            .await;
            assert_eq!(r, Err(TransferError::Timeout(Duration::from_millis(50))));
            assert!(t.elapsed() < Duration::from_secs(5));
            let r = rixl_runtime::wait_flag(
                &ra,
                12,
                rixl_runtime::Flag::Word(0),
                Duration::from_secs(1),
            )
            .await;
            assert!(matches!(
                r,
                Err(TransferError::InvalidDescriptor(
                    InvalidDescriptor::Misaligned { .. }
                ))
            ));
            a.shutdown().await;
            b.shutdown().await;
        })
    });
}

#[test]
fn messages_sent_from_registered_memory_arrive_intact_and_bad_input_is_typed() {
    if !have_device("messages_sent_from_registered_memory_arrive_intact_and_bad_input_is_typed") {
        return;
    }
    on_executor(|| {
        Box::pin(async {
            let cfg = config();
            let max = u64::from(cfg.max_message);
            let (a, b, ca, cb) = engine_pair(&cfg).await;
            let ra = a.register(1 << 20).await.expect("register a");
            let mut data = vec![0u8; 1 << 20];
            fill(&mut data, 77);
            ra.write_at(0, &data).expect("fill");

            // Zero-copy SENDs of every kind of size (inline up to 220 bytes, then read by the
            // NIC), at odd offsets, with and without an immediate: byte for byte.
            let sizes = [1u64, 63, 64, 220, 221, 1000, max];
            for (i, &len) in sizes.iter().enumerate() {
                let off = 4096 * i as u64 + 3;
                let imm = (i % 2 == 1).then_some(i as u32);
                a.send_from(ca, &ra, off, len, imm)
                    .await
                    .expect("send_from");
                let got = b.recv(cb).await.expect("recv");
                let want = data[off as usize..(off + len) as usize].to_vec();
                assert_eq!(got, Message::Data(want, imm), "{len} bytes at {off}");
            }

            // Bad input: typed, nothing posted, the connection fine afterwards.
            let reaped = a.counters().completions;
            let rb = b.register(4096).await.expect("register b");
            let bad = [
                (a.send_from(ca, &ra, 0, 0, None).await, "empty"),
                (
                    a.send_from(ca, &ra, 0, max + 1, None).await,
                    "over max_message",
                ),
                (
                    a.send_from(ca, &ra, (1 << 20) - 10, 11, None).await,
                    "past the end",
                ),
                (
                    a.send_from(ca, &ra, u64::MAX - 1, 8, None).await,
                    "overflow",
                ),
                (
                    a.send_from(ca, &rb, 0, 8, None).await,
                    "another engine's region",
                ),
            ];
            for (r, what) in &bad {
                assert!(
                    matches!(r, Err(TransferError::InvalidDescriptor(_))),
                    "{what}: {r:?}"
                );
            }
            assert!(matches!(
                bad[0].0,
                Err(TransferError::InvalidDescriptor(
                    InvalidDescriptor::MessageSize { len: 0, .. }
                ))
            ));
            assert!(matches!(
                bad[2].0,
                Err(TransferError::InvalidDescriptor(
                    InvalidDescriptor::OutOfRange { .. }
                ))
            ));
            assert!(matches!(
                bad[3].0,
                Err(TransferError::InvalidDescriptor(
                    InvalidDescriptor::Overflow { .. }
                ))
            ));
            assert!(matches!(
                bad[4].0,
                Err(TransferError::InvalidDescriptor(
                    InvalidDescriptor::ForeignRegion { .. }
                ))
            ));
            // Nothing posted: no completion, no slot (and the peer receives exactly the
            // messages below, in order).
            assert_eq!(a.counters().completions, reaped, "nothing posted");
            assert_eq!(a.inflight(), 0);

            // Futures dropped after their first poll, and the caller's region handle with them:
            // the in-flight slot keeps the region registered until the NIC is done, and a
            // message that was posted arrives intact. The second of the two, polled in the same
            // turn, may have been queued for the coalesced post instead (and so may the first,
            // after earlier sends in the same turn); dropped there, it is cancelled: never
            // posted, never received.
            let rc = a.register(1 << 16).await.expect("register c");
            rc.write_at(0, &data[..1 << 16]).expect("fill c");
            let before = rc.handle_count();
            let mut posted_imms = Vec::new();
            let mut futs = Vec::new();
            for imm in [7u32, 8] {
                let queued = a.counters().queued;
                let mut fut = Box::pin(a.send_from(ca, &rc, 0, max, Some(imm)));
                let first = poll_once(&mut fut).await;
                if a.counters().queued == queued {
                    posted_imms.push(imm);
                }
                if first.is_none() {
                    futs.push(fut);
                }
            }
            if !futs.is_empty() {
                assert!(rc.handle_count() > before - 1, "the slots hold the region");
            }
            drop(futs);
            drop(rc);
            for imm in &posted_imms {
                let got = b.recv(cb).await.expect("recv after the drop");
                assert_eq!(
                    got,
                    Message::Data(data[..max as usize].to_vec(), Some(*imm))
                );
            }
            settle(&a, |e| e.inflight() == 0).await;

            // The copying send and the zero-copy one interleave in order on one connection.
            for i in 0..50u64 {
                if i % 2 == 0 {
                    a.send(ca, &i.to_le_bytes(), None).await.expect("send");
                } else {
                    ra.write_at(0, &i.to_le_bytes()).expect("stage");
                    a.send_from(ca, &ra, 0, 8, None).await.expect("send_from");
                }
            }
            for i in 0..50u64 {
                assert_eq!(
                    b.recv(cb).await.expect("recv"),
                    Message::Data(i.to_le_bytes().to_vec(), None)
                );
            }
            report(&format!(
                "send_from: {} sizes verified, {} bad inputs typed; of 2 dropped futures {} posted (received intact), the rest cancelled in the queue; counters {:?}",
                sizes.len(),
                bad.len(),
                posted_imms.len(),
                a.counters()
            ));
            a.shutdown().await;
            b.shutdown().await;
        })
    });
}

#[test]
fn concurrent_messages_share_doorbells_and_arrive_intact() {
    if !have_device("concurrent_messages_share_doorbells_and_arrive_intact") {
        return;
    }
    on_executor(|| {
        Box::pin(async {
            let (a, b, ca, cb) = coalescing_pair().await;
            let n = 1000u32;
            // The reader runs beside the senders (a full inbox holds back receive buffers).
            let reader = {
                let b = b.clone();
                glommio::spawn_local(async move {
                    let mut seen = vec![false; n as usize];
                    for _ in 0..n {
                        match b.recv(cb).await.expect("recv") {
                            Message::Data(bytes, imm) => {
                                let i = imm.expect("an immediate");
                                assert_eq!(bytes, message_bytes(i), "message {i} intact");
                                assert!(!seen[i as usize], "message {i} arrived twice");
                                seen[i as usize] = true;
                            }
                            other => panic!("unexpected {other:?}"),
                        }
                    }
                    seen.iter().all(|s| *s)
                })
            };
            let before = a.counters();
            // One message per task, all started in one tick, like a step's notifications.
            let tasks: Vec<_> = (0..n)
                .map(|i| {
                    let a = a.clone();
                    glommio::spawn_local(
                        async move { a.send(ca, &message_bytes(i), Some(i)).await },
                    )
                })
                .collect();
            for t in tasks {
                t.await.expect("send");
            }
            assert!(reader.await, "every message arrived once");
            let after = a.counters();
            let doorbells = after.doorbells - before.doorbells;
            let completions = after.completions - before.completions;
            let queued = after.queued - before.queued;
            report(&format!(
                "{n} concurrent SENDs: {doorbells} doorbells, {completions} completions, {queued} queued for a shared doorbell; all arrived intact"
            ));
            assert_eq!(after.work_requests - before.work_requests, u64::from(n));
            assert!(
                doorbells * 8 <= u64::from(n),
                "doorbells were shared: {doorbells}"
            );
            assert!(
                completions * 4 <= u64::from(n),
                "signals were shared: {completions}"
            );
            // Sequential messages keep their order (fewer than the receive buffers: nobody
            // reads until they are all sent).
            for i in 0..32u32 {
                a.send(ca, &message_bytes(i), Some(i)).await.expect("send");
            }
            for i in 0..32u32 {
                assert_eq!(
                    b.recv(cb).await.expect("recv"),
                    Message::Data(message_bytes(i), Some(i))
                );
            }
            assert_eq!(a.inflight(), 0);
            a.shutdown().await;
            b.shutdown().await;
        })
    });
}

#[test]
fn a_sender_waiting_for_a_message_buffer_is_woken_when_queued_messages_are_cancelled() {
    if !have_device(
        "a_sender_waiting_for_a_message_buffer_is_woken_when_queued_messages_are_cancelled",
    ) {
        return;
    }
    on_executor(|| {
        Box::pin(async {
            let (a, b, ca, cb) = coalescing_pair().await;
            // Copying sends polled in one turn until 64 are pending take every buffer of the
            // send-message pool; all but the first (posted at once, and on rxe perhaps done in
            // its first poll) wait in the coalescing queue.
            let msgs: Vec<Vec<u8>> = (0..1000u32).map(message_bytes).collect();
            let mut futs = Vec::new();
            let mut posted = Vec::new();
            let mut i = 0u32;
            while futs.len() < 64 {
                let queued = a.counters().queued;
                let mut f = Box::pin(a.send(ca, &msgs[i as usize], Some(i)));
                let first = poll_once(&mut f).await;
                if a.counters().queued == queued {
                    posted.push(i);
                }
                match first {
                    Some(r) => r.expect("a send done in its first poll"),
                    None => futs.push((i, f)),
                }
                i += 1;
                assert!((i as usize) < msgs.len(), "sends kept finishing at once");
            }
            assert!(posted.len() < 64, "the turn's later sends were queued");
            // A 65th sender finds no buffer and waits for one.
            let late = {
                let a = a.clone();
                glommio::spawn_local(async move { a.send(ca, b"late", Some(999)).await })
            };
            // The queued sends are cancelled (dropped before their flush): their buffers go
            // back to the pool, which must wake the waiting sender. The posted ones are kept,
            // unpolled, so nothing else frees a buffer.
            let mut kept = Vec::new();
            for (i, f) in futs {
                if posted.contains(&i) {
                    kept.push(f);
                }
            }
            let woke = futures_lite::future::or(async { Some(late.await) }, async {
                glommio::timer::sleep(Duration::from_secs(10)).await;
                None
            })
            .await;
            assert!(
                matches!(woke, Some(Ok(()))),
                "the waiting sender got a buffer: {woke:?}"
            );
            for f in kept {
                f.await.expect("posted send");
            }
            let mut got = Vec::new();
            for _ in 0..posted.len() + 1 {
                match b.recv(cb).await.expect("recv") {
                    Message::Data(bytes, Some(imm)) => got.push((imm, bytes)),
                    other => panic!("unexpected {other:?}"),
                }
            }
            got.sort();
            let mut want: Vec<(u32, Vec<u8>)> =
                posted.iter().map(|&i| (i, message_bytes(i))).collect();
            want.push((999, b"late".to_vec()));
            assert_eq!(
                got, want,
                "the posted messages and the late one, nothing cancelled"
            );
            report(&format!(
                "message pool: 64 buffers taken, {} sends posted, {} cancelled in the queue; the waiting sender was woken by the cancelled ones' buffers",
                posted.len(),
                i as usize - posted.len()
            ));
            a.shutdown().await;
            b.shutdown().await;
        })
    });
}

/// Reads message `i` lent by `recv_with` (in its receive buffer, or a copy when the reader was
/// far behind), checking its bytes and immediate; `engine` is called from inside the reader to
/// show nothing of it is borrowed meanwhile.
async fn read_in_place(b: &Engine, cb: ConnId, i: u32) {
    let seen = b
        .recv_with(cb, |r| match r {
            Received::Data(bytes, imm) => {
                assert_eq!(bytes, message_bytes(i).as_slice(), "message {i} intact");
                assert_eq!(imm, Some(i));
                b.counters().completions
            }
            other => panic!("unexpected {other:?}"),
        })
        .await
        .expect("recv_with");
    assert!(seen > 0);
}

#[test]
fn messages_read_in_place_arrive_intact_in_order_and_give_their_buffers_back() {
    if !have_device("messages_read_in_place_arrive_intact_in_order_and_give_their_buffers_back") {
        return;
    }
    on_executor(|| {
        Box::pin(async {
            let cfg = config();
            let ring = cfg.recv_buffers;
            let (a, b, ca, cb) = engine_pair(&cfg).await;
            // Four times the receive ring, one at a time: every buffer lent to the reader must
            // be posted again, or the sender would meet receiver-not-ready and time out.
            for i in 0..4 * ring {
                a.send(ca, &message_bytes(i), Some(i)).await.expect("send");
                read_in_place(&b, cb, i).await;
            }
            // A reader behind by three quarters of the ring: the first half waits in its
            // buffers, the rest was copied out on arrival; both kinds in order, read lent or
            // copied.
            let behind = ring * 3 / 4;
            for i in 0..behind {
                a.send(ca, &message_bytes(i), Some(i)).await.expect("send");
            }
            for i in 0..behind {
                if i % 3 == 2 {
                    assert_eq!(
                        b.recv(cb).await.expect("recv"),
                        Message::Data(message_bytes(i), Some(i))
                    );
                } else {
                    read_in_place(&b, cb, i).await;
                }
            }
            // A WRITE_WITH_IMM's notification is lent as an immediate.
            let ra = a.register(4096).await.expect("register a");
            let rb = b.register(4096).await.expect("register b");
            ra.write_at(0, &[0x42; 64]).expect("fill");
            let mut local = LocalDescList::new();
            local.push(&ra, 0, 64);
            let remote = RemoteDescList(vec![RemoteDesc {
                addr: rb.addr(),
                len: 64,
                rkey: rb.rkey(),
            }]);
            let mut o = TransferOptions::default();
            o.notify_imm = Some(0xfeed);
            a.transfer(ca, Op::Write, &local, &remote, o)
                .await
                .expect("write with imm");
            let got = b
                .recv_with(cb, |r| r.to_message())
                .await
                .expect("notification");
            assert_eq!(got, Message::Immediate(0xfeed));
            // And the ring is whole again: another ring's worth in step.
            for i in 0..ring {
                a.send(ca, &message_bytes(i), Some(i)).await.expect("send");
                read_in_place(&b, cb, i).await;
            }
            report(&format!(
                "recv_with: {} messages read in place or from their copy, {behind} of them behind the sender; counters {:?}",
                5 * ring + behind,
                b.counters()
            ));
            assert_eq!(a.inflight(), 0);
            a.shutdown().await;
            b.shutdown().await;
        })
    });
}

/// Two engines of one executor, connected, with coalescing on.
async fn coalescing_pair() -> (Engine, Engine, ConnId, ConnId) {
    let mut cfg = config();
    cfg.coalesce = true;
    engine_pair(&cfg).await
}

/// Message `i` of the concurrent-messages test: 24 to 1,023 bytes, each byte derived from `i`.
fn message_bytes(i: u32) -> Vec<u8> {
    let len = 24 + (i as usize * 37) % 1000;
    (0..len).map(|k| (i as usize * 31 + k) as u8).collect()
}

/// The peer: one engine, a 64 MiB region, and a command loop.
#[test]
#[ignore = "peer process entry point; spawned by the RDMA tests"]
fn peer_process() {
    let Some((mut ctl, _scenario)) = peer_control() else {
        return;
    };
    let pool = EnginePool::start(&config(), &[0], DEFAULT_IO_MEMORY).expect("peer engine");
    let h = pool.handles()[0].clone();
    let region = block_on(h.register(REGION)).expect("register");
    let mut info = Vec::new();
    info.extend_from_slice(&region.addr().to_be_bytes());
    info.extend_from_slice(&region.rkey().to_be_bytes());
    info.extend_from_slice(&region.len().to_be_bytes());
    ctl.send(&info);
    let mut conns = Vec::new();
    let mut senders: Vec<std::thread::JoinHandle<()>> = Vec::new();
    loop {
        let cmd = ctl.recv_str();
        let f: Vec<&str> = cmd.split_whitespace().collect();
        match f.as_slice() {
            ["quit"] => {
                for s in senders.drain(..) {
                    s.join().expect("delayed sender");
                }
                break;
            }
            ["exit"] => std::process::exit(0),
            ["connect"] => {
                let (conn, mine) = block_on(h.prepare_connection()).expect("prepare");
                ctl.send(&mine.to_bytes());
                let theirs = Endpoint::from_bytes(&ctl.recv()).expect("endpoint");
                block_on(h.complete_connection(conn, theirs)).expect("complete");
                conns.push(conn);
                ctl.send_str("ok");
            }
            ["fill", seed] => {
                let mut data = vec![0u8; REGION];
                fill(&mut data, seed.parse().expect("seed"));
                region.write_at(0, &data).expect("fill");
                ctl.send_str("ok");
            }
            ["sum", n] => {
                let n: u64 = n.parse().expect("n");
                ctl.send_str(&region_sum(&region, n, remote_slot).to_string());
            }
            ["strided", base, count, stride, len] => {
                let p = |s: &str| s.parse::<u64>().expect("number");
                let (base, count, stride, len) = (p(base), p(count), p(stride), p(len));
                let mut h = 0xcbf2_9ce4_8422_2325u64;
                let mut buf = vec![0u8; len as usize];
                for k in 0..count {
                    region.read_at(base + k * stride, &mut buf).expect("read");
                    h = fnv(h, &buf);
                }
                ctl.send_str(&h.to_string());
            }
            ["send_later", ms, text] => {
                let (h, conn, ms, text) = (
                    h.clone(),
                    conns[0],
                    ms.parse().expect("ms"),
                    text.to_string(),
                );
                senders.push(std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(ms));
                    block_on(h.send(conn, text.into_bytes(), None)).expect("send later");
                }));
                ctl.send_str("ok");
            }
            ["recv", n] => {
                let n: usize = n.parse().expect("n");
                let conn = conns[0];
                let msgs: Vec<String> = (0..n)
                    .map(|_| match block_on(h.recv(conn)).expect("recv") {
                        Message::Data(d, imm) => format!(
                            "data {} {} {}",
                            d.len(),
                            d[0],
                            imm.map_or("none".to_string(), |i| format!("{i:#x}"))
                        ),
                        Message::Immediate(i) => format!("imm {i:#x}"),
                        other => format!("{other:?}"),
                    })
                    .collect();
                ctl.send_str(&msgs.join("|"));
            }
            other => panic!("peer: unknown command {other:?}"),
        }
    }
    pool.shutdown();
}
