//! The transfer core of one engine: connections, the in-flight table, deadlines and counters,
//! and the routing of completions. Posting lives in [`crate::posting`].
//!
//! Nothing here waits or does I/O: the glue (`rixl-runtime`) polls the core from its futures and
//! its progress loop, and the core drives queue pairs through [`SendQueue`].

use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use slab::Slab;

use crate::conn::{unknown, ConnParams, ConnState, Connection};
use crate::deadline::{Deadlines, Due};
use crate::desc::{LocalDesc, Op, RegionInfo, RemoteDesc};
use crate::error::{PostError, TransferError};
use crate::inflight::{decode_wr_id, InflightTable, Routed, SlotId};
use crate::plan::{self, Limits, Plan};
use crate::queue::{CompletionSource, SendQueue};
use crate::stats::{ConnId, EngineCounters};
use crate::wire::Completion;

/// Receive work requests carry this bit (send requests never do: their generation has 30 bits).
pub const RECV_BIT: u64 = 1 << 62;

/// The `wr_id` of receive buffer `index` of connection `conn`.
pub fn recv_wr_id(conn: u32, index: u32) -> u64 {
    RECV_BIT | (u64::from(conn) << 16) | u64::from(index)
}

/// Plans kept for reuse.
const KEPT_PLANS: usize = 8;
/// A plan with more requests or entries than this (a huge descriptor list) is dropped, not kept.
const KEPT_PLAN_ENTRIES: usize = 4096;

/// How the core posts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CoreConfig {
    /// Most work requests posted with one doorbell.
    pub post_batch: u32,
    /// Signal at least every this many work requests (and the last of every batch).
    pub signal_interval: u32,
    /// Coalesce small transfers (on by default): the first transfer of at most
    /// [`crate::COALESCE_MAX_WRS`] requests in a progress turn on a connection is posted at
    /// once, those that follow it in the same turn are queued and posted together by a flush
    /// ([`Core::flush`]). A connection whose flushes keep finding a single transfer (a task
    /// that posts, awaits and posts again, so nothing joins it) learns to post at once, and
    /// probes now and then whether concurrent transfers would join
    /// ([`crate::COALESCE_LONELY_FLUSHES`], [`crate::COALESCE_PROBE_EVERY`]).
    pub coalesce: bool,
    /// Scatter/gather entries a READ may use (the device's `max_sge_rd`).
    pub max_sge_rd: u32,
    /// Default deadline of a transfer.
    pub transfer_timeout: Duration,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            post_batch: 64,
            signal_interval: 32,
            coalesce: true,
            max_sge_rd: 16,
            transfer_timeout: Duration::from_secs(30),
        }
    }
}

/// A connection's queue-pair number, for routing completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct QpRoute {
    qpn: u32,
    conn: u32,
}

/// What the progress loop needs to know to decide whether to keep polling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    /// Nothing awaits a completion.
    pub idle: bool,
    /// A future waits for a message on a live connection.
    pub waiting_recv: bool,
}

/// One engine's transfer state machine over queues of type `Q`.
pub struct Core<Q: SendQueue> {
    // Field order matters: queue pairs are dropped before the in-flight keep-alives release
    // their memory, so the NIC never touches deregistered memory.
    pub(crate) conns: Slab<Connection<Q>>,
    pub(crate) inflight: InflightTable<Q::Keep>,
    /// A linear scan beats hashing for the few queue pairs of one engine.
    routes: Vec<QpRoute>,
    pub(crate) deadlines: Deadlines,
    pub(crate) counters: EngineCounters,
    pub(crate) cfg: CoreConfig,
    /// Progress turns so far (coalescing: a transfer posted at once is the first of its turn).
    pub(crate) turn: u64,
    epochs: u64,
    plans: Vec<Plan>,
}

impl<Q: SendQueue> std::fmt::Debug for Core<Q> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("connections", &self.conns.len())
            .field("inflight", &self.inflight.len())
            .field("counters", &self.counters)
            .finish()
    }
}

impl<Q: SendQueue> Core<Q> {
    /// An empty core.
    pub fn new(cfg: CoreConfig) -> Self {
        Core {
            conns: Slab::new(),
            inflight: InflightTable::new(),
            routes: Vec::new(),
            deadlines: Deadlines::default(),
            counters: EngineCounters::default(),
            cfg,
            turn: 1,
            epochs: 0,
            plans: Vec::new(),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> EngineCounters {
        self.counters
    }

    /// The counters, for the glue's own events (polls, parks, event waits).
    pub fn counters_mut(&mut self) -> &mut EngineCounters {
        &mut self.counters
    }

    /// Live in-flight slots (including detached ones the NIC has not finished).
    pub fn inflight_len(&self) -> usize {
        self.inflight.len()
    }

    /// Armed deadline entries (including lazily dropped ones).
    pub fn deadlines_len(&self) -> usize {
        self.deadlines.len()
    }

    /// Number of connections.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// The ids of all connections.
    pub fn connection_ids(&self) -> Vec<ConnId> {
        self.conns.iter().map(|(k, _)| ConnId(k as u32)).collect()
    }

    /// The id the next [`Core::add_connection`] returns (receive `wr_id`s encode it).
    pub fn next_conn_id(&self) -> ConnId {
        ConnId(u32::try_from(self.conns.vacant_key()).unwrap_or(u32::MAX))
    }

    /// Adds a connection over `queue` (its receives already posted), in [`ConnState::Prepared`].
    pub fn add_connection(&mut self, queue: Q, params: ConnParams) -> ConnId {
        self.epochs += 1;
        let qpn = queue.qpn();
        let conn = Connection::new(self.epochs, queue, params, self.cfg.signal_interval);
        let id = u32::try_from(self.conns.insert(conn)).unwrap_or(u32::MAX);
        self.routes.push(QpRoute { qpn, conn: id });
        ConnId(id)
    }

    /// The connection whose queue pair is number `qpn`.
    pub fn conn_of_qpn(&self, qpn: u32) -> Option<ConnId> {
        self.routes
            .iter()
            .find(|r| r.qpn == qpn)
            .map(|r| ConnId(r.conn))
    }

    /// Its queue.
    pub fn queue(&self, conn: ConnId) -> Option<&Q> {
        self.conns.get(conn.0 as usize).map(|c| &c.queue)
    }

    /// Its state.
    pub fn state(&self, conn: ConnId) -> Option<&ConnState> {
        self.conns.get(conn.0 as usize).map(|c| &c.state)
    }

    /// Its epoch (unique per core).
    pub fn epoch(&self, conn: ConnId) -> Option<u64> {
        self.conns.get(conn.0 as usize).map(|c| c.epoch)
    }

    /// The peer's endpoint was applied: transfers of at most `max_msg` bytes per request may be
    /// posted. Returns whether the connection exists.
    pub fn connected(&mut self, conn: ConnId, max_msg: u64) -> bool {
        match self.conns.get_mut(conn.0 as usize) {
            Some(c) => {
                c.state = ConnState::Ready;
                c.max_msg = max_msg;
                true
            }
            None => false,
        }
    }

    /// Fails a connection: its queue pair moves to error (the NIC flushes what is outstanding),
    /// every live transfer on it ends with `err` (or its own earlier error) once its work is
    /// flushed, and everything waiting on it wakes.
    pub fn fail_connection(&mut self, conn: ConnId, reason: &str, err: &TransferError) {
        let Some(c) = self.conns.get_mut(conn.0 as usize) else {
            return;
        };
        if let ConnState::Failed(_) = c.state {
            return;
        }
        c.state = ConnState::Failed(reason.to_string());
        if let Err(e) = c.queue.set_error() {
            tracing::warn!(conn = conn.0, error = %e, "moving the queue pair to error failed");
        }
        let waiters = c.take_waiters();
        self.inflight.fail_connection(conn.0, err);
        for w in waiters {
            w.wake();
        }
    }

    /// Removes a connection once nothing of it is in flight (queued transfers end with
    /// `Connection(.., "closed")`) and returns its queue.
    pub fn remove_connection(&mut self, conn: ConnId) -> Option<Q> {
        let c = self.conns.get_mut(conn.0 as usize)?;
        let err = TransferError::Connection(conn.0, "closed".into());
        c.fail_pending(&mut self.inflight, &err);
        let c = self.conns.remove(conn.0 as usize);
        self.routes.retain(|r| r.conn != conn.0);
        Some(c.queue)
    }

    /// Ready once no work request of `conn` awaits completion (or it is gone).
    pub fn poll_idle(&mut self, conn: ConnId, cx: &mut Context<'_>) -> Poll<()> {
        match self.conns.get_mut(conn.0 as usize) {
            Some(c) if !c.credits.is_idle() => {
                // A close polled again (an engine closing all its connections at once polls
                // every close at each wake) registers its waker once.
                if !c.credit_waiters.iter().any(|w| w.will_wake(cx.waker())) {
                    c.credit_waiters.push(cx.waker().clone());
                }
                Poll::Pending
            }
            _ => Poll::Ready(()),
        }
    }

    /// Ready with the free send-queue slots once `conn` has at least `k` (or with its error).
    pub fn poll_credits(
        &mut self,
        conn: ConnId,
        k: u32,
        cx: &mut Context<'_>,
    ) -> Poll<Result<u32, TransferError>> {
        let Some(c) = self.conns.get_mut(conn.0 as usize) else {
            return Poll::Ready(Err(unknown(conn.0)));
        };
        if let Err(e) = c.check_ready(conn.0) {
            return Poll::Ready(Err(e));
        }
        let free = c.credits.available();
        if free >= k.max(1) {
            Poll::Ready(Ok(free))
        } else {
            c.credit_waiters.push(cx.waker().clone());
            Poll::Pending
        }
    }

    /// Checks `conn` and a transfer's lists (`regions` are the local list's regions, already
    /// checked to be this engine's) and plans it into `plan`. Returns the connection's epoch.
    ///
    /// # Errors
    /// An unknown or failed connection, a notification on a READ, or an invalid descriptor.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_transfer(
        &self,
        conn: ConnId,
        op: Op,
        regions: &[RegionInfo],
        local: &[LocalDesc],
        remote: &[RemoteDesc],
        notify_imm: bool,
        plan: &mut Plan,
    ) -> Result<u64, TransferError> {
        check_notify(op, notify_imm)?;
        let c = self.live(conn)?;
        let limits = Limits {
            max_sge: match op {
                Op::Write => c.max_send_sge,
                Op::Read => c.max_send_sge.min(self.cfg.max_sge_rd.max(1)),
            },
            max_msg: c.max_msg,
        };
        plan::plan_into(plan, regions, local, remote, limits)?;
        Ok(c.epoch)
    }

    /// [`Core::plan_transfer`] for one descriptor a side that is valid and fits one request
    /// (most small transfers), without the general validation and walk; the same plan and
    /// epoch. `None` for anything else, without a reason: the caller then plans it with
    /// [`Core::plan_transfer`], which names the error or splits the transfer.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_single(
        &self,
        conn: ConnId,
        op: Op,
        region: &RegionInfo,
        local: &LocalDesc,
        remote: &RemoteDesc,
        notify_imm: bool,
        plan: &mut Plan,
    ) -> Option<u64> {
        if notify_imm && op == Op::Read {
            return None;
        }
        let c = self.conns.get(conn.0 as usize)?;
        if matches!(c.state, ConnState::Failed(_)) {
            return None;
        }
        if !fits_one_request(c.max_msg, region, local, remote) {
            return None;
        }
        plan::single_into(plan, region, local, remote);
        Some(c.epoch)
    }

    /// The checks of a transfer that come before its descriptors': a notification needs a WRITE,
    /// and `conn` must exist and not have failed.
    ///
    /// # Errors
    /// [`TransferError::Post`] for a notification on a READ, [`TransferError::Connection`].
    pub fn check_transfer(
        &self,
        conn: ConnId,
        op: Op,
        notify_imm: bool,
    ) -> Result<(), TransferError> {
        check_notify(op, notify_imm)?;
        self.live(conn).map(|_| ())
    }

    /// Checks that `conn` is live and still the connection of `epoch` (a prepared transfer's).
    ///
    /// # Errors
    /// [`TransferError::Connection`] if it is unknown, failed, or another connection now.
    pub fn check_epoch(
        &self,
        conn: ConnId,
        epoch: u64,
        op: Op,
        notify_imm: bool,
    ) -> Result<(), TransferError> {
        check_notify(op, notify_imm)?;
        if self.live(conn)?.epoch != epoch {
            return Err(TransferError::Connection(
                conn.0,
                "prepared for a connection that is gone".into(),
            ));
        }
        Ok(())
    }

    fn live(&self, conn: ConnId) -> Result<&Connection<Q>, TransferError> {
        let c = self
            .conns
            .get(conn.0 as usize)
            .ok_or_else(|| unknown(conn.0))?;
        c.check_live(conn.0)?;
        Ok(c)
    }

    /// A plan to fill (a kept one when there is one, so a transfer allocates no request list).
    pub fn take_plan(&mut self) -> Plan {
        self.plans.pop().unwrap_or_default()
    }

    /// Keeps `plan`'s allocations for the next transfer.
    pub fn recycle_plan(&mut self, plan: Plan) {
        if self.plans.len() < KEPT_PLANS
            && plan.wrs.capacity() <= KEPT_PLAN_ENTRIES
            && plan.sges.capacity() <= KEPT_PLAN_ENTRIES
        {
            self.plans.push(plan);
        }
    }

    /// The transfer of `slot` went away before taking its result: it stops posting, and its slot
    /// (and keep-alive) is released once the NIC is done. Returns whether it was released now.
    pub fn detach(&mut self, slot: SlotId) -> bool {
        self.counters.transfers_abandoned += 1;
        self.inflight.detach(slot)
    }

    /// Whether `slot` is still live.
    pub fn contains(&self, slot: SlotId) -> bool {
        self.inflight.contains(slot)
    }

    /// Counts a finished transfer.
    pub fn count_result(&mut self, ok: bool) {
        if ok {
            self.counters.transfers_ok += 1;
        } else {
            self.counters.transfers_failed += 1;
        }
    }

    /// Starts a progress turn (coalescing counts turns); returns its number.
    pub fn next_turn(&mut self) -> u64 {
        self.turn += 1;
        self.turn
    }

    /// The loop is about to park (nothing awaits a completion): the armed deadlines are dropped
    /// when no transfer is in flight at all.
    pub fn on_park(&mut self) {
        if self.inflight.is_empty() {
            self.deadlines.clear();
        }
    }

    /// Whether a signaled request is outstanding: a completion the CQ has still to deliver
    /// (O(1), unlike [`Core::activity`], which looks at every connection).
    pub fn awaits_completion(&self) -> bool {
        self.inflight.signaled_outstanding() > 0
    }

    /// Whether anything awaits a completion or a message.
    pub fn activity(&self) -> Activity {
        let mut idle = !self.awaits_completion();
        let mut waiting_recv = false;
        for (_, c) in self.conns.iter() {
            idle &= c.credits.is_idle();
            waiting_recv |= c.inbox_waiter.is_some() && c.state == ConnState::Ready;
        }
        Activity { idle, waiting_recv }
    }

    /// Expires every waiting transfer whose deadline passed at `now`: it ends with
    /// [`TransferError::Timeout`], and its connection is failed so the NIC flushes the work (the
    /// slot keeps the memory until then). Returns how many expired. The deadlines armed since
    /// the last call start at `now` (see [`Deadlines`](crate::deadline::Deadlines)).
    pub fn expire(&mut self, now: Instant) -> usize {
        let mut expired = 0;
        loop {
            let inflight = &self.inflight;
            let d = match self.deadlines.pop_due(now, |s| inflight.contains(s)) {
                Due::Passed(d) => d,
                Due::None => return expired,
            };
            let waited = self.inflight.waiting_on(d.slot);
            if !self
                .inflight
                .expire(d.slot, TransferError::Timeout(d.timeout))
            {
                continue;
            }
            expired += 1;
            let c = self.conns.get(d.conn as usize);
            tracing::warn!(
                conn = d.conn,
                timeout = ?d.timeout,
                waited = ?waited,
                queued = c.map(|c| c.pending.len()),
                flush_scheduled = c.map(|c| c.flush_scheduled),
                send_credits = c.map(|c| c.credits.available()),
                "transfer timed out; failing its connection"
            );
            self.fail_connection(
                ConnId(d.conn),
                "transfer timed out",
                &TransferError::Flushed,
            );
        }
    }

    /// Arms `timeout` for `slot` (its future is about to wait).
    pub(crate) fn arm_deadline(&mut self, slot: SlotId, conn: u32, timeout: Duration) {
        let inflight = &self.inflight;
        self.deadlines
            .arm(slot, conn, timeout, inflight.len(), |s| {
                inflight.contains(s)
            });
    }

    /// Polls `cq` once into `buf` and routes what it returned; returns how many.
    pub fn reap(&mut self, cq: &mut impl CompletionSource, buf: &mut [Completion]) -> usize {
        let n = cq.poll(buf);
        self.route_all(&buf[..n]);
        n
    }

    /// Counts and routes the completions of one poll (none: nothing happens).
    pub fn route_all(&mut self, wcs: &[Completion]) {
        if wcs.is_empty() {
            return;
        }
        self.counters.polls += 1;
        self.counters.completions += wcs.len() as u64;
        for wc in wcs {
            self.route(wc);
        }
    }

    /// Routes one completion: frees credits, fails the connection on an error, and counts the
    /// transfer's work (waking its future when it finished).
    pub fn route(&mut self, wc: &Completion) {
        if wc.wr_id & RECV_BIT != 0 {
            self.route_recv(wc);
            return;
        }
        let signaled = decode_wr_id(wc.wr_id).2;
        let status = if wc.is_success() {
            Ok(())
        } else {
            Err(TransferError::from_status(wc.status))
        };
        let conn = self
            .routes
            .iter()
            .find(|r| r.qpn == wc.qp_num)
            .map(|r| r.conn);
        // Wakers are woken where they are found: a wake only schedules its task (nothing runs
        // inside it that could reach this core), and collecting them first cost a list built,
        // drained and dropped per completion on the latency path.
        let mut failed = None;
        if let Some(c) = conn.and_then(|k| self.conns.get_mut(k as usize)) {
            if signaled {
                c.credits.on_signaled_completion();
                if !c.credit_waiters.is_empty() {
                    c.credit_waiters.drain(..).for_each(std::task::Waker::wake);
                }
            }
            if !wc.is_success() && c.state == ConnState::Ready {
                c.state = ConnState::Failed(wc.status.to_string());
                c.take_waiters()
                    .into_iter()
                    .for_each(std::task::Waker::wake);
                failed = conn;
            }
        }
        if self.inflight.on_completion(wc.wr_id, status) == Routed::Stale {
            self.counters.stale_completions += 1;
            tracing::debug!(wr_id = wc.wr_id, "completion for a released slot ignored");
        }
        if let Some(conn) = failed {
            tracing::warn!(conn, status = %wc.status, "connection failed by an error completion");
            self.inflight.fail_connection(conn, &TransferError::Flushed);
        }
    }
}

/// Whether one local descriptor (in the list's first region, `region`) and one remote one are
/// valid together and fit one request on a connection of `max_msg`-byte messages.
#[inline(always)]
pub(crate) fn fits_one_request(
    max_msg: u64,
    region: &RegionInfo,
    local: &LocalDesc,
    remote: &RemoteDesc,
) -> bool {
    let len = local.len;
    len > 0
        && local.region == 0
        && remote.len == len
        && len <= max_msg.clamp(1, u64::from(u32::MAX))
        && local
            .offset
            .checked_add(len)
            .is_some_and(|end| end <= region.len)
        && remote.addr.checked_add(len).is_some()
}

/// A WRITE_WITH_IMM notification needs a WRITE.
fn check_notify(op: Op, notify_imm: bool) -> Result<(), TransferError> {
    if notify_imm && op == Op::Read {
        return Err(TransferError::Post(PostError::NotifyOnRead));
    }
    Ok(())
}
