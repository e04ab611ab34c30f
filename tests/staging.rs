//! The staging pipeline (memory -> pooled bounce buffers -> I/O, and back) on the host, with
//! host memory standing in for the device: the same code a GPU node runs, with the copy leg
//! injected. The file tier runs on a real file, the object tier against a real s3s-fs.

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{bytes, dram, local_agent as agent, StandIn};
use futures_lite::future::block_on;
use futures_util::StreamExt;
use rixl::agent::AgentError;
use rixl::object::{ObjectDesc, ObjectError, ObjectSpec};
use rixl::runtime::{FileDesc, FileError, FileMode, FileSpec, LocalDescList, TransferError};
use rixl::staging::{chunk_of, stage_out, BouncePool, BounceSource, StagingError};
use rixl_testkit::s3::{S3Server, ACCESS_KEY, SECRET_KEY};

fn overlaps(a: &[(Instant, Instant)], b: &[(Instant, Instant)]) -> bool {
    a.iter()
        .any(|&(s1, e1)| b.iter().any(|&(s2, e2)| s1 < e2 && s2 < e1))
}

#[test]
fn staging_pipeline_overlaps_copy_and_io_within_bounded_memory() {
    let a = agent("stage-pipe");
    let chunk = 1usize << 20;
    let n = 12usize;
    let src = block_on(dram(&a, n * chunk, Some(11)));
    let mut local = LocalDescList::new();
    // Scattered: odd MiBs then even ones, so chunks gather pieces.
    for i in (1..n).step_by(2).chain((0..n).step_by(2)) {
        local.push(src.region(), (i * chunk) as u64, chunk as u64);
    }
    let starts = local.stream_starts();
    let chunks: Vec<_> = (0..n)
        .map(|i| chunk_of(&local, &starts, (i * chunk) as u64, chunk as u64))
        .collect();
    let pool = BouncePool::new(chunk, 3, BounceSource::Host);
    let copier = StandIn::new(Duration::from_millis(20));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let io_spans = Arc::new(Mutex::new(Vec::new()));
    let out = rt.block_on({
        let pool = pool.clone();
        let copier = copier.clone();
        let io_spans = Arc::clone(&io_spans);
        async move {
            let mut staged = stage_out(&pool, copier, chunks, 2);
            let mut sink = Vec::new();
            let mut writes = futures_util::stream::FuturesUnordered::new();
            while let Some(b) = staged.next().await {
                let b = b.unwrap();
                let io_spans = Arc::clone(&io_spans);
                // The I/O leg: 20 ms on the "wire" per buffer, one at a time.
                let data = b.into_bytes();
                sink.extend_from_slice(&data);
                writes.push(async move {
                    let t0 = Instant::now();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    io_spans.lock().unwrap().push((t0, Instant::now()));
                    drop(data);
                });
                while writes.len() >= 2 {
                    writes.next().await;
                }
            }
            while writes.next().await.is_some() {}
            sink
        }
    });
    let staged = out;
    let mut want = Vec::new();
    for i in (1..n).step_by(2).chain((0..n).step_by(2)) {
        want.extend(bytes(src.region(), (i * chunk) as u64, chunk));
    }
    assert!(
        staged == want,
        "the staged stream is the list's bytes in order"
    );
    let c = pool.counters();
    assert!(
        c.allocated <= 3 && c.high_water <= 3,
        "never more buffers than the pool holds: {c:?}"
    );
    assert_eq!(
        (c.in_use, c.copies),
        (0, n as u64),
        "every buffer went back"
    );
    assert!(
        overlaps(&copier.spans.lock().unwrap(), &io_spans.lock().unwrap()),
        "a copy ran while a buffer was on the wire"
    );
}

#[test]
fn staging_file_round_trip_with_device_stand_in() {
    let a = agent("stage-file");
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("staging-file");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    block_on(async {
        let len = 24usize << 20;
        let src = dram(&a, len, Some(17)).await;
        let f = a
            .register_file(FileSpec::new(
                dir.join("kv.bin"),
                2 * len as u64,
                FileMode::CreateNew,
            ))
            .await
            .unwrap();
        let dev = StandIn::new(Duration::ZERO);
        let staged = f.with_copier(dev.clone());
        // 96 blocks of 256 KiB, to reversed file slots.
        let block = 256u64 << 10;
        let blocks = len as u64 / block;
        let mut local = LocalDescList::new();
        let mut descs = Vec::new();
        for i in 0..blocks {
            local.push(src.region(), i * block, block);
            descs.push(FileDesc::new((2 * blocks - 1 - i) * block, block));
        }
        let st = a.write_file(&local, &staged, &descs).await.unwrap();
        assert_eq!(st.bytes, len as u64);
        assert_eq!(st.work_requests, 6, "six 4 MiB chunks");
        let wrote = dev.copies.load(Ordering::SeqCst);
        assert_eq!(
            wrote, blocks as usize,
            "each block copied once by the device's leg"
        );
        // Back through the staged read, into another region.
        let dst = dram(&a, len, None).await;
        let mut back = LocalDescList::new();
        for i in 0..blocks {
            back.push(dst.region(), i * block, block);
        }
        a.read_file(&back, &staged, &descs).await.unwrap();
        assert!(bytes(dst.region(), 0, len) == bytes(src.region(), 0, len));
        assert!(
            dev.copies.load(Ordering::SeqCst) > wrote,
            "reads copy through the device leg"
        );
        // And the direct path reads what the staged path wrote.
        let dst2 = dram(&a, len, None).await;
        let mut direct = LocalDescList::new();
        direct.push(dst2.region(), 0, len as u64);
        let whole: Vec<FileDesc> = (0..blocks)
            .map(|i| FileDesc::new((2 * blocks - 1 - i) * block, block))
            .collect();
        a.read_file(&direct, &f, &whole).await.unwrap();
        assert!(bytes(dst2.region(), 0, len) == bytes(src.region(), 0, len));
        let c = staged.bounce_pool().counters();
        assert!(c.allocated <= staged.bounce_pool().capacity(), "{c:?}");

        // An unaligned staged write is refused before anything moves; a failing copy is typed.
        let mut one = LocalDescList::new();
        one.push(src.region(), 0, 1000);
        let e = a
            .write_file(&one, &staged, &[FileDesc::new(0, 1000)])
            .await
            .unwrap_err();
        assert!(matches!(
            e,
            AgentError::Transfer(TransferError::File(FileError::Unaligned { index: 0, .. }))
        ));
        // Past the registered size: refused before anything moves (cuFile would not check).
        let mut page = LocalDescList::new();
        page.push(src.region(), 0, 4096);
        let e = a
            .write_file(&page, &staged, &[FileDesc::new(2 * len as u64, 4096)])
            .await
            .unwrap_err();
        assert!(matches!(
            e,
            AgentError::Transfer(TransferError::File(FileError::OutOfRange { index: 0, .. }))
        ));
        dev.fail.store(true, Ordering::SeqCst);
        let e = a.write_file(&local, &staged, &descs).await.unwrap_err();
        assert!(
            matches!(e, AgentError::Staging(StagingError::Closed)),
            "{e:?}"
        );
    });
}

#[test]
fn staging_object_round_trip_with_device_stand_in() {
    let Some(s3) = S3Server::start("staging_object", "rixl-stage") else {
        return;
    };
    let a = agent("stage-obj");
    block_on(async {
        let objs = a
            .register_object(
                ObjectSpec::new(s3.endpoint(), "rixl-stage", "vram")
                    .credentials(ACCESS_KEY, SECRET_KEY),
            )
            .await
            .unwrap();
        let dev = StandIn::new(Duration::from_millis(5));
        let staged = objs.with_copier(dev.clone());
        let len = 32usize << 20;
        let src = dram(&a, len, Some(23)).await;
        let mut local = LocalDescList::new();
        local.push(src.region(), 0, len as u64);
        let descs = [ObjectDesc::new("layer-0", 0, len as u64)];
        a.write_object(&local, &staged, &descs).await.unwrap();
        assert_eq!(
            dev.copies.load(Ordering::SeqCst),
            4,
            "four 8 MiB parts staged"
        );
        assert_eq!(staged.counters().multipart_uploads, 1);
        let dst = dram(&a, len, None).await;
        let mut back = LocalDescList::new();
        back.push(dst.region(), 0, len as u64);
        a.read_object(&back, &staged, &descs).await.unwrap();
        assert_eq!(dev.copies.load(Ordering::SeqCst), 8, "and four copied back");
        assert!(bytes(dst.region(), 0, len) == bytes(src.region(), 0, len));
        let c = staged.bounce_pool().counters();
        assert!(
            c.allocated <= staged.bounce_pool().capacity() && c.in_use == 0,
            "{c:?}"
        );

        // A copy leg that fails mid-upload: typed, and the upload is aborted (no object).
        dev.fail.store(true, Ordering::SeqCst);
        let e = a
            .write_object(
                &local,
                &staged,
                &[ObjectDesc::new("layer-1", 0, len as u64)],
            )
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::Object(ObjectError::Staging(StagingError::Closed))
            ),
            "{e:?}"
        );
        assert_eq!(staged.size("layer-1").await.unwrap(), None);
        assert_eq!(staged.counters().aborted, 1);
    });
}
