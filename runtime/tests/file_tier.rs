//! The FILE tier on real files (no RDMA needed): round trips of scattered block lists with every
//! byte verified (through the tier and independently through `std::fs`), merging, alignment,
//! and each failure (too small, past the end, deleted, truncated, full file system, timeout,
//! dropped future) as a typed error that corrupts nothing already written.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use futures_lite::future::block_on;
use rixl_runtime::{
    EngineConfig, EngineHandle, EnginePool, FileDesc, FileError, FileId, FileMode, FileSpec,
    InvalidDescriptor, LocalDescList, Op, Region, RuntimeError, TransferError, TransferStats,
};

const IO_MEMORY: usize = 1 << 20;

fn pool() -> (EnginePool, EngineHandle) {
    let mut cfg = EngineConfig::from_env();
    cfg.require_nic = false;
    let pool = EnginePool::start(&cfg, &[0], IO_MEMORY).expect("engine starts without a NIC");
    let h = pool.handles()[0].clone();
    (pool, h)
}

fn dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("file_tier-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Fills a region with the test kit's pattern of `seed`.
fn fill(r: &Region, seed: u64) {
    let mut v = vec![0u8; r.len() as usize];
    rixl_testkit::fill(&mut v, seed);
    r.write_at(0, &v).unwrap();
}

fn contents(r: &Region, off: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    r.read_at(off, &mut v).unwrap();
    v
}

fn list(r: &Region, pieces: &[(u64, u64)]) -> LocalDescList {
    let mut l = LocalDescList::new();
    for &(o, n) in pieces {
        l.push(r, o, n);
    }
    l
}

/// One transfer of `len` bytes between the start of `r` and the start of `file`.
fn whole<'a>(
    h: &'a EngineHandle,
    file: FileId,
    op: Op,
    r: &Region,
    len: u64,
) -> impl Future<Output = Result<TransferStats, TransferError>> + use<'a> {
    h.file_transfer(
        file,
        op,
        list(r, &[(0, len)]),
        vec![FileDesc::new(0, len)],
        None,
    )
}

fn file_err(e: TransferError) -> FileError {
    match e {
        TransferError::File(f) => f,
        other => panic!("expected a file error, got {other:?}"),
    }
}

/// A small LCG, so the test needs no rand dependency.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

#[test]
fn scattered_round_trip_every_byte_verified() {
    let (pool, h) = pool();
    let d = dir("roundtrip");
    let path = d.join("kv.bin");
    block_on(async {
        let file_size = 64u64 << 20;
        let f = h
            .open_file(FileSpec::new(&path, file_size, FileMode::Create))
            .await
            .unwrap();
        assert_eq!(f.size, file_size);
        let src = h.register(16 << 20).await.unwrap();
        let dst = h.register((16 << 20) + 8192).await.unwrap();
        fill(&src, 7);
        // 1000 blocks of 4..64 KiB (multiples of 4 KiB) at shuffled, non-overlapping file
        // slots, from scattered local offsets.
        let mut rng = Lcg(42);
        let slot = 64u64 << 10;
        let mut slots: Vec<u64> = (0..file_size / slot).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, rng.next(i as u64 + 1) as usize);
        }
        let mut local = Vec::new();
        let mut remote = Vec::new();
        let mut loff = 0u64;
        for &s in slots.iter().take(1000) {
            let len = (1 + rng.next(16)) * 4096;
            if loff + len > src.len() {
                break;
            }
            local.push((loff, len));
            remote.push(FileDesc::new(s * slot, len));
            loff += len + 512 * rng.next(3);
        }
        let n = local.len();
        assert!(n > 300, "{n} blocks");
        let st = h
            .file_transfer(f.id, Op::Write, list(&src, &local), remote.clone(), None)
            .await
            .unwrap();
        assert_eq!(st.bytes, local.iter().map(|l| l.1).sum::<u64>());
        // Independent check through std::fs.
        let on_disk = std::fs::read(&path).unwrap();
        for (&(lo, len), r) in local.iter().zip(&remote) {
            assert_eq!(
                &on_disk[r.offset as usize..(r.offset + len) as usize],
                &contents(&src, lo, len)[..],
                "block at file offset {}",
                r.offset
            );
        }
        // Read back into other local offsets and compare.
        let back: Vec<(u64, u64)> = local.iter().map(|&(o, l)| (o + 8192, l)).collect();
        let mut fits = back.clone();
        fits.retain(|&(o, l)| o + l <= dst.len());
        assert_eq!(fits.len(), back.len());
        h.file_transfer(f.id, Op::Read, list(&dst, &back), remote.clone(), None)
            .await
            .unwrap();
        for (&(lo, len), &(bo, _)) in local.iter().zip(&back) {
            assert_eq!(contents(&src, lo, len), contents(&dst, bo, len));
        }
        let c = h.file_counters().await.unwrap();
        assert_eq!(c.bytes_written, st.bytes);
        assert_eq!(c.bytes_read, st.bytes);
        eprintln!("{n} blocks, {} bytes, {c:?}", st.bytes);
    });
    pool.shutdown();
}

#[test]
fn contiguous_blocks_merge_into_few_ios_and_unaligned_reads_work() {
    let (pool, h) = pool();
    let d = dir("merge");
    block_on(async {
        let f = h
            .open_file(FileSpec::new(d.join("m.bin"), 4 << 20, FileMode::CreateNew))
            .await
            .unwrap();
        let src = h.register(4 << 20).await.unwrap();
        fill(&src, 3);
        // 512 adjacent 4 KiB blocks from scattered local places (reverse order): 2 I/Os of 1 MiB.
        let blocks = 512u64;
        let local: Vec<(u64, u64)> = (0..blocks)
            .map(|i| ((blocks - 1 - i) * 4096, 4096))
            .collect();
        let remote: Vec<FileDesc> = (0..blocks).map(|i| FileDesc::new(i * 4096, 4096)).collect();
        let before = h.file_counters().await.unwrap();
        let st = h
            .file_transfer(f.id, Op::Write, list(&src, &local), remote, None)
            .await
            .unwrap();
        let after = h.file_counters().await.unwrap();
        assert_eq!(st.work_requests, 2, "{st:?}");
        assert_eq!(after.ios - before.ios, 2);
        assert_eq!(after.merged - before.merged, blocks - 2);
        // An unaligned read (13 bytes at offset 4097) is served from the aligned range.
        let dst = h.register(4096).await.unwrap();
        h.file_transfer(
            f.id,
            Op::Read,
            list(&dst, &[(100, 13)]),
            vec![FileDesc::new(4097, 13)],
            None,
        )
        .await
        .unwrap();
        // File offset 4097 is block 1, byte 1: local block (blocks-2), byte 1.
        assert_eq!(
            contents(&dst, 100, 13),
            contents(&src, (blocks - 2) * 4096 + 1, 13)
        );
    });
    pool.shutdown();
}

#[test]
fn bad_requests_are_typed_and_write_nothing() {
    let (pool, h) = pool();
    let d = dir("bad");
    let path = d.join("b.bin");
    block_on(async {
        let f = h
            .open_file(FileSpec::new(&path, 1 << 20, FileMode::Create))
            .await
            .unwrap();
        let src = h.register(1 << 20).await.unwrap();
        fill(&src, 9);
        whole(&h, f.id, Op::Write, &src, 1 << 20).await.unwrap();
        let good = std::fs::read(&path).unwrap();
        let ios_before = h.file_counters().await.unwrap().ios;
        let junk = h.register(1 << 20).await.unwrap();
        fill(&junk, 99);

        // Unaligned write (even after merging).
        let e = h
            .file_transfer(
                f.id,
                Op::Write,
                list(&junk, &[(0, 1000), (1000, 96)]),
                vec![FileDesc::new(4096, 1000), FileDesc::new(5096, 96)],
                None,
            )
            .await
            .unwrap_err();
        assert!(matches!(
            file_err(e),
            FileError::Unaligned {
                index: 0,
                offset: 4096,
                len: 1096,
                ..
            }
        ));
        // Past the end of the registration.
        let e = h
            .file_transfer(
                f.id,
                Op::Read,
                list(&junk, &[(0, 8192)]),
                vec![FileDesc::new((1 << 20) - 4096, 8192)],
                None,
            )
            .await
            .unwrap_err();
        assert!(matches!(
            file_err(e),
            FileError::OutOfRange {
                index: 0,
                size: 1048576,
                ..
            }
        ));
        // Local range outside its region, and mismatched totals.
        let e = h
            .file_transfer(
                f.id,
                Op::Write,
                list(&junk, &[((1 << 20) - 100, 4096)]),
                vec![FileDesc::new(0, 4096)],
                None,
            )
            .await
            .unwrap_err();
        assert!(matches!(
            e,
            TransferError::InvalidDescriptor(InvalidDescriptor::OutOfRange { .. })
        ));
        let e = h
            .file_transfer(
                f.id,
                Op::Write,
                list(&junk, &[(0, 4096)]),
                vec![FileDesc::new(0, 8192)],
                None,
            )
            .await
            .unwrap_err();
        assert!(matches!(
            e,
            TransferError::InvalidDescriptor(InvalidDescriptor::LengthMismatch { .. })
        ));
        let e = h
            .file_transfer(f.id, Op::Write, LocalDescList::new(), vec![], None)
            .await
            .unwrap_err();
        assert!(matches!(
            e,
            TransferError::InvalidDescriptor(InvalidDescriptor::Empty { .. })
        ));
        assert_eq!(
            h.file_counters().await.unwrap().ios,
            ios_before,
            "no I/O was issued"
        );
        assert_eq!(std::fs::read(&path).unwrap(), good, "nothing was written");

        // Registration errors.
        let e = h
            .open_file(FileSpec::new(d.join("missing"), 4096, FileMode::Open))
            .await
            .unwrap_err();
        assert!(matches!(e, FileError::NotFound { .. }), "{e:?}");
        let e = h
            .open_file(FileSpec::new(&path, 4096, FileMode::CreateNew))
            .await
            .unwrap_err();
        assert!(matches!(e, FileError::Exists { .. }), "{e:?}");
        let e = h
            .open_file(FileSpec::new(&path, 2 << 20, FileMode::Open))
            .await
            .unwrap_err();
        assert_eq!(
            e,
            FileError::TooSmall {
                path: path.clone(),
                size: 1 << 20,
                needed: 2 << 20
            }
        );
        let e = h
            .open_file(FileSpec::new(d.join("zero"), 0, FileMode::Create))
            .await
            .unwrap_err();
        assert!(matches!(e, FileError::ZeroSize { .. }));
        assert_eq!(
            std::fs::read(&path).unwrap(),
            good,
            "failed registrations left the file alone"
        );

        // Open mode with size 0 takes the file's size; the data is there.
        let g = h
            .open_file(FileSpec::new(&path, 0, FileMode::Open))
            .await
            .unwrap();
        assert_eq!(g.size, 1 << 20);
        let dst = h.register(1 << 20).await.unwrap();
        whole(&h, g.id, Op::Read, &dst, 1 << 20).await.unwrap();
        assert_eq!(contents(&dst, 0, 1 << 20), good);

        // A closed id is unknown.
        h.close_file(g.id);
        let e = whole(&h, g.id, Op::Read, &dst, 4096).await.unwrap_err();
        assert!(matches!(file_err(e), FileError::UnknownFile(_)));

        // Truncated behind our back: the read comes up short, typed.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(8192)
            .unwrap();
        let e = whole(&h, f.id, Op::Read, &dst, 65536).await.unwrap_err();
        assert!(matches!(
            file_err(e),
            FileError::ShortRead {
                offset: 0,
                expected: 65536,
                got: 8192,
                ..
            }
        ));

        // Deleted after registration: refused, so no data goes to an unlinked inode.
        std::fs::remove_file(&path).unwrap();
        let e = whole(&h, f.id, Op::Write, &src, 4096).await.unwrap_err();
        assert!(matches!(file_err(e), FileError::Deleted { .. }));

        // RDMA calls on a core without a NIC are typed too.
        if !h.has_nic() {
            assert!(matches!(
                h.prepare_connection().await,
                Err(RuntimeError::NoNic)
            ));
        }
    });
    pool.shutdown();
}

#[test]
fn timeout_and_dropped_futures_keep_memory_alive_and_finish() {
    let (pool, h) = pool();
    let d = dir("timeout");
    let path = d.join("t.bin");
    block_on(async {
        let size = 64u64 << 20;
        let f = h
            .open_file(FileSpec::new(&path, size, FileMode::Create))
            .await
            .unwrap();
        let src = h.register(size as usize).await.unwrap();
        fill(&src, 5);
        let e = h
            .file_transfer(
                f.id,
                Op::Write,
                list(&src, &[(0, size)]),
                vec![FileDesc::new(0, size)],
                Some(Duration::from_micros(1)),
            )
            .await
            .unwrap_err();
        assert_eq!(e, TransferError::Timeout(Duration::from_micros(1)));
        // The timed-out transfer issues no new I/O; the ones in flight finish in the background.
        let mut last = h.file_counters().await.unwrap();
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let c = h.file_counters().await.unwrap();
            if c == last {
                break;
            }
            last = c;
        }
        assert!(
            last.bytes_written < size,
            "the timed-out transfer stopped early: {last:?}"
        );
        // A dropped future: the transfer still runs to the end with its own handle on `src2`.
        let src2 = h.register(size as usize).await.unwrap();
        fill(&src2, 6);
        let fut = whole(&h, f.id, Op::Write, &src2, size);
        let mut fut = Box::pin(fut);
        let waker =
            futures_lite::future::poll_fn(|cx| std::task::Poll::Ready(cx.waker().clone())).await;
        let _ = fut
            .as_mut()
            .poll(&mut std::task::Context::from_waker(&waker));
        drop(fut);
        drop(src2);
        let start = std::time::Instant::now();
        loop {
            let c = h.file_counters().await.unwrap();
            if c.bytes_written >= last.bytes_written + size {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "{c:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        let on_disk = std::fs::read(&path).unwrap();
        assert!(
            on_disk
                .iter()
                .enumerate()
                .all(|(i, &b)| b == rixl_testkit::pattern(6, i)),
            "the dropped transfer wrote every byte"
        );
    });
    pool.shutdown();
}

/// A full file system: a 2 MiB tmpfs mounted for the test (needs root; skipped with the reason
/// printed otherwise).
#[test]
fn full_file_system_is_typed_and_corrupts_nothing() {
    // A mount left by an interrupted earlier run.
    let stale = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("file_tier-full/mnt");
    let _ = std::process::Command::new("umount")
        .arg("-l")
        .arg(&stale)
        .stderr(std::process::Stdio::null())
        .status();
    let d = dir("full");
    let mnt = d.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            "size=2m",
            "rixl-full",
            mnt.to_str().unwrap(),
        ])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let msg = "SKIPPED full_file_system_is_typed_and_corrupts_nothing: cannot mount a small tmpfs (needs root)";
        if std::env::var("RIXL_REQUIRE_MOUNT").is_ok_and(|v| v == "1") {
            panic!("{msg}");
        }
        eprintln!("{msg}");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _u = Unmount(mnt.clone());
    let (pool, h) = pool();
    block_on(async {
        let a = mnt.join("a.bin");
        let f = h
            .open_file(FileSpec::new(&a, 1 << 20, FileMode::Create))
            .await
            .unwrap();
        let src = h.register(4 << 20).await.unwrap();
        fill(&src, 11);
        whole(&h, f.id, Op::Write, &src, 1 << 20).await.unwrap();
        let good = std::fs::read(&a).unwrap();
        assert_eq!(good, contents(&src, 0, 1 << 20));
        // Reserving more than is left fails at registration and leaves no file behind.
        let b = mnt.join("b.bin");
        let e = h
            .open_file(FileSpec::new(&b, 4 << 20, FileMode::Create))
            .await
            .unwrap_err();
        assert!(matches!(e, FileError::NoSpace { .. }), "{e:?}");
        assert!(!b.exists());
        // A sparse file registered with Open fills the disk mid-transfer: typed, and the other
        // file is intact.
        let c = mnt.join("c.bin");
        std::fs::File::create(&c).unwrap().set_len(4 << 20).unwrap();
        let g = h
            .open_file(FileSpec::new(&c, 4 << 20, FileMode::Open))
            .await
            .unwrap();
        let e = whole(&h, g.id, Op::Write, &src, 4 << 20).await.unwrap_err();
        assert!(
            matches!(file_err(e.clone()), FileError::NoSpace { .. }),
            "{e:?}"
        );
        assert_eq!(std::fs::read(&a).unwrap(), good);
        let dst = h.register(1 << 20).await.unwrap();
        whole(&h, f.id, Op::Read, &dst, 1 << 20).await.unwrap();
        assert_eq!(contents(&dst, 0, 1 << 20), good);
    });
    pool.shutdown();
}

#[test]
fn a_core_without_a_nic_uses_the_file_settings_it_was_given() {
    let mut cfg = EngineConfig::from_env();
    cfg.require_nic = false;
    cfg.file.max_io = 64 << 10;
    let pool = EnginePool::start(&cfg, &[0], IO_MEMORY).expect("engine starts");
    let h = pool.handles()[0].clone();
    let d = dir("settings");
    block_on(async {
        let f = h
            .open_file(FileSpec::new(d.join("s.bin"), 1 << 20, FileMode::Create))
            .await
            .unwrap();
        let src = h.register(1 << 20).await.unwrap();
        let st = whole(&h, f.id, Op::Write, &src, 1 << 20).await.unwrap();
        assert_eq!(
            st.work_requests, 16,
            "1 MiB in I/Os of the configured 64 KiB"
        );
    });
    pool.shutdown();
}
