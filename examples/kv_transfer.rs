//! Prefill → decode KV-block handoff with the agent API.
//!
//! The prefill agent registers a KV cache (layers x {K,V} x blocks x block size, default
//! 32 x 2 x 256 x 16 KiB) and serves its metadata on a side channel. The decode agent fetches the
//! metadata, prepares the remote descriptor list once (every block of every layer), and for each
//! request reads that request's scattered block ids with ONE index-based transfer, verifies every
//! block's checksum, and notifies prefill, which frees the blocks.
//!
//! ```text
//! kv_transfer prefill --listen 0.0.0.0:7000 [--requests 4] [--layers 32] [--blocks 256] [--block-size 16384]
//! kv_transfer decode  --prefill HOST:7000   [--requests 4] [--per-request 64] (same shape flags)
//! ```

use std::time::Instant;

use futures_lite::future::block_on;
use futures_lite::StreamExt;
use rixl::agent::{Agent, AgentConfig, PreparedLocal, RemoteRef, Visibility};
use rixl::runtime::Op;

use clap::Parser;

type BoxError = Box<dyn std::error::Error>;

struct Shape {
    layers: u64,
    blocks: u64,
    block: u64,
}

impl Shape {
    fn bytes(&self) -> u64 {
        self.layers * 2 * self.blocks * self.block
    }
    /// Offset of (layer, k-or-v, block) in the cache.
    fn offset(&self, layer: u64, kv: u64, block: u64) -> u64 {
        ((layer * 2 + kv) * self.blocks + block) * self.block
    }
    /// Index of (layer, kv, block) in the prepared lists.
    fn index(&self, layer: u64, kv: u64, block: u64) -> usize {
        ((layer * 2 + kv) * self.blocks + block) as usize
    }
}

/// Content of one KV block: a function of its position, so decode can verify what it got.
fn block_byte(offset: u64, i: u64) -> u8 {
    ((offset / 4096).wrapping_mul(31) ^ i.wrapping_mul(7)) as u8
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// `kv_transfer prefill|decode [flags]`.
#[derive(Debug, Parser)]
#[command(about = "Prefill -> decode KV-block handoff with the agent API")]
enum Cli {
    /// Register and fill the KV cache, serve its metadata, free blocks as decode reports them
    Prefill {
        /// Side-channel address to listen on
        #[arg(long, default_value = "127.0.0.1:7000")]
        listen: String,
        #[command(flatten)]
        common: Common,
    },
    /// Read each request's scattered blocks from prefill, verify them, notify prefill
    Decode {
        /// Prefill's side-channel address
        #[arg(long, default_value = "127.0.0.1:7000")]
        prefill: String,
        /// Blocks per request
        #[arg(long, default_value_t = 64)]
        per_request: u64,
        /// Prefill's KV-cache region id
        #[arg(long, default_value_t = 1)]
        region: u64,
        #[command(flatten)]
        common: Common,
    },
}

/// The flags both sides take (the same values on both).
#[derive(Debug, clap::Args)]
struct Common {
    /// Requests
    #[arg(long, default_value_t = 4)]
    requests: u64,
    /// Layers of the KV cache
    #[arg(long, default_value_t = 32)]
    layers: u64,
    /// Blocks per layer and K/V
    #[arg(long, default_value_t = 256)]
    blocks: u64,
    /// Block size in bytes
    #[arg(long, default_value_t = 16384)]
    block_size: u64,
}

impl Common {
    fn shape(&self) -> Shape {
        Shape {
            layers: self.layers,
            blocks: self.blocks,
            block: self.block_size,
        }
    }
}

fn prefill(listen: &str, requests: u64, shape: &Shape) -> Result<(), BoxError> {
    let agent = Agent::new("prefill", AgentConfig::default())?;
    let kv = block_on(agent.register(shape.bytes() as usize, Visibility::All))?;
    let mut buf = vec![0u8; shape.block as usize];
    for off in (0..shape.bytes()).step_by(shape.block as usize) {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = block_byte(off, i as u64);
        }
        kv.region().write_at(off, &buf)?;
    }
    let addr = agent.listen(listen)?;
    println!("prefill: KV cache {} layers x 2 x {} blocks x {} B = {} MiB registered (region {}), side channel {addr}",
        shape.layers, shape.blocks, shape.block, shape.bytes() >> 20, kv.id());
    let mut used = vec![true; shape.blocks as usize];
    let mut notifs = agent.notifications().ok_or("notification stream taken")?;
    for _ in 0..requests {
        let (peer, msg) = block_on(notifs.next()).ok_or("notification stream ended")?;
        let text = String::from_utf8(msg)?;
        // "done <request> <block ids...>": the decode side has the blocks; free them here.
        let ids: Vec<usize> = text
            .split(' ')
            .skip(2)
            .filter_map(|v| v.parse().ok())
            .collect();
        for &b in &ids {
            used[b] = false;
        }
        println!(
            "prefill: {peer} finished {}: freed {} blocks ({} still in use)",
            text.split(' ').nth(1).unwrap_or("?"),
            ids.len(),
            used.iter().filter(|u| **u).count()
        );
    }
    agent.shutdown();
    Ok(())
}

fn decode(
    prefill_addr: &str,
    per_request: u64,
    region: u64,
    requests: u64,
    shape: &Shape,
) -> Result<(), BoxError> {
    let agent = Agent::new("decode", AgentConfig::default())?;
    // The prefill side may still be filling its cache: retry the side channel for a while.
    let t0 = Instant::now();
    let peer = loop {
        match agent.fetch_remote_metadata(prefill_addr) {
            Ok(p) => break p,
            Err(e) if t0.elapsed().as_secs() < 60 => {
                let _ = e;
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            Err(e) => return Err(e.into()),
        }
    };
    let kv = block_on(agent.register(shape.bytes() as usize, Visibility::All))?;
    // Prepare every (layer, kv, block) once, on both sides.
    let t = Instant::now();
    let mut local = PreparedLocal::default();
    let mut refs = Vec::with_capacity((shape.layers * 2 * shape.blocks) as usize);
    for layer in 0..shape.layers {
        for k in 0..2 {
            for b in 0..shape.blocks {
                let off = shape.offset(layer, k, b);
                local.push(&kv, off, shape.block);
                refs.push(RemoteRef {
                    region,
                    offset: off,
                    len: shape.block,
                });
            }
        }
    }
    let remote = agent.prepare_remote(&peer, &refs)?;
    println!(
        "decode: prepared {} descriptors per side in {:?}",
        remote.len(),
        t.elapsed()
    );
    let mut buf = vec![0u8; shape.block as usize];
    let mut expect = vec![0u8; shape.block as usize];
    for req in 0..requests {
        // A request's scattered block ids.
        let ids: Vec<u64> = (0..per_request)
            .map(|i| (req * 101 + i * 37 + 11) % shape.blocks)
            .collect();
        let mut idx = Vec::with_capacity((shape.layers * 2) as usize * ids.len());
        for l in 0..shape.layers {
            for k in 0..2 {
                idx.extend(ids.iter().map(|&b| shape.index(l, k, b)));
            }
        }
        let t = Instant::now();
        let st = block_on(agent.transfer_indices(Op::Read, &local, &idx, &remote, &idx, None))?;
        let took = t.elapsed();
        // Verify every block's checksum.
        for &i in &idx {
            let off = i as u64 * shape.block;
            kv.region().read_at(off, &mut buf)?;
            for (k, e) in expect.iter_mut().enumerate() {
                *e = block_byte(off, k as u64);
            }
            if fnv(&buf) != fnv(&expect) {
                return Err(format!("request {req}: block at {off} has the wrong checksum").into());
            }
        }
        let note = format!(
            "done {req} {}",
            ids.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
        );
        block_on(agent.notify(&peer, note.as_bytes()))?;
        println!(
            "decode: request {req}: {} descriptors ({} blocks x {} layers x 2), {} bytes in {took:?} ({:.1} MiB/s, {} work requests), checksums verified, prefill notified",
            idx.len(), ids.len(), shape.layers, st.bytes, st.bytes as f64 / took.as_secs_f64() / (1 << 20) as f64, st.work_requests
        );
    }
    agent.shutdown();
    Ok(())
}

fn main() -> Result<(), BoxError> {
    match Cli::parse() {
        Cli::Prefill { listen, common } => prefill(&listen, common.requests, &common.shape()),
        Cli::Decode {
            prefill,
            per_request,
            region,
            common,
        } => decode(
            &prefill,
            per_request,
            region,
            common.requests,
            &common.shape(),
        ),
    }
}
