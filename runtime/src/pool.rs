//! A pool of engines pinned one per CPU, each on its own glommio executor thread.

use std::sync::mpsc::RecvTimeoutError;
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

/// The least time [`EnginePool::start`] gives an engine to open its device and answer.
const START_FLOOR: std::time::Duration = std::time::Duration::from_secs(30);

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
        // An engine has no heartbeat yet while it opens its device: its start gets
        // `stall_timeout`, but never less than START_FLOOR.
        let stall = cfg.stall_timeout.max(START_FLOOR);
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
            let failed = match ready_rx.recv_timeout(stall) {
                Ok(Ok(h)) => {
                    pool.handles.push(h);
                    pool.joins.push(join);
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {
                    // Its thread is left to itself (not joined): it may never end.
                    tracing::error!(cpu, waited = ?stall, "the engine did not start in time");
                    RuntimeError::EngineStalled(stall)
                }
                // The thread has answered, or died: it ends now.
                Ok(Err(e)) => {
                    let _ = join.join();
                    e
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let _ = join.join();
                    RuntimeError::Executor(format!("executor on CPU {cpu} died while starting"))
                }
            };
            pool.shutdown_inner();
            return Err(failed);
        }
        Ok(pool)
    }

    /// The engines' handles, in CPU order.
    pub fn handles(&self) -> &[EngineHandle] {
        &self.handles
    }

    fn shutdown_inner(&mut self) {
        for (h, j) in self.handles.drain(..).zip(self.joins.drain(..)) {
            if futures_lite::future::block_on(h.shutdown()) {
                let _ = j.join();
            } else {
                // A stalled core: its thread is left to itself rather than hanging the caller.
                tracing::error!(
                    engine = h.id(),
                    "the engine's core did not shut down in time; its thread is not joined"
                );
            }
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

/// The CPUs this process may run on, ascending: its affinity mask (a `taskset`, or a
/// container's cpuset), from `Cpus_allowed_list` in `/proc/self/status`. Engines pinned to
/// other CPUs would leave the mask (or fail to start inside a cpuset), so place them with
/// [`cpu_at`]. Where the mask cannot be read, CPUs `0..available_parallelism()`. Read once, at
/// the first call (engines are placed at start-up).
///
/// The mask is the main thread's (`/proc/self` is the process's first thread): an application
/// that pins its main thread alone to one CPU narrows this list to that CPU. CPUs isolated with
/// `isolcpus` are outside the default mask, so engines go there only through an explicit CPU.
pub fn available_cpus() -> &'static [usize] {
    static CPUS: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    CPUS.get_or_init(read_cpu_mask)
}

fn read_cpu_mask() -> Vec<usize> {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .and_then(parse_cpu_list)
        })
        .filter(|cpus| !cpus.is_empty())
        .unwrap_or_else(|| {
            let n = thread::available_parallelism().map_or(1, |n| n.get());
            (0..n).collect()
        })
}

/// The `i`-th CPU this process may run on, wrapping around ([`available_cpus`]).
pub fn cpu_at(i: usize) -> usize {
    let cpus = available_cpus();
    cpus[i % cpus.len()]
}

/// The CPU `n` places after `cpu` among those this process may run on, wrapping around: `cpu`
/// itself for `n == 0` (even outside the mask, an explicit choice); counted from the first
/// allowed CPU when `cpu` is outside the mask. Places an agent's or a tool's further engines.
pub fn cpu_after(cpu: usize, n: usize) -> usize {
    if n == 0 {
        return cpu;
    }
    let home = available_cpus().iter().position(|&c| c == cpu).unwrap_or(0);
    cpu_at(home + n)
}

/// Parses a kernel CPU list (`0-3,8,10-11`); `None` if malformed.
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let c = part.parse::<usize>().ok()?;
                (c, c)
            }
        };
        if last < first || last - first > 1 << 16 {
            return None;
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Some(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_like_the_kernel_prints_them_and_bad_ones_are_refused() {
        assert_eq!(parse_cpu_list("0-3\n"), Some(vec![0, 1, 2, 3]));
        assert_eq!(parse_cpu_list("1"), Some(vec![1]));
        assert_eq!(parse_cpu_list("8-9,2,4-5"), Some(vec![2, 4, 5, 8, 9]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(parse_cpu_list("0-"), None);
    }

    #[test]
    fn available_cpus_are_the_process_mask_and_cpu_at_wraps_within_them() {
        let cpus = available_cpus();
        assert!(!cpus.is_empty());
        // available_parallelism counts this thread's mask (less where a cgroup quota is lower).
        let n = thread::available_parallelism().map_or(1, |n| n.get());
        assert!(
            cpus.len() >= n,
            "{cpus:?} against available_parallelism {n}"
        );
        assert!(cpus.windows(2).all(|w| w[0] < w[1]), "ascending: {cpus:?}");
        assert_eq!(cpu_at(0), cpus[0]);
        assert_eq!(cpu_at(cpus.len()), cpus[0]);
        assert_eq!(cpu_at(cpus.len() - 1), *cpus.last().expect("one"));
    }

    #[test]
    fn cpu_after_counts_allowed_cpus_from_the_given_one_or_from_the_first() {
        let cpus = available_cpus();
        let last = *cpus.last().expect("one");
        assert_eq!(cpu_after(last, 0), last);
        assert_eq!(cpu_after(last, 1), cpus[0], "wraps around");
        assert_eq!(cpu_after(cpus[0], cpus.len() + 1), cpu_at(1));
        // Outside the mask: itself for the first engine, then from the first allowed CPU.
        assert_eq!(cpu_after(usize::MAX, 0), usize::MAX);
        assert_eq!(cpu_after(usize::MAX, 1), cpu_at(1));
    }
}
