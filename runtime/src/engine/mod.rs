//! The per-core engine: owns its device context, PD, CQ and queue pairs, and the transfer core
//! ([`rixl_proto::Core`]) that holds every connection's and transfer's state. Futures poll the core;
//! a progress task reaps completions and wakes them. Everything here is `!Send` and lock-free: it
//! lives on one glommio executor. Use [`crate::EngineHandle`] to submit from other threads.

mod config;
mod events;
mod grant;
mod message;
mod nic;
mod progress;
mod transfer;
mod wait;

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use rixl_proto::{ConnParams, Core, CoreConfig};
use rixl_verbs::{
    AccessFlags, CompletionQueue, Context, DeviceAttributes, Endpoint, ProtectionDomain, QueuePair,
    QueuePairCapabilities, RegisteredBuffer,
};

use crate::desc::{Region, SharedMr};
use crate::error::{RuntimeError, TransferError};
use crate::id::next_engine_id;

pub use config::{EngineConfig, PollMode};
pub use grant::{Access, Grant, GrantSpec};
pub use rixl_proto::{
    ConnId, DescriptorRanges, EngineCounters, Message, Progress, Received, TransferFailure,
    TransferOptions, TransferStats,
};
pub use transfer::PreparedTransfer;

use nic::VerbsQueue;

/// How long [`Engine::close_connection`] lets posted work finish before failing the connection.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// How long [`Engine::close_connection`] waits, once it has failed the connection, for the NIC
/// to flush what is left. A NIC that flushes nothing in that time leaves the connection in
/// place (failed, its memory kept by the in-flight table) rather than hanging the close.
pub const FLUSH_GRACE: Duration = Duration::from_secs(10);

/// Send-message slots of the engine's registered message pool.
const MESSAGE_SLOTS: u32 = 64;

pub(crate) struct Inner {
    id: u64,
    cfg: EngineConfig,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    device: DeviceAttributes,
    /// Every connection's and transfer's state. Field order: dropped after `pd` and `cq` handles
    /// (queue pairs keep their parents alive), and inside it queue pairs go before the in-flight
    /// keep-alives release their memory.
    core: RefCell<Core<VerbsQueue>>,
    kick: Cell<bool>,
    /// Empty polls since the last completion or submission.
    quiet_polls: Cell<u32>,
    progress_waker: RefCell<Option<Waker>>,
    shutdown: Cell<bool>,
    msg_region: Region,
    msg_slots: Rc<RefCell<nic::MessageSlots>>,
    /// Whether the engine's port is up (a port-down async event clears it, port-active sets
    /// it): connections are refused while it is down.
    port_up: Cell<bool>,
    /// A CQ poll failed (see `nic::VerbsCq`).
    cq_failed: Cell<bool>,
    /// Tells the async event reader thread to stop (engine shutdown).
    events_stop: Arc<std::sync::atomic::AtomicBool>,
    /// Takes the commands other threads sent to this core ([`Engine::set_command_pump`]).
    pump: RefCell<Option<Box<dyn Fn()>>>,
    /// The completion buffers of a future's own reap (kept: filling fresh ones on every poll
    /// was a few hundred bytes of stores per transfer).
    reap_buffers: RefCell<wait::ReapBuffers>,
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
            .field("counters", &self.counters())
            .finish()
    }
}

/// What opening a device gives an engine.
struct Opened {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    device: DeviceAttributes,
    messages: RegisteredBuffer,
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
        let opened = glommio::executor()
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
                let messages = RegisteredBuffer::new(
                    &pd,
                    (c.max_message as usize) * MESSAGE_SLOTS as usize,
                    AccessFlags::LOCAL_WRITE,
                )?;
                Ok(Opened {
                    pd,
                    cq,
                    device,
                    messages,
                })
            })
            .await?;
        let capacity_needed = cfg.max_connections * (cfg.send_queue_depth + cfg.recv_buffers);
        if opened.cq.capacity() < capacity_needed {
            return Err(RuntimeError::Limit(format!(
                "device CQ holds {} entries but {} connections x ({} + {}) need {capacity_needed}",
                opened.cq.capacity(),
                cfg.max_connections,
                cfg.send_queue_depth,
                cfg.recv_buffers
            )));
        }
        let mut core_cfg = CoreConfig::default();
        core_cfg.post_batch = cfg.post_batch;
        core_cfg.signal_interval = cfg.signal_interval;
        core_cfg.coalesce = cfg.coalesce;
        core_cfg.max_sge_rd = opened.device.max_sge_rd;
        core_cfg.transfer_timeout = cfg.transfer_timeout;
        let inner = Rc::new(Inner {
            id,
            msg_region: Region::new(opened.messages, id),
            msg_slots: Rc::new(RefCell::new(nic::MessageSlots::new(MESSAGE_SLOTS))),
            pd: opened.pd,
            cq: opened.cq,
            device: opened.device,
            core: RefCell::new(Core::new(core_cfg)),
            cfg,
            kick: Cell::new(false),
            quiet_polls: Cell::new(0),
            progress_waker: RefCell::new(None),
            shutdown: Cell::new(false),
            port_up: Cell::new(true),
            cq_failed: Cell::new(false),
            events_stop: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            pump: RefCell::new(None),
            reap_buffers: RefCell::default(),
        });
        glommio::spawn_local(progress::supervised(Rc::clone(&inner))).detach();
        events::start(&inner, inner.pd.context(), Arc::clone(&inner.events_stop));
        tracing::info!(engine = id, device = ?inner.cfg.device, "engine started");
        Ok(Engine { inner })
    }

    /// Installs `pump`, which takes the commands other threads sent to this core; the progress
    /// loop calls it at every turn. glommio looks at wake-ups from other threads only when a
    /// task queue runs dry or its 100 ms preemption timer fires, and the progress loop keeps
    /// its queue busy while work (or a receive) is awaited: without the pump, a command sent
    /// then could wait up to 100 ms to start.
    pub(crate) fn set_command_pump(&self, pump: Box<dyn Fn()>) {
        *self.inner.pump.borrow_mut() = Some(pump);
    }

    /// Removes the command pump (it holds the engine; the serving task's shutdown).
    pub(crate) fn clear_command_pump(&self) {
        self.inner.pump.borrow_mut().take();
    }

    /// Engine id (also the id of its protection domain's regions).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The verbs device (NIC) this engine opened, by name (`mlx5_0`, `rxe0`).
    pub fn device_name(&self) -> String {
        self.inner.pd.context().name().to_string()
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> EngineCounters {
        self.inner.core.borrow().counters()
    }

    /// Live in-flight slots (including detached ones the NIC has not finished).
    pub fn inflight(&self) -> usize {
        self.inner.core.borrow().inflight_len()
    }

    /// The access memory is registered with: with window grants, local access and `MW_BIND`
    /// only (peers reach it through the windows [`Self::grant`] binds); otherwise remote read
    /// and write through the region's own rkey (no windows can be bound over it).
    pub fn registration_access(&self) -> AccessFlags {
        registration_access(&self.inner.cfg)
    }

    /// Allocates and registers `len` bytes (page aligned, zeroed) for peers to reach (see
    /// [`Self::registration_access`]).
    /// Registration runs off the core.
    ///
    /// # Errors
    /// [`RuntimeError::Verbs`] if allocation or registration fails.
    pub async fn register(&self, len: usize) -> Result<Region, RuntimeError> {
        let pd = self.inner.pd.clone();
        let access = self.registration_access();
        let buf = glommio::executor()
            .spawn_blocking(move || RegisteredBuffer::new(&pd, len, access))
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
        let access = self.registration_access();
        let reg = glommio::executor()
            .spawn_blocking(move || rixl_verbs::SharedRegistration::register(&pd, mem, access))
            .await?;
        Ok(Region::shared(reg, self.inner.id))
    }

    /// Registers host memory (the caller's, or shared with other engines) as one registration
    /// that several regions may use ([`SharedMr::view`]): the agent's registration cache. Runs
    /// off the core.
    ///
    /// # Errors
    /// [`RuntimeError::Verbs`] with [`rixl_verbs::Error::RegisterMemory`] if the NIC refuses
    /// (`EFAULT`: unmapped, or read-only memory registered for write; `ENOMEM`: memlock).
    pub async fn register_mr(
        &self,
        mem: Arc<rixl_verbs::HostBuffer>,
    ) -> Result<SharedMr, RuntimeError> {
        let pd = self.inner.pd.clone();
        let access = self.registration_access();
        let reg = glommio::executor()
            .spawn_blocking(move || rixl_verbs::SharedRegistration::register(&pd, mem, access))
            .await?;
        Ok(SharedMr::new(reg, self.inner.id))
    }

    /// Allocates `len` bytes on GPU `ordinal` and registers them with this engine's NIC
    /// (GPUDirect RDMA: dma-buf first, nvidia-peermem second). Runs off the core.
    ///
    /// # Errors
    /// [`RuntimeError::Gpu`] without CUDA, for a bad ordinal, or when neither registration path
    /// works.
    pub async fn register_gpu(&self, ordinal: i32, len: usize) -> Result<Region, RuntimeError> {
        let pd = self.inner.pd.clone();
        let access = self.registration_access();
        let reg = glommio::executor()
            .spawn_blocking(move || {
                let gpu = rixl_gpudirect::Gpu::open(ordinal)?;
                let mem = rixl_gpudirect::DeviceMemory::alloc(&gpu, len)?;
                rixl_gpudirect::GpuRegistration::register(&pd, mem, access)
            })
            .await?;
        Ok(Region::gpu(reg, self.inner.id))
    }

    /// Registers the caller's GPU memory (its allocator's, see
    /// [`rixl_gpudirect::DeviceMemory::from_cuda_slice`] and `from_raw`) with this engine's NIC,
    /// as [`Engine::register_gpu`] does for memory it allocates. Runs off the core.
    ///
    /// # Errors
    /// [`RuntimeError::Gpu`] when neither registration path works.
    pub async fn register_device(
        &self,
        mem: rixl_gpudirect::DeviceMemory,
    ) -> Result<Region, RuntimeError> {
        let pd = self.inner.pd.clone();
        let access = self.registration_access();
        let reg = glommio::executor()
            .spawn_blocking(move || rixl_gpudirect::GpuRegistration::register(&pd, mem, access))
            .await?;
        Ok(Region::gpu(reg, self.inner.id))
    }

    /// Registers GPU memory another engine registered too (multi-rail: one allocation, one
    /// registration per NIC) with this engine's NIC. Runs off the core.
    ///
    /// # Errors
    /// [`RuntimeError::Gpu`] when neither registration path works.
    pub async fn register_device_shared(
        &self,
        mem: Arc<rixl_gpudirect::DeviceMemory>,
    ) -> Result<Region, RuntimeError> {
        let pd = self.inner.pd.clone();
        let access = self.registration_access();
        let reg = glommio::executor()
            .spawn_blocking(move || {
                rixl_gpudirect::GpuRegistration::register_shared(&pd, mem, access)
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
        if !self.inner.port_up.get() {
            return Err(RuntimeError::PortDown {
                port: cfg.connect.port,
            });
        }
        if self.inner.core.borrow().connections() >= cfg.max_connections as usize {
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
        let caps = qp.capabilities();
        let queue = VerbsQueue::new(Arc::new(qp), psn, recv_region, cfg.max_message);
        let mut core = self.inner.core.borrow_mut();
        // Post every receive buffer now (INIT accepts receives).
        queue.post_receives(core.next_conn_id().0, 0..cfg.recv_buffers)?;
        let id = core.add_connection(
            queue,
            ConnParams {
                send_queue_depth: caps.max_send_wr,
                max_send_sge: caps.max_send_sge,
                max_inline: caps.max_inline_data,
                recv_buffers: cfg.recv_buffers,
            },
        );
        tracing::debug!(
            engine = self.inner.id,
            conn = id.0,
            qpn = ep.qpn,
            "connection prepared"
        );
        Ok((id, ep))
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
            let core = self.inner.core.borrow();
            let q = core
                .queue(conn)
                .ok_or(RuntimeError::UnknownConnection(conn.0))?;
            (Arc::clone(&q.qp), q.psn)
        };
        let opts = self.inner.cfg.connect;
        let q = Arc::clone(&qp);
        glommio::executor()
            .spawn_blocking(move || -> Result<(), rixl_verbs::Error> {
                q.to_rtr(&remote, &opts)?;
                q.to_rts(psn, &opts)
            })
            .await?;
        self.inner
            .core
            .borrow_mut()
            .connected(conn, u64::from(qp.max_message_size()));
        tracing::debug!(engine = self.inner.id, conn = conn.0, "connection ready");
        Ok(())
    }

    /// Connections this engine holds (prepared, ready, failed or closing).
    pub fn connections(&self) -> usize {
        self.inner.core.borrow().connections()
    }

    /// Counts a contained panic of a task on this engine's core.
    pub(crate) fn note_task_panic(&self) {
        self.inner.note_task_panic();
    }

    /// Whether `conn` exists and is ready for transfers (not failed, not closing).
    pub fn connection_usable(&self, conn: ConnId) -> bool {
        matches!(
            self.inner.core.borrow().state(conn),
            Some(rixl_proto::ConnState::Ready)
        )
    }

    /// Fails a connection: its QP moves to ERROR, every outstanding transfer on it ends with
    /// [`TransferError::Flushed`] (or its own earlier error) once the NIC has flushed its work.
    pub fn abort_connection(&self, conn: ConnId, reason: &str) {
        self.inner
            .fail_connection(conn, reason, &TransferError::Flushed);
    }

    /// Closes a connection gracefully: work already posted gets up to [`CLOSE_GRACE`] to
    /// complete, then the connection is failed (the QP flushes what is left), and once nothing of
    /// it is in flight its queue pair is destroyed. A NIC that has not flushed within
    /// [`FLUSH_GRACE`] after that leaves the failed connection in place (logged), with its
    /// in-flight memory still held.
    pub async fn close_connection(&self, conn: ConnId) {
        if !self.wait_idle_within(conn, CLOSE_GRACE).await {
            tracing::debug!(
                conn = conn.0,
                "close: work still in flight after the grace period"
            );
        }
        self.abort_connection(conn, "closed");
        if !self.wait_idle_within(conn, FLUSH_GRACE).await {
            tracing::error!(
                conn = conn.0,
                "close: the NIC has not flushed the failed connection's work; it stays in place"
            );
            return;
        }
        let queue = self.inner.core.borrow_mut().remove_connection(conn);
        drop(queue);
    }

    /// Waits up to `limit` until no work request of `conn` awaits completion; whether it came
    /// to that.
    async fn wait_idle_within(&self, conn: ConnId, limit: Duration) -> bool {
        futures_lite::future::or(
            async {
                self.wait_idle(conn).await;
                true
            },
            async {
                glommio::timer::Timer::new(limit).await;
                false
            },
        )
        .await
    }

    /// Waits until no work request of `conn` awaits completion.
    async fn wait_idle(&self, conn: ConnId) {
        let inner = Rc::clone(&self.inner);
        poll_fn(|cx| {
            let r = inner.core.borrow_mut().poll_idle(conn, cx);
            if r.is_pending() {
                inner.kick_progress();
            }
            r
        })
        .await;
    }

    /// Stops the engine: fails every connection, waits until the NIC has flushed all in-flight
    /// work, and ends the progress task. Regions stay valid (they belong to their handles).
    pub async fn shutdown(self) {
        // Closed side by side: each may wait out its grace periods (a dead peer's work).
        let conns = self.inner.core.borrow().connection_ids();
        let closes = conns
            .into_iter()
            .map(|c| Box::pin(self.close_connection(c)))
            .collect();
        crate::join::join_all(closes).await;
        self.inner.shutdown.set(true);
        self.inner
            .events_stop
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.inner.kick_progress();
    }
}

impl Inner {
    /// Wakes the progress task (work was posted or a connection failed).
    #[inline(always)]
    fn kick_progress(&self) {
        self.kick.set(true);
        self.quiet_polls.set(0);
        if let Some(w) = self.progress_waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Counts a contained panic of a task on this core.
    fn note_task_panic(&self) {
        self.core.borrow_mut().counters_mut().task_panics += 1;
    }

    fn fail_connection(&self, conn: ConnId, reason: &str, err: &TransferError) {
        self.core.borrow_mut().fail_connection(conn, reason, err);
        self.kick_progress();
    }
}

/// A random 32-bit value from the OS's CSPRNG (initial PSNs: a peer cannot predict them).
/// Falls back to the clock, hashed, should the OS source fail (it does not on Linux >= 3.17).
fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    match getrandom::getrandom(&mut b) {
        Ok(()) => u32::from_ne_bytes(b),
        Err(e) => {
            tracing::warn!(error = %e, "no OS randomness; the initial PSN comes from the clock");
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
                .wrapping_mul(2_654_435_761)
        }
    }
}

/// The access flags registrations get under `cfg`.
fn registration_access(cfg: &EngineConfig) -> AccessFlags {
    if cfg.window_grants {
        AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND
    } else {
        AccessFlags::ALL_RDMA
    }
}
