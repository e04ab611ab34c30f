//! Calls made from a task on the engine's own core start there, without the cross-thread
//! hand-off; calls from other threads still go over the core's channel. A core without a NIC
//! (this host has none) answers a transfer with its typed `NoNic` on either path, and the
//! FILE tier moves real bytes on either path.

use futures_lite::future::block_on;
use rixl_runtime::{
    ConnId, EngineConfig, EngineHandle, EnginePool, FileDesc, FileMode, FileSpec, HandOffCounters,
    LocalDescList, Op, RemoteDescList, RuntimeError, TransferError, TransferOptions, TransferStats,
};

fn pool() -> EnginePool {
    let mut cfg = EngineConfig::from_env();
    cfg.require_nic = false;
    EnginePool::start(&cfg, &[0], 1 << 20).expect("engine starts without a NIC")
}

/// A WRITE of nothing: the core without a NIC answers `NoNic`.
async fn transfer(h: &EngineHandle) -> Result<TransferStats, TransferError> {
    h.transfer(
        ConnId(0),
        Op::Write,
        LocalDescList::new(),
        RemoteDescList(Vec::new()),
        TransferOptions::default(),
    )
    .await
}

#[test]
fn on_core_calls_skip_the_hand_off_and_give_the_same_answers() {
    let pool = pool();
    let h = pool.handles()[0].clone();
    // From this thread: sent over the channel.
    let before = h.hand_off_counters();
    let r = block_on(transfer(&h));
    assert!(matches!(r, Err(TransferError::NoNic)), "{r:?}");
    let after = h.hand_off_counters();
    assert_eq!(after.sent, before.sent + 1);
    assert_eq!(after.on_core, before.on_core);

    // From a task on the core: 100 transfers and a FILE round trip, none of them sent.
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("on_core");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f.bin");
    let inner = h.clone();
    let sent_before = h.hand_off_counters().sent;
    let got = block_on(h.run_on_core(move || async move {
        let mut answers = Vec::new();
        for _ in 0..100 {
            answers.push(transfer(&inner).await);
        }
        let f = inner
            .open_file(FileSpec::new(path, 1 << 16, FileMode::Create))
            .await
            .expect("file opens");
        let src = inner.register(1 << 16).await.expect("host memory");
        let data: Vec<u8> = (0..1u32 << 16).map(|i| (i % 251) as u8).collect();
        src.write_at(0, &data).unwrap();
        let mut local = LocalDescList::new();
        local.push(&src, 0, 1 << 16);
        let descs = vec![FileDesc {
            offset: 0,
            len: 1 << 16,
        }];
        inner
            .file_transfer(f.id, Op::Write, local, descs.clone(), None)
            .await
            .expect("written");
        let (_, back) = inner
            .file_read_bytes(f.id, descs, None)
            .await
            .expect("read back");
        (answers, back == data, inner.hand_off_counters())
    }))
    .expect("the task ran");
    let (answers, same, counters) = got;
    assert_eq!(answers.len(), 100);
    for r in &answers {
        assert!(matches!(r, Err(TransferError::NoNic)), "{r:?}");
    }
    assert!(same, "the FILE round trip on the core returned other bytes");
    // The run_on_core call itself was sent; nothing the task did on the core was.
    assert_eq!(counters.sent, sent_before + 1, "{counters:?}");
    assert!(counters.on_core >= 104, "{counters:?}");
    assert_eq!(counters, h.hand_off_counters());
    pool.shutdown();
}

#[test]
fn on_core_task_panics_are_contained_and_a_shut_down_core_is_typed() {
    let pool = pool();
    let h = pool.handles()[0].clone();
    let r = block_on(h.run_on_core(|| async { panic!("boom in a task on the core") }));
    assert!(
        matches!(&r, Err(RuntimeError::EnginePanic(m)) if m.contains("boom")),
        "{r:?}"
    );
    // The core still serves, on either path.
    let inner = h.clone();
    let n =
        block_on(h.run_on_core(move || async move { inner.register(4096).await.map(|r| r.len()) }))
            .expect("the task ran");
    assert_eq!(n.expect("registered"), 4096);
    pool.shutdown();
    let r = block_on(h.run_on_core(|| async { 1 }));
    assert!(matches!(r, Err(RuntimeError::EngineGone)), "{r:?}");
    // Sent: the three run_on_core calls (the last found the channel closed); on the core: the
    // registration.
    let c: HandOffCounters = h.hand_off_counters();
    assert_eq!((c.sent, c.on_core), (3, 1), "{c:?}");
}
