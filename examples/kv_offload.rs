//! Tiered KV offload and reload: hot KV cache -> host DRAM -> NVMe file under memory pressure,
//! and back on a prefix hit, through the agent's DRAM and FILE memory.
//!
//! Requests share prefixes (system prompts, documents: a skewed choice among `--prefixes`) and
//! add unique blocks. A block's identity is a hash chained over its tokens and its prefix (as in
//! vLLM's prefix caching), so equal prefixes are stored once in every tier. The hot tier is the
//! KV cache (DRAM here; VRAM on a GPU machine, staged through pinned memory); when it is full the
//! least recently used blocks move to the host tier, and from there to the file (written once:
//! a block already in the file is not written again). A request's blocks found in a lower tier
//! are reloaded (all of a request's file blocks in one scattered FILE read); the others are
//! "recomputed" (filled), and the time that would cost is taken from a stated prefill-rate model.
//! Every reloaded block is checked byte for byte against its content.
//!
//! ```text
//! kv_offload [--dir DIR] [--requests 300] [--prefixes 24] [--prefix-blocks 16]
//!            [--suffix-blocks 4] [--hot-blocks 64] [--host-blocks 128] [--file-blocks 1024]
//!            [--block-tokens 16] [--kv-bytes-per-token 16384] [--prefill-tokens-per-s 20000]
//! ```

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_lite::future::block_on;
use rixl::agent::{Agent, AgentConfig, FileRegistration, Registration, Visibility};
use rixl::runtime::{FileDesc, FileMode, FileSpec, LocalDescList};

use clap::Parser;

type BoxError = Box<dyn std::error::Error>;

/// The bytes of a block with identity `hash` (so any reload can be verified).
fn content(hash: u64, len: usize) -> Vec<u8> {
    let mut x = hash | 1;
    let mut v = Vec::with_capacity(len);
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

/// One tier of fixed-size slots with LRU replacement.
struct Tier {
    slots: Vec<Option<u64>>,
    at: HashMap<u64, usize>,
    used: HashMap<u64, u64>,
}

impl Tier {
    fn new(n: usize) -> Self {
        Tier {
            slots: vec![None; n],
            at: HashMap::new(),
            used: HashMap::new(),
        }
    }
    fn get(&self, h: u64) -> Option<usize> {
        self.at.get(&h).copied()
    }
    fn touch(&mut self, h: u64, clock: u64) {
        if self.at.contains_key(&h) {
            self.used.insert(h, clock);
        }
    }
    fn free_slot(&self) -> Option<usize> {
        self.slots.iter().position(Option::is_none)
    }
    /// The least recently used block not in `keep`.
    fn victim(&self, keep: &[u64]) -> Option<u64> {
        self.at
            .keys()
            .filter(|h| !keep.contains(h))
            .min_by_key(|h| self.used.get(h).copied().unwrap_or(0))
            .copied()
    }
    fn put(&mut self, h: u64, slot: usize, clock: u64) {
        self.slots[slot] = Some(h);
        self.at.insert(h, slot);
        self.used.insert(h, clock);
    }
    fn remove(&mut self, h: u64) -> Option<usize> {
        let s = self.at.remove(&h)?;
        self.used.remove(&h);
        self.slots[s] = None;
        Some(s)
    }
}

#[derive(Default)]
struct Stats {
    lookups: u64,
    hit_hot: u64,
    hit_host: u64,
    hit_file: u64,
    recomputed: u64,
    hot_to_host: u64,
    host_to_hot: u64,
    host_to_file: u64,
    file_writes_skipped: u64,
    file_to_hot: u64,
    file_reload_time: Duration,
    file_reads: u64,
    file_write_time: Duration,
    verified: u64,
    distinct: u64,
}

struct Offload {
    agent: Agent,
    block: u64,
    hot_mem: Registration,
    host_mem: Registration,
    file: FileRegistration,
    hot: Tier,
    host: Tier,
    stored: Tier,
    clock: u64,
    st: Stats,
}

impl Offload {
    fn copy(
        &self,
        from: &Registration,
        fs: usize,
        to: &Registration,
        ts: usize,
    ) -> Result<(), BoxError> {
        let mut buf = vec![0u8; self.block as usize];
        from.region().read_at(fs as u64 * self.block, &mut buf)?;
        to.region().write_at(ts as u64 * self.block, &buf)?;
        Ok(())
    }

    fn verify(&mut self, mem: &Registration, slot: usize, h: u64) -> Result<(), BoxError> {
        let mut buf = vec![0u8; self.block as usize];
        mem.region().read_at(slot as u64 * self.block, &mut buf)?;
        if buf != content(h, self.block as usize) {
            return Err(format!("block {h:#x} reloaded with wrong bytes").into());
        }
        self.st.verified += 1;
        Ok(())
    }

    /// Frees `n` host slots: LRU host blocks go to the file (one scattered write for those not
    /// stored yet) and leave the host tier.
    fn make_host_room(&mut self, n: usize) -> Result<(), BoxError> {
        let free = self.host.slots.iter().filter(|s| s.is_none()).count();
        let mut victims = Vec::new();
        for _ in free..n {
            let Some(v) = self.host.victim(&victims) else {
                break;
            };
            victims.push(v);
        }
        let mut local = LocalDescList::new();
        let mut descs = Vec::new();
        for &v in &victims {
            if self.stored.get(v).is_some() {
                self.st.file_writes_skipped += 1;
                continue;
            }
            let fslot = match self.stored.free_slot() {
                Some(s) => s,
                None => {
                    let old = self.stored.victim(&[]).ok_or("file tier has no slots")?;
                    self.stored.remove(old).ok_or("file tier index broken")?
                }
            };
            let hs = self.host.get(v).ok_or("host index broken")?;
            local.push(self.host_mem.region(), hs as u64 * self.block, self.block);
            descs.push(FileDesc::new(fslot as u64 * self.block, self.block));
            self.stored.put(v, fslot, self.clock);
        }
        if !descs.is_empty() {
            let t = Instant::now();
            block_on(self.agent.write_file(&local, &self.file, &descs))?;
            self.st.file_write_time += t.elapsed();
            self.st.host_to_file += descs.len() as u64;
        }
        for v in victims {
            self.host.remove(v);
        }
        Ok(())
    }

    /// Frees `n` hot slots, moving LRU blocks not in `keep` to the host tier.
    fn make_hot_room(&mut self, n: usize, keep: &[u64]) -> Result<(), BoxError> {
        let free = self.hot.slots.iter().filter(|s| s.is_none()).count();
        let mut victims = Vec::new();
        for _ in free..n {
            let mut k = keep.to_vec();
            k.extend(&victims);
            let Some(v) = self.hot.victim(&k) else { break };
            victims.push(v);
        }
        self.make_host_room(victims.len())?;
        for v in victims {
            let hs = self.hot.remove(v).ok_or("hot index broken")?;
            let slot = self.host.free_slot().ok_or("host tier full")?;
            self.copy(&self.hot_mem, hs, &self.host_mem, slot)?;
            self.host.put(v, slot, self.clock);
            self.st.hot_to_host += 1;
        }
        Ok(())
    }

    fn request(&mut self, blocks: &[u64]) -> Result<(), BoxError> {
        self.clock += 1;
        let clock = self.clock;
        for &h in blocks {
            self.hot.touch(h, clock);
            self.host.touch(h, clock);
            self.stored.touch(h, clock);
        }
        self.st.lookups += blocks.len() as u64;
        let missing: Vec<u64> = blocks
            .iter()
            .copied()
            .filter(|&h| self.hot.get(h).is_none())
            .collect();
        self.st.hit_hot += (blocks.len() - missing.len()) as u64;
        if missing.len() > self.hot.slots.len() {
            return Err("a request needs more blocks than the hot tier holds".into());
        }
        self.make_hot_room(missing.len(), blocks)?;
        let mut local = LocalDescList::new();
        let mut descs = Vec::new();
        let mut from_file = Vec::new();
        for &h in &missing {
            let slot = self.hot.free_slot().ok_or("hot tier full")?;
            self.hot.put(h, slot, clock);
            if let Some(hs) = self.host.get(h) {
                self.copy(&self.host_mem, hs, &self.hot_mem, slot)?;
                self.host.remove(h);
                self.st.hit_host += 1;
                self.st.host_to_hot += 1;
                self.verify(&self.hot_mem.clone(), slot, h)?;
            } else if let Some(fs) = self.stored.get(h) {
                local.push(self.hot_mem.region(), slot as u64 * self.block, self.block);
                descs.push(FileDesc::new(fs as u64 * self.block, self.block));
                from_file.push((slot, h));
            } else {
                // Recompute (prefill): the block's content appears in the cache.
                self.hot_mem
                    .region()
                    .write_at(slot as u64 * self.block, &content(h, self.block as usize))?;
                self.st.recomputed += 1;
            }
        }
        if !descs.is_empty() {
            let t = Instant::now();
            block_on(self.agent.read_file(&local, &self.file, &descs))?;
            self.st.file_reload_time += t.elapsed();
            self.st.file_reads += 1;
            self.st.hit_file += descs.len() as u64;
            self.st.file_to_hot += descs.len() as u64;
            let hot = self.hot_mem.clone();
            for (slot, h) in from_file {
                self.verify(&hot, slot, h)?;
            }
        }
        Ok(())
    }
}

/// `kv_offload [flags]`.
#[derive(Debug, Parser)]
#[command(
    about = "Tiered KV offload and reload: hot KV cache -> host DRAM -> NVMe file, and back on a prefix hit"
)]
struct Opts {
    /// Directory of the file tier
    #[arg(long, default_value = "target/kv-offload")]
    dir: PathBuf,
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
    #[arg(long, default_value_t = 64)]
    hot_blocks: usize,
    /// Blocks of the host DRAM tier
    #[arg(long, default_value_t = 128)]
    host_blocks: usize,
    /// Blocks of the file tier
    #[arg(long, default_value_t = 1024)]
    file_blocks: usize,
    /// Tokens per block
    #[arg(long, default_value_t = 16)]
    block_tokens: u64,
    /// KV bytes per token (block bytes = tokens x this, a multiple of 4096)
    #[arg(long, default_value_t = 16384)]
    kv_bytes_per_token: u64,
    /// Prefill rate of the recompute model, tokens per second
    #[arg(long, default_value_t = 20_000)]
    prefill_tokens_per_s: u64,
}

fn main() -> Result<(), BoxError> {
    let o = Opts::parse();
    let (requests, prefixes, prefix_blocks, suffix_blocks) =
        (o.requests, o.prefixes, o.prefix_blocks, o.suffix_blocks);
    let (hot_blocks, host_blocks, file_blocks) = (o.hot_blocks, o.host_blocks, o.file_blocks);
    let (block_tokens, per_token) = (o.block_tokens, o.kv_bytes_per_token);
    let prefill_rate = o.prefill_tokens_per_s as f64;
    let dir = o.dir;
    let block = block_tokens * per_token;
    if !block.is_multiple_of(4096) {
        return Err("block bytes (tokens x bytes per token) must be a multiple of 4096".into());
    }
    std::fs::create_dir_all(&dir)?;

    let mut cfg =
        AgentConfig::default().with_cluster_key(rixl::agent::ClusterKey::env_or_process_local()?);
    cfg.engine.require_nic = false;
    cfg.io_memory = 8 << 20;
    let agent = Agent::new("kv-offload", cfg)?;
    let hot_mem = block_on(agent.register(hot_blocks * block as usize, Visibility::All))?;
    let host_mem = block_on(agent.register(host_blocks * block as usize, Visibility::All))?;
    let path = dir.join("kv-tier.bin");
    let file = block_on(agent.register_file(FileSpec::new(
        &path,
        file_blocks as u64 * block,
        FileMode::Create,
    )))?;
    let gpu = rixl::gpudirect::probe();
    println!(
        "kv_offload: {requests} requests; {prefixes} shared prefixes x {prefix_blocks} blocks + {suffix_blocks} unique blocks each; block {} KiB ({block_tokens} tokens x {per_token} B)",
        block >> 10
    );
    println!(
        "tiers: hot {hot_blocks} blocks ({}), host DRAM {host_blocks} blocks, file {} {file_blocks} blocks (O_DIRECT: {}); NIC: {}",
        match &gpu {
            Ok(_) => "DRAM; a GPU is present but the VRAM tier needs the GPU backend",
            Err(_) => "DRAM: no GPU here",
        },
        path.display(),
        if file.direct() { "yes" } else { "no (tmpfs)" },
        if agent.has_nic() { "yes" } else { "none (local tiers only)" },
    );
    let mut o = Offload {
        agent: agent.clone(),
        block,
        hot_mem,
        host_mem,
        file,
        hot: Tier::new(hot_blocks),
        host: Tier::new(host_blocks),
        stored: Tier::new(file_blocks),
        clock: 0,
        st: Stats::default(),
    };
    let mut seen = std::collections::HashSet::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let t0 = Instant::now();
    for r in 0..requests {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Skewed popularity: prefix p with probability ~ 1/(p+1).
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        let p = ((prefixes as f64 + 1.0).powf(u) - 1.0).floor() as u64 % prefixes;
        let mut h = 0u64;
        let mut blocks = Vec::new();
        for i in 0..prefix_blocks {
            h = chain(h, &[p, i]);
            blocks.push(h);
        }
        for i in 0..suffix_blocks {
            h = chain(h, &[u64::MAX - r, i]);
            blocks.push(h);
        }
        seen.extend(blocks.iter().copied());
        o.request(&blocks)?;
    }
    let wall = t0.elapsed();
    o.st.distinct = seen.len() as u64;
    let st = &o.st;
    let mib = |n: u64| (n * block) as f64 / (1u64 << 20) as f64;
    let pct = |n: u64| 100.0 * n as f64 / st.lookups.max(1) as f64;
    println!(
        "block lookups {}: hot {} ({:.1}%), host {} ({:.1}%), file {} ({:.1}%), recomputed {} ({:.1}%); prefix hit rate {:.1}%",
        st.lookups,
        st.hit_hot,
        pct(st.hit_hot),
        st.hit_host,
        pct(st.hit_host),
        st.hit_file,
        pct(st.hit_file),
        st.recomputed,
        pct(st.recomputed),
        100.0 - pct(st.recomputed)
    );
    println!(
        "moved: hot->host {:.0} MiB, host->hot {:.0} MiB, host->file {:.0} MiB ({} blocks in {:.3} s; {} writes skipped, already stored), file->hot {:.0} MiB",
        mib(st.hot_to_host),
        mib(st.host_to_hot),
        mib(st.host_to_file),
        st.host_to_file,
        st.file_write_time.as_secs_f64(),
        st.file_writes_skipped,
        mib(st.file_to_hot)
    );
    let reload = st.file_reload_time.as_secs_f64();
    let recompute = (st.file_to_hot * block_tokens) as f64 / prefill_rate;
    println!(
        "file reload: {} blocks in {} scattered reads, {:.3} s ({:.0} MiB/s); recompute model ({block_tokens} tokens/block at {prefill_rate:.0} tokens/s): {:.3} s -> reload {:.1}x faster",
        st.file_to_hot,
        st.file_reads,
        reload,
        mib(st.file_to_hot) / reload.max(1e-9),
        recompute,
        recompute / reload.max(1e-9)
    );
    println!(
        "distinct blocks {} (equal prefixes are one block, stored once per tier; {} recomputed after leaving every tier); verified {} reloaded blocks ({:.0} MiB) byte for byte; wall {:.2} s",
        st.distinct,
        st.recomputed - st.distinct,
        st.verified,
        mib(st.verified),
        wall.as_secs_f64()
    );
    if st.verified != st.hit_host + st.hit_file {
        return Err("not every reloaded block was verified".into());
    }
    drop(o);
    agent.shutdown();
    let _ = std::fs::remove_file(&path);
    Ok(())
}
