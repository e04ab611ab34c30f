//! The per-core engine: owns its device context, PD, CQ and queue pairs; a progress task reaps
//! completions and wakes the transfer futures. Everything here is `!Send` and lock-free: it lives
//! on one glommio executor. Use [`crate::EngineHandle`] to submit from other threads.

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use rixl_verbs::{
    AccessFlags, CompletionQueue, ConnectOptions, Context, DeviceAttributes, Endpoint,
    OwnedRegistration, ProtectionDomain, QueuePair, QueuePairCapabilities, RecvBatch,
    RegisteredBuffer, SendBatch, SendFlags, SendOp, Sge, WcOpcode, WorkCompletion,
};
use slab::Slab;
use smallvec::SmallVec;
use tracing::Instrument;

use crate::credits::SendCredits;
use crate::desc::{LocalDescList, Op, Region, RemoteDescList};
use crate::error::{InvalidDescriptor, RuntimeError, TransferError};
use crate::inflight::{InflightTable, Routed, SlotId};
use crate::plan::{self, Limits, Plan, RegionInfo};

/// How the progress task waits for completions while work is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PollMode {
    /// Poll the CQ, yielding to other tasks between polls (lowest latency; the core is busy only
    /// while work is in flight).
    #[default]
    Busy,
    /// Arm the CQ and wait for its completion event off the core (glommio's blocking pool); for
    /// latency-insensitive users who want no spinning at all.
    Event,
}

/// Engine configuration.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EngineConfig {
    /// RDMA device name (`None`: the first device).
    pub device: Option<String>,
    /// Port and GID index, and the QP transport parameters.
    pub connect: ConnectOptions,
    /// Send queue depth of each connection.
    pub send_queue_depth: u32,
    /// Receive buffers posted per connection for SEND / WRITE_WITH_IMM messages.
    pub recv_buffers: u32,
    /// Largest message `send` carries (size of each receive buffer).
    pub max_message: u32,
    /// Most connections; the CQ is sized so it can never overflow with all of them full.
    pub max_connections: u32,
    /// Signal at least every this many work requests (and the last of every batch).
    pub signal_interval: u32,
    /// WRITEs and SENDs of at most this many bytes are copied into the work request
    /// (`IBV_SEND_INLINE`): the NIC needs no DMA read of the source, which cuts small-message
    /// latency. Requested from the device per connection (perftest's default is 220); a device
    /// that refuses it gets queue pairs without inline data. 0 disables.
    pub max_inline: u32,
    /// Most work requests posted with one doorbell.
    pub post_batch: u32,
    /// Completions reaped per poll.
    pub poll_batch: usize,
    /// Busy or event polling.
    pub poll_mode: PollMode,
    /// Default deadline of a transfer.
    pub transfer_timeout: Duration,
    /// Busy mode: how many empty polls after the last activity the engine keeps spinning for
    /// awaited receives before it falls back to polling every 200 µs.
    pub recv_spin_polls: u32,
    /// Measure per-transfer prepare/post/total times in [`TransferStats`] (off by default: it
    /// reads the clock several times per transfer, which is costly on some clock sources).
    pub timing: bool,
    /// Coalesce small transfers (off by default): the first transfer of at most
    /// [`COALESCE_MAX_WRS`] work requests in a progress turn on a connection is posted at once;
    /// those that follow it in the same turn are queued and posted together at the end of the
    /// turn, up to `post_batch` requests per doorbell, and only the batch's last request (plus
    /// every [`COALESCE_SIGNAL_INTERVAL`]-th) is signaled; the others complete with it (RC
    /// completes in order). On rxe, 128 concurrent one-request writes went from one doorbell
    /// and one completion per request to about 30 requests per doorbell and 8 per completion,
    /// and 64 B message rate rose by 15-40 %. The cost is for a task that posts transfers one
    /// after another without waiting in between (on rxe a completion is often there before
    /// the future first waits): every other one waits for the end of the turn.
    pub coalesce: bool,
    /// How long an engine's core spins for new work before it sleeps (glommio's
    /// `spin_before_park`; zero: it sleeps at once). A sleeping core takes a cross-thread
    /// wake-up (an eventfd and a scheduler round, tens of µs in a VM) to see the next command
    /// from another thread, such as a CUDA-IPC transfer's copies to await.
    pub spin_before_park: Duration,
    /// Fail to start when no RDMA device can be opened (`false`: such a core still serves host
    /// memory and the FILE tier; RDMA calls then fail with a typed error).
    pub require_nic: bool,
    /// The FILE tier's queue depth and I/O size.
    pub file: crate::file::FileConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        let mut connect = ConnectOptions::default();
        connect.gid_index = 1;
        EngineConfig {
            device: None,
            connect,
            send_queue_depth: 512,
            recv_buffers: 64,
            max_message: 4096,
            max_connections: 16,
            signal_interval: 32,
            post_batch: 64,
            poll_batch: 32,
            max_inline: 220,
            poll_mode: PollMode::Busy,
            transfer_timeout: Duration::from_secs(30),
            recv_spin_polls: 50_000,
            timing: false,
            coalesce: false,
            spin_before_park: Duration::from_micros(100),
            require_nic: true,
            file: crate::file::FileConfig::default(),
        }
    }
}

impl EngineConfig {
    /// Device and GID index from `RIXL_RDMA_DEVICE` / `RIXL_GID_INDEX` when set.
    pub fn from_env() -> Self {
        let mut c = EngineConfig {
            device: std::env::var("RIXL_RDMA_DEVICE").ok(),
            ..Self::default()
        };
        if let Some(g) = std::env::var("RIXL_GID_INDEX")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            c.connect.gid_index = g;
        }
        c
    }
}

/// Per-transfer options.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct TransferOptions {
    /// Deadline; `None` uses the engine's `transfer_timeout`.
    pub timeout: Option<Duration>,
    /// Deliver this immediate value to the peer after all data landed (the last work request
    /// becomes an RDMA WRITE_WITH_IMM; WRITE only). The peer sees it from
    /// [`Engine::recv`] as [`Message::Immediate`].
    pub notify_imm: Option<u32>,
}

/// What a finished transfer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct TransferStats {
    /// Bytes moved.
    pub bytes: u64,
    /// Descriptors in the local list.
    pub descriptors: usize,
    /// Work requests posted.
    pub work_requests: usize,
    /// Doorbells rung (post calls).
    pub doorbells: usize,
    /// Time to validate and plan.
    pub prepare: Duration,
    /// Time from the first to the last post.
    pub post: Duration,
    /// Total time of the future.
    pub total: Duration,
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

/// Counters of one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct EngineCounters {
    /// CQ polls that returned completions.
    pub polls: u64,
    /// Completions reaped.
    pub completions: u64,
    /// CQ polls that returned nothing.
    pub empty_polls: u64,
    /// Times the progress task parked (nothing in flight).
    pub parks: u64,
    /// Completion events waited for (event mode).
    pub event_waits: u64,
    /// Completions for freed slots (ignored).
    pub stale_completions: u64,
    /// Transfers that completed successfully.
    pub transfers_ok: u64,
    /// Transfers that failed.
    pub transfers_failed: u64,
    /// Work requests posted.
    pub work_requests: u64,
    /// Doorbells rung.
    pub doorbells: u64,
    /// Small transfers queued for a coalesced post (with coalescing on; the others were posted
    /// at once).
    pub queued: u64,
}

/// How long [`Engine::close_connection`] lets posted work finish before failing the connection.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Identifies a connection of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnId(pub u32);

/// A message received on a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Message {
    /// A SEND's payload (with its immediate value, if any).
    Data(Vec<u8>, Option<u32>),
    /// The immediate value of an RDMA WRITE_WITH_IMM: the writer's data has landed.
    Immediate(u32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ConnStatus {
    Prepared,
    Ready,
    Failed(String),
}

const RECV_BIT: u64 = 1 << 62;
/// Receive completions carry `RECV_BIT | conn << 16 | buffer index`.
fn recv_wr_id(conn: u32, index: u32) -> u64 {
    RECV_BIT | (u64::from(conn) << 16) | u64::from(index)
}

struct Conn {
    /// Unique per engine, unlike the slab id (reused after a close) and the QP number (which a
    /// device may reuse): what a [`PreparedTransfer`] is bound to.
    epoch: u64,
    qp: Arc<QueuePair>,
    psn: u32,
    status: ConnStatus,
    credits: SendCredits,
    credit_waiters: Vec<Waker>,
    recv_region: Region,
    inbox: VecDeque<Message>,
    inbox_waiter: Option<Waker>,
    max_msg: u64,
    /// Inline bytes per send request the queue pair was granted.
    max_inline: u64,
    /// Work requests of small transfers waiting for this tick's coalesced post.
    queue: VecDeque<QueuedWr>,
    /// A flush task for `queue` is scheduled.
    flush_scheduled: bool,
    /// The progress turn in which a small transfer was last posted at once (adaptive
    /// coalescing).
    immediate_turn: u64,
}

impl Conn {
    /// Whether a request of `op` moving `bytes` is posted inline (READs never are).
    fn inline(&self, op: &SendOp, bytes: u64) -> bool {
        !matches!(op, SendOp::Read { .. }) && bytes <= self.max_inline
    }
}

/// Transfers of at most this many work requests are coalesced (see [`EngineConfig::coalesce`]).
pub const COALESCE_MAX_WRS: usize = 4;

/// In a coalesced batch, at least every this many requests are signaled, so transfers complete
/// in small groups rather than all at the end of the batch.
pub const COALESCE_SIGNAL_INTERVAL: u32 = 8;

/// One queued work request of a coalesced transfer.
struct QueuedWr {
    slot: SlotId,
    op: SendOp,
    sges: Vec<Sge>,
    /// The transfer's last request (its WRs are queued and posted together).
    last: bool,
    /// Number of requests of its transfer (on the first one).
    count: usize,
}

/// What a transfer slot keeps alive until the NIC is done with it.
pub(crate) struct KeepAlive {
    _regions: SmallVec<[Region; 2]>,
    _message: Option<MessageSlot>,
}

/// A slot of the engine's registered send-message pool; returned to the pool on drop.
struct MessageSlot {
    index: u32,
    free: Rc<RefCell<Vec<u32>>>,
}

impl Drop for MessageSlot {
    fn drop(&mut self) {
        self.free.borrow_mut().push(self.index);
    }
}

/// (when, slot key, slot generation, connection, the timeout it was armed with), soonest first.
/// `None` = armed while the progress loop's clock was not running; the loop stamps it (now +
/// timeout) on its next clock read, so submitting never reads the clock.
type Deadline = Reverse<(Option<Instant>, u32, u32, u32, Duration)>;

struct State {
    // Field order matters: queue pairs are destroyed before the in-flight keep-alives release
    // their regions, so the NIC never touches deregistered memory.
    conns: Slab<Conn>,
    inflight: InflightTable<KeepAlive>,
    /// (qpn, connection) pairs; a linear scan beats hashing for the few QPs of one engine.
    qpn_to_conn: Vec<(u32, u32)>,
    batch: SendBatch,
    /// Transfer deadlines, soonest first; entries of finished transfers are dropped lazily.
    deadlines: BinaryHeap<Deadline>,
}

pub(crate) struct Inner {
    id: u64,
    cfg: EngineConfig,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    device: DeviceAttributes,
    state: RefCell<State>,
    counters: Cell<EngineCounters>,
    kick: Cell<bool>,
    /// Empty polls since the last completion or submission.
    quiet_polls: Cell<u32>,
    /// The progress loop's clock while it runs (refreshed every few iterations); `None` while
    /// parked, so a new deadline reads the real clock.
    clock: Cell<Option<Instant>>,
    progress_waker: RefCell<Option<Waker>>,
    shutdown: Cell<bool>,
    msg_region: Region,
    msg_free: Rc<RefCell<Vec<u32>>>,
    msg_waiters: RefCell<Vec<Waker>>,
    /// Connections made so far: each gets the next number as its epoch.
    conn_epochs: Cell<u64>,
    /// Plans of finished postings, reused so a transfer allocates no request list.
    plans: RefCell<Vec<Plan>>,
    /// Progress-loop iterations so far: a turn of the executor (for coalescing), and every 32nd
    /// reads the clock.
    turn: Cell<u64>,
}

/// Plans kept for reuse.
const KEPT_PLANS: usize = 8;
/// A plan with more requests or entries than this (a huge descriptor list) is dropped, not kept.
const KEPT_PLAN_ENTRIES: usize = 4096;
/// Completions a waiting future reaps at once.
const REAP_NOW_BATCH: usize = 8;

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// A fresh engine id (also used by cores without a NIC, for their host regions).
pub(crate) fn next_engine_id() -> u64 {
    NEXT_ENGINE.fetch_add(1, Ordering::Relaxed)
}

/// A per-core transfer engine. Cheap to clone (all clones are the same engine); `!Send`.
#[derive(Clone)]
pub struct Engine {
    pub(crate) inner: Rc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("id", &self.inner.id)
            .field("counters", &self.inner.counters.get())
            .finish()
    }
}

fn bump(c: &Cell<EngineCounters>, f: impl FnOnce(&mut EngineCounters)) {
    let mut v = c.get();
    f(&mut v);
    c.set(v);
}

impl Engine {
    /// Opens the device and starts the progress task on the current glommio executor. Slow verbs
    /// (device open, CQ creation, registration) run on the executor's blocking pool.
    ///
    /// # Errors
    /// [`RuntimeError::Verbs`] if the device cannot be opened or resources cannot be created.
    pub async fn open(cfg: EngineConfig) -> Result<Engine, RuntimeError> {
        let id = next_engine_id();
        let c = cfg.clone();
        let (ctx, pd, cq, device, msg_buf) = glommio::executor()
            .spawn_blocking(move || -> Result<_, rixl_verbs::Error> {
                let ctx = Context::open(c.device.as_deref())?;
                let device = ctx.query_device()?;
                let pd = ProtectionDomain::new(&ctx)?;
                // Room for every connection's full send and receive queues: the CQ can never
                // overflow, even when a failing connection flushes everything at once.
                let need = c.max_connections * (c.send_queue_depth + c.recv_buffers) + 64;
                let cq = CompletionQueue::new(
                    &ctx,
                    need.min(device.max_cqe),
                    c.poll_mode == PollMode::Event,
                )?;
                let msg = RegisteredBuffer::new(
                    &pd,
                    (c.max_message as usize) * 64,
                    AccessFlags::LOCAL_WRITE,
                )?;
                Ok((ctx, pd, cq, device, msg))
            })
            .await?;
        let capacity_needed = cfg.max_connections * (cfg.send_queue_depth + cfg.recv_buffers);
        if cq.capacity() < capacity_needed {
            return Err(RuntimeError::Limit(format!(
                "device CQ holds {} entries but {} connections x ({} + {}) need {capacity_needed}",
                cq.capacity(),
                cfg.max_connections,
                cfg.send_queue_depth,
                cfg.recv_buffers
            )));
        }
        drop(ctx);
        let inner = Rc::new(Inner {
            id,
            msg_region: Region::new(msg_buf, id),
            msg_free: Rc::new(RefCell::new((0..64).rev().collect())),
            msg_waiters: RefCell::new(Vec::new()),
            conn_epochs: Cell::new(0),
            plans: RefCell::new(Vec::new()),
            turn: Cell::new(1),
            cfg,
            pd,
            cq,
            device,
            state: RefCell::new(State {
                conns: Slab::new(),
                inflight: InflightTable::new(),
                qpn_to_conn: Vec::new(),
                batch: SendBatch::with_capacity(64, 4),
                deadlines: BinaryHeap::new(),
            }),
            counters: Cell::new(EngineCounters::default()),
            kick: Cell::new(false),
            quiet_polls: Cell::new(0),
            clock: Cell::new(None),
            progress_waker: RefCell::new(None),
            shutdown: Cell::new(false),
        });
        glommio::spawn_local(progress(Rc::clone(&inner))).detach();
        tracing::info!(engine = id, device = ?inner.cfg.device, "engine started");
        Ok(Engine { inner })
    }

    /// Engine id (also the id of its protection domain's regions).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> EngineCounters {
        self.inner.counters.get()
    }

    /// Live in-flight slots (including detached ones the NIC has not finished).
    pub fn inflight(&self) -> usize {
        self.inner.state.borrow().inflight.len()
    }

    /// Allocates and registers `len` bytes (page aligned, zeroed) with remote read/write access.
    /// Registration runs off the core.
    ///
    /// # Errors
    /// [`RuntimeError::Verbs`] if allocation or registration fails.
    pub async fn register(&self, len: usize) -> Result<Region, RuntimeError> {
        let pd = self.inner.pd.clone();
        let buf = glommio::executor()
            .spawn_blocking(move || RegisteredBuffer::new(&pd, len, AccessFlags::ALL_RDMA))
            .await?;
        Ok(Region::new(buf, self.inner.id))
    }

    /// Registers host memory shared with other engines (multi-rail: one buffer, one registration
    /// per NIC). Runs off the core.
    ///
    /// # Errors
    /// [`RuntimeError::Verbs`] if registration fails.
    pub async fn register_shared(
        &self,
        mem: Arc<rixl_verbs::HostBuffer>,
    ) -> Result<Region, RuntimeError> {
        let pd = self.inner.pd.clone();
        let reg = glommio::executor()
            .spawn_blocking(move || {
                rixl_verbs::SharedRegistration::register(&pd, mem, AccessFlags::ALL_RDMA)
            })
            .await?;
        Ok(Region::shared(reg, self.inner.id))
    }

    /// Allocates `len` bytes on GPU `ordinal` and registers them with this engine's NIC
    /// (GPUDirect RDMA: dma-buf first, nvidia-peermem second). Runs off the core.
    ///
    /// # Errors
    /// [`RuntimeError::Gpu`] without CUDA, for a bad ordinal, or when neither registration path
    /// works.
    pub async fn register_gpu(&self, ordinal: i32, len: usize) -> Result<Region, RuntimeError> {
        let pd = self.inner.pd.clone();
        let reg = glommio::executor()
            .spawn_blocking(move || {
                let gpu = rixl_gpudirect::Gpu::open(ordinal)?;
                let mem = rixl_gpudirect::DeviceMemory::alloc(&gpu, len)?;
                rixl_gpudirect::GpuRegistration::register(&pd, mem, AccessFlags::ALL_RDMA)
            })
            .await?;
        Ok(Region::gpu(reg, self.inner.id))
    }

    /// Creates a queue pair for a new connection and returns this side's endpoint, to be sent to
    /// the peer out of band.
    ///
    /// # Errors
    /// [`RuntimeError::Limit`] past `max_connections`; [`RuntimeError::Verbs`] on verb failures.
    pub async fn prepare_connection(&self) -> Result<(ConnId, Endpoint), RuntimeError> {
        let cfg = self.inner.cfg.clone();
        if self.inner.state.borrow().conns.len() >= cfg.max_connections as usize {
            return Err(RuntimeError::Limit(format!(
                "engine has {} connections (max_connections)",
                cfg.max_connections
            )));
        }
        let pd = self.inner.pd.clone();
        let cq = self.inner.cq.clone();
        let psn = (rand_u32() ^ self.inner.id as u32) & 0x00ff_ffff;
        let recv_len = (cfg.max_message as usize) * (cfg.recv_buffers as usize);
        // The device's limits were queried when the engine opened.
        let max_sge = 16.min(self.inner.device.max_sge);
        let (qp, ep, recv_buf) = glommio::executor()
            .spawn_blocking(move || -> Result<_, rixl_verbs::Error> {
                let mut caps = QueuePairCapabilities::default();
                caps.max_send_wr = cfg.send_queue_depth;
                caps.max_recv_wr = cfg.recv_buffers;
                caps.max_send_sge = max_sge;
                caps.max_recv_sge = 1;
                caps.max_inline_data = cfg.max_inline;
                let qp = match QueuePair::new_rc(&pd, &cq, &cq, caps) {
                    Ok(qp) => qp,
                    Err(e) if caps.max_inline_data > 0 => {
                        tracing::debug!(error = %e, inline = caps.max_inline_data, "queue pair refused inline data; retrying without");
                        caps.max_inline_data = 0;
                        QueuePair::new_rc(&pd, &cq, &cq, caps)?
                    }
                    Err(e) => return Err(e),
                };
                qp.to_init(&cfg.connect)?;
                let ep = qp.endpoint(&cfg.connect, psn)?;
                let recv_buf = RegisteredBuffer::new(&pd, recv_len, AccessFlags::LOCAL_WRITE)?;
                Ok((qp, ep, recv_buf))
            })
            .await?;
        let recv_region = Region::new(recv_buf, self.inner.id);
        let qp = Arc::new(qp);
        let mut st = self.inner.state.borrow_mut();
        let st = &mut *st;
        let credits = SendCredits::new(qp.capabilities().max_send_wr, cfg.signal_interval);
        let entry = st.conns.vacant_entry();
        let id = u32::try_from(entry.key()).unwrap_or(u32::MAX);
        // Post every receive buffer now (INIT accepts receives).
        let mut r = RecvBatch::default();
        for i in 0..cfg.recv_buffers {
            r.push(
                recv_wr_id(id, i),
                &[Sge {
                    addr: recv_region.addr() + u64::from(i * cfg.max_message),
                    length: cfg.max_message,
                    lkey: recv_region.lkey(),
                }],
            );
        }
        qp.post_recv_in(&mut r, recv_region.nic_slice())?;
        st.qpn_to_conn.push((qp.qpn(), id));
        let max_inline = u64::from(qp.capabilities().max_inline_data);
        let epoch = self.inner.conn_epochs.get() + 1;
        self.inner.conn_epochs.set(epoch);
        entry.insert(Conn {
            epoch,
            max_inline,
            qp,
            psn,
            status: ConnStatus::Prepared,
            credits,
            credit_waiters: Vec::new(),
            recv_region,
            inbox: VecDeque::new(),
            inbox_waiter: None,
            max_msg: u64::from(u32::MAX),
            queue: VecDeque::new(),
            flush_scheduled: false,
            immediate_turn: 0,
        });
        tracing::debug!(
            engine = self.inner.id,
            conn = id,
            qpn = ep.qpn,
            "connection prepared"
        );
        Ok((ConnId(id), ep))
    }

    /// Connects a prepared connection to the peer's endpoint (INIT → RTR → RTS, off the core).
    ///
    /// # Errors
    /// [`RuntimeError::UnknownConnection`] or the verbs error of a refused transition.
    pub async fn complete_connection(
        &self,
        conn: ConnId,
        remote: Endpoint,
    ) -> Result<(), RuntimeError> {
        let (qp, psn) = {
            let st = self.inner.state.borrow();
            let c = st
                .conns
                .get(conn.0 as usize)
                .ok_or(RuntimeError::UnknownConnection(conn.0))?;
            (Arc::clone(&c.qp), c.psn)
        };
        let opts = self.inner.cfg.connect;
        let q = Arc::clone(&qp);
        glommio::executor()
            .spawn_blocking(move || -> Result<(), rixl_verbs::Error> {
                q.to_rtr(&remote, &opts)?;
                q.to_rts(psn, &opts)
            })
            .await?;
        let mut st = self.inner.state.borrow_mut();
        if let Some(c) = st.conns.get_mut(conn.0 as usize) {
            c.status = ConnStatus::Ready;
            c.max_msg = u64::from(qp.max_message_size());
        }
        tracing::debug!(engine = self.inner.id, conn = conn.0, "connection ready");
        Ok(())
    }

    /// Fails a connection: its QP moves to ERROR, every outstanding transfer on it ends with
    /// [`TransferError::Flushed`] (or its own earlier error) once the NIC has flushed its work.
    pub fn abort_connection(&self, conn: ConnId, reason: &str) {
        self.inner
            .fail_connection(conn.0, reason, &TransferError::Flushed);
    }

    /// Closes a connection gracefully: work already posted gets up to [`CLOSE_GRACE`] to
    /// complete, then the connection is failed (the QP flushes what is left), and once nothing of
    /// it is in flight its queue pair is destroyed.
    pub async fn close_connection(&self, conn: ConnId) {
        let drained = futures_lite::future::or(
            async {
                self.wait_idle(conn).await;
                true
            },
            async {
                glommio::timer::Timer::new(CLOSE_GRACE).await;
                false
            },
        )
        .await;
        if !drained {
            tracing::debug!(
                conn = conn.0,
                "close: work still in flight after the grace period"
            );
        }
        self.abort_connection(conn, "closed");
        self.wait_idle(conn).await;
        let mut st = self.inner.state.borrow_mut();
        if st.conns.contains(conn.0 as usize) {
            let State {
                conns, inflight, ..
            } = &mut *st;
            if let Some(c) = conns.get_mut(conn.0 as usize) {
                fail_queue(
                    c,
                    inflight,
                    &TransferError::Connection(conn.0, "closed".into()),
                );
            }
            let c = st.conns.remove(conn.0 as usize);
            let qpn = c.qp.qpn();
            st.qpn_to_conn.retain(|&(q, _)| q != qpn);
        }
    }

    /// Waits until no work request of `conn` awaits completion.
    async fn wait_idle(&self, conn: ConnId) {
        let inner = Rc::clone(&self.inner);
        poll_fn(|cx| {
            let mut st = inner.state.borrow_mut();
            let busy = st
                .conns
                .get(conn.0 as usize)
                .is_some_and(|c| !c.credits.is_idle());
            if busy {
                st.conns[conn.0 as usize]
                    .credit_waiters
                    .push(cx.waker().clone());
                inner.kick_progress();
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await;
    }

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
        let span = tracing::debug_span!(
            "transfer",
            engine = self.inner.id,
            conn = conn.0,
            ?op,
            descriptors = local.len(),
            bytes = tracing::field::Empty,
            wrs = tracing::field::Empty
        );
        let inner = Rc::clone(&self.inner);
        // Without a debug subscriber the span is disabled: no `Instrumented` layer (a span
        // entered and left on every poll, and one more future to move) around the transfer.
        let transfer = transfer_inner(
            Rc::clone(&inner),
            conn,
            op,
            local,
            remote,
            opts,
            span.clone(),
        );
        let result = if span.is_disabled() {
            transfer.await
        } else {
            transfer.instrument(span.clone()).await
        };
        match &result {
            Ok(st) => {
                tracing::debug!(parent: &span, total_us = st.total.as_micros() as u64, post_us = st.post.as_micros() as u64, "transfer complete")
            }
            Err(e) => tracing::debug!(parent: &span, error = %e, "transfer failed"),
        }
        inner.count_result(result.is_ok());
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
        Ok(PreparedTransfer {
            engine: self.inner.id,
            conn,
            epoch,
            op,
            plan,
            regions: local.regions().iter().cloned().collect(),
            descriptors: local.len(),
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
        let inner = Rc::clone(&self.inner);
        let span = tracing::debug_span!(
            "post",
            engine = inner.id,
            conn = prepared.conn.0,
            op = ?prepared.op,
            bytes = prepared.plan.bytes,
            wrs = prepared.plan.wrs.len()
        );
        let post = post_prepared(&inner, prepared, &opts);
        let result = if span.is_disabled() {
            post.await
        } else {
            post.instrument(span.clone()).await
        };
        if let Err(e) = &result {
            tracing::debug!(parent: &span, error = %e, "prepared transfer failed");
        }
        inner.count_result(result.is_ok());
        result
    }

    /// Sends a small message (at most `max_message` bytes) with SEND (and optional immediate).
    ///
    /// # Errors
    /// [`TransferError::InvalidDescriptor`] if it is too large; otherwise as a transfer.
    pub async fn send(
        &self,
        conn: ConnId,
        msg: &[u8],
        imm: Option<u32>,
    ) -> Result<(), TransferError> {
        let max = self.inner.cfg.max_message;
        if msg.len() > max as usize || msg.is_empty() {
            return Err(TransferError::InvalidDescriptor(
                InvalidDescriptor::OutOfRange {
                    index: 0,
                    offset: 0,
                    len: msg.len() as u64,
                    region_len: u64::from(max),
                },
            ));
        }
        let inner = Rc::clone(&self.inner);
        let slot = poll_fn(|cx| match inner.msg_free.borrow_mut().pop() {
            Some(i) => Poll::Ready(MessageSlot {
                index: i,
                free: Rc::clone(&inner.msg_free),
            }),
            None => {
                inner.msg_waiters.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            }
        })
        .await;
        let off = u64::from(slot.index * max);
        self.inner
            .msg_region
            .write_at(off, msg)
            .map_err(|e| TransferError::Post(e.to_string()))?;
        let sge = Sge {
            addr: self.inner.msg_region.addr() + off,
            length: msg.len() as u32,
            lkey: self.inner.msg_region.lkey(),
        };
        let op = match imm {
            Some(imm) => SendOp::SendWithImm { imm },
            None => SendOp::Send,
        };
        let keep = KeepAlive {
            _regions: smallvec::smallvec![self.inner.msg_region.clone()],
            _message: Some(slot),
        };
        post_single(Rc::clone(&self.inner), conn, op, sge, keep).await
    }

    /// Receives the next message (SEND payload or WRITE_WITH_IMM notification) on `conn`.
    ///
    /// # Errors
    /// [`TransferError::Connection`] when the connection failed or is unknown.
    pub async fn recv(&self, conn: ConnId) -> Result<Message, TransferError> {
        let inner = Rc::clone(&self.inner);
        poll_fn(|cx| {
            let mut st = inner.state.borrow_mut();
            let Some(c) = st.conns.get_mut(conn.0 as usize) else {
                return Poll::Ready(Err(TransferError::Connection(conn.0, "unknown".into())));
            };
            if let Some(m) = c.inbox.pop_front() {
                return Poll::Ready(Ok(m));
            }
            if let ConnStatus::Failed(why) = &c.status {
                return Poll::Ready(Err(TransferError::Connection(conn.0, why.clone())));
            }
            c.inbox_waiter = Some(cx.waker().clone());
            inner.kick_progress();
            Poll::Pending
        })
        .await
    }

    /// Stops the engine: fails every connection, waits until the NIC has flushed all in-flight
    /// work, and ends the progress task. Regions stay valid (they belong to their handles).
    pub async fn shutdown(self) {
        let conns: Vec<u32> = self
            .inner
            .state
            .borrow()
            .conns
            .iter()
            .map(|(k, _)| k as u32)
            .collect();
        for c in conns {
            self.close_connection(ConnId(c)).await;
        }
        self.inner.shutdown.set(true);
        self.inner.kick_progress();
    }
}

fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    t.wrapping_mul(2_654_435_761)
}

fn since(a: Option<Instant>, b: Option<Instant>) -> Duration {
    match (a, b) {
        (Some(a), Some(b)) => b.saturating_duration_since(a),
        _ => Duration::ZERO,
    }
}

/// One transfer's posting parameters.
#[derive(Clone, Copy)]
struct Job<'a> {
    op: Op,
    slot: SlotId,
    plan: &'a Plan,
    notify_imm: Option<u32>,
    regions: &'a [&'a dyn rixl_verbs::OwnedRegistration],
}

/// Detaches a slot when the transfer future goes away before taking its result.
struct SlotGuard {
    inner: Rc<Inner>,
    slot: SlotId,
    armed: bool,
    /// The timeout still to arm as a deadline, on the first wait: a transfer that completes
    /// without waiting (its completion reaped by its own first poll) never touches the
    /// deadline heap. Deadlines only end waiting futures (a detached slot does not expire).
    timeout: Option<(u32, Duration)>,
}

impl SlotGuard {
    /// Arms the deadline if it is not armed yet (the future is about to wait).
    fn arm_deadline(&mut self) {
        if let Some((conn, timeout)) = self.timeout.take() {
            self.inner.arm_deadline(self.slot, conn, timeout);
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if self.armed {
            let released = self.inner.state.borrow_mut().inflight.detach(self.slot);
            tracing::debug!(
                slot = self.slot.key,
                released,
                "transfer future dropped; slot detached"
            );
        }
    }
}

impl Inner {
    /// Reaps the completions already in the CQ (one non-blocking poll) and routes them, on
    /// behalf of the progress task: a waiting future that finds its own completion there ends
    /// without a round trip through the progress task (on a fast device the completion often
    /// arrives before the future first waits).
    fn reap_now(&self) -> usize {
        let mut wcs = [WorkCompletion::default(); REAP_NOW_BATCH];
        let n = self.cq.poll(&mut wcs).unwrap_or(0);
        self.route_polled(&wcs[..n]);
        n
    }

    /// Counts and routes the completions of one CQ poll (none: nothing happens).
    fn route_polled(&self, wcs: &[WorkCompletion]) {
        if wcs.is_empty() {
            return;
        }
        self.quiet_polls.set(0);
        bump(&self.counters, |c| {
            c.polls += 1;
            c.completions += wcs.len() as u64;
        });
        for wc in wcs {
            self.route(wc);
        }
    }

    /// Polls in-flight `slot`: its result if it has one, else after reaping what the CQ holds.
    /// The waker is registered only after the reap, so a future that reaps its own completion
    /// does not wake itself.
    fn poll_slot(
        &self,
        slot: SlotId,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Result<(), TransferError>> {
        if let Poll::Ready(r) = self.state.borrow_mut().inflight.try_take(slot) {
            return Poll::Ready(r);
        }
        self.reap_now();
        self.state.borrow_mut().inflight.poll(slot, cx)
    }

    /// `f` of connection `conn` if it exists and has not failed.
    fn live_conn<T>(&self, conn: u32, f: impl FnOnce(&Conn) -> T) -> Result<T, TransferError> {
        let st = self.state.borrow();
        let c = st
            .conns
            .get(conn as usize)
            .ok_or_else(|| TransferError::Connection(conn, "unknown".into()))?;
        if let ConnStatus::Failed(why) = &c.status {
            return Err(TransferError::Connection(conn, why.clone()));
        }
        Ok(f(c))
    }

    /// Counts a finished transfer as succeeded or failed.
    fn count_result(&self, ok: bool) {
        bump(&self.counters, |c| {
            if ok {
                c.transfers_ok += 1
            } else {
                c.transfers_failed += 1
            }
        });
    }

    /// Keeps `plan`'s allocations for the next transfer.
    fn recycle_plan(&self, plan: Plan) {
        let mut plans = self.plans.borrow_mut();
        if plans.len() < KEPT_PLANS
            && plan.wrs.capacity() <= KEPT_PLAN_ENTRIES
            && plan.sges.capacity() <= KEPT_PLAN_ENTRIES
        {
            plans.push(plan);
        }
    }

    fn arm_deadline(&self, slot: SlotId, conn: u32, timeout: Duration) {
        let at = self.clock.get().map(|now| now + timeout);
        let mut st = self.state.borrow_mut();
        st.deadlines
            .push(Reverse((at, slot.key, slot.generation, conn, timeout)));
        // Entries of finished transfers are dropped lazily; keep the heap near the live set.
        if st.deadlines.len() > 2 * st.inflight.len() + 1024 {
            let State {
                deadlines,
                inflight,
                ..
            } = &mut *st;
            deadlines.retain(|Reverse((_, key, generation, ..))| {
                inflight.contains(SlotId {
                    key: *key,
                    generation: *generation,
                })
            });
        }
    }

    /// Expires every transfer whose deadline passed: its future ends with `Timeout`, and its
    /// connection is failed so the NIC flushes the work (the slot keeps the memory until then).
    fn expire_deadlines(&self, now: Instant) {
        loop {
            let mut st = self.state.borrow_mut();
            let Some(Reverse((at, key, generation, conn, timeout))) = st.deadlines.peek().copied()
            else {
                return;
            };
            let id = SlotId { key, generation };
            match at {
                None => {
                    // Armed while the clock was stopped: stamp it now (if still live).
                    st.deadlines.pop();
                    if st.inflight.contains(id) {
                        st.deadlines.push(Reverse((
                            Some(now + timeout),
                            key,
                            generation,
                            conn,
                            timeout,
                        )));
                    }
                    continue;
                }
                Some(at) if at > now => return,
                Some(_) => {}
            }
            st.deadlines.pop();
            if !st.inflight.expire(id, TransferError::Timeout(timeout)) {
                continue;
            }
            drop(st);
            tracing::warn!(conn, ?timeout, "transfer timed out; failing its connection");
            self.fail_connection(conn, "transfer timed out", &TransferError::Flushed);
        }
    }

    fn kick_progress(&self) {
        self.kick.set(true);
        self.quiet_polls.set(0);
        if let Some(w) = self.progress_waker.borrow_mut().take() {
            w.wake();
        }
    }

    fn fail_connection(&self, conn: u32, reason: &str, err: &TransferError) {
        let mut st = self.state.borrow_mut();
        let Some(c) = st.conns.get_mut(conn as usize) else {
            return;
        };
        if let ConnStatus::Failed(_) = c.status {
            return;
        }
        c.status = ConnStatus::Failed(reason.to_string());
        if let Err(e) = c.qp.to_error() {
            tracing::warn!(conn, error = %e, "moving QP to error failed");
        }
        let waiters: Vec<Waker> = c
            .credit_waiters
            .drain(..)
            .chain(c.inbox_waiter.take())
            .collect();
        st.inflight.fail_connection(conn, err);
        drop(st);
        for w in waiters {
            w.wake();
        }
        self.kick_progress();
    }

    fn limits(&self, op: Op, qp: &QueuePair, max_msg: u64) -> Limits {
        let sge = qp.capabilities().max_send_sge;
        Limits {
            max_sge: match op {
                Op::Write => sge,
                Op::Read => sge.min(self.device.max_sge_rd.max(1)),
            },
            max_msg,
        }
    }

    /// Waits until `conn` has at least one free send-queue slot.
    async fn credits(&self, conn: u32) -> Result<u32, TransferError> {
        self.credits_or(conn, || {}).await
    }

    /// [`Inner::credits`], calling `on_wait` each time it has to wait.
    async fn credits_or(&self, conn: u32, mut on_wait: impl FnMut()) -> Result<u32, TransferError> {
        poll_fn(|cx| {
            let mut st = self.state.borrow_mut();
            let Some(c) = st.conns.get_mut(conn as usize) else {
                return Poll::Ready(Err(TransferError::Connection(conn, "unknown".into())));
            };
            match &c.status {
                ConnStatus::Failed(why) => {
                    return Poll::Ready(Err(TransferError::Connection(conn, why.clone())))
                }
                ConnStatus::Prepared => {
                    return Poll::Ready(Err(TransferError::Connection(
                        conn,
                        "not connected".into(),
                    )))
                }
                ConnStatus::Ready => {}
            }
            if c.credits.available() > 0 {
                Poll::Ready(Ok(c.credits.available()))
            } else {
                c.credit_waiters.push(cx.waker().clone());
                drop(st);
                on_wait();
                Poll::Pending
            }
        })
        .await
    }

    /// Posts `wrs` (a chunk of `plan`) with one doorbell. Returns how many were posted.
    fn post_chunk(
        &self,
        conn: u32,
        job: &Job<'_>,
        range: std::ops::Range<usize>,
    ) -> Result<usize, TransferError> {
        let Job {
            op,
            slot,
            plan,
            notify_imm,
            regions,
        } = *job;
        let mut st = self.state.borrow_mut();
        let State {
            conns,
            inflight,
            batch,
            ..
        } = &mut *st;
        let c = conns
            .get_mut(conn as usize)
            .ok_or_else(|| TransferError::Connection(conn, "unknown".into()))?;
        batch.clear();
        let n = range.len();
        let signals = c.credits.plan(n as u32);
        for (i, signal) in range.clone().zip(signals.flags()) {
            let wr = &plan.wrs[i];
            let is_last_of_transfer = i + 1 == plan.wrs.len();
            let op = match (op, notify_imm) {
                (Op::Write, Some(imm)) if is_last_of_transfer => SendOp::WriteWithImm {
                    remote_addr: wr.remote_addr,
                    rkey: wr.rkey,
                    imm,
                },
                (Op::Write, _) => SendOp::Write {
                    remote_addr: wr.remote_addr,
                    rkey: wr.rkey,
                },
                (Op::Read, _) => SendOp::Read {
                    remote_addr: wr.remote_addr,
                    rkey: wr.rkey,
                },
            };
            let inline = c.inline(&op, wr.bytes);
            batch.push(
                slot.wr_id(signal),
                op,
                plan.sges_of(wr),
                SendFlags {
                    signaled: signal,
                    inline,
                    ..SendFlags::default()
                },
            );
        }
        match c.qp.post_send_in(batch, regions) {
            Ok(()) => {
                let signaled = signals.signaled();
                c.credits.commit(signals);
                inflight.add_signaled(slot, signaled);
                bump(&self.counters, |k| {
                    k.work_requests += n as u64;
                    k.doorbells += 1;
                });
                Ok(n)
            }
            // Nothing of a refused batch counts; the connection is failed by the caller.
            Err(e) => Err(TransferError::Post(e.to_string())),
        }
    }

    fn route(&self, wc: &WorkCompletion) {
        let wr_id = wc.wr_id();
        if wr_id & RECV_BIT != 0 {
            self.route_recv(wc);
            return;
        }
        let signaled = crate::inflight::decode_wr_id(wr_id).2;
        let status = if wc.is_success() {
            Ok(())
        } else {
            Err(TransferError::from_status(wc.status()))
        };
        let mut st = self.state.borrow_mut();
        let qpn = wc.qp_num();
        let conn = st
            .qpn_to_conn
            .iter()
            .find(|&&(q, _)| q == qpn)
            .map(|&(_, c)| c);
        let mut wake = Vec::new();
        let mut failed = None;
        if let Some(c) = conn.and_then(|k| st.conns.get_mut(k as usize)) {
            if signaled {
                c.credits.on_signaled_completion();
                wake.append(&mut c.credit_waiters);
            }
            if !wc.is_success() && c.status == ConnStatus::Ready {
                c.status = ConnStatus::Failed(wc.status().to_string());
                wake.append(&mut c.credit_waiters);
                wake.extend(c.inbox_waiter.take());
                failed = conn;
            }
        }
        match st.inflight.on_completion(wr_id, status) {
            Routed::Stale => {
                bump(&self.counters, |c| c.stale_completions += 1);
                tracing::debug!(wr_id, "completion for a released slot ignored");
            }
            Routed::Progress | Routed::Finished | Routed::Released => {}
        }
        if let Some(conn) = failed {
            tracing::warn!(conn, status = %wc.status(), "connection failed by an error completion");
            st.inflight.fail_connection(conn, &TransferError::Flushed);
        }
        drop(st);
        for w in wake {
            w.wake();
        }
    }

    fn route_recv(&self, wc: &WorkCompletion) {
        let conn = ((wc.wr_id() >> 16) & 0xffff) as u32;
        let index = (wc.wr_id() & 0xffff) as u32;
        let mut st = self.state.borrow_mut();
        let Some(c) = st.conns.get_mut(conn as usize) else {
            return;
        };
        if !wc.is_success() {
            // Flushed receives of a failing connection.
            return;
        }
        let max = self.cfg.max_message;
        let msg = match wc.opcode() {
            WcOpcode::RecvRdmaWithImm => Message::Immediate(wc.imm_data().unwrap_or(0)),
            _ => {
                let mut data = vec![0u8; wc.byte_len() as usize];
                let _ = c.recv_region.read_at(u64::from(index * max), &mut data);
                Message::Data(data, wc.imm_data())
            }
        };
        c.inbox.push_back(msg);
        let waiter = c.inbox_waiter.take();
        // Repost the buffer.
        let mut r = RecvBatch::default();
        r.push(
            recv_wr_id(conn, index),
            &[Sge {
                addr: c.recv_region.addr() + u64::from(index * max),
                length: max,
                lkey: c.recv_region.lkey(),
            }],
        );
        if let Err(e) = c.qp.post_recv_in(&mut r, c.recv_region.nic_slice()) {
            tracing::warn!(conn, error = %e, "reposting a receive failed");
        }
        drop(st);
        if let Some(w) = waiter {
            w.wake();
        }
    }
}

/// A WRITE_WITH_IMM notification needs a WRITE.
fn check_notify(op: Op, notify_imm: bool) -> Result<(), TransferError> {
    if notify_imm && op == Op::Read {
        return Err(TransferError::Post("notify_imm needs a WRITE".into()));
    }
    Ok(())
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
    check_notify(op, notify_imm)?;
    let (limits, epoch) =
        inner.live_conn(conn.0, |c| (inner.limits(op, &c.qp, c.max_msg), c.epoch))?;
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
        if r.registration().is_none() {
            return Err(InvalidDescriptor::NotRegistered { index: index() }.into());
        }
        if r.engine_id() != inner.id {
            return Err(InvalidDescriptor::ForeignRegion { index: index() }.into());
        }
        regions.push(RegionInfo {
            addr: r.addr(),
            len: r.len(),
            lkey: r.lkey(),
        });
    }
    plan::plan_into(plan, &regions, local.descs(), &remote.0, limits)?;
    Ok(epoch)
}

async fn transfer_inner(
    inner: Rc<Inner>,
    conn: ConnId,
    op: Op,
    local: &LocalDescList,
    remote: &RemoteDescList,
    opts: TransferOptions,
    span: tracing::Span,
) -> Result<TransferStats, TransferError> {
    let clock = || inner.cfg.timing.then(Instant::now);
    let t0 = clock();
    let mut plan = inner.plans.borrow_mut().pop().unwrap_or_default();
    if let Err(e) = check_and_plan(
        &inner,
        conn,
        op,
        local,
        remote,
        opts.notify_imm.is_some(),
        &mut plan,
    ) {
        inner.recycle_plan(plan);
        return Err(e);
    }
    span.record("bytes", plan.bytes);
    span.record("wrs", plan.wrs.len());
    let prepared = clock();
    let (guard, doorbells) = post_plan(&inner, conn, op, &plan, local.regions(), &opts).await;
    let (bytes, work_requests) = (plan.bytes, plan.wrs.len());
    // The plan goes back to the pool before the wait: concurrent transfers share few plans.
    inner.recycle_plan(plan);
    let posted = clock();
    wait_slot(guard).await?;
    Ok(TransferStats {
        bytes,
        descriptors: local.len(),
        work_requests,
        doorbells,
        prepare: since(t0, prepared),
        post: since(prepared, posted),
        total: since(t0, clock()),
    })
}

async fn post_prepared(
    inner: &Rc<Inner>,
    p: &PreparedTransfer,
    opts: &TransferOptions,
) -> Result<TransferStats, TransferError> {
    let clock = || inner.cfg.timing.then(Instant::now);
    let t0 = clock();
    if p.engine != inner.id {
        return Err(InvalidDescriptor::ForeignRegion { index: 0 }.into());
    }
    check_notify(p.op, opts.notify_imm.is_some())?;
    if inner.live_conn(p.conn.0, |c| c.epoch)? != p.epoch {
        return Err(TransferError::Connection(
            p.conn.0,
            "prepared for a connection that is gone".into(),
        ));
    }
    let (guard, doorbells) = post_plan(inner, p.conn, p.op, &p.plan, &p.regions, opts).await;
    let posted = clock();
    wait_slot(guard).await?;
    Ok(TransferStats {
        bytes: p.plan.bytes,
        descriptors: p.descriptors,
        work_requests: p.plan.wrs.len(),
        doorbells,
        prepare: Duration::ZERO,
        post: since(t0, posted),
        total: since(t0, clock()),
    })
}

/// Takes an in-flight slot for `plan` (keeping `regions` registered until the NIC is done), arms
/// its deadline and posts its work requests (or queues them for a coalesced post). Returns the
/// slot's guard and the doorbells rung. A post error ends the slot's posting: the error is the
/// transfer's result once its posted work has completed or flushed.
async fn post_plan(
    inner: &Rc<Inner>,
    conn: ConnId,
    op: Op,
    plan: &Plan,
    regions: &[Region],
    opts: &TransferOptions,
) -> (SlotGuard, usize) {
    let nic_buffers: SmallVec<[&dyn OwnedRegistration; 4]> =
        regions.iter().filter_map(Region::registration).collect();
    let slot = inner.state.borrow_mut().inflight.insert(
        conn.0,
        KeepAlive {
            _regions: regions.iter().cloned().collect(),
            _message: None,
        },
    );
    let mut guard = SlotGuard {
        inner: Rc::clone(inner),
        slot,
        armed: true,
        timeout: Some((conn.0, opts.timeout.unwrap_or(inner.cfg.transfer_timeout))),
    };
    let job = Job {
        op,
        slot,
        plan,
        notify_imm: opts.notify_imm,
        regions: &nic_buffers,
    };
    let batch = inner.cfg.post_batch.max(1) as usize;
    let mut next = 0usize;
    let mut doorbells = 0usize;
    let mut post_err = None;
    let coalesced = inner.cfg.coalesce
        && plan.wrs.len() <= COALESCE_MAX_WRS
        && opts.notify_imm.is_none()
        && !inner.post_at_once(conn.0);
    if coalesced {
        // Posted by this tick's flush; the flush ends posting for the slot.
        if let Err(e) = inner.enqueue(conn.0, slot, op, plan) {
            post_err = Some(e);
        }
        next = plan.wrs.len();
    }
    while next < plan.wrs.len() {
        let free = match inner.credits_or(conn.0, || guard.arm_deadline()).await {
            Ok(f) => f as usize,
            Err(e) => {
                post_err = Some(e);
                break;
            }
        };
        let end = (next + free.min(batch)).min(plan.wrs.len());
        match inner.post_chunk(conn.0, &job, next..end) {
            Ok(n) => {
                next += n;
                doorbells += 1;
                inner.kick_progress();
            }
            Err(e) => {
                inner.fail_connection(conn.0, "post failed", &TransferError::Flushed);
                post_err = Some(e);
                break;
            }
        }
    }
    if !coalesced || post_err.is_some() {
        let mut st = inner.state.borrow_mut();
        if let Some(e) = post_err {
            st.inflight.fail(slot, e);
        }
        st.inflight.end_posting(slot);
    }
    (guard, doorbells)
}

/// Waits for the slot of `guard` to complete and releases it.
async fn wait_slot(mut guard: SlotGuard) -> Result<(), TransferError> {
    let inner = Rc::clone(&guard.inner);
    let slot = guard.slot;
    let result = poll_fn(|cx| {
        let r = inner.poll_slot(slot, cx);
        if r.is_pending() {
            guard.arm_deadline();
        }
        r
    })
    .await;
    guard.armed = false;
    result
}

/// Ends every queued (not yet posted) transfer of `c` with `err`.
fn fail_queue(c: &mut Conn, inflight: &mut InflightTable<KeepAlive>, err: &TransferError) {
    for q in c.queue.drain(..) {
        inflight.fail(q.slot, err.clone());
        if q.last {
            inflight.finish_posting(q.slot);
        }
    }
}

impl Inner {
    /// Queues a small transfer's requests for this tick's coalesced post (see
    /// [`EngineConfig::coalesce`]) and makes sure a flush is scheduled.
    fn enqueue(
        self: &Rc<Self>,
        conn: u32,
        slot: SlotId,
        op: Op,
        plan: &Plan,
    ) -> Result<(), TransferError> {
        let mut st = self.state.borrow_mut();
        let c = st
            .conns
            .get_mut(conn as usize)
            .ok_or_else(|| TransferError::Connection(conn, "unknown".into()))?;
        match &c.status {
            ConnStatus::Ready => {}
            ConnStatus::Failed(why) => return Err(TransferError::Connection(conn, why.clone())),
            ConnStatus::Prepared => {
                return Err(TransferError::Connection(conn, "not connected".into()))
            }
        }
        let n = plan.wrs.len();
        for (i, wr) in plan.wrs.iter().enumerate() {
            let op = match op {
                Op::Write => SendOp::Write {
                    remote_addr: wr.remote_addr,
                    rkey: wr.rkey,
                },
                Op::Read => SendOp::Read {
                    remote_addr: wr.remote_addr,
                    rkey: wr.rkey,
                },
            };
            c.queue.push_back(QueuedWr {
                slot,
                op,
                sges: plan.sges_of(wr).to_vec(),
                last: i + 1 == n,
                count: if i == 0 { n } else { 0 },
            });
        }
        bump(&self.counters, |k| k.queued += 1);
        if !c.flush_scheduled {
            c.flush_scheduled = true;
            drop(st);
            glommio::spawn_local(flush_queue(Rc::clone(self), conn)).detach();
        }
        Ok(())
    }

    /// Posts whole queued transfers of `conn` that fit in `free` send-queue slots with one
    /// doorbell. Only the batch's last request and every `signal_interval`-th are signaled; a
    /// transfer whose last request is unsignaled is covered by the batch's last transfer.
    /// Returns how many requests were posted (0: the first transfer needs more credits).
    fn post_queued(&self, conn: u32, free: usize) -> Result<usize, TransferError> {
        let mut st = self.state.borrow_mut();
        let State {
            conns,
            inflight,
            batch,
            ..
        } = &mut *st;
        let c = conns
            .get_mut(conn as usize)
            .ok_or_else(|| TransferError::Connection(conn, "unknown".into()))?;
        // Transfers whose futures went away before posting: drop their requests (their memory
        // may already be released).
        c.queue.retain(|q| inflight.contains(q.slot));
        let limit = free.min(self.cfg.post_batch.max(1) as usize);
        let mut n = 0;
        let mut i = 0;
        while let Some(q) = c.queue.get(i) {
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
        batch.clear();
        let mut regions: Vec<Region> = Vec::new();
        for (q, signal) in c.queue.iter().take(n).zip(signals.flags()) {
            let bytes: u64 = q.sges.iter().map(|g| u64::from(g.length)).sum();
            let inline = c.inline(&q.op, bytes);
            batch.push(
                q.slot.wr_id(signal),
                q.op,
                &q.sges,
                SendFlags {
                    signaled: signal,
                    inline,
                    ..SendFlags::default()
                },
            );
            if let Some(k) = inflight.keepalive(q.slot) {
                for r in &k._regions {
                    if !regions.iter().any(|x| x.same(r)) {
                        regions.push(r.clone());
                    }
                }
            }
        }
        let regs: Vec<&dyn rixl_verbs::OwnedRegistration> =
            regions.iter().filter_map(Region::registration).collect();
        if let Err(e) = c.qp.post_send_in(batch, &regs) {
            return Err(TransferError::Post(e.to_string()));
        }
        let flags: Vec<bool> = signals.flags().collect();
        c.credits.commit(signals);
        let posted: Vec<QueuedWr> = c.queue.drain(..n).collect();
        // Transfers whose last request is unsignaled complete with the next signaled request
        // (the batch's last request is always signaled).
        let mut uncovered: Vec<SlotId> = Vec::new();
        for (q, signal) in posted.iter().zip(flags) {
            if signal {
                inflight.add_signaled(q.slot, 1);
                for a in uncovered.drain(..) {
                    inflight.cover(q.slot, a);
                }
            } else if q.last {
                uncovered.push(q.slot);
            }
        }
        for q in posted.iter().filter(|q| q.last) {
            inflight.finish_posting(q.slot);
        }
        bump(&self.counters, |k| {
            k.work_requests += n as u64;
            k.doorbells += 1;
        });
        Ok(n)
    }

    /// Coalescing: whether a small transfer on `conn` is posted at once, because it is the
    /// first of this progress turn and nothing is queued before it (a lone transfer does not
    /// wait for the flush; the ones that follow it in the same turn share a doorbell).
    fn post_at_once(&self, conn: u32) -> bool {
        let turn = self.turn.get();
        let mut st = self.state.borrow_mut();
        match st.conns.get_mut(conn as usize) {
            Some(c) if c.queue.is_empty() && !c.flush_scheduled && c.immediate_turn != turn => {
                c.immediate_turn = turn;
                true
            }
            _ => false,
        }
    }

    /// Waits until `conn` has at least `k` free send-queue slots (or fails).
    async fn credits_at_least(&self, conn: u32, k: usize) -> Result<usize, TransferError> {
        loop {
            let free = self.credits(conn).await? as usize;
            if free >= k {
                return Ok(free);
            }
            // Fewer than a whole transfer: wait for the next signaled completion.
            poll_fn(|cx| {
                let mut st = self.state.borrow_mut();
                match st.conns.get_mut(conn as usize) {
                    Some(c)
                        if (c.credits.available() as usize) < k
                            && c.status == ConnStatus::Ready =>
                    {
                        c.credit_waiters.push(cx.waker().clone());
                        Poll::Pending
                    }
                    _ => Poll::Ready(()),
                }
            })
            .await;
        }
    }
}

/// Posts `conn`'s queued small transfers, one doorbell per batch, until the queue is empty.
async fn flush_queue(inner: Rc<Inner>, conn: u32) {
    // glommio's `spawn_local` runs a new task at once, inside the spawner's poll: without this
    // yield the flush would post the one transfer just queued. Yielding first puts it behind
    // the tasks already runnable in this tick, so their transfers share its doorbell.
    futures_lite::future::yield_now().await;
    loop {
        let need = {
            let st = inner.state.borrow();
            let Some(c) = st.conns.get(conn as usize) else {
                return;
            };
            c.queue.front().map(|q| q.count.max(1))
        };
        let Some(need) = need else {
            if let Some(c) = inner.state.borrow_mut().conns.get_mut(conn as usize) {
                c.flush_scheduled = false;
            }
            return;
        };
        let result = match inner.credits_at_least(conn, need).await {
            Ok(free) => inner.post_queued(conn, free),
            Err(e) => Err(e),
        };
        match result {
            Ok(_) => inner.kick_progress(),
            Err(e) => {
                if matches!(e, TransferError::Post(_)) {
                    inner.fail_connection(conn, "post failed", &TransferError::Flushed);
                }
                let mut st = inner.state.borrow_mut();
                let State {
                    conns, inflight, ..
                } = &mut *st;
                if let Some(c) = conns.get_mut(conn as usize) {
                    fail_queue(c, inflight, &e);
                    c.flush_scheduled = false;
                }
                return;
            }
        }
    }
}

/// Posts one signaled work request (SEND) owning `keep` until completion.
async fn post_single(
    inner: Rc<Inner>,
    conn: ConnId,
    op: SendOp,
    sge: Sge,
    keep: KeepAlive,
) -> Result<(), TransferError> {
    inner.credits(conn.0).await?;
    let msg_region = inner.msg_region.clone();
    let slot = inner.state.borrow_mut().inflight.insert(conn.0, keep);
    let guard = SlotGuard {
        inner: Rc::clone(&inner),
        slot,
        armed: true,
        timeout: Some((conn.0, inner.cfg.transfer_timeout)),
    };
    let posted = {
        let mut st = inner.state.borrow_mut();
        let State {
            conns,
            inflight,
            batch,
            ..
        } = &mut *st;
        let c = conns
            .get_mut(conn.0 as usize)
            .ok_or_else(|| TransferError::Connection(conn.0, "unknown".into()))?;
        batch.clear();
        let flags = SendFlags {
            inline: c.inline(&op, u64::from(sge.length)),
            ..SendFlags::SIGNALED
        };
        batch.push(slot.wr_id(true), op, &[sge], flags);
        match c.qp.post_send_in(batch, msg_region.nic_slice()) {
            Ok(()) => {
                c.credits.commit(c.credits.plan(1));
                inflight.add_signaled(slot, 1);
                Ok(())
            }
            Err(e) => Err(TransferError::Post(e.to_string())),
        }
    };
    if let Err(e) = posted {
        inner.state.borrow_mut().inflight.fail(slot, e);
    }
    inner.state.borrow_mut().inflight.end_posting(slot);
    inner.kick_progress();
    let r = wait_slot(guard).await;
    // A freed message slot may unblock a waiting sender.
    for w in inner.msg_waiters.borrow_mut().drain(..) {
        w.wake();
    }
    r
}

/// The per-core progress task: reaps completions in batches and wakes futures; busy-polls
/// (yielding) only while work is in flight, parks when nothing is.
async fn progress(inner: Rc<Inner>) {
    let mut wcs = vec![WorkCompletion::default(); inner.cfg.poll_batch.max(1)];
    loop {
        let turn = inner.turn.get() + 1;
        inner.turn.set(turn);
        // Read the clock only every few iterations (clock reads are syscalls on some clock
        // sources); event-mode iterations are slow anyway.
        let tick = turn.is_multiple_of(32) || inner.cfg.poll_mode == PollMode::Event;
        if tick {
            inner.clock.set(Some(Instant::now()));
        }
        let n = match inner.cq.poll(&mut wcs) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(error = %e, "polling the CQ failed");
                0
            }
        };
        if n > 0 {
            inner.route_polled(&wcs[..n]);
            // Let the woken futures run.
            futures_lite::future::yield_now().await;
            continue;
        }
        bump(&inner.counters, |c| c.empty_polls += 1);
        inner
            .quiet_polls
            .set(inner.quiet_polls.get().saturating_add(1));
        if tick && !inner.state.borrow().deadlines.is_empty() {
            if let Some(now) = inner.clock.get() {
                inner.expire_deadlines(now);
            }
        }
        // One borrow and one pass over the connections per empty poll.
        let (idle, waiting_recv) = {
            let st = inner.state.borrow();
            let mut idle = st.inflight.signaled_outstanding() == 0;
            let mut waiting_recv = false;
            for (_, c) in st.conns.iter() {
                idle &= c.credits.is_idle();
                waiting_recv |= c.inbox_waiter.is_some() && c.status == ConnStatus::Ready;
            }
            (idle, waiting_recv)
        };
        if idle && inner.shutdown.get() {
            tracing::info!(engine = inner.id, "progress task stopped");
            return;
        }
        if idle && !waiting_recv {
            // Park until a submitter kicks us: no CPU while idle.
            bump(&inner.counters, |c| c.parks += 1);
            inner.clock.set(None);
            {
                // Nothing is in flight: no deadline can matter any more.
                let mut st = inner.state.borrow_mut();
                if st.inflight.is_empty() {
                    st.deadlines.clear();
                }
            }
            poll_fn(|cx| {
                if inner.kick.replace(false) {
                    Poll::Ready(())
                } else {
                    *inner.progress_waker.borrow_mut() = Some(cx.waker().clone());
                    Poll::Pending
                }
            })
            .await;
            continue;
        }
        let spin_for_recv = waiting_recv && inner.quiet_polls.get() < inner.cfg.recv_spin_polls;
        match inner.cfg.poll_mode {
            PollMode::Busy if !idle || spin_for_recv => futures_lite::future::yield_now().await,
            _ => {
                // Event mode (or only receives pending): arm, poll again (drain-after-arm), then
                // wait for the event off the core.
                if inner.cq.req_notify(false).is_ok() {
                    let n = inner.cq.poll(&mut wcs).unwrap_or(0);
                    if n > 0 {
                        for wc in &wcs[..n] {
                            inner.route(wc);
                        }
                        continue;
                    }
                    bump(&inner.counters, |c| c.event_waits += 1);
                    let cq = inner.cq.clone();
                    let _ = glommio::executor()
                        .spawn_blocking(move || cq.wait_event(Some(Duration::from_millis(20))))
                        .await;
                } else {
                    // No event channel (busy mode): a short timer instead of spinning.
                    glommio::timer::sleep(Duration::from_micros(200)).await;
                }
            }
        }
    }
}
