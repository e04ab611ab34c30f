//! The KV tiers from VRAM, for the GPU check: VRAM -> FILE and back, VRAM -> OBJECT and back
//! (through pooled pinned bounce buffers, the device's copy overlapping the I/O), and the
//! tiered cache with its hot tier in VRAM. Every byte verified. Each staged transfer is timed
//! next to its two legs run alone (the device-to-host copy into the same pool, and the same I/O
//! from DRAM), and the pipeline's ratio to the slower leg is printed.
//!
//! `--standin` runs the same code with DRAM standing in for VRAM (on a host without a GPU), so
//! it is exercised here too. The object stage needs `s3s-fs` (`RIXL_S3S_FS`, or in the cargo
//! bin directory); without it that stage prints SKIPPED.
//!
//! ```text
//! gpu_tiers [--mib 256] [--gpu 0] [--standin] [--dir DIR]
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures_lite::future::block_on;
use futures_util::StreamExt;
use rixl::agent::{Agent, AgentConfig, Registration, Visibility};
use rixl::object::{ObjectDesc, ObjectSpec};
use rixl::runtime::{FileDesc, FileMode, FileSpec, LocalDescList};
use rixl::staging::{chunk_of, stage_out, BouncePool, BounceSource, RegionCopier};
use rixl::tier::{Lru, Policy, Tier, TierConfig, TieredCache};

type BoxError = Box<dyn std::error::Error>;

#[derive(Debug, Parser)]
#[command(about = "KV tiers from VRAM: staged FILE and OBJECT transfers, the tiered cache")]
struct Opts {
    /// MiB moved per stage.
    #[arg(long, default_value_t = 256)]
    mib: usize,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: i32,
    /// DRAM stands in for VRAM (no GPU needed).
    #[arg(long)]
    standin: bool,
    /// Directory of the file tier.
    #[arg(long, default_value = "target/gpu-tiers")]
    dir: std::path::PathBuf,
}

fn pattern(i: usize, seed: u8) -> u8 {
    ((i.wrapping_mul(2_654_435_761) >> 11) as u8) ^ seed
}

fn gbs(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

struct Check {
    agent: Agent,
    opts: Opts,
    len: usize,
}

impl Check {
    /// "VRAM" of `len` bytes filled with `seed`'s pattern (or zero).
    fn memory(&self, len: usize, seed: Option<u8>) -> Result<Registration, BoxError> {
        let r = if self.opts.standin {
            block_on(self.agent.register(len, Visibility::All))?
        } else {
            block_on(
                self.agent
                    .register_vram(self.opts.gpu, len, Visibility::All),
            )?
        };
        let host: Vec<u8> = match seed {
            Some(s) => (0..len).map(|i| pattern(i, s)).collect(),
            None => vec![0; len],
        };
        r.region().write_at(0, &host)?;
        Ok(r)
    }

    fn dram(&self, len: usize) -> Result<Registration, BoxError> {
        Ok(block_on(self.agent.register(len, Visibility::All))?)
    }

    fn whole(r: &Registration, len: usize) -> LocalDescList {
        let mut l = LocalDescList::new();
        l.push(r.region(), 0, len as u64);
        l
    }

    fn verify(r: &Registration, len: usize, seed: u8, what: &str) -> Result<(), BoxError> {
        let mut back = vec![0u8; len];
        r.region().read_at(0, &mut back)?;
        match (0..len).find(|&i| back[i] != pattern(i, seed)) {
            Some(i) => Err(format!("{what}: byte {i} differs").into()),
            None => Ok(()),
        }
    }

    /// The copy leg alone: `src` staged through a pool like the transfer's, nothing sent.
    fn copy_leg(&self, src: &Registration, chunk: usize) -> Result<Duration, BoxError> {
        let local = Self::whole(src, self.len);
        let starts = local.stream_starts();
        let n = self.len.div_ceil(chunk);
        let chunks: Vec<_> = (0..n)
            .map(|i| {
                let at = (i * chunk) as u64;
                chunk_of(&local, &starts, at, chunk.min(self.len - i * chunk) as u64)
            })
            .collect();
        let source = match src.region().gpu_memory() {
            Some(g) => BounceSource::Pinned(Arc::clone(g.gpu())),
            None => BounceSource::Host,
        };
        let pool = BouncePool::new(chunk, 6, source);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(async {
            let t0 = Instant::now();
            let mut s = stage_out(&pool, Arc::new(RegionCopier), chunks, 4);
            while let Some(b) = s.next().await {
                drop(b?);
            }
            Ok(t0.elapsed())
        })
    }

    fn report(&self, what: &str, pipe: Duration, copy: Duration, io: Duration) {
        let slower = copy.max(io);
        println!(
            "  {what}: {:.2} GB/s; legs alone: device copy {:.2} GB/s, I/O from DRAM {:.2} GB/s; pipeline / slower leg {:.2}",
            gbs(self.len, pipe),
            gbs(self.len, copy),
            gbs(self.len, io),
            slower.as_secs_f64() / pipe.as_secs_f64()
        );
    }

    fn file(&self) -> Result<(), BoxError> {
        std::fs::create_dir_all(&self.opts.dir)?;
        let f = block_on(self.agent.register_file(FileSpec::new(
            self.opts.dir.join("vram-tier.bin"),
            self.len as u64,
            FileMode::Create,
        )))?;
        // DRAM standing in for VRAM is staged as VRAM would be.
        let f = if self.opts.standin {
            f.with_copier(Arc::new(RegionCopier))
        } else {
            f
        };
        let descs = [FileDesc::new(0, self.len as u64)];
        let src = self.memory(self.len, Some(0x5a))?;
        let dst = self.memory(self.len, None)?;
        let dram = self.dram(self.len)?;
        // A first write lays the file out; the timed ones overwrite it.
        block_on(
            self.agent
                .write_file(&Self::whole(&dram, self.len), &f, &descs),
        )?;
        let t0 = Instant::now();
        block_on(
            self.agent
                .write_file(&Self::whole(&src, self.len), &f, &descs),
        )?;
        let pipe = t0.elapsed();
        let t0 = Instant::now();
        block_on(
            self.agent
                .read_file(&Self::whole(&dst, self.len), &f, &descs),
        )?;
        let back = t0.elapsed();
        Self::verify(&dst, self.len, 0x5a, "VRAM -> FILE -> VRAM")?;
        let copy = self.copy_leg(&src, 4 << 20)?;
        let plain = if self.opts.standin {
            f.unstaged()
        } else {
            f.clone()
        };
        let t0 = Instant::now();
        block_on(
            self.agent
                .write_file(&Self::whole(&dram, self.len), &plain, &descs),
        )?;
        let io = t0.elapsed();
        self.report("VRAM -> FILE", pipe, copy, io);
        println!(
            "  FILE -> VRAM: {:.2} GB/s, {} MiB verified",
            gbs(self.len, back),
            self.len >> 20
        );
        Ok(())
    }

    fn object(&self, s3: &rixl_testkit::s3::S3Server, bucket: &str) -> Result<(), BoxError> {
        let objs = block_on(
            self.agent.register_object(
                ObjectSpec::new(s3.endpoint(), bucket, "vram")
                    .credentials(rixl_testkit::s3::ACCESS_KEY, rixl_testkit::s3::SECRET_KEY),
            ),
        )?;
        let objs = if self.opts.standin {
            objs.with_copier(Arc::new(RegionCopier))
        } else {
            objs
        };
        let len = self.len.min(256 << 20);
        let src = self.memory(len, Some(0xa5))?;
        let dst = self.memory(len, None)?;
        let dram = self.dram(len)?;
        let descs = [ObjectDesc::new("layer-0", 0, len as u64)];
        let t0 = Instant::now();
        block_on(
            self.agent
                .write_object(&Self::whole(&src, len), &objs, &descs),
        )?;
        let pipe = t0.elapsed();
        let t0 = Instant::now();
        block_on(
            self.agent
                .read_object(&Self::whole(&dst, len), &objs, &descs),
        )?;
        let back = t0.elapsed();
        Self::verify(&dst, len, 0xa5, "VRAM -> OBJECT -> VRAM")?;
        let copy = self.copy_leg(&src, 8 << 20)?;
        let t0 = Instant::now();
        block_on(self.agent.write_object(
            &Self::whole(&dram, len),
            &objs,
            &[ObjectDesc::new("dram-0", 0, len as u64)],
        ))?;
        let io = t0.elapsed();
        self.report("VRAM -> OBJECT (staged, multipart)", pipe, copy, io);
        println!(
            "  OBJECT -> VRAM (ranged GETs): {:.2} GB/s, {} MiB verified; {:?}",
            gbs(len, back),
            len >> 20,
            objs.counters()
        );
        Ok(())
    }

    fn tiers(&self, s3: &rixl_testkit::s3::S3Server, bucket: &str) -> Result<(), BoxError> {
        let block = 64usize << 10;
        let (hot, host, file) = (8usize, 8usize, 16usize);
        let hot_mem = self.memory(hot * block, None)?;
        let host_mem = self.dram(host * block)?;
        let f = block_on(self.agent.register_file(FileSpec::new(
            self.opts.dir.join("tiers.bin"),
            (file * block) as u64,
            FileMode::Create,
        )))?;
        let objs = block_on(
            self.agent.register_object(
                ObjectSpec::new(s3.endpoint(), bucket, "tiers")
                    .credentials(rixl_testkit::s3::ACCESS_KEY, rixl_testkit::s3::SECRET_KEY),
            ),
        )?;
        let cfg = TierConfig::new(block as u64, hot, host, file, Duration::from_secs(1));
        let lru = || Box::new(Lru::default()) as Box<dyn Policy>;
        let mut cache = TieredCache::new(&self.agent, cfg, hot_mem, host_mem, f, objs, lru)?;
        let mut buf = vec![0u8; block];
        let mut verified = 0;
        // 40 blocks through 8 + 8 + 16 slots, then every one of them again, newest first.
        for b in (0..40u64).chain((0..40).rev()) {
            for p in block_on(cache.acquire(&[b]))? {
                let at = p.slot as u64 * block as u64;
                let want: Vec<u8> = (0..block).map(|i| pattern(i, b as u8)).collect();
                match p.from {
                    None => cache.hot_region().write_at(at, &want)?,
                    Some(t) => {
                        cache.hot_region().read_at(at, &mut buf)?;
                        if buf != want {
                            return Err(format!("block {b} from {t:?} has wrong bytes").into());
                        }
                        verified += 1;
                    }
                }
            }
        }
        let st = cache.stats();
        let hits: Vec<String> = Tier::ALL
            .iter()
            .map(|&t| format!("{t:?} {}", st.tier(t).hits))
            .collect();
        println!(
            "  tiered cache, hot tier in {}: {verified} blocks came back intact; hits {}",
            if self.opts.standin {
                "DRAM (stand-in)"
            } else {
                "VRAM"
            },
            hits.join(", ")
        );
        if Tier::ALL.iter().any(|&t| st.tier(t).hits == 0) {
            return Err("a tier had no hit".into());
        }
        Ok(())
    }
}

fn main() -> Result<(), BoxError> {
    let opts = Opts::parse();
    if !opts.standin {
        if let Err(e) = rixl::gpudirect::probe() {
            println!("SKIPPED gpu_tiers: {e} (--standin runs it with DRAM for VRAM)");
            return Ok(());
        }
    }
    let mut cfg =
        AgentConfig::default().with_cluster_key(rixl::agent::ClusterKey::env_or_process_local()?);
    cfg.engine.require_nic = false;
    cfg.io_memory = 8 << 20;
    let agent = Agent::new("gpu-tiers", cfg)?;
    let len = opts.mib << 20;
    let check = Check { agent, opts, len };
    println!(
        "gpu_tiers: {} MiB per stage, memory: {}",
        len >> 20,
        if check.opts.standin {
            "DRAM standing in for VRAM".into()
        } else {
            format!("VRAM of GPU {}", check.opts.gpu)
        }
    );
    let mut failed = Vec::new();
    let mut stage = |name: &'static str, r: Result<(), BoxError>| {
        if let Err(e) = r {
            println!("  FAILED {name}: {e}");
            failed.push(name);
        }
    };
    match rixl::gpudirect::gds::Gds::open() {
        Ok(_) if !check.opts.standin => {
            println!(
                "  GPUDirect Storage (cuFile) present: VRAM FILE transfers use it, not staging"
            )
        }
        Ok(_) => println!("  GPUDirect Storage present, unused: the stand-in is DRAM"),
        Err(e) => println!("  no GPUDirect Storage ({e}): VRAM FILE transfers are staged"),
    }
    stage("file", check.file());
    match rixl_testkit::s3::S3Server::start("gpu_tiers", "rixl-gpu") {
        Some(s3) => {
            stage("object", check.object(&s3, "rixl-gpu"));
            stage("tiered cache", check.tiers(&s3, "rixl-gpu"));
        }
        None => println!("  (object and tiered stages skipped: no s3s-fs)"),
    }
    check.agent.shutdown();
    if !failed.is_empty() {
        return Err(format!("gpu_tiers: {} stage(s) failed: {failed:?}", failed.len()).into());
    }
    println!("gpu_tiers: all stages passed");
    Ok(())
}
