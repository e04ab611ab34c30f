//! Verbs-level transfer demo: an RC WRITE stream between two processes, with every byte verified.
//!
//! ```text
//! rc_write_demo server [--port 18515]                      # waits for one client
//! rc_write_demo client HOST [--port 18515] [--size 1048576] [--iters 200] [--depth 16]
//! ```
//! Device and GID index come from `RIXL_RDMA_DEVICE` / `RIXL_GID_INDEX` (defaults: first device,
//! GID 1). The client prints bytes moved and bandwidth; the server verifies the data checksum.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use rixl_verbs::{
    AccessFlags, CompletionQueue, ConnectOptions, Context, Endpoint, ProtectionDomain, QueuePair,
    QueuePairCapabilities, RegisteredBuffer, SendBatch, SendFlags, SendOp, Sge, WorkCompletion,
};

type BoxError = Box<dyn std::error::Error>;

fn arg(args: &[String], flag: &str, default: u64) -> Result<u64, BoxError> {
    match args.iter().position(|a| a == flag) {
        Some(i) => Ok(args
            .get(i + 1)
            .ok_or(format!("{flag} needs a value"))?
            .parse()?),
        None => Ok(default),
    }
}

fn frame_send(s: &mut TcpStream, b: &[u8]) -> Result<(), BoxError> {
    s.write_all(&(b.len() as u32).to_be_bytes())?;
    s.write_all(b)?;
    Ok(())
}

fn frame_recv(s: &mut TcpStream) -> Result<Vec<u8>, BoxError> {
    let mut l = [0u8; 4];
    s.read_exact(&mut l)?;
    let mut b = vec![0u8; u32::from_be_bytes(l) as usize];
    s.read_exact(&mut b)?;
    Ok(b)
}

fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

struct Setup {
    qp: QueuePair,
    cq: CompletionQueue,
    buf: RegisteredBuffer,
    opts: ConnectOptions,
    psn: u32,
}

fn setup(len: usize, depth: u32) -> Result<Setup, BoxError> {
    let ctx = Context::open(std::env::var("RIXL_RDMA_DEVICE").ok().as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let cq = CompletionQueue::new(&ctx, depth * 2 + 16, false)?;
    let mut caps = QueuePairCapabilities::default();
    caps.max_send_wr = depth * 2;
    let qp = QueuePair::new_rc(&pd, &cq, &cq, caps)?;
    let buf = RegisteredBuffer::new(&pd, len, AccessFlags::ALL_RDMA)?;
    let mut opts = ConnectOptions::default();
    opts.gid_index = std::env::var("RIXL_GID_INDEX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let psn = std::process::id() & 0xffffff;
    Ok(Setup {
        qp,
        cq,
        buf,
        opts,
        psn,
    })
}

fn exchange(s: &mut TcpStream, st: &Setup, extra: &[u8]) -> Result<(Endpoint, Vec<u8>), BoxError> {
    let mut out = st.qp.endpoint(&st.opts, st.psn)?.to_bytes().to_vec();
    out.extend_from_slice(extra);
    frame_send(s, &out)?;
    let got = frame_recv(s)?;
    let ep = Endpoint::from_bytes(&got[..Endpoint::WIRE_LEN])?;
    Ok((ep, got[Endpoint::WIRE_LEN..].to_vec()))
}

fn server(port: u16) -> Result<(), BoxError> {
    let listener = TcpListener::bind(("0.0.0.0", port))?;
    let (mut s, peer) = listener.accept()?;
    let want = frame_recv(&mut s)?;
    let size = u64::from_be_bytes(want[..8].try_into()?) as usize;
    let st = setup(size, 16)?;
    let mut info = st.buf.addr().to_be_bytes().to_vec();
    info.extend_from_slice(&st.buf.rkey().to_be_bytes());
    let (remote, _) = exchange(&mut s, &st, &info)?;
    st.qp.connect(&remote, st.psn, &st.opts)?;
    frame_send(&mut s, b"ready")?;
    let done = frame_recv(&mut s)?;
    let expect = u64::from_be_bytes(done[..8].try_into()?);
    let got = fnv1a(st.buf.as_slice());
    println!(
        "server: client {peer}, buffer {size} B, checksum {}",
        if got == expect { "OK" } else { "MISMATCH" }
    );
    frame_send(&mut s, &got.to_be_bytes())?;
    if got != expect {
        return Err("data mismatch".into());
    }
    Ok(())
}

fn client(host: &str, port: u16, size: usize, iters: u64, depth: u32) -> Result<(), BoxError> {
    let mut s = TcpStream::connect((host, port))?;
    s.set_nodelay(true)?;
    frame_send(&mut s, &(size as u64).to_be_bytes())?;
    let mut st = setup(size, depth)?;
    for (i, b) in st.buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(2_654_435_761) as u8 ^ (i >> 12) as u8;
    }
    let (remote, info) = exchange(&mut s, &st, &[])?;
    let raddr = u64::from_be_bytes(info[..8].try_into()?);
    let rkey = u32::from_be_bytes(info[8..12].try_into()?);
    st.qp.connect(&remote, st.psn, &st.opts)?;
    frame_recv(&mut s)?; // ready
    let mut batch = SendBatch::with_capacity(1, 1);
    let mut wcs = [WorkCompletion::default(); 16];
    let (mut posted, mut done, mut inflight) = (0u64, 0u64, 0u32);
    let t0 = Instant::now();
    while done < iters {
        while posted < iters && inflight < depth {
            batch.clear();
            batch.push(
                posted,
                SendOp::Write {
                    remote_addr: raddr,
                    rkey,
                },
                &[Sge {
                    addr: st.buf.addr(),
                    length: size as u32,
                    lkey: st.buf.lkey(),
                }],
                SendFlags::SIGNALED,
            );
            // SAFETY: the buffer outlives every completion, all of which are reaped below.
            unsafe { st.qp.post_send(&mut batch) }?;
            posted += 1;
            inflight += 1;
        }
        let n = st.cq.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            wc.result()?;
        }
        done += n as u64;
        inflight -= n as u32;
    }
    let secs = t0.elapsed().as_secs_f64();
    let bytes = size as u64 * iters;
    frame_send(&mut s, &fnv1a(st.buf.as_slice()).to_be_bytes())?;
    let verdict = frame_recv(&mut s)?;
    let ok = verdict == fnv1a(st.buf.as_slice()).to_be_bytes();
    println!(
        "rixl-verbs RDMA WRITE on {}: {iters} x {size} B = {bytes} bytes moved in {secs:.3} s, \
         {:.1} MiB/s ({:.3} Gb/s), depth {depth}, data verified: {}",
        st.qp.endpoint(&st.opts, 0)?.gid,
        bytes as f64 / secs / (1 << 20) as f64,
        bytes as f64 * 8.0 / secs / 1e9,
        if ok { "yes" } else { "NO" }
    );
    if !ok {
        return Err("peer saw different data".into());
    }
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let port = arg(&args, "--port", 18515)? as u16;
    match args.get(1).map(String::as_str) {
        Some("server") => server(port),
        Some("client") => {
            let host = args.get(2).ok_or("client needs HOST")?;
            client(
                host,
                port,
                arg(&args, "--size", 1 << 20)? as usize,
                arg(&args, "--iters", 200)?,
                arg(&args, "--depth", 16)? as u32,
            )
        }
        _ => Err(
            "usage: rc_write_demo server | client HOST [--size N] [--iters N] [--depth N]".into(),
        ),
    }
}
