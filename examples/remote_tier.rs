//! Reaching another node's FILE tier with the agent API only (no new protocol): the reader asks
//! the storage agent, by notification, to load blocks from its file into registered staging DRAM;
//! the storage agent answers with the staging slots; the reader RDMA-READs them and verifies
//! every byte.
//!
//! Two agents in one process here (storage on the last CPU, reader on CPU 0), connected through
//! the side channel and the RDMA device exactly as two nodes would be.
//!
//! ```text
//! remote_tier [--dir DIR] [--blocks 256] [--block-size 65536] [--requests 20] [--per-request 8]
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_lite::future::block_on;
use futures_lite::StreamExt;
use rixl::agent::{Agent, AgentConfig, RemoteRef, Visibility};
use rixl::runtime::{FileDesc, FileMode, FileSpec, LocalDescList};

use clap::Parser;

type BoxError = Box<dyn std::error::Error>;

fn content(block: u64, i: u64) -> u8 {
    (block.wrapping_mul(0x9e37) ^ i.wrapping_mul(13)) as u8
}

fn parse_nums(s: &str) -> Result<Vec<u64>, BoxError> {
    s.split(' ')
        .filter(|w| !w.is_empty())
        .map(|w| w.parse::<u64>().map_err(Into::into))
        .collect()
}

/// `remote_tier [flags]`.
#[derive(Debug, Parser)]
#[command(
    about = "Reach another agent's FILE tier with the agent API only (two agents in one process)"
)]
struct Opts {
    /// Directory of the storage agent's file [default: the temporary directory]
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Blocks in the file
    #[arg(long, default_value_t = 256)]
    blocks: u64,
    /// Block size in bytes
    #[arg(long, default_value_t = 65536)]
    block_size: u64,
    /// Requests
    #[arg(long, default_value_t = 20)]
    requests: u64,
    /// Blocks per request
    #[arg(long, default_value_t = 8)]
    per_request: u64,
}

fn main() -> Result<(), BoxError> {
    let o = Opts::parse();
    let (blocks, bs, requests, per) = (o.blocks, o.block_size, o.requests, o.per_request);
    let dir = o.dir.unwrap_or_else(std::env::temp_dir);
    let cpus = rixl::runtime::available_cpus();

    // --- storage node: a file tier, staging DRAM visible only to the reader.
    let mut cfg =
        AgentConfig::default().with_cluster_key(rixl::agent::ClusterKey::env_or_process_local()?);
    cfg.cpu = cpus.last().copied().unwrap_or(0);
    let storage = Agent::new("storage", cfg)?;
    let path = dir.join(format!("remote-tier-{}.bin", std::process::id()));
    let file =
        block_on(storage.register_file(FileSpec::new(&path, blocks * bs, FileMode::Create)))?;
    let fill = block_on(storage.register((blocks * bs) as usize, Visibility::Only(vec![])))?;
    let data: Vec<u8> = (0..blocks * bs).map(|i| content(i / bs, i % bs)).collect();
    fill.region().write_at(0, &data)?;
    let mut all = LocalDescList::new();
    all.push(fill.region(), 0, blocks * bs);
    block_on(storage.write_file(&all, &file, &[FileDesc::new(0, blocks * bs)]))?;
    drop(fill);
    let staging =
        block_on(storage.register((per * bs) as usize, Visibility::Only(vec!["reader".into()])))?;
    let addr = storage.listen("127.0.0.1:0")?;
    let mut storage_inbox = storage.notifications().ok_or("notifications taken")?;
    let (s2, staging_id) = (storage.clone(), staging.id());
    let server = std::thread::spawn(move || -> Result<u64, String> {
        let mut served = 0;
        while let Some((peer, msg)) = block_on(storage_inbox.next()) {
            let msg = String::from_utf8_lossy(&msg).to_string();
            let Some(list) = msg.strip_prefix("LOAD ") else {
                if msg == "BYE" {
                    return Ok(served);
                }
                continue;
            };
            let ids = parse_nums(list).map_err(|e| e.to_string())?;
            // Stage block k of the request in staging slot k (one scattered FILE read).
            let mut local = LocalDescList::new();
            let mut descs = Vec::new();
            for (k, &b) in ids.iter().enumerate() {
                local.push(staging.region(), k as u64 * bs, bs);
                descs.push(FileDesc::new(b * bs, bs));
            }
            let reply = match block_on(s2.read_file(&local, &file, &descs)) {
                Ok(_) => format!(
                    "READY {}",
                    (0..ids.len())
                        .map(|k| k.to_string())
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
                Err(e) => format!("ERROR {e}"),
            };
            block_on(s2.notify(&peer, reply.as_bytes())).map_err(|e| e.to_string())?;
            served += 1;
        }
        Err("storage inbox closed".into())
    });

    // --- reader node.
    let mut cfg =
        AgentConfig::default().with_cluster_key(rixl::agent::ClusterKey::env_or_process_local()?);
    cfg.cpu = rixl::runtime::cpu_at(0);
    let reader = Agent::new("reader", cfg)?;
    // One thread forwards the reader's notifications, so each wait can have a deadline.
    let mut notifications = reader.notifications().ok_or("notifications taken")?;
    let (inbox_tx, inbox) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        while let Some(n) = block_on(notifications.next()) {
            if inbox_tx.send(n).is_err() {
                return;
            }
        }
    });
    let peer = reader.fetch_remote_metadata(&addr.to_string())?;
    let dst = block_on(reader.register((per * bs) as usize, Visibility::Only(vec![])))?;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut times = Vec::new();
    let mut verified = 0u64;
    for _ in 0..requests {
        let ids: Vec<u64> = (0..per)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % blocks
            })
            .collect();
        let t = Instant::now();
        let msg = format!(
            "LOAD {}",
            ids.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
        );
        block_on(reader.notify(&peer, msg.as_bytes()))?;
        let (_, reply) = inbox
            .recv_timeout(Duration::from_secs(30))
            .map_err(|_| "no answer from the storage agent within 30 s")?;
        let reply = String::from_utf8_lossy(&reply).to_string();
        let slots = parse_nums(
            reply
                .strip_prefix("READY ")
                .ok_or(format!("storage: {reply}"))?,
        )?;
        let mut local = LocalDescList::new();
        let mut remote = Vec::new();
        for (k, &slot) in slots.iter().enumerate() {
            local.push(dst.region(), k as u64 * bs, bs);
            remote.push(RemoteRef {
                region: staging_id,
                offset: slot * bs,
                len: bs,
            });
        }
        block_on(reader.read(&peer, &local, &remote))?;
        times.push(t.elapsed());
        for (k, &b) in ids.iter().enumerate() {
            let mut got = vec![0u8; bs as usize];
            dst.region().read_at(k as u64 * bs, &mut got)?;
            if (0..bs).any(|i| got[i as usize] != content(b, i)) {
                return Err(format!("block {b} arrived with wrong bytes").into());
            }
            verified += 1;
        }
    }
    block_on(reader.notify(&peer, b"BYE"))?;
    let served = server.join().map_err(|_| "server panicked")??;
    times.sort();
    let avg = times.iter().sum::<Duration>() / times.len().max(1) as u32;
    println!(
        "remote_tier: {requests} requests x {per} blocks of {} KiB from the storage agent's file (served {served}); verified {verified} blocks; per request (notify + file->staging + RDMA READ + reply): avg {:.2} ms, max {:.2} ms",
        bs >> 10,
        avg.as_secs_f64() * 1e3,
        times.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );
    reader.shutdown();
    storage.shutdown();
    let _ = std::fs::remove_file(&path);
    Ok(())
}
