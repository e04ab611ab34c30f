//! `rixl-perf`: perftest-compatible benchmarks that drive the rixl runtime (the same `Engine`
//! futures a serving engine awaits), so its numbers are the library's numbers.
//!
//! ```text
//! rixl-perf write_bw -d rxe0 -x 1 -a            # server
//! rixl-perf write_bw -d rxe0 -x 1 -a 127.0.0.1  # client: prints perftest's columns
//! rixl-perf sweep --help                        # nixlbench-style block x batch sweep
//! rixl-perf file --help                         # fio-style FILE tier benchmark
//! ```
#![forbid(unsafe_code)]

mod args;
mod cycles;
mod file;
mod oob;
mod probes;
mod stats;
mod sweep;

use std::cell::{Cell, RefCell};
use std::net::{TcpListener, TcpStream};
use std::rc::Rc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use args::{Args, Mode, Notify, Test};
use glommio::{LocalExecutorBuilder, Placement};
use oob::{Hello, Oob};
use rixl::runtime::{
    wait_flag, ConnId, Engine, EngineConfig, Flag, LocalDescList, Op, PreparedTransfer, Region,
    RemoteDesc, RemoteDescList, TransferOptions, DEFAULT_IO_MEMORY,
};
use stats::{BwRow, LatRow};

type Res<T> = Result<T, String>;

/// One size's result on one engine: (size, completion stamps, elapsed seconds).
type SizeResult = (u64, Vec<(f64, u64)>, f64);

/// How long one side of a ping-pong waits for the other's WRITE.
const PING_TIMEOUT: Duration = Duration::from_secs(10);

/// The flag value of ping-pong round `i`: never 0 (the landing byte starts zeroed) and never the
/// previous round's.
fn ping_value(i: u64) -> u8 {
    (i % 255) as u8 + 1
}

/// Registered bytes for messages up to `max_size`: a source area and, in the upper half, the
/// landing area the peer's ping-pong WRITEs go to.
/// The test's buffer: host memory, or GPU memory with `--use_cuda` (registered for GPUDirect
/// RDMA, through dma-buf only with `--use_cuda_dmabuf`).
async fn buffer(engine: &Engine, len: usize, a: &Args) -> Res<rixl::runtime::Region> {
    let Some(gpu) = a.use_cuda else {
        return engine.register(len).await.map_err(s);
    };
    let region = engine
        .register_gpu(gpu, len)
        .await
        .map_err(|e| format!("--use_cuda={gpu}: {e}"))?;
    let kind = region.gpu_registration().map(|g| g.kind());
    if a.use_cuda_dmabuf && kind != Some(rixl::gpudirect::RegistrationKind::DmaBuf) {
        return Err(format!(
            "--use_cuda_dmabuf: GPU {gpu} memory was registered as {kind:?}, not through dma-buf"
        ));
    }
    eprintln!("rixl-perf: buffer of {len} bytes on GPU {gpu}, registered {kind:?}");
    Ok(region)
}

fn region_len(max_size: u64) -> usize {
    2 * max_size.max(4096) as usize
}

/// The first `size` bytes of the peer's landing area (the upper half of its region).
fn landing(peer: &RemoteDesc, size: u64) -> RemoteDescList {
    RemoteDescList(vec![RemoteDesc {
        addr: peer.addr + peer.len / 2,
        len: size,
        rkey: peer.rkey,
    }])
}

/// Posts the `Xfer` `$x` on the engine `$e` and awaits it inside the caller's future (a method
/// would be one more future, moved when it starts, per transfer; perftest's loops post
/// directly). `Res<()>`.
macro_rules! run_xfer {
    ($e:expr, $x:expr) => {{
        let x: &Xfer = $x;
        let opts = TransferOptions::default();
        match &x.prepared {
            Some(p) => $e.post(p, opts).await,
            None => $e.transfer(x.conn, x.op, &x.local, &x.remote, opts).await,
        }
        .map(|_| ())
        .map_err(s)
    }};
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Receives one message on `conn`: copied out (`Engine::recv`, `--recv-copy`) or read in place
/// (`Engine::recv_with`, as perftest's receiver reads its buffers).
async fn recv_one(
    e: &Engine,
    conn: ConnId,
    copy: bool,
) -> Result<(), rixl::runtime::TransferError> {
    if copy {
        e.recv(conn).await.map(drop)
    } else {
        e.recv_with(conn, |_| ()).await
    }
}

/// Engine configuration for a test with messages up to `max_size`.
fn engine_config(a: &Args, test: Test, max_size: u64, tx_depth: u32, conns: u32) -> EngineConfig {
    let mut cfg = EngineConfig::from_env();
    if a.device.is_some() {
        cfg.device = a.device.clone();
    }
    if let Some(g) = a.gid_index {
        cfg.connect.gid_index = g;
    }
    cfg.connect.port = a.ib_port;
    cfg.connect.timeout = a.qp_timeout;
    cfg.poll_mode = a.poll_mode;
    cfg.coalesce = a.coalesce;
    if let Some(n) = a.spin_polls {
        cfg.spin_polls = n;
    }
    if let Some(n) = a.rx_depth {
        cfg.recv_buffers = n;
    }
    cfg.max_connections = conns.max(1);
    cfg.send_queue_depth = tx_depth.clamp(64, 1024);
    cfg.post_batch = a.post_batch;
    cfg.transfer_timeout = Duration::from_secs(60);
    if test.is_send() {
        cfg.max_message = u32::try_from(max_size.max(4096)).unwrap_or(u32::MAX);
    }
    cfg
}

fn region_line(r: &Region) -> String {
    format!("REGION {} {} {}", r.addr(), r.rkey(), r.len())
}

fn parse_region(f: &[String]) -> Res<RemoteDesc> {
    let n = |i: usize| -> Res<u64> {
        f.get(i)
            .ok_or("short REGION line")?
            .parse()
            .map_err(|_| "bad REGION line".to_string())
    };
    Ok(RemoteDesc {
        addr: n(0)?,
        rkey: n(1)? as u32,
        len: n(2)?,
    })
}

/// The CPU of engine `idx`: `idx` allowed CPUs after `--cpu` (by default the first this process
/// may run on; see [`rixl::runtime::cpu_after`]).
fn cpu_from(first: Option<usize>, idx: usize) -> usize {
    rixl::runtime::cpu_after(first.unwrap_or_else(|| rixl::runtime::cpu_at(0)), idx)
}

/// Runs `f` on a glommio executor pinned to `cpu`.
fn on_core<T: Send + 'static>(
    cpu: usize,
    f: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>> + Send + 'static,
) -> Res<T> {
    on_core_with(cpu, DEFAULT_IO_MEMORY, f)
}

/// [`on_core`] with `io_memory` bytes of glommio I/O memory.
fn on_core_with<T: Send + 'static>(
    cpu: usize,
    io_memory: usize,
    f: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>> + Send + 'static,
) -> Res<T> {
    rixl::runtime::preflight::check(1, io_memory).map_err(s)?;
    LocalExecutorBuilder::new(Placement::Fixed(cpu))
        .io_memory(io_memory)
        .spawn(f)
        .map_err(s)?
        .join()
        .map_err(s)
}

// ----------------------------------------------------------------------------------------------
// Server

async fn server(a: Args) -> Res<()> {
    let listener =
        TcpListener::bind(("0.0.0.0", a.port)).map_err(|e| format!("listen on {}: {e}", a.port))?;
    eprintln!(
        "rixl-perf {}: waiting for a client on port {}",
        a.test.name(),
        a.port
    );
    let (sock, peer) = listener.accept().map_err(s)?;
    let mut first = Oob::new(sock).map_err(s)?;
    let hello = Hello::parse(&first.recv()?)?;
    if hello.test != a.test.name() {
        return Err(format!(
            "client runs {} but this server runs {}",
            hello.test,
            a.test.name()
        ));
    }
    let mut streams = vec![first];
    for _ in 1..hello.engines {
        let (sock, _) = listener.accept().map_err(s)?;
        let mut o = Oob::new(sock).map_err(s)?;
        Hello::parse(&o.recv()?)?;
        streams.push(o);
    }
    let conns_total = hello.qps * hello.engines;
    let cfg = engine_config(&a, a.test, hello.max_size, hello.tx_depth, conns_total);
    let engine = Engine::open(cfg).await.map_err(s)?;
    let region = buffer(&engine, region_len(hello.max_size), &a).await?;
    let mut all: Vec<(ConnId, RemoteDesc)> = Vec::new();
    for o in &mut streams {
        let theirs = connect_side(&engine, &region, o, hello.qps, true).await?;
        all.extend(theirs);
    }
    eprintln!("rixl-perf: client {peer} connected ({conns_total} queue pairs)");
    let (conn0, remote0) = all[0];
    loop {
        let line = streams[0].recv()?;
        let f: Vec<&str> = line.split(' ').collect();
        match f.as_slice() {
            ["DONE"] => break,
            ["PING", size, n, notify] => {
                let (size, n): (u64, u64) = (size.parse().map_err(s)?, n.parse().map_err(s)?);
                let local = one_desc(&region, size);
                // The client's landing area is the upper half of its region (ours likewise).
                let remote = landing(&remote0, size);
                let pong = Xfer::new(
                    &engine,
                    a.prepared,
                    conn0,
                    Op::Write,
                    local.clone(),
                    remote.clone(),
                )?;
                let flag_at = region.len() / 2 + size - 1;
                region.write_at(flag_at, &[0]).map_err(s)?;
                let reply = vec![0x5a; size as usize];
                streams[0].send("GO")?;
                for i in 0..n {
                    if *notify == "flag" {
                        let v = ping_value(i);
                        wait_flag(&region, flag_at, Flag::Byte(v), PING_TIMEOUT)
                            .await
                            .map_err(s)?;
                        region.write_at(size - 1, &[v]).map_err(s)?;
                        run_xfer!(engine, &pong)?;
                        continue;
                    }
                    recv_one(&engine, conn0, a.recv_copy).await.map_err(s)?;
                    if a.test.is_send() && a.copy {
                        engine.send(conn0, &reply, None).await.map_err(s)?;
                    } else if a.test.is_send() {
                        engine
                            .send_from(conn0, &region, 0, size, None)
                            .await
                            .map_err(s)?;
                    } else {
                        let mut o = TransferOptions::default();
                        o.notify_imm = Some(i as u32);
                        engine
                            .transfer(conn0, Op::Write, &local, &remote, o)
                            .await
                            .map_err(s)?;
                    }
                }
            }
            ["SENDBW", n] => {
                let n: u64 = n.parse().map_err(s)?;
                let conns: Vec<ConnId> = all.iter().map(|c| c.0).collect();
                let got = Rc::new(Cell::new(0u64));
                let tasks: Vec<_> = conns
                    .iter()
                    .enumerate()
                    .map(|(k, &c)| {
                        let (e, got) = (engine.clone(), Rc::clone(&got));
                        let copy = a.recv_copy;
                        let share =
                            n / conns.len() as u64 + u64::from((k as u64) < n % conns.len() as u64);
                        glommio::spawn_local(async move {
                            for _ in 0..share {
                                recv_one(&e, c, copy).await?;
                                got.set(got.get() + 1);
                            }
                            Ok::<_, rixl::runtime::TransferError>(())
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.map_err(s)?;
                }
                streams[0].send(&format!("SENDBW-DONE {}", got.get()))?;
            }
            other => return Err(format!("unknown command {other:?}")),
        }
    }
    for o in streams.iter_mut().skip(1) {
        o.expect("DONE")?;
    }
    engine.shutdown().await;
    Ok(())
}

/// Exchanges regions and endpoints for `qps` connections over `o`, and connects them. The server
/// speaks first. Returns each connection with the peer's region.
async fn connect_side(
    engine: &Engine,
    region: &Region,
    o: &mut Oob,
    qps: u32,
    server: bool,
) -> Res<Vec<(ConnId, RemoteDesc)>> {
    let mut mine = Vec::new();
    for _ in 0..qps {
        mine.push(engine.prepare_connection().await.map_err(s)?);
    }
    let send_all = |o: &mut Oob, mine: &[(ConnId, rixl::verbs::Endpoint)]| -> Res<()> {
        o.send(&region_line(region))?;
        for (_, ep) in mine {
            o.send_endpoint(ep)?;
        }
        Ok(())
    };
    let recv_all = |o: &mut Oob| -> Res<(RemoteDesc, Vec<rixl::verbs::Endpoint>)> {
        let r = parse_region(&o.expect("REGION")?)?;
        let eps = (0..qps)
            .map(|_| o.recv_endpoint())
            .collect::<Res<Vec<_>>>()?;
        Ok((r, eps))
    };
    let (remote, eps) = if server {
        send_all(o, &mine)?;
        recv_all(o)?
    } else {
        let r = recv_all(o)?;
        send_all(o, &mine)?;
        r
    };
    let mut out = Vec::new();
    for ((conn, _), ep) in mine.into_iter().zip(eps) {
        engine.complete_connection(conn, ep).await.map_err(s)?;
        out.push((conn, remote));
    }
    if server {
        o.send("READY")?;
    } else {
        o.expect("READY")?;
    }
    Ok(out)
}

fn one_desc(region: &Region, size: u64) -> LocalDescList {
    let mut l = LocalDescList::new();
    l.push(region, 0, size);
    l
}

// ----------------------------------------------------------------------------------------------
// Client

struct ClientSide {
    engine: Engine,
    region: Region,
    conns: Vec<(ConnId, RemoteDesc)>,
    oob: Oob,
}

async fn client_setup(a: &Args, host: &str, max_size: u64) -> Res<ClientSide> {
    let sock = connect_retry(host, a.port)?;
    let mut oob = Oob::new(sock).map_err(s)?;
    oob.send(
        &Hello {
            test: a.test.name().into(),
            qps: a.qps,
            engines: a.engines,
            max_size,
            tx_depth: a.tx_depth,
        }
        .line(),
    )?;
    let cfg = engine_config(a, a.test, max_size, a.tx_depth, a.qps);
    let engine = Engine::open(cfg).await.map_err(s)?;
    let region = buffer(&engine, region_len(max_size), a).await?;
    let conns = connect_side(&engine, &region, &mut oob, a.qps, false).await?;
    Ok(ClientSide {
        engine,
        region,
        conns,
        oob,
    })
}

fn connect_retry(host: &str, port: u16) -> Res<TcpStream> {
    let t0 = Instant::now();
    loop {
        match TcpStream::connect((host, port)) {
            Ok(s) => return Ok(s),
            Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(format!("connect to {host}:{port}: {e}")),
        }
    }
}

/// A READ or WRITE of fixed descriptors, prepared once with `--prepared` (then each run only
/// posts it), else submitted whole each time as `Engine::transfer`.
struct Xfer {
    conn: ConnId,
    op: Op,
    local: LocalDescList,
    remote: RemoteDescList,
    prepared: Option<PreparedTransfer>,
}

impl Xfer {
    fn new(
        e: &Engine,
        prepare: bool,
        conn: ConnId,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
    ) -> Res<Self> {
        let prepared = if prepare {
            Some(e.prepare(conn, op, &local, &remote).map_err(s)?)
        } else {
            None
        };
        Ok(Xfer {
            conn,
            op,
            local,
            remote,
            prepared,
        })
    }
}

/// One engine's share of a bandwidth run: completion stamps (seconds since `t0`, messages),
/// taken every 16 transfers per task (and at each task's end) to keep clock reads off the path.
async fn bw_run(
    c: &ClientSide,
    a: &Args,
    size: u64,
    iters: u64,
    t0: Instant,
) -> Res<Vec<(f64, u64)>> {
    // A SEND is one message per call (post lists apply to RDMA READ/WRITE).
    let post_list = if a.test == Test::SendBw {
        1
    } else {
        u64::from(a.post_list)
    };
    let transfers = iters.div_ceil(post_list);
    let concurrency = (u64::from(a.tx_depth) / post_list).max(1);
    let next = Rc::new(Cell::new(0u64));
    let times = Rc::new(RefCell::new(Vec::with_capacity(iters as usize)));
    let deadline = a.duration.map(|d| t0 + d);
    // Stamps are cycle-counter readings (see `cycles`), turned into seconds since `t0` at the end.
    let sw = cycles::Stopwatch::start();
    let offset = t0.elapsed().as_secs_f64();
    let op = match a.test {
        Test::ReadBw => Op::Read,
        _ => Op::Write,
    };
    // Stamp often enough that every tenth of the run has stamps (peak bandwidth needs them),
    // at most every 16 transfers per task.
    let tasks_n = concurrency.min(transfers.max(1));
    let stamp_every = (transfers / (10 * tasks_n)).clamp(1, 16) * post_list;
    let mut tasks = Vec::new();
    for _ in 0..tasks_n {
        let (e, next, times) = (c.engine.clone(), Rc::clone(&next), Rc::clone(&times));
        let conns = c.conns.clone();
        let region = c.region.clone();
        let send = a.test == Test::SendBw;
        let prepare = a.prepared;
        let payload = if send && a.copy {
            vec![0xa5u8; size as usize]
        } else {
            Vec::new()
        };
        tasks.push(glommio::spawn_local(async move {
            let mut local = LocalDescList::with_capacity(post_list as usize);
            for _ in 0..post_list {
                local.push(&region, 0, size);
            }
            let xfers = if send {
                Vec::new()
            } else {
                conns
                    .iter()
                    .map(|&(conn, r)| {
                        let remote =
                            RemoteDescList(vec![RemoteDesc { len: size, ..r }; post_list as usize]);
                        Xfer::new(&e, prepare, conn, op, local.clone(), remote)
                    })
                    .collect::<Res<Vec<_>>>()?
            };
            let mut unstamped = 0u64;
            loop {
                let i = next.get();
                let more = match deadline {
                    Some(d) => !(i.is_multiple_of(64) && Instant::now() >= d),
                    None => i < transfers,
                };
                if !more {
                    if unstamped > 0 {
                        times.borrow_mut().push((cycles::ticks(), unstamped));
                    }
                    return Ok::<(), String>(());
                }
                next.set(i + 1);
                let k = (i % conns.len() as u64) as usize;
                if send && payload.is_empty() {
                    e.send_from(conns[k].0, &region, 0, size, None)
                        .await
                        .map_err(s)?;
                } else if send {
                    e.send(conns[k].0, &payload, None).await.map_err(s)?;
                } else {
                    run_xfer!(e, &xfers[k])?;
                }
                unstamped += post_list;
                if unstamped >= stamp_every {
                    times.borrow_mut().push((cycles::ticks(), unstamped));
                    unstamped = 0;
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let stamps = Rc::try_unwrap(times)
        .map_err(|_| "tasks still hold results")?
        .into_inner();
    let rate = sw.rate();
    let mut v: Vec<(f64, u64)> = stamps
        .into_iter()
        .map(|(t, n)| (offset + sw.since_start(t) as f64 / rate, n))
        .collect();
    v.sort_by(|x, y| x.0.total_cmp(&y.0));
    Ok(v)
}

fn client_bw(a: &Args, host: &str) -> Res<Vec<BwRow>> {
    let max_size = *a.sizes.iter().max().unwrap_or(&65536);
    if a.test == Test::SendBw && a.duration.is_some() {
        return Err("send_bw: -D is not supported (the receiver counts messages); use -n".into());
    }
    if a.test == Test::SendBw && max_size > (1 << 20) {
        return Err("send_bw: rixl messages are at most 1 MiB (they are copied into registered receive buffers)".into());
    }
    let engines = if a.test == Test::SendBw {
        1
    } else {
        a.engines as usize
    };
    let barrier = Arc::new(Barrier::new(engines));
    let handles: Vec<_> = (0..engines)
        .map(|idx| {
            let (a, host, barrier) = (a.clone(), host.to_string(), Arc::clone(&barrier));
            std::thread::spawn(move || -> Res<Vec<SizeResult>> {
                on_core(cpu_from(a.cpu, idx), move || {
                    Box::pin(async move {
                        let mut c = client_setup(&a, &host, max_size).await?;
                        let mut out = Vec::new();
                        for &size in &a.sizes {
                            let iters = a.iters / engines as u64;
                            // Warm-up: a few transfers, not measured. SEND tests first tell the
                            // server how many messages to receive.
                            let warm = (iters / 20).max(5);
                            if a.test == Test::SendBw {
                                c.oob.send(&format!("SENDBW {warm}"))?;
                            }
                            bw_run(
                                &c,
                                &Args {
                                    duration: None,
                                    post_list: 1,
                                    ..a.clone()
                                },
                                size,
                                warm,
                                Instant::now(),
                            )
                            .await?;
                            if a.test == Test::SendBw {
                                c.oob.expect("SENDBW-DONE")?;
                                c.oob.send(&format!("SENDBW {iters}"))?;
                            }
                            barrier.wait();
                            let t0 = Instant::now();
                            let times = bw_run(&c, &a, size, iters, t0).await?;
                            let elapsed = times.last().map_or(0.0, |t| t.0);
                            if a.test == Test::SendBw {
                                c.oob.expect("SENDBW-DONE")?;
                            }
                            out.push((size, times, elapsed));
                        }
                        c.oob.send("DONE")?;
                        let counters = c.engine.counters();
                        c.engine.shutdown().await;
                        tracing::debug!(?counters, "client engine counters");
                        Ok(out)
                    })
                })?
            })
        })
        .collect();
    let mut per_engine = Vec::new();
    for h in handles {
        per_engine.push(h.join().map_err(|_| "engine thread panicked")??);
    }
    let mut rows = Vec::new();
    for (i, &size) in a.sizes.iter().enumerate() {
        let mut all: Vec<(f64, u64)> = per_engine
            .iter()
            .flat_map(|e| e[i].1.iter().copied())
            .collect();
        all.sort_by(|x, y| x.0.total_cmp(&y.0));
        let elapsed = per_engine.iter().map(|e| e[i].2).fold(0.0, f64::max);
        rows.push(stats::bw_from(size, &all, elapsed));
    }
    Ok(rows)
}

fn client_lat(a: &Args, host: &str) -> Res<(Vec<LatRow>, Vec<LatRow>)> {
    let max_size = *a.sizes.iter().max().unwrap_or(&2);
    if a.test == Test::SendLat && max_size > (1 << 20) {
        return Err("send_lat: rixl messages are at most 1 MiB".into());
    }
    let (a, host) = (a.clone(), host.to_string());
    on_core(cpu_from(a.cpu, 0), move || {
        Box::pin(async move {
            let mut c = client_setup(&a, &host, max_size).await?;
            let (conn, remote0) = c.conns[0];
            let mut rows = Vec::new();
            let mut awaits = Vec::new();
            for &size in &a.sizes {
                let local = one_desc(&c.region, size);
                let remote = RemoteDescList(vec![RemoteDesc {
                    len: size,
                    ..remote0
                }]);
                let warm = (a.iters / 10).max(5);
                let total = a.iters + warm;
                let mut samples: Vec<u64> = Vec::with_capacity(a.iters as usize);
                let sw = cycles::Stopwatch::start();
                match a.test {
                    Test::ReadLat => {
                        let read = Xfer::new(
                            &c.engine,
                            a.prepared,
                            conn,
                            Op::Read,
                            local.clone(),
                            remote.clone(),
                        )?;
                        for i in 0..total {
                            let t = cycles::ticks();
                            run_xfer!(c.engine, &read)?;
                            if i >= warm {
                                samples.push(cycles::ticks().wrapping_sub(t));
                            }
                        }
                        rows.push(stats::lat_from(size, &sw.durations(&samples), 1.0));
                    }
                    Test::WriteLat | Test::SendLat => {
                        let notify = if a.test == Test::WriteLat {
                            a.notify
                        } else {
                            Notify::Imm
                        };
                        // Replies land in the upper half of our region (ours go to theirs).
                        let flag_at = c.region.len() / 2 + size - 1;
                        c.region.write_at(flag_at, &[0]).map_err(s)?;
                        let land = landing(&remote0, size);
                        let ping = Xfer::new(
                            &c.engine,
                            a.prepared,
                            conn,
                            Op::Write,
                            local.clone(),
                            land.clone(),
                        )?;
                        c.oob
                            .send(&format!("PING {size} {total} {}", notify.name()))?;
                        c.oob.expect("GO")?;
                        let payload = vec![0xa5u8; size as usize];
                        let mut breakdown = probes::Breakdown::default();
                        // send_lat: the SEND's `.await` and the wait for the reply after it.
                        let (mut sent, mut replied) = (Vec::new(), Vec::new());
                        for i in 0..total {
                            let v = ping_value(i);
                            if notify == Notify::Flag {
                                c.region.write_at(size - 1, &[v]).map_err(s)?;
                            }
                            let t = cycles::ticks();
                            if a.test == Test::SendLat && a.copy {
                                c.engine.send(conn, &payload, None).await.map_err(s)?;
                            } else if a.test == Test::SendLat {
                                c.engine
                                    .send_from(conn, &c.region, 0, size, None)
                                    .await
                                    .map_err(s)?;
                            } else if notify == Notify::Flag {
                                run_xfer!(c.engine, &ping)?;
                            } else {
                                let mut o = TransferOptions::default();
                                o.notify_imm = Some(i as u32);
                                c.engine
                                    .transfer(conn, Op::Write, &local, &land, o)
                                    .await
                                    .map_err(s)?;
                            }
                            let done = cycles::ticks();
                            if notify == Notify::Flag {
                                wait_flag(&c.region, flag_at, Flag::Byte(v), PING_TIMEOUT)
                                    .await
                                    .map_err(s)?;
                                if i >= warm {
                                    breakdown.record(t, done, cycles::ticks());
                                }
                            } else {
                                recv_one(&c.engine, conn, a.recv_copy).await.map_err(s)?;
                                if i >= warm {
                                    sent.push(done.wrapping_sub(t));
                                    replied.push(cycles::ticks().wrapping_sub(done));
                                }
                            }
                            if i >= warm {
                                samples.push(cycles::ticks().wrapping_sub(t));
                            }
                        }
                        breakdown.print(&sw);
                        if !sent.is_empty() {
                            eprintln!(
                                "rixl-perf: {} {size} B round trip: the send's .await median {:.2} us, then the reply's {:.2} us",
                                a.test.name(),
                                sw.median_us(&sent),
                                sw.median_us(&replied)
                            );
                        }
                        // Ping-pong round trips, reported one-way like perftest.
                        rows.push(stats::lat_from(size, &sw.durations(&samples), 2.0));
                        if a.test == Test::WriteLat {
                            // One `.await` of a WRITE: completes when the ACK is back (one round trip).
                            let mut one = Vec::with_capacity(a.iters as usize);
                            let write = Xfer::new(
                                &c.engine,
                                a.prepared,
                                conn,
                                Op::Write,
                                local.clone(),
                                remote.clone(),
                            )?;
                            for i in 0..total {
                                let t = cycles::ticks();
                                run_xfer!(c.engine, &write)?;
                                if i >= warm {
                                    one.push(cycles::ticks().wrapping_sub(t));
                                }
                            }
                            awaits.push(stats::lat_from(size, &sw.durations(&one), 1.0));
                        }
                    }
                    _ => unreachable!("latency tests only"),
                }
            }
            c.oob.send("DONE")?;
            let counters = c.engine.counters();
            c.engine.shutdown().await;
            tracing::debug!(?counters, "client engine counters");
            Ok((rows, awaits))
        })
    })?
}

fn banner(a: &Args) {
    let line = "-".repeat(87);
    println!("{line}");
    println!(
        "                    RDMA_{} {} Test (rixl runtime)",
        match a.test {
            Test::WriteBw | Test::WriteLat => "Write",
            Test::ReadBw | Test::ReadLat => "Read",
            Test::SendBw | Test::SendLat => "Send",
        },
        if a.test.is_bw() { "BW" } else { "Latency" }
    );
    println!(
        " Device: {} | Number of qps: {} | Transport type: IB (RC) | Engines: {} | Poll mode: {:?}",
        a.device.as_deref().unwrap_or("(first)"),
        a.qps,
        a.engines,
        a.poll_mode
    );
    println!(
        " TX depth: {} | Post list: {} | GID index: {}{}",
        a.tx_depth,
        a.post_list,
        a.gid_index.map_or("default".into(), |g| g.to_string()),
        if a.test == Test::WriteLat {
            format!(" | Arrival: {}", a.notify.name())
        } else {
            String::new()
        }
    );
    println!(
        " Prepared transfers: {} | Coalescing: {}",
        if a.prepared { "on" } else { "off" },
        if a.coalesce { "on" } else { "off" }
    );
    println!("{line}");
}

fn run(mode: Mode) -> Res<()> {
    let a = match mode {
        Mode::Perf(a) => a,
        Mode::Sweep(w) => return sweep::main(w),
        Mode::File(f) => return file::main(f),
    };
    let Some(host) = a.server.clone() else {
        // The server sits on the last CPU so a client on the same host (first CPU) does not
        // compete with it for a core.
        let cpu = a
            .cpu
            .unwrap_or_else(|| rixl::runtime::available_cpus().last().copied().unwrap_or(0));
        let a2 = a.clone();
        return on_core(cpu, move || Box::pin(server(a2)))?;
    };
    banner(&a);
    if a.test.is_bw() {
        let rows = client_bw(&a, &host)?;
        println!("{}", stats::bw_header(a.report_gbits));
        for r in &rows {
            println!("{}", stats::bw_line(r, a.report_gbits));
        }
        println!("{}", "-".repeat(87));
        if let Some(f) = &a.out_json {
            std::fs::write(f, stats::bw_json(&rows, a.report_gbits)).map_err(s)?;
        }
    } else {
        let (rows, awaits) = client_lat(&a, &host)?;
        println!("{}", stats::lat_header());
        for r in &rows {
            println!("{}", stats::lat_line(r));
        }
        println!("{}", "-".repeat(87));
        for r in &awaits {
            println!(
                "# rixl: one .await of a {} B RDMA WRITE (completes on the ACK: one round trip): t_typical {:.2} usec, t_avg {:.2} usec, 99% {:.2} usec",
                r.bytes, r.typical, r.avg, r.p99
            );
        }
        if let Some(f) = &a.out_json {
            std::fs::write(f, stats::lat_json(&rows)).map_err(s)?;
        }
    }
    Ok(())
}

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let mode = args::parse(std::env::args_os()).unwrap_or_else(|e| args::exit(&e));
    if let Err(e) = run(mode) {
        eprintln!("rixl-perf: {e}");
        std::process::exit(1);
    }
}
