//! A `Send` handle to an engine running on another core, and a pool of pinned engines.

use std::rc::Rc;
use std::thread;
use std::time::Duration;

use futures_channel::{mpsc, oneshot};
use futures_lite::StreamExt;
use glommio::{LocalExecutorBuilder, Placement};
use rixl_verbs::{Endpoint, HostBuffer};

use crate::desc::{LocalDescList, Op, Region, RemoteDescList};
use crate::engine::{
    ConnId, Engine, EngineConfig, EngineCounters, Message, PreparedTransfer, TransferOptions,
    TransferStats,
};
use crate::error::{RuntimeError, TransferError};
use crate::file::{FileCounters, FileDesc, FileError, FileId, FileInfo, FileSpec, FileStore};
use crate::id::next_engine_id;

type Reply<T> = oneshot::Sender<T>;

enum Command {
    Register(usize, Reply<Result<Region, RuntimeError>>),
    RegisterGpu(i32, usize, Reply<Result<Region, RuntimeError>>),
    RegisterShared(
        std::sync::Arc<HostBuffer>,
        Reply<Result<Region, RuntimeError>>,
    ),
    Prepare(Reply<Result<(ConnId, Endpoint), RuntimeError>>),
    Complete(ConnId, Endpoint, Reply<Result<(), RuntimeError>>),
    Transfer {
        conn: ConnId,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
        opts: TransferOptions,
        reply: Reply<Result<TransferStats, TransferError>>,
    },
    PrepareTransfer {
        conn: ConnId,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
        reply: Reply<Result<PreparedTransfer, TransferError>>,
    },
    PostPrepared(
        std::sync::Arc<PreparedTransfer>,
        TransferOptions,
        Reply<Result<TransferStats, TransferError>>,
    ),
    Send(
        ConnId,
        Vec<u8>,
        Option<u32>,
        Reply<Result<(), TransferError>>,
    ),
    Recv(ConnId, Reply<Result<Message, TransferError>>),
    Counters(Reply<(EngineCounters, usize)>),
    Close(ConnId, Reply<()>),
    OpenFile(FileSpec, Reply<Result<FileInfo, FileError>>),
    CloseFile(FileId),
    FileTransfer {
        file: FileId,
        op: Op,
        local: LocalDescList,
        descs: Vec<FileDesc>,
        timeout: Option<Duration>,
        reply: Reply<Result<TransferStats, TransferError>>,
    },
    FileCounters(Reply<FileCounters>),
    /// Copies already enqueued (by the caller's thread), to be awaited on the core.
    AwaitCopies(
        rixl_nvlink::ipc::PendingCopy,
        Reply<Result<(), rixl_nvlink::ipc::IpcError>>,
    ),
    Shutdown(Reply<()>),
}

pub use rixl_nvlink::ipc::DeviceCopy;

/// A `Send + Clone` handle to an engine: any thread or task can submit work to the engine that
/// owns the connection; each call's future resolves on the caller's side. Dropping a call's
/// future does not cancel the transfer (memory stays registered until the NIC is done).
#[derive(Clone, Debug)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    id: u64,
    nic: bool,
}

async fn ask<T>(
    tx: &mpsc::UnboundedSender<Command>,
    make: impl FnOnce(Reply<T>) -> Command,
) -> Option<T> {
    let (reply, rx) = oneshot::channel();
    tx.unbounded_send(make(reply)).ok()?;
    rx.await.ok()
}

impl EngineHandle {
    /// The engine's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether this core has an RDMA device (otherwise it serves host memory and files only).
    pub fn has_nic(&self) -> bool {
        self.nic
    }

    /// Opens and registers a file in this core's FILE tier; see [`FileStore::open`].
    ///
    /// # Errors
    /// As [`FileStore::open`], or [`FileError::EngineGone`].
    pub async fn open_file(&self, spec: FileSpec) -> Result<FileInfo, FileError> {
        ask(&self.tx, |r| Command::OpenFile(spec, r))
            .await
            .unwrap_or(Err(FileError::EngineGone))
    }

    /// Forgets a file (closed once its in-flight I/Os are done).
    pub fn close_file(&self, id: FileId) {
        let _ = self.tx.unbounded_send(Command::CloseFile(id));
    }

    /// A FILE-tier transfer (`Op::Write`: memory to file); see [`FileStore::transfer`]. `timeout`
    /// `None` uses the engine's `transfer_timeout`.
    ///
    /// # Errors
    /// As [`FileStore::transfer`], or [`TransferError::EngineGone`].
    pub async fn file_transfer(
        &self,
        file: FileId,
        op: Op,
        local: LocalDescList,
        descs: Vec<FileDesc>,
        timeout: Option<Duration>,
    ) -> Result<TransferStats, TransferError> {
        ask(&self.tx, |reply| Command::FileTransfer {
            file,
            op,
            local,
            descs,
            timeout,
            reply,
        })
        .await
        .unwrap_or(Err(TransferError::EngineGone))
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
        stream: std::sync::Arc<rixl_nvlink::ipc::CopyStream>,
        copies: Vec<DeviceCopy>,
    ) -> Result<(), rixl_nvlink::ipc::IpcError> {
        let pending = stream.copy_all(copies)?;
        // If the engine is gone, the command (and the copies in it) is dropped here, and
        // dropping waits for the GPU before their memory can go.
        ask(&self.tx, |r| Command::AwaitCopies(pending, r))
            .await
            .unwrap_or(Err(rixl_nvlink::ipc::IpcError::Gpu(
                rixl_gpudirect::Error::InvalidArgument("the engine has shut down".into()),
            )))
    }

    /// The FILE tier's counters.
    ///
    /// # Errors
    /// [`RuntimeError::EngineGone`].
    pub async fn file_counters(&self) -> Result<FileCounters, RuntimeError> {
        ask(&self.tx, Command::FileCounters)
            .await
            .ok_or(RuntimeError::EngineGone)
    }

    /// See [`Engine::register`].
    ///
    /// # Errors
    /// As [`Engine::register`], or [`RuntimeError::EngineGone`].
    pub async fn register(&self, len: usize) -> Result<Region, RuntimeError> {
        ask(&self.tx, |r| Command::Register(len, r))
            .await
            .unwrap_or(Err(RuntimeError::EngineGone))
    }

    /// See [`Engine::register_shared`]; [`RuntimeError::NoNic`] on a core without a NIC.
    ///
    /// # Errors
    /// As [`Engine::register_shared`], or [`RuntimeError::EngineGone`].
    pub async fn register_shared(
        &self,
        mem: std::sync::Arc<HostBuffer>,
    ) -> Result<Region, RuntimeError> {
        ask(&self.tx, |r| Command::RegisterShared(mem, r))
            .await
            .unwrap_or(Err(RuntimeError::EngineGone))
    }

    /// See [`Engine::register_gpu`]; on a core without a NIC, plain device memory (for CUDA IPC
    /// and copies; RDMA refuses it).
    ///
    /// # Errors
    /// As [`Engine::register_gpu`], or [`RuntimeError::EngineGone`].
    pub async fn register_gpu(&self, ordinal: i32, len: usize) -> Result<Region, RuntimeError> {
        ask(&self.tx, |r| Command::RegisterGpu(ordinal, len, r))
            .await
            .unwrap_or(Err(RuntimeError::EngineGone))
    }

    /// See [`Engine::prepare_connection`].
    ///
    /// # Errors
    /// As [`Engine::prepare_connection`], or [`RuntimeError::EngineGone`].
    pub async fn prepare_connection(&self) -> Result<(ConnId, Endpoint), RuntimeError> {
        ask(&self.tx, Command::Prepare)
            .await
            .unwrap_or(Err(RuntimeError::EngineGone))
    }

    /// See [`Engine::complete_connection`].
    ///
    /// # Errors
    /// As [`Engine::complete_connection`], or [`RuntimeError::EngineGone`].
    pub async fn complete_connection(
        &self,
        conn: ConnId,
        remote: Endpoint,
    ) -> Result<(), RuntimeError> {
        ask(&self.tx, |r| Command::Complete(conn, remote, r))
            .await
            .unwrap_or(Err(RuntimeError::EngineGone))
    }

    /// See [`Engine::transfer`].
    ///
    /// # Errors
    /// As [`Engine::transfer`], or [`TransferError::EngineGone`].
    pub async fn transfer(
        &self,
        conn: ConnId,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferError> {
        ask(&self.tx, |reply| Command::Transfer {
            conn,
            op,
            local,
            remote,
            opts,
            reply,
        })
        .await
        .unwrap_or(Err(TransferError::EngineGone))
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
    ) -> Result<std::sync::Arc<PreparedTransfer>, TransferError> {
        ask(&self.tx, |reply| Command::PrepareTransfer {
            conn,
            op,
            local,
            remote,
            reply,
        })
        .await
        .unwrap_or(Err(TransferError::EngineGone))
        .map(std::sync::Arc::new)
    }

    /// Posts a prepared transfer once more; see [`Engine::post`].
    ///
    /// # Errors
    /// As [`Engine::post`].
    pub async fn post(
        &self,
        prepared: &std::sync::Arc<PreparedTransfer>,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferError> {
        let prepared = std::sync::Arc::clone(prepared);
        ask(&self.tx, |reply| {
            Command::PostPrepared(prepared, opts, reply)
        })
        .await
        .unwrap_or(Err(TransferError::EngineGone))
    }

    /// RDMA WRITE; see [`Engine::write`].
    ///
    /// # Errors
    /// As [`Engine::transfer`].
    pub async fn write(
        &self,
        conn: ConnId,
        local: LocalDescList,
        remote: RemoteDescList,
    ) -> Result<TransferStats, TransferError> {
        self.transfer(conn, Op::Write, local, remote, TransferOptions::default())
            .await
    }

    /// RDMA READ; see [`Engine::read`].
    ///
    /// # Errors
    /// As [`Engine::transfer`].
    pub async fn read(
        &self,
        conn: ConnId,
        local: LocalDescList,
        remote: RemoteDescList,
    ) -> Result<TransferStats, TransferError> {
        self.transfer(conn, Op::Read, local, remote, TransferOptions::default())
            .await
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
        ask(&self.tx, |r| Command::Send(conn, msg, imm, r))
            .await
            .unwrap_or(Err(TransferError::EngineGone))
    }

    /// See [`Engine::recv`].
    ///
    /// # Errors
    /// As [`Engine::recv`].
    pub async fn recv(&self, conn: ConnId) -> Result<Message, TransferError> {
        ask(&self.tx, |r| Command::Recv(conn, r))
            .await
            .unwrap_or(Err(TransferError::EngineGone))
    }

    /// The engine's counters and its live in-flight slots.
    ///
    /// # Errors
    /// [`RuntimeError::EngineGone`].
    pub async fn counters(&self) -> Result<(EngineCounters, usize), RuntimeError> {
        ask(&self.tx, Command::Counters)
            .await
            .ok_or(RuntimeError::EngineGone)
    }

    /// See [`Engine::close_connection`].
    pub async fn close_connection(&self, conn: ConnId) {
        let _ = ask(&self.tx, |r| Command::Close(conn, r)).await;
    }
}

impl Engine {
    /// Serves a [`EngineHandle`]: returns the handle and the task future to spawn on this
    /// engine's executor (it ends on shutdown or when every handle is dropped).
    pub fn handle(&self) -> (EngineHandle, impl std::future::Future<Output = ()>) {
        serve_core(Some(self.clone()), self.id(), self.config().clone())
    }
}

/// Serves a core: its RDMA engine when it has one, host memory otherwise, and its FILE tier.
fn serve_core(
    engine: Option<Engine>,
    id: u64,
    cfg: EngineConfig,
) -> (EngineHandle, impl std::future::Future<Output = ()>) {
    let (tx, rx) = mpsc::unbounded();
    let handle = EngineHandle {
        tx,
        id,
        nic: engine.is_some(),
    };
    (handle, serve(engine, id, cfg, rx))
}

fn spawn(f: impl std::future::Future<Output = ()> + 'static) {
    glommio::spawn_local(f).detach();
}

/// The answer of an RDMA command on a core without a NIC.
fn no_nic<T>(r: Reply<Result<T, RuntimeError>>) {
    let _ = r.send(Err(RuntimeError::NoNic));
}

/// `cfg` is the core's configuration (the engine's, or the one given to a core without a NIC):
/// the FILE tier's depth and I/O size and the default deadline come from it.
async fn serve(
    engine: Option<Engine>,
    id: u64,
    cfg: EngineConfig,
    mut rx: mpsc::UnboundedReceiver<Command>,
) {
    let files = Rc::new(FileStore::new(cfg.file));
    while let Some(cmd) = rx.next().await {
        let e = engine.clone();
        match cmd {
            Command::Register(len, r) => {
                glommio::spawn_local(async move {
                    let res = match e {
                        Some(e) => e.register(len).await,
                        None => glommio::executor()
                            .spawn_blocking(move || HostBuffer::new(len))
                            .await
                            .map(|b| Region::host(b, id))
                            .map_err(RuntimeError::from),
                    };
                    let _ = r.send(res);
                })
                .detach();
            }
            Command::RegisterShared(mem, r) => match e {
                Some(e) => spawn(async move {
                    let _ = r.send(e.register_shared(mem).await);
                }),
                None => no_nic(r),
            },
            Command::RegisterGpu(ordinal, len, r) => match e {
                Some(e) => spawn(async move {
                    let _ = r.send(e.register_gpu(ordinal, len).await);
                }),
                // No NIC: device memory for CUDA IPC and copies, not registered.
                None => spawn(async move {
                    let res = glommio::executor()
                        .spawn_blocking(move || {
                            let gpu = rixl_gpudirect::Gpu::open(ordinal)?;
                            rixl_gpudirect::DeviceMemory::alloc(&gpu, len)
                        })
                        .await
                        .map(|m| Region::device(m, id))
                        .map_err(RuntimeError::from);
                    let _ = r.send(res);
                }),
            },
            Command::Prepare(r) => match e {
                Some(e) => spawn(async move {
                    let _ = r.send(e.prepare_connection().await);
                }),
                None => no_nic(r),
            },
            Command::Complete(c, ep, r) => match e {
                Some(e) => spawn(async move {
                    let _ = r.send(e.complete_connection(c, ep).await);
                }),
                None => no_nic(r),
            },
            Command::Transfer {
                conn,
                op,
                local,
                remote,
                opts,
                reply,
            } => match e {
                Some(e) => spawn(async move {
                    let _ = reply.send(e.transfer(conn, op, &local, &remote, opts).await);
                }),
                None => {
                    let _ = reply.send(Err(TransferError::NoNic));
                }
            },
            Command::PrepareTransfer {
                conn,
                op,
                local,
                remote,
                reply,
            } => {
                let _ = reply.send(match e {
                    Some(e) => e.prepare(conn, op, &local, &remote),
                    None => Err(TransferError::NoNic),
                });
            }
            Command::PostPrepared(p, opts, reply) => match e {
                Some(e) => spawn(async move {
                    let _ = reply.send(e.post(&p, opts).await);
                }),
                None => {
                    let _ = reply.send(Err(TransferError::NoNic));
                }
            },
            Command::Send(c, m, imm, r) => match e {
                Some(e) => spawn(async move {
                    let _ = r.send(e.send(c, &m, imm).await);
                }),
                None => {
                    let _ = r.send(Err(TransferError::NoNic));
                }
            },
            Command::Recv(c, r) => match e {
                Some(e) => spawn(async move {
                    let _ = r.send(e.recv(c).await);
                }),
                None => {
                    let _ = r.send(Err(TransferError::NoNic));
                }
            },
            Command::Counters(r) => {
                let _ = r.send(e.map_or((EngineCounters::default(), 0), |e| {
                    (e.counters(), e.inflight())
                }));
            }
            Command::Close(c, r) => match e {
                Some(e) => spawn(async move {
                    e.close_connection(c).await;
                    let _ = r.send(());
                }),
                None => {
                    let _ = r.send(());
                }
            },
            Command::OpenFile(spec, r) => {
                let f = Rc::clone(&files);
                glommio::spawn_local(async move {
                    let _ = r.send(f.open(&spec).await);
                })
                .detach();
            }
            Command::CloseFile(id) => files.close(id),
            Command::FileTransfer {
                file,
                op,
                local,
                descs,
                timeout,
                reply,
            } => {
                let f = Rc::clone(&files);
                let timeout = timeout.unwrap_or(cfg.transfer_timeout);
                glommio::spawn_local(async move {
                    let _ = reply.send(f.transfer(file, op, local, &descs, timeout).await);
                })
                .detach();
            }
            Command::AwaitCopies(pending, r) => {
                let timeout = cfg.transfer_timeout;
                spawn(async move {
                    let _ = r.send(crate::gpu::wait_copy_for(pending, timeout).await);
                });
            }
            Command::FileCounters(r) => {
                let _ = r.send(files.counters());
            }
            Command::Shutdown(r) => {
                files.close_all().await;
                if let Some(e) = engine {
                    e.shutdown().await;
                }
                let _ = r.send(());
                return;
            }
        }
    }
}

/// Engines pinned one per CPU, each on its own glommio executor thread.
#[derive(Debug)]
pub struct EnginePool {
    handles: Vec<EngineHandle>,
    joins: Vec<glommio::ExecutorJoinHandle<()>>,
}

/// Locked memory each executor's io_uring may register (small, so pools fit an 8 MiB memlock).
pub const DEFAULT_IO_MEMORY: usize = 64 << 10;

impl EnginePool {
    /// Starts one engine per CPU in `cpus`, pinned there, with `io_memory` bytes of glommio I/O
    /// memory each. Checks io_uring and the memlock limit first.
    ///
    /// # Errors
    /// [`RuntimeError::MemlockTooLow`], [`RuntimeError::IoUringDisabled`], an executor that
    /// failed to start, or the first engine that failed to open.
    pub fn start(
        cfg: &EngineConfig,
        cpus: &[usize],
        io_memory: usize,
    ) -> Result<Self, RuntimeError> {
        crate::preflight::check(cpus.len(), io_memory)?;
        let mut pool = EnginePool {
            handles: Vec::new(),
            joins: Vec::new(),
        };
        for (i, &cpu) in cpus.iter().enumerate() {
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            let cfg = cfg.clone();
            let join = LocalExecutorBuilder::new(Placement::Fixed(cpu))
                .name(&format!("rixl-engine-{i}"))
                .io_memory(io_memory)
                .spin_before_park(cfg.spin_before_park)
                .spawn(move || async move {
                    let require = cfg.require_nic;
                    let core_cfg = cfg.clone();
                    match Engine::open(cfg).await {
                        Ok(engine) => {
                            let (handle, serve) = engine.handle();
                            let _ = ready_tx.send(Ok(handle));
                            serve.await;
                        }
                        Err(RuntimeError::Verbs(e))
                            if !require
                                && (e.is_no_device()
                                    || matches!(e, rixl_verbs::Error::GetDeviceList(_))) =>
                        {
                            tracing::info!(cpu, error = %e, "no RDMA device: host memory and files only");
                            let (handle, serve) = serve_core(None, next_engine_id(), core_cfg);
                            let _ = ready_tx.send(Ok(handle));
                            serve.await;
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                })
                .map_err(|e| RuntimeError::Executor(e.to_string()))?;
            pool.joins.push(join);
            match ready_rx.recv() {
                Ok(Ok(h)) => pool.handles.push(h),
                Ok(Err(e)) => {
                    pool.shutdown_inner();
                    return Err(e);
                }
                Err(_) => {
                    pool.shutdown_inner();
                    return Err(RuntimeError::Executor(format!(
                        "executor on CPU {cpu} died while starting"
                    )));
                }
            }
        }
        Ok(pool)
    }

    /// The engines' handles, in CPU order.
    pub fn handles(&self) -> &[EngineHandle] {
        &self.handles
    }

    fn shutdown_inner(&mut self) {
        for h in self.handles.drain(..) {
            let (tx, rx) = oneshot::channel();
            if h.tx.unbounded_send(Command::Shutdown(tx)).is_ok() {
                let _ = futures_lite::future::block_on(rx);
            }
        }
        for j in self.joins.drain(..) {
            let _ = j.join();
        }
    }

    /// Shuts every engine down (flushing in-flight work) and joins the executor threads.
    pub fn shutdown(mut self) {
        self.shutdown_inner();
    }
}

impl Drop for EnginePool {
    fn drop(&mut self) {
        if !self.handles.is_empty() || !self.joins.is_empty() {
            self.shutdown_inner();
        }
    }
}

/// The CPUs this process may run on (for pool placement).
pub fn available_cpus() -> Vec<usize> {
    let n = thread::available_parallelism().map_or(1, |n| n.get());
    (0..n).collect()
}
