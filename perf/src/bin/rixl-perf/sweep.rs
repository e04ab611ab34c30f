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

use super::stats::pct;
use super::{on_core, s, Res};

const USAGE: &str = "\
usage: rixl-perf sweep [options]   (nixlbench flags)
    --op READ|WRITE                 (default WRITE)
    --start_block_size <B>          (default 4096)
    --max_block_size <B>            (default 67108864)
    --start_batch_size <n>          (default 1)
    --max_batch_size <n>            (default 1)
    --num_iter <n>                  (default 1000)
    --warmup_iter <n>               (default 100)
    --large_blk_iter_ftr <n>        iterations divided by this above 1 MiB blocks (default 16)
    --total_buffer_size <B>         (default 268435456; descriptors wrap inside it)
    -d <dev>, -x <gid index>        device and GID index (default $RIXL_RDMA_DEVICE, $RIXL_GID_INDEX)";

struct Sweep {
    op: Op,
    start_block: u64,
    max_block: u64,
    start_batch: u64,
    max_batch: u64,
    iters: u64,
    warmup: u64,
    large_factor: u64,
    buffer: u64,
    device: Option<String>,
    gid: Option<u32>,
}

fn parse(argv: &[String]) -> Res<Sweep> {
    let mut w = Sweep {
        op: Op::Write,
        start_block: 4096,
        max_block: 64 << 20,
        start_batch: 1,
        max_batch: 1,
        iters: 1000,
        warmup: 100,
        large_factor: 16,
        buffer: 256 << 20,
        device: None,
        gid: None,
    };
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) => (f, Some(v.to_string())),
            None => (a.as_str(), None),
        };
        let mut v = || -> Res<String> {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or(format!("{flag} needs a value"))
        };
        let mut n = || -> Res<u64> { v()?.parse().map_err(|_| format!("{flag}: not a number")) };
        match flag {
            "--op" => {
                w.op = match v()?.to_ascii_uppercase().as_str() {
                    "READ" => Op::Read,
                    "WRITE" => Op::Write,
                    o => return Err(format!("--op READ or WRITE, not {o}")),
                }
            }
            "--start_block_size" => w.start_block = n()?,
            "--max_block_size" => w.max_block = n()?,
            "--start_batch_size" => w.start_batch = n()?,
            "--max_batch_size" => w.max_batch = n()?,
            "--num_iter" => w.iters = n()?,
            "--warmup_iter" => w.warmup = n()?,
            "--large_blk_iter_ftr" => w.large_factor = n()?.max(1),
            "--total_buffer_size" => w.buffer = n()?,
            "-d" => w.device = Some(v()?),
            "-x" => w.gid = Some(n()? as u32),
            "-h" | "--help" => return Err(USAGE.into()),
            f => return Err(format!("unknown option {f}\n{USAGE}")),
        }
    }
    if w.start_block == 0
        || w.start_block > w.max_block
        || w.start_batch == 0
        || w.start_batch > w.max_batch
        || w.iters == 0
    {
        return Err(format!("inconsistent sizes\n{USAGE}"));
    }
    if w.max_block > w.buffer {
        return Err("--max_block_size exceeds --total_buffer_size".into());
    }
    Ok(w)
}

pub fn main(argv: &[String]) -> Res<()> {
    let w = parse(argv)?;
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
    let target_cpu = if cpus.len() > 1 { 1 } else { 0 };
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
    let run = std::thread::spawn(move || -> Res<()> {
        on_core(0, move || {
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
                            (w.iters / w.large_factor).max(1)
                        } else {
                            w.iters
                        };
                        for _ in 0..w.warmup.min(iters) {
                            e.transfer(conn, w.op, &local, &remote, TransferOptions::default())
                                .await
                                .map_err(s)?;
                        }
                        let (mut prep, mut post, mut tx) = (Vec::new(), Vec::new(), Vec::new());
                        let t0 = Instant::now();
                        for _ in 0..iters {
                            let st = e
                                .transfer(conn, w.op, &local, &remote, TransferOptions::default())
                                .await
                                .map_err(s)?;
                            prep.push(st.prepare.as_secs_f64() * 1e6);
                            post.push(st.post.as_secs_f64() * 1e6);
                            tx.push(st.total.as_secs_f64() * 1e6);
                        }
                        let el = t0.elapsed().as_secs_f64();
                        let avg = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
                        println!(
                            "{:>14} | {:>10} | {:>12.6} | {:>13.3} | {:>12.3} | {:>12.3} | {:>12.3} | {:>12.3} | {:>12.3} | {:>12.3} | {:>12.0}",
                            block,
                            batch,
                            (iters * batch * block) as f64 / el / 1e9,
                            el * 1e6 / (iters * batch) as f64,
                            avg(&prep),
                            pct(&mut prep, 0.99),
                            avg(&post),
                            pct(&mut post, 0.99),
                            avg(&tx),
                            pct(&mut tx, 0.99),
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
