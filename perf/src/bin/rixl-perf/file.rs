//! fio-style benchmark of the FILE tier: `bs`-sized transfers between host memory and a file,
//! sequential or random, with `iodepth` of them in flight, through the same `FileStore` futures
//! the agent uses, on one pinned glommio core. Prints fio-like lines (and JSON with `--out_json`).

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use rixl::runtime::{
    FileConfig, FileDesc, FileMode, FileSpec, FileStore, LocalDescList, Op, Region,
};

use super::stats::pct;
use super::{on_core_with, s, Res};

const USAGE: &str = "\
usage: rixl-perf file --filename <path> [options]   (fio's names and meanings)
    --rw read|write|randread|randwrite   (default read)
    --bs <B>               block size per transfer, k/m/g suffixes are 1024-based (default 128k)
    --iodepth <n>          transfers in flight (default 32)
    --size <B>             file size; the whole file is covered once (default 1g)
    --batch <n>            blocks per transfer (descriptors); iodepth counts blocks (default 1)
    --cpu <n>              core to run on (default 0)
    --io_memory <B>        glommio I/O memory (default 2 x iodepth x bs, at most 256m)
    --verify               after a write, read the file back through std::fs and compare
    --out_json <path>      write the result as JSON";

#[derive(Debug, Clone)]
struct FileArgs {
    path: PathBuf,
    op: Op,
    random: bool,
    bs: u64,
    iodepth: usize,
    size: u64,
    batch: usize,
    cpu: usize,
    io_memory: Option<usize>,
    verify: bool,
    out_json: Option<String>,
}

/// Parses fio-style sizes: `131072`, `128k`, `1m`, `1g` (1024-based, like fio's default).
pub fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim().to_ascii_lowercase();
    let (num, mult) = match v.strip_suffix(['k', 'm', 'g']) {
        Some(n) => {
            let m = match v.chars().last() {
                Some('k') => 1u64 << 10,
                Some('m') => 1 << 20,
                _ => 1 << 30,
            };
            (n, m)
        }
        None => (v.as_str(), 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mult)
}

fn parse(argv: &[String]) -> Res<FileArgs> {
    let mut a = FileArgs {
        path: PathBuf::new(),
        op: Op::Read,
        random: false,
        bs: 128 << 10,
        iodepth: 32,
        size: 1 << 30,
        batch: 1,
        cpu: 0,
        io_memory: None,
        verify: false,
        out_json: None,
    };
    let mut it = argv.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f, Some(v.to_string())),
            None => (arg.as_str(), None),
        };
        let mut v = || -> Res<String> {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or(format!("{flag} needs a value"))
        };
        let size = |v: String| parse_size(&v).ok_or(format!("{flag}: not a size: {v}"));
        match flag {
            "--filename" => a.path = PathBuf::from(v()?),
            "--rw" => {
                let rw = v()?;
                (a.op, a.random) = match rw.as_str() {
                    "read" => (Op::Read, false),
                    "write" => (Op::Write, false),
                    "randread" => (Op::Read, true),
                    "randwrite" => (Op::Write, true),
                    o => return Err(format!("--rw read|write|randread|randwrite, not {o}")),
                }
            }
            "--bs" => a.bs = size(v()?)?,
            "--size" => a.size = size(v()?)?,
            "--iodepth" => a.iodepth = size(v()?)? as usize,
            "--batch" => a.batch = size(v()?)? as usize,
            "--cpu" => a.cpu = size(v()?)? as usize,
            "--io_memory" => a.io_memory = Some(size(v()?)? as usize),
            "--verify" => a.verify = true,
            "--out_json" => a.out_json = Some(v()?),
            "-h" | "--help" => return Err(USAGE.into()),
            f => return Err(format!("unknown option {f}\n{USAGE}")),
        }
    }
    if a.path.as_os_str().is_empty() {
        return Err(format!("--filename is required\n{USAGE}"));
    }
    if a.bs == 0 || !a.bs.is_multiple_of(4096) {
        return Err("--bs must be a positive multiple of 4096 (O_DIRECT)".into());
    }
    if a.size < a.bs || a.iodepth == 0 || a.batch == 0 {
        return Err(format!(
            "inconsistent --size/--bs/--iodepth/--batch\n{USAGE}"
        ));
    }
    Ok(a)
}

/// Blocks of host memory the run cycles through: `iodepth` of them (fio's buffer footprint).
fn mem_blocks(a: &FileArgs) -> u64 {
    (a.iodepth as u64).clamp(1, a.size / a.bs)
}

/// The byte the benchmark writes at file position `i` (so `--verify` can check it).
fn pattern(i: u64) -> u8 {
    ((i / 4096).wrapping_mul(131) ^ (i % 4096)) as u8
}

struct Run {
    blocks: Vec<u64>,
    next: Cell<usize>,
    lat: RefCell<Vec<Duration>>,
    error: RefCell<Option<String>>,
}

/// Result of one run.
pub struct FileResult {
    bytes: u64,
    secs: f64,
    lat_us: Vec<f64>,
}

async fn run(a: FileArgs) -> Res<FileResult> {
    let blocks_n = a.size / a.bs;
    let store = FileStore::new(FileConfig {
        queue_depth: a.batch.min(a.iodepth),
        max_io: a.bs,
    });
    let exists = std::fs::metadata(&a.path).map(|m| m.len()).unwrap_or(0);
    let mode = if exists >= a.size {
        FileMode::Open
    } else {
        FileMode::Create
    };
    let f = store
        .open(&FileSpec::new(&a.path, blocks_n * a.bs, mode))
        .await
        .map_err(s)?;
    // Source/target memory: iodepth blocks reused round-robin, like fio's buffers.
    let mem_blocks = mem_blocks(&a);
    let region = Region::unregistered((mem_blocks * a.bs) as usize).map_err(s)?;
    let buf: Vec<u8> = (0..region.len()).map(pattern).collect();
    region.write_at(0, &buf).map_err(s)?;
    if mode == FileMode::Create && a.op == Op::Read {
        // Lay the file out first (fio does the same for a missing file).
        lay_out(&store, f.id, &region, blocks_n, mem_blocks, a.bs).await?;
    }
    let mut blocks: Vec<u64> = (0..blocks_n).collect();
    if a.random {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for i in (1..blocks.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            blocks.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    let state = Rc::new(Run {
        blocks,
        next: Cell::new(0),
        lat: RefCell::new(Vec::with_capacity(blocks_n as usize)),
        error: RefCell::new(None),
    });
    let store = Rc::new(store);
    let in_flight = (a.iodepth / a.batch).max(1);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..in_flight {
        let (st, store, region) = (Rc::clone(&state), Rc::clone(&store), region.clone());
        let (bs, batch, op, id) = (a.bs, a.batch, a.op, f.id);
        tasks.push(glommio::spawn_local(async move {
            loop {
                let i = st.next.get();
                if i >= st.blocks.len() || st.error.borrow().is_some() {
                    break;
                }
                let end = (i + batch).min(st.blocks.len());
                st.next.set(end);
                let mut local = LocalDescList::with_capacity(end - i);
                let mut descs = Vec::with_capacity(end - i);
                for &b in &st.blocks[i..end] {
                    local.push(&region, (b % mem_blocks) * bs, bs);
                    descs.push(FileDesc::new(b * bs, bs));
                }
                let t = Instant::now();
                match store
                    .transfer(id, op, local, &descs, Duration::from_secs(60))
                    .await
                {
                    Ok(_) => st.lat.borrow_mut().push(t.elapsed()),
                    Err(e) => {
                        st.error.borrow_mut().get_or_insert(e.to_string());
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await;
    }
    let secs = t0.elapsed().as_secs_f64();
    if let Some(e) = state.error.borrow_mut().take() {
        return Err(e);
    }
    store.close_all().await;
    let lat_us = state
        .lat
        .borrow()
        .iter()
        .map(|d| d.as_secs_f64() * 1e6)
        .collect();
    Ok(FileResult {
        bytes: blocks_n * a.bs,
        secs,
        lat_us,
    })
}

async fn lay_out(
    store: &FileStore,
    id: rixl::runtime::FileId,
    region: &Region,
    blocks_n: u64,
    mem_blocks: u64,
    bs: u64,
) -> Res<()> {
    let mut b = 0;
    while b < blocks_n {
        let n = (blocks_n - b).min(mem_blocks);
        let mut local = LocalDescList::new();
        local.push(region, 0, n * bs);
        store
            .transfer(
                id,
                Op::Write,
                local,
                &[FileDesc::new(b * bs, n * bs)],
                Duration::from_secs(600),
            )
            .await
            .map_err(s)?;
        b += n;
    }
    Ok(())
}

fn verify(a: &FileArgs) -> Res<()> {
    use std::io::Read;
    let mem_blocks = mem_blocks(a);
    let mut f = std::fs::File::open(&a.path).map_err(s)?;
    let mut buf = vec![0u8; a.bs as usize];
    for b in 0..a.size / a.bs {
        f.read_exact(&mut buf).map_err(s)?;
        let src = (b % mem_blocks) * a.bs;
        if let Some(i) = (0..a.bs).find(|&i| buf[i as usize] != pattern(src + i)) {
            return Err(format!("verify: byte {} of block {b} differs", i));
        }
    }
    Ok(())
}

pub fn main(argv: &[String]) -> Res<()> {
    let a = parse(argv)?;
    let io_memory = a
        .io_memory
        .unwrap_or_else(|| ((2 * a.iodepth as u64 * a.bs).min(256 << 20)) as usize);
    let a2 = a.clone();
    let mut r = on_core_with(a.cpu, io_memory, move || Box::pin(run(a2)))??;
    if a.verify && a.op == Op::Write {
        verify(&a)?;
        eprintln!("rixl-perf file: verified {} bytes", r.bytes);
    }
    let rw = match (a.op, a.random) {
        (Op::Read, false) => "read",
        (Op::Write, false) => "write",
        (Op::Read, true) => "randread",
        (Op::Write, true) => "randwrite",
    };
    let mib_s = r.bytes as f64 / r.secs / (1u64 << 20) as f64;
    let iops = (r.bytes / a.bs) as f64 / r.secs;
    let avg = r.lat_us.iter().sum::<f64>() / r.lat_us.len().max(1) as f64;
    let p99 = pct(&mut r.lat_us, 0.99);
    let min = r.lat_us.first().copied().unwrap_or(0.0);
    let max = r.lat_us.last().copied().unwrap_or(0.0);
    println!(
        "rixl-perf file: rw={rw} bs={} iodepth={} batch={} size={} file={}",
        a.bs,
        a.iodepth,
        a.batch,
        a.size,
        a.path.display()
    );
    println!(
        "  {}: IOPS={iops:.0}, BW={mib_s:.1}MiB/s ({:.1}MB/s)({}MiB/{:.0}ms)",
        if a.op == Op::Read { "read" } else { "write" },
        r.bytes as f64 / r.secs / 1e6,
        r.bytes >> 20,
        r.secs * 1e3
    );
    println!("    lat (usec) per transfer: min={min:.0}, max={max:.0}, avg={avg:.1}, p99={p99:.0}");
    if let Some(path) = &a.out_json {
        let j = serde_json::json!({
            "rw": rw, "bs": a.bs, "iodepth": a.iodepth, "batch": a.batch, "bytes": r.bytes,
            "seconds": r.secs, "bw_MiBps": mib_s, "iops": iops, "lat_avg_us": avg, "lat_p99_us": p99,
        });
        std::fs::write(path, j.to_string()).map_err(s)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fio_sizes() {
        assert_eq!(parse_size("131072"), Some(131_072));
        assert_eq!(parse_size("128k"), Some(128 << 10));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("2g"), Some(2 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("99999999999g"), None);
    }

    #[test]
    fn flags() {
        let p = |s: &str| parse(&s.split(' ').map(String::from).collect::<Vec<_>>());
        let a = p("--filename /x --rw=randwrite --bs 1m --iodepth 8").unwrap();
        assert_eq!(
            (a.op, a.random, a.bs, a.iodepth),
            (Op::Write, true, 1 << 20, 8)
        );
        assert!(p("--rw read").is_err(), "filename required");
        assert!(p("--filename /x --bs 1000").is_err(), "bs not aligned");
        assert!(p("--filename /x --bogus 1").is_err());
        assert!(p("--filename /x --rw sideways").is_err());
    }
}
