//! A core that stops running (here: a job that blocks its thread) must not hang the threads
//! that call it. Each core beats (a task of its own, every eighth of
//! `EngineConfig::stall_timeout`), and a call from another thread waiting on a core that has
//! not beaten for `stall_timeout` ends with the typed `EngineStalled`; once the core runs again
//! it serves as before. A call that only takes long on a running core is not cut short. The
//! core is a real engine core (this host has no NIC, so it serves host memory and files only).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_lite::future::block_on;
use rixl_runtime::{
    ConnId, EngineConfig, EngineHandle, EnginePool, LocalDescList, Op, RemoteDescList,
    RuntimeError, TransferError, TransferOptions,
};

const STALL: Duration = Duration::from_secs(1);

fn pool() -> EnginePool {
    pool_with(STALL)
}

fn pool_with(stall: Duration) -> EnginePool {
    let mut cfg = EngineConfig::from_env();
    cfg.require_nic = false;
    cfg.stall_timeout = stall;
    let cpu = rixl_runtime::available_cpus().last().copied().unwrap_or(0);
    EnginePool::start(&cfg, &[cpu], 1 << 20).expect("engine starts without a NIC")
}

/// A job blocking the core's thread.
struct Blocker {
    /// The blocking job's own call (from another thread, so it is bounded too).
    thread: std::thread::JoinHandle<Result<(), RuntimeError>>,
    /// Set on the core when the job has finished blocking it.
    done: Arc<AtomicBool>,
}

/// Blocks the core's thread for `secs` seconds from a job of its own; returns once the job
/// runs.
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

fn null_transfer(h: &EngineHandle) -> Result<rixl_runtime::TransferStats, TransferError> {
    null_transfer_with(h, TransferOptions::default())
}

fn null_transfer_with(
    h: &EngineHandle,
    opts: TransferOptions,
) -> Result<rixl_runtime::TransferStats, TransferError> {
    block_on(h.transfer(
        ConnId(0),
        Op::Write,
        LocalDescList::new(),
        RemoteDescList(Vec::new()),
        opts,
    ))
}

#[test]
fn stalled_core_transfer_from_another_thread_ends_soon_after_its_own_deadline() {
    // A stall bound far longer than the transfer's deadline: the deadline, not the bound,
    // ends the wait (a running core would have ended the transfer itself by then).
    let pool = pool_with(Duration::from_secs(30));
    let h = pool.handles()[0].clone();
    let blocker = block_core(&h, 4);
    let mut opts = TransferOptions::default();
    opts.timeout = Some(Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    let r = null_transfer_with(&h, opts);
    let took = t0.elapsed();
    assert!(
        matches!(r, Err(TransferError::EngineStalled(d)) if d < Duration::from_secs(1)),
        "{r:?}"
    );
    assert!(
        took >= Duration::from_millis(300),
        "ended before its deadline: {took:?}"
    );
    assert!(
        took < Duration::from_secs(3),
        "ended {took:?} after its start"
    );
    assert!(
        !blocker.done.load(Ordering::Acquire),
        "the core was blocked for 4 s"
    );
    // Only that call's deadline passed: a call without one still waits for the core, and
    // gets its answer once the block ends.
    assert!(block_on(h.counters()).is_ok());
    assert!(blocker.done.load(Ordering::Acquire));
    let own = blocker.thread.join().expect("blocker thread");
    assert!(own.is_ok(), "{own:?}");
    pool.shutdown();
}

#[test]
fn stalled_core_calls_from_other_threads_end_with_engine_stalled_and_the_core_serves_after() {
    let pool = pool();
    let h = pool.handles()[0].clone();
    assert!(block_on(h.counters()).is_ok(), "a running core answers");

    let blocker = block_core(&h, 5);

    let r = block_on(h.counters());
    assert!(
        matches!(r, Err(RuntimeError::EngineStalled(d)) if d == STALL),
        "{r:?}"
    );
    let r = null_transfer(&h);
    assert!(
        matches!(r, Err(TransferError::EngineStalled(d)) if d == STALL),
        "{r:?}"
    );
    // Both ended while the core was still blocked: the bound, not the core, ended them.
    assert!(
        !blocker.done.load(Ordering::Acquire),
        "the core was blocked for 5 s"
    );
    // The blocking job's own caller, on another thread, is bounded the same way.
    let own = blocker.thread.join().expect("blocker thread");
    assert!(
        matches!(own, Err(RuntimeError::EngineStalled(_))),
        "{own:?}"
    );

    // Once the core runs again, it serves: the calls queued behind the block run (the
    // transfer's was cancelled, its caller gone), and new calls are answered.
    while !blocker.done.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
    }
    // The job has stopped blocking, but the core counts as running again only once it has
    // beaten: until then a call to it still ends at once with `EngineStalled` (a loaded host
    // may not run the core's thread for a while). It must beat well within a stall bound.
    let resumed = std::time::Instant::now();
    loop {
        match block_on(h.counters()) {
            Ok(_) => break,
            Err(RuntimeError::EngineStalled(_)) if resumed.elapsed() < STALL * 4 => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!(
                "the core did not serve again {:?} after the block: {e:?}",
                resumed.elapsed()
            ),
        }
    }
    let r = null_transfer(&h);
    assert!(matches!(r, Err(TransferError::NoNic)), "{r:?}");
    assert!(block_on(h.counters()).is_ok());
    pool.shutdown();
}

#[test]
fn stalled_core_bound_spares_a_long_call_on_a_running_core() {
    // A job that waits three stall bounds on a timer: the core runs (and beats) all along, so
    // its caller waits for it.
    let pool = pool();
    let h = pool.handles()[0].clone();
    let long = STALL * 3;
    let r = block_on(h.run_on_core(move || async move {
        glommio::timer::sleep(long).await;
        7
    }));
    assert_eq!(r.expect("a long call on a running core"), 7);
    pool.shutdown();
}
