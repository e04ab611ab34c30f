//! GPU check, one command (`scripts/gpu-check`), for a machine with an NVIDIA GPU:
//!
//! 1. device-to-device copy through rixl (a `CopyStream` copy awaited as a future on a glommio
//!    core) next to plain `cuMemcpyDtoD`, bytes verified;
//! 2. CUDA IPC between two processes on one GPU: the parent exports a buffer, a child process
//!    opens the handle and copies it into its own buffer through rixl, bytes verified;
//! 3. host<->device through pinned memory next to pageable memory;
//! 4. 1024 scattered 64 KiB block copies on one stream with one event, a `cuMemcpyAsync` each
//!    next to rixl's block-copy kernel (`copy_all`, the floor for 5); `copy_all` on 5000
//!    copies of odd sizes and offsets plus large ones, checked byte for byte; and both for 2 to
//!    256 copies of 64 KiB and 1 MiB (where the kernel pays);
//! 5. the agent API between two processes on one node, routed by the topology to CUDA IPC (no
//!    NIC needed): a peer agent's VRAM read with `agent.read(...)`; 1024 scattered 64 KiB blocks
//!    written to it in reversed order with one `agent.write` (time next to the floor); a write
//!    future dropped in flight together with its source registration; bytes verified each time;
//! 6. GPUDirect RDMA registration (dma-buf or nvidia-peermem) when an RDMA device exists.
//!
//! Without a CUDA driver it prints `SKIPPED gpu_check: ...` and exits 0.
//!
//! ```text
//! gpu_check [--mib 256] [--iters 10] [--gpu 0]
//! ```

use std::sync::Arc;
use std::time::Instant;

use rixl::gpudirect::{DeviceMemory, Gpu, PinnedHostMemory};
use rixl::nvlink::ipc::{CopyStream, DeviceCopy, DeviceRange, ImportedMemory, IpcHandle};

use clap::Parser;

/// gpu_check's command line.
#[derive(Debug, Clone, Parser)]
#[command(about = "rixl's GPU checks (CUDA IPC, block-copy kernel, agent on the IPC path)")]
struct Opts {
    /// MiB of GPU memory per buffer.
    #[arg(long, default_value_t = 256)]
    mib: usize,
    /// Timed repetitions of each copy.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: i32,
    /// Child process of the CUDA IPC stage: the exported handle (hex).
    #[arg(long, hide = true)]
    child: Option<String>,
    /// Child process of the agent stage (the peer agent).
    #[arg(long, hide = true)]
    agent_child: bool,
}

type BoxError = Box<dyn std::error::Error>;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

fn gbs(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn verify(mem: &DeviceMemory, len: usize) -> Result<(), BoxError> {
    let mut back = vec![0u8; len];
    mem.read(0, &mut back)?;
    if let Some(i) = (0..len).find(|&i| back[i] != pattern(i)) {
        return Err(format!("byte {i} differs after the copy").into());
    }
    Ok(())
}

/// Runs `copies` rixl copies of `src` into `dst` on a pinned glommio core; returns seconds.
fn rixl_copies(
    gpu: &Arc<Gpu>,
    dst: Arc<dyn DeviceRange>,
    src: Arc<dyn DeviceRange>,
    len: usize,
    copies: usize,
) -> Result<f64, BoxError> {
    let gpu = Arc::clone(gpu);
    let secs =
        glommio::LocalExecutorBuilder::new(glommio::Placement::Fixed(rixl::runtime::cpu_at(0)))
            .spawn(move || async move {
                let stream = CopyStream::new(&gpu).map_err(|e| e.to_string())?;
                let t = Instant::now();
                for _ in 0..copies {
                    let p = stream
                        .copy(Arc::clone(&dst), 0, Arc::clone(&src), 0, len)
                        .map_err(|e| e.to_string())?;
                    rixl::runtime::gpu::wait_copy(p)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Ok::<f64, String>(t.elapsed().as_secs_f64())
            })?
            .join()??;
    Ok(secs)
}

fn child(opts: &Opts, handle: &str) -> Result<(), BoxError> {
    let bytes = hex::decode(handle)?;
    let len = opts.mib << 20;
    let iters = opts.iters;
    let gpu = Gpu::open(opts.gpu)?;
    // A peer that states more than it exported is refused (the handle is closed again).
    match ImportedMemory::open(&gpu, &IpcHandle::from_bytes(&bytes)?, len + (64 << 20)) {
        Err(rixl::nvlink::ipc::IpcError::OutOfRange { len: l, size, .. }) => println!(
            "  CUDA IPC: a stated length of {l} bytes over the {size}-byte export is refused"
        ),
        Ok(_) => return Err("an IPC import longer than its allocation was accepted".into()),
        Err(e) => return Err(format!("an over-long IPC import failed untyped: {e}").into()),
    }
    let imported: Arc<dyn DeviceRange> = Arc::new(ImportedMemory::open(
        &gpu,
        &IpcHandle::from_bytes(&bytes)?,
        len,
    )?);
    let mine = Arc::new(DeviceMemory::alloc(&gpu, len)?);
    let secs = rixl_copies(&gpu, mine.clone(), imported, len, iters)?;
    verify(&mine, len)?;
    println!(
        "  CUDA IPC (child process, rixl copy from the parent's buffer): {:.1} GB/s, {} MiB verified",
        gbs(len * iters, secs),
        len >> 20
    );
    Ok(())
}

/// `len` bytes of VRAM on GPU `ordinal`, registered with `a` and visible to every peer.
fn vram(
    a: &rixl::agent::Agent,
    ordinal: i32,
    len: usize,
) -> Result<rixl::agent::Registration, BoxError> {
    Ok(futures_lite::future::block_on(a.register_vram(
        ordinal,
        len,
        rixl::agent::Visibility::All,
    ))?)
}

/// The peer's region `region` (its first `len` bytes), read into fresh VRAM with `agent.read`
/// and copied to the host.
fn read_back(
    a: &rixl::agent::Agent,
    peer: &str,
    region: u64,
    len: usize,
    ordinal: i32,
) -> Result<Vec<u8>, BoxError> {
    let back = vram(a, ordinal, len)?;
    futures_lite::future::block_on(a.read(peer, &whole(&back, len), &whole_remote(region, len)))?;
    let mut host = vec![0u8; len];
    back.region().read_at(0, &mut host)?;
    Ok(host)
}

/// Checks that every one of the first `len` bytes of the peer's region `region` is `value`.
fn peer_all(
    a: &rixl::agent::Agent,
    peer: &str,
    region: u64,
    len: usize,
    ordinal: i32,
    value: u8,
) -> Result<(), BoxError> {
    let host = read_back(a, peer, region, len, ordinal)?;
    match host.iter().position(|&b| b != value) {
        Some(i) => Err(format!("byte {i} at the peer is {:#x}, not {value:#x}", host[i]).into()),
        None => Ok(()),
    }
}

/// The first `len` bytes of `r` as one local descriptor.
fn whole(r: &rixl::agent::Registration, len: usize) -> rixl::runtime::LocalDescList {
    let mut l = rixl::runtime::LocalDescList::new();
    l.push(r.region(), 0, len as u64);
    l
}

/// The first `len` bytes of the peer's region `region`.
fn whole_remote(region: u64, len: usize) -> [rixl::agent::RemoteRef; 1] {
    [rixl::agent::RemoteRef {
        region,
        offset: 0,
        len: len as u64,
    }]
}

fn agent_config() -> rixl::agent::AgentConfig {
    let mut cfg = rixl::agent::AgentConfig::default()
        .with_cluster_key(rixl::agent::ClusterKey::env_or_process_local().expect("a cluster key"));
    cfg.engine.require_nic = false;
    cfg
}

/// The peer agent: exports patterned VRAM and serves its metadata until stdin closes.
fn agent_child(opts: &Opts) -> Result<(), BoxError> {
    let len = opts.mib << 20;
    let a = rixl::agent::Agent::new("gpu-peer", agent_config())?;
    let reg = vram(&a, opts.gpu, len)?;
    let host: Vec<u8> = (0..len).map(pattern).collect();
    reg.region().write_at(0, &host)?;
    let addr = a.listen("127.0.0.1:0")?;
    println!("READY {addr} {}", reg.id());
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    a.shutdown();
    Ok(())
}

/// `count` copies of `size` bytes from `s` to `d`, blocks in reversed order.
fn reversed(
    s: &Arc<dyn DeviceRange>,
    d: &Arc<dyn DeviceRange>,
    count: usize,
    size: usize,
) -> Vec<DeviceCopy> {
    (0..count)
        .map(|i| DeviceCopy {
            dst: d.clone(),
            dst_offset: (count - 1 - i) * size,
            src: s.clone(),
            src_offset: i * size,
            len: size,
        })
        .collect()
}

/// The first (block, byte) of `buf` that does not hold what [`reversed`] copies of the
/// pattern put there: block `i` of `size` bytes, `pattern` from `i * size`, at block
/// `blocks - 1 - i`.
fn misplaced(buf: &[u8], blocks: usize, size: usize) -> Option<(usize, usize)> {
    (0..blocks).find_map(|i| {
        let at = (blocks - 1 - i) * size;
        (0..size)
            .find(|&k| buf[at + k] != pattern(i * size + k))
            .map(|k| (i, k))
    })
}

/// Seconds for `copies` through `copy_all` (`all`) or `copy_each`, until their event is done.
fn timed(stream: &CopyStream, copies: Vec<DeviceCopy>, all: bool) -> Result<f64, BoxError> {
    let t = Instant::now();
    let mut p = if all {
        stream.copy_all(copies)?
    } else {
        stream.copy_each(copies)?
    };
    while !p.poll()? {}
    Ok(t.elapsed().as_secs_f64())
}

const BLOCK: usize = 64 << 10;
const BLOCKS: usize = 1024;
const ROUNDS: usize = 5;
const SINGLE_ROUNDS: usize = 101;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median seconds of `rounds` calls of `f`.
fn median_time(
    rounds: usize,
    mut f: impl FnMut() -> Result<(), BoxError>,
) -> Result<f64, BoxError> {
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(&mut times))
}

/// The floor for the scattered write: the same reversed 64 KiB block copies between two buffers
/// of this process on one stream with one completion event, no agent, no engine, no IPC: once
/// as a `cuMemcpyAsync` per block (`CopyStream::copy_each`), once as what the agent uses
/// (`copy_all`: one launch of rixl's block-copy kernel where the driver loads it); and one block
/// alone.
fn scattered_baseline(
    gpu: &Arc<Gpu>,
    src: &Arc<DeviceMemory>,
    dst: &Arc<DeviceMemory>,
    len: usize,
) -> Result<Floor, BoxError> {
    let blocks = (len / BLOCK).min(BLOCKS);
    let stream = CopyStream::new(gpu)?;
    let (s, d): (Arc<dyn DeviceRange>, Arc<dyn DeviceRange>) = (src.clone(), dst.clone());
    let run = |all: bool| -> Result<f64, BoxError> {
        let mut times = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            dst.fill(0)?;
            times.push(timed(&stream, reversed(&s, &d, blocks, BLOCK), all)?);
        }
        let mut back = vec![0u8; blocks * BLOCK];
        dst.read(0, &mut back)?;
        if let Some((i, _)) = misplaced(&back, blocks, BLOCK) {
            return Err(format!("block copies: block {i} differs").into());
        }
        Ok(median(&mut times))
    };
    let each = run(false)?;
    let all = run(true)?;
    let single = median_time(SINGLE_ROUNDS, || {
        let mut p = stream.copy(d.clone(), 0, s.clone(), 0, BLOCK)?;
        while !p.poll()? {}
        Ok(())
    })?;
    println!(
        "  {blocks} scattered {} KiB block copies in one process, one stream, one event, median of {ROUNDS}: a cuMemcpyAsync each {:.1} µs ({:.0} copies/s); copy_all ({}) {:.1} µs ({:.0} copies/s, {:.1}x faster); verified",
        BLOCK >> 10,
        each * 1e6,
        blocks as f64 / each,
        if stream.uses_kernel() {
            "one launch of the block-copy kernel"
        } else {
            "kernel not loaded: a cuMemcpyAsync each"
        },
        all * 1e6,
        blocks as f64 / all,
        each / all
    );
    println!(
        "  one {} KiB copy (cuMemcpyAsync, event polled), median of {SINGLE_ROUNDS}: {:.1} µs",
        BLOCK >> 10,
        single * 1e6
    );
    Ok(Floor { all, single })
}

/// The bare-copy times the agent's figures are compared with (median seconds).
#[derive(Debug, Clone, Copy)]
struct Floor {
    /// 1024 scattered blocks through `copy_all`.
    all: f64,
    /// One block.
    single: f64,
}

/// `copy_all` on an awkward mix, checked byte for byte: 5000 copies (more than one kernel
/// launch holds) of 1 B to 16 KiB and eight of 64 KiB to 1 MiB (several kernel pieces each), at
/// odd offsets, mirrored end to end, plus two 2 MiB copies (past the kernel's limit: copy
/// engines) in the same call.
fn mixed_copies(
    gpu: &Arc<Gpu>,
    src: &Arc<DeviceMemory>,
    dst: &Arc<DeviceMemory>,
    host: &[u8],
) -> Result<(), BoxError> {
    let mut pieces = Vec::new(); // (src offset, len)
    let mut at = 3usize;
    for i in 0..5000usize {
        let len = 1 + pattern(i) as usize * 64 + pattern(i + 7) as usize % 61;
        pieces.push((at, len));
        at += len + pattern(i + 3) as usize % 5;
    }
    // Past one kernel piece (64 KiB) up to the kernel's limit: split over several blocks.
    for i in 0..8usize {
        let len = (65_537 + i * 130_001).min(rixl::nvlink::ipc::KERNEL_MAX_COPY);
        pieces.push((at, len));
        at += len + 3;
    }
    for _ in 0..2 {
        pieces.push((at, 2 << 20));
        at += (2 << 20) + 1;
    }
    let span = at;
    if span > host.len() {
        return Err(format!("mixed copies need {span} bytes").into());
    }
    let stream = CopyStream::new(gpu)?;
    let (s, d): (Arc<dyn DeviceRange>, Arc<dyn DeviceRange>) = (src.clone(), dst.clone());
    let copies = pieces
        .iter()
        .map(|&(off, len)| DeviceCopy {
            dst: d.clone(),
            dst_offset: span - off - len,
            src: s.clone(),
            src_offset: off,
            len,
        })
        .collect();
    dst.fill(0)?;
    let mut p = stream.copy_all(copies)?;
    while !p.poll()? {}
    let mut want = vec![0u8; span];
    for &(off, len) in &pieces {
        want[span - off - len..span - off].copy_from_slice(&host[off..off + len]);
    }
    let mut got = vec![0u8; span];
    dst.read(0, &mut got)?;
    if let Some(i) = (0..span).find(|&i| got[i] != want[i]) {
        return Err(format!("mixed copies: byte {i} of {span} differs").into());
    }
    println!(
        "  copy_all on {} copies of 1 B..16 KiB, eight of 64 KiB..1 MiB, all at odd offsets, plus two 2 MiB ({}): {} bytes checked, every byte as expected",
        pieces.len() - 10,
        if stream.uses_kernel() {
            "kernel launches and copy engines"
        } else {
            "a cuMemcpyAsync each"
        },
        span
    );
    Ok(())
}

/// Where the kernel pays: `copy_each` (a `cuMemcpyAsync` per copy) next to `copy_all` for 2, 16
/// and 256 copies of 64 KiB and of 1 MiB (median of 5 each).
fn crossover(
    gpu: &Arc<Gpu>,
    src: &Arc<DeviceMemory>,
    dst: &Arc<DeviceMemory>,
) -> Result<(), BoxError> {
    let stream = CopyStream::new(gpu)?;
    let (s, d): (Arc<dyn DeviceRange>, Arc<dyn DeviceRange>) = (src.clone(), dst.clone());
    let mut line = String::from("  copy_each vs copy_all, median of 5 (µs):");
    for size in [64usize << 10, 1 << 20] {
        for count in [2usize, 16, 256] {
            if size * count > src.len() {
                continue;
            }
            let mut t = [Vec::new(), Vec::new()];
            for _ in 0..5 {
                for (k, times) in t.iter_mut().enumerate() {
                    times.push(timed(&stream, reversed(&s, &d, count, size), k == 1)?);
                }
            }
            let [mut each, mut all] = t;
            line += &format!(
                " {count}x{}K {:.1}/{:.1};",
                size >> 10,
                median(&mut each) * 1e6,
                median(&mut all) * 1e6
            );
        }
    }
    println!("{line}");
    Ok(())
}

/// A KV-handoff shape: 64 KiB blocks written to the peer's VRAM in reverse order (one
/// descriptor per block, one `agent.write`), then the peer's whole region read back into a second
/// region and every block checked at its new place.
fn scattered_write(
    a: &rixl::agent::Agent,
    peer: &str,
    mine: &rixl::agent::Registration,
    region: u64,
    len: usize,
    ordinal: i32,
    baseline: Option<Floor>,
) -> Result<(), BoxError> {
    let blocks = (len / BLOCK).min(BLOCKS);
    let mut local = rixl::runtime::LocalDescList::new();
    let mut remote = Vec::with_capacity(blocks);
    for i in 0..blocks {
        local.push(mine.region(), (i * BLOCK) as u64, BLOCK as u64);
        remote.push(rixl::agent::RemoteRef {
            region,
            offset: ((blocks - 1 - i) * BLOCK) as u64,
            len: BLOCK as u64,
        });
    }
    let mut st = rixl::runtime::TransferStats::default();
    let secs = median_time(ROUNDS, || {
        st = futures_lite::future::block_on(a.write(peer, &local, &remote))?;
        Ok(())
    })?;
    let host = read_back(a, peer, region, len, ordinal)?;
    if let Some((i, k)) = misplaced(&host, blocks, BLOCK) {
        return Err(format!("scattered write: block {i} byte {k} differs at the peer").into());
    }
    println!(
        "  agent.write of {blocks} scattered {} KiB blocks to the peer's VRAM (reversed, {} copies), median of {ROUNDS}: {:.1} µs, {:.1} GB/s, {:.0} descriptors/s{}; every block verified at its place",
        BLOCK >> 10,
        st.work_requests,
        secs * 1e6,
        gbs(blocks * BLOCK, secs),
        blocks as f64 / secs,
        baseline.map_or(String::new(), |b| format!(
            " ({:.2}x the time of the bare copies)",
            secs / b.all
        ))
    );
    let mut one = rixl::runtime::LocalDescList::new();
    one.push(mine.region(), 0, BLOCK as u64);
    let to = [rixl::agent::RemoteRef {
        region,
        offset: 0,
        len: BLOCK as u64,
    }];
    let single = median_time(SINGLE_ROUNDS, || {
        futures_lite::future::block_on(a.write(peer, &one, &to))?;
        Ok(())
    })?;
    println!(
        "  one {} KiB agent.write to the peer's VRAM, median of {SINGLE_ROUNDS}: {:.1} µs{}",
        BLOCK >> 10,
        single * 1e6,
        baseline.map_or(String::new(), |b| format!(
            " ({:.1} µs more than the bare copy)",
            (single - b.single) * 1e6
        ))
    );
    Ok(())
}

/// A transfer future dropped while its copies are in flight, and its source registration dropped
/// right after: the in-flight copies keep the memory alive and finish; the peer's region then
/// holds the source's bytes throughout (read back on the same stream, so after those copies).
fn dropped_future(
    a: &rixl::agent::Agent,
    peer: &str,
    region: u64,
    len: usize,
    ordinal: i32,
) -> Result<(), BoxError> {
    use futures_lite::future::{block_on, poll_once};
    let remote = whole_remote(region, len);
    let source = vram(a, ordinal, len)?;
    source.region().write_at(0, &vec![0xab; len])?;
    let local = whole(&source, len);
    let mut fut = Box::pin(a.write(peer, &local, &remote));
    let state = match block_on(poll_once(&mut fut)) {
        None => "in flight",
        Some(r) => {
            r?;
            "already complete"
        }
    };
    drop(fut);
    drop(local);
    drop(source);
    peer_all(a, peer, region, len, ordinal, 0xab).map_err(|e| format!("dropped future: {e}"))?;
    println!(
        "  agent.write future dropped after one poll ({state}), its source registration dropped at once: the copies finished from live memory, {} MiB verified at the peer",
        len >> 20
    );
    Ok(())
}

/// A transfer past its deadline: a second agent whose transfers may take 1 µs writes the peer's
/// whole region 64 times over. Its future ends in `Timeout`, its source registration is dropped at once, and
/// the copies still finish from live memory: the peer's region, read back later, holds the
/// source's bytes.
fn timed_out(
    a: &rixl::agent::Agent,
    peer: &str,
    addr: &str,
    region: u64,
    len: usize,
    ordinal: i32,
) -> Result<(), BoxError> {
    use futures_lite::future::block_on;
    let mut cfg = agent_config();
    cfg.engine.transfer_timeout = std::time::Duration::from_micros(1);
    let b = rixl::agent::Agent::new("gpu-check-deadline", cfg)?;
    let name = b.fetch_remote_metadata(addr)?;
    let source = vram(&b, ordinal, len)?;
    source.region().write_at(0, &vec![0x5a; len])?;
    // 64 passes over the peer's whole region (overlapping destinations are fine here: every
    // source byte is the same): ~9 ms of copying on an H200, far past the deadline.
    let mut local = rixl::runtime::LocalDescList::new();
    for _ in 0..64 {
        local.push(source.region(), 0, len as u64);
    }
    let remote = vec![whole_remote(region, len)[0]; 64];
    let res = block_on(b.write(&name, &local, &remote));
    drop(local);
    drop(source);
    match res {
        Err(rixl::agent::AgentError::Ipc(rixl::nvlink::ipc::IpcError::Timeout(t))) => {
            println!("  agent.write past a {t:?} deadline: Timeout")
        }
        Ok(_) => return Err("the 1 µs transfer did not time out".into()),
        Err(e) => return Err(format!("expected Timeout, got {e}").into()),
    }
    // The detached copies are long done after this (256 MiB take ~0.2 ms).
    std::thread::sleep(std::time::Duration::from_millis(200));
    peer_all(a, peer, region, len, ordinal, 0x5a).map_err(|e| format!("after the timeout: {e}"))?;
    println!(
        "    the timed-out copies finished from live memory (source registration dropped at the timeout): {} MiB verified at the peer",
        len >> 20
    );
    b.shutdown();
    Ok(())
}

/// The fixed cost of one small CUDA-IPC transfer with the engine's core spinning before it
/// sleeps (the default) and with it sleeping at once: a second agent with `spin_before_park`
/// zero, both writing one 64 KiB block to the peer, in alternating rounds.
fn spin_ab(
    a: &rixl::agent::Agent,
    peer: &str,
    addr: &str,
    region: u64,
    ordinal: i32,
) -> Result<(), BoxError> {
    use futures_lite::future::block_on;
    let mut cfg = agent_config();
    cfg.engine.spin_before_park = std::time::Duration::ZERO;
    let c = rixl::agent::Agent::new("gpu-check-sleepy", cfg)?;
    let c_peer = c.fetch_remote_metadata(addr)?;
    let (mine_a, mine_c) = (vram(a, ordinal, BLOCK)?, vram(&c, ordinal, BLOCK)?);
    let (la, lc) = (whole(&mine_a, BLOCK), whole(&mine_c, BLOCK));
    let to = whole_remote(region, BLOCK);
    let (mut ta, mut tc) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        for _ in 0..21 {
            let t = Instant::now();
            block_on(a.write(peer, &la, &to))?;
            ta.push(t.elapsed().as_secs_f64());
        }
        for _ in 0..21 {
            let t = Instant::now();
            block_on(c.write(&c_peer, &lc, &to))?;
            tc.push(t.elapsed().as_secs_f64());
        }
    }
    println!(
        "  one {} KiB agent.write, 5 alternating rounds of 21: core spins {:?} before sleeping (default) {:.1} µs median, sleeps at once {:.1} µs median",
        BLOCK >> 10,
        rixl::runtime::EngineConfig::default().spin_before_park,
        median(&mut ta) * 1e6,
        median(&mut tc) * 1e6
    );
    c.shutdown();
    Ok(())
}

fn agent_stage(
    len: usize,
    iters: usize,
    ordinal: i32,
    baseline: Option<Floor>,
) -> Result<(), BoxError> {
    use std::io::{BufRead, Write};
    let mut peer = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--agent-child",
            "--mib",
            &(len >> 20).to_string(),
            "--gpu",
            &ordinal.to_string(),
        ])
        // The child agent proves itself with this process's cluster key.
        .env(
            "RIXL_CLUSTER_KEY",
            rixl::agent::ClusterKey::env_or_process_local()?.to_hex(),
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut first = String::new();
    std::io::BufReader::new(peer.stdout.take().ok_or("child stdout")?).read_line(&mut first)?;
    let f: Vec<&str> = first.split_whitespace().collect();
    let (addr, region) = match f.as_slice() {
        ["READY", addr, region] => (addr.to_string(), region.parse::<u64>()?),
        _ => return Err(format!("peer agent did not start: {first:?}").into()),
    };
    let a = rixl::agent::Agent::new("gpu-check", agent_config())?;
    let name = a.fetch_remote_metadata(&addr)?;
    let mine = vram(&a, ordinal, len)?;
    let (local, remote) = (whole(&mine, len), whole_remote(region, len));
    // The first transfer to a peer discovers the topology and opens the peer's IPC handle.
    let t = Instant::now();
    let mut st = futures_lite::future::block_on(a.read(&name, &local, &remote))?;
    let first = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..iters {
        st = futures_lite::future::block_on(a.read(&name, &local, &remote))?;
    }
    let secs = t.elapsed().as_secs_f64();
    let mut back = vec![0u8; len];
    mine.region().read_at(0, &mut back)?;
    if let Some(i) = (0..len).find(|&i| back[i] != pattern(i)) {
        return Err(format!("agent read: byte {i} differs").into());
    }
    println!(
        "  agent.read of a peer process's VRAM (same node, routed to CUDA IPC: {} copy per read): first read {:.1} ms (topology discovery, IPC open), then {iters} reads {:.1} GB/s, {} MiB verified",
        st.work_requests,
        first * 1e3,
        gbs(len * iters, secs),
        len >> 20
    );
    ipc_latency(&a, &name, &mine, region, ordinal)?;
    // A node without a NIC sends its notifications on the side channel: delivered into the
    // peer's stream when this returns.
    if !a.has_nic() {
        let t = Instant::now();
        futures_lite::future::block_on(a.notify(&name, b"gpu-check: reads done"))?;
        println!(
            "  notification without a NIC (side channel): delivered in {:.2} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    scattered_write(&a, &name, &mine, region, len, ordinal, baseline)?;
    dropped_future(&a, &name, region, len, ordinal)?;
    spin_ab(&a, &name, &addr, region, ordinal)?;
    timed_out(&a, &name, &addr, region, len, ordinal)?;
    caller_owned_vram(&a, &name, region, len, ordinal)?;
    if let Some(mut stdin) = peer.stdin.take() {
        let _ = writeln!(stdin, "done");
    }
    let _ = peer.wait();
    a.shutdown();
    Ok(())
}

/// Latency of small reads of a peer process's VRAM over CUDA IPC (`agent.read`, 4 KiB), next
/// to a plain 4 KiB `cuMemcpyDtoD` in one process.
fn ipc_latency(
    a: &rixl::agent::Agent,
    name: &str,
    mine: &rixl::agent::Registration,
    region: u64,
    ordinal: i32,
) -> Result<(), BoxError> {
    const SMALL: u64 = 4096;
    const N: u32 = 2000;
    let mut local = rixl::runtime::LocalDescList::new();
    local.push(mine.region(), 0, SMALL);
    let remote = [rixl::agent::RemoteRef {
        region,
        offset: 0,
        len: SMALL,
    }];
    futures_lite::future::block_on(a.read(name, &local, &remote))?;
    let t = Instant::now();
    for _ in 0..N {
        futures_lite::future::block_on(a.read(name, &local, &remote))?;
    }
    let ipc_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(N);
    let gpu = Gpu::open(ordinal)?;
    let (src, dst) = (
        DeviceMemory::alloc(&gpu, SMALL as usize)?,
        DeviceMemory::alloc(&gpu, SMALL as usize)?,
    );
    dst.copy_from(&src)?;
    let t = Instant::now();
    for _ in 0..N {
        dst.copy_from(&src)?;
    }
    let plain_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(N);
    println!(
        "  latency of a 4 KiB read: agent.read over CUDA IPC {ipc_us:.1} us, cuMemcpyDtoD {plain_us:.1} us ({:.2}x)",
        ipc_us / plain_us
    );
    Ok(())
}

/// Engine-owned VRAM: a cudarc `CudaSlice` from the engine's own allocator, and a layer-sized
/// range inside a larger allocation, registered with `register_device` and read into from the
/// peer process over CUDA IPC; every byte verified, then released.
fn caller_owned_vram(
    a: &rixl::agent::Agent,
    peer: &str,
    region: u64,
    len: usize,
    ordinal: i32,
) -> Result<(), BoxError> {
    use rixl::gpudirect::cudarc::driver::CudaContext;
    let ctx = CudaContext::new(ordinal as usize)?;
    let slice = ctx.default_stream().alloc_zeros::<u8>(len)?;
    let mem = DeviceMemory::from_cuda_slice(slice)?;
    let reg = futures_lite::future::block_on(a.register_device(mem, rixl::agent::Visibility::All))?;
    futures_lite::future::block_on(a.read(peer, &whole(&reg, len), &whole_remote(region, len)))?;
    let mut back = vec![0u8; len];
    reg.region().read_at(0, &mut back)?;
    if let Some(i) = (0..len).find(|&i| back[i] != pattern(i)) {
        return Err(format!("caller-owned CudaSlice: byte {i} differs").into());
    }
    let released = futures_lite::future::block_on(reg.release());
    // A range inside a larger allocation (one "layer" of a pool), and one that leaves it.
    let gpu = Gpu::open(ordinal)?;
    let pool = Arc::new(DeviceMemory::alloc(&gpu, 2 * len)?);
    let layer = DeviceMemory::slice_of(&pool, len, len)?;
    let outside = DeviceMemory::slice_of(&pool, len + 1, len);
    let reg =
        futures_lite::future::block_on(a.register_device(layer, rixl::agent::Visibility::All))?;
    futures_lite::future::block_on(a.read(peer, &whole(&reg, len), &whole_remote(region, len)))?;
    reg.region().read_at(0, &mut back)?;
    let mut in_pool = vec![0u8; len];
    pool.read(len, &mut in_pool)?;
    if back != in_pool || (0..len).any(|i| back[i] != pattern(i)) {
        return Err("caller-owned range inside an allocation: bytes differ".into());
    }
    println!(
        "  caller-owned VRAM: a cudarc CudaSlice and a {} MiB range at offset {} MiB of a larger allocation registered with register_device, read over CUDA IPC, {} MiB verified each; released (deregistered: {}); a range leaving the allocation refused: {}",
        len >> 20,
        len >> 20,
        len >> 20,
        released.deregistered,
        outside.is_err()
    );
    if outside.is_ok() {
        return Err("a range outside its allocation was accepted".into());
    }
    Ok(())
}

/// 1. D2D: plain `cuMemcpyDtoD` next to rixl's copy future.
fn d2d(
    gpu: &Arc<Gpu>,
    src: &Arc<DeviceMemory>,
    dst: &Arc<DeviceMemory>,
    len: usize,
    iters: usize,
) -> Result<(), BoxError> {
    let t = Instant::now();
    for _ in 0..iters {
        dst.copy_from(src)?;
    }
    let base = gbs(len * iters, t.elapsed().as_secs_f64());
    verify(dst, len)?;
    dst.fill(0)?;
    let secs = rixl_copies(gpu, dst.clone(), src.clone(), len, iters)?;
    verify(dst, len)?;
    let ours = gbs(len * iters, secs);
    println!(
        "  device-to-device {} MiB x {iters}: cuMemcpyDtoD {base:.1} GB/s, rixl copy future {ours:.1} GB/s ({:.2}x), bytes verified",
        len >> 20,
        ours / base
    );
    Ok(())
}

/// 2. CUDA IPC across processes: a child opens `src`'s handle and copies it through rixl.
fn ipc(src: &DeviceMemory, len: usize, iters: usize, ordinal: i32) -> Result<(), BoxError> {
    let handle = IpcHandle::export(src)?;
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--child",
            &hex::encode(handle.0),
            "--mib",
            &(len >> 20).to_string(),
        ])
        .args(["--iters", &iters.to_string(), "--gpu", &ordinal.to_string()])
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        return Err(format!("IPC child failed: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(())
}

/// 3. Host <-> device: pinned vs pageable.
fn host_device(
    gpu: &Arc<Gpu>,
    dst: &DeviceMemory,
    host: &[u8],
    iters: usize,
) -> Result<(), BoxError> {
    let len = host.len();
    let mut pinned = PinnedHostMemory::alloc(gpu, len)?;
    pinned.as_mut_slice().copy_from_slice(host);
    let mut pageable = host.to_vec();
    let time =
        |f: &mut dyn FnMut() -> Result<(), rixl::gpudirect::Error>| -> Result<f64, BoxError> {
            let t = Instant::now();
            for _ in 0..iters {
                f()?;
            }
            Ok(gbs(len * iters, t.elapsed().as_secs_f64()))
        };
    let h2d_pinned = time(&mut || dst.write(0, pinned.as_slice()))?;
    let h2d_pageable = time(&mut || dst.write(0, &pageable))?;
    let d2h_pinned = time(&mut || dst.read(0, pinned.as_mut_slice()))?;
    let d2h_pageable = time(&mut || dst.read(0, &mut pageable))?;
    if pinned.as_slice() != host || pageable != host {
        return Err("host copies differ".into());
    }
    println!(
        "  host->device: pinned {h2d_pinned:.1} GB/s, pageable {h2d_pageable:.1} GB/s; device->host: pinned {d2h_pinned:.1} GB/s, pageable {d2h_pageable:.1} GB/s; bytes verified"
    );
    Ok(())
}

/// Stage 6, host-staged RDMA's copy leg on this GPU: VRAM copied into a host staging region in 4 MiB
/// chunks by `RegionCopier` (one `cuMemcpyDtoH` each, into the slot) and back, next to one plain
/// `cuMemcpy` of the whole buffer each way (pageable host memory, as the staging area is); and
/// the NICs the agent binds this GPU's memory to (none on a machine without RDMA: memory the
/// NIC cannot reach would be staged).
fn staged_copy_leg(ordinal: i32, len: usize, iters: usize) -> Result<(), BoxError> {
    use rixl::staging::{Copier, RegionCopier};
    let mut cfg = agent_config();
    cfg.engine.require_nic = false;
    let agent = rixl::agent::Agent::new("gpu-check-staged", cfg)?;
    let vram = futures_lite::future::block_on(agent.register_vram(
        ordinal,
        len,
        rixl::agent::Visibility::All,
    ))?;
    let host = futures_lite::future::block_on(agent.register(len, rixl::agent::Visibility::All))?;
    let pattern_bytes: Vec<u8> = (0..len).map(pattern).collect();
    vram.region().write_at(0, &pattern_bytes)?;
    let chunk = rixl::agent::STAGE_CHUNK;
    let copier = RegionCopier;
    let t = Instant::now();
    for _ in 0..iters {
        let mut off = 0u64;
        while off < len as u64 {
            let n = chunk.min(len as u64 - off);
            copier.device_to_region(vram.region(), off, host.region(), off, n)?;
            off += n;
        }
    }
    let staged_out = gbs(len * iters, t.elapsed().as_secs_f64());
    let mut back = vec![0u8; len];
    host.region().read_at(0, &mut back)?;
    if back != pattern_bytes {
        return Err("staged device->host copy differs".into());
    }
    let t = Instant::now();
    for _ in 0..iters {
        let mut off = 0u64;
        while off < len as u64 {
            let n = chunk.min(len as u64 - off);
            copier.region_to_device(host.region(), off, vram.region(), off, n)?;
            off += n;
        }
    }
    let staged_in = gbs(len * iters, t.elapsed().as_secs_f64());
    let gpu_mem = vram
        .region()
        .gpu_memory()
        .ok_or("VRAM region without GPU memory")?;
    let t = Instant::now();
    for _ in 0..iters {
        gpu_mem.read(0, &mut back)?;
    }
    let plain_out = gbs(len * iters, t.elapsed().as_secs_f64());
    let t = Instant::now();
    for _ in 0..iters {
        gpu_mem.write(0, &back)?;
    }
    let plain_in = gbs(len * iters, t.elapsed().as_secs_f64());
    let choice = agent.binding(&vram).ok_or("no binding")?;
    println!(
        "  staged copy leg ({} MiB chunks): device->slot {staged_out:.1} GB/s ({:.2}x plain cuMemcpy {plain_out:.1}), slot->device {staged_in:.1} GB/s ({:.2}x plain {plain_in:.1}); GPU memory bound to {:?} ({}), staged {}",
        chunk >> 20,
        staged_out / plain_out,
        staged_in / plain_in,
        choice.nics,
        choice.relation,
        agent.is_staged(&vram)
    );
    agent.shutdown();
    Ok(())
}

/// 5. GPUDirect RDMA registration on the first RDMA device, if any.
fn gpudirect(gpu: &Arc<Gpu>) -> Result<(), BoxError> {
    match rixl::verbs::DeviceList::new().and_then(|l| l.find(None).map(|d| d.open())) {
        Ok(Ok(ctx)) => {
            let pd = rixl::verbs::ProtectionDomain::new(&ctx)?;
            let mem = DeviceMemory::alloc(gpu, 64 << 20)?;
            match rixl::gpudirect::GpuRegistration::register(
                &pd,
                mem,
                rixl::verbs::AccessFlags::ALL_RDMA,
            ) {
                Ok(r) => println!(
                    "  GPUDirect RDMA: 64 MiB registered on {} via {:?} (lkey {:#x})",
                    ctx.name(),
                    r.kind(),
                    r.lkey()
                ),
                Err(e) => println!("  GPUDirect RDMA on {}: {e}", ctx.name()),
            }
        }
        _ => println!("  GPUDirect RDMA: not exercised (no RDMA device on this machine)"),
    }
    Ok(())
}

fn main() -> Result<(), BoxError> {
    // Warnings (a block-copy kernel the driver cannot load, say) show on stderr; RUST_LOG
    // widens it.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let opts = Opts::parse();
    if let Some(handle) = &opts.child {
        return child(&opts, handle);
    }
    if opts.agent_child {
        return agent_child(&opts);
    }
    let info = match rixl::gpudirect::probe() {
        Ok(i) => i,
        Err(e) => {
            println!("SKIPPED gpu_check: {e}");
            return Ok(());
        }
    };
    let (ordinal, len, iters) = (opts.gpu, opts.mib << 20, opts.iters);
    println!(
        "gpu_check: CUDA driver {}.{}, {} GPU(s); GPU {ordinal}: {}",
        info.driver_version / 1000,
        info.driver_version % 1000 / 10,
        info.gpus.len(),
        info.gpus
            .iter()
            .find(|g| g.ordinal == ordinal)
            .map_or("?".into(), |g| format!("{} at {}", g.name, g.pci_address))
    );
    // Every stage runs even if an earlier one failed; the exit status says whether all passed.
    let mut failed = Vec::new();
    let mut stage = |name: &'static str, r: Result<(), BoxError>| {
        if let Err(e) = r {
            println!("  FAILED {name}: {e}");
            failed.push(name);
        }
    };
    let gpu = Gpu::open(ordinal)?;
    let src = Arc::new(DeviceMemory::alloc(&gpu, len)?);
    let host: Vec<u8> = (0..len).map(pattern).collect();
    src.write(0, &host)?;
    let dst = Arc::new(DeviceMemory::alloc(&gpu, len)?);
    stage("device-to-device", d2d(&gpu, &src, &dst, len, iters));
    stage("CUDA IPC", ipc(&src, len, iters, ordinal));
    stage("host<->device", host_device(&gpu, &dst, &host, iters));
    stage("mixed copies", mixed_copies(&gpu, &src, &dst, &host));
    stage("crossover", crossover(&gpu, &src, &dst));
    let mut baseline = None;
    stage(
        "scattered copies",
        scattered_baseline(&gpu, &src, &dst, len).map(|s| baseline = Some(s)),
    );
    stage("agent", agent_stage(len, iters, ordinal, baseline));
    stage("GPUDirect RDMA", gpudirect(&gpu));
    stage("staged copy leg", staged_copy_leg(ordinal, len, iters));
    if !failed.is_empty() {
        return Err(format!("gpu_check: {} stage(s) failed: {failed:?}", failed.len()).into());
    }
    println!("gpu_check: all stages passed");
    Ok(())
}
