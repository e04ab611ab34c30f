//! A `Send` handle to an engine running on another core: each call ships a job to the core that
//! owns the engine and resolves on the caller's side when the job's future ends there.

use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use futures_channel::{mpsc, oneshot};
use rixl_verbs::{Endpoint, HostBuffer};

use crate::desc::{LocalDescList, Op, Region, RemoteDescList, SharedMr};
use crate::engine::{
    ConnId, Engine, EngineConfig, EngineCounters, Message, PreparedTransfer, TransferOptions,
    TransferStats,
};
use crate::error::{RuntimeError, TransferError};
use crate::file::{FileCounters, FileDesc, FileError, FileId, FileInfo, FileSpec, FileStore};
use crate::supervise;
use rixl_proto::TransferFailure;

pub use rixl_nvlink::ipc::DeviceCopy;

/// What a job finds on its core: the engine (if the core has a NIC), the FILE tier, the core's
/// configuration and the id its host regions carry.
#[derive(Clone)]
struct Served {
    engine: Option<Engine>,
    files: Rc<FileStore>,
    cfg: Rc<EngineConfig>,
    id: u64,
    /// The tasks its jobs started that are still running.
    live: Rc<serve::LiveJobs>,
}

impl Served {
    /// The engine, or `no_nic` on a core without one.
    fn rdma<E>(&self, no_nic: E) -> Result<&Engine, E> {
        self.engine.as_ref().ok_or(no_nic)
    }
}

/// A job run on the core (it spawns its own task there).
type Job = Box<dyn FnOnce(Served) + Send>;

enum Command {
    Run(Job),
    Shutdown(oneshot::Sender<()>),
}

/// Why a job on a core gave no output.
#[derive(Debug)]
enum Lost {
    /// The engine has shut down.
    Gone,
    /// The job panicked (its message).
    Panicked(String),
    /// The core did not answer within the caller's bound (see [`bound`]).
    Stalled(Duration),
}

impl From<bound::Stalled> for Lost {
    fn from(s: bound::Stalled) -> Self {
        Lost::Stalled(s.0)
    }
}

impl From<Lost> for TransferError {
    fn from(l: Lost) -> Self {
        match l {
            Lost::Gone => TransferError::EngineGone,
            Lost::Panicked(m) => TransferError::EnginePanic(m),
            Lost::Stalled(d) => TransferError::EngineStalled(d),
        }
    }
}

impl From<Lost> for RuntimeError {
    fn from(l: Lost) -> Self {
        match l {
            Lost::Gone => RuntimeError::EngineGone,
            Lost::Panicked(m) => RuntimeError::EnginePanic(m),
            Lost::Stalled(d) => RuntimeError::EngineStalled(d),
        }
    }
}

impl From<Lost> for FileError {
    fn from(l: Lost) -> Self {
        match l {
            Lost::Gone => FileError::EngineGone,
            Lost::Panicked(m) => FileError::EnginePanic(m),
            Lost::Stalled(d) => FileError::EngineStalled(d),
        }
    }
}

/// The error a call returns for a lost job.
fn lost<T, E: From<Lost>>(l: Lost) -> Result<T, E> {
    Err(l.into())
}

/// A transfer's failure for a lost job: nothing posted if the engine was gone; unknown
/// progress if its task panicked.
fn lost_transfer(l: Lost, descriptors: usize) -> TransferFailure {
    match l {
        Lost::Gone => TransferFailure::before_posting(TransferError::EngineGone, descriptors),
        Lost::Panicked(m) => TransferFailure::unknown(TransferError::EnginePanic(m), descriptors),
        Lost::Stalled(d) => TransferFailure::unknown(TransferError::EngineStalled(d), descriptors),
    }
}

/// Logs and counts a job's contained panic.
fn contained(engine: Option<&Engine>, p: supervise::Panicked) -> Lost {
    tracing::error!(engine = engine.map(Engine::id), panic = %p.0, "a call's task panicked on its engine core; only its call failed");
    if let Some(e) = engine {
        e.note_task_panic();
    }
    Lost::Panicked(p.0)
}

/// A `Send + Clone` handle to an engine: any thread or task can submit work to the engine that
/// owns the connection; each call's future resolves on the caller's side. Dropping a
/// transfer's future cancels it on the core: requests not yet posted are never posted, posted
/// ones drain, and memory stays registered until the NIC is done.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    id: u64,
    nic: bool,
    /// The NIC's verbs device name (`None` on a core without one).
    device: Option<Arc<str>>,
    hand_offs: Arc<local::HandOffs>,
    /// `EngineConfig::reply_spin`.
    reply_spin: Duration,
    /// `EngineConfig::transfer_timeout`: the deadline of a transfer without one of its own.
    transfer_timeout: Duration,
    /// The core's heartbeat, which bounds the wait of calls from other threads.
    liveness: Arc<bound::Liveness>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Command::Run(_) => "Run",
            Command::Shutdown(_) => "Shutdown",
        })
    }
}

mod bound;
mod gpu;
mod local;
mod nudge;
mod serve;

pub(crate) use serve::serve_core;

pub use local::HandOffCounters;

impl EngineHandle {
    /// Runs `job` as a task on the engine's core and returns its output, or why there is none:
    /// the engine is gone (the job, and what it owns, is dropped then), the job panicked
    /// (contained: see [`crate::supervise`]) or, for a caller on another thread, the core
    /// stopped running for `EngineConfig::stall_timeout` (see [`bound`]; the job stays queued
    /// and runs if the core does again).
    async fn on_core<T, F, Fut>(&self, job: F) -> Result<T, Lost>
    where
        T: Send + 'static,
        F: FnOnce(Served) -> Fut + Send + 'static,
        Fut: Future<Output = T> + 'static,
    {
        let (reply, rx) = oneshot::channel();
        let run: Job = Box::new(move |served| {
            let engine = served.engine.clone();
            let live = served.live.enter();
            glommio::spawn_local(async move {
                let _live = live;
                let out = supervise::catching(async move { job(served).await }).await;
                let _ = reply.send(out.map_err(|p| contained(engine.as_ref(), p)));
            })
            .detach();
        });
        self.reply(self.start(run)?, None, rx).await
    }

    /// Awaits a job's reply; `sent`: the job was sent from another thread, which bounds its
    /// wait by the core's heartbeat and the call's own `deadline`, if it has one (see
    /// [`bound`]).
    async fn reply<T>(
        &self,
        sent: bool,
        deadline: Option<Duration>,
        rx: oneshot::Receiver<Result<T, Lost>>,
    ) -> Result<T, Lost> {
        let bound = sent.then_some(bound::Bound {
            core: &self.liveness,
            deadline,
        });
        bound::bounded(rx, bound).await?.map_err(|_| Lost::Gone)?
    }

    /// As [`Self::on_core`], but the job is cancelled when the caller goes away first: once this
    /// future is dropped, the job's future is dropped on the core at its next turn (a transfer's
    /// slot is then detached: requests not yet posted never are, posted ones drain, and the
    /// in-flight table keeps the memory until they have). A job whose caller is already gone
    /// when it reaches the core never starts.
    ///
    /// `rdma_only`: the job only moves data over RDMA (a transfer or a post), whose
    /// completions the engine's progress loop or the transfer itself polls. With a busy-polled
    /// engine such a job needs nothing from the core's reactor, so the serving task may spin for
    /// the next call while it runs.
    ///
    /// `deadline`: the call's own deadline (a transfer's), which tightens the bound on a
    /// stalled core once it has passed (see [`bound`]).
    async fn on_core_or_cancel<T, F, Fut>(
        &self,
        rdma_only: bool,
        deadline: Option<Duration>,
        job: F,
    ) -> Result<T, Lost>
    where
        T: Send + 'static,
        F: FnOnce(Served) -> Fut + Send + 'static,
        Fut: Future<Output = T> + 'static,
    {
        let (mut reply, rx) = oneshot::channel();
        let run: Job = Box::new(move |served| {
            let engine = served.engine.clone();
            let polled = rdma_only && served.cfg.poll_mode == crate::engine::PollMode::Busy;
            let live = (!polled).then(|| served.live.enter());
            glommio::spawn_local(async move {
                let _live = live;
                let out = supervise::catching(futures_lite::future::or(
                    async {
                        reply.cancellation().await;
                        None
                    },
                    async { Some(job(served).await) },
                ))
                .await;
                match out {
                    Ok(Some(v)) => {
                        let _ = reply.send(Ok(v));
                    }
                    Ok(None) => {}
                    Err(p) => {
                        let _ = reply.send(Err(contained(engine.as_ref(), p)));
                    }
                }
            })
            .detach();
        });
        self.reply(self.start(run)?, deadline, rx).await
    }

    /// How often the watchdog has nudged this core: woken it from another thread after it
    /// went without a heartbeat for two beat periods (a parked executor with work to run; see
    /// the `nudge` module's notes on glommio 0.9.0). Zero on a healthy core.
    pub fn nudges(&self) -> u64 {
        self.liveness.nudges()
    }

    /// The engine's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether this core has an RDMA device (otherwise it serves host memory and files only).
    pub fn has_nic(&self) -> bool {
        self.nic
    }

    /// The verbs device name of this core's NIC (`mlx5_0`, `rxe0`), if it has one.
    pub fn device_name(&self) -> Option<&str> {
        self.device.as_deref()
    }

    /// How long a call from another thread polls for its reply before it waits
    /// (`EngineConfig::reply_spin`).
    pub fn reply_spin(&self) -> Duration {
        self.reply_spin
    }

    /// Opens and registers a file in this core's FILE tier; see [`FileStore::open`].
    ///
    /// # Errors
    /// As [`FileStore::open`], [`FileError::EngineGone`] or [`FileError::EnginePanic`].
    pub async fn open_file(&self, spec: FileSpec) -> Result<FileInfo, FileError> {
        self.on_core(move |s| async move { s.files.open(&spec).await })
            .await
            .unwrap_or_else(lost)
    }

    /// Forgets a file (closed once its in-flight I/Os are done).
    pub fn close_file(&self, id: FileId) {
        let job: Job = Box::new(move |s| s.files.close(id));
        let _ = self.start(job);
    }

    /// A FILE-tier transfer (`Op::Write`: memory to file); see [`FileStore::transfer`]. `timeout`
    /// `None` uses the engine's `transfer_timeout`.
    ///
    /// # Errors
    /// As [`FileStore::transfer`], [`TransferError::EngineGone`] or [`TransferError::EnginePanic`].
    pub async fn file_transfer(
        &self,
        file: FileId,
        op: Op,
        local: LocalDescList,
        descs: Vec<FileDesc>,
        timeout: Option<Duration>,
    ) -> Result<TransferStats, TransferError> {
        self.on_core(move |s| async move {
            let timeout = timeout.unwrap_or(s.cfg.transfer_timeout);
            s.files.transfer(file, op, local, &descs, timeout).await
        })
        .await
        .unwrap_or_else(lost)
    }

    /// Writes host bytes into a file at `descs` on this core (a staged transfer's I/O leg); see
    /// [`FileStore::write_bytes`].
    ///
    /// # Errors
    /// As [`Self::file_transfer`].
    pub async fn file_write_bytes(
        &self,
        file: FileId,
        data: bytes::Bytes,
        descs: Vec<FileDesc>,
        timeout: Option<Duration>,
    ) -> Result<TransferStats, TransferError> {
        self.on_core(move |s| async move {
            let timeout = timeout.unwrap_or(s.cfg.transfer_timeout);
            s.files.write_bytes(file, data, &descs, timeout).await
        })
        .await
        .unwrap_or_else(lost)
    }

    /// Reads a file at `descs` into one host buffer on this core; see
    /// [`FileStore::read_bytes`].
    ///
    /// # Errors
    /// As [`Self::file_transfer`].
    pub async fn file_read_bytes(
        &self,
        file: FileId,
        descs: Vec<FileDesc>,
        timeout: Option<Duration>,
    ) -> Result<(TransferStats, Vec<u8>), TransferError> {
        self.on_core(move |s| async move {
            let timeout = timeout.unwrap_or(s.cfg.transfer_timeout);
            s.files.read_bytes(file, &descs, timeout).await
        })
        .await
        .unwrap_or_else(lost)
    }

    /// Enqueues `copies` on `stream` from the calling thread (CUDA streams may be used from any
    /// thread, and the copies start without waiting for the core), then waits for their CUDA
    /// event on this engine's core (the same core that polls its RDMA completions), so a
    /// CUDA-IPC transfer is a future like an RDMA one, with the same deadline
    /// (`transfer_timeout`). Every range is checked before anything is enqueued.
    ///
    /// # Errors
    /// [`rixl_nvlink::ipc::IpcError`] for a bad range, a failing copy, or the deadline.
    pub async fn device_copies(
        &self,
        stream: Arc<rixl_nvlink::ipc::CopyStream>,
        copies: Vec<DeviceCopy>,
    ) -> Result<(), rixl_nvlink::ipc::IpcError> {
        let pending = stream.copy_all(copies)?;
        // If the engine is gone, the job (and the copies in it) is dropped here, and dropping
        // waits for the GPU before their memory can go.
        self.on_core(move |s| crate::gpu::wait_copy_for(pending, s.cfg.transfer_timeout))
            .await
            .unwrap_or_else(|l| {
                Err(rixl_nvlink::ipc::IpcError::Gpu(
                    rixl_gpudirect::Error::InvalidArgument(RuntimeError::from(l).to_string()),
                ))
            })
    }

    /// The FILE tier's counters.
    ///
    /// # Errors
    /// [`RuntimeError::EngineGone`].
    pub async fn file_counters(&self) -> Result<FileCounters, RuntimeError> {
        self.on_core(|s| async move { s.files.counters() })
            .await
            .map_err(RuntimeError::from)
    }

    /// See [`Engine::register`]; on a core without a NIC, host memory registered with nothing
    /// (for the FILE tier).
    ///
    /// # Errors
    /// As [`Engine::register`], [`RuntimeError::EngineGone`] or [`RuntimeError::EnginePanic`].
    pub async fn register(&self, len: usize) -> Result<Region, RuntimeError> {
        self.on_core(move |s| async move {
            match s.engine {
                Some(e) => e.register(len).await,
                None => glommio::executor()
                    .spawn_blocking(move || HostBuffer::new(len))
                    .await
                    .map(|b| Region::host(b, s.id))
                    .map_err(RuntimeError::from),
            }
        })
        .await
        .unwrap_or_else(lost)
    }

    /// See [`Engine::register_shared`]; [`RuntimeError::NoNic`] on a core without a NIC.
    ///
    /// # Errors
    /// As [`Engine::register_shared`], [`RuntimeError::EngineGone`] or [`RuntimeError::EnginePanic`].
    pub async fn register_shared(&self, mem: Arc<HostBuffer>) -> Result<Region, RuntimeError> {
        self.on_core(
            move |s| async move { s.rdma(RuntimeError::NoNic)?.register_shared(mem).await },
        )
        .await
        .unwrap_or_else(lost)
    }

    /// See [`Engine::register_mr`]; [`RuntimeError::NoNic`] on a core without a NIC.
    ///
    /// # Errors
    /// As [`Engine::register_mr`], [`RuntimeError::EngineGone`] or [`RuntimeError::EnginePanic`].
    pub async fn register_mr(&self, mem: Arc<HostBuffer>) -> Result<SharedMr, RuntimeError> {
        self.on_core(move |s| async move { s.rdma(RuntimeError::NoNic)?.register_mr(mem).await })
            .await
            .unwrap_or_else(lost)
    }

    /// The caller's host memory as a region of this core registered with no NIC: what a core
    /// without one serves local tiers (files) from. RDMA refuses it.
    pub fn unregistered(&self, mem: HostBuffer) -> Region {
        Region::host(mem, self.id)
    }

    /// See [`Engine::prepare_connection`].
    ///
    /// # Errors
    /// As [`Engine::prepare_connection`], [`RuntimeError::EngineGone`] or [`RuntimeError::EnginePanic`].
    pub async fn prepare_connection(&self) -> Result<(ConnId, Endpoint), RuntimeError> {
        self.on_core(|s| async move { s.rdma(RuntimeError::NoNic)?.prepare_connection().await })
            .await
            .unwrap_or_else(lost)
    }

    /// See [`Engine::complete_connection`].
    ///
    /// # Errors
    /// As [`Engine::complete_connection`], [`RuntimeError::EngineGone`] or [`RuntimeError::EnginePanic`].
    pub async fn complete_connection(
        &self,
        conn: ConnId,
        remote: Endpoint,
    ) -> Result<(), RuntimeError> {
        self.on_core(move |s| async move {
            s.rdma(RuntimeError::NoNic)?
                .complete_connection(conn, remote)
                .await
        })
        .await
        .unwrap_or_else(lost)
    }

    /// See [`Engine::grant`].
    ///
    /// # Errors
    /// As [`Engine::grant`], [`RuntimeError::EngineGone`] or [`RuntimeError::EnginePanic`].
    pub async fn grant(
        &self,
        conn: ConnId,
        specs: Vec<crate::engine::GrantSpec>,
    ) -> Result<Vec<crate::engine::Grant>, RuntimeError> {
        self.on_core(move |s| async move { s.rdma(RuntimeError::NoNic)?.grant(conn, specs).await })
            .await
            .unwrap_or_else(lost)
    }

    /// See [`Engine::transfer`].
    ///
    /// # Errors
    /// As [`Engine::transfer`], [`TransferError::EngineGone`] or [`TransferError::EnginePanic`].
    pub async fn transfer(
        &self,
        conn: ConnId,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferError> {
        self.transfer_ranges(conn, op, local, remote, opts)
            .await
            .map_err(|f| f.error)
    }

    /// See [`Engine::transfer_ranges`].
    ///
    /// # Errors
    /// As [`Engine::transfer_ranges`], [`TransferError::EngineGone`] (nothing known
    /// posted) or [`TransferError::EnginePanic`] (progress unknown).
    pub async fn transfer_ranges(
        &self,
        conn: ConnId,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferFailure> {
        let call = self.transfer_ranges_unspun(conn, op, local, remote, opts);
        self.spin_for_reply(call).await
    }

    /// [`Self::transfer_ranges`] without the reply spin: for a caller that awaits several
    /// calls at once and spins for all of them (see [`Self::spin_for_reply`]).
    pub(crate) async fn transfer_ranges_unspun(
        &self,
        conn: ConnId,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferFailure> {
        let deadline = opts.timeout.unwrap_or(self.transfer_timeout);
        self.on_rdma(local.len(), deadline, move |e| async move {
            e.transfer_ranges(conn, op, &local, &remote, opts).await
        })
        .await
    }

    /// [`Self::transfer`] of a WRITE with default options.
    ///
    /// # Errors
    /// As [`Self::transfer`].
    pub async fn write(
        &self,
        conn: ConnId,
        local: LocalDescList,
        remote: RemoteDescList,
    ) -> Result<TransferStats, TransferError> {
        let opts = TransferOptions::default();
        self.transfer(conn, Op::Write, local, remote, opts).await
    }

    /// [`Self::transfer`] of a READ with default options.
    ///
    /// # Errors
    /// As [`Self::transfer`].
    pub async fn read(
        &self,
        conn: ConnId,
        local: LocalDescList,
        remote: RemoteDescList,
    ) -> Result<TransferStats, TransferError> {
        let opts = TransferOptions::default();
        self.transfer(conn, Op::Read, local, remote, opts).await
    }

    /// Checks and plans a READ or WRITE once on the engine's core; see [`Engine::prepare`].
    /// Post the result with [`EngineHandle::post`] (from any thread, any number of times).
    ///
    /// # Errors
    /// As [`Engine::prepare`].
    pub async fn prepare_transfer(
        &self,
        conn: ConnId,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
    ) -> Result<Arc<PreparedTransfer>, TransferError> {
        self.on_core(move |s| async move {
            s.rdma(TransferError::NoNic)?
                .prepare(conn, op, &local, &remote)
                .map(Arc::new)
        })
        .await
        .unwrap_or_else(lost)
    }

    /// Posts a prepared transfer once more; see [`Engine::post`].
    ///
    /// # Errors
    /// As [`Engine::post`].
    pub async fn post(
        &self,
        prepared: &Arc<PreparedTransfer>,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferError> {
        self.post_ranges(prepared, opts).await.map_err(|f| f.error)
    }

    /// See [`Engine::post_ranges`].
    ///
    /// # Errors
    /// As [`Engine::post_ranges`], [`TransferError::EngineGone`] (nothing known
    /// posted) or [`TransferError::EnginePanic`] (progress unknown).
    pub async fn post_ranges(
        &self,
        prepared: &Arc<PreparedTransfer>,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferFailure> {
        self.spin_for_reply(self.post_ranges_unspun(prepared, opts))
            .await
    }

    /// [`Self::post_ranges`] without the reply spin (see [`Self::transfer_ranges_unspun`]).
    pub(crate) async fn post_ranges_unspun(
        &self,
        prepared: &Arc<PreparedTransfer>,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferFailure> {
        let prepared = Arc::clone(prepared);
        let deadline = opts.timeout.unwrap_or(self.transfer_timeout);
        self.on_rdma(prepared.descriptors(), deadline, move |e| async move {
            e.post_ranges(&prepared, opts).await
        })
        .await
    }

    /// Runs an RDMA transfer or post of `descriptors` descriptors, due within `deadline`, on
    /// the engine's core (cancelled with the caller's future): a core without a NIC answers
    /// `NoNic` before posting, and a lost job names what is known of its progress.
    async fn on_rdma<F, Fut>(
        &self,
        descriptors: usize,
        deadline: Duration,
        f: F,
    ) -> Result<TransferStats, TransferFailure>
    where
        F: FnOnce(Engine) -> Fut + Send + 'static,
        Fut: Future<Output = Result<TransferStats, TransferFailure>> + 'static,
    {
        self.on_core_or_cancel(true, Some(deadline), move |s| async move {
            match s.engine {
                Some(e) => f(e).await,
                None => Err(TransferFailure::before_posting(
                    TransferError::NoNic,
                    descriptors,
                )),
            }
        })
        .await
        .unwrap_or_else(|l| Err(lost_transfer(l, descriptors)))
    }

    /// See [`Engine::send`].
    ///
    /// # Errors
    /// As [`Engine::send`].
    pub async fn send(
        &self,
        conn: ConnId,
        msg: Vec<u8>,
        imm: Option<u32>,
    ) -> Result<(), TransferError> {
        // Cancelled with the caller: a send whose caller gave up (a stalled core) is not
        // sent later.
        self.on_core_or_cancel(false, None, move |s| async move {
            s.rdma(TransferError::NoNic)?.send(conn, &msg, imm).await
        })
        .await
        .unwrap_or_else(lost)
    }

    /// See [`Engine::send_from`]: zero-copy from `region` (a clone travels to the core).
    ///
    /// # Errors
    /// As [`Engine::send_from`].
    pub async fn send_from(
        &self,
        conn: ConnId,
        region: Region,
        offset: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<(), TransferError> {
        self.on_core_or_cancel(false, None, move |s| async move {
            s.rdma(TransferError::NoNic)?
                .send_from(conn, &region, offset, len, imm)
                .await
        })
        .await
        .unwrap_or_else(lost)
    }

    /// See [`Engine::recv`].
    ///
    /// # Errors
    /// As [`Engine::recv`].
    pub async fn recv(&self, conn: ConnId) -> Result<Message, TransferError> {
        self.on_core(move |s| async move { s.rdma(TransferError::NoNic)?.recv(conn).await })
            .await
            .unwrap_or_else(lost)
    }

    /// The engine's counters and its live in-flight slots.
    ///
    /// # Errors
    /// [`RuntimeError::EngineGone`].
    pub async fn counters(&self) -> Result<(EngineCounters, usize), RuntimeError> {
        self.on_core(|s| async move {
            s.engine.map_or((EngineCounters::default(), 0), |e| {
                (e.counters(), e.inflight())
            })
        })
        .await
        .map_err(RuntimeError::from)
    }

    /// See [`Engine::connections`] (0 on a core without a NIC).
    ///
    /// # Errors
    /// [`RuntimeError::EngineGone`].
    pub async fn connections(&self) -> Result<usize, RuntimeError> {
        self.on_core(|s| async move { s.engine.map_or(0, |e| e.connections()) })
            .await
            .map_err(RuntimeError::from)
    }

    /// See [`Engine::connection_usable`] (false on a core without a NIC).
    ///
    /// # Errors
    /// [`RuntimeError::EngineGone`], [`RuntimeError::EngineStalled`]: the engine cannot tell.
    pub async fn connection_usable(&self, conn: ConnId) -> Result<bool, RuntimeError> {
        self.on_core(move |s| async move { s.engine.is_some_and(|e| e.connection_usable(conn)) })
            .await
            .map_err(RuntimeError::from)
    }

    /// See [`Engine::close_connection`].
    pub async fn close_connection(&self, conn: ConnId) {
        let _ = self
            .on_core(move |s| async move {
                if let Some(e) = s.engine {
                    e.close_connection(conn).await;
                }
            })
            .await;
    }

    /// Stops the core's service: closes its files, shuts the engine down (flushing in-flight
    /// work) and ends the serving task. Returns once that is done (at once if it already was):
    /// `true`; `false` if the core stopped running for `stall_timeout` first (see [`bound`]).
    pub(crate) async fn shutdown(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.unbounded_send(Command::Shutdown(tx)).is_err() {
            return true;
        }
        let bound = bound::Bound {
            core: &self.liveness,
            deadline: None,
        };
        bound::bounded(rx, Some(bound)).await.is_ok()
    }
}
