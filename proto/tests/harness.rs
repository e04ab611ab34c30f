//! The transfer core against the deterministic fake NIC and virtual clock: error and timing
//! paths (deadlines, credits, flushes, dropped and forgotten transfers, stale completions,
//! coalescing boundaries, receives), each driven step by step the way the runtime's futures and
//! progress loop drive it.

use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use rixl_proto::harness::{counting_waker, FakeCq, FakeNic, FakeQueue, VirtualClock};
use rixl_proto::inflight::InflightTable;
use rixl_proto::{
    recv_wr_id, Clock, Completion, ConnId, ConnParams, ConnState, Core, CoreConfig,
    InvalidDescriptor, LocalDesc, LoneTransfer, Message, Op, Plan, Posting, RegionInfo, RemoteDesc,
    SendOp, Sge, TransferError, TransferOptions, WcOpcode, WcStatus, INBOX_LIMIT,
};

/// What a slot keeps alive: its strong count tells whether the core still holds it.
type Keep = Rc<&'static str>;

const REGION: RegionInfo = RegionInfo {
    addr: 0x10_0000,
    len: 1 << 30,
    lkey: 7,
    host: true,
};
const TIMEOUT: Duration = Duration::from_millis(50);

struct Fx {
    nic: FakeNic,
    cq: FakeCq,
    clock: VirtualClock,
    core: Core<FakeQueue<Keep>>,
    conn: ConnId,
    keep: Keep,
}

/// Every transfer posted at once (coalescing, the default, has its own tests below).
fn config() -> CoreConfig {
    let mut cfg = CoreConfig::default();
    cfg.coalesce = false;
    cfg.post_batch = 64;
    cfg.signal_interval = 4;
    cfg.transfer_timeout = TIMEOUT;
    cfg
}

fn params(depth: u32) -> ConnParams {
    ConnParams {
        send_queue_depth: depth,
        max_send_sge: 4,
        max_inline: 64,
        recv_buffers: 0,
    }
}

impl Fx {
    fn new() -> Self {
        Self::with(config(), 16)
    }

    fn with(cfg: CoreConfig, depth: u32) -> Self {
        let nic = FakeNic::new();
        let mut core = Core::new(cfg);
        let conn = core.add_connection(nic.queue(), params(depth));
        assert!(core.connected(conn, 1 << 20));
        let clock = VirtualClock::new();
        Fx {
            cq: nic.cq(),
            nic,
            clock,
            core,
            conn,
            keep: Rc::new("registered memory"),
        }
    }

    fn qpn(&self) -> u32 {
        self.nic.posted().first().map_or(0x101, |w| w.qpn)
    }

    /// A plan of `n` scattered blocks of `len` bytes (none merge).
    fn plan(&mut self, op: Op, n: u64, len: u64) -> Plan {
        let (local, remote) = scattered(n, len);
        let mut plan = self.core.take_plan();
        self.core
            .plan_transfer(self.conn, op, &[REGION], &local, &remote, false, &mut plan)
            .expect("valid lists");
        plan
    }

    /// Opens a transfer and posts what credits allow (as the runtime's `post_plan` does).
    fn start(&mut self, plan: &Plan, opts: TransferOptions) -> (Posting, Poll<()>) {
        let mut p = self
            .core
            .begin(self.conn, Op::Write, Rc::clone(&self.keep), &opts);
        let r = self
            .core
            .post(&mut p, plan, &mut Context::from_waker(Waker::noop()));
        (p, r)
    }

    fn write(&mut self, n: u64) -> Posting {
        let plan = self.plan(Op::Write, n, 4096);
        let (p, r) = self.start(&plan, TransferOptions::default());
        assert!(r.is_ready(), "posted at once");
        p
    }

    fn reap(&mut self) -> usize {
        let mut buf = [Completion::success(0, 0); 16];
        let mut total = 0;
        loop {
            let n = self.core.reap(&mut self.cq, &mut buf);
            total += n;
            if n == 0 {
                return total;
            }
        }
    }

    /// Polls a transfer as its future does: its result, else reap, else wait.
    fn poll(&mut self, p: &mut Posting, waker: &Waker) -> Poll<Result<(), TransferError>> {
        if let Poll::Ready(r) = self.core.try_finish(p) {
            return Poll::Ready(r);
        }
        self.reap();
        self.core.poll_finish(p, &mut Context::from_waker(waker))
    }

    fn poll_noop(&mut self, p: &mut Posting) -> Poll<Result<(), TransferError>> {
        self.poll(p, Waker::noop())
    }

    /// Two ticks of the progress loop, now and `d` later: the first starts the deadlines armed
    /// since the last tick; returns how many transfers expired at the second.
    fn tick(&mut self, d: Duration) -> usize {
        assert_eq!(self.core.expire(self.clock.now()), 0, "expired early");
        self.clock.advance(d);
        self.core.expire(self.clock.now())
    }

    fn held(&self) -> usize {
        Rc::strong_count(&self.keep) - 1
    }
}

fn scattered(n: u64, len: u64) -> (Vec<LocalDesc>, Vec<RemoteDesc>) {
    let local = (0..n)
        .map(|i| LocalDesc {
            region: 0,
            offset: i * 2 * len,
            len,
        })
        .collect();
    let remote = (0..n)
        .map(|i| RemoteDesc {
            addr: 0x9000_0000 + i * 3 * len,
            len,
            rkey: 9,
        })
        .collect();
    (local, remote)
}

// ---- completion and waking ----

#[test]
fn a_transfer_completes_after_its_signaled_completion_and_releases_its_memory() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    assert_eq!(fx.nic.doorbells(), 1);
    assert_eq!(fx.held(), 1, "the slot holds the memory");
    assert!(fx.poll_noop(&mut p).is_pending());
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
    assert!(p.finished());
    assert_eq!(fx.held(), 0);
    assert_eq!(fx.core.inflight_len(), 0);
}

#[test]
fn a_completion_wakes_the_waiting_transfer_once() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    let (count, waker) = counting_waker();
    assert!(fx.poll(&mut p, &waker).is_pending());
    fx.nic.complete_all();
    fx.reap();
    assert_eq!(count.get(), 1);
    assert_eq!(fx.poll(&mut p, &waker), Poll::Ready(Ok(())));
    assert_eq!(count.get(), 1, "no second wake");
}

#[test]
fn a_transfer_that_reaps_its_own_completion_does_not_wake_itself() {
    let mut fx = Fx::new();
    let mut p = fx.write(2);
    fx.nic.complete_all();
    let (count, waker) = counting_waker();
    assert_eq!(fx.poll(&mut p, &waker), Poll::Ready(Ok(())));
    assert_eq!(count.get(), 0);
}

#[test]
fn out_of_order_completions_across_connections_finish_each_transfer_once() {
    let mut fx = Fx::new();
    let second = fx.core.add_connection(fx.nic.queue(), params(16));
    fx.core.connected(second, 1 << 20);
    let mut a = fx.write(1);
    let plan = fx.plan(Op::Write, 1, 4096);
    let mut b = fx.core.begin(
        second,
        Op::Write,
        Rc::clone(&fx.keep),
        &TransferOptions::default(),
    );
    assert!(fx
        .core
        .post(&mut b, &plan, &mut Context::from_waker(Waker::noop()))
        .is_ready());
    // B's request (posted second, on another queue pair) completes first.
    assert!(fx.nic.complete_at(1, WcStatus::Success).is_some());
    assert!(fx.poll_noop(&mut a).is_pending());
    assert_eq!(fx.poll_noop(&mut b), Poll::Ready(Ok(())));
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut a), Poll::Ready(Ok(())));
    assert_eq!(fx.core.counters().stale_completions, 0);
}

#[test]
fn polls_and_completions_are_counted_per_reap() {
    let mut fx = Fx::new();
    let mut p = fx.write(8);
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
    let c = fx.core.counters();
    assert_eq!(c.completions, 2, "8 requests, signaled every 4th");
    assert_eq!(c.polls, 1);
    assert_eq!(c.work_requests, 8);
    assert_eq!(c.doorbells, 1);
}

// ---- deadlines ----

#[test]
fn a_transfer_completed_before_it_waits_never_arms_a_deadline() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
    assert!(!p.deadline_armed());
    assert_eq!(fx.core.deadlines_len(), 0);
}

#[test]
fn the_deadline_is_armed_once_when_the_transfer_first_waits() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    assert_eq!(fx.core.deadlines_len(), 0, "posting arms nothing");
    assert!(fx.poll_noop(&mut p).is_pending());
    assert!(p.deadline_armed());
    assert!(fx.poll_noop(&mut p).is_pending());
    assert_eq!(fx.core.deadlines_len(), 1, "armed once");
}

#[test]
fn a_waiting_transfer_times_out_and_fails_its_connection() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    assert!(fx.poll_noop(&mut p).is_pending());
    assert_eq!(fx.tick(TIMEOUT - Duration::from_millis(1)), 0, "not yet");
    assert_eq!(fx.tick(Duration::from_millis(2)), 1);
    assert_eq!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Timeout(TIMEOUT)))
    );
    assert!(matches!(fx.core.state(fx.conn), Some(ConnState::Failed(_))));
    assert!(fx.nic.errored(fx.qpn()), "the QP is moved to error");
}

#[test]
fn a_timed_out_transfer_keeps_its_memory_until_the_nic_flushes_it() {
    let mut fx = Fx::new();
    let mut p = fx.write(4);
    assert!(fx.poll_noop(&mut p).is_pending());
    fx.tick(TIMEOUT * 2);
    assert!(matches!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Timeout(_)))
    ));
    assert_eq!(fx.held(), 1, "the NIC may still read it");
    assert_eq!(fx.nic.flush(fx.qpn()), 4);
    fx.reap();
    assert_eq!(fx.held(), 0, "released once flushed");
    assert_eq!(fx.core.inflight_len(), 0);
}

#[test]
fn a_per_transfer_timeout_overrides_the_default() {
    let mut fx = Fx::new();
    let plan = fx.plan(Op::Write, 1, 4096);
    let mut opts = TransferOptions::default();
    opts.timeout = Some(Duration::from_millis(5));
    let (mut p, _) = fx.start(&plan, opts);
    assert!(fx.poll_noop(&mut p).is_pending());
    assert_eq!(fx.tick(Duration::from_millis(6)), 1);
    assert_eq!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Timeout(Duration::from_millis(5))))
    );
}

#[test]
fn a_deadline_starts_at_the_first_tick_after_it_was_armed() {
    let mut fx = Fx::new();
    // The loop's last clock read is long past when the transfer waits (other tasks held the
    // core since): that stale reading must not start the deadline.
    fx.clock.advance(TIMEOUT * 10);
    let mut p = fx.write(1);
    assert!(fx.poll_noop(&mut p).is_pending());
    // The next tick reads the clock after the arming: the deadline counts from there, not from
    // the stale tick (which would have expired it at once, well before its timeout).
    fx.clock.advance(TIMEOUT / 2);
    assert_eq!(fx.core.expire(fx.clock.now()), 0, "started, not expired");
    fx.clock.advance(TIMEOUT / 2);
    assert_eq!(
        fx.core.expire(fx.clock.now()),
        0,
        "half a timeout after the start"
    );
    fx.clock.advance(TIMEOUT / 2 + Duration::from_millis(1));
    assert_eq!(
        fx.core.expire(fx.clock.now()),
        1,
        "a timeout after the start"
    );
    assert!(matches!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Timeout(_)))
    ));
}

#[test]
fn a_finished_transfers_deadline_expires_nothing() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    assert!(fx.poll_noop(&mut p).is_pending());
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
    assert_eq!(fx.tick(TIMEOUT * 2), 0);
    assert_eq!(fx.core.state(fx.conn), Some(&ConnState::Ready));
}

#[test]
fn a_detached_transfers_deadline_expires_nothing() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    assert!(fx.poll_noop(&mut p).is_pending());
    assert!(!fx.core.detach(p.slot()));
    assert_eq!(fx.tick(TIMEOUT * 2), 0, "nobody waits for it");
    assert_eq!(fx.core.state(fx.conn), Some(&ConnState::Ready));
    fx.nic.complete_all();
    fx.reap();
    assert_eq!(fx.held(), 0);
}

#[test]
fn parking_with_nothing_in_flight_drops_the_deadlines() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    assert!(fx.poll_noop(&mut p).is_pending());
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
    assert_eq!(fx.core.deadlines_len(), 1, "dropped lazily");
    fx.core.on_park();
    assert_eq!(fx.core.deadlines_len(), 0);
}

#[test]
fn many_deadlines_expire_in_order_of_their_instants() {
    let mut fx = Fx::with(config(), 64);
    let mut ps = Vec::new();
    for ms in [30u64, 10, 20] {
        let plan = fx.plan(Op::Write, 1, 64);
        let mut opts = TransferOptions::default();
        opts.timeout = Some(Duration::from_millis(ms));
        let (mut p, _) = fx.start(&plan, opts);
        assert!(fx.poll_noop(&mut p).is_pending());
        ps.push(p);
    }
    assert_eq!(fx.tick(Duration::from_millis(11)), 1);
    assert!(matches!(
        fx.poll_noop(&mut ps[1]),
        Poll::Ready(Err(TransferError::Timeout(d))) if d == Duration::from_millis(10)
    ));
    // The connection failed with the first timeout: the others end flushed once the NIC is.
    fx.nic.flush(fx.qpn());
    assert_eq!(
        fx.poll_noop(&mut ps[0]),
        Poll::Ready(Err(TransferError::Flushed))
    );
    assert_eq!(
        fx.poll_noop(&mut ps[2]),
        Poll::Ready(Err(TransferError::Flushed))
    );
}

// ---- credits ----

#[test]
fn credit_exhaustion_posts_what_fits_and_resumes_on_a_signaled_completion() {
    let mut fx = Fx::new();
    let plan = fx.plan(Op::Write, 40, 4096);
    let (mut p, r) = fx.start(&plan, TransferOptions::default());
    assert!(r.is_pending(), "16 of 40 fit");
    assert_eq!(fx.nic.outstanding().len(), 16);
    assert!(!p.posted());
    // The first signaled request (the 4th) frees 4 slots.
    fx.nic.complete(4);
    let (count, waker) = counting_waker();
    assert!(fx
        .core
        .post(&mut p, &plan, &mut Context::from_waker(&waker))
        .is_pending());
    fx.reap();
    assert!(count.get() >= 1, "credits wake the poster");
    assert!(fx
        .core
        .post(&mut p, &plan, &mut Context::from_waker(&waker))
        .is_pending());
    assert_eq!(fx.nic.posted().len(), 20);
    while !p.posted() {
        fx.nic.complete_all();
        fx.reap();
        let _ = fx
            .core
            .post(&mut p, &plan, &mut Context::from_waker(Waker::noop()));
    }
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
    assert_eq!(fx.nic.posted().len(), 40);
}

#[test]
fn waiting_for_credits_arms_the_deadline_and_can_time_out() {
    let mut fx = Fx::new();
    let plan = fx.plan(Op::Write, 40, 4096);
    let (mut p, r) = fx.start(&plan, TransferOptions::default());
    assert!(r.is_pending());
    assert!(
        p.deadline_armed(),
        "a transfer waiting for credits waits too"
    );
    assert_eq!(fx.tick(TIMEOUT * 2), 1);
    // Posting stops (the connection failed); the result is the timeout.
    assert!(fx
        .core
        .post(&mut p, &plan, &mut Context::from_waker(Waker::noop()))
        .is_ready());
    assert_eq!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Timeout(TIMEOUT)))
    );
    assert_eq!(fx.nic.posted().len(), 16, "nothing more posted");
}

#[test]
fn poll_credits_waits_for_k_free_slots() {
    let mut fx = Fx::with(config(), 8);
    let _p = fx.write(8);
    let (count, waker) = counting_waker();
    let mut cx = Context::from_waker(&waker);
    assert!(fx.core.poll_credits(fx.conn, 1, &mut cx).is_pending());
    fx.nic.complete(4);
    fx.reap();
    assert_eq!(count.get(), 1);
    assert_eq!(
        fx.core.poll_credits(fx.conn, 4, &mut cx),
        Poll::Ready(Ok(4))
    );
    assert!(fx.core.poll_credits(fx.conn, 5, &mut cx).is_pending());
}

#[test]
fn a_large_transfer_rings_one_doorbell_per_post_batch() {
    let mut cfg = config();
    cfg.post_batch = 4;
    let mut fx = Fx::with(cfg, 64);
    let mut p = fx.write(10);
    assert_eq!(p.doorbells(), 3);
    assert_eq!(fx.nic.doorbells(), 3);
    let doorbells: Vec<u64> = fx.nic.posted().iter().map(|w| w.doorbell).collect();
    assert_eq!(doorbells, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]);
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
}

#[test]
fn every_interval_th_request_and_the_last_are_signaled() {
    let mut fx = Fx::new();
    let _p = fx.write(10);
    let signaled: Vec<bool> = fx.nic.posted().iter().map(|w| w.flags.signaled).collect();
    assert_eq!(
        signaled,
        [false, false, false, true, false, false, false, true, false, true]
    );
}

// ---- errors and flushes ----

#[test]
fn an_error_completion_fails_the_transfer_with_its_mapped_error_and_the_connection() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    let wr = fx.nic.outstanding()[0].wr_id;
    assert!(fx.nic.complete_wr(wr, WcStatus::RemoteAccessError));
    assert_eq!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::RemoteAccess {
            status: WcStatus::RemoteAccessError
        }))
    );
    assert_eq!(
        fx.core.state(fx.conn),
        Some(&ConnState::Failed("IBV_WC_REM_ACCESS_ERR".into()))
    );
}

#[test]
fn retry_exceeded_is_a_remote_disconnect() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    fx.nic.complete_at(0, WcStatus::RetryExceededError);
    assert!(matches!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::RemoteDisconnect { .. }))
    ));
}

#[test]
fn after_an_error_the_flush_ends_every_transfer_on_the_connection_and_the_first_error_stays() {
    let mut fx = Fx::new();
    let mut a = fx.write(4);
    let mut b = fx.write(4);
    // A's unsignaled first request fails; the NIC flushes the rest.
    fx.nic.complete_at(0, WcStatus::RemoteAccessError);
    fx.nic.flush(fx.qpn());
    assert!(matches!(
        fx.poll_noop(&mut a),
        Poll::Ready(Err(TransferError::RemoteAccess { .. }))
    ));
    assert_eq!(
        fx.poll_noop(&mut b),
        Poll::Ready(Err(TransferError::Flushed))
    );
    assert_eq!(fx.held(), 0);
}

#[test]
fn a_failed_connection_refuses_new_transfers_before_anything_is_posted() {
    let mut fx = Fx::new();
    fx.core
        .fail_connection(fx.conn, "aborted", &TransferError::Flushed);
    let (local, remote) = scattered(1, 64);
    let mut plan = Plan::default();
    let err = fx
        .core
        .plan_transfer(
            fx.conn,
            Op::Write,
            &[REGION],
            &local,
            &remote,
            false,
            &mut plan,
        )
        .unwrap_err();
    assert_eq!(err, TransferError::Connection(fx.conn.0, "aborted".into()));
    assert_eq!(fx.nic.doorbells(), 0);
}

#[test]
fn a_transfer_begun_on_a_connection_that_fails_before_posting_ends_with_its_error() {
    let mut fx = Fx::new();
    let plan = fx.plan(Op::Write, 1, 64);
    let mut p = fx.core.begin(
        fx.conn,
        Op::Write,
        Rc::clone(&fx.keep),
        &TransferOptions::default(),
    );
    fx.core
        .fail_connection(fx.conn, "aborted", &TransferError::Flushed);
    assert!(fx
        .core
        .post(&mut p, &plan, &mut Context::from_waker(Waker::noop()))
        .is_ready());
    // Every live transfer of a failed connection ends flushed (nothing of it was posted).
    assert_eq!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Flushed))
    );
    assert_eq!(fx.held(), 0);
}

#[test]
fn a_post_the_nic_refuses_fails_the_transfer_and_the_connection() {
    let mut fx = Fx::new();
    fx.nic.refuse_posts(1);
    let mut p = fx.write(2);
    assert!(matches!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Post(_)))
    ));
    assert!(matches!(fx.core.state(fx.conn), Some(ConnState::Failed(why)) if why == "post failed"));
    assert_eq!(
        fx.core.counters().doorbells,
        0,
        "a refused batch does not count"
    );
}

#[test]
fn a_refused_chunk_ends_the_transfer_once_its_earlier_chunks_are_flushed() {
    let mut cfg = config();
    cfg.post_batch = 2;
    let mut fx = Fx::with(cfg, 64);
    fx.nic.refuse_posts_after(1, 1);
    let mut p = fx.write(6);
    assert_eq!(fx.nic.outstanding().len(), 2, "the first chunk went out");
    assert!(matches!(fx.core.state(fx.conn), Some(ConnState::Failed(_))));
    assert!(
        fx.poll_noop(&mut p).is_pending(),
        "its first chunk is still the NIC's"
    );
    assert_eq!(fx.held(), 1);
    fx.nic.flush(fx.qpn());
    assert!(matches!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Post(_)))
    ));
    assert_eq!(fx.held(), 0);
}

// ---- dropped and forgotten transfers ----

#[test]
fn a_dropped_transfer_keeps_its_memory_until_the_nic_is_done() {
    let mut fx = Fx::new();
    let mut p = fx.write(3);
    assert!(fx.poll_noop(&mut p).is_pending());
    assert!(!fx.core.detach(p.slot()), "work outstanding");
    assert_eq!(fx.held(), 1);
    fx.nic.complete_all();
    fx.reap();
    assert_eq!(fx.held(), 0);
    assert!(!fx.core.contains(p.slot()));
}

#[test]
fn a_transfer_dropped_while_waiting_for_credits_posts_nothing_more() {
    let mut fx = Fx::new();
    let plan = fx.plan(Op::Write, 40, 4096);
    let (p, r) = fx.start(&plan, TransferOptions::default());
    assert!(r.is_pending());
    fx.core.detach(p.slot());
    fx.nic.complete_all();
    fx.reap();
    assert_eq!(fx.nic.posted().len(), 16, "the rest is never posted");
    assert_eq!(fx.held(), 0, "released with its last completion");
}

#[test]
fn a_forgotten_transfer_holds_its_memory_until_the_core_goes() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    assert!(fx.poll_noop(&mut p).is_pending());
    // A forgotten future never runs its guard: the core is never told to detach the slot.
    let _forgotten = p;
    fx.nic.complete_all();
    fx.reap();
    assert_eq!(fx.held(), 1, "parked result: nobody detached the slot");
    let keep = Rc::clone(&fx.keep);
    drop(fx);
    assert_eq!(Rc::strong_count(&keep), 1, "dropping the core releases it");
}

#[test]
fn a_dropped_transfer_with_nothing_outstanding_is_released_at_once() {
    let mut fx = Fx::new();
    let p = fx.core.begin(
        fx.conn,
        Op::Write,
        Rc::clone(&fx.keep),
        &TransferOptions::default(),
    );
    assert!(fx.core.detach(p.slot()));
    assert_eq!(fx.held(), 0);
}

// ---- stale completions, slot reuse, generations ----

#[test]
fn a_stale_completion_after_slot_reuse_is_counted_and_ignored() {
    let mut fx = Fx::new();
    let mut a = fx.write(1);
    let old = fx.nic.outstanding()[0].clone();
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut a), Poll::Ready(Ok(())));
    let mut b = fx.write(1);
    assert_eq!(a.slot().key, b.slot().key, "the key is reused");
    assert_ne!(a.slot().generation, b.slot().generation);
    fx.nic.inject(Completion::success(old.qpn, old.wr_id));
    fx.reap();
    assert_eq!(fx.core.counters().stale_completions, 1);
    assert!(
        fx.poll_noop(&mut b).is_pending(),
        "B is not completed by A's CQE"
    );
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut b), Poll::Ready(Ok(())));
}

#[test]
fn a_completion_from_an_unknown_queue_pair_changes_nothing() {
    let mut fx = Fx::new();
    let mut p = fx.write(1);
    let wr = fx.nic.outstanding()[0].wr_id;
    let mut foreign = Completion::success(0xdead, wr ^ 0x7fff_0000_0000);
    foreign.status = WcStatus::RemoteAccessError;
    fx.nic.inject(foreign);
    fx.reap();
    assert_eq!(fx.core.state(fx.conn), Some(&ConnState::Ready));
    assert_eq!(fx.core.counters().stale_completions, 1);
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
}

#[test]
fn generations_wrap_to_one_and_never_match_an_old_slot() {
    let max = InflightTable::<()>::MAX_GENERATION;
    let mut t: InflightTable<()> = InflightTable::starting_at_generation(max);
    let last = t.insert(0, ());
    assert_eq!(last.generation, max);
    assert!(t.detach(last));
    let wrapped = t.insert(0, ());
    assert_eq!(wrapped.generation, 1, "0 is skipped");
    assert_eq!(wrapped.key, last.key);
    t.add_signaled(wrapped, 1);
    t.end_posting(wrapped);
    assert_eq!(
        t.on_completion(last.wr_id(true), Ok(())),
        rixl_proto::inflight::Routed::Stale
    );
    assert_eq!(
        t.on_completion(wrapped.wr_id(true), Ok(())),
        rixl_proto::inflight::Routed::Finished
    );
    let (key, generation, signaled) = rixl_proto::inflight::decode_wr_id(last.wr_id(true));
    assert_eq!((key, generation, signaled), (last.key, max, true));
}

// ---- coalescing ----

fn coalescing() -> Fx {
    let mut cfg = config();
    cfg.coalesce = true;
    cfg.signal_interval = 32;
    Fx::with(cfg, 64)
}

#[test]
fn coalescing_posts_the_first_small_transfer_of_a_turn_at_once() {
    let mut fx = coalescing();
    let p = fx.write(1);
    assert!(!p.queued());
    assert_eq!(fx.nic.doorbells(), 1);
    assert!(!fx.core.take_flush_request(fx.conn));
}

/// Completes everything posted and takes `ps`' results (the queued ones covered by a later
/// signal); nothing is held afterwards.
fn complete_and_take<'a>(fx: &mut Fx, ps: impl IntoIterator<Item = &'a mut Posting>) {
    fx.nic.complete_all();
    for p in ps {
        assert_eq!(fx.poll_noop(p), Poll::Ready(Ok(())), "covered by the last");
    }
    assert_eq!(fx.held(), 0);
}

/// Flushes the queue, completes everything and takes `ps`' results.
fn flush_and_complete(fx: &mut Fx, ps: &mut [Posting]) {
    assert!(fx.core.take_flush_request(fx.conn));
    assert!(fx
        .core
        .flush(fx.conn, &mut Context::from_waker(Waker::noop()))
        .is_ready());
    fx.nic.complete_all();
    fx.reap();
    for p in ps {
        assert_eq!(fx.poll_noop(p), Poll::Ready(Ok(())));
    }
}

#[test]
fn coalescing_learns_to_post_at_once_when_nothing_joins_the_queue_and_probes_back() {
    // A task that posts, awaits and posts again within one progress turn (on rxe the
    // completion is often there before the future first waits, so no turn passes).
    let mut fx = coalescing();
    let mut first = fx.write(1);
    assert!(!first.queued(), "the first of the turn");
    fx.nic.complete_all();
    fx.reap();
    assert_eq!(fx.poll_noop(&mut first), Poll::Ready(Ok(())));
    for i in 0..rixl_proto::COALESCE_LONELY_FLUSHES {
        let mut p = fx.write(1);
        assert!(p.queued(), "transfer {i}: later in the turn, queued");
        flush_and_complete(&mut fx, std::slice::from_mut(&mut p));
    }
    // Every flush posted one transfer: the connection posts at once now, but for a probe.
    let queued = fx.core.counters().queued;
    for i in 1..rixl_proto::COALESCE_PROBE_EVERY {
        let mut p = fx.write(1);
        assert!(!p.queued(), "transfer {i} posted at once");
        fx.nic.complete_all();
        fx.reap();
        assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
    }
    assert_eq!(fx.core.counters().queued, queued);
    // The probe is queued, and a transfer that comes while it waits joins it rather than
    // overtaking it: that flush found company, so the connection coalesces again.
    let probe = fx.write(1);
    assert!(probe.queued(), "the probe");
    let joined = fx.write(1);
    assert!(joined.queued(), "joins the probe");
    flush_and_complete(&mut fx, &mut [probe, joined]);
    let mut again = fx.write(1);
    assert!(again.queued(), "coalescing again");
    flush_and_complete(&mut fx, std::slice::from_mut(&mut again));
    assert_eq!(fx.held(), 0);
}

#[test]
fn coalescing_queues_later_small_transfers_of_the_turn_and_flushes_them_with_one_doorbell() {
    let mut fx = coalescing();
    let mut first = fx.write(1);
    let mut queued: Vec<Posting> = (0..3).map(|_| fx.write(1)).collect();
    assert!(queued.iter().all(Posting::queued));
    assert_eq!(fx.nic.doorbells(), 1);
    assert_eq!(fx.core.counters().queued, 3);
    assert!(fx.core.take_flush_request(fx.conn));
    assert!(!fx.core.take_flush_request(fx.conn), "one flush at a time");
    assert!(fx
        .core
        .flush(fx.conn, &mut Context::from_waker(Waker::noop()))
        .is_ready());
    assert_eq!(fx.nic.doorbells(), 2, "three transfers, one doorbell");
    let signaled: Vec<bool> = fx.nic.outstanding()[1..]
        .iter()
        .map(|w| w.flags.signaled)
        .collect();
    assert_eq!(signaled, [false, false, true], "only the batch's last");
    complete_and_take(&mut fx, std::iter::once(&mut first).chain(&mut queued));
}

#[test]
fn coalescing_never_queues_a_transfer_of_more_than_the_limit() {
    let mut fx = coalescing();
    let _first = fx.write(1);
    let big = fx.write(rixl_proto::COALESCE_MAX_WRS as u64 + 1);
    assert!(!big.queued());
    let small = fx.write(rixl_proto::COALESCE_MAX_WRS as u64);
    assert!(small.queued(), "at the limit it is queued");
}

#[test]
fn coalescing_never_queues_a_transfer_larger_than_one_doorbell() {
    let mut cfg = config();
    cfg.coalesce = true;
    cfg.post_batch = 2;
    let mut fx = Fx::with(cfg, 64);
    let _first = fx.write(1);
    // Three requests cannot go in one flush doorbell of two: posted at once, never queued (a
    // queued one could never be flushed).
    let big = fx.write(3);
    assert!(!big.queued());
    assert!(fx.write(2).queued());
}

#[test]
fn coalescing_posts_at_once_again_in_the_next_turn() {
    let mut fx = coalescing();
    let _a = fx.write(1);
    let b = fx.write(1);
    assert!(b.queued());
    let _ = fx
        .core
        .flush(fx.conn, &mut Context::from_waker(Waker::noop()));
    fx.core.next_turn();
    let c = fx.write(1);
    assert!(!c.queued());
}

#[test]
fn coalescing_queues_a_notification_behind_queued_transfers_with_the_immediate_last() {
    let mut fx = coalescing();
    // The first of the turn, notification or not, is posted at once.
    let plan = fx.plan(Op::Write, 1, 64);
    let mut opts = TransferOptions::default();
    opts.notify_imm = Some(4);
    let (first, _) = fx.start(&plan, opts);
    assert!(!first.queued());
    assert!(matches!(
        fx.nic.posted().last().map(|w| w.op),
        Some(SendOp::WriteWithImm { imm: 4, .. })
    ));
    // Later ones queue behind what is queued: the notification never lands before the data
    // queued ahead of it on the connection.
    let queued = fx.write(1);
    assert!(queued.queued());
    let plan = fx.plan(Op::Write, 2, 64);
    let mut opts = TransferOptions::default();
    opts.notify_imm = Some(5);
    let (notified, _) = fx.start(&plan, opts);
    assert!(notified.queued(), "behind the queued transfer");
    assert_eq!(fx.nic.doorbells(), 1);
    assert!(fx.core.take_flush_request(fx.conn));
    assert!(fx
        .core
        .flush(fx.conn, &mut Context::from_waker(Waker::noop()))
        .is_ready());
    let ops: Vec<Option<u32>> = fx.nic.posted()[1..]
        .iter()
        .map(|w| match w.op {
            SendOp::WriteWithImm { imm, .. } => Some(imm),
            SendOp::Write { .. } => None,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(
        ops,
        [None, None, Some(5)],
        "the immediate on its last request"
    );
    complete_and_take(&mut fx, &mut [first, queued, notified]);
}

#[test]
fn coalescing_flush_waits_for_credits_for_a_whole_transfer() {
    let mut cfg = config();
    cfg.coalesce = true;
    let mut fx = Fx::with(cfg, 4);
    let _a = fx.write(2);
    let b = fx.write(3);
    assert!(b.queued());
    let (count, waker) = counting_waker();
    let mut cx = Context::from_waker(&waker);
    assert!(
        fx.core.flush(fx.conn, &mut cx).is_pending(),
        "2 free, 3 needed"
    );
    assert_eq!(fx.nic.doorbells(), 1);
    fx.nic.complete_all();
    fx.reap();
    assert_eq!(count.get(), 1);
    assert!(fx.core.flush(fx.conn, &mut cx).is_ready());
    assert_eq!(fx.nic.doorbells(), 2);
}

#[test]
fn coalescing_drops_a_queued_transfer_whose_future_went_away() {
    let mut fx = coalescing();
    let mut a = fx.write(1);
    let b = fx.write(1);
    let mut c = fx.write(1);
    fx.core.detach(b.slot());
    let _ = fx
        .core
        .flush(fx.conn, &mut Context::from_waker(Waker::noop()));
    assert_eq!(fx.nic.posted().len(), 2, "B's request is not posted");
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut a), Poll::Ready(Ok(())));
    assert_eq!(fx.poll_noop(&mut c), Poll::Ready(Ok(())));
    assert_eq!(fx.held(), 0);
}

#[test]
fn coalescing_signals_every_eighth_request_of_a_batch() {
    let mut fx = coalescing();
    let _a = fx.write(1);
    let mut ps: Vec<Posting> = (0..20).map(|_| fx.write(1)).collect();
    let _ = fx
        .core
        .flush(fx.conn, &mut Context::from_waker(Waker::noop()));
    let signaled: Vec<usize> = fx.nic.outstanding()[1..]
        .iter()
        .enumerate()
        .filter(|(_, w)| w.flags.signaled)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(signaled, [7, 15, 19]);
    // Completing up to the first signal finishes the first eight only.
    fx.nic.complete(1 + 8);
    fx.reap();
    let done = ps
        .iter_mut()
        .map(|p| fx.core.try_finish(p).is_ready())
        .filter(|d| *d)
        .count();
    assert_eq!(done, 8);
}

/// A message as the runtime's `post_message` sends it: queued for the coalesced post, or
/// posted at once (the fake queue always has a credit here).
fn message(fx: &mut Fx, len: u32) -> Posting {
    let sge = Sge {
        addr: REGION.addr,
        length: len,
        lkey: REGION.lkey,
    };
    let keep = Rc::clone(&fx.keep);
    if fx.core.queues_message(fx.conn) {
        fx.core
            .queue_message(fx.conn, SendOp::Send, sge, true, keep)
    } else {
        fx.core.post_single(fx.conn, SendOp::Send, sge, true, keep)
    }
}

#[test]
fn coalescing_queues_later_messages_of_the_turn_behind_queued_transfers_in_order() {
    let mut fx = coalescing();
    let mut first = message(&mut fx, 64);
    assert!(!first.queued(), "the first of the turn is posted at once");
    let mut queued = vec![fx.write(1), message(&mut fx, 64), message(&mut fx, 4096)];
    assert!(queued.iter().all(Posting::queued));
    assert_eq!(fx.nic.doorbells(), 1);
    assert_eq!(fx.core.counters().queued, 3);
    assert!(fx.core.take_flush_request(fx.conn));
    assert!(fx
        .core
        .flush(fx.conn, &mut Context::from_waker(Waker::noop()))
        .is_ready());
    assert_eq!(fx.nic.doorbells(), 2, "one doorbell for the three");
    let ops: Vec<(bool, bool, bool)> = fx
        .nic
        .posted()
        .iter()
        .map(|w| {
            (
                matches!(w.op, SendOp::Send),
                w.flags.signaled,
                w.flags.inline,
            )
        })
        .collect();
    assert_eq!(
        ops,
        [
            (true, true, true),
            (false, false, false),
            (true, false, true),
            (true, true, false),
        ],
        "in order: the at-once SEND, then the WRITE and the SENDs queued after it; the batch's \
         last is signaled, the small SEND inline"
    );
    let c = fx.core.counters();
    assert_eq!((c.work_requests, c.doorbells), (4, 2));
    complete_and_take(&mut fx, std::iter::once(&mut first).chain(&mut queued));
}

#[test]
fn coalescing_off_posts_every_message_at_once() {
    let mut fx = Fx::new();
    let ps: Vec<Posting> = (0..3).map(|_| message(&mut fx, 64)).collect();
    assert!(ps.iter().all(|p| !p.queued()));
    assert_eq!(fx.nic.doorbells(), 3);
    assert!(fx.nic.posted().iter().all(|w| w.flags.signaled));
}

#[test]
fn a_queued_message_on_a_failed_connection_ends_with_its_error() {
    let mut fx = coalescing();
    let _first = message(&mut fx, 64);
    fx.core
        .fail_connection(fx.conn, "aborted", &TransferError::Flushed);
    let mut p = message(&mut fx, 64);
    assert!(!p.queued(), "not queued: the connection is not ready");
    assert!(matches!(fx.poll_noop(&mut p), Poll::Ready(Err(_))));
    assert_eq!(fx.nic.doorbells(), 1, "nothing more posted");
}

#[test]
fn coalesced_transfers_end_with_the_error_when_the_connection_fails_before_the_flush() {
    let mut fx = coalescing();
    let _a = fx.write(1);
    let mut b = fx.write(1);
    fx.core
        .fail_connection(fx.conn, "aborted", &TransferError::Flushed);
    assert!(fx
        .core
        .flush(fx.conn, &mut Context::from_waker(Waker::noop()))
        .is_ready());
    assert_eq!(
        fx.poll_noop(&mut b),
        Poll::Ready(Err(TransferError::Flushed))
    );
    assert_eq!(fx.nic.doorbells(), 1, "nothing queued is posted");
}

#[test]
fn coalesced_transfers_fail_when_the_flush_post_is_refused() {
    let mut fx = coalescing();
    let _a = fx.write(1);
    let mut b = fx.write(1);
    fx.nic.refuse_posts(1);
    let _ = fx
        .core
        .flush(fx.conn, &mut Context::from_waker(Waker::noop()));
    assert!(matches!(
        fx.poll_noop(&mut b),
        Poll::Ready(Err(TransferError::Post(_)))
    ));
    assert!(matches!(fx.core.state(fx.conn), Some(ConnState::Failed(_))));
}

// ---- planning, notifications, prepared transfers ----

#[test]
fn a_notification_turns_the_last_request_into_a_write_with_immediate() {
    let mut fx = Fx::new();
    let plan = fx.plan(Op::Write, 3, 64);
    let mut opts = TransferOptions::default();
    opts.notify_imm = Some(0xfeed);
    let _ = fx.start(&plan, opts);
    let ops: Vec<SendOp> = fx.nic.posted().iter().map(|w| w.op).collect();
    assert!(matches!(ops[0], SendOp::Write { .. }));
    assert!(matches!(ops[2], SendOp::WriteWithImm { imm: 0xfeed, .. }));
}

#[test]
fn a_notification_on_a_read_is_refused() {
    let fx = Fx::new();
    let (local, remote) = scattered(1, 64);
    let err = fx
        .core
        .plan_transfer(
            fx.conn,
            Op::Read,
            &[REGION],
            &local,
            &remote,
            true,
            &mut Plan::default(),
        )
        .unwrap_err();
    assert!(matches!(err, TransferError::Post(_)));
}

#[test]
fn bad_descriptors_are_typed_errors_and_nothing_is_posted() {
    let fx = Fx::new();
    let mut plan = Plan::default();
    let remote = [RemoteDesc {
        addr: 0x1000,
        len: 64,
        rkey: 1,
    }];
    let outside = [LocalDesc {
        region: 0,
        offset: REGION.len - 32,
        len: 64,
    }];
    let err = fx
        .core
        .plan_transfer(
            fx.conn,
            Op::Write,
            &[REGION],
            &outside,
            &remote,
            false,
            &mut plan,
        )
        .unwrap_err();
    assert!(matches!(
        err,
        TransferError::InvalidDescriptor(InvalidDescriptor::OutOfRange { index: 0, .. })
    ));
    let unknown_region = [LocalDesc {
        region: 3,
        offset: 0,
        len: 64,
    }];
    let err = fx
        .core
        .plan_transfer(
            fx.conn,
            Op::Write,
            &[REGION],
            &unknown_region,
            &remote,
            false,
            &mut plan,
        )
        .unwrap_err();
    assert!(matches!(
        err,
        TransferError::InvalidDescriptor(InvalidDescriptor::ForeignRegion { index: 0 })
    ));
    assert_eq!(fx.nic.doorbells(), 0);
}

#[test]
fn reads_use_at_most_the_devices_read_entries_and_are_never_inline() {
    let mut cfg = config();
    cfg.max_sge_rd = 1;
    let mut fx = Fx::with(cfg, 64);
    // Two adjacent remote pieces from scattered local blocks: one request for a WRITE (2
    // entries), two for a READ (1 entry each).
    let local = [
        LocalDesc {
            region: 0,
            offset: 0,
            len: 32,
        },
        LocalDesc {
            region: 0,
            offset: 4096,
            len: 32,
        },
    ];
    let remote = [RemoteDesc {
        addr: 0x5000,
        len: 64,
        rkey: 3,
    }];
    let mut plan = Plan::default();
    fx.core
        .plan_transfer(
            fx.conn,
            Op::Write,
            &[REGION],
            &local,
            &remote,
            false,
            &mut plan,
        )
        .expect("valid");
    assert_eq!(plan.wrs.len(), 1);
    fx.core
        .plan_transfer(
            fx.conn,
            Op::Read,
            &[REGION],
            &local,
            &remote,
            false,
            &mut plan,
        )
        .expect("valid");
    assert_eq!(plan.wrs.len(), 2);
    let mut p = fx.core.begin(
        fx.conn,
        Op::Read,
        Rc::clone(&fx.keep),
        &TransferOptions::default(),
    );
    let _ = fx
        .core
        .post(&mut p, &plan, &mut Context::from_waker(Waker::noop()));
    assert!(fx
        .nic
        .posted()
        .iter()
        .all(|w| !w.flags.inline && matches!(w.op, SendOp::Read { .. })));
}

#[test]
fn small_writes_go_inline_and_large_ones_do_not() {
    let mut fx = Fx::new();
    let _ = fx.write(1);
    let plan = fx.plan(Op::Write, 1, 64);
    let _ = fx.start(&plan, TransferOptions::default());
    let inline: Vec<bool> = fx.nic.posted().iter().map(|w| w.flags.inline).collect();
    assert_eq!(
        inline,
        [false, true],
        "4 KiB is over the 64-byte grant, 64 B is not"
    );
}

#[test]
fn small_requests_from_gpu_memory_are_never_inline() {
    // IBV_SEND_INLINE makes the CPU copy the bytes inside the post: from a device address
    // that would read memory the CPU cannot reach. Posted at once, queued for a coalesced
    // post, and as a SEND: the NIC reads GPU memory itself.
    let gpu = RegionInfo {
        host: false,
        ..REGION
    };
    for coalesce in [false, true] {
        let mut fx = if coalesce { coalescing() } else { Fx::new() };
        for _ in 0..3 {
            let (local, remote) = scattered(1, 64);
            let mut plan = fx.core.take_plan();
            fx.core
                .plan_transfer(
                    fx.conn,
                    Op::Write,
                    &[gpu],
                    &local,
                    &remote,
                    false,
                    &mut plan,
                )
                .expect("valid lists");
            assert!(!plan.host);
            let _ = fx.start(&plan, TransferOptions::default());
        }
        if coalesce {
            assert!(fx.core.take_flush_request(fx.conn), "the later two queued");
            assert!(fx
                .core
                .flush(fx.conn, &mut Context::from_waker(Waker::noop()))
                .is_ready());
        }
        let posted = fx.nic.posted();
        assert_eq!(posted.len(), 3, "coalesce {coalesce}: {posted:?}");
        assert!(
            posted.iter().all(|w| !w.flags.inline),
            "coalesce {coalesce}: {posted:?}"
        );
    }
    let mut fx = Fx::new();
    let sge = Sge {
        addr: REGION.addr,
        length: 16,
        lkey: REGION.lkey,
    };
    let _ = fx
        .core
        .post_single(fx.conn, SendOp::Send, sge, false, Rc::clone(&fx.keep));
    let _ = fx
        .core
        .post_single(fx.conn, SendOp::Send, sge, true, Rc::clone(&fx.keep));
    let inline: Vec<bool> = fx.nic.posted().iter().map(|w| w.flags.inline).collect();
    assert_eq!(
        inline,
        [false, true],
        "a SEND from GPU memory, then from host"
    );
}

#[test]
fn a_prepared_transfer_is_bound_to_its_connections_epoch() {
    let mut fx = Fx::new();
    let epoch = fx.core.epoch(fx.conn).expect("live");
    assert!(fx
        .core
        .check_epoch(fx.conn, epoch, Op::Write, false)
        .is_ok());
    assert!(fx.core.remove_connection(fx.conn).is_some());
    let again = fx.core.add_connection(fx.nic.queue(), params(16));
    fx.core.connected(again, 1 << 20);
    assert_eq!(again, fx.conn, "the id is reused");
    assert_eq!(
        fx.core.check_epoch(again, epoch, Op::Write, false),
        Err(TransferError::Connection(
            again.0,
            "prepared for a connection that is gone".into()
        ))
    );
}

#[test]
fn plans_are_recycled_with_their_allocations() {
    let mut fx = Fx::new();
    let plan = fx.plan(Op::Write, 100, 64);
    let cap = plan.wrs.capacity();
    fx.core.recycle_plan(plan);
    let again = fx.core.take_plan();
    assert!(again.wrs.capacity() >= cap.min(100));
}

// ---- connections, receives, activity ----

#[test]
fn removing_a_connection_ends_its_queued_transfers_closed() {
    let mut fx = coalescing();
    let _a = fx.write(1);
    let mut b = fx.write(1);
    assert!(b.queued());
    assert!(fx.core.remove_connection(fx.conn).is_some());
    assert_eq!(
        fx.core.try_finish(&mut b),
        Poll::Ready(Err(TransferError::Connection(fx.conn.0, "closed".into())))
    );
}

#[test]
fn unknown_connections_are_typed_errors() {
    let mut fx = Fx::new();
    let ghost = ConnId(42);
    let mut cx = Context::from_waker(Waker::noop());
    assert_eq!(
        fx.core.poll_credits(ghost, 1, &mut cx),
        Poll::Ready(Err(TransferError::Connection(42, "unknown".into())))
    );
    assert!(matches!(
        fx.core.poll_recv(ghost, &mut cx),
        Poll::Ready(Err(TransferError::Connection(42, _)))
    ));
    assert_eq!(fx.core.poll_idle(ghost, &mut cx), Poll::Ready(()));
    let plan = fx.plan(Op::Write, 1, 64);
    let mut p = fx.core.begin(
        ghost,
        Op::Write,
        Rc::clone(&fx.keep),
        &TransferOptions::default(),
    );
    assert!(fx.core.post(&mut p, &plan, &mut cx).is_ready());
    assert!(matches!(
        fx.core.try_finish(&mut p),
        Poll::Ready(Err(TransferError::Connection(42, _)))
    ));
}

fn recv(conn: ConnId, index: u32, len: u32, opcode: WcOpcode, imm: Option<u32>) -> Completion {
    Completion {
        wr_id: recv_wr_id(conn.0, index),
        status: WcStatus::Success,
        opcode,
        byte_len: len,
        imm,
        qp_num: 0x101,
    }
}

#[test]
fn received_messages_are_delivered_in_order_and_their_buffers_reposted() {
    let mut fx = Fx::new();
    let (count, waker) = counting_waker();
    let mut cx = Context::from_waker(&waker);
    assert!(fx.core.poll_recv(fx.conn, &mut cx).is_pending());
    fx.nic.inject(recv(fx.conn, 3, 5, WcOpcode::Recv, None));
    fx.nic
        .inject(recv(fx.conn, 4, 0, WcOpcode::RecvRdmaWithImm, Some(77)));
    fx.reap();
    assert_eq!(count.get(), 1);
    assert_eq!(
        fx.core.poll_recv(fx.conn, &mut cx),
        Poll::Ready(Ok(Message::Data(vec![3; 5], None)))
    );
    assert_eq!(
        fx.core.poll_recv(fx.conn, &mut cx),
        Poll::Ready(Ok(Message::Immediate(77)))
    );
    assert_eq!(
        fx.nic.reposted(),
        [recv_wr_id(fx.conn.0, 3), recv_wr_id(fx.conn.0, 4)]
    );
    assert_eq!(fx.nic.received(), [(3, 5)], "an immediate reads no buffer");
}

#[test]
fn a_reader_that_falls_behind_holds_back_receive_buffers_past_the_inbox_limit() {
    let mut fx = Fx::new();
    let extra = 5u32;
    let n = INBOX_LIMIT as u32 + extra;
    for i in 0..n {
        fx.nic.inject(recv(fx.conn, i, 1, WcOpcode::Recv, None));
    }
    fx.reap();
    assert_eq!(
        fx.nic.reposted().len(),
        INBOX_LIMIT,
        "buffers past the limit are held back: the sender meets RNR"
    );
    assert_eq!(fx.core.counters().receives_held_back, u64::from(extra));
    let mut cx = Context::from_waker(Waker::noop());
    // Each message taken posts one held-back buffer again, until none is held back.
    for k in 1..=n {
        assert!(matches!(
            fx.core.poll_recv(fx.conn, &mut cx),
            Poll::Ready(Ok(Message::Data(..)))
        ));
        let want = INBOX_LIMIT + (k as usize).min(extra as usize);
        assert_eq!(fx.nic.reposted().len(), want, "after {k} taken");
    }
    assert!(fx.core.poll_recv(fx.conn, &mut cx).is_pending());
    let mut all = fx.nic.reposted();
    all.sort_unstable();
    all.dedup();
    assert_eq!(
        all.len(),
        n as usize,
        "every buffer posted again exactly once"
    );
}

#[test]
fn a_flushed_receive_delivers_nothing_and_is_not_reposted() {
    let mut fx = Fx::new();
    let mut c = recv(fx.conn, 1, 0, WcOpcode::Recv, None);
    c.status = WcStatus::WorkRequestFlushError;
    fx.nic.inject(c);
    fx.reap();
    assert!(fx
        .core
        .poll_recv(fx.conn, &mut Context::from_waker(Waker::noop()))
        .is_pending());
    assert!(fx.nic.reposted().is_empty());
}

#[test]
fn a_failed_connection_delivers_its_inbox_then_its_error() {
    let mut fx = Fx::new();
    fx.nic.inject(recv(fx.conn, 0, 2, WcOpcode::Recv, Some(1)));
    fx.reap();
    fx.core
        .fail_connection(fx.conn, "peer gone", &TransferError::Flushed);
    let mut cx = Context::from_waker(Waker::noop());
    assert!(matches!(
        fx.core.poll_recv(fx.conn, &mut cx),
        Poll::Ready(Ok(Message::Data(_, Some(1))))
    ));
    assert_eq!(
        fx.core.poll_recv(fx.conn, &mut cx),
        Poll::Ready(Err(TransferError::Connection(
            fx.conn.0,
            "peer gone".into()
        )))
    );
}

#[test]
fn failing_a_connection_wakes_everything_waiting_on_it() {
    let mut fx = Fx::with(config(), 4);
    let _p = fx.write(4);
    let (count, waker) = counting_waker();
    let mut cx = Context::from_waker(&waker);
    assert!(fx.core.poll_recv(fx.conn, &mut cx).is_pending());
    assert!(fx.core.poll_credits(fx.conn, 1, &mut cx).is_pending());
    fx.core
        .fail_connection(fx.conn, "aborted", &TransferError::Flushed);
    assert_eq!(count.get(), 2);
    assert!(matches!(
        fx.core.poll_credits(fx.conn, 1, &mut cx),
        Poll::Ready(Err(TransferError::Connection(..)))
    ));
}

#[test]
fn idle_waits_for_the_connections_outstanding_work() {
    let mut fx = Fx::new();
    let mut cx = Context::from_waker(Waker::noop());
    assert_eq!(fx.core.poll_idle(fx.conn, &mut cx), Poll::Ready(()));
    let _p = fx.write(2);
    assert!(fx.core.poll_idle(fx.conn, &mut cx).is_pending());
    assert!(!fx.core.activity().idle);
    fx.nic.complete_all();
    fx.reap();
    assert_eq!(fx.core.poll_idle(fx.conn, &mut cx), Poll::Ready(()));
    assert!(fx.core.activity().idle);
}

#[test]
fn activity_reports_a_waiting_receive_only_on_a_live_connection() {
    let mut fx = Fx::new();
    assert!(!fx.core.activity().waiting_recv);
    let _ = fx
        .core
        .poll_recv(fx.conn, &mut Context::from_waker(Waker::noop()));
    assert!(fx.core.activity().waiting_recv);
    fx.core
        .fail_connection(fx.conn, "aborted", &TransferError::Flushed);
    assert!(!fx.core.activity().waiting_recv);
}

#[test]
fn a_single_send_is_signaled_and_keeps_its_buffer_until_completion() {
    let mut fx = Fx::new();
    let sge = Sge {
        addr: REGION.addr,
        length: 16,
        lkey: REGION.lkey,
    };
    let mut p = fx.core.post_single(
        fx.conn,
        SendOp::SendWithImm { imm: 9 },
        sge,
        true,
        Rc::clone(&fx.keep),
    );
    let wr = fx.nic.posted()[0].clone();
    assert!(wr.flags.signaled && wr.flags.inline);
    assert_eq!(fx.held(), 1);
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
    assert_eq!(fx.held(), 0);
}

#[test]
fn a_control_request_takes_a_credit_and_its_completion_ends_its_slot_and_a_refusal_takes_none() {
    // A memory-window bind is such a request: built by the caller, accounted by the core.
    let mut fx = Fx::with(config(), 2);
    let mut cx = Context::from_waker(Waker::noop());
    let mut p = fx
        .core
        .post_control(fx.conn, Op::Write, Rc::clone(&fx.keep), |q, wr_id| {
            rixl_proto::SendQueue::push(
                q,
                wr_id,
                SendOp::Send,
                &[],
                rixl_proto::SendFlags::SIGNALED,
            );
            Ok(())
        });
    assert_eq!(fx.nic.posted().len(), 1, "posted with one doorbell");
    assert_eq!(fx.held(), 1, "its keep-alive is held until it completes");
    assert!(
        fx.core.poll_credits(fx.conn, 2, &mut cx).is_pending(),
        "one credit taken"
    );
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
    assert_eq!(fx.held(), 0);
    assert!(
        fx.core.poll_credits(fx.conn, 2, &mut cx).is_ready(),
        "the credit is back"
    );
    // A request the caller could not build fails its slot, takes no credit, posts nothing.
    let mut refused = fx
        .core
        .post_control(fx.conn, Op::Write, Rc::clone(&fx.keep), |_, _| {
            Err(rixl_proto::harness::Refused("bind"))
        });
    assert!(matches!(
        fx.poll_noop(&mut refused),
        Poll::Ready(Err(TransferError::Post(_)))
    ));
    assert_eq!(fx.nic.posted().len(), 1);
    assert!(fx.core.poll_credits(fx.conn, 2, &mut cx).is_ready());
    assert_eq!(fx.held(), 0);
}

#[test]
fn the_virtual_clock_moves_only_when_told() {
    let clock = VirtualClock::new();
    let t0 = clock.now();
    assert_eq!(clock.now(), t0);
    clock.advance(Duration::from_secs(3));
    assert_eq!(clock.now() - t0, Duration::from_secs(3));
    assert_eq!(clock.elapsed(), Duration::from_secs(3));
}

// ---- which descriptors failed ----

#[test]
fn a_failure_names_the_completed_prefix_the_failed_descriptors_and_none_unposted() {
    use rixl_proto::{DescriptorRanges, Progress};
    let mut fx = Fx::new();
    // 12 scattered requests, every 4th and the last signaled: 3, 7, 11.
    let mut p = fx.write(12);
    assert_eq!(fx.nic.posted().len(), 12);
    assert_eq!(
        fx.nic.complete(8),
        8,
        "requests 0..8 complete (signaled 3 and 7)"
    );
    fx.nic.complete_at(0, WcStatus::RemoteAccessError); // request 8
    fx.nic.flush(fx.qpn());
    assert!(matches!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::RemoteAccess { .. }))
    ));
    assert_eq!(
        p.progress(),
        Progress {
            completed_bytes: 8 * 4096,
            posted_bytes: 12 * 4096
        }
    );
    let r = DescriptorRanges::of(p.progress(), std::iter::repeat_n(4096, 12));
    assert_eq!((r.failed(), r.not_posted()), (8..12, 12..12));
    // The first signaled request failed: nothing is known complete.
    let mut fx = Fx::new();
    let mut p = fx.write(6);
    fx.nic.complete_at(0, WcStatus::RemoteAccessError);
    fx.nic.flush(fx.qpn());
    assert!(fx.poll_noop(&mut p).is_ready());
    let r = DescriptorRanges::of(p.progress(), std::iter::repeat_n(4096, 6));
    assert_eq!((r.failed(), r.not_posted()), (0..6, 6..6));
}

#[test]
fn a_timed_out_transfer_names_the_descriptors_it_never_posted() {
    use rixl_proto::DescriptorRanges;
    let mut fx = Fx::new();
    // 40 requests on a 16-deep queue: 16 posted, then it waits for credits and times out.
    let plan = fx.plan(Op::Write, 40, 4096);
    let (mut p, r) = fx.start(&plan, TransferOptions::default());
    assert!(r.is_pending());
    // The first 8 complete (signaled 3 and 7), then the deadline passes.
    fx.nic.complete(8);
    fx.reap();
    assert_eq!(fx.tick(TIMEOUT * 2), 1);
    assert!(fx
        .core
        .post(&mut p, &plan, &mut Context::from_waker(Waker::noop()))
        .is_ready());
    assert_eq!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Timeout(TIMEOUT)))
    );
    // Descriptors of 1 KiB pieces: each 4 KiB request covers four.
    let r = DescriptorRanges::of(p.progress(), std::iter::repeat_n(1024, 160));
    assert_eq!(r.completed, 32, "8 requests x 4 descriptors completed");
    assert_eq!(
        r.posted,
        16 * 4,
        "the 16 requests posted before the deadline"
    );
    assert_eq!(r.not_posted(), r.posted..160);
}

#[test]
fn a_queued_coalesced_transfer_that_fails_names_every_descriptor_failed() {
    use rixl_proto::DescriptorRanges;
    let mut fx = coalescing();
    let _first = fx.write(1); // posted at once: the turn's first
    let mut queued = fx.write(2);
    assert!(queued.queued());
    fx.core
        .fail_connection(fx.conn, "test", &TransferError::Flushed);
    fx.nic.flush(fx.qpn());
    let mut cx = Context::from_waker(Waker::noop());
    let _ = fx.core.flush(fx.conn, &mut cx);
    assert!(matches!(fx.poll_noop(&mut queued), Poll::Ready(Err(_))));
    let r = DescriptorRanges::of(queued.progress(), [4096, 4096]);
    assert_eq!((r.failed(), r.not_posted()), (0..2, 2..2));
}

proptest::proptest! {
    /// The single-request plan is the general plan whenever it answers, and it answers for every
    /// valid transfer of one descriptor a side that fits one request; anything else (every
    /// invalid list, a READ with a notification, a failed connection) is left to the general
    /// planner, which names the error.
    #[test]
    fn plan_single_agrees_with_the_general_plan(
        region in 0u32..2,
        offset in proptest::prop_oneof![0u64..4096, (1u64 << 30) - 4096..(1u64 << 30) + 8, u64::MAX - 8..=u64::MAX],
        len in proptest::prop_oneof![0u64..8192, (1u64 << 20) - 2..(1u64 << 20) + 2],
        remote_len_delta in proptest::prop_oneof![proptest::strategy::Just(0i64), -1i64..=1],
        remote_addr in proptest::prop_oneof![0x9000_0000u64..0x9000_1000, u64::MAX - 4096..=u64::MAX],
        read in proptest::bool::ANY,
        notify in proptest::bool::ANY,
        failed in proptest::bool::ANY,
    ) {
        let mut fx = Fx::new();
        if failed {
            fx.core.fail_connection(fx.conn, "test", &TransferError::Flushed);
        }
        let op = if read { Op::Read } else { Op::Write };
        let local = LocalDesc { region, offset, len };
        let remote = RemoteDesc {
            addr: remote_addr,
            len: len.saturating_add_signed(remote_len_delta),
            rkey: 9,
        };
        let mut general = fx.core.take_plan();
        let expected =
            fx.core.plan_transfer(fx.conn, op, &[REGION], &[local], &[remote], notify, &mut general);
        let mut single = fx.core.take_plan();
        let got = fx.core.plan_single(fx.conn, op, &REGION, &local, &remote, notify, &mut single);
        match (&expected, got) {
            (Ok(epoch), Some(e)) => {
                proptest::prop_assert_eq!(*epoch, e);
                proptest::prop_assert_eq!(&general, &single);
            }
            (Ok(_), None) => proptest::prop_assert!(
                general.wrs.len() > 1,
                "a valid one-request transfer was left to the general planner: {general:?}"
            ),
            (Err(e), Some(_)) => proptest::prop_assert!(false, "planned what the general planner refuses: {e}"),
            (Err(_), None) => {}
        }
    }
}

/// The general path of one transfer, as the runtime takes it when the core leaves it a lone
/// transfer: plan, open the slot, post.
fn general_transfer(
    fx: &mut Fx,
    op: Op,
    local: LocalDesc,
    remote: RemoteDesc,
    opts: &TransferOptions,
) -> Result<(Posting, Poll<()>, usize), TransferError> {
    let mut plan = fx.core.take_plan();
    fx.core.plan_transfer(
        fx.conn,
        op,
        &[REGION],
        &[local],
        &[remote],
        opts.notify_imm.is_some(),
        &mut plan,
    )?;
    let mut p = fx.core.begin(fx.conn, op, Rc::clone(&fx.keep), opts);
    let r = fx
        .core
        .post(&mut p, &plan, &mut Context::from_waker(Waker::noop()));
    Ok((p, r, plan.wrs.len()))
}

proptest::proptest! {
    /// A lone transfer (checks, slot, credit and post or queueing in one call) is the general
    /// path's transfer whenever the core takes it: the same request (id, operation, entry,
    /// flags) with one doorbell, or queued and then posted by the flush, the same counters and
    /// the same result, refused posts included. It takes every valid one-request transfer the
    /// general path would post at once or queue; whatever it leaves (errors, transfers to split,
    /// no credit) it leaves untouched, so the general path then does exactly what it would have
    /// done.
    #[test]
    fn post_lone_agrees_with_the_general_path(
        offset in proptest::prop_oneof![0u64..4096, (1u64 << 30) - 4096..(1u64 << 30) + 8],
        len in proptest::prop_oneof![0u64..8192, (1u64 << 20) - 2..(1u64 << 20) + 2],
        remote_len_delta in proptest::prop_oneof![proptest::strategy::Just(0i64), -1i64..=1],
        read in proptest::bool::ANY,
        notify in proptest::bool::ANY,
        failed in proptest::bool::ANY,
        coalesce in proptest::bool::ANY,
        before in proptest::prop_oneof![0u64..=2, 14u64..=17],
        refuse in proptest::bool::ANY,
    ) {
        let mut cfg = config();
        cfg.coalesce = coalesce;
        let (mut general, mut lone) = (Fx::with(cfg, 16), Fx::with(cfg, 16));
        for fx in [&mut general, &mut lone] {
            // Transfers of this turn before it: with coalescing the next one is queued; 16
            // take every credit.
            let plan = fx.plan(Op::Write, 1, 64);
            for _ in 0..before {
                let _ = fx.start(&plan, TransferOptions::default());
            }
            if failed {
                fx.core.fail_connection(fx.conn, "test", &TransferError::Flushed);
            }
            if refuse {
                fx.nic.refuse_posts(1);
            }
        }
        let op = if read { Op::Read } else { Op::Write };
        let local = LocalDesc { region: 0, offset, len };
        let remote = RemoteDesc {
            addr: 0x9000_0000,
            len: len.saturating_add_signed(remote_len_delta),
            rkey: 9,
        };
        let mut opts = TransferOptions::default();
        opts.notify_imm = notify.then_some(5);
        let (posted_before, inflight_before) = (lone.nic.posted().len(), lone.core.inflight_len());
        let t = LoneTransfer { conn: lone.conn, op, region: REGION, local: &local, remote: &remote, opts: &opts };
        let keep = Rc::clone(&lone.keep);
        let got = lone.core.post_lone(&t, || keep);
        let expected = general_transfer(&mut general, op, local, remote, &opts);
        match (expected, got) {
            (Ok((mut p, Poll::Ready(()), 1)), Some(mut q)) if !p.queued() => {
                proptest::prop_assert_eq!(general.nic.posted(), lone.nic.posted());
                proptest::prop_assert_eq!(general.core.counters(), lone.core.counters());
                proptest::prop_assert_eq!(general.core.inflight_len(), lone.core.inflight_len());
                proptest::prop_assert_eq!(p.doorbells(), q.doorbells());
                general.nic.complete_all();
                lone.nic.complete_all();
                let (a, b) = (general.poll_noop(&mut p), lone.poll_noop(&mut q));
                proptest::prop_assert_eq!(&a, &b);
                proptest::prop_assert!(a.is_ready());
                proptest::prop_assert_eq!(p.progress(), q.progress());
                // And what follows it sees the same core (a turn's first is taken).
                let next = |fx: &mut Fx| general_transfer(fx, Op::Write, local, remote, &TransferOptions::default())
                    .map(|(p, r, n)| (p.queued(), r, n, fx.nic.posted()));
                proptest::prop_assert_eq!(next(&mut general), next(&mut lone));
            }
            (Ok((mut p, Poll::Ready(()), 1)), Some(mut q)) if p.queued() => {
                // Queued for the turn's coalesced post, as the general path queues it.
                proptest::prop_assert!(q.queued());
                proptest::prop_assert_eq!(general.nic.posted(), lone.nic.posted());
                proptest::prop_assert_eq!(general.core.counters(), lone.core.counters());
                proptest::prop_assert_eq!(general.core.inflight_len(), lone.core.inflight_len());
                // The flush posts the same requests, and the transfer ends the same.
                for fx in [&mut general, &mut lone] {
                    proptest::prop_assert!(fx.core.take_flush_request(fx.conn));
                    let _ = fx.core.flush(fx.conn, &mut Context::from_waker(Waker::noop()));
                }
                proptest::prop_assert_eq!(general.nic.posted(), lone.nic.posted());
                proptest::prop_assert_eq!(general.core.counters(), lone.core.counters());
                general.nic.complete_all();
                lone.nic.complete_all();
                let (a, b) = (general.poll_noop(&mut p), lone.poll_noop(&mut q));
                proptest::prop_assert_eq!(&a, &b);
                proptest::prop_assert_eq!(p.progress(), q.progress());
                let next = |fx: &mut Fx| general_transfer(fx, Op::Write, local, remote, &TransferOptions::default())
                    .map(|(p, r, n)| (p.queued(), r, n, fx.nic.posted()));
                proptest::prop_assert_eq!(next(&mut general), next(&mut lone));
            }
            (expected, Some(_)) => {
                proptest::prop_assert!(false, "took what the general path does not post at once or queue: {expected:?}");
            }
            (expected, None) => {
                proptest::prop_assert_eq!(lone.nic.posted().len(), posted_before);
                proptest::prop_assert_eq!(lone.core.inflight_len(), inflight_before);
                proptest::prop_assert_eq!(Rc::strong_count(&lone.keep), inflight_before + 1);
                // Untouched: the general path does on it what it did on the other.
                let again = general_transfer(&mut lone, op, local, remote, &opts);
                proptest::prop_assert_eq!(general.nic.posted(), lone.nic.posted());
                proptest::prop_assert_eq!(general.core.counters(), lone.core.counters());
                match (expected, again) {
                    (Ok((p, r, n)), Ok((q, s, m))) => {
                        proptest::prop_assert_eq!((r, n, p.queued()), (s, m, q.queued()));
                        proptest::prop_assert!(
                            r.is_pending() || n > 1,
                            "left a transfer the general path posts at once or queues"
                        );
                    }
                    (Err(e), Err(f)) => proptest::prop_assert_eq!(e.to_string(), f.to_string()),
                    (e, f) => proptest::prop_assert!(false, "{e:?} against {f:?}"),
                }
            }
        }
    }
}

/// A lone transfer of `len` bytes (`op`) offered to the core: `Some` posting if it takes it.
fn offer_lone(fx: &mut Fx, op: Op, len: u64) -> Option<Posting> {
    let local = LocalDesc {
        region: 0,
        offset: 0,
        len,
    };
    let remote = RemoteDesc {
        addr: 0x9000_0000,
        len,
        rkey: 9,
    };
    let opts = TransferOptions::default();
    let t = LoneTransfer {
        conn: fx.conn,
        op,
        region: REGION,
        local: &local,
        remote: &remote,
        opts: &opts,
    };
    let keep = Rc::clone(&fx.keep);
    fx.core.post_lone(&t, || keep)
}

/// A lone 64 B transfer (`op`) that the core takes, posted.
fn lone_64(fx: &mut Fx, op: Op) -> Posting {
    offer_lone(fx, op, 64).expect("taken")
}

#[test]
fn a_lone_transfer_whose_post_is_refused_fails_with_the_post_error_and_fails_its_connection() {
    let mut fx = Fx::new();
    fx.nic.refuse_posts(1);
    let mut p = lone_64(&mut fx, Op::Write);
    assert_eq!(p.doorbells(), 0);
    assert!(matches!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Post(_)))
    ));
    assert!(matches!(fx.core.state(fx.conn), Some(ConnState::Failed(_))));
    assert_eq!(fx.held(), 0, "the slot let its memory go");
}

#[test]
fn a_lone_transfer_that_never_completes_expires_at_its_deadline() {
    let mut fx = Fx::new();
    let mut p = lone_64(&mut fx, Op::Read);
    assert!(fx.poll_noop(&mut p).is_pending(), "waits: deadline armed");
    assert_eq!(fx.tick(TIMEOUT), 1);
    assert!(matches!(
        fx.poll_noop(&mut p),
        Poll::Ready(Err(TransferError::Timeout { .. }))
    ));
    assert_eq!(
        fx.held(),
        1,
        "the NIC may still touch it: the slot keeps it"
    );
}

#[test]
fn a_lone_transfer_the_core_leaves_to_the_general_path_does_not_count_towards_a_probe() {
    // Direct mode, as in the coalescing test above.
    let mut fx = coalescing();
    let mut first = fx.write(1);
    fx.nic.complete_all();
    fx.reap();
    assert_eq!(fx.poll_noop(&mut first), Poll::Ready(Ok(())));
    for _ in 0..rixl_proto::COALESCE_LONELY_FLUSHES {
        let mut p = fx.write(1);
        flush_and_complete(&mut fx, std::slice::from_mut(&mut p));
    }
    // Between the transfers posted at once, a lone transfer the core declines (an empty
    // descriptor): the probe still comes after COALESCE_PROBE_EVERY - 1 of them.
    for i in 1..rixl_proto::COALESCE_PROBE_EVERY {
        assert!(offer_lone(&mut fx, Op::Write, 0).is_none());
        let mut p = fx.write(1);
        assert!(!p.queued(), "transfer {i} posted at once");
        fx.nic.complete_all();
        fx.reap();
        assert_eq!(fx.poll_noop(&mut p), Poll::Ready(Ok(())));
    }
    let probe = fx.write(1);
    assert!(
        probe.queued(),
        "the probe, when it would have come without the declined ones"
    );
}

#[test]
fn a_lone_transfer_coalescing_would_queue_is_queued_and_posted_by_the_flush() {
    let mut cfg = config();
    cfg.coalesce = true;
    let mut fx = Fx::with(cfg, 16);
    let mut first = lone_64(&mut fx, Op::Write);
    assert!(!first.queued(), "the turn's first is posted at once");
    let mut second = lone_64(&mut fx, Op::Read);
    assert!(second.queued(), "a later one waits for the turn's flush");
    assert_eq!(fx.nic.posted().len(), 1);
    assert_eq!(fx.core.counters().queued, 1);
    assert!(fx.core.take_flush_request(fx.conn));
    assert!(fx
        .core
        .flush(fx.conn, &mut Context::from_waker(Waker::noop()))
        .is_ready());
    let posted = fx.nic.posted();
    assert_eq!(posted.len(), 2);
    assert_eq!(posted[1].doorbell, 2, "its own doorbell, rung by the flush");
    fx.nic.complete_all();
    assert_eq!(fx.poll_noop(&mut first), Poll::Ready(Ok(())));
    assert_eq!(fx.poll_noop(&mut second), Poll::Ready(Ok(())));
    assert_eq!(fx.core.inflight_len(), 0);
}
