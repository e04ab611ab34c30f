//! Posting a planned transfer: a slot in the in-flight table, chunks of at most `post_batch`
//! requests as send credits allow (one doorbell each), or a place in the connection's coalescing
//! queue; then the wait for its result, with its deadline armed only while it waits.

use std::task::{Context, Poll};
use std::time::Duration;

use smallvec::SmallVec;

use crate::conn::{unknown, Connection, QueuedWr};
use crate::conn::{COALESCE_MAX_WRS, COALESCE_SIGNAL_INTERVAL};

/// Requests of a coalesced batch whose bookkeeping stays on the stack (the default
/// `post_batch`).
pub const POST_BATCH_INLINE: usize = 64;
use crate::core::Core;
use crate::desc::Op;
use crate::error::{PostError, TransferError};
use crate::inflight::{InflightTable, SlotFailure, SlotId};
use crate::queue::SendQueue;
use crate::stats::{ConnId, EngineCounters, Progress, TransferOptions};
use crate::wire::{SendFlags, SendOp, Sge};

/// One transfer between [`Core::begin`] and its result. The caller owns it (in its future) and
/// hands it back to the core on every poll; if the caller goes away before the result, it calls
/// [`Core::detach`] with [`Posting::slot`] (unless [`Posting::finished`]).
#[derive(Debug)]
pub struct Posting {
    conn: ConnId,
    op: Op,
    slot: SlotId,
    notify_imm: Option<u32>,
    /// The timeout still to arm as a deadline, on the first wait: a transfer that completes
    /// without waiting never touches the deadline heap.
    timeout: Option<Duration>,
    next: usize,
    doorbells: usize,
    /// Bytes of the requests posted so far.
    bytes_posted: u64,
    /// The stream position (bytes) at the end of each signaled request posted, in order.
    signaled_at: SmallVec<[u64; 2]>,
    /// How far it got, once it ended in an error.
    progress: Progress,
    started: bool,
    posted: bool,
    queued: bool,
    finished: bool,
}

impl Posting {
    /// Its in-flight slot.
    pub fn slot(&self) -> SlotId {
        self.slot
    }

    /// Its connection.
    pub fn conn(&self) -> ConnId {
        self.conn
    }

    /// Doorbells rung for it so far (0 when it was coalesced).
    pub fn doorbells(&self) -> usize {
        self.doorbells
    }

    /// Whether posting has ended (all requests posted or queued, or posting stopped by an error).
    pub fn posted(&self) -> bool {
        self.posted
    }

    /// Whether it waits in its connection's coalescing queue (posted by [`Core::flush`]).
    pub fn queued(&self) -> bool {
        self.queued
    }

    /// Whether its result has been taken (its slot is gone).
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// How far it got, once its result was an error (see [`Progress`]).
    pub fn progress(&self) -> Progress {
        self.progress
    }

    /// Whether its deadline is armed (it has waited).
    pub fn deadline_armed(&self) -> bool {
        self.timeout.is_none()
    }

    /// A lone request's posting ([`Core::post_lone`]): posting ends with the one post that
    /// [`Self::posted_lone`] records (a refused post records none; the slot holds the error).
    pub(crate) fn lone(
        conn: ConnId,
        op: Op,
        slot: SlotId,
        opts: &TransferOptions,
        timeout: Duration,
    ) -> Posting {
        Posting {
            conn,
            op,
            slot,
            notify_imm: opts.notify_imm,
            timeout: Some(opts.timeout.unwrap_or(timeout)),
            next: 0,
            doorbells: 0,
            bytes_posted: 0,
            signaled_at: SmallVec::new(),
            progress: Progress::default(),
            started: true,
            posted: true,
            queued: false,
            finished: false,
        }
    }

    /// Marks a lone transfer queued for its connection's coalesced post.
    pub(crate) fn set_queued(&mut self) {
        self.queued = true;
    }

    /// Records a lone request of `bytes`, signaled, posted with its own doorbell.
    #[inline(always)]
    pub(crate) fn posted_lone(&mut self, bytes: u64) {
        self.next = 1;
        self.doorbells = 1;
        self.bytes_posted = bytes;
        self.signaled_at.push(bytes);
    }
}

impl<Q: SendQueue> Core<Q> {
    /// Opens an in-flight slot for a transfer on `conn` that keeps `keep` alive until the NIC is
    /// done with it.
    pub fn begin(
        &mut self,
        conn: ConnId,
        op: Op,
        keep: Q::Keep,
        opts: &TransferOptions,
    ) -> Posting {
        let slot = self.inflight.insert(conn.0, keep);
        Posting {
            conn,
            op,
            slot,
            notify_imm: opts.notify_imm,
            timeout: Some(opts.timeout.unwrap_or(self.cfg.transfer_timeout)),
            next: 0,
            doorbells: 0,
            bytes_posted: 0,
            signaled_at: SmallVec::new(),
            progress: Progress::default(),
            started: false,
            posted: false,
            queued: false,
            finished: false,
        }
    }

    /// The slot's result for `p`, recording how far `p` got when it is a failure.
    fn finish(
        p: &mut Posting,
        r: Poll<Result<(), SlotFailure>>,
    ) -> Poll<Result<(), TransferError>> {
        r.map_err(|f| {
            p.progress = if p.queued {
                Progress {
                    completed_bytes: 0,
                    posted_bytes: u64::MAX,
                }
            } else {
                Progress {
                    completed_bytes: (f.ok_signaled as usize)
                        .checked_sub(1)
                        .and_then(|i| p.signaled_at.get(i).copied())
                        .unwrap_or(0),
                    posted_bytes: p.bytes_posted,
                }
            };
            f.error
        })
    }

    /// Posts what send credits allow of `plan` for `p`. Ready once posting ended (every request
    /// posted, or queued for a coalesced post, or stopped by an error, which is then the
    /// transfer's result); Pending while it waits for credits (its deadline armed). A refused
    /// post fails the connection.
    pub fn post(
        &mut self,
        p: &mut Posting,
        plan: &crate::plan::Plan,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        if p.posted {
            return Poll::Ready(());
        }
        if !p.started {
            p.started = true;
            // A queued transfer must fit one doorbell of the flush.
            if self.cfg.coalesce
                && plan.wrs.len() <= COALESCE_MAX_WRS.min(self.cfg.post_batch.max(1) as usize)
                && !self.post_at_once(p.conn)
            {
                // Posted by the connection's flush, which ends posting for the slot.
                p.posted = true;
                let n = plan.wrs.len();
                let queued = |i: usize, wr: &crate::plan::PlannedWr| QueuedWr {
                    slot: p.slot,
                    op: request_op(p, wr.remote_addr, wr.rkey, i + 1 == n),
                    sges: match plan.sges_of(wr) {
                        [one] => smallvec::smallvec![*one],
                        more => SmallVec::from_slice(more),
                    },
                    host: plan.host,
                    last: i + 1 == n,
                    count: if i == 0 { n } else { 0 },
                };
                p.queued |= match &plan.wrs[..] {
                    // One request (most small transfers): no iterator over the plan.
                    [wr] => self.enqueue(p.conn, p.slot, [queued(0, wr)]),
                    wrs => {
                        let all = wrs.iter().enumerate().map(|(i, wr)| queued(i, wr));
                        self.enqueue(p.conn, p.slot, all)
                    }
                };
                return Poll::Ready(());
            }
        }
        let batch = self.cfg.post_batch.max(1) as usize;
        let mut err = None;
        while p.next < plan.wrs.len() {
            let free = match self.conns.get_mut(p.conn.0 as usize) {
                None => Err(unknown(p.conn.0)),
                Some(c) => c.check_ready(p.conn.0).map(|()| c.credits.available()),
            };
            let free = match free {
                Ok(0) => {
                    self.conns[p.conn.0 as usize]
                        .credit_waiters
                        .push(cx.waker().clone());
                    self.arm(p);
                    return Poll::Pending;
                }
                Ok(f) => f as usize,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            };
            let end = (p.next + free.min(batch)).min(plan.wrs.len());
            if let Err(e) = self.post_chunk(p, plan, end) {
                // The refused transfer keeps the post's error; the others on the connection
                // end flushed.
                self.inflight.fail(p.slot, e);
                self.fail_connection(p.conn, "post failed", &TransferError::Flushed);
                break;
            }
        }
        if let Some(e) = err {
            self.inflight.fail(p.slot, e);
        }
        self.inflight.end_posting(p.slot);
        p.posted = true;
        Poll::Ready(())
    }

    /// The transfer's result if it has one now, without registering a waker (so a future that
    /// reaps its own completion does not wake itself).
    pub fn try_finish(&mut self, p: &mut Posting) -> Poll<Result<(), TransferError>> {
        let r = Self::finish(p, self.inflight.poll_counted(p.slot, None));
        p.finished |= r.is_ready();
        r
    }

    /// The transfer's result, or Pending with the waker registered and the deadline armed.
    pub fn poll_finish(
        &mut self,
        p: &mut Posting,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), TransferError>> {
        let r = Self::finish(p, self.inflight.poll_counted(p.slot, Some(cx)));
        if r.is_pending() {
            self.arm(p);
        } else {
            p.finished = true;
        }
        r
    }

    fn arm(&mut self, p: &mut Posting) {
        if let Some(timeout) = p.timeout.take() {
            self.arm_deadline(p.slot, p.conn.0, timeout);
        }
    }

    /// Posts requests `p.next..end` of `plan` with one doorbell.
    fn post_chunk(
        &mut self,
        p: &mut Posting,
        plan: &crate::plan::Plan,
        end: usize,
    ) -> Result<(), TransferError> {
        let Core {
            conns,
            inflight,
            counters,
            ..
        } = self;
        let c = conns
            .get_mut(p.conn.0 as usize)
            .ok_or_else(|| unknown(p.conn.0))?;
        // What keeps the memory alive, looked up before anything is pushed (the slot is live while
        // its posting is open).
        let keep = inflight
            .keepalive(p.slot)
            .ok_or(TransferError::EngineGone)?;
        let n = end - p.next;
        let signals = c.credits.plan(n as u32);
        let last = plan.wrs.len();
        let (mut at, marks) = (p.bytes_posted, p.signaled_at.len());
        for (i, signal) in (p.next..end).zip(signals.flags()) {
            let wr = &plan.wrs[i];
            at += wr.bytes;
            if signal {
                p.signaled_at.push(at);
            }
            let op = request_op(p, wr.remote_addr, wr.rkey, i + 1 == last);
            let flags = SendFlags {
                signaled: signal,
                inline: plan.host && c.inline(&op, wr.bytes),
                ..SendFlags::default()
            };
            c.queue
                .push(p.slot.wr_id(signal), op, plan.sges_of(wr), flags);
        }
        match c.queue.post(&[keep]) {
            Ok(()) => {
                let signaled = signals.signaled();
                c.credits.commit(signals);
                inflight.add_signaled(p.slot, signaled);
                counters.work_requests += n as u64;
                counters.doorbells += 1;
                p.next = end;
                p.doorbells += 1;
                p.bytes_posted = at;
                Ok(())
            }
            // Nothing of a refused batch counts.
            Err(e) => {
                p.signaled_at.truncate(marks);
                Err(TransferError::Post(PostError::refused(e)))
            }
        }
    }

    /// Coalescing: whether a small transfer on `conn` is posted at once: the first of this
    /// progress turn with nothing queued before it, or any while the connection's flushes find
    /// no company (but for a probe now and then; see [`crate::COALESCE_LONELY_FLUSHES`]).
    fn post_at_once(&mut self, conn: ConnId) -> bool {
        let turn = self.turn;
        match self.conns.get_mut(conn.0 as usize) {
            Some(c) => c.decide_turn(turn),
            None => false,
        }
    }

    /// Queues the requests `wrs` of `slot` for `conn`'s coalesced post; whether they were
    /// queued. If the connection is unknown or not ready, ends the slot with that error instead.
    fn enqueue(
        &mut self,
        conn: ConnId,
        slot: SlotId,
        wrs: impl IntoIterator<Item = QueuedWr>,
    ) -> bool {
        let ready = match self.conns.get_mut(conn.0 as usize) {
            None => Err(unknown(conn.0)),
            Some(c) => c.check_ready(conn.0).map(|()| c.pending.extend(wrs)),
        };
        match ready {
            Ok(()) => {
                self.counters.queued += 1;
                true
            }
            Err(e) => {
                self.inflight.fail(slot, e);
                self.inflight.end_posting(slot);
                false
            }
        }
    }

    /// Whether `conn` has queued transfers and no flush scheduled yet; marks one scheduled (the
    /// caller then runs [`Core::flush`] for it, after the tasks runnable now have queued theirs).
    pub fn take_flush_request(&mut self, conn: ConnId) -> bool {
        match self.conns.get_mut(conn.0 as usize) {
            Some(c) if !c.pending.is_empty() && !c.flush_scheduled => {
                c.flush_scheduled = true;
                true
            }
            _ => false,
        }
    }

    /// Posts `conn`'s queued transfers, whole transfers per doorbell as credits allow. Ready when
    /// the queue is empty (or the connection failed: what is left ends with the error); Pending
    /// while it waits for credits.
    pub fn flush(&mut self, conn: ConnId, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            let Some(c) = self.conns.get_mut(conn.0 as usize) else {
                return Poll::Ready(());
            };
            let Some(need) = c.pending.front().map(|q| q.count.max(1)) else {
                c.flush_scheduled = false;
                c.mode.flushed();
                return Poll::Ready(());
            };
            let result = match c.check_ready(conn.0) {
                Err(e) => Err(e),
                Ok(()) if (c.credits.available() as usize) < need => {
                    c.credit_waiters.push(cx.waker().clone());
                    return Poll::Pending;
                }
                Ok(()) => {
                    let free = c.credits.available() as usize;
                    self.post_queued(conn, free)
                }
            };
            if let Err(e) = result {
                // The queued transfers keep this error; the others on the connection end
                // flushed.
                if let Some(c) = self.conns.get_mut(conn.0 as usize) {
                    c.fail_pending(&mut self.inflight, &e);
                    c.flush_scheduled = false;
                }
                if matches!(e, TransferError::Post(_)) {
                    self.fail_connection(conn, "post failed", &TransferError::Flushed);
                }
                return Poll::Ready(());
            }
        }
    }

    /// Posts whole queued transfers of `conn` that fit in `free` send-queue slots with one
    /// doorbell. Only the batch's last request and every [`COALESCE_SIGNAL_INTERVAL`]-th are
    /// signaled; a transfer whose last request is unsignaled is covered by the next signaled one.
    fn post_queued(&mut self, conn: ConnId, free: usize) -> Result<usize, TransferError> {
        let Core {
            conns,
            inflight,
            counters,
            cfg,
            ..
        } = self;
        let c = conns
            .get_mut(conn.0 as usize)
            .ok_or_else(|| unknown(conn.0))?;
        // Transfers whose futures went away before posting: drop their requests (their memory
        // may already be released).
        c.pending.retain(|q| inflight.contains(q.slot));
        let limit = free.min(cfg.post_batch.max(1) as usize);
        let (mut n, mut i) = (0, 0);
        while let Some(q) = c.pending.get(i) {
            let count = q.count.max(1);
            if n + count > limit {
                break;
            }
            n += count;
            i += count;
        }
        if n == 0 {
            return Ok(0);
        }
        let signals = c.credits.plan_every(n as u32, COALESCE_SIGNAL_INTERVAL);
        // A batch of up to the default `post_batch` keeps its lists on the stack (they grew on
        // the heap, several allocations per doorbell, from 8 entries).
        let mut keeps: SmallVec<[&Q::Keep; POST_BATCH_INLINE]> = SmallVec::new();
        let mut last_slot = None;
        for (q, signal) in c.pending.iter().take(n).zip(signals.flags()) {
            let bytes: u64 = q.sges.iter().map(|g| u64::from(g.length)).sum();
            let flags = SendFlags {
                signaled: signal,
                inline: q.host && c.inline(&q.op, bytes),
                ..SendFlags::default()
            };
            c.queue.push(q.slot.wr_id(signal), q.op, &q.sges, flags);
            if last_slot != Some(q.slot) {
                last_slot = Some(q.slot);
                keeps.extend(inflight.keepalive(q.slot));
            }
        }
        if let Err(e) = c.queue.post(&keeps) {
            return Err(TransferError::Post(PostError::refused(e)));
        }
        drop(keeps);
        c.credits.commit(signals);
        // Transfers whose last request is unsignaled complete with the next signaled request
        // (the batch's last request is always signaled).
        let mut uncovered: SmallVec<[SlotId; 8]> = SmallVec::new();
        let mut finished: SmallVec<[SlotId; POST_BATCH_INLINE]> = SmallVec::new();
        for (q, signal) in c.pending.drain(..n).zip(signals.flags()) {
            if signal {
                inflight.add_signaled(q.slot, 1);
                for a in uncovered.drain(..) {
                    inflight.cover(q.slot, a);
                }
            } else if q.last {
                uncovered.push(q.slot);
            }
            if q.last {
                finished.push(q.slot);
            }
        }
        c.mode.round = c.mode.round.saturating_add(finished.len() as u32);
        for s in finished {
            inflight.finish_posting(s);
        }
        counters.work_requests += n as u64;
        counters.doorbells += 1;
        Ok(n)
    }

    /// Coalescing for a message (a SEND of one request): whether it is queued for the
    /// connection's coalesced post ([`Core::queue_message`]), as [`Core::post`] queues a small
    /// transfer, rather than posted at once with [`Core::post_single`] (coalescing off, the
    /// first of its turn, or a connection whose flushes find no company). Counts as the
    /// decision for one message.
    pub fn queues_message(&mut self, conn: ConnId) -> bool {
        self.cfg.coalesce && !self.post_at_once(conn)
    }

    /// Queues a message for `conn`'s coalesced post in a new slot keeping `keep` (after
    /// [`Core::queues_message`] said so). The connection's flush ([`Core::take_flush_request`],
    /// [`Core::flush`]) posts it, in order with what was queued before it. A connection that
    /// is not ready fails the slot with its error. (Out of line: the message posted at once
    /// is the latency path, and it stays as small as before.)
    #[inline(never)]
    pub fn queue_message(
        &mut self,
        conn: ConnId,
        op: SendOp,
        sge: Sge,
        host: bool,
        keep: Q::Keep,
    ) -> Posting {
        let mut p = self.begin(conn, op_kind(op), keep, &TransferOptions::default());
        p.started = true;
        p.posted = true;
        p.queued |= self.enqueue(conn, p.slot, [QueuedWr::single(p.slot, op, sge, host)]);
        p
    }

    /// Posts one signaled request (a SEND) in a new slot keeping `keep`; the caller made sure
    /// `conn` has a credit ([`Core::poll_credits`]). `host`: `sge` is host memory (a small one is
    /// then posted inline). A refused post is the result.
    pub fn post_single(
        &mut self,
        conn: ConnId,
        op: SendOp,
        sge: Sge,
        host: bool,
        keep: Q::Keep,
    ) -> Posting {
        let inline = host
            && self
                .conns
                .get(conn.0 as usize)
                .is_some_and(|c| c.inline(&op, u64::from(sge.length)));
        let flags = SendFlags {
            inline,
            ..SendFlags::SIGNALED
        };
        // One request with its own doorbell, built by the queue directly.
        self.post_signaled(conn, op_kind(op), keep, |q, wr_id, keep| {
            q.post_one(wr_id, op, sge, flags, keep)
        })
    }

    /// Posts one signaled request that `post` builds on the queue (a SEND, or a request the
    /// core has no operation for, such as a memory-window bind) under the `wr_id` of a new
    /// slot keeping `keep`, accounted like any other: one send credit, completion routed to
    /// the slot. `post` pushes (and the core rings the doorbell), or posts by itself and
    /// pushes nothing.
    /// The caller made sure `conn` has a credit ([`Core::poll_credits`]). A refused post is the
    /// result.
    pub fn post_control(
        &mut self,
        conn: ConnId,
        op: Op,
        keep: Q::Keep,
        post: impl FnOnce(&mut Q, u64) -> Result<(), Q::Error>,
    ) -> Posting {
        self.post_signaled(conn, op, keep, |q, wr_id, keep| {
            post(q, wr_id)?;
            q.post(&[keep])
        })
    }

    /// [`Core::post_control`] with `post` ringing the doorbell itself (given what the slot
    /// keeps alive).
    fn post_signaled(
        &mut self,
        conn: ConnId,
        op: Op,
        keep: Q::Keep,
        post: impl FnOnce(&mut Q, u64, &Q::Keep) -> Result<(), Q::Error>,
    ) -> Posting {
        let mut p = self.begin(conn, op, keep, &TransferOptions::default());
        p.started = true;
        p.posted = true;
        let posted = match self.conns.get_mut(conn.0 as usize) {
            None => Err(unknown(conn.0)),
            Some(c) => post_one_signaled(c, &mut self.inflight, &mut self.counters, p.slot, post),
        };
        if let Err(e) = posted {
            self.inflight.fail(p.slot, e);
        }
        self.inflight.end_posting(p.slot);
        p
    }
}

/// Posts the one signaled request of `slot` on `c` with a doorbell of its own (`post` builds and
/// rings it under the slot's request id, given what the slot keeps alive) and accounts for it:
/// one send credit, one signaled request outstanding, one request and one doorbell counted.
/// Nothing counts if the post is refused. Inlined: it is the latency path's post.
#[inline(always)]
pub(crate) fn post_one_signaled<Q: SendQueue>(
    c: &mut Connection<Q>,
    inflight: &mut InflightTable<Q::Keep>,
    counters: &mut EngineCounters,
    slot: SlotId,
    post: impl FnOnce(&mut Q, u64, &Q::Keep) -> Result<(), Q::Error>,
) -> Result<(), TransferError> {
    // The slot is live: its caller opened it just before.
    let Some(keep) = inflight.keepalive(slot) else {
        return Err(TransferError::EngineGone);
    };
    post(&mut c.queue, slot.wr_id(true), keep)
        .map_err(|e| TransferError::Post(PostError::refused(e)))?;
    c.credits.commit_one_signaled();
    inflight.add_signaled(slot, 1);
    counters.work_requests += 1;
    counters.doorbells += 1;
    Ok(())
}

/// The operation of a transfer's request: its last one carries the notification, if any.
pub(crate) fn request_op(p: &Posting, remote_addr: u64, rkey: u32, last: bool) -> SendOp {
    match (p.op, p.notify_imm) {
        (Op::Write, Some(imm)) if last => SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        },
        (Op::Write, _) => SendOp::Write { remote_addr, rkey },
        (Op::Read, _) => SendOp::Read { remote_addr, rkey },
    }
}

/// The transfer direction a single request's slot is filed under (only READ reads remotely).
fn op_kind(op: SendOp) -> Op {
    match op {
        SendOp::Read { .. } => Op::Read,
        _ => Op::Write,
    }
}
