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

use super::stats::Durations;
use super::{on_core_with, s, Res};

/// `rixl-perf file`: fio's flag names and meanings; sizes take fio's k/m/g suffixes (1024-based).
#[derive(Debug, Clone, clap::Args)]
pub struct FileArgs {
    /// The file to read or write (created when missing or short)
    #[arg(long = "filename", value_name = "PATH")]
    path: PathBuf,
    /// Direction and order
    #[arg(long = "rw", value_enum, default_value_t = Rw::Read)]
    rw: Rw,
    /// Block size per transfer: a positive multiple of 4096 (O_DIRECT)
    #[arg(long = "bs", value_name = "B", default_value = "128k", value_parser = block_size)]
    bs: u64,
    /// Transfers in flight
    #[arg(long = "iodepth", value_name = "N", default_value = "32", value_parser = count)]
    iodepth: usize,
    /// File size; the whole file is covered once
    #[arg(long = "size", value_name = "B", default_value = "1g", value_parser = size)]
    size: u64,
    /// Blocks per transfer (descriptors); --iodepth counts blocks
    #[arg(long = "batch", value_name = "N", default_value = "1", value_parser = count)]
    batch: usize,
    /// Core to run on [default: the first CPU this process may run on]
    #[arg(long = "cpu", value_name = "N", value_parser = index)]
    cpu: Option<usize>,
    /// glommio I/O memory [default: 2 x iodepth x bs, at most 256m]
    #[arg(long = "io_memory", value_name = "B", value_parser = index)]
    io_memory: Option<usize>,
    /// After a write, read the file back through std::fs and compare
    #[arg(long = "verify")]
    verify: bool,
    /// Write the result as JSON to this file
    #[arg(long = "out_json", value_name = "PATH")]
    out_json: Option<String>,
}

/// fio's `--rw` values that rixl's FILE tier runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Rw {
    Read,
    Write,
    #[value(name = "randread")]
    RandRead,
    #[value(name = "randwrite")]
    RandWrite,
}

impl Rw {
    fn op(self) -> Op {
        match self {
            Rw::Read | Rw::RandRead => Op::Read,
            Rw::Write | Rw::RandWrite => Op::Write,
        }
    }

    fn random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite)
    }

    fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
        }
    }
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

/// clap value parsers: a fio size ([`parse_size`]), a block size, an index, a positive count.
fn size(v: &str) -> Result<u64, String> {
    parse_size(v).ok_or_else(|| format!("not a size: {v}"))
}

fn block_size(v: &str) -> Result<u64, String> {
    match size(v)? {
        b if b > 0 && b.is_multiple_of(4096) => Ok(b),
        _ => Err("a positive multiple of 4096 (O_DIRECT)".into()),
    }
}

fn index(v: &str) -> Result<usize, String> {
    usize::try_from(size(v)?).map_err(|e| e.to_string())
}

fn count(v: &str) -> Result<usize, String> {
    match index(v)? {
        0 => Err("must be positive".into()),
        n => Ok(n),
    }
}

impl FileArgs {
    /// The checks that involve several flags.
    pub fn check(&self) -> Res<()> {
        if self.size < self.bs {
            return Err("--size is smaller than --bs".into());
        }
        Ok(())
    }
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
    lat: RefCell<Durations>,
    error: RefCell<Option<String>>,
}

/// Result of one run.
pub struct FileResult {
    bytes: u64,
    secs: f64,
    lat: Durations,
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
    if mode == FileMode::Create && a.rw.op() == Op::Read {
        // Lay the file out first (fio does the same for a missing file).
        lay_out(&store, f.id, &region, blocks_n, mem_blocks, a.bs).await?;
    }
    let mut blocks: Vec<u64> = (0..blocks_n).collect();
    if a.rw.random() {
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
        lat: RefCell::new(Durations::default()),
        error: RefCell::new(None),
    });
    let store = Rc::new(store);
    let in_flight = (a.iodepth / a.batch).max(1);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..in_flight {
        let (st, store, region) = (Rc::clone(&state), Rc::clone(&store), region.clone());
        let (bs, batch, op, id) = (a.bs, a.batch, a.rw.op(), f.id);
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
                    Ok(_) => st.lat.borrow_mut().record(t.elapsed()),
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
    let lat = state.lat.borrow().clone();
    Ok(FileResult {
        bytes: blocks_n * a.bs,
        secs,
        lat,
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

pub fn main(a: FileArgs) -> Res<()> {
    let io_memory = a
        .io_memory
        .unwrap_or_else(|| ((2 * a.iodepth as u64 * a.bs).min(256 << 20)) as usize);
    let a2 = a.clone();
    let cpu = a.cpu.unwrap_or_else(|| rixl::runtime::cpu_at(0));
    let r = on_core_with(cpu, io_memory, move || Box::pin(run(a2)))??;
    if a.verify && a.rw.op() == Op::Write {
        verify(&a)?;
        eprintln!("rixl-perf file: verified {} bytes", r.bytes);
    }
    let rw = a.rw.name();
    let mib_s = r.bytes as f64 / r.secs / (1u64 << 20) as f64;
    let iops = (r.bytes / a.bs) as f64 / r.secs;
    let (min, max, avg, p99) = (
        r.lat.min_us(),
        r.lat.max_us(),
        r.lat.mean_us(),
        r.lat.quantile_us(0.99),
    );
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
        if a.rw.op() == Op::Read {
            "read"
        } else {
            "write"
        },
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
    use crate::args::{parse, Mode};

    #[test]
    fn fio_sizes() {
        assert_eq!(parse_size("131072"), Some(131_072));
        assert_eq!(parse_size("128k"), Some(128 << 10));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("2g"), Some(2 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("99999999999g"), None);
    }

    fn p(s: &str) -> Result<FileArgs, String> {
        match parse(["rixl-perf", "file"].into_iter().chain(s.split(' '))) {
            Ok(Mode::File(a)) => Ok(a),
            Ok(m) => Err(format!("not file: {m:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn flags() {
        let a = p("--filename /x --rw=randwrite --bs 1m --iodepth 8").unwrap();
        assert_eq!(
            (a.rw.op(), a.rw.random(), a.bs, a.iodepth),
            (Op::Write, true, 1 << 20, 8)
        );
        let a = p("--filename /x").unwrap();
        assert_eq!(
            (a.rw, a.bs, a.iodepth, a.size, a.batch, a.cpu, a.io_memory),
            (Rw::Read, 128 << 10, 32, 1 << 30, 1, None, None)
        );
        assert!(!a.verify && a.out_json.is_none());
        // compare_fio.py's invocation.
        let a = p("--filename /f --rw randread --bs 128k --iodepth 32 --size 2g --cpu 1 --out_json /t.json --io_memory 8m --verify --batch 4")
            .unwrap();
        assert_eq!(
            (a.rw, a.size, a.cpu, a.io_memory, a.batch, a.verify),
            (Rw::RandRead, 2 << 30, Some(1), Some(8 << 20), 4, true)
        );
        assert_eq!(a.out_json.as_deref(), Some("/t.json"));
        assert!(p("--rw read").is_err(), "filename required");
        assert!(p("--filename /x --bs 1000").is_err(), "bs not aligned");
        assert!(p("--filename /x --bs 0").is_err(), "bs zero");
        assert!(p("--filename /x --iodepth 0").is_err());
        assert!(p("--filename /x --batch 0").is_err());
        assert!(p("--filename /x --size 64k").is_err(), "size below bs");
        assert!(p("--filename /x --size lots").is_err());
        assert!(p("--filename /x --bogus 1").is_err());
        assert!(p("--filename /x --rw sideways").is_err());
    }
}
