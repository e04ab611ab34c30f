//! Calls from another thread: after a call, the core's serving task spins for the next one
//! (`spin_before_park`), so back-to-back calls are found without a cross-thread wake-up. It
//! does not spin while a job's task runs, so the FILE tier's I/O (which needs the core's
//! reactor) still completes while another thread keeps calling. A core without a NIC (this
//! host has none) answers a transfer with its typed `NoNic`. A calling thread polls for its
//! reply for `reply_spin` before it waits, but only while such spins catch their replies.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_lite::future::block_on;
use rixl_runtime::{
    ConnId, EngineConfig, EngineHandle, EnginePool, FileDesc, FileMode, FileSpec, LocalDescList,
    Op, RemoteDescList, TransferError, TransferOptions,
};

fn pool(spin: Duration) -> EnginePool {
    pool_with(spin, EngineConfig::default().reply_spin)
}

/// The tests here measure how a core meets calls: one at a time, so that their cores do not
/// share a CPU.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A core without a NIC on the last CPU (away from the calling thread where there are two).
fn pool_with(spin: Duration, reply_spin: Duration) -> EnginePool {
    let mut cfg = EngineConfig::from_env();
    cfg.require_nic = false;
    cfg.spin_before_park = spin;
    cfg.reply_spin = reply_spin;
    let cpu = rixl_runtime::available_cpus().last().copied().unwrap_or(0);
    EnginePool::start(&cfg, &[cpu], 1 << 20).expect("engine starts without a NIC")
}

/// A WRITE of nothing from this thread: the core without a NIC answers `NoNic`.
fn null_call(h: &EngineHandle) {
    let r = block_on(h.transfer(
        ConnId(0),
        Op::Write,
        LocalDescList::new(),
        RemoteDescList(Vec::new()),
        TransferOptions::default(),
    ));
    assert!(matches!(r, Err(TransferError::NoNic)), "{r:?}");
}

#[test]
fn hand_off_back_to_back_calls_are_found_by_the_spinning_core_without_a_wake_up() {
    let _one = one_at_a_time();
    // The default window (100 µs): the next call of a thread that calls in a loop comes well
    // inside it, so nearly all of them are found while the core spins.
    let spinning = pool(EngineConfig::default().spin_before_park);
    let h = spinning.handles()[0].clone();
    let before = h.hand_off_counters();
    for _ in 0..1000 {
        null_call(&h);
    }
    let after = h.hand_off_counters();
    assert_eq!(after.sent, before.sent + 1000, "{after:?}");
    let found = after.taken_without_wake - before.taken_without_wake;
    println!("{found} of 1000 back-to-back calls found without a wake-up");
    // Not all: the scheduler may take this thread off its CPU for longer than the window.
    assert!(
        found >= 500,
        "only {found} of 1000 calls found without a wake-up: {after:?}"
    );
    spinning.shutdown();

    // No window: the core waits for calls, and every call is still answered.
    let waiting = pool(Duration::ZERO);
    let h = waiting.handles()[0].clone();
    for _ in 0..200 {
        null_call(&h);
    }
    assert_eq!(h.hand_off_counters().sent, 200);
    waiting.shutdown();
}

#[test]
fn hand_off_file_round_trips_complete_while_another_thread_keeps_calling() {
    let _one = one_at_a_time();
    let pool = pool(EngineConfig::default().spin_before_park);
    let h = pool.handles()[0].clone();
    let stop = Arc::new(AtomicBool::new(false));
    let caller = {
        let (h, stop) = (h.clone(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut calls = 0u64;
            while !stop.load(Ordering::Relaxed) {
                null_call(&h);
                calls += 1;
            }
            calls
        })
    };
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hand_off");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let len = 1u64 << 16;
    let f = block_on(h.open_file(FileSpec::new(dir.join("f.bin"), len, FileMode::Create)))
        .expect("file opens");
    let src = block_on(h.register(len as usize)).expect("host memory");
    let descs = vec![FileDesc { offset: 0, len }];
    for round in 0..20u32 {
        let data: Vec<u8> = (0..len as u32)
            .map(|i| (i.wrapping_mul(31) ^ round) as u8)
            .collect();
        src.write_at(0, &data).unwrap();
        let mut local = LocalDescList::new();
        local.push(&src, 0, len);
        block_on(h.file_transfer(f.id, Op::Write, local, descs.clone(), None)).expect("written");
        let (_, back) = block_on(h.file_read_bytes(f.id, descs.clone(), None)).expect("read");
        assert!(
            back == data,
            "round {round}: the file gave other bytes back"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let calls = caller.join().expect("the calling thread");
    assert!(calls > 0, "the other thread made no call");
    pool.shutdown();
}

#[test]
fn hand_off_callers_stop_spinning_for_replies_that_do_not_come_within_the_spin() {
    let _one = one_at_a_time();
    // 100 ns of reply spin against a core that waits for calls: a reply crosses threads
    // twice and runs a task on the core, more than the 200 ns a spin may take to pay. A
    // reply caught later (this thread taken off its CPU mid-spin, as on a loaded 2-core CI
    // machine) is a miss too. So the spins miss, and after a few in a row the callers only
    // probe now and then.
    let waiting = pool_with(Duration::ZERO, Duration::from_nanos(100));
    let h = waiting.handles()[0].clone();
    for _ in 0..640 {
        null_call(&h);
    }
    let c = h.hand_off_counters();
    println!("{c:?}");
    assert_eq!(c.sent, 640, "{c:?}");
    assert!(c.reply_spins >= 8, "the first calls spin: {c:?}");
    assert!(
        c.reply_spins < 200,
        "callers kept spinning for slow replies: {c:?}"
    );
    waiting.shutdown();
}
