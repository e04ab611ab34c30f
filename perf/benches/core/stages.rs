//! One 1-descriptor 64 B WRITE through the transfer core, stage by stage, as the engine's transfer
//! future runs it (`runtime/src/engine/transfer.rs`), on a null queue pair: the NIC is out of
//! the number, the software path is all of it. Two shapes:
//! - **wait**: the completion is not there when the future first looks (a real NIC's round
//!   trip): the future registers its waker and arms its deadline, the progress side reaps the
//!   completion and wakes it (a real `Waker`), the future is polled again and takes its result;
//! - **reap**: the completion is there when the future first looks (rxe, which completes inside
//!   the post): the future reaps it itself and ends in its first poll, with no wake.
//!
//! Each stage is timed with the cycle counter and reported as the median over many transfers
//! (the counter read's own cost, measured the same way, is taken off each stage); criterion
//! times the whole path of each shape.

use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use criterion::{Criterion, Throughput};
use rixl_proto::{
    Completion, ConnId, Core, LocalDesc, LoneTransfer, Op, Plan, Posting, RemoteDesc,
    TransferOptions, TransferStats,
};

use crate::null_nic::{connected_core, NullCq, NullNic, NullQp};
use crate::REGION;

/// Completions a waiting future reaps at once (the engine's `REAP_NOW_BATCH`).
const REAP_NOW: usize = 8;

/// What the engine's slot keeps alive: the local regions (reference-counted handles).
type SmallKeep = smallvec::SmallVec<[Rc<()>; 2]>;

/// A task's waker: counts wake-ups, as an executor's run queue would receive them.
struct Task(AtomicUsize);

impl Wake for Task {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::Release);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

/// The stages, in order.
const STAGES: [&str; 6] = [
    "check + plan (descriptor checked, work request planned)",
    "in-flight slot (keep-alive of the regions)",
    "build + doorbell (ibv_send_wr into the batch, null post; lone: check, slot, build, post)",
    "first wait (own CQ reaped, waker registered, deadline armed)",
    "completion (reaped, routed, future woken)",
    "result (polled again, result taken, plan recycled, stats)",
];

struct Fixture {
    core: Core<NullQp<SmallKeep>>,
    nic: Rc<NullNic>,
    conn: ConnId,
    region: Rc<()>,
    local: [LocalDesc; 1],
    remote: [RemoteDesc; 1],
    task: Arc<Task>,
    waker: Waker,
}

impl Fixture {
    fn new() -> Self {
        let nic = Rc::new(NullNic::default());
        let (core, conn) = connected_core(&nic);
        let task = Arc::new(Task(AtomicUsize::new(0)));
        Fixture {
            core,
            nic,
            conn,
            region: Rc::new(()),
            local: [LocalDesc {
                region: 0,
                offset: 4096,
                len: 64,
            }],
            remote: [RemoteDesc {
                addr: 0x5500_0000_1000,
                len: 64,
                rkey: 77,
            }],
            waker: Waker::from(Arc::clone(&task)),
            task,
        }
    }

    /// One transfer; `mark(i)` is called after stage `i` (the timing hook). Returns its stats.
    /// `lone`: as the engine takes a one-descriptor transfer posted at once (`post_lone`: the
    /// checks, the slot and the post in one call, stages 0 and 1 empty); else the general path.
    fn transfer(&mut self, wait: bool, lone: bool, mut mark: impl FnMut(usize)) -> TransferStats {
        self.nic.at_doorbell.set(!wait);
        let mut cx = Context::from_waker(&self.waker);
        // Each transfer the first of its turn, as in a request-response loop.
        self.core.next_turn();
        if lone {
            mark(0);
            mark(1);
            let opts = TransferOptions::default();
            let t = LoneTransfer {
                conn: self.conn,
                op: Op::Write,
                region: REGION,
                local: &self.local[0],
                remote: &self.remote[0],
                opts: &opts,
            };
            let region = &self.region;
            let keep = || -> SmallKeep { smallvec::smallvec![Rc::clone(region)] };
            let mut p = self.core.post_lone(&t, keep).expect("a lone transfer");
            mark(2);
            return self.wait(&mut p, &mut mark, 64, 1);
        }
        // 0: the engine's check_and_plan.
        let mut plan: Plan = self.core.take_plan();
        self.core
            .check_transfer(self.conn, Op::Write, false)
            .expect("live");
        let regions = [REGION];
        self.core
            .plan_transfer(
                self.conn,
                Op::Write,
                &regions,
                &self.local,
                &self.remote,
                false,
                &mut plan,
            )
            .expect("valid");
        mark(0);
        // 1: the slot.
        let keep: SmallKeep = smallvec::smallvec![Rc::clone(&self.region)];
        let mut p = self
            .core
            .begin(self.conn, Op::Write, keep, &TransferOptions::default());
        mark(1);
        // 2: build and ring.
        assert!(self.core.post(&mut p, &plan, &mut cx).is_ready());
        // A probe queued for a coalesced post: the engine's flush task posts it.
        if p.queued() && self.core.take_flush_request(self.conn) {
            assert!(self.core.flush(self.conn, &mut cx).is_ready());
        }
        let (bytes, wrs) = (plan.bytes, plan.wrs.len());
        self.core.recycle_plan(plan);
        mark(2);
        self.wait(&mut p, &mut mark, bytes, wrs)
    }

    /// Stages 3 to 5 of a posted transfer `p` (of `bytes` in `wrs` requests).
    fn wait(
        &mut self,
        p: &mut Posting,
        mark: &mut impl FnMut(usize),
        bytes: u64,
        wrs: usize,
    ) -> TransferStats {
        let mut cx = Context::from_waker(&self.waker);
        // 3: the future's first poll of its slot (the engine's wait_slot).
        let mut buf = [Completion::success(0, 0); REAP_NOW];
        let first = match self.core.try_finish(p) {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => {
                self.core.reap(&mut NullCq(&self.nic), &mut buf);
                self.core.poll_finish(p, &mut cx)
            }
        };
        mark(3);
        let result = match first {
            Poll::Ready(r) => {
                mark(4);
                r
            }
            Poll::Pending => {
                // 4: the NIC completes; the progress side reaps, routes and wakes.
                self.nic.complete();
                let before = self.task.0.load(Ordering::Acquire);
                let mut batch = [Completion::success(0, 0); 32];
                self.core.reap(&mut NullCq(&self.nic), &mut batch);
                assert_eq!(self.task.0.load(Ordering::Acquire), before + 1, "woken");
                mark(4);
                // 5: polled again.
                match self.core.try_finish(p) {
                    Poll::Ready(r) => r,
                    Poll::Pending => panic!("woken but not finished"),
                }
            }
        };
        result.expect("null QP completes successfully");
        self.core.count_result(true);
        let stats = TransferStats::new(bytes, 1, wrs, p.doorbells());
        mark(5);
        std::hint::black_box(stats)
    }
}

/// The cycle counter (`rdtsc`, `cntvct_el0`), elsewhere nanoseconds of the monotonic clock.
fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        tick_counter::x86_64_tick_counter()
    }
    #[cfg(target_arch = "aarch64")]
    {
        tick_counter::aarch64_tick_counter()
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        EPOCH
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_nanos() as u64
    }
}

/// The mean of the lower 99 % of `v` (the counter reads in steps of several ns on some
/// machines, so a median can only be a multiple of the step; a mean over many transfers is
/// not, and the top 1 % are interrupts and migrations).
fn trimmed_mean(v: &mut [u64]) -> f64 {
    v.sort_unstable();
    let keep = &v[..(v.len() * 99 / 100).max(1)];
    keep.iter().sum::<u64>() as f64 / keep.len() as f64
}

/// Mean cost of each stage in ns (see [`trimmed_mean`]), over `n` transfers of one shape.
fn stage_means(f: &mut Fixture, wait: bool, lone: bool, n: usize) -> [f64; 6] {
    // The counter's rate.
    let (t0, c0) = (std::time::Instant::now(), ticks());
    std::thread::sleep(std::time::Duration::from_millis(50));
    let rate = (ticks() - c0) as f64 / t0.elapsed().as_secs_f64() / 1e9; // ticks per ns
                                                                         // The cost of one read of the counter between two stages.
    let mut gaps: Vec<u64> = (0..n.max(10_000))
        .map(|_| {
            let a = ticks();
            let b = ticks();
            b - a
        })
        .collect();
    let overhead = trimmed_mean(&mut gaps);
    let mut per: Vec<Vec<u64>> = (0..6).map(|_| Vec::with_capacity(n)).collect();
    for _ in 0..n {
        let mut last = ticks();
        let mut at = [0u64; 6];
        f.transfer(wait, lone, |i| {
            let now = ticks();
            at[i] = now - last;
            last = ticks();
        });
        for (i, v) in at.iter().enumerate() {
            per[i].push(*v);
        }
    }
    let mut out = [0.0; 6];
    for (i, v) in per.iter_mut().enumerate() {
        out[i] = (trimmed_mean(v) - overhead).max(0.0) / rate;
    }
    out
}

/// The hand-off of an [`rixl::runtime::EngineHandle`] call, which is what an `agent.write` from
/// a thread other than the engine's core adds to the engine's transfer: the job sent to the
/// core, its task spawned and run there, the result sent back and the caller woken. Measured
/// with a real engine core (glommio, no NIC on this machine, so the transfer ends at once with
/// its typed `NoNic` error on the core): median ns per call over `n` calls, the core's serving
/// task spinning for the next call for `spin` (`spin_before_park`; calls here come back to
/// back, so with the default 100 µs it does not sleep either) and the caller polling for the
/// reply for `reply_spin` before its future waits (`EngineConfig::reply_spin`). `None` where no
/// engine core starts (io_uring or memlock refused).
fn hand_off_median(
    n: usize,
    spin: std::time::Duration,
    reply_spin: std::time::Duration,
    caller_spins: bool,
) -> Option<f64> {
    let (pool, h) = nic_less_core(spin, reply_spin)?;
    // The caller either sleeps until it is woken (`block_on`, as a thread blocked on the call
    // would) or polls the reply in a loop (as a task of a busy executor would find it).
    let call = || {
        if caller_spins {
            spin_on(null_call(&h))
        } else {
            futures_lite::future::block_on(null_call(&h))
        }
    };
    for _ in 0..n.min(1000) {
        call();
    }
    let v: Vec<u64> = (0..n)
        .map(|_| {
            let t = std::time::Instant::now();
            call();
            t.elapsed().as_nanos() as u64
        })
        .collect();
    pool.shutdown();
    Some(median(v))
}

/// The same call made from a task on the engine's own core (`EngineHandle::run_on_core`, as a
/// serving engine's step loop there makes it): it starts on the core without the hand-off.
/// Median ns per call over `n` calls, timed inside the task.
fn on_core_median(n: usize) -> Option<f64> {
    let d = rixl::runtime::EngineConfig::default();
    let (pool, h) = nic_less_core(d.spin_before_park, d.reply_spin)?;
    let inner = h.clone();
    let v = futures_lite::future::block_on(h.run_on_core(move || async move {
        for _ in 0..n.min(1000) {
            null_call(&inner).await;
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let t = std::time::Instant::now();
            null_call(&inner).await;
            v.push(t.elapsed().as_nanos() as u64);
        }
        v
    }))
    .ok()?;
    let counted = h.hand_off_counters();
    assert!(counted.on_core >= n as u64, "{counted:?}");
    pool.shutdown();
    Some(median(v))
}

/// A real engine core without a NIC (none on this machine), spinning `spin` before it sleeps,
/// its callers polling `reply_spin` for a reply,
/// on the last CPU (away from this thread if the scheduler allows); `None`, with the reason
/// printed, where no engine core starts (io_uring or memlock refused).
fn nic_less_core(
    spin: std::time::Duration,
    reply_spin: std::time::Duration,
) -> Option<(rixl::runtime::EnginePool, rixl::runtime::EngineHandle)> {
    let mut cfg = rixl::runtime::EngineConfig::default();
    cfg.require_nic = false;
    cfg.spin_before_park = spin;
    cfg.reply_spin = reply_spin;
    let cpu = rixl::runtime::available_cpus().last().copied().unwrap_or(0);
    match rixl::runtime::EnginePool::start(&cfg, &[cpu], rixl::runtime::DEFAULT_IO_MEMORY) {
        Ok(pool) => {
            let h = pool.handles()[0].clone();
            Some((pool, h))
        }
        Err(e) => {
            println!("(no engine core for the hand-off: {e})");
            None
        }
    }
}

/// One `EngineHandle` transfer call, answered on the core without a NIC by its typed `NoNic`.
async fn null_call(h: &rixl::runtime::EngineHandle) {
    use rixl::runtime::{LocalDescList, RemoteDescList, TransferError};
    let r = h
        .transfer(
            ConnId(0),
            Op::Write,
            LocalDescList::new(),
            RemoteDescList(Vec::new()),
            TransferOptions::default(),
        )
        .await;
    assert!(matches!(r, Err(TransferError::NoNic)), "{r:?}");
}

/// The median of `v`.
fn median(mut v: Vec<u64>) -> f64 {
    v.sort_unstable();
    v[v.len() / 2] as f64
}

/// For scale: a bare round trip between two threads of this machine that both spin (a value
/// sent over `std::sync::mpsc` and sent back), median ns over `n`.
fn bare_round_trip(n: usize) -> f64 {
    use std::sync::mpsc::{channel, TryRecvError};
    let (to_tx, to_rx) = channel::<u64>();
    let (back_tx, back_rx) = channel::<u64>();
    let echo = std::thread::spawn(move || loop {
        match to_rx.try_recv() {
            Ok(v) => {
                if back_tx.send(v).is_err() {
                    return;
                }
            }
            Err(TryRecvError::Empty) => std::hint::spin_loop(),
            Err(TryRecvError::Disconnected) => return,
        }
    });
    let v: Vec<u64> = (0..n as u64)
        .map(|i| {
            let t = std::time::Instant::now();
            to_tx.send(i).expect("echo thread alive");
            loop {
                match back_rx.try_recv() {
                    Ok(got) => {
                        assert_eq!(got, i);
                        break;
                    }
                    Err(TryRecvError::Empty) => std::hint::spin_loop(),
                    Err(TryRecvError::Disconnected) => panic!("echo thread gone"),
                }
            }
            t.elapsed().as_nanos() as u64
        })
        .collect();
    drop(to_tx);
    echo.join().expect("echo thread");
    median(v)
}

/// Polls `fut` in a loop until it is ready, never sleeping.
fn spin_on<F: std::future::Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::hint::spin_loop();
    }
}

/// Prints the stage table of both shapes (the "cost broken down by stage").
pub fn print_stage_table(n: usize) {
    let mut f = Fixture::new();
    for _ in 0..n.min(10_000) {
        for (wait, lone) in [(true, false), (false, false), (true, true), (false, true)] {
            f.transfer(wait, lone, |_| {});
        }
    }
    let lone_wait = stage_means(&mut f, true, true, n);
    let lone_reap = stage_means(&mut f, false, true, n);
    let wait = stage_means(&mut f, true, false, n);
    let reap = stage_means(&mut f, false, false, n);
    println!("\nnull_qp_stages: one 1-descriptor 64 B WRITE through the core, mean ns per stage, the slowest 1 % left out ({n} transfers each; criterion's `null_qp_await` times the whole path). The engine takes such a transfer, posted at once, as a lone transfer (`Core::post_lone`: stages 0-2 in one call); the general path (plan, slot, post) is every other transfer's");
    println!("| stage | lone, completion waited for (woken) | lone, reaped by the future | general, woken | general, reaped |");
    println!("|---|---|---|---|---|");
    let cell = |v: &[f64; 6], i: usize, empty: bool| {
        if empty {
            "-".to_string()
        } else {
            format!("{:.1}", v[i])
        }
    };
    for (i, s) in STAGES.iter().enumerate() {
        println!(
            "| {s} | {} | {} | {} | {} |",
            cell(&lone_wait, i, i < 2),
            cell(&lone_reap, i, i < 2 || i == 4),
            cell(&wait, i, false),
            cell(&reap, i, i == 4)
        );
    }
    let sum = |v: &[f64; 6]| v.iter().sum::<f64>();
    println!(
        "| **sum** | **{:.1}** | **{:.1}** | **{:.1}** | **{:.1}** |",
        sum(&lone_wait),
        sum(&lone_reap),
        sum(&wait),
        sum(&reap)
    );
    let calls = (n / 20).max(200);
    let awake = std::time::Duration::from_secs(1);
    let defaults = rixl::runtime::EngineConfig::default();
    let (park, reply) = (defaults.spin_before_park, defaults.reply_spin);
    let none = std::time::Duration::ZERO;
    for (what, spin, reply_spin, caller_spins) in [
        ("core kept awake, caller polls", awake, none, true),
        (
            "core kept awake, caller sleeps until woken, no reply spin",
            awake,
            none,
            false,
        ),
        (
            "engine defaults but no reply spin, caller sleeps until woken",
            park,
            none,
            false,
        ),
        (
            "engine defaults (reply spin on), caller sleeps until woken",
            park,
            reply,
            false,
        ),
    ] {
        if let Some(ns) = hand_off_median(calls, spin, reply_spin, caller_spins) {
            println!("| hand-off from another thread and back ({what}; median of {calls} calls) | {ns:.0} | |");
        }
    }
    if let Some(ns) = on_core_median(calls) {
        println!("| the same call from a task on the engine's own core (`run_on_core`; median of {calls} calls) | {ns:.0} | |");
    }
    println!(
        "| for scale: a bare round trip between two spinning threads (std mpsc; median of {calls}) | {:.0} | |",
        bare_round_trip(calls)
    );
    println!();
}

/// Criterion: the whole path of each shape.
pub fn bench_null_qp_await(c: &mut Criterion) {
    let mut g = c.benchmark_group("null_qp_await");
    g.throughput(Throughput::Elements(1));
    let mut f = Fixture::new();
    g.bench_function("write_64B_woken", |b| {
        b.iter(|| f.transfer(true, false, |_| {}))
    });
    g.bench_function("write_64B_reaped", |b| {
        b.iter(|| f.transfer(false, false, |_| {}))
    });
    g.bench_function("lone_write_64B_woken", |b| {
        b.iter(|| f.transfer(true, true, |_| {}))
    });
    g.bench_function("lone_write_64B_reaped", |b| {
        b.iter(|| f.transfer(false, true, |_| {}))
    });
    g.finish();
}
