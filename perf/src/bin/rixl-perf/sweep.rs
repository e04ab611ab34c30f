//! nixlbench-style sweep: block size x batch size (descriptors per transfer), READ or WRITE, in
//! one process: an initiator engine on core 0 and a target engine on another core, connected
//! through the device. Reports GB/s (1e9), per-request prepare / post / transfer time (average and
//! p99) and descriptors per second, like nixlbench's columns.

use std::time::{Duration, Instant};

use futures_lite::future::block_on;
use rixl::runtime::{
    Engine, EngineConfig, EnginePool, LocalDescList, Op, RemoteDesc, RemoteDescList,
    TransferOptions, DEFAULT_IO_MEMORY,
};

use super::stats::Durations;
use super::{on_core, s, Res};

/// `rixl-perf sweep`: nixlbench's flags and defaults.
#[derive(Debug, Clone, clap::Args)]
pub struct SweepArgs {
    /// Operation
    #[arg(long = "op", value_enum, ignore_case = true, default_value_t = SweepOp::Write)]
    op: SweepOp,
    /// First block size in bytes (doubled up to --max_block_size)
    #[arg(long = "start_block_size", value_name = "B", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(1..))]
    start_block: u64,
    /// Last block size in bytes
    #[arg(long = "max_block_size", value_name = "B", default_value_t = 64 << 20)]
    max_block: u64,
    /// First batch size: descriptors per transfer (doubled up to --max_batch_size)
    #[arg(long = "start_batch_size", value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..))]
    start_batch: u64,
    /// Last batch size
    #[arg(long = "max_batch_size", value_name = "N", default_value_t = 1)]
    max_batch: u64,
    /// Measured iterations per block and batch size
    #[arg(long = "num_iter", value_name = "N", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Warm-up iterations (not measured)
    #[arg(long = "warmup_iter", value_name = "N", default_value_t = 100)]
    warmup: u64,
    /// Iterations are divided by this above 1 MiB blocks (0 counts as 1)
    #[arg(long = "large_blk_iter_ftr", value_name = "N", default_value_t = 16)]
    large_factor: u64,
    /// Registered bytes on each side; descriptors wrap inside it
    #[arg(long = "total_buffer_size", value_name = "B", default_value_t = 256 << 20)]
    buffer: u64,
    /// RDMA device [default: $RIXL_RDMA_DEVICE, else the first]
    #[arg(short = 'd', value_name = "DEV")]
    device: Option<String>,
    /// GID index [default: $RIXL_GID_INDEX]
    #[arg(short = 'x', value_name = "IDX")]
    gid: Option<u32>,
}

/// `--op`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SweepOp {
    #[value(name = "READ")]
    Read,
    #[value(name = "WRITE")]
    Write,
}

impl SweepArgs {
    /// The checks that involve several flags.
    pub fn check(&self) -> Res<()> {
        if self.start_block > self.max_block || self.start_batch > self.max_batch {
            return Err(
                "inconsistent sizes: --start_block_size above --max_block_size or \
                 --start_batch_size above --max_batch_size"
                    .into(),
            );
        }
        if self.max_block > self.buffer {
            return Err("--max_block_size exceeds --total_buffer_size".into());
        }
        Ok(())
    }
}

pub fn main(w: SweepArgs) -> Res<()> {
    let op = match w.op {
        SweepOp::Read => Op::Read,
        SweepOp::Write => Op::Write,
    };
    let large_factor = w.large_factor.max(1);
    let mut cfg = EngineConfig::from_env();
    cfg.timing = true; // prepare / post / transfer columns
    if w.device.is_some() {
        cfg.device = w.device.clone();
    }
    if let Some(g) = w.gid {
        cfg.connect.gid_index = g;
    }
    // The target: a passive engine on the other core that only registers memory.
    let cpus = rixl::runtime::available_cpus();
    let target_cpu = cpus[1 % cpus.len()];
    let pool = EnginePool::start(&cfg, &[target_cpu], DEFAULT_IO_MEMORY).map_err(s)?;
    let t = pool.handles()[0].clone();
    let target_region = block_on(t.register(w.buffer as usize)).map_err(s)?;
    let (tconn, tep) = block_on(t.prepare_connection()).map_err(s)?;
    let remote_base = RemoteDesc {
        addr: target_region.addr(),
        len: 0,
        rkey: target_region.rkey(),
    };
    let (ep_tx, ep_rx) = std::sync::mpsc::channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let initiator_cpu = cpus[0];
    let run = std::thread::spawn(move || -> Res<()> {
        on_core(initiator_cpu, move || {
            Box::pin(async move {
                let e = Engine::open(cfg).await.map_err(s)?;
                let (conn, ep) = e.prepare_connection().await.map_err(s)?;
                ep_tx.send(ep).map_err(s)?;
                e.complete_connection(conn, tep).await.map_err(s)?;
                ready_rx.recv().map_err(s)?;
                let region = e.register(w.buffer as usize).await.map_err(s)?;
                println!(
                    "{:>14} | {:>10} | {:>12} | {:>13} | {:>12} | {:>12} | {:>12} | {:>12} | {:>12} | {:>12} | {:>12}",
                    "Block Size (B)", "Batch Size", "B/W (GB/Sec)", "Avg Lat. (us)", "Avg Prep (us)", "P99 Prep (us)",
                    "Avg Post (us)", "P99 Post (us)", "Avg Tx (us)", "P99 Tx (us)", "Descs/s"
                );
                let mut block = w.start_block;
                while block <= w.max_block {
                    let mut batch = w.start_batch;
                    while batch <= w.max_batch {
                        let slots = (w.buffer / block).max(1);
                        let mut local = LocalDescList::with_capacity(batch as usize);
                        let mut remote = Vec::with_capacity(batch as usize);
                        for i in 0..batch {
                            let off = (i % slots) * block;
                            local.push(&region, off, block);
                            remote.push(RemoteDesc {
                                addr: remote_base.addr + off,
                                len: block,
                                ..remote_base
                            });
                        }
                        let remote = RemoteDescList(remote);
                        let iters = if block > (1 << 20) {
                            (w.iters / large_factor).max(1)
                        } else {
                            w.iters
                        };
                        for _ in 0..w.warmup.min(iters) {
                            e.transfer(conn, op, &local, &remote, TransferOptions::default())
                                .await
                                .map_err(s)?;
                        }
                        let (mut prep, mut post, mut tx) = (
                            Durations::default(),
                            Durations::default(),
                            Durations::default(),
                        );
                        let t0 = Instant::now();
                        for _ in 0..iters {
                            let st = e
                                .transfer(conn, op, &local, &remote, TransferOptions::default())
                                .await
                                .map_err(s)?;
                            prep.record(st.prepare);
                            post.record(st.post);
                            tx.record(st.total);
                        }
                        let el = t0.elapsed().as_secs_f64();
                        println!(
                            "{:>14} | {:>10} | {:>12.6} | {:>13.3} | {:>12.3} | {:>12.3} | {:>12.3} | {:>12.3} | {:>12.3} | {:>12.3} | {:>12.0}",
                            block,
                            batch,
                            (iters * batch * block) as f64 / el / 1e9,
                            el * 1e6 / (iters * batch) as f64,
                            prep.mean_us(),
                            prep.quantile_us(0.99),
                            post.mean_us(),
                            post.quantile_us(0.99),
                            tx.mean_us(),
                            tx.quantile_us(0.99),
                            (iters * batch) as f64 / el
                        );
                        batch *= 2;
                    }
                    block *= 2;
                }
                e.shutdown().await;
                Ok(())
            })
        })?
    });
    let ep = ep_rx
        .recv_timeout(Duration::from_secs(30))
        .map_err(|_| "initiator did not start".to_string())?;
    block_on(t.complete_connection(tconn, ep)).map_err(s)?;
    ready_tx.send(()).map_err(s)?;
    let r = run
        .join()
        .map_err(|_| "sweep thread panicked".to_string())?;
    pool.shutdown();
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{parse, Mode};

    fn p(s: &str) -> Result<SweepArgs, String> {
        match parse(
            ["rixl-perf", "sweep"]
                .into_iter()
                .chain(s.split_whitespace()),
        ) {
            Ok(Mode::Sweep(w)) => Ok(w),
            Ok(m) => Err(format!("not sweep: {m:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn nixlbench_flags_and_defaults() {
        let w = p("").expect("defaults");
        assert_eq!(
            (w.op, w.start_block, w.max_block, w.start_batch, w.max_batch),
            (SweepOp::Write, 4096, 64 << 20, 1, 1)
        );
        assert_eq!(
            (w.iters, w.warmup, w.large_factor, w.buffer),
            (1000, 100, 16, 256 << 20)
        );
        assert!(w.device.is_none() && w.gid.is_none());
        // perf/tests/rdma_perf.rs's sweep.
        let w = p("--max_block_size 16384 --max_batch_size 4 --num_iter 20 --warmup_iter 2 --total_buffer_size 1048576")
            .expect("ok");
        assert_eq!(
            (w.max_block, w.max_batch, w.iters, w.warmup, w.buffer),
            (16384, 4, 20, 2, 1 << 20)
        );
        let w =
            p("--op read --start_block_size=8192 -d rxe0 -x 1 --large_blk_iter_ftr 0").expect("ok");
        assert_eq!((w.op, w.start_block), (SweepOp::Read, 8192));
        assert_eq!((w.device.as_deref(), w.gid), (Some("rxe0"), Some(1)));
        assert_eq!(p("--op READ").expect("ok").op, SweepOp::Read);
        assert!(p("--op SEND").is_err());
        assert!(p("--max_block_size 1").is_err(), "below the start block");
        assert!(p("--start_batch_size 8 --max_batch_size 4").is_err());
        assert!(p("--start_block_size 0").is_err());
        assert!(p("--num_iter 0").is_err());
        assert!(p("--max_block_size 1048576 --total_buffer_size 4096").is_err());
        assert!(p("--bogus").is_err());
    }
}
