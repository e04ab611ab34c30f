//! Tiered KV offload through all four tiers: the hot KV cache (VRAM on a GPU node, DRAM here)
//! -> host DRAM -> an NVMe file -> an S3-compatible object store, and back on a prefix hit,
//! with [`rixl::tier::TieredCache`].
//!
//! Requests share prefixes (system prompts, documents: a skewed choice among `--prefixes`) and
//! add unique blocks. A block's identity is a hash chained over its tokens and its prefix (as in
//! vLLM's prefix caching), so equal prefixes are one block in every tier. Blocks found below the
//! hot tier are reloaded when the tier's measured reload cost beats recomputing them (the
//! recompute cost is a stated prefill-rate model); every block that arrives is checked byte for
//! byte against its content, and the run fails on the first wrong byte.
//!
//! ```text
//! tiered_kv --endpoint http://127.0.0.1:9000 --bucket kv [--access-key K --secret-key S]
//!           [--dir DIR] [--policy lru|fifo] [--requests 300] [--prefixes 24]
//!           [--prefix-blocks 16] [--suffix-blocks 4] [--hot-blocks 48] [--host-blocks 64]
//!           [--file-blocks 128] [--block-tokens 16] [--kv-bytes-per-token 4096]
//!           [--prefill-tokens-per-s 20000]
//! ```
//! Credentials default to `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use futures_lite::future::block_on;
use rixl::agent::{Agent, AgentConfig, Visibility};
use rixl::object::ObjectSpec;
use rixl::runtime::{FileMode, FileSpec};
use rixl::tier::{Fifo, Lru, Policy, Tier, TierConfig, TieredCache};

type BoxError = Box<dyn std::error::Error>;

/// `tiered_kv [flags]`.
#[derive(Debug, Parser)]
#[command(
    about = "Tiered KV offload: hot KV cache -> DRAM -> NVMe file -> object store, and back on a hit"
)]
struct Opts {
    /// S3-compatible endpoint
    #[arg(long)]
    endpoint: String,
    /// Bucket
    #[arg(long)]
    bucket: String,
    /// Key prefix in the bucket
    #[arg(long, default_value = "tiered-kv")]
    prefix: String,
    /// Access key (default: AWS_ACCESS_KEY_ID)
    #[arg(long)]
    access_key: Option<String>,
    /// Secret key (default: AWS_SECRET_ACCESS_KEY)
    #[arg(long)]
    secret_key: Option<String>,
    /// Directory of the file tier
    #[arg(long, default_value = "target/tiered-kv")]
    dir: PathBuf,
    /// Replacement policy of every tier: lru or fifo
    #[arg(long, default_value = "lru")]
    policy: String,
    /// Requests
    #[arg(long, default_value_t = 300)]
    requests: u64,
    /// Shared prefixes (chosen with a skew)
    #[arg(long, default_value_t = 24)]
    prefixes: u64,
    /// Blocks per prefix
    #[arg(long, default_value_t = 16)]
    prefix_blocks: u64,
    /// Unique blocks per request
    #[arg(long, default_value_t = 4)]
    suffix_blocks: u64,
    /// Blocks of the hot tier (the KV cache)
    #[arg(long, default_value_t = 48)]
    hot_blocks: usize,
    /// Blocks of the host DRAM tier
    #[arg(long, default_value_t = 64)]
    host_blocks: usize,
    /// Blocks of the file tier
    #[arg(long, default_value_t = 128)]
    file_blocks: usize,
    /// Tokens per block
    #[arg(long, default_value_t = 16)]
    block_tokens: u64,
    /// KV bytes per token (block bytes = tokens x this, a multiple of 4096)
    #[arg(long, default_value_t = 4096)]
    kv_bytes_per_token: u64,
    /// Prefill rate of the recompute model, tokens per second
    #[arg(long, default_value_t = 20_000)]
    prefill_tokens_per_s: u64,
}

/// The bytes of a block with identity `hash` (so any reload can be verified).
fn content(hash: u64, len: usize) -> Vec<u8> {
    let mut x = hash | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

fn chain(parent: u64, tokens: &[u64]) -> u64 {
    tokens.iter().fold(parent ^ 0xcbf2_9ce4_8422_2325, |h, &t| {
        (h ^ t).wrapping_mul(0x100_0000_01b3).rotate_left(5)
    })
}

fn main() -> Result<(), BoxError> {
    let o = Opts::parse();
    let block = o.block_tokens * o.kv_bytes_per_token;
    let recompute = Duration::from_secs_f64(o.block_tokens as f64 / o.prefill_tokens_per_s as f64);
    std::fs::create_dir_all(&o.dir)?;
    let mut cfg =
        AgentConfig::default().with_cluster_key(rixl::agent::ClusterKey::env_or_process_local()?);
    cfg.engine.require_nic = false;
    cfg.io_memory = 8 << 20;
    let agent = Agent::new("tiered-kv", cfg)?;
    let (hot, host, file, objects) = block_on(async {
        let hot = agent
            .register(o.hot_blocks * block as usize, Visibility::All)
            .await?;
        let host = agent
            .register(o.host_blocks * block as usize, Visibility::All)
            .await?;
        let file = agent
            .register_file(FileSpec::new(
                o.dir.join("kv-tier.bin"),
                o.file_blocks as u64 * block,
                FileMode::Create,
            ))
            .await?;
        let mut spec = ObjectSpec::new(&o.endpoint, &o.bucket, &o.prefix);
        if let (Some(k), Some(s)) = (&o.access_key, &o.secret_key) {
            spec = spec.credentials(k, s);
        }
        let objects = agent.register_object(spec).await?;
        Ok::<_, BoxError>((hot, host, file, objects))
    })?;
    let policy: fn() -> Box<dyn Policy> = match o.policy.as_str() {
        "lru" => || Box::new(Lru::default()),
        "fifo" => || Box::new(Fifo::default()),
        other => return Err(format!("unknown policy {other:?} (lru or fifo)").into()),
    };
    let tiers = TierConfig::new(block, o.hot_blocks, o.host_blocks, o.file_blocks, recompute);
    let mut cache = TieredCache::new(&agent, tiers, hot, host, file, objects, policy)?;
    println!(
        "tiered_kv: {} requests; {} prefixes x {} blocks + {} unique each; block {} KiB; tiers: hot {} (DRAM here), host {}, file {}, object store {}/{}; policy {}; recompute {:.0} us/block ({} tokens at {} tok/s)",
        o.requests, o.prefixes, o.prefix_blocks, o.suffix_blocks, block >> 10, o.hot_blocks,
        o.host_blocks, o.file_blocks, o.bucket, o.prefix, o.policy,
        recompute.as_secs_f64() * 1e6, o.block_tokens, o.prefill_tokens_per_s
    );
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut seen = HashSet::new();
    let (mut verified, mut computed) = (0u64, 0u64);
    let mut buf = vec![0u8; block as usize];
    let t0 = Instant::now();
    for r in 0..o.requests {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Skewed popularity: prefix p with probability ~ 1/(p+1).
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        let p = ((o.prefixes as f64 + 1.0).powf(u) - 1.0).floor() as u64 % o.prefixes;
        let mut h = 0u64;
        let mut blocks = Vec::new();
        for i in 0..o.prefix_blocks {
            h = chain(h, &[p, i]);
            blocks.push(h);
        }
        for i in 0..o.suffix_blocks {
            h = chain(h, &[u64::MAX - r, i]);
            blocks.push(h);
        }
        seen.extend(blocks.iter().copied());
        for placed in block_on(cache.acquire(&blocks))? {
            let at = placed.slot as u64 * block;
            match placed.from {
                None => {
                    cache
                        .hot_region()
                        .write_at(at, &content(placed.block, block as usize))?;
                    computed += 1;
                }
                Some(_) => {
                    cache.hot_region().read_at(at, &mut buf)?;
                    if buf != content(placed.block, block as usize) {
                        return Err(format!(
                            "block {:#x} arrived from {:?} with wrong bytes",
                            placed.block, placed.from
                        )
                        .into());
                    }
                    verified += 1;
                }
            }
        }
    }
    let wall = t0.elapsed();
    let st = cache.stats();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "lookups {} ({} distinct blocks), misses {}, recomputed {}, verified {} blocks byte for byte, in {:.2} s",
        st.lookups, seen.len(), st.misses, st.recomputed, verified, wall.as_secs_f64()
    );
    println!(
        "{:<7} {:>7} {:>10} {:>10} {:>8} {:>8} {:>10} {:>14}",
        "tier", "hits", "in MiB", "out MiB", "skipped", "reloads", "recomputes", "us/block"
    );
    for t in Tier::ALL {
        let c = st.tier(t);
        println!(
            "{:<7} {:>7} {:>10.1} {:>10.1} {:>8} {:>8} {:>10} {:>14}",
            format!("{t:?}"),
            c.hits,
            mib(c.bytes_in),
            mib(c.bytes_out),
            c.writes_skipped,
            c.reloads,
            c.recomputes,
            c.per_block
                .map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e6)),
        );
    }
    for t in [Tier::Host, Tier::File, Tier::Object] {
        let c = st.tier(t);
        if let Some(d) = c.per_block {
            let decision = if d < recompute { "reload" } else { "recompute" };
            println!(
                "decision {t:?}: reload {:.1} us/block (measured) vs recompute {:.1} us/block (model): {decision}",
                d.as_secs_f64() * 1e6,
                recompute.as_secs_f64() * 1e6
            );
        }
    }
    println!("tiered_kv: ok ({computed} blocks computed, {verified} arrived intact)");
    agent.shutdown();
    Ok(())
}
