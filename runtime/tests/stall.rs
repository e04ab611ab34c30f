//! A core that stops running (here: a job that blocks its thread) must not hang the threads
//! that call it. A call from another thread bounds its wait: its own deadline plus
//! `EngineConfig::stall_timeout`, or the latter alone for a call without a deadline. Past it
//! the call ends with the typed `EngineStalled`, and once the core runs again it serves as
//! before. The core is a real engine core (this host has no NIC, so it serves host memory and
//! files only).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_lite::future::block_on;
use rixl_runtime::{
    ConnId, EngineConfig, EngineHandle, EnginePool, LocalDescList, Op, RemoteDescList,
    RuntimeError, TransferError, TransferOptions,
};

const STALL: Duration = Duration::from_millis(300);

fn pool() -> EnginePool {
    let mut cfg = EngineConfig::from_env();
    cfg.require_nic = false;
    cfg.stall_timeout = STALL;
    let cpu = rixl_runtime::available_cpus().last().copied().unwrap_or(0);
    EnginePool::start(&cfg, &[cpu], 1 << 20).expect("engine starts without a NIC")
}

/// A job blocking the core's thread.
struct Blocker {
    thread: std::thread::JoinHandle<Result<(), RuntimeError>>,
    /// Set on the core when the job has finished blocking it.
    done: Arc<AtomicBool>,
}

/// Blocks the core's thread for `secs` seconds from a job of its own (the thread that sent it
/// waits without a bound, as a `run_on_core` caller does); returns once the job runs.
fn block_core(h: &EngineHandle, secs: u64) -> Blocker {
    let running = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let (r, d) = (Arc::clone(&running), Arc::clone(&done));
    let h = h.clone();
    let thread = std::thread::spawn(move || {
        block_on(h.run_on_core(move || async move {
            r.store(true, Ordering::Release);
            std::thread::sleep(Duration::from_secs(secs));
            d.store(true, Ordering::Release);
        }))
    });
    while !running.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
    Blocker { thread, done }
}

#[test]
fn stalled_core_calls_from_other_threads_end_with_engine_stalled_and_the_core_serves_after() {
    let pool = pool();
    let h = pool.handles()[0].clone();
    assert!(block_on(h.counters()).is_ok(), "a running core answers");

    let blocker = block_core(&h, 4);

    // A call without a deadline of its own: bounded by stall_timeout alone.
    let r = block_on(h.counters());
    assert!(
        matches!(r, Err(RuntimeError::EngineStalled(d)) if d == STALL),
        "{r:?}"
    );
    // A transfer: its deadline plus stall_timeout. Its job is still queued for the core.
    let mut opts = TransferOptions::default();
    opts.timeout = Some(Duration::from_millis(200));
    let r = block_on(h.transfer(
        ConnId(0),
        Op::Write,
        LocalDescList::new(),
        RemoteDescList(Vec::new()),
        opts,
    ));
    assert!(
        matches!(r, Err(TransferError::EngineStalled(d)) if d == STALL + Duration::from_millis(200)),
        "{r:?}"
    );
    // Both ended while the core was still blocked: the bound, not the core, ended them.
    assert!(
        !blocker.done.load(Ordering::Acquire),
        "the core was blocked for 4 s"
    );

    // Once the core runs again, it serves: the blocking job ends, and calls are answered.
    blocker
        .thread
        .join()
        .expect("blocker thread")
        .expect("the blocking job ends once it has slept");
    let r = block_on(h.transfer(
        ConnId(0),
        Op::Write,
        LocalDescList::new(),
        RemoteDescList(Vec::new()),
        TransferOptions::default(),
    ));
    assert!(matches!(r, Err(TransferError::NoNic)), "{r:?}");
    assert!(block_on(h.counters()).is_ok());
    pool.shutdown();
}

#[test]
fn stalled_core_receives_wait_without_a_bound() {
    // A receive waits for a peer's message for as long as it takes: no stall bound ends it.
    // Here it is answered (NoNic) only once the blocked core runs again.
    let pool = pool();
    let h = pool.handles()[0].clone();
    let blocker = block_core(&h, 1); // 1 s: over three times STALL
    let r = block_on(h.recv(ConnId(0)));
    assert!(
        blocker.done.load(Ordering::Acquire),
        "the receive was answered after the core's block, not ended by a bound"
    );
    assert!(matches!(r, Err(TransferError::NoNic)), "{r:?}");
    assert!(blocker.thread.join().expect("blocker thread").is_ok());
    pool.shutdown();
}
