//! A pool of engines pinned one per CPU, each on its own glommio executor thread.

use std::thread;

use glommio::{LocalExecutorBuilder, Placement};

use crate::engine::{Engine, EngineConfig};
use crate::error::RuntimeError;
use crate::handle::{serve_core, EngineHandle};
use crate::id::next_engine_id;

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
            futures_lite::future::block_on(h.shutdown());
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
