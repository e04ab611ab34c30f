//! Engine-owned memory on a real device (rxe in the guest): memory the serving engine allocated
//! itself, registered once, moved byte-exact by two agents in one process; the registration
//! cache; release; cancelled and dropped transfers; partial metadata; eager connect. Skipped
//! without a device (a failure under `RIXL_REQUIRE_RDMA=1`).

use std::future::Future;
use std::time::{Duration, Instant};

use futures_lite::future::block_on;
use futures_lite::StreamExt;
use rixl::agent::{
    Agent, AgentConfig, AgentError, CallOptions, RemoteRef, Transfer, TransferStatus, Visibility,
};
use rixl::runtime::{LocalDescList, Op, TransferError};
use rixl::verbs::memmap2::{MmapMut, MmapOptions};
use rixl::verbs::HostBuffer;
use rixl_testkit::{example, patterned, report, require_or_skip};

/// Two agents in one process: `owner` exports memory, `user` (on the other core) loaded its
/// metadata over the side channel.
struct Pair {
    owner: Agent,
    user: Agent,
    peer: String,
}

impl Pair {
    fn new(test: &str) -> Option<Pair> {
        Self::with_grants(test, true)
    }

    /// Agents with `nic_grants` as given.
    fn with_grants(test: &str, nic_grants: bool) -> Option<Pair> {
        rixl_testkit::init_logs();
        let make = |name: &str, cpu: usize| {
            let mut cfg = AgentConfig::default();
            cfg.cpu = rixl::runtime::cpu_at(cpu);
            cfg.nic_grants = nic_grants;
            Agent::new(name, cfg)
        };
        let owner = require_or_skip(test, || make(&format!("{test}-owner"), 0))?;
        let user = make(&format!("{test}-user"), 1).expect("second agent");
        owner.listen("127.0.0.1:0").expect("listen");
        Some(Pair {
            owner,
            user,
            peer: String::new(),
        })
    }

    /// (Re)loads the owner's full metadata into the user.
    fn sync(&mut self) {
        let blob = self
            .owner
            .local_metadata(self.user.name())
            .expect("metadata");
        self.peer = self.user.load_remote_metadata(&blob).expect("load");
    }

    /// `len` bytes on the owner filled with pattern `seed` (its metadata then loaded by the
    /// user), and `len` zeroed bytes on the user.
    fn src_dst(
        &mut self,
        len: usize,
        seed: u64,
    ) -> (rixl::agent::Registration, rixl::agent::Registration) {
        let src = block_on(self.owner.register(len, Visibility::All)).expect("src");
        src.region().write_at(0, &patterned(len, seed)).unwrap();
        self.sync();
        let dst = block_on(self.user.register(len, Visibility::All)).expect("dst");
        (src, dst)
    }

    fn shutdown(self) {
        self.user.shutdown();
        self.owner.shutdown();
    }
}

fn whole(region: u64, len: u64) -> [RemoteRef; 1] {
    [RemoteRef {
        region,
        offset: 0,
        len,
    }]
}

/// The first `len` bytes of `reg` as one local descriptor.
fn head(reg: &rixl::agent::Registration, len: u64) -> LocalDescList {
    let mut local = LocalDescList::new();
    local.push(reg.region(), 0, len);
    local
}

fn contents(reg: &rixl::agent::Registration) -> Vec<u8> {
    let mut v = vec![0u8; reg.region().len() as usize];
    reg.region().read_at(0, &mut v).expect("read back");
    v
}

#[test]
fn caller_owned_vec_boxed_mmap_shm_static_and_raw_memory_move_every_byte() {
    let Some(mut p) = Pair::new("caller_owned_kinds") else {
        return;
    };
    const LEN: usize = 1 << 20;
    // The owner's memory, allocated by "the engine" in every supported form.
    let shm_path = format!("/dev/shm/rixl-test-{}", std::process::id());
    let shm_file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&shm_path)
        .expect("shm file");
    shm_file.set_len(LEN as u64).expect("size shm");
    // SAFETY: the file is private to this test and not truncated while mapped.
    let mut shm = unsafe { MmapMut::map_mut(&shm_file) }.expect("map shm");
    shm.copy_from_slice(&patterned(LEN, 3));
    let mut anon = MmapMut::map_anon(LEN).expect("anon map");
    anon.copy_from_slice(&patterned(LEN, 4));
    let leaked: &'static mut [u8] = Box::leak(patterned(LEN, 5).into_boxed_slice());
    // A raw range the test keeps mapped until the registration is released.
    let mut raw_map = MmapMut::map_anon(LEN).expect("raw map");
    raw_map.copy_from_slice(&patterned(LEN, 6));
    // SAFETY: `raw_map` outlives the registration: it is released (and awaited) below, before
    // the map is dropped.
    let raw = unsafe { HostBuffer::from_raw(raw_map.as_mut_ptr(), LEN) }.expect("raw");
    let mems: Vec<(&str, HostBuffer, u64)> = vec![
        ("vec", HostBuffer::from_vec(patterned(LEN, 1)).unwrap(), 1),
        (
            "boxed",
            HostBuffer::from_boxed(patterned(LEN, 2).into_boxed_slice()).unwrap(),
            2,
        ),
        ("shm", HostBuffer::from_mmap(shm).unwrap(), 3),
        ("anon", HostBuffer::from_mmap(anon).unwrap(), 4),
        ("static", HostBuffer::from_static(leaked).unwrap(), 5),
        ("raw", raw, 6),
    ];
    let mut regs = Vec::new();
    for (kind, mem, seed) in mems {
        let addr = mem.addr();
        let reg = block_on(p.owner.register_host(mem, Visibility::All)).expect(kind);
        assert_eq!(reg.region().addr(), addr, "{kind}: registered in place");
        regs.push((kind, reg, seed));
    }
    // Huge pages where the machine has them.
    match MmapOptions::new().len(2 << 20).huge(Some(21)).map_anon() {
        Ok(mut huge) => {
            huge.copy_from_slice(&patterned(2 << 20, 7));
            let mem = HostBuffer::from_mmap(huge).unwrap();
            let reg = block_on(p.owner.register_host(mem, Visibility::All)).expect("huge");
            regs.push(("huge", reg, 7));
        }
        Err(e) => report(&format!(
            "caller_owned: no 2 MiB huge pages on this machine ({e}); huge-page registration not exercised"
        )),
    }
    p.sync();
    // The user's destination: its own Vec.
    let dst = block_on(p.user.register_host(
        HostBuffer::from_vec(vec![0u8; 2 << 20]).unwrap(),
        Visibility::All,
    ))
    .expect("user vec");
    for (kind, reg, seed) in &regs {
        let len = reg.region().len();
        let local = head(&dst, len);
        let st = block_on(p.user.read(&p.peer, &local, &whole(reg.id(), len)))
            .unwrap_or_else(|e| panic!("{kind}: read: {e}"));
        assert_eq!(st.bytes, len);
        let mut got = vec![0u8; len as usize];
        dst.region().read_at(0, &mut got).unwrap();
        assert!(
            got == patterned(len as usize, *seed),
            "{kind}: every byte read"
        );
        // And back: the user's bytes written into the owner's memory, in place.
        let changed: Vec<u8> = got.iter().map(|b| b ^ 0x5a).collect();
        dst.region().write_at(0, &changed).unwrap();
        block_on(p.user.write(&p.peer, &local, &whole(reg.id(), len)))
            .unwrap_or_else(|e| panic!("{kind}: write: {e}"));
        assert!(contents(reg) == changed, "{kind}: every byte written");
    }
    let kinds: Vec<&str> = regs.iter().map(|(k, _, _)| *k).collect();
    for (_, reg, _) in regs {
        let released = block_on(reg.release());
        assert!(released.deregistered);
    }
    // The raw range was released: the test's map may go now; it holds the bytes written into it.
    let written: Vec<u8> = patterned(LEN, 6).iter().map(|b| b ^ 0x5a).collect();
    assert!(raw_map[..] == written[..]);
    drop(raw_map);
    drop(shm_file);
    let _ = std::fs::remove_file(&shm_path);
    report(&format!(
        "caller_owned: {} kinds of caller memory read and written byte-exact: {kinds:?}",
        kinds.len()
    ));
    p.shutdown();
}

#[test]
fn caller_owned_bad_memory_gets_typed_errors_and_nothing_is_registered() {
    let Some(p) = Pair::new("caller_owned_bad") else {
        return;
    };
    // Zero length is refused before anything reaches the NIC.
    assert!(HostBuffer::from_vec(Vec::new()).is_err());
    assert!(HostBuffer::from_boxed(Vec::new().into_boxed_slice()).is_err());
    // A range the process may not touch: mapped with no access rights, then offered by
    // pointer. (Not an unmapped range: another thread's mapping, such as a new thread's stack,
    // may take its place before the registration.)
    // SAFETY: a fresh private anonymous mapping, no address requested; unmapped below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            1 << 20,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED, "mmap");
    let ptr = ptr.cast::<u8>();
    // SAFETY: deliberately violates the contract's "accessible" part to check the NIC's
    // refusal; nothing reads or writes the range.
    let unmapped = unsafe { HostBuffer::from_raw(ptr, 1 << 20) }.unwrap();
    match block_on(p.owner.register_host(unmapped, Visibility::All)) {
        Err(AgentError::BadMemory { source, .. }) => {
            assert_eq!(
                source.raw_os_error(),
                Some(libc::EFAULT),
                "inaccessible: {source}"
            );
        }
        other => panic!("inaccessible memory: {other:?}"),
    }
    // Read-only memory cannot be registered for the writes every registration allows.
    let ro = MmapMut::map_anon(1 << 20)
        .expect("map")
        .make_read_only()
        .expect("read-only");
    // SAFETY: `ro` outlives the (refused) registration; nothing writes it.
    let read_only = unsafe { HostBuffer::from_raw(ro.as_ptr().cast_mut(), 1 << 20) }.unwrap();
    let err = block_on(p.owner.register_host(read_only, Visibility::All)).unwrap_err();
    assert!(
        matches!(err, AgentError::BadMemory { .. }),
        "read-only memory: {err:?}"
    );
    drop(ro);
    assert_eq!(p.owner.registration_counters().made, 0);
    assert!(p.owner.query_memory(ptr as u64, 4096).is_none());
    // SAFETY: the mapping made above, refused by the NIC and not referenced since.
    assert_eq!(unsafe { libc::munmap(ptr.cast(), 1 << 20) }, 0);
    report(&format!(
        "caller_owned: inaccessible and read-only memory refused ({err})"
    ));
    p.shutdown();
}

#[test]
fn caller_owned_release_waits_for_an_inflight_transfer_and_a_dropped_handle_keeps_memory() {
    let Some(mut p) = Pair::new("caller_owned_release") else {
        return;
    };
    const LEN: usize = 32 << 20;
    let src = block_on(p.owner.register_host(
        HostBuffer::from_vec(patterned(LEN, 9)).unwrap(),
        Visibility::All,
    ))
    .expect("src");
    p.sync();
    let dst = block_on(p.user.register_host(
        HostBuffer::from_vec(vec![0u8; LEN]).unwrap(),
        Visibility::All,
    ))
    .expect("dst");
    let mut local = LocalDescList::new();
    for k in 0..(LEN as u64 >> 20) {
        local.push(dst.region(), k << 20, 1 << 20);
    }
    let mut t = p.user.read(&p.peer, &local, &whole(src.id(), LEN as u64));
    assert_eq!(t.status(), TransferStatus::Pending);
    drop(local);
    // Release the destination while 32 MiB land in it: the release waits for the transfer.
    let check = dst.region().clone();
    let mut release = Box::pin(dst.release());
    let mut polls = 0u32;
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    while t.status() == TransferStatus::Pending {
        assert!(
            release.as_mut().poll(&mut cx).is_pending(),
            "release resolved while the transfer was in flight"
        );
        polls += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    let st = match block_on(t) {
        Ok(st) => st,
        Err(e) => {
            // CI once saw this READ time out with none of its 32 requests completed; the
            // engines' and the device's counters say whether the requests left, and what rxe
            // did with them.
            report(&format!(
                "caller_owned: the READ failed after {polls} polls: {e:?}\n  user engines: {:?}\n  owner engines: {:?}\n  rdma counters: {}",
                block_on(p.user.rail_counters()),
                block_on(p.owner.rail_counters()),
                rixl_testkit::rdma_hw_counters()
            ));
            panic!("read: {e:?}");
        }
    };
    assert_eq!(st.bytes, LEN as u64);
    let mut got = vec![0u8; LEN];
    check.read_at(0, &mut got).unwrap();
    assert!(
        got == patterned(LEN, 9),
        "every byte landed before the release"
    );
    // The test's own handle on the region is the last one.
    assert!(
        release.as_mut().poll(&mut cx).is_pending(),
        "a handle is still held"
    );
    drop(check);
    let released = block_on(release);
    assert!(released.deregistered);
    // Dropping a registration (no release) during a transfer: the in-flight table keeps its
    // memory registered until the NIC is done, and the bytes are right.
    let dst2 = block_on(p.user.register_host(
        HostBuffer::from_vec(vec![0u8; LEN]).unwrap(),
        Visibility::All,
    ))
    .expect("dst2");
    let view = dst2.region().clone();
    let local = head(&dst2, LEN as u64);
    let t = p.user.read(&p.peer, &local, &whole(src.id(), LEN as u64));
    drop((local, dst2));
    block_on(t).expect("read into a dropped registration");
    view.read_at(0, &mut got).unwrap();
    assert!(got == patterned(LEN, 9));
    report(&format!(
        "caller_owned: release of a 32 MiB destination stayed pending over {polls} polls of its in-flight READ, then resolved deregistered"
    ));
    p.shutdown();
}

#[test]
fn registration_cache_reuses_contained_ranges_refuses_partial_overlaps_and_counts() {
    let Some(mut p) = Pair::new("registration_cache") else {
        return;
    };
    const LEN: usize = 8 << 20;
    let mut pool = MmapMut::map_anon(LEN).expect("pool");
    pool.copy_from_slice(&patterned(LEN, 11));
    let base = pool.as_mut_ptr();
    // SAFETY: every range below lies inside `pool`, which outlives every registration (they
    // are released and awaited before it is dropped).
    let range =
        |off: usize, len: usize| unsafe { HostBuffer::from_raw(base.add(off), len) }.unwrap();
    let whole_reg = block_on(p.owner.register_host(range(0, LEN), Visibility::All)).expect("whole");
    let c = p.owner.registration_counters();
    assert_eq!((c.made, c.reused), (1, 0));
    let equal = block_on(p.owner.register_host(range(0, LEN), Visibility::All)).expect("equal");
    let inner = block_on(
        p.owner
            .register_host(range(1 << 20, 1 << 20), Visibility::All),
    )
    .expect("inner");
    let c = p.owner.registration_counters();
    assert_eq!(
        (c.made, c.reused),
        (1, 2),
        "equal and inner ranges reuse the MR"
    );
    assert_eq!(equal.region().rkey(), whole_reg.region().rkey());
    assert_eq!(inner.region().rkey(), whole_reg.region().rkey());
    assert_eq!(inner.region().addr(), base as u64 + (1 << 20));
    let info = p
        .owner
        .query_memory(base as u64 + (1 << 20) + 100, 10)
        .expect("query");
    assert_eq!((info.id, info.offset, info.len), (inner.id(), 100, 1 << 20));
    assert!(info.shared && info.nic);
    // Partial overlap with the live 8 MiB registration: a typed error, nothing registered.
    let mut big = MmapMut::map_anon(2 * LEN).expect("big");
    let other = big.as_mut_ptr();
    // SAFETY: inside `big`, which outlives the registration.
    let outer = block_on(p.owner.register_host(
        unsafe { HostBuffer::from_raw(other, 2 * LEN) }.unwrap(),
        Visibility::All,
    ))
    .expect("a second, unrelated range");
    // SAFETY: as above.
    let straddle = unsafe { HostBuffer::from_raw(base.add(LEN - 4096), 8192) };
    // The straddling range reaches past `pool`: it is refused before the NIC sees it, so no
    // unmapped byte is registered.
    match block_on(p.owner.register_host(straddle.unwrap(), Visibility::All)) {
        Err(AgentError::OverlappingRegistration { existing, .. }) => {
            assert_eq!(existing, base as u64)
        }
        other => panic!("partial overlap: {other:?}"),
    }
    assert_eq!(p.owner.registration_counters().overlaps, 1);
    // Peers read through the cached inner registration, from its own offsets.
    p.sync();
    let dst = block_on(p.user.register(1 << 20, Visibility::All)).expect("dst");
    let local = head(&dst, 1 << 20);
    block_on(p.user.read(&p.peer, &local, &whole(inner.id(), 1 << 20))).expect("read inner");
    assert!(contents(&dst) == patterned(LEN, 11)[1 << 20..2 << 20]);
    let outside = [RemoteRef {
        region: inner.id(),
        offset: 1 << 20,
        len: 1,
    }];
    assert!(matches!(
        block_on(p.user.read(&p.peer, &local, &outside)),
        Err(AgentError::RemoteOutOfRange { .. })
    ));
    // Released one by one: the MR goes with the last registration that uses it.
    assert!(!block_on(inner.release()).deregistered);
    assert!(!block_on(equal.release()).deregistered);
    assert!(block_on(whole_reg.release()).deregistered);
    assert!(block_on(outer.release()).deregistered);
    drop(big);
    // With nothing live, the same range is registered again (a new MR).
    let again = block_on(p.owner.register_host(range(0, LEN), Visibility::All)).expect("again");
    let c = p.owner.registration_counters();
    assert_eq!((c.made, c.reused), (3, 2));
    assert!(block_on(again.release()).deregistered);
    drop(pool);
    report(&format!("registration_cache: counters {c:?}"));
    p.shutdown();
}

/// `n` transfers of 16-256 scattered 4 KiB blocks each, READ from `src` (whole region id) into
/// `dst`.
fn scattered(p: &Pair, dst: &rixl::agent::Registration, src: u64, n: usize) -> Vec<Transfer> {
    (0..n)
        .map(|i| {
            let blocks = 16 + (i * 37) % 241;
            let mut local = LocalDescList::new();
            let mut remote = Vec::new();
            for b in 0..blocks as u64 {
                let at = ((i as u64 * 7919 + b * 104_729) % 4096) * 4096;
                local.push(dst.region(), at, 4096);
                remote.push(RemoteRef {
                    region: src,
                    offset: at,
                    len: 4096,
                });
            }
            p.user.read(&p.peer, &local, &remote)
        })
        .collect()
}

#[test]
fn cancel_abandoned_transfers_post_nothing_more_and_do_not_delay_the_next_one() {
    let Some(mut p) = Pair::new("cancel_abandoned") else {
        return;
    };
    const LEN: usize = 16 << 20;
    let (src, dst) = p.src_dst(LEN, 13);
    block_on(p.user.connect(&p.peer)).expect("connect");
    let before = block_on(p.user.rail_counters())[0];
    let mut ts = scattered(&p, &dst, src.id(), 1000);
    // Descriptors asked for (scattered: nearly one work request each).
    let asked: u64 = (0..1000).map(|i| 16 + (i * 37) % 241).sum();
    for t in &mut ts {
        let _ = t.status(); // shipped to the engine
    }
    std::thread::sleep(Duration::from_millis(20));
    let done = ts
        .iter_mut()
        .map(Transfer::status)
        .filter(|s| *s != TransferStatus::Pending)
        .count();
    // Half cancelled, half dropped.
    for t in ts.iter_mut().step_by(2) {
        let was = t.status();
        t.cancel();
        let want = if was == TransferStatus::Pending {
            TransferStatus::Cancelled
        } else {
            was
        };
        assert_eq!(t.status(), want);
    }
    drop(ts);
    // The next transfer completes at once, and right.
    let t0 = Instant::now();
    let local = head(&dst, 1 << 20);
    dst.region().write_at(0, &vec![0u8; 1 << 20]).unwrap();
    block_on(p.user.read(&p.peer, &local, &whole(src.id(), 1 << 20))).expect("next read");
    let next = t0.elapsed();
    let mut got = vec![0u8; 1 << 20];
    dst.region().read_at(0, &mut got).unwrap();
    assert!(got == patterned(LEN, 13)[..1 << 20]);
    // Drained: nothing left in flight; the abandoned work was mostly never posted.
    let t1 = Instant::now();
    while block_on(p.user.rail_inflight())[0] != 0 {
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "abandoned work drains"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let after = block_on(p.user.rail_counters())[0];
    let posted = after.work_requests - before.work_requests;
    report(&format!(
        "cancel: {done} of 1000 ended before the cancel; engine: {} abandoned, {} ok, {posted} WRs posted for {asked} descriptors; next READ {next:?}",
        after.transfers_abandoned - before.transfers_abandoned,
        after.transfers_ok - before.transfers_ok,
    ));
    // Transfers that had started on the engine were abandoned there (their slots detached);
    // the others never started. Either way, little of the work was ever posted.
    assert!(
        posted < asked / 4,
        "unposted work of abandoned transfers was never posted ({posted} WRs posted, {asked} descriptors asked)"
    );
    assert!(
        next < Duration::from_secs(10),
        "the next transfer waited {next:?} behind abandoned work"
    );
    report(&format!(
        "cancel: 1000 transfers (16-256 blocks) abandoned after 20 ms: {} abandoned on the engine, {posted} WRs posted for {asked} descriptors asked; the next 1 MiB READ took {next:?}",
        after.transfers_abandoned - before.transfers_abandoned
    ));
    p.shutdown();
}

#[test]
fn cancel_after_done_does_nothing_and_memory_outlives_a_cancelled_transfer() {
    let Some(mut p) = Pair::new("cancel_states") else {
        return;
    };
    const LEN: usize = 16 << 20;
    let src = block_on(p.owner.register(LEN, Visibility::All)).expect("src");
    src.region().write_at(0, &patterned(LEN, 17)).unwrap();
    p.sync();
    let dst = block_on(p.user.register_host(
        HostBuffer::from_vec(vec![0u8; LEN]).unwrap(),
        Visibility::All,
    ))
    .expect("dst");
    let local = head(&dst, 4096);
    let mut t = p.user.read(&p.peer, &local, &whole(src.id(), 4096));
    while t.status() == TransferStatus::Pending {
        std::thread::sleep(Duration::from_millis(1));
    }
    t.cancel();
    assert_eq!(
        t.status(),
        TransferStatus::Done,
        "cancel after done does nothing"
    );
    assert_eq!(block_on(t).expect("result kept").bytes, 4096);
    drop(local);
    // A large READ cancelled in flight: the handle ends Cancelled, and the release of its
    // destination waits until the posted work has drained.
    let local = head(&dst, LEN as u64);
    let mut t = p.user.read(&p.peer, &local, &whole(src.id(), LEN as u64));
    assert_eq!(t.status(), TransferStatus::Pending);
    std::thread::sleep(Duration::from_millis(2));
    t.cancel();
    assert_eq!(t.status(), TransferStatus::Cancelled);
    assert!(matches!(t.take_result(), Some(Err(AgentError::Cancelled))));
    drop((t, local));
    let released = block_on(dst.release());
    assert!(released.deregistered);
    assert_eq!(
        block_on(p.user.rail_inflight())[0],
        0,
        "drained before the release resolved"
    );
    // The connection is still good.
    let dst = block_on(p.user.register(4096, Visibility::All)).expect("dst");
    let local = head(&dst, 4096);
    block_on(p.user.read(&p.peer, &local, &whole(src.id(), 4096))).expect("after cancel");
    p.shutdown();
}

#[test]
fn caller_owned_transfers_take_a_per_call_notification_and_timeout() {
    let Some(mut p) = Pair::new("call_options") else {
        return;
    };
    const LEN: usize = 32 << 20;
    let (src, dst) = p.src_dst(LEN, 0);
    let mut notifs = p.owner.notifications().expect("stream");
    let local = head(&dst, 4096);
    let opts = CallOptions::new().notification(&b"req-42"[..]);
    block_on(
        p.user
            .transfer_with(&p.peer, Op::Write, &local, &whole(src.id(), 4096), opts),
    )
    .expect("write with notification");
    let (from, msg) = block_on(notifs.next()).expect("notification");
    assert_eq!(
        (from.as_str(), msg.as_slice()),
        (p.user.name(), &b"req-42"[..])
    );
    // A dead peer: the owner's engine (and its queue pairs) are gone, so nothing answers. The
    // per-call deadline ends the READ long before the transport's own retries would.
    p.owner.shutdown();
    let local = head(&dst, 4096);
    // 100 ms: a loaded guest may hold the caller off its CPU for 20 ms before the READ is posted.
    let opts = CallOptions::new().timeout(Duration::from_millis(100));
    let t0 = Instant::now();
    let r = block_on(
        p.user
            .transfer_with(&p.peer, Op::Read, &local, &whole(src.id(), 4096), opts),
    );
    let took = t0.elapsed();
    assert!(
        // The engine's deadline is what is left of the call's 100 ms once the READ is posted.
        matches!(&r, Err(AgentError::Incomplete { source: TransferError::Timeout(d), descriptors })
            if *d <= Duration::from_millis(100) && *d > Duration::ZERO && descriptors.failed() == (0..1)),
        "per-call timeout: {r:?} after {took:?}"
    );
    report(&format!("call options: notification delivered; a READ from a dead peer ended with its 100 ms per-call deadline after {took:?}"));
    p.shutdown();
}

#[test]
fn partial_metadata_sends_only_named_regions_and_updates_merge() {
    let Some(mut p) = Pair::new("partial_metadata") else {
        return;
    };
    let r1 = block_on(p.owner.register(1 << 20, Visibility::All)).expect("r1");
    let r2 = block_on(p.owner.register(1 << 20, Visibility::All)).expect("r2");
    r1.region().write_at(0, &patterned(1 << 20, 21)).unwrap();
    let reader = p.user.name().to_string();
    let full = p.owner.local_metadata(&reader).expect("full");
    let only1 = p
        .owner
        .local_partial_metadata(&reader, &[r1.id()], &[])
        .expect("partial");
    assert!(only1.len() < full.len());
    p.peer = p.user.load_remote_metadata(&only1).expect("load partial");
    p.user
        .check_remote_metadata(&p.peer, &[r1.id()])
        .expect("r1 known");
    assert!(matches!(
        p.user.check_remote_metadata(&p.peer, &[r1.id(), r2.id()]),
        Err(AgentError::UnknownRegion { region, .. }) if region == r2.id()
    ));
    // A new registration: an update naming it alone, merged into what the user holds.
    let r3 = block_on(p.owner.register(1 << 20, Visibility::All)).expect("r3");
    r3.region().write_at(0, &patterned(1 << 20, 23)).unwrap();
    let update = p
        .owner
        .local_partial_metadata(&reader, &[r3.id()], &[])
        .expect("update");
    p.user.load_remote_metadata(&update).expect("merge");
    p.user
        .check_remote_metadata(&p.peer, &[r1.id(), r3.id()])
        .expect("both known");
    let dst = block_on(p.user.register(1 << 20, Visibility::All)).expect("dst");
    let local = head(&dst, 1 << 20);
    for (r, seed) in [(&r1, 21), (&r3, 23)] {
        block_on(p.user.read(&p.peer, &local, &whole(r.id(), 1 << 20))).expect("read");
        assert!(contents(&dst) == patterned(1 << 20, seed));
    }
    // A released region, announced as removed, is forgotten.
    let gone = r1.id();
    block_on(r1.release());
    let removal = p
        .owner
        .local_partial_metadata(&reader, &[], &[gone])
        .expect("removal");
    p.user
        .load_remote_metadata(&removal)
        .expect("merge removal");
    assert!(p.user.check_remote_metadata(&p.peer, &[gone]).is_err());
    p.user
        .check_remote_metadata(&p.peer, &[r3.id()])
        .expect("r3 kept");
    // Bad input: a region that is not ours, or not visible to the reader.
    let secret = block_on(
        p.owner
            .register(4096, Visibility::Only(vec!["else".into()])),
    )
    .unwrap();
    for id in [secret.id(), 9999] {
        assert!(matches!(
            p.owner.local_partial_metadata(&reader, &[id], &[]),
            Err(AgentError::UnknownLocalRegion(x)) if x == id
        ));
    }
    assert!(matches!(
        p.user.check_remote_metadata("nobody", &[1]),
        Err(AgentError::UnknownPeer(_))
    ));
    report(&format!(
        "partial_metadata: full blob {} bytes, one region {} bytes, update {} bytes, removal {} bytes",
        full.len(),
        only1.len(),
        update.len(),
        removal.len()
    ));
    p.shutdown();
}

#[test]
fn connect_makes_the_connection_before_the_first_transfer() {
    let Some(mut p) = Pair::new("connect_eager") else {
        return;
    };
    let src = block_on(p.owner.register(1 << 20, Visibility::All)).expect("src");
    p.sync();
    assert!(matches!(
        block_on(p.user.connect("nobody")),
        Err(AgentError::UnknownPeer(_))
    ));
    assert!(!p.user.is_connected(&p.peer));
    let t0 = Instant::now();
    block_on(p.user.connect(&p.peer)).expect("connect");
    let connect = t0.elapsed();
    assert!(
        p.user.is_connected(&p.peer),
        "connected before any transfer"
    );
    let before = block_on(p.user.rail_counters())[0];
    block_on(p.user.connect(&p.peer)).expect("connect again is a no-op");
    let dst = block_on(p.user.register(1 << 20, Visibility::All)).expect("dst");
    let local = head(&dst, 4096);
    let t1 = Instant::now();
    block_on(p.user.read(&p.peer, &local, &whole(src.id(), 4096))).expect("first read");
    let first = t1.elapsed();
    let t2 = Instant::now();
    block_on(p.user.read(&p.peer, &local, &whole(src.id(), 4096))).expect("second read");
    let second = t2.elapsed();
    report(&format!(
        "connect: eager connect {connect:?}; then first 4 KiB READ {first:?}, second {second:?}"
    ));
    // Both READs ran on the connection that connect made.
    let after = block_on(p.user.rail_counters())[0];
    assert_eq!(after.transfers_ok - before.transfers_ok, 2);
    assert!(p.user.is_connected(&p.peer));
    p.shutdown();
}

#[test]
fn estimate_lands_within_30_percent_of_measured_times_from_4k_to_8m() {
    let Some(mut p) = Pair::new("estimate") else {
        return;
    };
    const LEN: usize = 16 << 20;
    let (src, dst) = p.src_dst(LEN, 0);
    let list = |bytes: u64, pieces: u64| {
        let mut local = LocalDescList::new();
        let mut remote = Vec::new();
        let piece = bytes / pieces;
        for k in 0..pieces {
            // Scattered: every other piece-sized slot.
            local.push(dst.region(), 2 * k * piece, piece);
            remote.push(RemoteRef {
                region: src.id(),
                offset: 2 * k * piece,
                len: piece,
            });
        }
        (local, remote)
    };
    // Bad input: an unknown peer, and a known peer before any transfer.
    let (l, r) = list(4096, 1);
    assert!(matches!(
        p.user.estimate(Op::Read, &l, &r, "nobody"),
        Err(AgentError::UnknownPeer(_))
    ));
    assert!(matches!(
        p.user.estimate(Op::Read, &l, &r, &p.peer),
        Err(AgentError::NoEstimate { samples: 0, .. })
    ));
    block_on(p.user.connect(&p.peer)).expect("connect");
    let shapes: [(u64, u64); 6] = [
        (4 << 10, 1),
        (64 << 10, 1),
        (256 << 10, 64),
        (1 << 20, 1),
        (2 << 20, 128),
        (8 << 20, 1),
    ];
    let run = |bytes: u64, pieces: u64| {
        let (l, r) = list(bytes, pieces);
        let t = Instant::now();
        block_on(p.user.read(&p.peer, &l, &r)).expect("read");
        t.elapsed()
    };
    // Warm-up: the model learns from these.
    for _ in 0..6 {
        for &(b, n) in &shapes {
            run(b, n);
        }
    }
    // A guest on a shared 2-core host stalls now and then (episodes where a 4 KiB READ takes
    // ~100 ms instead of ~3 ms): a measuring round that a stall spoiled is measured again after
    // three more learning passes, up to ten rounds (in full-suite runs whole stretches of five
    // rounds were spoiled); every round is reported.
    let mut rounds = Vec::new();
    let mut worst = f64::INFINITY;
    for round in 1..=10 {
        if round > 1 {
            for _ in 0..3 {
                for &(b, n) in &shapes {
                    run(b, n);
                }
            }
        }
        let mut lines = Vec::new();
        let mut round_worst = 0.0f64;
        for &(b, n) in &shapes {
            let (l, r) = list(b, n);
            let est = p
                .user
                .estimate(Op::Read, &l, &r, &p.peer)
                .expect("estimate");
            let mut took: Vec<Duration> = (0..7).map(|_| run(b, n)).collect();
            took.sort();
            let measured = took[3];
            let ratio = est.as_secs_f64() / measured.as_secs_f64();
            round_worst = round_worst.max((ratio - 1.0).abs());
            lines.push(format!(
                "{} KiB in {n}: estimate {est:?}, measured median {measured:?}, ratio {ratio:.2}",
                b >> 10
            ));
        }
        rounds.push(format!("round {round}:\n  {}", lines.join("\n  ")));
        worst = round_worst;
        if worst <= 0.30 {
            break;
        }
    }
    let text = format!("estimate (READ on rxe):\n{}", rounds.join("\n"));
    report(&text);
    assert!(
        worst <= 0.30,
        "an estimate is off by {:.0} % in the last round\n{text}",
        worst * 100.0
    );
    p.shutdown();
}

#[test]
fn caller_owned_engine_kv_example_moves_its_own_paged_cache_with_every_byte_verified() {
    if require_or_skip("engine_kv example", || {
        rixl::verbs::DeviceList::new().and_then(|l| l.find(None).map(|_| ()))
    })
    .is_none()
    {
        return;
    }
    let out = std::process::Command::new(example("engine_kv"))
        .args([
            "--requests",
            "4",
            "--layers",
            "4",
            "--blocks",
            "64",
            "--per-request",
            "16",
        ])
        .output()
        .expect("run engine_kv");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "engine_kv failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("every byte verified"), "{stdout}");
    // Each engine's four layers reused the map's one memory region.
    assert!(
        stdout.contains("memory regions made 1, reused 4"),
        "{stdout}"
    );
    report(&format!("engine_kv: {}", stdout.trim()));
}

#[test]
fn caller_owned_failure_names_the_descriptors_that_failed_after_those_that_completed() {
    // Without NIC grants, so that the freed region's key reaches the NIC, which refuses it: what
    // is checked here is how posted work that failed is reported. (With grants the agent has
    // no key for a released region and refuses before posting: `NotGranted`, `rdma_grants`.)
    let Some(mut p) = Pair::with_grants("failed_ranges", false) else {
        return;
    };
    // Every request signaled, so the completed prefix is exact.
    let mut cfg = AgentConfig::default();
    cfg.cpu = rixl::runtime::cpu_at(1);
    cfg.engine.signal_interval = 1;
    cfg.nic_grants = false;
    p.user.shutdown();
    p.user = Agent::new("failed_ranges-user1", cfg).expect("user");
    const BLOCK: u64 = 64 << 10;
    let kept = block_on(p.owner.register((8 * BLOCK) as usize, Visibility::All)).expect("kept");
    kept.region()
        .write_at(0, &patterned(8 * BLOCK as usize, 31))
        .unwrap();
    let freed = block_on(p.owner.register((8 * BLOCK) as usize, Visibility::All)).expect("freed");
    p.sync();
    // The owner frees the second region (its memory region deregistered); the user's metadata
    // still names it.
    let freed_id = freed.id();
    assert!(block_on(freed.release()).deregistered);
    let dst = block_on(p.user.register((16 * BLOCK) as usize, Visibility::All)).expect("dst");
    let mut local = LocalDescList::new();
    let mut remote = Vec::new();
    for (k, region) in (0..16u64).map(|k| (k, if k < 8 { kept.id() } else { freed_id })) {
        local.push(dst.region(), k * BLOCK, BLOCK);
        remote.push(RemoteRef {
            region,
            offset: (k % 8) * BLOCK,
            len: BLOCK,
        });
    }
    let r = block_on(p.user.read(&p.peer, &local, &remote));
    let d = match &r {
        Err(AgentError::Incomplete {
            source: TransferError::RemoteAccess { .. },
            descriptors,
        }) => *descriptors,
        other => panic!("a READ of freed memory: {other:?}"),
    };
    assert_eq!(d.total, 16);
    assert!(
        d.completed <= 8 && d.failed().contains(&8),
        "descriptor 8 (the first of the freed region) failed: {d:?}"
    );
    assert!(d.not_posted().is_empty() || d.not_posted().start >= 9);
    // What the error calls completed did land, byte for byte.
    let mut got = vec![0u8; (d.completed as u64 * BLOCK) as usize];
    dst.region().read_at(0, &mut got).unwrap();
    assert!(got[..] == patterned(8 * BLOCK as usize, 31)[..got.len()]);
    report(&format!(
        "failed ranges: a READ of 8 blocks of live memory then 8 of freed memory: descriptors {:?} completed, {:?} failed, {:?} not posted ({})",
        0..d.completed,
        d.failed(),
        d.not_posted(),
        r.expect_err("error")
    ));
    p.shutdown();
}
