//! Transfers as futures: READ/WRITE (planned each time or prepared once), SEND and receive. Each
//! future owns its [`Posting`] and polls the core with it; a [`SlotGuard`] detaches the slot if
//! the future goes away first, so the in-flight table, not the future, keeps memory alive.

use std::future::poll_fn;
use std::rc::Rc;
use std::task::Poll;
use std::time::{Duration, Instant};

use rixl_proto::RemoteDesc;
use rixl_proto::{ConnId, LocalDesc, LoneTransfer, Op, Plan, Posting, RegionInfo};
use rixl_proto::{DescriptorRanges, TransferFailure, TransferOptions, TransferStats};
use smallvec::SmallVec;
use tracing::Instrument;

use super::nic::KeepAlive;
use super::wait::{reap_until, wait_slot, SlotGuard};
use super::{Engine, Inner};
use crate::desc::{LocalDescList, Region, RemoteDescList};
use crate::error::{InvalidDescriptor, TransferError};
use crate::probe::{self, Point};

/// Posts (or queues) the [`LoneTransfer`] `$lone` through the core's lone path, keeping `$region`
/// (its local region) registered in the new slot, and schedules what follows: the connection's
/// flush for the first transfer queued in a turn, else the progress task's wake-up for one
/// posted at once. Then returns `$body` (the caller's result, evaluated with the [`Posting`]
/// bound to `$posting`) from the calling function; when the core declines the transfer nothing
/// happens and the caller goes on to the general path.
///
/// A macro, not a function, because it is the latency path of both a transfer and a prepared
/// transfer's post: as an `#[inline(always)]` function returning the posting it cost a 64 B
/// WRITE's hop 65-95 instructions more (icount of a `write_lat` server), where this expands to
/// the code the transfer had before it was shared.
macro_rules! lone_posted {
    ($inner:expr, $lone:expr, $region:expr, $span:expr, $posting:ident => $body:block) => {
        let keep = || KeepAlive {
            regions: smallvec::smallvec![$region.clone()],
            _message: None,
        };
        probe::stamp(Point::SlotOpened);
        let posting = $inner.core.borrow_mut().post_lone(&$lone, keep);
        probe::stamp(Point::Posted);
        // A queued one asks for its connection's flush (only the first of a turn gets it).
        let flush = posting.as_ref().is_some_and(Posting::queued)
            && $inner.core.borrow_mut().take_flush_request($lone.conn);
        if let Some($posting) = posting {
            if let Some(span) = $span {
                span.record("bytes", $lone.local.len);
                span.record("wrs", 1);
            }
            if flush {
                spawn_flush($inner, $lone.conn);
            } else if !$posting.queued() {
                $inner.kick_progress();
            }
            return $body;
        }
    };
}

/// A READ or WRITE checked and planned once and posted any number of times with
/// [`Engine::post`] (NIXL's prepared transfer request): a weight broadcast or a fixed KV layout
/// re-sent every step skips validation and planning on every post after the first.
///
/// It keeps its local regions registered while it lives, and it is bound to the connection it was
/// prepared for: after that connection fails or is closed, posting it gives
/// [`TransferError::Connection`]. Like a transfer future, a `post` future may be dropped or
/// forgotten at any point; its in-flight slot keeps the regions registered until the NIC is done.
pub struct PreparedTransfer {
    engine: u64,
    conn: ConnId,
    epoch: u64,
    op: Op,
    plan: Plan,
    regions: SmallVec<[Region; 2]>,
    descriptors: usize,
    /// The local descriptors' lengths, to name the ones a failed post did not complete.
    lens: Box<[u64]>,
    /// One descriptor a side in one region, fitting one request: posted as a lone transfer.
    lone: Option<LoneShape>,
}

/// What the core's lone path takes of a prepared transfer of one descriptor a side.
#[derive(Debug, Clone, Copy)]
struct LoneShape {
    region: RegionInfo,
    local: LocalDesc,
    remote: RemoteDesc,
}

impl PreparedTransfer {
    /// The connection it is posted on.
    pub fn conn(&self) -> ConnId {
        self.conn
    }

    /// READ or WRITE.
    pub fn op(&self) -> Op {
        self.op
    }

    /// Bytes each post moves.
    pub fn bytes(&self) -> u64 {
        self.plan.bytes
    }

    /// Local descriptors it moves.
    pub fn descriptors(&self) -> usize {
        self.descriptors
    }

    /// Work requests each post takes (after merging adjacent descriptors).
    pub fn work_requests(&self) -> usize {
        self.plan.wrs.len()
    }
}

impl std::fmt::Debug for PreparedTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedTransfer")
            .field("conn", &self.conn.0)
            .field("op", &self.op)
            .field("bytes", &self.plan.bytes)
            .field("work_requests", &self.plan.wrs.len())
            .field("descriptors", &self.descriptors)
            .finish()
    }
}

impl Engine {
    /// RDMA WRITE of `local` to `remote` on `conn`.
    ///
    /// # Errors
    /// See [`TransferError`].
    pub async fn write(
        &self,
        conn: ConnId,
        local: &LocalDescList,
        remote: &RemoteDescList,
    ) -> Result<TransferStats, TransferError> {
        self.transfer(conn, Op::Write, local, remote, TransferOptions::default())
            .await
    }

    /// RDMA READ of `remote` into `local` on `conn`.
    ///
    /// # Errors
    /// See [`TransferError`].
    pub async fn read(
        &self,
        conn: ConnId,
        local: &LocalDescList,
        remote: &RemoteDescList,
    ) -> Result<TransferStats, TransferError> {
        self.transfer(conn, Op::Read, local, remote, TransferOptions::default())
            .await
    }

    /// A READ or WRITE with options. The returned future may be dropped or forgotten at any
    /// point: the in-flight slot keeps the regions registered until the NIC is done.
    ///
    /// # Errors
    /// See [`TransferError`].
    pub async fn transfer(
        &self,
        conn: ConnId,
        op: Op,
        local: &LocalDescList,
        remote: &RemoteDescList,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferError> {
        self.transfer_ranges(conn, op, local, remote, opts)
            .await
            .map_err(|f| f.error)
    }

    /// [`Engine::transfer`], with a failure naming which descriptors completed, failed, or
    /// were never posted (a failure before posting names none posted).
    ///
    /// # Errors
    /// See [`TransferFailure`].
    pub async fn transfer_ranges(
        &self,
        conn: ConnId,
        op: Op,
        local: &LocalDescList,
        remote: &RemoteDescList,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferFailure> {
        probe::stamp(Point::Entry);
        let inner = &self.inner;
        // No subscriber takes debug spans or events (the usual case): no span made, entered or
        // dropped, and no event checked after the result (one load of the global level here).
        if !tracing::level_enabled!(tracing::Level::DEBUG) {
            let result = transfer_inner(inner, conn, op, local, remote, opts, None).await;
            inner.core.borrow_mut().count_result(result.is_ok());
            return result;
        }
        let span = tracing::debug_span!(
            "transfer",
            engine = self.inner.id,
            conn = conn.0,
            ?op,
            descriptors = local.len(),
            bytes = tracing::field::Empty,
            wrs = tracing::field::Empty
        );
        // Without a debug subscriber the span is disabled: no `Instrumented` layer (a span
        // entered and left on every poll, and one more future to move) around the transfer.
        // (Each branch makes its future where it awaits it: a future bound first is moved,
        // several hundred bytes, when it is awaited.)
        let result = if span.is_disabled() {
            transfer_inner(inner, conn, op, local, remote, opts, None).await
        } else {
            transfer_inner(inner, conn, op, local, remote, opts, Some(&span))
                .instrument(span.clone())
                .await
        };
        match &result {
            Ok(st) => {
                tracing::debug!(parent: &span, total_us = st.total.as_micros() as u64, post_us = st.post.as_micros() as u64, "transfer complete")
            }
            Err(e) => tracing::debug!(parent: &span, error = %e, "transfer failed"),
        }
        inner.core.borrow_mut().count_result(result.is_ok());
        result
    }

    /// Checks and plans a READ or WRITE once, for [`Engine::post`] to post it any number of
    /// times (see [`PreparedTransfer`]).
    ///
    /// # Errors
    /// The checks of [`Engine::transfer`]: an unknown or failed connection, unregistered or
    /// foreign regions, descriptors out of range or of mismatched lengths.
    pub fn prepare(
        &self,
        conn: ConnId,
        op: Op,
        local: &LocalDescList,
        remote: &RemoteDescList,
    ) -> Result<PreparedTransfer, TransferError> {
        let mut plan = Plan::default();
        let epoch = check_and_plan(&self.inner, conn, op, local, remote, false, &mut plan)?;
        // Checked and planned as one request: each post can take the lone path (the core
        // checks the connection and the fit again, and declines anything else).
        let lone = one_each(&self.inner, local, remote)
            .filter(|_| plan.wrs.len() == 1)
            .map(|(_, region, d, rd)| LoneShape {
                region,
                local: *d,
                remote: *rd,
            });
        Ok(PreparedTransfer {
            engine: self.inner.id,
            conn,
            epoch,
            op,
            plan,
            regions: local.regions().iter().cloned().collect(),
            descriptors: local.len(),
            lens: local.descs().iter().map(|d| d.len).collect(),
            lone,
        })
    }

    /// Posts a prepared transfer once more and waits for it, like [`Engine::transfer`] with the
    /// descriptors it was prepared from.
    ///
    /// # Errors
    /// [`TransferError::Connection`] if its connection failed or is not the one it was prepared
    /// on (closed, and its id reused), [`TransferError::InvalidDescriptor`] if it belongs to
    /// another engine; otherwise as [`Engine::transfer`].
    pub async fn post(
        &self,
        prepared: &PreparedTransfer,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferError> {
        self.post_ranges(prepared, opts).await.map_err(|f| f.error)
    }

    /// [`Engine::post`], with a failure naming which descriptors completed, failed, or were
    /// never posted.
    ///
    /// # Errors
    /// See [`TransferFailure`].
    pub async fn post_ranges(
        &self,
        prepared: &PreparedTransfer,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferFailure> {
        probe::stamp(Point::Entry);
        let inner = Rc::clone(&self.inner);
        // As in `transfer_ranges`: no span without a debug subscriber.
        if !tracing::level_enabled!(tracing::Level::DEBUG) {
            let result = post_prepared(&inner, prepared, &opts).await;
            inner.core.borrow_mut().count_result(result.is_ok());
            return result;
        }
        let span = tracing::debug_span!(
            "post",
            engine = inner.id,
            conn = prepared.conn.0,
            op = ?prepared.op,
            bytes = prepared.plan.bytes,
            wrs = prepared.plan.wrs.len()
        );
        let result = if span.is_disabled() {
            post_prepared(&inner, prepared, &opts).await
        } else {
            post_prepared(&inner, prepared, &opts)
                .instrument(span.clone())
                .await
        };
        if let Err(e) = &result {
            tracing::debug!(parent: &span, error = %e, "prepared transfer failed");
        }
        inner.core.borrow_mut().count_result(result.is_ok());
        result
    }
}

fn since(a: Option<Instant>, b: Option<Instant>) -> Duration {
    match (a, b) {
        (Some(a), Some(b)) => b.saturating_duration_since(a),
        _ => Duration::ZERO,
    }
}

/// A failure after posting began, with the descriptors (of lengths `lens`) its progress covers.
fn failed(
    error: TransferError,
    guard: &SlotGuard,
    lens: impl IntoIterator<Item = u64>,
) -> TransferFailure {
    TransferFailure {
        error,
        descriptors: DescriptorRanges::of(guard.posting.progress(), lens),
    }
}

/// Checks `conn` and the local side of a transfer against this engine and plans it into `plan`.
/// Returns the connection's epoch (a prepared transfer is bound to it).
fn check_and_plan(
    inner: &Inner,
    conn: ConnId,
    op: Op,
    local: &LocalDescList,
    remote: &RemoteDescList,
    notify_imm: bool,
    plan: &mut Plan,
) -> Result<u64, TransferError> {
    let core = inner.core.borrow();
    // One descriptor a side (most small transfers): planned directly if valid and fitting one
    // request. Anything else, errors included, takes the general path.
    if let Some((_, region, d, rd)) = one_each(inner, local, remote) {
        if let Some(epoch) = core.plan_single(conn, op, &region, d, rd, notify_imm, plan) {
            return Ok(epoch);
        }
    }
    // The notification and the connection are checked before the descriptors.
    core.check_transfer(conn, op, notify_imm)?;
    // Most transfers use one or two regions: no heap allocation for them.
    let mut regions: SmallVec<[RegionInfo; 4]> = SmallVec::new();
    for (i, r) in local.regions().iter().enumerate() {
        let index = || {
            local
                .descs()
                .iter()
                .position(|d| d.region as usize == i)
                .unwrap_or(0)
        };
        let Some(info) = r.plan_info() else {
            return Err(InvalidDescriptor::NotRegistered { index: index() }.into());
        };
        if r.engine_id() != inner.id {
            return Err(InvalidDescriptor::ForeignRegion { index: index() }.into());
        }
        regions.push(info);
    }
    core.plan_transfer(
        conn,
        op,
        &regions,
        local.descs(),
        &remote.0,
        notify_imm,
        plan,
    )
}

/// The region (with what the core needs of it) and descriptors of a transfer of one descriptor
/// a side in one region registered with this engine: the shape the core's one-request paths
/// take.
#[inline]
fn one_each<'a>(
    inner: &Inner,
    local: &'a LocalDescList,
    remote: &'a RemoteDescList,
) -> Option<(&'a Region, RegionInfo, &'a LocalDesc, &'a RemoteDesc)> {
    match (local.regions(), local.descs(), &remote.0[..]) {
        ([r], [d], [rd]) if r.engine_id() == inner.id => Some((r, r.plan_info()?, d, rd)),
        _ => None,
    }
}

/// Sets the times of `stats`: checking and planning from `t0` to `prepared`, posting from
/// `prepared` to `posted`, the whole from `t0` to `end` (all `None` with timing off). Inlined:
/// on the latency path a call and the stats' moves cost more than the few stores.
#[inline(always)]
fn set_times(
    stats: &mut TransferStats,
    t0: Option<Instant>,
    prepared: Option<Instant>,
    posted: Option<Instant>,
    end: Option<Instant>,
) {
    stats.prepare = since(t0, prepared);
    stats.post = since(prepared, posted);
    stats.total = since(t0, end);
}

/// A READ or WRITE: check and plan, post, wait. `span`: the transfer's, when enabled.
async fn transfer_inner(
    inner: &Rc<Inner>,
    conn: ConnId,
    op: Op,
    local: &LocalDescList,
    remote: &RemoteDescList,
    opts: TransferOptions,
    span: Option<&tracing::Span>,
) -> Result<TransferStats, TransferFailure> {
    let clock = || inner.cfg.timing.then(Instant::now);
    let t0 = clock();
    // One descriptor a side, one request, posted at once (a latency hop) or queued for the
    // turn's coalesced post: checked, given its slot (and credit) and posted or queued in one
    // call into the core, with no plan.
    if let Some((r, region, d, rd)) = one_each(inner, local, remote) {
        let lone = LoneTransfer {
            conn,
            op,
            region,
            local: d,
            remote: rd,
            opts: &opts,
        };
        lone_posted!(inner, lone, r, span, posting => {
            let mut guard = SlotGuard {
                inner: Rc::clone(inner),
                posting,
            };
            let posted = clock();
            crate::supervise::fail_point("rixl-transfer-posted");
            wait_slot(&mut guard)
                .await
                .map_err(|e| failed(e, &guard, [d.len]))?;
            // The checks are part of the post here.
            let mut stats = TransferStats::new(d.len, 1, 1, guard.posting.doorbells());
            set_times(&mut stats, t0, t0, posted, clock());
            Ok(stats)
        });
    }
    let mut plan = inner.core.borrow_mut().take_plan();
    if let Err(e) = check_and_plan(
        inner,
        conn,
        op,
        local,
        remote,
        opts.notify_imm.is_some(),
        &mut plan,
    ) {
        inner.core.borrow_mut().recycle_plan(plan);
        return Err(TransferFailure::before_posting(e, local.len()));
    }
    if let Some(span) = span {
        span.record("bytes", plan.bytes);
        span.record("wrs", plan.wrs.len());
    }
    let prepared = clock();
    let mut guard = post_plan(inner, conn, op, &plan, local.regions(), &opts).await;
    let (bytes, work_requests) = (plan.bytes, plan.wrs.len());
    // The plan goes back to the pool before the wait: concurrent transfers share few plans.
    inner.core.borrow_mut().recycle_plan(plan);
    let posted = clock();
    crate::supervise::fail_point("rixl-transfer-posted");
    wait_slot(&mut guard)
        .await
        .map_err(|e| failed(e, &guard, local.descs().iter().map(|d| d.len)))?;
    let mut stats =
        TransferStats::new(bytes, local.len(), work_requests, guard.posting.doorbells());
    set_times(&mut stats, t0, prepared, posted, clock());
    Ok(stats)
}

async fn post_prepared(
    inner: &Rc<Inner>,
    p: &PreparedTransfer,
    opts: &TransferOptions,
) -> Result<TransferStats, TransferFailure> {
    let clock = || inner.cfg.timing.then(Instant::now);
    let t0 = clock();
    if p.engine != inner.id {
        return Err(TransferFailure::before_posting(
            InvalidDescriptor::ForeignRegion { index: 0 }.into(),
            p.descriptors,
        ));
    }
    inner
        .core
        .borrow()
        .check_epoch(p.conn, p.epoch, p.op, opts.notify_imm.is_some())
        .map_err(|e| TransferFailure::before_posting(e, p.descriptors))?;
    // One request: the lone path, as an unprepared transfer of that shape takes (through the
    // general path's plan and batch the post's own functions took about 1,890 instructions a
    // latency hop, against about 1,130 this way; docs/perf.md).
    if let (Some(l), [r]) = (&p.lone, &p.regions[..]) {
        let lone = LoneTransfer {
            conn: p.conn,
            op: p.op,
            region: l.region,
            local: &l.local,
            remote: &l.remote,
            opts,
        };
        lone_posted!(inner, lone, r, None::<&tracing::Span>, posting => {
            let mut guard = SlotGuard {
                inner: Rc::clone(inner),
                posting,
            };
            let posted = clock();
            wait_slot(&mut guard)
                .await
                .map_err(|e| failed(e, &guard, [l.local.len]))?;
            let mut stats = TransferStats::new(l.local.len, 1, 1, guard.posting.doorbells());
            set_times(&mut stats, t0, t0, posted, clock());
            Ok(stats)
        });
    }
    let mut guard = post_plan(inner, p.conn, p.op, &p.plan, &p.regions, opts).await;
    let posted = clock();
    wait_slot(&mut guard)
        .await
        .map_err(|e| failed(e, &guard, p.lens.iter().copied()))?;
    let mut stats = TransferStats::new(
        p.plan.bytes,
        p.descriptors,
        p.plan.wrs.len(),
        guard.posting.doorbells(),
    );
    set_times(&mut stats, t0, t0, posted, clock());
    Ok(stats)
}

/// Takes an in-flight slot for `plan` (keeping `regions` registered until the NIC is done) and
/// posts its work requests as credits allow, or queues them for a coalesced post. A post error
/// ends the slot's posting: the error is the transfer's result once its posted work has
/// completed or flushed.
async fn post_plan(
    inner: &Rc<Inner>,
    conn: ConnId,
    op: Op,
    plan: &Plan,
    regions: &[Region],
    opts: &TransferOptions,
) -> SlotGuard {
    let keep = KeepAlive {
        regions: regions.iter().cloned().collect(),
        _message: None,
    };
    let posting = inner.core.borrow_mut().begin(conn, op, keep, opts);
    probe::stamp(Point::SlotOpened);
    let mut guard = SlotGuard {
        inner: Rc::clone(inner),
        posting,
    };
    poll_fn(|cx| {
        let mut core = inner.core.borrow_mut();
        let rung = guard.posting.doorbells();
        let r = core.post(&mut guard.posting, plan, cx);
        let flush = r.is_ready() && guard.posting.queued() && core.take_flush_request(conn);
        drop(core);
        if guard.posting.doorbells() != rung || (r.is_ready() && !guard.posting.queued()) {
            inner.kick_progress();
        }
        if flush {
            spawn_flush(inner, conn);
        }
        r
    })
    .await;
    probe::stamp(Point::Posted);
    guard
}

/// Runs `conn`'s flush (the core granted its flush request) as a task of its own, behind the
/// tasks runnable now.
pub(super) fn spawn_flush(inner: &Rc<Inner>, conn: ConnId) {
    crate::supervise::spawn("flush queue", flush_queue(Rc::clone(inner), conn));
}

/// Posts `conn`'s queued small transfers, one doorbell per batch, until the queue is empty.
async fn flush_queue(inner: Rc<Inner>, conn: ConnId) {
    // glommio's `spawn_local` runs a new task at once, inside the spawner's poll: without this
    // yield the flush would post the one transfer just queued. Yielding first puts it behind
    // the tasks already runnable in this tick, so their transfers share its doorbell.
    futures_lite::future::yield_now().await;
    poll_fn(|cx| {
        let mut core = inner.core.borrow_mut();
        let rung = core.counters().doorbells;
        let r = core.flush(conn, cx);
        let posted = core.counters().doorbells != rung;
        if !(posted || r.is_ready()) {
            return r;
        }
        // A device that completes within the post (rxe): reap here, which wakes the queued
        // futures, and leave the progress task parked when nothing is left to wait for (a
        // latency loop's occasional probe would otherwise set it spinning beside the loop).
        if posted {
            let _ = reap_until(&inner, &mut core, 1, |_| Poll::<()>::Pending);
        }
        // A signaled request still outstanding (on any connection) needs the progress task.
        let waiting = core.awaits_completion() || inner.cq_failed.get();
        drop(core);
        if waiting {
            inner.kick_progress();
        }
        r
    })
    .await;
}
