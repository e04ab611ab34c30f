//! The OBJECT tier and the staging pipeline, side by side with their baselines in one process,
//! alternating rounds (ABBA), against one S3-compatible server (`perf/benches/compare-objects`
//! starts it):
//!
//! - **put / get**: rixl's `write_object` / `read_object` of a 64 MiB DRAM object against
//!   `object_store` (the client rixl uses) doing the same by hand: a multipart upload of 8 MiB
//!   parts, 8 in flight; 8 ranged GETs of 8 MiB in flight. Same server, same checksums.
//! - **staging**: the pipeline (copy into bounce buffers, overlapped with the I/O) against the
//!   slower of its two legs run alone: the copy leg is a stand-in for a device copy engine,
//!   throttled to the I/O leg's own rate (the case where overlap matters most), and the I/O leg
//!   is the same transfer from DRAM without staging. For the object store and for the file.
//!
//! ```text
//! rixl-objects --endpoint URL --bucket B [--access-key K --secret-key S] [--size 64m]
//!              [--part 8m] [--parallel 8] [--rounds 6] [--dir target/compare-objects]
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures_lite::future::block_on;
use object_store::aws::{AmazonS3, AmazonS3Builder, Checksum};
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload};
use rixl::agent::{Agent, AgentConfig, Registration, Visibility};
use rixl::object::{ObjectConfig, ObjectDesc, ObjectRegistration, ObjectSpec};
use rixl::runtime::{FileDesc, FileMode, FileSpec, LocalDescList, Region};
use rixl::staging::{
    chunk_of, stage_out, BouncePool, BounceSource, Copier, RegionCopier, StagingError,
};

type BoxError = Box<dyn std::error::Error>;

#[derive(Debug, Parser)]
#[command(about = "OBJECT tier and staging pipeline next to object_store and their own legs")]
struct Opts {
    #[arg(long)]
    endpoint: String,
    #[arg(long)]
    bucket: String,
    #[arg(long)]
    access_key: String,
    #[arg(long)]
    secret_key: String,
    /// Object size (k, m, g suffixes)
    #[arg(long, default_value = "64m", value_parser = size)]
    size: u64,
    /// Part size
    #[arg(long, default_value = "8m", value_parser = size)]
    part: u64,
    /// Requests in flight
    #[arg(long, default_value_t = 8)]
    parallel: usize,
    /// Rounds (each runs rixl and the baseline, order alternating)
    #[arg(long, default_value_t = 6)]
    rounds: usize,
    /// Directory of the file-tier staging run
    #[arg(long, default_value = "target/compare-objects")]
    dir: std::path::PathBuf,
}

fn size(s: &str) -> Result<u64, String> {
    let (n, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    n.parse::<u64>()
        .map(|n| n * mult)
        .map_err(|e| format!("{s:?}: {e}"))
}

/// A device copy engine's stand-in: one engine that moves `bytes_per_s`, copies queued on it
/// in order of arrival. The bytes move by the region's own copy; each copy then completes when
/// the engine's clock says (queueing included), as a DMA engine's would whatever the CPUs are
/// doing.
struct Throttled {
    bytes_per_s: f64,
    /// When the engine is next idle.
    free_at: std::sync::Mutex<Instant>,
}

impl Throttled {
    fn engine(bytes_per_s: f64) -> Arc<dyn Copier> {
        Arc::new(Throttled {
            bytes_per_s,
            free_at: std::sync::Mutex::new(Instant::now()),
        })
    }

    fn run(
        &self,
        len: usize,
        copy: impl FnOnce() -> Result<(), StagingError>,
    ) -> Result<(), StagingError> {
        let asked = Instant::now();
        let done = {
            let mut free = self
                .free_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let start = (*free).max(asked);
            *free = start + Duration::from_secs_f64(len as f64 / self.bytes_per_s);
            *free
        };
        copy()?;
        if let Some(left) = done.checked_duration_since(Instant::now()) {
            std::thread::sleep(left);
        }
        Ok(())
    }
}

impl Copier for Throttled {
    fn device_to_host(&self, r: &Region, off: u64, dst: &mut [u8]) -> Result<(), StagingError> {
        let len = dst.len();
        self.run(len, || RegionCopier.device_to_host(r, off, dst))
    }

    fn host_to_device(&self, src: &[u8], r: &Region, off: u64) -> Result<(), StagingError> {
        self.run(src.len(), || RegionCopier.host_to_device(src, r, off))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

struct Bench {
    o: Opts,
    agent: Agent,
    client: Arc<AmazonS3>,
    objects: ObjectRegistration,
    src: Registration,
    dst: Registration,
    data: bytes::Bytes,
    rt: tokio::runtime::Runtime,
}

impl Bench {
    fn mbps(&self, took: Duration) -> f64 {
        self.o.size as f64 / took.as_secs_f64() / 1e6
    }

    fn whole(&self, r: &Registration) -> LocalDescList {
        let mut l = LocalDescList::new();
        l.push(r.region(), 0, self.o.size);
        l
    }

    /// object_store by hand: multipart upload, `parallel` parts in flight.
    fn baseline_put(&self, key: &str) -> Result<Duration, BoxError> {
        let (client, data, part, par) = (
            Arc::clone(&self.client),
            self.data.clone(),
            self.o.part as usize,
            self.o.parallel,
        );
        let loc = Path::from(format!("baseline/{key}"));
        self.rt.block_on(async move {
            let t0 = Instant::now();
            let mut up = client.put_multipart(&loc).await?;
            let mut inflight = futures_util::stream::FuturesUnordered::new();
            use futures_util::StreamExt;
            let mut at = 0;
            while at < data.len() {
                let end = (at + part).min(data.len());
                inflight.push(up.put_part(PutPayload::from_bytes(data.slice(at..end))));
                at = end;
                while inflight.len() >= par {
                    if let Some(r) = inflight.next().await {
                        r?;
                    }
                }
            }
            while let Some(r) = inflight.next().await {
                r?;
            }
            up.complete().await?;
            Ok(t0.elapsed())
        })
    }

    /// object_store by hand: ranged GETs, `parallel` in flight, copied into one buffer.
    fn baseline_get(&self, key: &str) -> Result<Duration, BoxError> {
        let (client, size, part, par) = (
            Arc::clone(&self.client),
            self.o.size,
            self.o.part,
            self.o.parallel,
        );
        let loc = Path::from(format!("baseline/{key}"));
        self.rt.block_on(async move {
            use futures_util::StreamExt;
            let t0 = Instant::now();
            let mut out = vec![0u8; size as usize];
            let ranges: Vec<_> = (0..size.div_ceil(part))
                .map(|i| i * part..((i + 1) * part).min(size))
                .collect();
            let mut gets = futures_util::stream::iter(ranges.into_iter().map(|r| {
                let client = Arc::clone(&client);
                let loc = loc.clone();
                async move {
                    let opts = GetOptions {
                        range: Some(GetRange::Bounded(r.clone())),
                        ..GetOptions::default()
                    };
                    let b = client.get_opts(&loc, opts).await?.bytes().await?;
                    Ok::<_, object_store::Error>((r, b))
                }
            }))
            .buffer_unordered(par);
            while let Some(r) = gets.next().await {
                let (r, b) = r?;
                out[r.start as usize..r.end as usize].copy_from_slice(&b);
            }
            Ok(t0.elapsed())
        })
    }

    fn rixl_put(&self, objs: &ObjectRegistration, key: &str) -> Result<Duration, BoxError> {
        let t0 = Instant::now();
        block_on(self.agent.write_object(
            &self.whole(&self.src),
            objs,
            &[ObjectDesc::new(key, 0, self.o.size)],
        ))?;
        Ok(t0.elapsed())
    }

    fn rixl_get(&self, key: &str) -> Result<Duration, BoxError> {
        let t0 = Instant::now();
        block_on(self.agent.read_object(
            &self.whole(&self.dst),
            &self.objects,
            &[ObjectDesc::new(key, 0, self.o.size)],
        ))?;
        Ok(t0.elapsed())
    }

    /// The copy leg alone: stage the whole object through a pool with `copier`, no I/O.
    fn copy_leg(&self, copier: Arc<dyn Copier>, chunk: u64) -> Result<Duration, BoxError> {
        let local = self.whole(&self.src);
        let starts = local.stream_starts();
        let chunks: Vec<_> = (0..self.o.size.div_ceil(chunk))
            .map(|i| {
                chunk_of(
                    &local,
                    &starts,
                    i * chunk,
                    chunk.min(self.o.size - i * chunk),
                )
            })
            .collect();
        let pool = BouncePool::new(chunk as usize, self.o.parallel + 2, BounceSource::Host);
        let depth = self.o.parallel;
        self.rt.block_on(async move {
            use futures_util::StreamExt;
            let t0 = Instant::now();
            let mut s = stage_out(&pool, copier, chunks, depth);
            while let Some(b) = s.next().await {
                drop(b?);
            }
            Ok(t0.elapsed())
        })
    }
}

/// Runs `a` and `b` for `rounds` in ABBA order; returns their MB/s per round.
fn paired(
    rounds: usize,
    mut a: impl FnMut(usize) -> Result<Duration, BoxError>,
    mut b: impl FnMut(usize) -> Result<Duration, BoxError>,
    mbps: impl Fn(Duration) -> f64,
) -> Result<(Vec<f64>, Vec<f64>), BoxError> {
    let (mut ra, mut rb) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        if r % 2 == 0 {
            ra.push(mbps(a(r)?));
            rb.push(mbps(b(r)?));
        } else {
            rb.push(mbps(b(r)?));
            ra.push(mbps(a(r)?));
        }
    }
    Ok((ra, rb))
}

fn main() -> Result<(), BoxError> {
    let o = Opts::parse();
    std::fs::create_dir_all(&o.dir)?;
    let mut cfg =
        AgentConfig::default().with_cluster_key(rixl::agent::ClusterKey::env_or_process_local()?);
    cfg.engine.require_nic = false;
    cfg.io_memory = 8 << 20;
    let agent = Agent::new("objects-bench", cfg)?;
    let mut ocfg = ObjectConfig::default();
    ocfg.part_size = o.part;
    ocfg.concurrency = o.parallel;
    let mut spec =
        ObjectSpec::new(&o.endpoint, &o.bucket, "rixl").credentials(&o.access_key, &o.secret_key);
    spec.config = ocfg;
    let objects = block_on(agent.register_object(spec))?;
    let client = AmazonS3Builder::new()
        .with_endpoint(&o.endpoint)
        .with_allow_http(true)
        .with_bucket_name(&o.bucket)
        .with_region("us-east-1")
        .with_access_key_id(&o.access_key)
        .with_secret_access_key(&o.secret_key)
        .with_checksum_algorithm(Checksum::CRC64NVME)
        .build()?;
    let len = o.size as usize;
    let src = block_on(agent.register(len, Visibility::All))?;
    let dst = block_on(agent.register(len, Visibility::All))?;
    let data: Vec<u8> = (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    src.region().write_at(0, &data)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let b = Bench {
        agent: agent.clone(),
        client: Arc::new(client),
        objects: objects.clone(),
        src,
        dst,
        data: data.into(),
        rt,
        o,
    };
    let rounds = b.o.rounds.max(2);
    println!(
        "compare-objects: {} MiB objects, {} MiB parts, {} in flight, {rounds} rounds (ABBA), server {}",
        b.o.size >> 20, b.o.part >> 20, b.o.parallel, b.o.endpoint
    );
    // Warm both clients' connections.
    b.baseline_put("warm")?;
    b.rixl_put(&objects, "warm")?;
    let mut rows: Vec<(String, f64, f64, String)> = Vec::new();
    let (put_r, put_b) = paired(
        rounds,
        |r| b.rixl_put(&objects, &format!("obj-{r}")),
        |r| b.baseline_put(&format!("obj-{r}")),
        |d| b.mbps(d),
    )?;
    rows.push((
        "object put".into(),
        median(put_r.clone()),
        median(put_b.clone()),
        "object_store multipart".into(),
    ));
    let (get_r, get_b) = paired(
        rounds,
        |r| b.rixl_get(&format!("obj-{r}")),
        |r| b.baseline_get(&format!("obj-{r}")),
        |d| b.mbps(d),
    )?;
    if (0..len).step_by(4099).any(|i| {
        let mut x = [0u8];
        b.dst.region().read_at(i as u64, &mut x).is_err() || x[0] != b.data[i]
    }) {
        return Err("rixl's read brought back wrong bytes".into());
    }
    rows.push((
        "object get".into(),
        median(get_r),
        median(get_b),
        "object_store ranged GETs".into(),
    ));

    // Staging into the object store, the copy leg throttled to the upload's own rate (equal
    // legs, where overlap matters most) and to four times it (a GPU's copy engine outruns
    // object storage). A multipart upload ends with a CompleteMultipartUpload that waits for
    // every part, so its time cannot overlap any copy.
    let io = median(put_r);
    for (speedup, name) in [(1.0, "staged object put"), (4.0, "staged put, copy 4x")] {
        let throttled = Throttled::engine(median(put_b.clone()) * 1e6 * speedup);
        let staged = objects.with_copier(Arc::clone(&throttled));
        let (pipe, copy) = paired(
            rounds,
            |r| b.rixl_put(&staged, &format!("staged-{r}")),
            |_| b.copy_leg(Arc::clone(&throttled), b.o.part),
            |d| b.mbps(d),
        )?;
        let slower = median(copy.clone()).min(io);
        rows.push((
            name.into(),
            median(pipe),
            slower,
            format!(
                "slower leg: copy {:.0} MB/s, upload {io:.0} MB/s",
                median(copy)
            ),
        ));
    }

    // Staging into a file: the I/O leg is the unstaged write of the same bytes.
    let file = block_on(agent.register_file(FileSpec::new(
        b.o.dir.join("staging.bin"),
        b.o.size,
        FileMode::Create,
    )))?;
    let descs = [FileDesc::new(0, b.o.size)];
    let local = b.whole(&b.src);
    let file_write = |f: &rixl::agent::FileRegistration| -> Result<Duration, BoxError> {
        let t0 = Instant::now();
        block_on(agent.write_file(&local, f, &descs))?;
        Ok(t0.elapsed())
    };
    file_write(&file)?;
    let (_, direct) = paired(
        rounds,
        |_| Ok(Duration::from_secs(1)),
        |_| file_write(&file),
        |d| b.mbps(d),
    )?;
    let file_rate = median(direct.clone()) * 1e6;
    let throttled = Throttled::engine(file_rate);
    let staged_file = file.with_copier(Arc::clone(&throttled));
    let (pipe, copy) = paired(
        rounds,
        |_| file_write(&staged_file),
        |_| b.copy_leg(Arc::clone(&throttled), 4 << 20),
        |d| b.mbps(d),
    )?;
    let slower = median(copy.clone()).min(median(direct.clone()));
    rows.push((
        "staged file write".into(),
        median(pipe),
        slower,
        format!(
            "slower leg: copy {:.0} MB/s, file {:.0} MB/s",
            median(copy),
            median(direct)
        ),
    ));

    println!(
        "{:<18} {:>10} {:>10} {:>7}  baseline",
        "test", "rixl MB/s", "base MB/s", "ratio"
    );
    let mut md = String::from(
        "| test | rixl MB/s | baseline MB/s | ratio | baseline |\n|---|---|---|---|---|\n",
    );
    for (name, r, base, what) in &rows {
        println!(
            "{name:<18} {r:>10.0} {base:>10.0} {:>7.2}  {what}",
            r / base
        );
        md.push_str(&format!(
            "| {name} | {r:.0} | {base:.0} | {:.2} | {what} |\n",
            r / base
        ));
    }
    std::fs::write(b.o.dir.join("compare.md"), md)?;
    agent.shutdown();
    Ok(())
}
