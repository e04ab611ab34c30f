//! A serving engine's paged KV cache, allocated by the engine and registered once.
//!
//! Each engine allocates its KV cache itself: ONE anonymous memory map, cut per layer into
//! blocks (layers x blocks x block size). It registers the whole map once, then each layer as a
//! region of its own (vLLM registers one region per layer): the layers reuse the map's memory
//! region through the registration cache, so the pages are pinned once.
//!
//! Per request, prefill "computes" the request's blocks (fills them with a pattern of request,
//! layer and block) and notifies decode with the block ids; decode pulls them into free blocks
//! of its own cache with ONE index-selection READ over prepared lists (every block of every
//! layer, prepared once), verifies every byte, and notifies prefill, which frees the blocks
//! when notified.
//!
//! ```text
//! engine_kv [--requests 8] [--layers 8] [--blocks 256] [--block-size 16384] [--per-request 32]
//! ```
//! Exits non-zero if any byte differs.

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use futures_lite::future::block_on;
use futures_lite::StreamExt;
use rixl::agent::{
    Agent, AgentConfig, CallOptions, PreparedLocal, Registration, RemoteRef, Visibility,
};
use rixl::runtime::Op;
use rixl::verbs::memmap2::MmapMut;
use rixl::verbs::HostBuffer;

type BoxError = Box<dyn std::error::Error>;

#[derive(Debug, Parser)]
#[command(about = "A serving engine's own paged KV cache, registered once; prefill -> decode")]
struct Args {
    /// Requests to hand off.
    #[arg(long, default_value_t = 8)]
    requests: u64,
    /// Layers in the cache.
    #[arg(long, default_value_t = 8)]
    layers: u64,
    /// Blocks per layer.
    #[arg(long, default_value_t = 256)]
    blocks: u64,
    /// Block size in bytes.
    #[arg(long, default_value_t = 16384)]
    block_size: u64,
    /// Blocks per request (in every layer).
    #[arg(long, default_value_t = 32)]
    per_request: u64,
}

/// One engine's KV cache: the map (owned by a `HostBuffer`), its registration, and one
/// registration per layer.
struct KvCache {
    mem: Arc<HostBuffer>,
    _whole: Registration,
    layers: Vec<Registration>,
    free: Vec<u64>,
}

impl KvCache {
    async fn allocate(agent: &Agent, a: &Args) -> Result<KvCache, BoxError> {
        let layer_bytes = (a.blocks * a.block_size) as usize;
        // The engine's own allocation.
        let map = MmapMut::map_anon(layer_bytes * a.layers as usize)?;
        let mem = Arc::new(HostBuffer::from_mmap(map)?);
        let whole = agent
            .register_host(HostBuffer::slice_of(&mem, 0, mem.len())?, Visibility::All)
            .await?;
        let mut layers = Vec::new();
        for l in 0..a.layers as usize {
            let view = HostBuffer::slice_of(&mem, l * layer_bytes, layer_bytes)?;
            layers.push(agent.register_host(view, Visibility::All).await?);
        }
        Ok(KvCache {
            mem,
            _whole: whole,
            layers,
            free: (0..a.blocks).rev().collect(),
        })
    }

    fn take(&mut self, n: u64) -> Result<Vec<u64>, BoxError> {
        (0..n)
            .map(|_| self.free.pop().ok_or_else(|| "KV cache full".into()))
            .collect()
    }

    /// Every block of every layer, in (layer, block) order.
    fn prepared(&self, a: &Args) -> PreparedLocal {
        let mut p = PreparedLocal::default();
        for layer in &self.layers {
            for b in 0..a.blocks {
                p.push(layer, b * a.block_size, a.block_size);
            }
        }
        p
    }
}

/// Byte `i` of block `block` of `layer` for request `req`.
fn pattern(req: u64, layer: u64, block: u64, i: u64) -> u8 {
    (req.wrapping_mul(131) ^ layer.wrapping_mul(31) ^ block.wrapping_mul(7) ^ i) as u8
}

fn parse_ids(s: &str) -> Vec<u64> {
    s.split(',').filter_map(|x| x.parse().ok()).collect()
}

fn main() -> Result<(), BoxError> {
    let a = Args::parse();
    let mut pc =
        AgentConfig::default().with_cluster_key(rixl::agent::ClusterKey::env_or_process_local()?);
    pc.cpu = rixl::runtime::cpu_at(0);
    let mut dc =
        AgentConfig::default().with_cluster_key(rixl::agent::ClusterKey::env_or_process_local()?);
    dc.cpu = rixl::runtime::cpu_at(1);
    let prefill = Agent::new("prefill", pc)?;
    let decode = Agent::new("decode", dc)?;
    prefill.listen("127.0.0.1:0")?;
    decode.listen("127.0.0.1:0")?;
    let mut pkv = block_on(KvCache::allocate(&prefill, &a))?;
    let mut dkv = block_on(KvCache::allocate(&decode, &a))?;
    let counters = prefill.registration_counters();
    println!(
        "each engine: one {} MiB map, {} layer registrations; memory regions made {}, reused {} (prefill)",
        pkv.mem.len() >> 20,
        pkv.layers.len(),
        counters.made,
        counters.reused
    );
    decode.load_remote_metadata(&prefill.local_metadata("decode")?)?;
    prefill.load_remote_metadata(&decode.local_metadata("prefill")?)?;
    block_on(decode.connect("prefill"))?;
    // Decode prepares both lists once: its own blocks and prefill's, layer by layer.
    let local = dkv.prepared(&a);
    let remote: Vec<RemoteRef> = pkv
        .layers
        .iter()
        .flat_map(|l| {
            (0..a.blocks).map(move |b| RemoteRef {
                region: l.id(),
                offset: b * a.block_size,
                len: a.block_size,
            })
        })
        .collect();
    let remote = decode.prepare_remote("prefill", &remote)?;
    let mut to_decode = decode.notifications().ok_or("decode notifications")?;
    let mut to_prefill = prefill.notifications().ok_or("prefill notifications")?;
    let t0 = Instant::now();
    let (mut bytes, mut checked) = (0u64, 0u64);
    for req in 0..a.requests {
        // Prefill: compute the request's blocks, tell decode where they are.
        let blocks = pkv.take(a.per_request)?;
        for (l, layer) in pkv.layers.iter().enumerate() {
            for &b in &blocks {
                let data: Vec<u8> = (0..a.block_size)
                    .map(|i| pattern(req, l as u64, b, i))
                    .collect();
                layer.region().write_at(b * a.block_size, &data)?;
            }
        }
        let ids: Vec<String> = blocks.iter().map(u64::to_string).collect();
        block_on(prefill.notify("decode", format!("{req} {}", ids.join(",")).as_bytes()))?;
        // Decode: one READ of every layer's blocks into free blocks of its own.
        let (_, msg) = block_on(to_decode.next()).ok_or("decode: stream ended")?;
        let msg = String::from_utf8(msg)?;
        let (r, ids) = msg.split_once(' ').ok_or("bad notification")?;
        let (r, theirs) = (r.parse::<u64>()?, parse_ids(ids));
        let mine = dkv.take(theirs.len() as u64)?;
        let index = |blocks: &[u64]| -> Vec<usize> {
            (0..a.layers)
                .flat_map(|l| blocks.iter().map(move |&b| (l * a.blocks + b) as usize))
                .collect()
        };
        let opts = CallOptions::new().notification(format!("done {r}").into_bytes());
        let st = block_on(decode.transfer_indices_with(
            Op::Read,
            &local,
            &index(&mine),
            &remote,
            &index(&theirs),
            opts,
        ))?;
        bytes += st.bytes;
        for (l, layer) in dkv.layers.iter().enumerate() {
            for (&m, &t) in mine.iter().zip(&theirs) {
                let mut got = vec![0u8; a.block_size as usize];
                layer.region().read_at(m * a.block_size, &mut got)?;
                if let Some(i) =
                    (0..a.block_size).find(|&i| got[i as usize] != pattern(r, l as u64, t, i))
                {
                    return Err(
                        format!("request {r}, layer {l}, block {t}: byte {i} differs").into(),
                    );
                }
                checked += a.block_size;
            }
        }
        dkv.free.extend(mine); // decode is done with them (its model step would use them)
                               // Prefill frees its blocks when notified.
        let (_, done) = block_on(to_prefill.next()).ok_or("prefill: stream ended")?;
        if done != format!("done {r}").into_bytes() {
            return Err(format!("prefill: unexpected notification {done:?}").into());
        }
        pkv.free.extend(blocks);
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{} requests x {} layers x {} blocks of {} KiB: {} MiB pulled in {secs:.3} s ({:.1} MiB/s); every byte verified ({} MiB)",
        a.requests,
        a.layers,
        a.per_request,
        a.block_size >> 10,
        bytes >> 20,
        bytes as f64 / secs / (1 << 20) as f64,
        checked >> 20
    );
    if pkv.free.len() as u64 != a.blocks || dkv.free.len() as u64 != a.blocks {
        return Err("blocks were not all freed".into());
    }
    decode.shutdown();
    prefill.shutdown();
    Ok(())
}
